"""Every setting a plan writes into config.toml, each with the rule that chose it (its reason).

``plan_choices`` lists them in the order the file shows them, one function per section (model and
dataset, network, optimizer, training, saving, informational); the reasons are the comments above
each key in config.toml and the "reason" column of ``autotune plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.layout import LOGS_DIR
from autotune.planning.dataset import DatasetSummary
from autotune.planning.goals import GoalProfile, learning_rate
from autotune.planning.host_ram import default_workers
from autotune.planning.profiles import FP8_FILE_KEY, plan_profile
from autotune.planning.request import GIB, PlanRequest
from autotune.planning.resolution import TINY_CPU_MAX_STEPS, bucket_rules, bucket_step_reason, is_tiny_scale
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import config_values

if TYPE_CHECKING:
    from autotune.planning.profiles import PlanProfile

OPTIMIZER_REASONS = {
    "AdamW8bit": "8-bit Adam state (2 bytes/param instead of 8), same quality in practice",
    "AdamW": "fp32 Adam state: the reference optimizer (priority quality)",
    "Prodigy": "Prodigy estimates its own step size (learning rates 1.0)",
}
PRODIGY_ARGS = ["decouple=True", "weight_decay=0.01", "use_bias_correction=True", "safeguard_warmup=True"]


@dataclass(frozen=True)
class Choice:
    """One planned setting. ``kohya`` False: informational (effective batch, devices), not a config key."""

    key: str
    value: Any
    reason: str
    kohya: bool = True
    placeholder: bool = False  # a path for the user to fill in: no file was given for it
    model_file: bool = False  # one of the files the family's trainer reads beside the model (clip_l, t5xxl, ae, ...)


@dataclass(frozen=True)
class PlanContext:
    """What the choices are made from: the request, the search's settings and the amount of training."""

    request: PlanRequest
    family: FamilySpec
    dataset: DatasetSummary
    goal: GoalProfile
    settings: TrainSettings
    devices: int
    effective: int
    epochs: int
    steps: int
    target_views: int
    precision_reason: str
    fallbacks: tuple[str, ...]
    preferred_opt: str
    usable: int
    peak: int
    workers: int | None = None  # data loader workers after the host-RAM check (None: the default rule)
    t5_fp8: bool = False  # FLUX: plan an fp8 T5-XXL file (caching would not fit with the 16-bit one)
    host_ram: int = 0
    te_cpu: bool = False  # HunyuanImage: cache on the CPU (even the fp8 encoders do not fit)
    compile_reason: str = "eager"  # why torch_compile is on or off (planning.compile_choice)
    pinned_reason: str | None = None  # why the swapped blocks are pinned or not (planning.host_swap)
    offload_reason: str | None = None  # Wan 2.2, both experts: why the inactive one is offloaded or not
    sharding_reason: str | None = None  # several cards: why data parallel or sharded (planning.sharding)
    state_reason: str | None = None  # ... why the LoRA's optimizer state is split across them or whole on each

    @property
    def values(self) -> dict[str, Any]:
        """The settings' kohya values: the one mapping (``settings_space.config_values``) every key below reads."""
        return config_values(self.settings, self.family.config_keys)

    @property
    def text_encoder_fp8(self) -> bool:
        """The largest text encoder is in fp8 for caching (SD3: only under fp8_base, which keeps the file's fp8)."""
        return plan_profile(self.family).text_encoder_fp8(self.t5_fp8, self.settings.fp8_base)

    @property
    def side(self) -> int:
        """The (square) training resolution in px."""
        return self.settings.resolution[0]


def _state_split_choices(split: bool, keys: tuple[tuple[str, Any], ...], reason: str) -> list[Choice]:
    """The rows that split the LoRA's optimizer state across the cards, written where split: lora-autotune's
    engine's ``shard_optimizer_state``; sd-scripts' DeepSpeed at ZeRO stage 2. Kept whole: the first key, off,
    with why (not written)."""
    if not split:
        return [Choice(keys[0][0], False, reason, kohya=False)]
    (first, value), *rest = keys
    why = {"zero_stage": "DeepSpeed's stage that splits the optimizer's state and the gradients, not the model "
                         "(its stage 3 fails or hangs while sd-scripts loads the model, process by process)"}
    written = {"deepspeed": " (sd-scripts' DeepSpeed: install it in sd-scripts' venv with DS_BUILD_OPS=0 pip install "
                            "deepspeed; the accelerate launch command stays as it is)"}
    return [Choice(first, value, reason + written.get(first, "")),
            *(Choice(key, entry, why.get(key, reason)) for key, entry in rest)]


def model_files(req: PlanRequest, profile: PlanProfile, text_encoder_fp8: bool,
                both_experts: bool = False) -> dict[str, tuple[str, str]]:
    """The separate model files the family's script takes (FLUX: CLIP-L, T5-XXL, AE; Wan 2.2's second expert
    when both train), each the file the user gave or a placeholder to edit; none for a builtin:<id> model, none
    for a part the model file holds itself."""
    two = profile.both_experts
    takes = [key for key in profile.model_files if key != FP8_FILE_KEY] + ([two.file_key] if two else [])
    for key, _ in req.model_files:
        if key not in takes:
            raise UserError(f"--{key}: {req.model} takes no {key} file"
                            + (f"; its script takes {', '.join(takes)}" if takes else " (one file holds it all)"))
    given = {key: (path, "the file you gave") for key, path in req.model_files}
    if req.model.startswith("builtin:"):
        return given  # a built-in brings its own parts; a given file replaces one
    files = dict(profile.model_files)
    if two and both_experts:
        files[two.file_key] = (two.placeholder, two.file_reason)
    fp8_t5 = files.pop(FP8_FILE_KEY, None)
    if text_encoder_fp8 and fp8_t5 is not None:  # caching with the 16-bit T5-XXL would not fit this card
        files["t5xxl"] = fp8_t5
    for key in parts_inside(req.model, profile.model_files_inside or {}):
        files.pop(key, None)
    files.update(given)
    return files


def parts_inside(model: str, prefixes: dict[str, str]) -> list[str]:
    """The keys of ``prefixes`` whose part the model file holds (read from its header alone)."""
    from sd_scripts_compat.safetensors_file import read_entries

    path = Path(model).expanduser()
    if not prefixes or not path.is_file() or path.suffix.lower() != ".safetensors":
        return []
    try:
        with path.open("rb") as handle:
            keys = read_entries(handle)[0]
    except (OSError, ValueError, KeyError, TypeError):
        return []  # detection has said what is wrong with the file
    return [key for key, prefix in prefixes.items() if any(k.startswith(prefix) for k in keys)]


def plan_choices(c: PlanContext) -> tuple[Choice, ...]:
    """Every setting in config.toml, with its reason, in the order the file shows them; the settings the user gave
    (``Preferences.settings``) in place of the plan's own."""
    planned = [*_model_and_dataset(c), *_network(c), *_optimizer(c), *_training(c), *_saving(c)]
    return (*user_settings(planned, c.request.preferences.settings), *_informational(c))


def user_settings(planned: list[Choice], given: tuple[tuple[str, Any], ...]) -> list[Choice]:
    """The choices with each setting the user gave in place of the plan's value (the plan's said in the reason),
    and the ones the plan does not set added after them."""
    yours = dict(given)
    out = [replace(c, value=yours.pop(c.key), reason=f"yours (the plan's {c.value!r}: {c.reason})")
           if c.key in yours else c for c in planned]
    return out + [Choice(key, value, f"yours (--{key})") for key, value in yours.items()]


def _model_and_dataset(c: PlanContext) -> list[Choice]:
    s, fam, req = c.settings, c.family, c.request
    out = [Choice("pretrained_model_name_or_path", req.model,
                  "builtin:<id> is understood by lora-autotune's engine only" if req.model.startswith("builtin:")
                  else "the base model you gave")]
    if req.allow_pickle:
        out.append(Choice("allow_pickle", True, "you allowed this pickle checkpoint; lora-autotune's engine loads "
                                                "it with torch.load(weights_only=True) (sd-scripts ignores this key)"))
    if fam.v2:
        out.append(Choice("v2", True, "SD 2.x: OpenCLIP text encoder and 1024-wide cross-attention"))
    if fam.v_parameterization:
        out.append(Choice("v_parameterization", True, "768-v model: the UNet predicts v, not noise"))
    profile = plan_profile(fam)
    given = dict(req.model_files)
    files = model_files(req, profile, c.text_encoder_fp8, both_experts=c.settings.high_noise_expert)
    out += [Choice(key, path, reason if key in given else f"fill in your file (or plan with --{key} FILE): {reason}",
                   placeholder=key not in given, model_file=True) for key, (path, reason) in files.items()]
    kept = [key for key in profile.model_files if key != FP8_FILE_KEY and key not in given]
    if req.model.startswith("builtin:") and kept:  # sd-scripts would take these as files
        out.append(Choice("model_files", "built in", f"this built-in brings its own {', '.join(kept)}; for "
                          f"sd-scripts, plan its files: --model FILE {' '.join(f'--{k} FILE' for k in kept)}",
                          kohya=False))
    if c.text_encoder_fp8 and profile.te_fp8_flag and not c.te_cpu:
        out.append(Choice(profile.te_fp8_flag, True, "caching the text-encoder outputs with the 16-bit "
                          "text encoder would not fit this card: its weights in fp8 while caching"))
    if c.te_cpu and profile.te_cpu_flag:
        out.append(Choice(profile.te_cpu_flag, True, "the text encoder does not fit this card beside CUDA even "
                          "in its smallest dtype: it caches on the CPU (slow: minutes per caption, once)"))
    here = req.output_dir is not None
    out.append(Choice("dataset_config", str(Path(req.output_dir).expanduser().resolve() / "dataset.toml")
                      if req.output_dir is not None else "dataset.toml",
                      "images, repeats and captions: the dataset.toml written next to this file" if here
                      else "images, repeats and captions: dataset.toml, relative to the folder you launch from"))
    pinned = req.preferences.resolution
    res_reason = (f"{fam.name}'s native size" if c.side == fam.resolution and not pinned
                  else "your --resolution" if pinned and c.side == pinned
                  else f"lowered from {fam.resolution}: nothing fit at the native size (quality cost)")
    step, min_bucket = bucket_rules(fam, c.side)
    out += [
        Choice("resolution", c.values["resolution"], res_reason + "; activation memory grows with its square"),
        Choice("enable_bucket", True, "keeps each image's aspect ratio; bucket area never exceeds resolution^2"),
        Choice("min_bucket_reso", min_bucket, min_bucket_reason(min_bucket, c.side, step)),
        Choice("max_bucket_reso", c.values["max_bucket_reso"],
               ("twice the resolution" if c.values["max_bucket_reso"] == 2 * c.side
                else f"{c.values['max_bucket_reso']} px") + ": tall/wide images keep their shape"),
        Choice("bucket_reso_steps", step, bucket_step_reason(step)),
        Choice("bucket_no_upscale", True, "small images are not blown up past their own size"),
        *([Choice("target_frames", c.settings.frames,
                  f"your --frames: {c.settings.frames} frames per clip ({fam.latent_frames(c.settings.frames)} latent "
                  "frames); activation memory grows with them", kohya=False)] if c.settings.frames > 1 else
          [Choice("target_frames", 1, "images (one frame); --frames N trains clips", kohya=False)]
          if (fam.musubi or {}).get("video") else []),
        Choice("cache_latents", True, "VAE encodes each image once; the VAE leaves memory and steps skip the "
                                      "encoder"),
        Choice("cache_latents_to_disk", True, "reruns and OOM retries reuse the cache (files next to the images)"),
    ]
    if s.cache_text_encoder_outputs:
        out.append(Choice("cache_text_encoder_outputs", True,
                          (profile.cache_text_encoder_outputs_reason
                           or "text encoders run once and leave memory (SDXL UNet-only training)")
                          + "; captions cannot be shuffled"))
    default = default_workers(req)
    workers = default if c.workers is None else c.workers
    reason = (f"lowered from {default}: host RAM (each worker is a process with its own pages and batches)"
              if workers < default else "your --workers" if req.preferences.workers is not None
              else "training on the CPU: the step's threads use every core, and a batch of cached latents loads "
                   "in the main process, so no worker takes a core from the step" if not req.gpus
              else f"{req.cpu_physical_cores} physical cores; cached latents make a batch cheap to load, "
              "so 0-2 workers")
    out.append(Choice("max_data_loader_n_workers", workers, reason))
    if workers > 0:
        out.append(Choice("persistent_data_loader_workers", True, "workers survive between epochs (no restart stall)"))
    return out


def _network(c: PlanContext) -> list[Choice]:
    s, req, goal = c.settings, c.request, c.goal
    profile = plan_profile(c.family)
    pinned = req.preferences.rank
    rank_reason = ("your --rank" if pinned and s.network_dim == pinned
                   else f"goal {req.goal}: rank {goal.rank}" if s.network_dim == goal.rank
                   else f"lowered from {pinned or goal.rank} to fit memory (fewer LoRA parameters)")
    lycoris = s.network_module != profile.network_module
    out = [
        Choice("network_module", s.network_module, "LyCORIS through lycoris-lora, as asked (--network)" if lycoris
               else profile.network_module_reason),
        Choice("network_dim", c.values["network_dim"], rank_reason),
        Choice("network_alpha", c.values["network_alpha"],
               f"your --alpha: LoRA scale {float(s.network_alpha or 0) / s.network_dim:g}"
               if req.preferences.alpha is not None
               else "alpha = rank / 2: LoRA scale 0.5 whatever the rank, so the learning rate holds"),
    ]
    if s.network_args:
        out.append(Choice("network_args", list(s.network_args),
                          "the LyCORIS algorithm and its options (parameters counted by lycoris-lora itself)"
                          if lycoris else "your --network-arg entries"))
    if s.network_train_unet_only:
        te_reason = ("UNet only: fit memory" if any(f.startswith("UNet only") for f in c.fallbacks)
                     else "your choice" if req.preferences.train_text_encoder is False
                     else "text-encoder outputs are cached: the transformer trains alone"
                     if profile.cache_text_encoder_outputs
                     else "SDXL: training its two text encoders costs much memory for little gain")
        out.append(Choice("network_train_unet_only", True, te_reason))
    return out


def _optimizer(c: PlanContext) -> list[Choice]:
    s, req, goal = c.settings, c.request, c.goal
    opt_reason = OPTIMIZER_REASONS.get(s.optimizer_type, f"{s.optimizer_type}, as sd-scripts builds it")
    if s.optimizer_type != c.preferred_opt:
        opt_reason = f"switched from {c.preferred_opt} to fit memory; " + opt_reason
    elif req.preferences.optimizer:
        opt_reason = "your --optimizer; " + opt_reason
    out = [Choice("optimizer_type", c.values["optimizer_type"], opt_reason)]
    if s.optimizer_type == "Prodigy":
        out.append(Choice("optimizer_args", list(PRODIGY_ARGS), "Prodigy's usual LoRA settings (decoupled weight "
                                                                "decay)"))
        unet_lr, te_lr = 1.0, 1.0
        lr_reason = "Prodigy: 1.0 means 'use the estimated step size'"
    else:
        unet_lr = learning_rate(goal, c.effective)
        te_lr = float(f"{unet_lr / 2:.3g}")
        lr_reason = (f"goal {req.goal}: {goal.unet_lr:g} x sqrt(effective batch {c.effective} / 4), "
                     "clamped to [2.5e-5, 4e-4]")
    if req.preferences.learning_rate is not None:
        unet_lr, te_lr = req.preferences.learning_rate, float(f"{req.preferences.learning_rate / 2:.3g}")
        lr_reason = "your --lr"
    out += [Choice("learning_rate", unet_lr, "same as unet_lr (kohya uses the per-part rates below)"),
            Choice("unet_lr", unet_lr, lr_reason)]
    if not s.network_train_unet_only:
        out.append(Choice("text_encoder_lr", [te_lr], "half the UNet rate: text encoders overfit fast"))
    out += [Choice("lr_scheduler", "cosine", "decays to zero by the last step"),
            Choice("lr_warmup_steps", int(round(0.05 * c.steps)),
                   f"5% of {c.steps} steps: protects the fresh LoRA from large early updates")]
    return out


def _training(c: PlanContext) -> list[Choice]:
    s, fam, req, goal = c.settings, c.family, c.request, c.goal
    mb, accum = c.values["train_batch_size"], c.values["gradient_accumulation_steps"]
    pinned = req.preferences.batch is not None and mb == req.preferences.batch
    out = [
        Choice("train_batch_size", mb, f"{'your --batch' if pinned else 'fastest fitting micro-batch'}: predicted "
                                       f"peak {c.peak / GIB:.2f} GiB of {c.usable / GIB:.2f} GiB usable per device"),
        Choice("gradient_accumulation_steps", accum, f"effective batch {c.effective} = {mb} x {accum}"
               + (f" x {c.devices} devices" if c.devices > 1 else "") + f" (goal {req.goal} wants "
               f"{goal.effective_batch})"),
        Choice("gradient_checkpointing", c.values["gradient_checkpointing"],
               "needed to fit: recomputes activations in backward (~30% slower, far less memory)"
               if s.gradient_checkpointing else "off: everything fits without recomputing activations (faster)"),
        Choice("mixed_precision", c.values["mixed_precision"], c.precision_reason),
        Choice("torch_compile", s.torch_compile, c.compile_reason),
    ]
    if s.torch_compile:
        out.append(Choice("dynamo_backend", s.dynamo_backend, "the backend of the measured compiled run"))
    profile = plan_profile(fam)
    if s.fp8_base and fam.fp8_option:
        out.append(Choice(fam.fp8_option, True, "nothing fit with 16-bit weights: " + (profile.fp8_reason or (
            "last resort to fit: frozen base weights stored in fp8 (half of 16-bit; slight quality cost)"))))
    if s.blocks_to_swap:
        out.append(Choice("blocks_to_swap", c.values["blocks_to_swap"], swap_reason(c)))
    if c.devices > 1:
        out.append(Choice("ddp_gradient_as_bucket_view", True, (
            "several processes: DDP's gradients are views into its all-reduce buckets, one copy of the LoRA's "
            "gradients instead of two (PyTorch's gradient_as_bucket_view; sd-scripts' and musubi-tuner's option, "
            "lora-autotune's engine keeps no second copy either way)")))
    if s.fsdp:
        out.append(Choice("fsdp", s.fsdp, f"{c.sharding_reason} (lora-autotune's engine; sd-scripts ignores this "
                                          "key)"))
        out.append(Choice("fsdp_offload_params", s.fsdp_offload_params, (
            "sharded alone fits no card without giving something up (the fsdp row says what): each process's share "
            "of the denoiser waits in pinned host RAM and is copied in for each gather (accelerate's name; "
            "lora-autotune's engine)") if s.fsdp_offload_params else
            "each process's share stays on its card (fits without offloading to host RAM)"))
        if s.fsdp == "hybrid_shard":
            out.append(Choice("fsdp_shard_size", s.fsdp_shard_size, (
                f"each group of {s.fsdp_shard_size} of the {c.devices} cards shards one copy of the denoiser and "
                "gathers within itself (the fsdp row says why; lora-autotune's engine)")))
    if c.state_reason is not None:  # written where split, under the trainer's keys
        out += _state_split_choices(s.shard_optimizer_state, fam.config_keys.state_split, c.state_reason)
    if c.pinned_reason is not None:
        out.append(Choice("use_pinned_memory_for_block_swap", s.use_pinned_memory_for_block_swap, c.pinned_reason))
    if c.offload_reason is not None:
        out.append(Choice("offload_inactive_dit", s.offload_inactive_dit, c.offload_reason))
    fixed = fixed_keys(profile, s.high_noise_expert)
    # one attention flag: the user's xformers replaces the family's own sdpa; else the family's reason, where it has one
    out += [Choice(key, value, reason) for key, value, reason in fixed if not (s.xformers and key == "sdpa")]
    if s.xformers:
        out.append(Choice("xformers", True, "your --attention xformers: memory-efficient attention kernel"))
    elif "sdpa" not in {key for key, _, _ in fixed}:
        out.append(Choice("sdpa", True, "PyTorch scaled-dot-product attention: flash / memory-efficient kernels, "
                                        "no extra install"))
    if fam.is_sdxl and s.mixed_precision == "fp16":
        out.append(Choice("no_half_vae", True, "SDXL's VAE overflows in fp16 (NaN latents); it only runs while "
                                               "caching"))
    epochs_reason = (f"~{c.target_views} image-views for goal {req.goal} ({c.dataset.num_images} {c.dataset.noun}, "
                     f"{c.dataset.views_per_epoch} views per epoch) -> {c.steps} optimizer steps")
    if not req.gpus and is_tiny_scale(fam) and not req.preferences.epochs:
        epochs_reason += f"; tiny model on CPU: capped to a short run (<= {TINY_CPU_MAX_STEPS} steps, >= 1 epoch)"
    length = Choice("max_train_steps", c.steps, f"your --steps ({c.epochs} epochs of {c.dataset.views_per_epoch} "
                    "views, the last one partly)") if req.preferences.steps else \
        Choice("max_train_epochs", c.epochs, epochs_reason)
    out += [length, Choice("seed", req.preferences.seed, "fixed seed: reruns are reproducible")]
    return out


def fixed_keys(profile: PlanProfile, both_experts: bool) -> tuple[tuple[str, Any, str], ...]:
    """The profile's fixed keys; with two experts, its one-expert keys replaced by the two-expert ones."""
    two = profile.both_experts
    if not (two and both_experts):
        return profile.fixed
    return (*(entry for entry in profile.fixed if entry[0] not in two.drop), *two.fixed)


def swap_reason(c: PlanContext) -> str:
    """Why this many blocks: the fewest that fit, where they live, and what the copies cost per step."""
    from autotune.estimate.dit_memory import dit_inputs_for_settings, predict_dit_memory
    from autotune.estimate.dit_speed import dit_step_flops, swap_seconds

    inputs = replace(dit_inputs_for_settings(c.family, c.settings, t5_fp8=c.text_encoder_fp8),
                     text_encoders_on_cpu=c.te_cpu)
    estimate = predict_dit_memory(inputs)
    double, single = c.family.swap_split(c.settings.blocks_to_swap)
    blocks = (f"{double} double + {single} single" if c.family.swap_block_counts[1]
              else f"the last {double} of {c.family.swap_block_counts[0]}")
    gpus = c.request.gpus
    cost = ""
    if gpus:
        link = swap_seconds(inputs, gpus[0].spec)
        cost = (f"; copying them costs ~{link:.2f} s of host-link time per micro-step against "
                f"{dit_step_flops(inputs)['total'] / 1e12:.0f} TFLOP of compute it overlaps")
    each = " of each expert (both train)" if c.settings.high_noise_expert else ""
    return (f"the fewest swapped blocks that fit ({blocks}{each}): "
            f"{estimate.swapped_bytes / GIB:.1f} GiB of their weights{' per expert' if each else ''} wait in host RAM "
            f"(~{estimate.host_ram_bytes / GIB:.0f} GiB RAM in all while training){cost}")


def output_paths(request: PlanRequest) -> tuple[str, str]:
    """(output_dir, logging_dir): relative to the launch folder, or the run folder's (``autotune.layout``): the
    LoRA beside the configs, TensorBoard's logs in ``logs/``."""
    if request.output_dir is None:
        return "./output", "./logs"
    base = Path(request.output_dir).expanduser().resolve()
    return str(base), str(base / LOGS_DIR)


def output_name(request: PlanRequest, dataset: DatasetSummary, family: FamilySpec) -> str:
    if request.preferences.output_name:
        return request.preferences.output_name
    stem = Path(dataset.root).name if request.dataset_dir else "lora"
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in stem).strip("_") or "lora"
    return f"{safe}-{family.name}"


def _saving(c: PlanContext) -> list[Choice]:
    output_dir, logging_dir = output_paths(c.request)
    every = max(1, math.ceil(c.epochs / 4))  # about four LoRA files to compare
    return [
        Choice("output_dir", output_dir, "trained LoRA files go here"),
        Choice("output_name", output_name(c.request, c.dataset, c.family), "dataset folder and family"),
        Choice("save_model_as", "safetensors", "safe format, kohya's default"),
        Choice("save_precision", "fp16", "half-size LoRA files, loadable everywhere"),
        Choice("save_every_n_epochs", every, checkpoints_reason(c.epochs, every)),
        Choice("logging_dir", logging_dir, "TensorBoard logs"),
        Choice("log_with", "tensorboard", "loss curves without an account"),
    ]


def _informational(c: PlanContext) -> list[Choice]:
    out = [Choice("effective_batch", c.effective, "samples per optimizer step across accumulation and devices",
                  kohya=False),
           Choice("num_processes", c.devices, ("processes (one per GPU), each with 1/N of the transformer"
                                               if c.settings.fsdp else "data-parallel processes (one per GPU)")
                  if c.request.gpus else "one process: no GPU", kohya=False)]
    if c.sharding_reason and not c.settings.fsdp:
        out.append(Choice("sharding", "off", c.sharding_reason, kohya=False))
    if c.fallbacks:
        out.append(Choice("fallbacks", ", ".join(c.fallbacks), "given up, in this order, because nothing fit before",
                          kohya=False))
    return out


def min_bucket_reason(min_bucket: int, side: int, step: int) -> str:
    """Why the smallest bucket side is what it is, in the plan's own numbers."""
    half = side // 2 // step * step
    if min_bucket == half:
        return "half the resolution: narrower buckets waste pixels"
    if min_bucket == side:
        return f"the resolution itself ({side} px): half of it would be below the {min_bucket} px floor of bucket sides"
    return f"the {min_bucket} px floor of bucket sides (half the resolution would be {half} px)"


def checkpoints_reason(epochs: int, every: int) -> str:
    """What ``save_every_n_epochs`` = ``every`` gives: how many LoRA files the run leaves to compare."""
    if epochs <= 1:
        return "a one-epoch run: the LoRA at its end is the only one"
    count = epochs // every + (1 if epochs % every else 0)  # the last epoch's LoRA is written whatever the rhythm
    return f"{count} LoRA files to compare, one every {every} epoch{'s' if every > 1 else ''}"
