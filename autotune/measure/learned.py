"""What the planner learns from the store: a measured speed for a candidate, and the settings that ran out
of memory on this device.

- **Exact**: a finished run with the candidate's key (device, family, :data:`~autotune.measure.store.KEY_FIELDS`)
  gives its micro-steps/s as measured (source ``"measured"``); on a GPU also its peak reserved memory.
- **Scaled**: otherwise the nearest finished run of the same device and family (fewest differing fields, then
  the closest batch, resolution and rank) is scaled by the speed model's ratio between the two settings
  (source ``"measured-scaled"``): the model's error on this machine mostly cancels in the ratio.
- **Model** otherwise (source ``"model"``).
- **Memory** the same way: a finished run of the candidate's key gives its measured peak (CUDA max reserved on a
  GPU, to which the planner adds the CUDA context; the emulated card's count; peak resident memory on a CPU);
  otherwise the memory model's prediction is corrected by measured / predicted of the nearest finished run of the
  same device and family: per part where that run read what stays on the device between steps (``resident_mib``:
  the weights, the LoRA, its optimizer state; the rest of the peak is gradients, activations, the allocator's
  slack), so that a run whose activations were off and weights right corrects a larger micro-batch's activations
  alone; else the whole peak by one ratio (a CPU run, which reads no resident memory). A ratio lowers a
  prediction only when that run's settings were at least as heavy as the candidate's: a lighter run that needed
  less than predicted says nothing about a heavier one.
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

    def memory(self, settings: dict[str, Any], model: Callable[[dict[str, Any]], ModelPeak]) -> LearnedMemory:
        """The measured (or corrected) peak MiB of ``settings``; ``model`` gives the memory model's figures of a
        settings block as the engine measures them (:class:`ModelPeak`)."""
        key = settings_key(settings)
        exact = next((r for r in reversed(self.peaks) if r.key == key), None)
        mine = model(settings)
        if exact is not None and exact.peak_memory_mib is not None:
            factor = exact.peak_memory_mib / mine.peak if mine.peak > 0 else 1.0
            return LearnedMemory(exact.peak_memory_mib, "measured",
                                 f"{exact.source} on {self.device}, {when_measured(exact)}: peak "
                                 f"{mib(exact.peak_memory_mib)} MiB", factor)
        alike = [r for r in self.peaks if r.key["torch_compile"] == key["torch_compile"]]
        if not alike:
            return LearnedMemory(None, "model", "memory model")
        nearest = min(alike, key=lambda r: _distance(key, r.key))
        theirs = model(nearest.settings)
        if theirs.peak <= 0:
            return LearnedMemory(None, "model", "memory model")
        k = nearest.key
        run = (f"{nearest.source} on {self.device}, {when_measured(nearest)} (micro-batch {k['train_batch_size']}, "
               f"{k['resolution'][0]} px, rank {k['network_dim']})")
        lowers = heavier_or_equal(nearest.key, key)
        kept = "; not lowered: that run was lighter than this one"
        parts = _part_ratios(nearest, theirs)
        if parts is not None:  # each part by its own ratio: the weights' error says nothing of the activations'
            resident, rest = (ratio if ratio >= 1.0 or lowers else 1.0 for ratio in parts)
            peak = mine.resident * resident + (mine.peak - mine.resident) * rest
            measured_rest = (nearest.peak_memory_mib or 0.0) - (nearest.resident_mib or 0.0)
            return LearnedMemory(peak, "measured-scaled", (
                f"{run}: resident measured {mib(nearest.resident_mib or 0.0)} MiB / model {mib(theirs.resident)} "
                f"MiB = x{parts[0]:.3g}, the rest of the peak measured {mib(measured_rest)} MiB / model "
                f"{mib(theirs.peak - theirs.resident)} MiB = x{parts[1]:.3g}"
                f"{kept if (resident, rest) != parts else ''}"), peak / mine.peak if mine.peak > 0 else 1.0)
        measured = nearest.peak_memory_mib or 0.0
        ratio = measured / theirs.peak
        factor = ratio if ratio >= 1.0 or lowers else 1.0
        return LearnedMemory(mine.peak * factor, "measured-scaled",
                             f"{run}: measured {mib(measured)} MiB / model {mib(theirs.peak)} MiB = x{ratio:.3g}"
                             f"{kept if factor != ratio else ''}", factor)


@dataclass(frozen=True)
class ModelPeak:
    """The memory model's figures for one settings block, MiB, as the engine measures them: ``peak`` (CUDA's
    max reserved, which leaves the context out; the emulated card's count; a CPU's peak resident memory) and
    ``resident``, what of it stays on the device between steps (weights, LoRA, optimizer state: the engine's
    ``resident_memory``; 0 where the model does not say)."""

    peak: float
    resident: float = 0.0


def _part_ratios(record: Measurement, model: ModelPeak) -> tuple[float, float] | None:
    """(measured / predicted of the resident part, of the rest of the peak) of ``record``; None where either side
    lacks the split (a CPU run reads no resident memory) or a part is empty."""
    measured_peak, measured_resident = record.peak_memory_mib or 0.0, record.resident_mib or 0.0
    if not (0.0 < measured_resident < measured_peak and 0.0 < model.resident < model.peak):
        return None
    return measured_resident / model.resident, (measured_peak - measured_resident) / (model.peak - model.resident)


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
