"""Fitting the CPU speed model to measured engine runs (calibration only).

The CPU model is ``seconds per micro-step = overhead + FLOPs / (cores x rate)`` (see
``autotune.estimate.speed_model``). Two unknowns, so a least-squares line through measured
(FLOPs per core, seconds) points: tiny models pin the overhead, full-size steps the rate.
``bench/learned_plan.py --calibrate-cpu`` measures the points and prints the fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuPoint:
    """One measured run: FLOPs of one micro-step, its measured seconds, the physical cores it ran on."""

    flops_per_micro_step: float
    seconds_per_micro_step: float
    cores: int


@dataclass(frozen=True)
class CpuFit:
    overhead_s: float  # CPU_MICRO_STEP_OVERHEAD_S
    gflops_per_core: float  # CPU_GFLOPS_PER_CORE


def fit_cpu_speed(points: Sequence[CpuPoint]) -> CpuFit:
    """Least squares of ``seconds = overhead + (flops / cores) / rate`` over ``points`` (two or more, with
    different FLOPs); the overhead is clamped at 0 (noise can pull it below with only big steps)."""
    import numpy as np

    if len(points) < 2:
        raise ValueError("fit_cpu_speed needs two or more measured points")
    x = np.array([p.flops_per_micro_step / max(1, p.cores) for p in points], dtype=float)
    y = np.array([p.seconds_per_micro_step for p in points], dtype=float)
    if np.ptp(x) == 0:
        raise ValueError("fit_cpu_speed needs points with different FLOPs per micro-step")
    slope, intercept = np.polyfit(x, y, 1)
    if intercept < 0:  # through the origin instead
        intercept, slope = 0.0, float(np.dot(x, y) / np.dot(x, x))
    return CpuFit(overhead_s=float(intercept), gflops_per_core=float(1.0 / slope / 1e9) if slope > 0 else 0.0)
