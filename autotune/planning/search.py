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
from autotune.planning.profiles import plan_profile
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
    """The preferred settings before anything is given up (latents always cached; text-encoder outputs as the
    family's plan profile says, else cached for SDXL UNet-only training)."""
    cache_te = plan_profile(family.name).cache_text_encoder_outputs
    return TrainSettings(
        train_batch_size=1, gradient_accumulation_steps=effective, resolution=(side, side),
        gradient_checkpointing=False, optimizer_type=optimizer, network_dim=rank, network_alpha=network_alpha(rank),
        network_train_unet_only=not train_te, mixed_precision=precision, fp8_base=False, cache_latents=True,
        cache_text_encoder_outputs=cache_te if cache_te is not None else family.is_sdxl and not train_te,
        max_bucket_reso=side * 2, xformers=attention == "xformers",
    )


@dataclass(frozen=True)
class Estimate:
    required: int  # peak + the memory model's safety margin: must fit in the usable VRAM
    peak: int  # what max_memory_reserved / nvidia-smi would show
    components: tuple[tuple[str, int], ...]
    it_per_s: float  # micro-steps per second of the slowest device
    host_ram: int = 0  # host memory the run holds while training (FLUX: swapped blocks, parked encoders)
    host_ram_loading: int = 0  # ... and while loading (FLUX: the transformer file passes through RAM)
    speed_source: str = "model"  # "measured" | "measured-scaled" | "model" (autotune.measure.learned)
    speed_basis: str = "speed model"
    memory_source: str = "model"  # "measured": a GPU run of these exact settings
    oom: str | None = None  # ran out of memory here before: not proposed


def estimate_for_settings(family: str, s: TrainSettings, cpu_cores: int, *, t5_fp8: bool = False,
                          cpu_bf16: bool = False) -> tuple[Any, Any]:
    """(memory estimate, speed function of a GPU spec) from the family's memory model: FLUX's own
    (``flux_memory`` / ``flux_speed``) for the families its calibration lists, else the UNet model
    (``cpu_bf16``: the CPU computes bf16 natively)."""
    from autotune.estimate.flux_memory import flux_inputs_for_settings, is_flux_family, predict_flux_memory

    if is_flux_family(family):
        from autotune.estimate.flux_speed import predict_flux_speed

        flux = flux_inputs_for_settings(family, s, t5_fp8=t5_fp8)
        return predict_flux_memory(flux), lambda spec: predict_flux_speed(flux, spec, cpu_cores=cpu_cores)
    from autotune.estimate.memory_model import inputs_for_settings, predict_memory
    from autotune.estimate.speed_model import predict_speed

    inputs = inputs_for_settings(family, s)
    return predict_memory(inputs), lambda spec: predict_speed(inputs, spec, steps=1, cpu_cores=cpu_cores,
                                                              cpu_bf16=cpu_bf16)


class Predictor:
    """Adapts the memory and speed models to ``TrainSettings``; caches by settings (the ladder revisits points).

    With ``learned`` (this device's measurements) a measured figure replaces the model's, and a setting that
    ran out of memory here is made not to fit (``excluded`` keeps why, for the plan to show)."""

    def __init__(self, family: FamilySpec, gpus: tuple[GpuTarget, ...], cpu_cores: int, t5_fp8: bool = False,
                 cpu_bf16: bool = False, learned: Any = None, usable: int = 0) -> None:
        self.family = family
        self.gpus = gpus
        self.cpu_cores = cpu_cores
        self.t5_fp8 = t5_fp8  # FLUX: the T5-XXL file is fp8 (the caching phase needs it on small cards)
        self.cpu_bf16 = cpu_bf16
        self.learned = learned
        self.usable = usable
        self.excluded: dict[TrainSettings, str] = {}
        self._cache: dict[TrainSettings, Estimate] = {}

    def _models(self, s: TrainSettings) -> tuple[Any, Any]:
        return estimate_for_settings(self.family.name, s, self.cpu_cores, t5_fp8=self.t5_fp8, cpu_bf16=self.cpu_bf16)

    def model_rate(self, s: TrainSettings) -> float:
        """The speed model's micro-steps/s of the slowest device."""
        speed_of = self._models(s)[1]
        return min(float(speed_of(gpu.spec if gpu is not None else None).it_per_s) for gpu in self.gpus or (None,))

    def predict(self, s: TrainSettings) -> Estimate:
        """Memory on one device and micro-steps/s of the slowest device."""
        hit = self._cache.get(s)
        if hit is not None:
            return hit
        estimate, speed_of = self._models(s)
        components = dict(estimate.components)
        extra = 0
        if len(self.gpus) > 1:
            # DDP keeps a second copy of the trainable gradients as all-reduce buckets.
            extra = components.get("lora_grads", 0)
            components["ddp_buckets"] = extra
        rates = []
        for gpu in self.gpus or (None,):
            rates.append(float(speed_of(gpu.spec if gpu is not None else None).it_per_s))
        result = Estimate(required=int(estimate.total_bytes) + extra, peak=int(estimate.peak_bytes) + extra,
                          components=tuple((str(k), int(v)) for k, v in components.items()), it_per_s=min(rates),
                          host_ram=int(getattr(estimate, "host_ram_bytes", 0)),
                          host_ram_loading=int(getattr(estimate, "host_ram_loading_bytes", 0)))
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
    host_ram: int = 0
    host_ram_loading: int = 0


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
            scored = Scored(s, e.required, e.peak, e.components, e.it_per_s, e.it_per_s * mb * scale, e.host_ram,
                            e.host_ram_loading)
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
    """Ladder points after the start, each with the step that produced it (see the planner's docstring), in the
    order of the family's plan profile (``ladder``: optimizer, unet_only, fp8, swap, rank, resolution,
    rank_min)."""
    profile = plan_profile(family.name)
    points: list[tuple[str, TrainSettings]] = []
    cur = start
    for step in profile.ladder:
        for label, point in _ladder_step(step, cur, family, goal, fp8_ok, pinned_resolution,
                                         profile.max_blocks_to_swap):
            points.append((label, point))
            cur = point
    return points


def _ladder_step(step: str, cur: TrainSettings, family: FamilySpec, goal: GoalProfile, fp8_ok: bool,
                 pinned_resolution: int | None, max_swap: int) -> list[tuple[str, TrainSettings]]:
    """The points one named ladder step adds on top of ``cur`` (mildest first)."""
    out: list[tuple[str, TrainSettings]] = []
    if step == "optimizer" and cur.optimizer_type != "AdamW8bit":
        out.append(("optimizer AdamW8bit (8-bit state)", replace(cur, optimizer_type="AdamW8bit")))
    elif step == "unet_only" and not cur.network_train_unet_only:
        out.append(("UNet only" + (" with cached text-encoder outputs" if family.is_sdxl else ""),
                    replace(cur, network_train_unet_only=True,
                            cache_text_encoder_outputs=cur.cache_text_encoder_outputs or family.is_sdxl)))
    elif step == "fp8" and fp8_ok and not cur.fp8_base:
        out.append(("fp8 base weights", replace(cur, fp8_base=True)))
    elif step == "swap":
        for n in range(cur.blocks_to_swap + 1, max_swap + 1):  # the fewest swapped blocks that fit win
            cur = replace(cur, blocks_to_swap=n)
            out.append((f"blocks_to_swap {n}", cur))
    elif step in ("rank", "rank_min"):
        for rank in halvings(cur.network_dim, goal.rank_floor if step == "rank" else 4):
            cur = at_rank(cur, rank)
            out.append((f"rank {rank}", cur))
    elif step == "resolution":
        for side in resolution_ladder(family.resolution, pinned_resolution)[1:]:
            cur = at_resolution(cur, side)
            out.append((f"resolution {side}", cur))
    return out


@dataclass(frozen=True)
class SearchResult:
    chosen: Scored | None  # None: nothing fits
    smallest: Scored  # the smallest candidate of the last point tried (what "nothing fits" reports)
    fallbacks: tuple[str, ...]  # what the ladder gave up, in order


def _add_fallback(fallbacks: list[str], label: str) -> None:
    """Append a ladder step; consecutive swap counts collapse into one "blocks_to_swap 1-15" entry."""
    prefix = "blocks_to_swap "
    if label.startswith(prefix) and fallbacks and fallbacks[-1].startswith(prefix):
        first = fallbacks[-1][len(prefix):].split("-")[0]
        fallbacks[-1] = f"{prefix}{first}-{label[len(prefix):]}"
    else:
        fallbacks.append(label)


def search(start: TrainSettings, family: FamilySpec, goal: GoalProfile, *, fp8_ok: bool,
           pinned_resolution: int | None, effective: int, devices: int, usable: int,
           predictor: Predictor) -> SearchResult:
    """Walk the ladder from ``start`` (cumulatively, mildest first) until something fits."""
    fallbacks: list[str] = []
    smallest: Scored | None = None
    for label, point in [("", start), *ladder(start, family, goal, fp8_ok, pinned_resolution)]:
        best, smallest = best_at(point, effective, devices, usable, predictor)
        if label:
            _add_fallback(fallbacks, label)
        if best is not None:
            return SearchResult(chosen=best, smallest=smallest, fallbacks=tuple(fallbacks))
    assert smallest is not None
    return SearchResult(chosen=None, smallest=smallest, fallbacks=tuple(fallbacks))
