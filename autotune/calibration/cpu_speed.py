"""Fitting the CPU speed model to measured engine runs (calibration only).

The CPU model is ``seconds per micro-step = overhead + weight bytes / weight rate + FLOPs / (cores x FLOP rate) +
activation bytes / activation rate`` (see ``autotune.estimate.speed_model``): four non-negative unknowns per
precision, fitted by least squares on the relative error over measured points (tiny models pin the overhead and
the activation term, full-size steps the weight traffic and the FLOP rate). ``bench/learned_plan.py
--calibrate-cpu`` measures the points and prints the fit. Non-negative least squares by hand (every subset of
the four terms, the best one whose coefficients are all non-negative): numpy has none, and scipy is not a
dependency for four unknowns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sd_scripts_compat.facts.settings import TrainSettings


@dataclass(frozen=True)
class CpuPoint:
    """One measured micro-step: its FLOPs, frozen weight bytes (compute dtype), activation bytes, the physical
    cores it ran on and its measured seconds."""

    flops_per_micro_step: float
    weight_bytes: float
    activation_bytes: float
    cores: int
    seconds_per_micro_step: float


def fit_cpu_speed(points: Sequence[CpuPoint], gflops_per_core: float | None = None) -> tuple[float, float, float,
                                                                                           float]:
    """``(overhead_s, weight_gbs, gflops_per_core, activation_gbs)`` of the best non-negative fit; a term the
    points do not need is 0 (its rate ``inf``). ``gflops_per_core`` fixes the FLOP rate (bf16, whose FLOP and
    activation terms the points cannot tell apart: fp32's rate times the measured gain). ValueError with fewer
    than four points."""
    import numpy as np

    if len(points) < 4:
        raise ValueError("fit_cpu_speed needs four or more measured points")
    design = np.array([[1.0, p.weight_bytes, p.flops_per_micro_step / max(1, p.cores), p.activation_bytes]
                       for p in points])
    measured = np.array([p.seconds_per_micro_step for p in points])
    seconds = measured.copy()
    weights = 1.0 / measured  # relative error: a tiny step counts as much as a full-size one
    if gflops_per_core is not None:
        seconds = measured - design[:, 2] / (gflops_per_core * 1e9)
        design[:, 2] = 0.0
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, 5):
        for columns in itertools.combinations(range(4), size):
            found, *_ = np.linalg.lstsq(design[:, columns] * weights[:, None], seconds * weights, rcond=None)
            if (found < 0).any():
                continue
            coefficients = np.zeros(4)
            coefficients[list(columns)] = found
            residual = float(np.sum(((design @ coefficients - seconds) * weights) ** 2))
            if best is None or residual < best[0]:
                best = (residual, coefficients)
    assert best is not None  # the overhead alone is always a non-negative fit
    overhead, per_weight_byte, per_flop, per_activation_byte = best[1]

    def rate(per_unit: float) -> float:
        return float(1.0 / per_unit / 1e9) if per_unit > 0 else float("inf")

    flop_rate = gflops_per_core if gflops_per_core is not None else rate(per_flop)
    return float(overhead), rate(per_weight_byte), flop_rate, rate(per_activation_byte)


def cpu_point(family: str, settings: TrainSettings, seconds_per_micro_step: float, cores: int) -> tuple[str, CpuPoint]:
    """A bench point's precision ("fp32" / "bf16") and its features, as the speed model counts them."""
    from autotune.estimate.memory_model import inputs_for_settings
    from autotune.estimate.speed_model import compute_precision, cpu_traffic_bytes, step_flops
    from sd_scripts_compat.facts.families import get_family

    inputs = inputs_for_settings(get_family(family), settings)
    precision = "bf16" if compute_precision(inputs) == "bf16" else "fp32"
    flops = step_flops(inputs).total
    weights, activations = cpu_traffic_bytes(inputs, flops)
    return precision, CpuPoint(flops, weights, activations, cores, seconds_per_micro_step)
