"""The search: predict candidate settings with the memory and speed models, keep the fastest that fits.

Candidates are ``TrainSettings`` (kohya's names, the type the engine reports and the OOM ladder steps
down from); the memory model reads them through ``inputs_for_settings``, the same mapping the ladder
uses. The fallback points are the settings space's moves (``sd_scripts_compat.facts.settings_space``) in the
planner's policy (:func:`planner_policy`: the family's order from its plan profile, any optimizer may become
AdamW8bit, alpha = rank / 2, buckets twice the side); at each point, mildest first, every power-of-two
micro-batch up to the effective batch and gradient checkpointing off/on are tried; the first point where
something fits wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune.estimate.memory_view import AS_MODELLED, MemoryView
from autotune.planning.goals import GoalProfile, network_alpha
from autotune.planning.profiles import plan_profile
from autotune.planning.request import GpuTarget
from autotune.planning.resolution import resolution_floor, step_and_floor
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import RUNGS, Limits, Policy, micro_batch_splits

if TYPE_CHECKING:
    from autotune.measure.learned import LearnedFigures, ModelPeak

DDP_EFFICIENCY = 0.9  # all-reduce of the LoRA gradients each step; small LoRAs make it cheap but not free


def start_point(family: FamilySpec, *, side: int, rank: int, optimizer: str, precision: str, train_te: bool,
                effective: int, attention: str, network: tuple[str, tuple[str, ...]] | None = None,
                frames: int = 1, high_noise_expert: bool = False) -> TrainSettings:
    """The preferred settings before anything is given up (latents always cached; text-encoder outputs as the
    family's plan profile says, else cached for SDXL UNet-only training)."""
    cache_te = plan_profile(family).cache_text_encoder_outputs
    return TrainSettings(
        train_batch_size=1, gradient_accumulation_steps=effective, resolution=(side, side),
        gradient_checkpointing=False, optimizer_type=optimizer, network_dim=rank, network_alpha=network_alpha(rank),
        network_train_unet_only=not train_te, mixed_precision=precision, fp8_base=False, cache_latents=True,
        cache_text_encoder_outputs=cache_te if cache_te is not None else family.is_sdxl and not train_te,
        max_bucket_reso=side * 2, xformers=attention == "xformers",
        network_module=network[0] if network else family.network_module, network_args=network[1] if network else (),
        frames=frames, high_noise_expert=high_noise_expert,
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
    memory_source: str = "model"  # "measured" | "measured-scaled" | "model" (autotune.measure.learned)
    memory_basis: str = "memory model"
    memory_factor: float = 1.0  # measured / predicted applied to the model's peak
    oom: str | None = None  # ran out of memory here before: not proposed


def estimate_for_settings(family: FamilySpec, s: TrainSettings, cpu_cores: int, *, t5_fp8: bool = False,
                          cpu_bf16: bool = False, te_cpu: bool = False, on_gpu: bool = True,
                          memory: MemoryView = AS_MODELLED, devices: int = 1) -> tuple[Any, Any]:
    """(memory estimate, speed function of a GPU spec) from the family's memory model: FLUX's own
    (``dit_memory`` / ``dit_speed``: the transformer model) for the families its calibration lists, else the UNet model
    (``cpu_bf16``: the CPU computes bf16 natively; ``on_gpu``: the coefficients traced under CUDA autocast's op
    lists, else under the CPU's; ``memory``: an emulated card's view, a deliberately scaled model; ``devices``: the
    processes a sharded transformer (``s.fsdp``) is split across)."""
    from autotune.estimate.dit_memory import dit_inputs_for_settings, is_dit_family, predict_dit_memory
    from autotune.estimate.memory_model import DEFAULT_CUDA_CONTEXT_GIB

    rules = "cuda" if on_gpu else "cpu"
    context = DEFAULT_CUDA_CONTEXT_GIB if on_gpu else 0.0  # a CPU plan has no CUDA context

    if is_dit_family(family):
        from autotune.estimate.dit_speed import predict_dit_speed
        from autotune.planning.profiles import plan_profile

        profile = plan_profile(family)
        te_fp8 = profile.text_encoder_fp8(t5_fp8, s.fp8_base)
        flux = replace(dit_inputs_for_settings(family, s, t5_fp8=te_fp8, processes=devices),
                       text_encoders_on_cpu=te_cpu, expert_switch_share=profile.expert_switch_share(),
                       autocast_rules=rules, cuda_context_gib=context)
        return (memory.predict(predict_dit_memory, flux),
                lambda spec: predict_dit_speed(flux, spec, cpu_cores=cpu_cores))
    from autotune.estimate.memory_model import inputs_for_settings, predict_memory
    from autotune.estimate.speed_model import predict_speed

    inputs = replace(inputs_for_settings(family, s, processes=devices), autocast_rules=rules,
                     cuda_context_gib=context)
    return memory.predict(predict_memory, inputs), lambda spec: predict_speed(inputs, spec, steps=1,
                                                                              cpu_cores=cpu_cores, cpu_bf16=cpu_bf16)


class Predictor:
    """Adapts the memory and speed models to ``TrainSettings``; caches by settings (the ladder revisits points).

    With ``learned`` (this device's measurements) a measured figure replaces the model's, and a setting that
    ran out of memory here is made not to fit (``excluded`` keeps why, for the plan to show)."""

    def __init__(self, family: FamilySpec, gpus: tuple[GpuTarget, ...], cpu_cores: int, t5_fp8: bool = False,
                 cpu_bf16: bool = False, learned: LearnedFigures | None = None, usable: int = 0,
                 te_cpu: bool = False, memory: MemoryView = AS_MODELLED) -> None:
        self.family = family
        self.gpus = gpus
        self.cpu_cores = cpu_cores
        self.t5_fp8 = t5_fp8  # FLUX: the T5-XXL file is fp8 (the caching phase needs it on small cards)
        self.te_cpu = te_cpu  # HunyuanImage: the text encoders cache on the CPU (text_encoder_cpu)
        self.cpu_bf16 = cpu_bf16
        self.memory = memory
        self.learned = learned
        self.usable = usable
        self.excluded: dict[TrainSettings, str] = {}
        self._cache: dict[TrainSettings, Estimate] = {}
        self._model_cache: dict[TrainSettings, Estimate] = {}

    def _models(self, s: TrainSettings) -> tuple[Any, Any]:
        return estimate_for_settings(self.family, s, self.cpu_cores, t5_fp8=self.t5_fp8, cpu_bf16=self.cpu_bf16,
                                     te_cpu=self.te_cpu, on_gpu=bool(self.gpus), memory=self.memory,
                                     devices=max(1, len(self.gpus)))

    def model_rate(self, s: TrainSettings) -> float:
        """The speed model's micro-steps/s of the slowest device."""
        speed_of = self._models(s)[1]
        return min(float(speed_of(gpu.spec if gpu is not None else None).it_per_s) for gpu in self.gpus or (None,))

    def predict(self, s: TrainSettings) -> Estimate:
        """Memory on one device and micro-steps/s of the slowest device (this device's measurements applied)."""
        hit = self._cache.get(s)
        if hit is not None:
            return hit
        result = self.model_estimate(s)
        if self.learned:
            result = self._with_measurements(self.learned, s, result)
        self._cache[s] = result
        return result

    def model_estimate(self, s: TrainSettings) -> Estimate:
        """What the memory and speed models alone predict for ``s``."""
        hit = self._model_cache.get(s)
        if hit is not None:
            return hit
        estimate, speed_of = self._models(s)
        components = dict(estimate.components)
        extra = 0
        if len(self.gpus) > 1:
            extra = components["gradient_all_reduce"] = all_reduce_bytes(components)
        rates = []
        for gpu in self.gpus or (None,):
            rates.append(float(speed_of(gpu.spec if gpu is not None else None).it_per_s))
        result = Estimate(required=int(estimate.total_bytes) + extra, peak=int(estimate.peak_bytes) + extra,
                          components=tuple((str(k), int(v)) for k, v in components.items()), it_per_s=min(rates),
                          host_ram=int(getattr(estimate, "host_ram_bytes", 0)),
                          host_ram_loading=int(getattr(estimate, "host_ram_loading_bytes", 0)),
                          memory_basis=self.memory.basis())
        self._model_cache[s] = result
        return result

    def _with_measurements(self, learned: LearnedFigures, s: TrainSettings, e: Estimate) -> Estimate:
        """The measured (or scaled) speed and peak of ``s`` where the store has them; a recorded OOM makes it not
        fit."""
        event = s.to_event()
        oom = learned.oom_reason(event, self.usable / 2**20)
        if oom is not None:
            self.excluded[s] = oom
            return replace(e, required=max(e.required, self.usable + 1), oom=oom)
        got = learned.speed(event, lambda values: self.model_rate(TrainSettings.from_event(values)))
        if got.micro_steps_per_s is not None:
            e = replace(e, it_per_s=float(got.micro_steps_per_s), speed_source=got.speed_source,
                        speed_basis=got.speed_basis)
        memory = learned.memory(event, lambda values: self._as_measured(TrainSettings.from_event(values)))
        if memory.peak_mib is not None:
            peak = int(memory.peak_mib * 2**20) + dict(e.components).get("cuda_context", 0)
            basis = memory.basis if memory.source == "measured" else self.memory.basis(memory.basis)
            e = replace(e, required=e.required - e.peak + peak, peak=peak, memory_source=memory.source,
                        memory_basis=basis, memory_factor=memory.factor)
        return e

    def _as_measured(self, s: TrainSettings) -> ModelPeak:
        """The memory model's figures of ``s`` as the engine measures them: the peak without the CUDA context
        (``max_memory_reserved`` leaves it out; the planner adds the measured context, else the model's, back) and
        what stays on the device between steps."""
        from autotune.estimate.memory_model import resident_bytes
        from autotune.measure.learned import ModelPeak

        e = self.model_estimate(s)
        parts = dict(e.components)
        return ModelPeak((e.peak - parts.get("cuda_context", 0)) / 2**20, resident_bytes(parts) / 2**20)


def all_reduce_bytes(components: dict[str, int]) -> int:
    """Bytes the averaging of the LoRA's gradients adds at the peak on each of several cards. None for DDP as
    sd-scripts and musubi-tuner run it, since a plan over several cards writes ``ddp_gradient_as_bucket_view``
    (the gradients are views into DDP's all-reduce buckets, not a second copy: PyTorch's documented saving, the
    gradients' size). Our engine (data parallel or sharded) all-reduces one flat copy after the backward, when the
    activations are gone (``devices.average_gradients``; on the emulated card, tiny-flux at 256 px, a second
    process adds the same 0.06 MiB at rank 4 and at rank 64, whose copy is 0.72 MiB): what exceeds them."""
    return max(0, components.get("lora_grads", 0) - components.get("activations", 0))


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


def score(s: TrainSettings, predictor: Predictor, devices: int = 1) -> Scored:
    """The predicted memory and speed of ``s`` (samples/s across ``devices`` data-parallel processes)."""
    e = predictor.predict(s)
    scale = devices * (DDP_EFFICIENCY if devices > 1 else 1.0)
    return Scored(s, e.required, e.peak, e.components, e.it_per_s, e.it_per_s * s.train_batch_size * scale,
                  e.host_ram, e.host_ram_loading)


def best_at(point: TrainSettings, effective_batch: int, devices: int, usable: int,
            predictor: Predictor, split: tuple[int, int] | None = None) -> tuple[Scored | None, Scored]:
    """The fastest fitting (micro-batch, checkpointing) at one ladder point, and the smallest candidate there;
    ``split``: only that (micro-batch, accumulation), the user's."""
    best: Scored | None = None
    smallest: Scored | None = None
    splits = [split] if split else list(reversed(micro_batch_splits(effective_batch, devices, exact=False)))
    for gc in (False, True):
        for mb, accum in splits:
            s = replace(point, train_batch_size=mb, gradient_accumulation_steps=accum, gradient_checkpointing=gc)
            scored = score(s, predictor, devices)
            if smallest is None or scored.required < smallest.required:
                smallest = scored
            if scored.required > usable:
                continue
            # Highest samples/s; ties: no checkpointing first (loop order), then smaller micro-batch.
            if best is None or scored.samples_per_s > best.samples_per_s * (1 + 1e-9):
                best = scored
    assert smallest is not None
    return best, smallest


def planner_policy(family: FamilySpec, goal: GoalProfile) -> Policy:
    """The planner's walk of the settings space: the family's order (``plan_profiles.json``'s ``ladder``), any
    optimizer may become AdamW8bit (the plan writes its own rates), alpha = rank / 2, buckets twice the side, and
    the goal's rank floor before the last resort (``rank_min``)."""
    return Policy(rungs=plan_profile(family).ladder, exact_micro_batches=False, switch_optimizer=True,
                  alpha=network_alpha, bucket_follows="double", rank_floor=goal.rank_floor)


def planner_limits(family: FamilySpec, fp8_ok: bool) -> Limits:
    """What the planner may lower: resolutions in 64 px steps down to 5/8 of the native size (never below 256 px),
    the family's swap maximum, fp8 where every card stores it."""
    step, _ = step_and_floor(family)
    return Limits(is_sdxl=family.is_sdxl, fp8_supported=fp8_ok, max_blocks_to_swap=family.max_blocks_to_swap,
                  resolution_step=step, min_resolution=resolution_floor(family.resolution),
                  keys=family.config_keys)


def ladder(start: TrainSettings, family: FamilySpec, goal: GoalProfile,
           fp8_ok: bool) -> list[tuple[str, TrainSettings]]:
    """Ladder points after the start, each with the move that produced it, cumulatively (each rung's moves start
    from the last point of the rung before)."""
    policy, limits = planner_policy(family, goal), planner_limits(family, fp8_ok)
    points: list[tuple[str, TrainSettings]] = []
    cur = start
    for name in policy.rungs:
        for candidate in RUNGS[name].moves(cur, policy, limits):
            points.append((candidate.label, candidate.settings))
        cur = points[-1][1] if points else cur
    return points


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
           effective: int, devices: int, usable: int,
           predictor: Predictor, split: tuple[int, int] | None = None) -> SearchResult:
    """Walk the ladder from ``start`` (cumulatively, mildest first) until something fits; with ``split`` (the
    user's micro-batch and accumulation) only that split is tried at each point."""
    fallbacks: list[str] = []
    smallest: Scored | None = None
    for label, point in [("", start), *ladder(start, family, goal, fp8_ok)]:
        best, smallest = best_at(point, effective, devices, usable, predictor, split)
        if label:
            _add_fallback(fallbacks, label)
        if best is not None:
            best = _fewest_swapped(best, start, effective, devices, usable, predictor, split, fallbacks)
            return SearchResult(chosen=best, smallest=smallest, fallbacks=tuple(fallbacks))
    assert smallest is not None
    return SearchResult(chosen=None, smallest=smallest, fallbacks=tuple(fallbacks))


def _fewest_swapped(best: Scored, start: TrainSettings, effective: int, devices: int, usable: int,
                    predictor: Predictor, split: tuple[int, int] | None, fallbacks: list[str]) -> Scored:
    """The swap rung comes before rank and resolution: where a later rung made room, the fewest swapped blocks that
    fit at the point found (fewer copies per step), its fallback entry cut to match."""
    point = best.settings
    for count in range(start.blocks_to_swap, point.blocks_to_swap):
        fewer, _ = best_at(replace(point, blocks_to_swap=count), effective, devices, usable, predictor, split)
        if fewer is None:
            continue
        prefix = "blocks_to_swap "
        at = next((i for i, entry in enumerate(fallbacks) if entry.startswith(prefix)), None)
        if at is not None and count == 0:
            del fallbacks[at]
        elif at is not None:
            first = fallbacks[at][len(prefix):].split("-")[0]
            fallbacks[at] = f"{prefix}{first}-{count}" if str(count) != first else f"{prefix}{count}"
        return fewer
    return best
