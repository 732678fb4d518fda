"""The planner: from a dataset, a model family and a GPU to the fastest LoRA settings that fit, with reasons.

``plan_training(PlanRequest) -> Plan`` never touches torch: it asks the analytic memory model
(``autotune.estimate.memory_model``) and speed model (``autotune.estimate.speed_model``) about a few hundred candidate
settings and keeps the best, so ``autotune plan`` answers in well under a second.

Decision rules (each chosen value carries its rule as a reason string):

- **Precision.** ``mixed_precision = "bf16"`` where the card has compute capability >= 8.0 (AMD: where the
  catalogue says bf16), else ``"fp16"``; on a machine without a GPU ``"bf16"`` where the CPU computes bf16
  natively (avx512_bf16 / AMX: the probe's ``cpu.bf16_native``), else ``"no"`` (fp32; emulated bf16 is slower).
  Frozen base weights are held in that dtype (kohya casts them), the LoRA stays fp32.
- **Measurements** (``autotune.measure``): where this device has measured a candidate (``autotune bench``,
  ``autotune run``), its measured micro-steps/s replaces the speed model's (or the nearest measured point,
  scaled by the model's ratio), and a setting that ran out of memory here is not proposed; the prediction
  says which it used (``speed_source``: measured / measured-scaled / model).
- **Caching.** Latents are always cached (to disk, so reruns and OOM retries reuse them): the VAE leaves the
  GPU and each step skips the encoder. Text-encoder outputs are cached only for SDXL when the text encoders are
  not trained (sd-scripts allows it only then, and only for SDXL).
- **Goal** sets the LoRA rank/alpha (alpha = rank / 2 always, so the LoRA's scale and hence the learning-rate
  rule do not depend on rank), the effective batch, and the amount of training (image-views, below).
- **Priority** sets the optimizer preference (quality: AdamW with fp32 state; speed/balanced: AdamW8bit) and
  scales the image-views (speed 0.75x, balanced 1x, quality 1.25x). A ``Preferences.optimizer`` overrides it.
- **Search.** For each point of the *fallback ladder* (below), every micro-batch in {1, 2, 4, ...} up to the
  effective batch and gradient checkpointing off/on are predicted; candidates whose predicted peak exceeds the
  usable VRAM (total minus what other processes and a display hold; the memory model adds the CUDA context,
  allocator overhead and safety margin to its peak) are dropped, and the highest predicted throughput
  (samples/s across all devices) wins; ties go to no checkpointing, then the smaller micro-batch.
  Gradient accumulation = effective batch / (micro-batch x devices), rounded up.
- **Fallback ladder** (walked cumulatively, mildest first, only while nothing fits):
  1. optimizer -> AdamW8bit (if another was preferred);
  2. train the UNet only (SDXL: and cache the text-encoder outputs);
  3. rank halved, down to the goal's floor;
  4. resolution lowered in 64 px steps, down to 5/8 of the family's native size (bucket limits follow);
  5. fp8 base weights (``fp8_base``), where the card can (compute capability >= 8.9, as the engine requires);
  6. rank halved below the goal's floor, down to 4.
  When even the last point does not fit, the plan says so and what that smallest configuration needs.
- **Several GPUs** (data parallel): every device gets the same settings, the smallest usable VRAM decides them,
  the slowest card sets the pace; throughput = devices x per-device rate x 0.9 (gradient all-reduce).
- **Compiled blocks** (``torch_compile``, ``autotune.planning.compile_choice``): on only where this device has
  measured a compiled run of the chosen settings (``autotune bench --sweep compile=off,on``) and the time it saves
  over the plan's steps exceeds its measured compile time; the prediction then uses the compiled step and adds the
  compile. Otherwise eager, with the reason.
- **Workers.** ``max_data_loader_n_workers`` = min(2, physical cores // 2) with cached latents (a batch is
  a few small arrays); 0 when training on the CPU (the step's threads use every core; torch's own default is
  the physical cores this process may run on), fewer where host RAM is short.
- **Amount of training.** target image-views = clamp(views_per_image(goal) x images, min, max) x priority scale;
  epochs = max(1, round(target / views per epoch)), where views per epoch = sum(images x repeats) over the
  ``N_name`` folders; optimizer steps = epochs x ceil(views per epoch / effective batch).
  **CPU plans of tiny families** (``tiny`` in the family data, demos and tests) are capped to a short run: as many
  whole epochs as fit in ``TINY_CPU_MAX_STEPS`` optimizer steps (at least one). On the CPU a tiny model's
  step costs per-op overhead, not FLOPs (measured here: ~1 s per optimizer step of 4 micro-steps at 64 px
  against the speed model's 0.08 s), so the full view count would take minutes for a smoke test.
- **Learning rate** (AdamW family): unet_lr = base(goal) x sqrt(effective batch / 4), clamped to
  [2.5e-5, 4e-4]; text_encoder_lr = unet_lr / 2. Prodigy sets its own step size: all rates 1.0.
  Schedule: cosine with 5% linear warm-up (in steps).

Deterministic: the same request gives the same plan (no clocks, no randomness, stable iteration order).

Modules, by concern: ``request`` (PlanRequest, Preferences, GpuTarget, checks), ``dataset`` (the scan's
summary), ``goals`` (goal profiles, learning rate, amount of training), ``resolution`` (bucket rules and the
tiny families' special case), ``search`` (predictions and the fallback ladder over ``TrainSettings``),
``choices`` (every setting with its reason), ``outputs`` (dataset.toml values, launch command) and this one
(``plan_training``, ``Plan``). The family comes from ``sd_scripts_compat.models.detect``. The names other
code imports from here are re-exported.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune import __version__
from autotune.estimate.memory_view import MemoryView
from autotune.planning.choices import Choice, PlanContext, plan_choices
from autotune.planning.compile_choice import CompileDecision, decide_compile
from autotune.planning.dataset import (
    CAPTION_EXTENSIONS,
    IMAGE_EXTENSIONS,
    DatasetSummary,
    SubsetInfo,
    nominal_dataset,
    scan_dataset,
)
from autotune.planning.goals import (
    GOAL_PROFILES,
    GOALS,
    OPTIMIZERS,
    PRIORITIES,
    PRIORITY_OPTIMIZER,
    PRIORITY_VIEW_SCALE,
    GoalProfile,
    learning_rate,
    target_views,
    training_length,
)
from autotune.planning.host_ram import plan_host_ram
from autotune.planning.host_swap import HostSwapChoice, decide_host_swap
from autotune.planning.outputs import dataset_config, launch_command
from autotune.planning.profiles import plan_profile
from autotune.planning.request import (
    EMULATED_CARD,
    GENERIC_GPU_NAME,
    GIB,
    GpuTarget,
    PlanRequest,
    Preferences,
    emulated_card_label,
    gpu_from_spec,
    gpu_from_vram,
    network_choice,
    validate_frames,
    validate_request,
    validate_resolution,
    wants_both_experts,
)
from autotune.planning.resolution import (
    MIN_RESOLUTION_FRACTION,
    RESOLUTION_STEP,
    TINY_CPU_MAX_STEPS,
    bucket_rules,
    is_tiny_scale,
)
from autotune.planning.search import DDP_EFFICIENCY, Predictor, Scored, SearchResult, search, start_point
from autotune.planning.sharding import several_cards
from sd_scripts_compat.facts.dataset_scan import VIDEO_EXTENSIONS
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.models.detect import detect_family

if TYPE_CHECKING:
    from autotune.measure.learned import LearnedFigures
    from autotune.planning.request import Preferences
    from autotune.planning.search import Estimate
    from sd_scripts_compat.facts.families import FamilySpec

__all__ = [
    "CAPTION_EXTENSIONS", "DDP_EFFICIENCY", "GENERIC_GPU_NAME", "GIB", "GOALS", "GOAL_PROFILES", "IMAGE_EXTENSIONS",
    "MIN_RESOLUTION_FRACTION", "OPTIMIZERS", "PRIORITIES", "PRIORITY_OPTIMIZER", "PRIORITY_VIEW_SCALE",
    "RESOLUTION_STEP", "TINY_CPU_MAX_STEPS", "Choice",
    "DatasetSummary", "GoalProfile", "GpuTarget", "Plan", "PlanRequest", "Prediction", "Preferences", "SubsetInfo",
    "TrainSettings", "bucket_rules", "detect_family", "gpu_from_spec", "gpu_from_vram", "learning_rate",
    "nominal_dataset", "plan_training", "scan_dataset", "target_views",
]


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int  # tensors + CUDA context + allocator slack: what max_memory_reserved / nvidia-smi show
    required_bytes: int  # peak + the memory model's safety margin; must not exceed usable_bytes
    usable_bytes: int
    components: tuple[tuple[str, int], ...]
    it_per_s: float  # optimizer steps per second: what kohya's progress bar shows
    micro_steps_per_s: float  # forward+backward passes per second per device (= it/s at accumulation 1)
    samples_per_s: float  # across all devices
    seconds_per_step: float  # one optimizer step (all accumulation micro-steps)
    total_seconds: float
    optimizer_steps: int
    speed_source: str = "model"  # "measured" (this device ran these settings), "measured-scaled" or "model"
    speed_basis: str = "speed model"  # which measurement, when
    memory_source: str = "model"  # "measured" (this device ran these settings), "measured-scaled" or "model"
    memory_basis: str = "memory model"  # which measurement, when, and measured / predicted
    memory_factor: float = 1.0  # what the memory model's peak was multiplied by
    ram_peak_bytes: int = 0  # predicted peak host RAM (autotune.estimate.ram_model)
    ram_usable_bytes: int | None = None  # host RAM the run may use; None: not known, not checked
    ram_components: tuple[tuple[str, int], ...] = ()  # of one process
    ram_processes: int = 1  # processes on the machine, each with ram_components (ram_peak_bytes counts them all)
    ram_turn_bytes: int = 0  # sharded: the denoiser as read, held by one loading process at a time (RamEstimate)
    compile_seconds: float = 0.0  # torch_compile: the measured compile, counted in total_seconds

    @property
    def loading_processes(self) -> str:
        """How the run's processes load the model, for the host-RAM line."""
        if self.ram_turn_bytes:
            return (f"{self.ram_processes} processes loading in turn (the denoiser's "
                    f"{self.ram_turn_bytes / GIB:.1f} GiB held by one at a time)")
        return f"{self.ram_processes} processes loading at once"


@dataclass(frozen=True)
class Plan:
    fits: bool
    message: str
    version: str
    model: str
    family: FamilySpec  # detected once; its name in the JSON
    goal: str
    priority: str
    device: str  # "2 x NVIDIA GeForce RTX 3060 (12.0 GiB)", "CPU"
    num_processes: int
    settings: TrainSettings | None  # kohya's names, the type the engine reports and the OOM ladder uses
    choices: tuple[Choice, ...]
    dataset: DatasetSummary | None
    dataset_config: dict[str, Any]
    prediction: Prediction | None
    launch_command: tuple[str, ...]
    fallbacks: tuple[str, ...]  # what the ladder gave up, in order
    warnings: tuple[str, ...]
    probe_summary: str
    output_dir: str | None
    learned: tuple[str, ...] = ()  # what the measurements taught: settings not proposed (OOM here), and why
    pin_costs: tuple[str, ...] = ()  # what the user's pinned micro-batch split forced down, against the planner's
    # accelerate's --num_cpu_threads_per_process (it sets OMP_NUM_THREADS, torch's intra-op threads): 1 where a GPU
    # runs the step, the physical cores where the CPU does
    cpu_threads: int = 1

    @property
    def memory_unit(self) -> tuple[int, str]:
        """The unit its memory figures print in: GiB, or MiB on an emulated card (a few MiB of tensors)."""
        return memory_unit(self.device)

    @property
    def memory_noun(self) -> str:
        """What its memory figures are: the card's (per device) or, planned for a CPU, the host's."""
        if self.device.startswith(EMULATED_CARD):
            return "memory on the emulated card"
        return "memory (RAM)" if self.device == "CPU" else "VRAM per device"

    def kohya_values(self) -> dict[str, Any]:
        return {c.key: c.value for c in self.choices if c.kohya}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``autotune plan --json``); ``settings`` is ``TrainSettings.to_event()``."""
        out = asdict(self)
        out["family"] = self.family.name
        out["settings"] = self.settings.to_event() if self.settings is not None else None
        out["choices"] = [asdict(c) for c in self.choices]
        if self.prediction is not None:
            out["prediction"]["components"] = dict(self.prediction.components)
            out["prediction"]["peak_gib"] = round(self.prediction.peak_bytes / GIB, 3)
            out["prediction"]["usable_gib"] = round(self.prediction.usable_bytes / GIB, 3)
            out["prediction"]["ram_components"] = dict(self.prediction.ram_components)
            out["prediction"]["ram_processes"] = self.prediction.ram_processes
            out["prediction"]["ram_turn_gib"] = round(self.prediction.ram_turn_bytes / GIB, 3)
            out["prediction"]["ram_peak_gib"] = round(self.prediction.ram_peak_bytes / GIB, 3)
        out["launch_command"] = list(self.launch_command)
        return json.loads(json.dumps(out, default=str))


def _precision(gpus: Sequence[GpuTarget], cpu_bf16: bool = False) -> tuple[str, str]:
    """mixed_precision and its reason: the weakest device decides (all ranks of a DDP run share one setting)."""
    if not gpus:
        from autotune.estimate.speed_model import cpu_bf16_speed

        if cpu_bf16:
            return "bf16", f"no GPU; {cpu_bf16_speed(True)}; the LoRA weights stay fp32"
        return "no", f"no GPU; {cpu_bf16_speed(False)}: fp32"
    if all(g.bf16_capable for g in gpus):
        return "bf16", "compute capability >= 8.0: bf16 has fp32's range, no loss scaling"
    return "fp16", "compute capability < 8.0: no fast bf16, fp16 with loss scaling"


def _fp8_capable(gpu: GpuTarget, min_cc: tuple[int, int] | None) -> bool:
    """fp8_base on this card: the engine's rule (8.9+), or the family profile's lower floor (FLUX: 8.0)."""
    cc = gpu.cc_tuple
    return gpu.fp8_base_capable or (min_cc is not None and cc is not None and cc >= min_cc)


def caching_needs_fp8_t5(family: FamilySpec, usable: int, t5_fp8: bool = False) -> bool:
    """True when caching the text-encoder outputs with a 16-bit T5-XXL (the family's largest text encoder;
    ``t5_fp8``: with it in fp8) would not fit ``usable`` bytes."""
    from autotune.estimate.dit_memory import DitMemoryInputs, predict_dit_memory

    estimate = predict_dit_memory(DitMemoryInputs(resolution=512, family=family.name, blocks_to_swap=0, t5_fp8=t5_fp8))
    return estimate.caching_peak + estimate.components["safety_margin"] > usable


def memory_unit(device: str) -> tuple[int, str]:
    return (2**20, "MiB") if device.startswith(EMULATED_CARD) else (GIB, "GiB")


def _device_label(gpus: Sequence[GpuTarget], emulated_card_bytes: int | None = None) -> str:
    if emulated_card_bytes is not None:
        return emulated_card_label(emulated_card_bytes / 2**20)
    if not gpus:
        return "CPU"
    labels = [f"{g.name} ({g.usable_bytes / GIB:.1f} GiB usable)" for g in gpus]
    if len(set(labels)) == 1:
        return labels[0] if len(labels) == 1 else f"{len(labels)} x {labels[0]}"
    return ", ".join(labels)


@dataclass(frozen=True)
class _Searched:
    """What the search was given and found: the facts the plan's choices are explained from."""

    family: FamilySpec
    dataset: DatasetSummary
    goal: GoalProfile
    devices: int
    precision: str
    precision_reason: str
    usable: int
    preferred_opt: str
    t5_fp8: bool
    te_cpu: bool
    measured: LearnedFigures | None
    predictor: Predictor
    found: SearchResult
    pin_costs: tuple[str, ...] = ()
    sharding_reason: str | None = None  # several cards: data parallel or sharded, and why (planning.sharding)
    state_reason: str | None = None  # ... the LoRA's optimizer state split across them or whole on each, and why


def plan_training(request: PlanRequest) -> Plan:
    """Plan a LoRA training run; see the module docstring for every rule. Deterministic."""
    validate_request(request)
    searched = _search_plan(request)
    found, gpus = searched.found, request.gpus
    device = _device_label(gpus, request.emulated_card_bytes)
    cpu_threads = 1 if gpus else max(1, request.cpu_physical_cores)
    common: dict[str, Any] = dict(
        version=__version__, model=request.model, family=searched.family, goal=request.goal,
        priority=request.priority, device=device, num_processes=searched.devices, dataset=searched.dataset,
        cpu_threads=cpu_threads, fallbacks=found.fallbacks, warnings=tuple(searched.dataset.warnings),
        probe_summary=request.probe_summary, output_dir=request.output_dir,
        learned=_learned_lines(searched.predictor.excluded), pin_costs=searched.pin_costs)
    if request.strict and searched.pin_costs:
        raise UserError(f"--strict: {searched.pin_costs[0]}; pin a smaller split, or drop --strict to accept it")
    if found.chosen is None:
        return Plan(fits=False, message=_nothing_fits(found.smallest, gpus, device), settings=None, choices=(),
                    dataset_config={}, prediction=None, launch_command=(), **common)
    return _fitting_plan(request, searched, found.chosen, common, device, cpu_threads)


def _search_plan(request: PlanRequest) -> _Searched:
    """The family, dataset and card read; the start point; the search over the settings space."""
    family = request.family or detect_family(request.model)
    validate_resolution(request.preferences.resolution, family)
    validate_frames(request.preferences.frames, family)
    media = VIDEO_EXTENSIONS if (request.preferences.frames or 1) > 1 else IMAGE_EXTENSIONS  # clips: its videos
    dataset = request.dataset or (scan_dataset(request.dataset_dir, media) if request.dataset_dir
                                  else nominal_dataset())
    goal = GOAL_PROFILES[request.goal]
    prefs, gpus = request.preferences, request.gpus
    devices = max(1, len(gpus))
    precision, precision_reason = _precision(gpus, request.cpu_bf16)
    usable = min(g.usable_bytes for g in gpus) if gpus else int(request.emulated_card_bytes or
                                                                request.cpu_memory_bytes or 16 * GIB)
    effective = max(devices, max(1, min(goal.effective_batch, dataset.num_images)))
    split = _pinned_split(prefs, effective, devices)
    effective = split[0] * split[1] * devices if split else effective
    preferred_opt = prefs.optimizer or PRIORITY_OPTIMIZER[request.priority]
    profile = plan_profile(family)
    train_te = prefs.train_text_encoder if prefs.train_text_encoder is not None else (
        profile.train_text_encoder if profile.train_text_encoder is not None else not family.is_sdxl)
    # fp8 text encoder while caching where the trainer has it (musubi's FLUX.2 dev: Mistral 3 has no fp8 mode)
    te_fp8_offered = (family.musubi or {}).get("text_encoder_fp8", True) is not None
    t5_fp8 = profile.has_te_fp8 and te_fp8_offered and caching_needs_fp8_t5(family, usable)
    te_cpu = bool(profile.te_cpu_flag) and bool(gpus) and caching_needs_fp8_t5(family, usable, t5_fp8)
    both = wants_both_experts(request, profile.both_experts.file_key if profile.both_experts else None)
    start = start_point(family, side=prefs.resolution or family.resolution, rank=prefs.rank or goal.rank,
                        optimizer=preferred_opt, precision=precision, train_te=train_te, effective=effective,
                        attention=prefs.attention, network=network_choice(prefs, family), frames=prefs.frames or 1,
                        high_noise_expert=both)
    fp8_ok = bool(gpus) and prefs.allow_fp8 and all(_fp8_capable(g, profile.fp8_min_compute_capability)
                                                     for g in gpus)
    measured = learned_for(request, family, devices)
    predictor = Predictor(family, gpus, request.cpu_physical_cores, t5_fp8=t5_fp8, te_cpu=te_cpu,
                          cpu_bf16=request.cpu_bf16, learned=measured, usable=usable,
                          memory=memory_view(request, bool(gpus), devices))
    found = search(start, family, goal, fp8_ok=fp8_ok, effective=effective,
                   devices=devices, usable=usable, predictor=predictor, split=split)

    def again(point: TrainSettings) -> SearchResult:
        return search(point, family, goal, fp8_ok=fp8_ok, effective=effective, devices=devices, usable=usable,
                      predictor=predictor, split=split)

    found, sharding_reason, state_reason = several_cards(start, family, devices, found, again)
    if split and found.chosen is None:  # the user's batch fits nowhere: the planner's own split, said why
        need = found.smallest.required / GIB
        found = search(start, family, goal, fp8_ok=fp8_ok, effective=effective, devices=devices, usable=usable,
                       predictor=predictor)
        found = replace(found, fallbacks=(f"your micro-batch {split[0]} x {split[1]} does not fit (needs "
                                          f"{need:.1f} GiB at the smallest settings, {usable / GIB:.1f} usable): "
                                          "the fastest split that does", *found.fallbacks))
    costs: tuple[str, ...] = ()
    if split and found.chosen is not None and found.fallbacks:  # did the user's split cost what the plan's would not?
        free = search(start, family, goal, fp8_ok=fp8_ok, effective=effective, devices=devices, usable=usable,
                      predictor=predictor)
        costs = pin_costs(split, found.chosen.settings, free.chosen.settings if free.chosen else None)
    return _Searched(family=family, dataset=dataset, goal=goal, devices=devices, precision=precision,
                     precision_reason=precision_reason, usable=usable, preferred_opt=preferred_opt, t5_fp8=t5_fp8,
                     te_cpu=te_cpu, measured=measured, predictor=predictor, found=found, pin_costs=costs,
                     sharding_reason=sharding_reason, state_reason=state_reason)


def pin_costs(split: tuple[int, int], pinned: TrainSettings, free: TrainSettings | None) -> tuple[str, ...]:
    """What a pinned (micro-batch, accumulation) forced down that the planner's own split keeps: one line, or ()."""
    if free is None:
        return ()
    lowered = []
    if pinned.network_dim < free.network_dim:
        lowered.append(f"rank {free.network_dim} -> {pinned.network_dim}")
    if pinned.resolution[0] * pinned.resolution[1] < free.resolution[0] * free.resolution[1]:
        lowered.append(f"resolution {free.resolution[0]} -> {pinned.resolution[0]}")
    if pinned.network_train_unet_only and not free.network_train_unet_only:
        lowered.append("the text encoders no longer trained")
    if pinned.frames < free.frames:
        lowered.append(f"frames {free.frames} -> {pinned.frames}")
    if not lowered:
        return ()
    return (f"your micro-batch {split[0]} x {split[1]} forces {', '.join(lowered)} to fit (the planner's "
            f"{free.train_batch_size} x {free.gradient_accumulation_steps} keeps rank {free.network_dim} at "
            f"{free.resolution[0]} px)",)


def _fitting_plan(request: PlanRequest, searched: _Searched, fitting: Scored, common: dict[str, Any], device: str,
                  cpu_threads: int) -> Plan:
    """The plan around the settings the search chose: host RAM, length, prediction, compile, choices."""
    family, dataset, goal, devices = searched.family, searched.dataset, searched.goal, searched.devices
    found, predictor, usable, gpus, prefs = searched.found, searched.predictor, searched.usable, request.gpus, \
        request.preferences
    host_swap = decide_host_swap(fitting, predictor, usable=usable, host_ram=request.host_ram_bytes) \
        if family.trains_with.host_swap_options and gpus else HostSwapChoice(fitting)
    chosen = host_swap.chosen
    s = chosen.settings if prefs.alpha is None else replace(chosen.settings, network_alpha=prefs.alpha)
    effective_real = s.train_batch_size * s.gradient_accumulation_steps * devices
    short_cpu_run = not gpus and is_tiny_scale(family) and not prefs.epochs
    length = training_length(goal, request.priority, dataset.num_images, dataset.views_per_epoch, effective_real,
                             prefs.epochs, short_cpu_run, pinned_steps=prefs.steps)
    seconds_per_step = s.gradient_accumulation_steps / chosen.it_per_s
    # a DiT's own host-RAM model is a GPU run's (swapped blocks, parked encoders, a CUDA process); on a CPU the
    # tensors themselves live in RAM, without the CUDA context the device peak counts
    modelled = (chosen.host_ram_loading, chosen.host_ram) if chosen.host_ram and gpus else None
    host_tensors = sum(v for k, v in chosen.components if k not in ("cuda_context", "safety_margin"))
    ram = plan_host_ram(request, family, s, dataset.num_images, host_tensors, modelled=modelled,
                        own_model=bool(chosen.host_ram), processes=devices)
    common.update(fallbacks=found.fallbacks + ram.fallbacks, warnings=common["warnings"] + ram.warnings)
    prediction = Prediction(
        peak_bytes=chosen.peak, required_bytes=chosen.required, usable_bytes=usable, components=chosen.components,
        it_per_s=1.0 / seconds_per_step, micro_steps_per_s=chosen.it_per_s, samples_per_s=chosen.samples_per_s,
        seconds_per_step=seconds_per_step, total_seconds=length.steps * seconds_per_step,
        optimizer_steps=length.steps, ram_peak_bytes=ram.estimate.peak_bytes, ram_usable_bytes=ram.usable_bytes,
        ram_components=tuple(ram.estimate.components.items()), ram_processes=ram.estimate.processes,
        ram_turn_bytes=ram.estimate.turn_bytes,
        **_sources(predictor.predict(s)),
    )
    compiling = decide_compile(searched.measured, s, seconds_per_step, length.steps, usable / 2**20 if gpus else None)
    if compiling.on:
        s, prediction = replace(s, torch_compile=True, dynamo_backend=compiling.backend), compiled(prediction,
                                                                                                   compiling)
    context = PlanContext(request=request, family=family, dataset=dataset, goal=goal, settings=s, devices=devices,
                          effective=effective_real, epochs=length.epochs, steps=length.steps,
                          target_views=length.target_views, precision_reason=searched.precision_reason,
                          fallbacks=found.fallbacks, preferred_opt=searched.preferred_opt, usable=usable,
                          peak=chosen.peak, workers=ram.workers, t5_fp8=searched.t5_fp8, te_cpu=searched.te_cpu,
                          host_ram=chosen.host_ram, compile_reason=compiling.reason,
                          pinned_reason=host_swap.pinned_reason, offload_reason=host_swap.offload_reason,
                          sharding_reason=searched.sharding_reason, state_reason=searched.state_reason)
    unit, unit_name = memory_unit(device)
    summary = (f"{family.name} on {device}: micro-batch {s.train_batch_size} x accumulation "
               f"{s.gradient_accumulation_steps}{f' x {devices} devices' if devices > 1 else ''}, "
               f"{s.resolution[0]} px, rank {s.network_dim}, "
               + (f"{s.blocks_to_swap} blocks swapped, " if s.blocks_to_swap else "") +
               f"predicted peak {chosen.peak / unit:.2f} of {usable / unit:.2f} {unit_name} usable")
    choices = plan_choices(context)
    return Plan(fits=True, message=summary, settings=_with_written_rates(s, choices), choices=choices,
                dataset_config=dataset_config(s, dataset, family), prediction=prediction,
                launch_command=launch_command(family, devices, searched.precision, request.output_dir,
                                               cpu_threads),
                **common)


def compiled(prediction: Prediction, compiling: CompileDecision) -> Prediction:
    """The prediction with the measured compiled step, and the compile counted once in the run's time."""
    step = compiling.seconds_per_step
    if step is None:  # nothing measured compiled: the eager prediction stands
        return prediction
    faster = prediction.seconds_per_step / step
    return replace(prediction, seconds_per_step=step, it_per_s=1.0 / step,
                   micro_steps_per_s=prediction.micro_steps_per_s * faster,
                   samples_per_s=prediction.samples_per_s * faster,
                   total_seconds=prediction.optimizer_steps * step + compiling.compile_seconds,
                   compile_seconds=compiling.compile_seconds, speed_source="measured", speed_basis=compiling.basis)


def _pinned_split(prefs: Preferences, effective: int, devices: int) -> tuple[int, int] | None:
    """The user's (micro-batch, accumulation): both given; the batch alone (accumulation makes up the goal's
    effective batch); or the accumulation alone (the micro-batch makes up the rest)."""
    batch, accum = prefs.batch, prefs.accum
    if batch is not None:
        return batch, accum if accum is not None else max(1, round(effective / (batch * devices)))
    if accum is not None:
        return max(1, round(effective / (accum * devices))), accum
    return None


def memory_view(request: PlanRequest, on_gpu: bool, devices: int) -> MemoryView:
    """How the memory model is read for this plan: an emulated card, a deliberately scaled model, and on a GPU this
    device's CUDA context as a run here measured it (in place of the model's constant)."""
    from autotune.measure.learned import measured_cuda_context

    context = measured_cuda_context(request.measurements, request.measured_device) \
        if on_gpu and request.measured_device is not None and devices == 1 else None
    return MemoryView(emulated=request.emulated_card_bytes is not None, scale=request.memory_scale,
                      cuda_context_gib=context.mib / 1024 if context else None,
                      context_basis=context.basis if context else "")


def learned_for(request: PlanRequest, family: FamilySpec, devices: int) -> LearnedFigures | None:
    """This device's measurements for ``family`` (None: none given, or a multi-GPU plan, which no single-device
    measurement describes)."""
    if not request.measurements or request.measured_device is None or devices > 1:
        return None
    from autotune.measure.learned import LearnedFigures

    return LearnedFigures(request.measurements, request.measured_device, family) or None


def _learned_lines(excluded: dict[TrainSettings, str]) -> tuple[str, ...]:
    from autotune.measure.learned import short_settings

    return tuple(f"not proposed: {short_settings(s)}: {why}" for s, why in excluded.items())


def _sources(estimate: Estimate) -> dict[str, Any]:
    return {"speed_source": estimate.speed_source, "speed_basis": estimate.speed_basis,
            "memory_source": estimate.memory_source, "memory_basis": estimate.memory_basis,
            "memory_factor": estimate.memory_factor}


# TrainSettings fields the plan's choices write (the search itself never varies them)
_RATE_FIELDS = ("learning_rate", "unet_lr", "text_encoder_lr", "lr_scheduler", "lr_warmup_steps", "max_grad_norm",
                "full_fp16", "full_bf16")


def _with_written_rates(s: TrainSettings, choices: Sequence[Choice]) -> TrainSettings:
    """The searched settings plus the learning-rate, clipping and precision values the choices write, so
    ``plan.settings`` is what the engine will read back from the files (the stability ladder starts there)."""
    written = {c.key: c.value for c in choices if c.kohya and c.key in _RATE_FIELDS}
    if isinstance(written.get("text_encoder_lr"), list):
        written["text_encoder_lr"] = tuple(float(lr) for lr in written["text_encoder_lr"])
    return replace(s, **written)


def _nothing_fits(smallest: Scored, gpus: Sequence[GpuTarget], device: str) -> str:
    """What the smallest configuration of the last ladder point needs, and on what card it would fit."""
    s = smallest.settings
    need = smallest.required + (max(g.held_bytes for g in gpus) if gpus else 0)
    fix = (f"use a card with at least {math.ceil(need / GIB)} GB free, or free memory held by other processes" if gpus
           else f"free memory (at least {math.ceil(need / GIB)} GB), or plan for a card with --gpu / --vram")
    return (f"nothing fits {device}: the smallest configuration "
            f"({s.resolution[0]} px, batch 1, rank {s.network_dim}, gradient checkpointing, {s.optimizer_type}"
            f"{', fp8 base' if s.fp8_base else ''}{', UNet only' if s.network_train_unet_only else ''}) "
            f"needs {smallest.required / GIB:.1f} GiB with the safety margin; {fix}")
