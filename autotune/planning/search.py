"""The search: predict candidate settings with the memory and speed models, keep the fastest that fits.

Candidates are ``TrainSettings`` (kohya's names, the type the engine reports and the OOM ladder steps
down from); the memory model reads them through ``inputs_for_settings``, the same mapping the ladder
uses. At each point of the fallback ladder (mildest first) every micro-batch up to the effective batch
and gradient checkpointing off/on are tried; the first point where something fits wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from autotune.planning.goals import GoalProfile, network_alpha
from autotune.planning.request import GpuTarget
from autotune.planning.resolution import resolution_ladder
from sd_scripts_compat.config.settings import TrainSettings
from sd_scripts_compat.models.families import FamilySpec

DDP_EFFICIENCY = 0.9  # all-reduce of the LoRA gradients each step; small LoRAs make it cheap but not free


def at_resolution(settings: TrainSettings, side: int) -> TrainSettings:
    """Square ``side`` px, buckets up to twice that (the planner's bucket rule)."""
    return replace(settings, resolution=(side, side), max_bucket_reso=side * 2)


def at_rank(settings: TrainSettings, rank: int) -> TrainSettings:
    return settings.with_rank(rank, network_alpha(rank))


def start_point(family: FamilySpec, *, side: int, rank: int, optimizer: str, precision: str, train_te: bool,
                effective: int, attention: str) -> TrainSettings:
    """The preferred settings before anything is given up (latents always cached)."""
    return TrainSettings(
        train_batch_size=1, gradient_accumulation_steps=effective, resolution=(side, side),
        gradient_checkpointing=False, optimizer_type=optimizer, network_dim=rank, network_alpha=network_alpha(rank),
        network_train_unet_only=not train_te, mixed_precision=precision, fp8_base=False, cache_latents=True,
        cache_text_encoder_outputs=family.is_sdxl and not train_te, max_bucket_reso=side * 2,
        xformers=attention == "xformers",
    )


@dataclass(frozen=True)
class Estimate:
    required: int  # peak + the memory model's safety margin: must fit in the usable VRAM
    peak: int  # what max_memory_reserved / nvidia-smi would show
    components: tuple[tuple[str, int], ...]
    it_per_s: float  # micro-steps per second of the slowest device
    speed_source: str = "model"  # "measured" | "measured-scaled" | "model" (autotune.measure.learned)
    speed_basis: str = "speed model"
    memory_source: str = "model"  # "measured": a GPU run of these exact settings
    oom: str | None = None  # ran out of memory here before: not proposed


class Predictor:
    """Adapts the memory and speed models to ``TrainSettings``; caches by settings (the ladder revisits points).

    With ``learned`` (this device's measurements) a measured figure replaces the model's, and a setting that
    ran out of memory here is made not to fit (``excluded`` keeps why, for the plan to show)."""

    def __init__(self, family: FamilySpec, gpus: tuple[GpuTarget, ...], cpu_cores: int, cpu_bf16: bool = False,
                 learned: Any = None, usable: int = 0) -> None:
        self.family = family
        self.gpus = gpus
        self.cpu_cores = cpu_cores
        self.cpu_bf16 = cpu_bf16
        self.learned = learned
        self.usable = usable
        self.excluded: dict[TrainSettings, str] = {}
        self._cache: dict[TrainSettings, Estimate] = {}

    def model_rate(self, s: TrainSettings) -> float:
        """The speed model's micro-steps/s of the slowest device."""
        from autotune.estimate.memory_model import inputs_for_settings
        from autotune.estimate.speed_model import predict_speed

        inputs = inputs_for_settings(self.family.name, s)
        return min(float(predict_speed(inputs, gpu.spec if gpu is not None else None, steps=1,
                                       cpu_cores=self.cpu_cores, cpu_bf16=self.cpu_bf16).it_per_s)
                   for gpu in self.gpus or (None,))

    def predict(self, s: TrainSettings) -> Estimate:
        """Memory on one device and micro-steps/s of the slowest device."""
        hit = self._cache.get(s)
        if hit is not None:
            return hit
        from autotune.estimate.memory_model import inputs_for_settings, predict_memory

        inputs = inputs_for_settings(self.family.name, s)
        estimate = predict_memory(inputs)
        components = dict(estimate.components)
        extra = 0
        if len(self.gpus) > 1:
            # DDP keeps a second copy of the trainable gradients as all-reduce buckets.
            extra = components.get("lora_grads", 0)
            components["ddp_buckets"] = extra
        result = Estimate(required=int(estimate.total_bytes) + extra, peak=int(estimate.peak_bytes) + extra,
                          components=tuple((str(k), int(v)) for k, v in components.items()),
                          it_per_s=self.model_rate(s))
        if self.learned:
            result = self._with_measurements(s, result)
        self._cache[s] = result
        return result

    def _with_measurements(self, s: TrainSettings, e: Estimate) -> Estimate:
        """The measured speed (and GPU peak) of ``s`` where the store has them; a recorded OOM makes it not fit."""
        event = s.to_event()
        oom = self.learned.oom_reason(event, self.usable / 2**20)
        if oom is not None:
            self.excluded[s] = oom
            return replace(e, required=max(e.required, self.usable + 1), oom=oom)
        got = self.learned.speed(event, lambda values: self.model_rate(TrainSettings.from_event(values)))
        if got.micro_steps_per_s is None:
            return e
        e = replace(e, it_per_s=float(got.micro_steps_per_s), speed_source=got.speed_source,
                    speed_basis=got.speed_basis)
        if got.peak_mib:
            peak = int(got.peak_mib * 2**20)
            e = replace(e, required=e.required - e.peak + peak, peak=peak, memory_source="measured")
        return e


@dataclass(frozen=True)
class Scored:
    settings: TrainSettings
    required: int
    peak: int
    components: tuple[tuple[str, int], ...]
    it_per_s: float
    samples_per_s: float


def micro_batches(effective: int) -> list[int]:
    out, b = [], 1
    while b <= effective:
        out.append(b)
        b *= 2
    return out


def best_at(point: TrainSettings, effective_batch: int, devices: int, usable: int,
            predictor: Predictor) -> tuple[Scored | None, Scored]:
    """The fastest fitting (micro-batch, checkpointing) at one ladder point, and the smallest candidate there."""
    best: Scored | None = None
    smallest: Scored | None = None
    for gc in (False, True):
        for mb in micro_batches(max(1, effective_batch // devices)):
            accum = max(1, math.ceil(effective_batch / (mb * devices)))
            s = replace(point, train_batch_size=mb, gradient_accumulation_steps=accum, gradient_checkpointing=gc)
            e = predictor.predict(s)
            scale = devices * (DDP_EFFICIENCY if devices > 1 else 1.0)
            scored = Scored(s, e.required, e.peak, e.components, e.it_per_s, e.it_per_s * mb * scale)
            if smallest is None or e.required < smallest.required:
                smallest = scored
            if e.required > usable:
                continue
            # Highest samples/s; ties: no checkpointing first (loop order), then smaller micro-batch.
            if best is None or scored.samples_per_s > best.samples_per_s * (1 + 1e-9):
                best = scored
    assert smallest is not None
    return best, smallest


def halvings(start: int, stop: int) -> list[int]:
    out, r = [], start
    while r // 2 >= stop:
        r //= 2
        out.append(r)
    return out


def ladder(start: TrainSettings, family: FamilySpec, goal: GoalProfile, fp8_ok: bool,
           pinned_resolution: int | None) -> list[tuple[str, TrainSettings]]:
    """Ladder points after the start, each with the step that produced it (see the planner's docstring)."""
    points: list[tuple[str, TrainSettings]] = []
    cur = start
    if cur.optimizer_type != "AdamW8bit":
        cur = replace(cur, optimizer_type="AdamW8bit")
        points.append(("optimizer AdamW8bit (8-bit state)", cur))
    if not cur.network_train_unet_only:
        cur = replace(cur, network_train_unet_only=True, cache_text_encoder_outputs=family.is_sdxl)
        points.append(("UNet only" + (" with cached text-encoder outputs" if family.is_sdxl else ""), cur))
    for rank in halvings(cur.network_dim, goal.rank_floor):
        cur = at_rank(cur, rank)
        points.append((f"rank {rank}", cur))
    for side in resolution_ladder(family.resolution, pinned_resolution)[1:]:
        cur = at_resolution(cur, side)
        points.append((f"resolution {side}", cur))
    if fp8_ok:
        cur = replace(cur, fp8_base=True)
        points.append(("fp8 base weights", cur))
    for rank in halvings(cur.network_dim, 4):
        cur = at_rank(cur, rank)
        points.append((f"rank {rank}", cur))
    return points


@dataclass(frozen=True)
class SearchResult:
    chosen: Scored | None  # None: nothing fits
    smallest: Scored  # the smallest candidate of the last point tried (what "nothing fits" reports)
    fallbacks: tuple[str, ...]  # what the ladder gave up, in order


def search(start: TrainSettings, family: FamilySpec, goal: GoalProfile, *, fp8_ok: bool,
           pinned_resolution: int | None, effective: int, devices: int, usable: int,
           predictor: Predictor) -> SearchResult:
    """Walk the ladder from ``start`` (cumulatively, mildest first) until something fits."""
    fallbacks: list[str] = []
    smallest: Scored | None = None
    for label, point in [("", start), *ladder(start, family, goal, fp8_ok, pinned_resolution)]:
        best, smallest = best_at(point, effective, devices, usable, predictor)
        if label:
            fallbacks.append(label)
        if best is not None:
            return SearchResult(chosen=best, smallest=smallest, fallbacks=tuple(fallbacks))
    assert smallest is not None
    return SearchResult(chosen=None, smallest=smallest, fallbacks=tuple(fallbacks))
