"""What the planner learns from the store: a measured speed for a candidate, and the settings that ran out
of memory on this device.

- **Exact**: a finished run with the candidate's key (device, family, :data:`~autotune.measure.store.KEY_FIELDS`)
  gives its micro-steps/s as measured (source ``"measured"``); on a GPU also its peak reserved memory.
- **Scaled**: otherwise the nearest finished run of the same device and family (fewest differing fields, then
  the closest batch, resolution and rank) is scaled by the speed model's ratio between the two settings
  (source ``"measured-scaled"``): the model's error on this machine mostly cancels in the ratio.
- **Model** otherwise (source ``"model"``).
- **Memory** the same way: a finished run of the candidate's key gives its measured peak (CUDA max reserved on a
  GPU, peak resident memory on a CPU: the figure the plan is checked against); otherwise the memory model's
  prediction is multiplied by measured / predicted of the nearest finished run of the same device and family. The
  factor lowers a prediction only when that run's settings were at least as heavy as the candidate's: a lighter
  run that needed less than predicted says nothing about a heavier one.
- **Compiled** (``torch_compile``): a compiled record answers only a compiled candidate, exactly or scaled from
  another compiled one, never an eager one; :meth:`LearnedFigures.compiled` gives the planner the compiled run of
  its chosen settings (planning.compile_choice weighs it against the compile time).
- **OOM**: a candidate at least as heavy as one that ran out of memory here (same categorical settings; batch,
  resolution and rank no smaller; checkpointing not added; no smaller memory to fit in) is not proposed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.measure.store import Measurement, settings_key
from sd_scripts_compat.facts.contract import Outcome
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings

# fields compared by equality when judging "at least as heavy" (the rest are ordered: batch, size, rank, gc)
_CATEGORICAL = ("optimizer_type", "network_train_unet_only", "mixed_precision", "fp8_base", "cache_latents",
                "cache_text_encoder_outputs", "xformers", "blocks_to_swap", "torch_compile")


def short_settings(s: TrainSettings) -> str:
    """One compact line: micro-batch x accumulation, size, rank, optimizer, precision, checkpointing."""
    parts = [f"{s.train_batch_size}x{s.gradient_accumulation_steps}", f"{s.resolution[0]} px", f"rank {s.network_dim}",
             s.optimizer_type, {"no": "fp32"}.get(s.mixed_precision, s.mixed_precision)]
    if s.gradient_checkpointing:
        parts.append("checkpointing")
    if s.fp8_base:
        parts.append("fp8 base")
    if s.torch_compile:
        parts.append(f"compiled ({s.dynamo_backend})")
    return ", ".join(parts)


@dataclass(frozen=True)
class Learned:
    """A candidate's measured figures (any may be None) and where they came from."""

    micro_steps_per_s: float | None
    speed_source: str  # "measured" | "measured-scaled" | "model"
    speed_basis: str  # one line: which record, when
    oom: str | None = None  # why the candidate is not proposed


@dataclass(frozen=True)
class LearnedMemory:
    """A candidate's peak memory as this device measured it (or the model's, corrected), and where it came from."""

    peak_mib: float | None  # None: the model's own figure stands
    source: str  # "measured" | "measured-scaled" | "model"
    basis: str  # one line: which record, when, and the factor
    factor: float = 1.0  # what the model's prediction was multiplied by


def mib(value: float) -> str:
    """MiB as plans and logs print them: whole above 100, one decimal below (an emulated card holds a few MiB)."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _area(key: dict[str, Any]) -> int:
    width, height = key["resolution"] or (0, 0)
    return int(width) * int(height)


def heavier_or_equal(candidate: dict[str, Any], oomed: dict[str, Any]) -> bool:
    """Whether ``candidate`` needs at least the memory of ``oomed`` (both settings keys)."""
    if any(candidate[name] != oomed[name] for name in _CATEGORICAL):
        return False
    if candidate["gradient_checkpointing"] and not oomed["gradient_checkpointing"]:
        return False  # checkpointing added: less memory, worth trying
    return (candidate["train_batch_size"] >= oomed["train_batch_size"] and _area(candidate) >= _area(oomed)
            and candidate["network_dim"] >= oomed["network_dim"])


def _distance(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, float]:
    differing = sum(1 for name in a if a[name] != b[name])
    spread = sum(abs(math.log2(max(1, a[n]) / max(1, b[n]))) for n in ("train_batch_size", "network_dim"))
    spread += abs(math.log2(max(1, _area(a)) / max(1, _area(b)))) / 2
    return differing, spread


def when_measured(m: Measurement) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M", time.localtime(m.measured_at)) if m.measured_at else "earlier"


class LearnedFigures:
    """The store's records for one device and family, asked about one candidate at a time."""

    def __init__(self, records: Sequence[Measurement], device: str, family: FamilySpec) -> None:
        mine = [r for r in records if r.device == device and r.family == family.name]
        self.device = device
        self.done = [r for r in mine if r.outcome == Outcome.DONE and r.micro_steps_per_s]
        self.peaks = [r for r in mine if r.outcome == Outcome.DONE and r.peak_memory_mib]
        self.ooms = [r for r in mine if r.outcome == Outcome.OOM]

    def __bool__(self) -> bool:
        return bool(self.done or self.peaks or self.ooms)

    def oom_reason(self, settings: dict[str, Any], usable_mib: float) -> str | None:
        key = settings_key(settings)
        for record in self.ooms:
            if record.budget_mib is not None and usable_mib > record.budget_mib * 1.02:
                continue  # it ran out of a smaller budget than this plan has
            if heavier_or_equal(key, record.key):
                k = record.key
                return (f"ran out of memory on {self.device} ({record.source}, {when_measured(record)}) at micro-batch "
                        f"{k['train_batch_size']}, {k['resolution'][0]} px, rank {k['network_dim']}, "
                        f"checkpointing {'on' if k['gradient_checkpointing'] else 'off'}")
        return None

    def compiled(self, settings: dict[str, Any]) -> Measurement | None:
        """The newest finished run of ``settings`` with its blocks compiled (any backend), on this device."""
        key = {**settings_key(settings), "torch_compile": True}
        return next((r for r in reversed(self.done) if r.key == key), None)

    def speed(self, settings: dict[str, Any], model_rate: Callable[[dict[str, Any]], float]) -> Learned:
        """The measured (or scaled) micro-steps/s of ``settings``; ``model_rate`` predicts a settings block."""
        key = settings_key(settings)
        exact = next((r for r in reversed(self.done) if r.key == key), None)
        if exact is not None:
            return Learned(exact.micro_steps_per_s, "measured",
                           f"{exact.source} on {self.device}, {when_measured(exact)}: "
                           f"{exact.seconds_per_step:.4g} s per step over {exact.steps} steps")
        alike = [r for r in self.done if r.key["torch_compile"] == key["torch_compile"]]  # never scaled across
        if not alike:
            return Learned(None, "model", "speed model")
        nearest = min(alike, key=lambda r: _distance(key, r.key))
        if nearest.micro_steps_per_s is None:  # a finished run without a timed step
            return Learned(None, "model", "speed model")
        ratio = model_rate(settings) / model_rate(nearest.settings)
        k = nearest.key
        return Learned(nearest.micro_steps_per_s * ratio, "measured-scaled",
                       f"{nearest.source} on {self.device}, {when_measured(nearest)} (micro-batch "
                       f"{k['train_batch_size']}, {k['resolution'][0]} px, rank {k['network_dim']}, "
                       f"{k['mixed_precision']}) x the speed model's ratio {ratio:.3g}")

    def memory(self, settings: dict[str, Any], model_mib: Callable[[dict[str, Any]], float]) -> LearnedMemory:
        """The measured (or corrected) peak MiB of ``settings``; ``model_mib`` is the memory model's peak of a
        settings block."""
        key = settings_key(settings)
        exact = next((r for r in reversed(self.peaks) if r.key == key), None)
        model = model_mib(settings)
        if exact is not None and exact.peak_memory_mib is not None:
            factor = exact.peak_memory_mib / model if model > 0 else 1.0
            return LearnedMemory(exact.peak_memory_mib, "measured",
                                 f"{exact.source} on {self.device}, {when_measured(exact)}: peak "
                                 f"{mib(exact.peak_memory_mib)} MiB", factor)
        alike = [r for r in self.peaks if r.key["torch_compile"] == key["torch_compile"]]
        if not alike:
            return LearnedMemory(None, "model", "memory model")
        nearest = min(alike, key=lambda r: _distance(key, r.key))
        measured, predicted = nearest.peak_memory_mib or 0.0, model_mib(nearest.settings)
        if predicted <= 0:
            return LearnedMemory(None, "model", "memory model")
        ratio = measured / predicted
        factor = ratio if ratio >= 1.0 or heavier_or_equal(nearest.key, key) else 1.0
        k = nearest.key
        kept = "" if factor == ratio else "; not lowered: that run was lighter than this one"
        return LearnedMemory(model * factor, "measured-scaled",
                             f"{nearest.source} on {self.device}, {when_measured(nearest)} (micro-batch "
                             f"{k['train_batch_size']}, {k['resolution'][0]} px, rank {k['network_dim']}): measured "
                             f"{mib(measured)} MiB / model {mib(predicted)} MiB = x{ratio:.3g}{kept}", factor)


MAX_CUDA_CONTEXT_MIB = 8192.0  # a context is ~300-1500 MiB; a larger figure is no context


@dataclass(frozen=True)
class MeasuredContext:
    """The CUDA context a run on this device measured at its start (the engine's ``cuda_context_mib``)."""

    mib: float
    basis: str  # one line: which record, when


def measured_cuda_context(records: Sequence[Measurement], device: str) -> MeasuredContext | None:
    """The newest CUDA context measured on ``device`` by any run (any family: the context is the driver's and the
    card's, not the model's); None where no record has a believable one."""
    mine = [r for r in records if r.device == device and 0.0 < r.memory.get("cuda_context_mib", 0.0)
            <= MAX_CUDA_CONTEXT_MIB]
    if not mine:
        return None
    newest = max(mine, key=lambda r: r.measured_at)
    value = newest.memory["cuda_context_mib"]
    return MeasuredContext(value, f"CUDA context {mib(value)} MiB as measured at the start of a {newest.family} "
                                  f"{newest.source} on {device}, {when_measured(newest)}")
