"""Training configuration as sd-scripts reads it, checked once at the edge into a typed object.

As sd-scripts: ``--config_file X.toml`` is read with the ``toml`` package, its sections are flattened
one level (section names ignored, a key repeated later wins), and the command line overrides the
file, which overrides the defaults (only flags actually typed override the file).

Unlike sd-scripts, nothing passes unchecked: an unknown key is a one-line error naming the file, the
key and the closest known key; a known key of a GUI wrapper (lora-scripts) gets a warning that it is
ignored; a kohya key this engine does not implement gets a warning naming it; a wrong type is an
error naming the file, the key and the type wanted. The result is a frozen :class:`TrainingConfig`.
"""

from __future__ import annotations

import ast
import difflib
import logging
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.config.bounds import MAX_VALUES, MIN_VALUES, bound_problem
from sd_scripts_compat.config.dataset_config import describe_value, folder_dataset_group, load_dataset_config
from sd_scripts_compat.config.network_args import LYCORIS_MODULE, NetworkArgs, parse_network_args
from sd_scripts_compat.facts.dataset_spec import DatasetGroupSpec, DatasetSpec
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_args import (
    ArgSpec,
    arg_specs,
    build_argparser,
    load_arg_specs,
    script_name,
    scripts_text,
)
from sd_scripts_compat.facts.kohya_toml import flatten, read_toml
from sd_scripts_compat.facts.optimizers import OPTIMIZERS, SCHEDULERS

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

log = logging.getLogger(__name__)

# Keys GUI wrappers write into the TOML they hand to sd-scripts, which sd-scripts ignores. Accepted
# with a warning (key -> what to do instead). Sources: lora-scripts' config/default.toml and
# config/lora.toml templates (lr_restart_cycles, the contrastive keys of later lora.toml versions),
# its GUI forms (mikazuki/schema/*.ts) and the TOML its backend autosaves or exports.
WRAPPER_KEYS: dict[str, str] = {
    "lr_restart_cycles": "lora-scripts template key; the kohya key is lr_scheduler_num_cycles",
    "model_train_type": "lora-scripts GUI key; the entry point (train_network / sdxl_train_network) decides",
    "gpu_ids": "lora-scripts GUI key; choose GPUs with CUDA_VISIBLE_DEVICES or accelerate launch",
    "lora_type": "lora-scripts GUI key",
    "network_args_custom": "lora-scripts GUI key; put the entries into network_args",
    "optimizer_args_custom": "lora-scripts GUI key; put the entries into optimizer_args",
    "lycoris_algo": 'lora-scripts GUI key; write network_module = "lycoris.kohya", network_args = ["algo=locon"]',
    "conv_dim": 'lora-scripts GUI key; write network_args = ["conv_dim=4", "conv_alpha=1"]',
    "conv_alpha": 'lora-scripts GUI key; write network_args = ["conv_dim=4", "conv_alpha=1"]',
    "dropout": "lora-scripts GUI key (LyCORIS dropout); the kohya key is network_dropout",
    "train_norm": 'lora-scripts GUI key (LyCORIS); write network_args = ["train_norm=True"]',
    "dylora_unit": "lora-scripts GUI key (DyLoRA)",
    "lokr_factor": 'lora-scripts GUI key (LyCORIS LoKr); write network_args = ["factor=8"]',
    "enable_block_weights": 'lora-scripts GUI key; write network_args = ["down_lr_weight=..."]',
    "down_lr_weight": 'lora-scripts GUI key; write network_args = ["down_lr_weight=..."]',
    "mid_lr_weight": 'lora-scripts GUI key; write network_args = ["mid_lr_weight=..."]',
    "up_lr_weight": 'lora-scripts GUI key; write network_args = ["up_lr_weight=..."]',
    "block_lr_zero_threshold": 'lora-scripts GUI key; write network_args = ["block_lr_zero_threshold=..."]',
    "enable_base_weight": "lora-scripts GUI key; base_weights is the kohya key",
    "enable_preview": "lora-scripts GUI key; sample_prompts and sample_every_n_epochs drive previews",
    "prompt_file": "lora-scripts GUI key; the kohya key is sample_prompts",
    "positive_prompts": "lora-scripts GUI key; write the prompts to a file named by sample_prompts",
    "negative_prompts": "lora-scripts GUI key; use --n in the sample_prompts file",
    "sample_width": "lora-scripts GUI key; use --w in the sample_prompts file",
    "sample_height": "lora-scripts GUI key; use --h in the sample_prompts file",
    "sample_cfg": "lora-scripts GUI key; use --l in the sample_prompts file",
    "sample_seed": "lora-scripts GUI key; use --d in the sample_prompts file",
    "sample_steps": "lora-scripts GUI key; use --s in the sample_prompts file",
    "randomly_choice_prompt": "lora-scripts GUI key",
    "ui_custom_params": "lora-scripts GUI key",
    "prodigy_d0": 'lora-scripts GUI key; write optimizer_args = ["d0=1e-6"]',
    "prodigy_d_coef": 'lora-scripts GUI key; write optimizer_args = ["d_coef=2.0"]',
    "enable_contrastive": "lora-scripts template key (contrastive loss), not an sd-scripts option",
    "negative_sampling_method": "lora-scripts template key (contrastive loss), not an sd-scripts option",
    "noise_strength": "lora-scripts template key (contrastive loss), not an sd-scripts option",
    "contrastive_weight": "lora-scripts template key (contrastive loss), not an sd-scripts option",
    "contrastive_warmup_steps": "lora-scripts template key (contrastive loss), not an sd-scripts option",
}

# kohya keys the training loop acts on (issue 4's list plus what every run needs). A kohya key outside
# this set that is set to a non-default value gets a "not implemented" warning.
IMPLEMENTED: frozenset[str] = frozenset({
    # model
    "pretrained_model_name_or_path", "v2", "v_parameterization",
    # data
    "train_data_dir", "reg_data_dir", "dataset_config", "prior_loss_weight", "resolution", "train_batch_size",
    "caption_extension", "caption_separator", "shuffle_caption", "keep_tokens", "keep_tokens_separator",
    "caption_prefix", "caption_suffix", "caption_dropout_rate", "caption_dropout_every_n_epochs",
    "caption_tag_dropout_rate", "color_aug", "flip_aug", "random_crop", "face_crop_aug_range",
    "token_warmup_min", "token_warmup_step",
    "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale",
    # caching
    "cache_latents", "cache_latents_to_disk", "vae_batch_size",
    "cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk",
    # precision, memory, attention
    "mixed_precision", "full_fp16", "full_bf16", "fp8_base", "fp8_base_unet",
    "gradient_checkpointing", "gradient_accumulation_steps", "max_grad_norm", "sdpa", "xformers",
    "torch_compile", "dynamo_backend",
    # noise and loss
    "noise_offset", "min_snr_gamma", "clip_skip", "max_token_length",
    # network
    "network_module", "network_dim", "network_alpha", "network_args", "network_train_unet_only",
    "unet_lr", "text_encoder_lr",
    # optimizer and schedule
    "optimizer_type", "optimizer_args", "learning_rate", "lr_scheduler", "lr_warmup_steps",
    "lr_scheduler_num_cycles", "lr_scheduler_power", "lr_scheduler_args",
    # run length and data loading
    "seed", "max_train_steps", "max_train_epochs", "max_data_loader_n_workers", "persistent_data_loader_workers",
    # validation
    "validation_split", "validation_seed", "validate_every_n_steps", "validate_every_n_epochs",
    "max_validation_steps",
    # saving and resuming
    "output_dir", "output_name", "save_model_as", "save_precision", "save_every_n_epochs", "save_every_n_steps",
    "save_last_n_epochs", "save_last_n_epochs_state", "save_last_n_steps", "save_last_n_steps_state",
    "save_state", "save_state_on_train_end", "resume",
    # logging and samples
    "logging_dir", "log_with", "log_prefix", "sample_prompts", "sample_every_n_steps", "sample_every_n_epochs",
    "sample_sampler", "sample_at_first",
    # the config file itself
    "config_file",
    # more that the loop acts on
    "no_half_vae", "network_weights", "dim_from_weights", "network_dropout", "training_comment",
    "min_timestep", "max_timestep",
    # deprecated kohya spellings, mapped as sd-scripts maps them
    "caption_extention", "use_8bit_adam", "use_lion_optimizer",
    # FLUX.1 (flux_train_network): model files, text encoding, the flow-matching objective, block swap
    "clip_l", "t5xxl", "ae", "t5xxl_max_token_length", "apply_t5_attn_mask", "guidance_scale",
    "timestep_sampling", "sigmoid_scale", "model_prediction_type", "discrete_flow_shift", "weighting_scheme",
    "logit_mean", "logit_std", "mode_scale", "blocks_to_swap", "model_type", "split_mode",
    "cpu_offload_checkpointing",
    # several processes: how long a collective may wait for the others (minutes; accelerate's process group)
    "ddp_timeout",
    # SD3 / SD3.5 (sd3_train_network): its CLIP-G file, the CLIP masks, the timestep shift; a VAE file (all)
    "clip_g", "apply_lg_attn_mask", "training_shift", "vae",
})
ALIASES = frozenset({"caption_extention", "use_8bit_adam", "use_lion_optimizer"})
# sd-scripts options whose effect this engine has by construction, taken without a word and not read:
# DDP's gradients as views into its buckets (one copy of them); this engine averages them in one flat copy after
# the backward and keeps no buckets (training.devices.average_gradients)
HELD_BY_CONSTRUCTION = frozenset({"ddp_gradient_as_bucket_view"})

# kohya names this engine knows but does not implement (for a clearer error than "unknown").
KOHYA_ONLY_OPTIMIZERS = ("SGDNesterov", "SGDNesterov8bit", "DAdaptation", "DAdaptAdam", "DAdaptAdaGrad",
                         "DAdaptAdan", "DAdaptAdanIP", "DAdaptLion", "DAdaptSGD", "AdamWScheduleFree",
                         "RAdamScheduleFree", "SGDScheduleFree")
KOHYA_ONLY_SCHEDULERS = ("inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")
SUPPORTED_NETWORK_MODULES = ("networks.lora", LYCORIS_MODULE)
# kohya's network module per entry point (its FLUX script trains networks.lora_flux), the first one the default
NETWORK_MODULES: dict[str, tuple[str, ...]] = {"train_network": SUPPORTED_NETWORK_MODULES,
                                               "sdxl_train_network": SUPPORTED_NETWORK_MODULES,
                                               "flux_train_network": ("networks.lora_flux",)}
SUPPORTED_LOG_WITH = (None, "tensorboard")


def network_modules(script: str) -> tuple[str, ...]:
    """The network modules an entry point takes, its default first; a script sd-scripts runs for us (SD3, Lumina,
    ...) takes its families' module (the family data's ``network_module``)."""
    if script in NETWORK_MODULES:
        return NETWORK_MODULES[script]
    from sd_scripts_compat.facts.families import family_names, get_family

    return tuple(dict.fromkeys(get_family(name).network_module for name in family_names()
                               if get_family(name).script == script))

_KIND_WORDS = {
    "store_true": "true or false",
    "int": "an integer",
    "float": "a number",
    "int_or_float": "an integer step count or a ratio below 1",
    "str": "a string",
    "Path": "a path string",
    "str[nargs=*]": 'a list of strings such as ["key=value"]',
    "float[nargs=*]": "a number or a list of numbers",
}
_KEY_WORDS = {
    "resolution": 'a string "W,H" such as "512,512"',
    "face_crop_aug_range": 'a string "min,max" such as "2.0,4.0"',
}


@dataclass(frozen=True)
class TrainingConfig:
    """The merged, checked training configuration. Field names are kohya's; types are normalized.

    ``raw`` holds what the user gave (TOML flattened, then command line), in kohya's own form, for
    metadata and for writing the effective config back out; ``given`` names those keys.
    """

    # model
    pretrained_model_name_or_path: str | None = None
    v2: bool = False
    v_parameterization: bool = False
    # data
    train_data_dir: str | None = None
    reg_data_dir: str | None = None
    dataset_config: str | None = None
    prior_loss_weight: float = 1.0
    resolution: tuple[int, int] | None = None  # (width, height)
    train_batch_size: int = 1
    caption_extension: str = ".caption"
    caption_separator: str = ","
    shuffle_caption: bool = False
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    color_aug: bool = False
    flip_aug: bool = False
    random_crop: bool = False
    face_crop_aug_range: tuple[float, float] | None = None
    token_warmup_min: int = 1
    token_warmup_step: float = 0.0
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    # caching
    cache_latents: bool = False
    cache_latents_to_disk: bool = False
    vae_batch_size: int = 1
    cache_text_encoder_outputs: bool = False
    cache_text_encoder_outputs_to_disk: bool = False
    # precision, memory, attention
    mixed_precision: str = "no"
    full_fp16: bool = False
    full_bf16: bool = False
    fp8_base: bool = False
    fp8_base_unet: bool = False
    gradient_checkpointing: bool = False
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    sdpa: bool = False
    xformers: bool = False
    torch_compile: bool = False  # each repeated block compiled (training.compiled_blocks), not the whole model
    dynamo_backend: str = "inductor"
    # noise and loss
    noise_offset: float | None = None
    min_snr_gamma: float | None = None
    clip_skip: int | None = None
    max_token_length: int | None = None  # None = 75 tokens
    # network
    network_module: str = "networks.lora"
    network_dim: int = 4  # networks/lora.py's default when network_dim is not given
    network_alpha: float = 1.0
    network_args: NetworkArgs = field(default_factory=NetworkArgs)  # typed; .entries as given
    network_train_unet_only: bool = False
    unet_lr: float | None = None
    text_encoder_lr: tuple[float, ...] | None = None  # one value for all encoders, or one per encoder
    # optimizer and schedule
    optimizer_type: str = "AdamW"  # canonical name from sd_scripts_compat.facts.optimizers
    optimizer_args: dict[str, Any] = field(default_factory=dict)  # values through ast.literal_eval
    learning_rate: float = 2e-06
    lr_scheduler: str = "constant"
    lr_warmup_steps: int | float = 0  # int = steps; float in (0, 1) = ratio of the total steps
    lr_scheduler_num_cycles: int = 1
    lr_scheduler_power: float = 1.0
    lr_scheduler_args: dict[str, Any] = field(default_factory=dict)  # values through ast.literal_eval
    # run length and data loading
    seed: int | None = None
    max_train_steps: int = 1600
    max_train_epochs: int | None = None
    max_data_loader_n_workers: int = 8
    persistent_data_loader_workers: bool = False
    # validation
    validation_split: float = 0.0
    validation_seed: int | None = None
    validate_every_n_steps: int | None = None
    validate_every_n_epochs: int | None = None
    max_validation_steps: int | None = None
    # saving and resuming
    output_dir: str | None = None
    output_name: str | None = None
    save_model_as: str = "safetensors"
    save_precision: str | None = None
    save_every_n_epochs: int | None = None
    save_every_n_steps: int | None = None
    save_last_n_epochs: int | None = None
    save_last_n_epochs_state: int | None = None
    save_last_n_steps: int | None = None
    save_last_n_steps_state: int | None = None
    save_state: bool = False
    save_state_on_train_end: bool = False
    resume: str | None = None
    # logging and samples
    logging_dir: str | None = None
    log_with: str | None = None
    log_prefix: str | None = None
    sample_prompts: str | None = None
    sample_every_n_steps: int | None = None
    sample_every_n_epochs: int | None = None
    sample_sampler: str = "ddim"
    sample_at_first: bool = False
    # the config file itself
    config_file: str | None = None
    # more that the loop acts on
    no_half_vae: bool = False
    network_weights: str | None = None
    dim_from_weights: bool = False
    network_dropout: float | None = None
    training_comment: str | None = None
    min_timestep: int | None = None
    max_timestep: int | None = None
    # FLUX.1 (flux_train_network only; the other scripts keep these defaults)
    clip_l: str | None = None
    t5xxl: str | None = None
    ae: str | None = None
    t5xxl_max_token_length: int | None = None  # None: the model's (dev 512, schnell 256)
    apply_t5_attn_mask: bool = False
    guidance_scale: float = 3.5
    timestep_sampling: str = "sigma"
    sigmoid_scale: float = 1.0
    model_prediction_type: str = "sigma_scaled"
    discrete_flow_shift: float = 3.0
    weighting_scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    blocks_to_swap: int = 0  # kohya's None is 0 here
    cpu_offload_checkpointing: bool = False  # FLUX / SD3 / Anima: checkpointed block inputs on the host
    ddp_timeout: int | None = None  # minutes a collective waits for the other processes (None: torch's default)
    model_type: str = "flux"
    split_mode: bool = False  # deprecated in sd-scripts: blocks_to_swap = 18
    # SD3 / SD3.5 (sd3_train_network only), and the VAE file every script takes
    clip_g: str | None = None
    vae: str | None = None
    apply_lg_attn_mask: bool = False
    training_shift: float = 1.0
    # engine extensions (not kohya options; command line only, never written to kohya configs)
    allow_pickle: bool = False
    fsdp: str | None = None  # several processes: the frozen denoiser sharded (training.sharding.STRATEGIES)
    fsdp_offload_params: bool = False  # ... each process's share waiting in host RAM between its gathers
    fsdp_shard_size: int | None = None  # hybrid_shard: the processes of each group that shards one copy
    shard_optimizer_state: bool = False  # several processes: each keeps the optimizer state of its share of the LoRA
    autotune_events_dir: str | None = None
    autotune_retry_log: str | None = None
    autotune_state_dir: str | None = None
    save_state_every_seconds: float | None = None
    autotune_monitor_seconds: float | None = None
    t5xxl_tokenizer: str | None = None  # FLUX: a local T5 tokenizer (sd-scripts downloads one from the hub)
    # not kohya options: where the values came from
    sdxl: bool = False
    script: str = "train_network"  # the entry point that read it (kohya_args.SCRIPTS)
    raw: dict[str, Any] = field(default_factory=dict)
    given: frozenset[str] = frozenset()
    warnings: tuple[str, ...] = ()

    @property
    def text_encoders_lr(self) -> float | None:
        """The text encoders' one learning rate (the reader refuses several different ones), None when unset."""
        return self.text_encoder_lr[0] if self.text_encoder_lr else None

    def warmup_steps(self, total_steps: int) -> int:
        """``lr_warmup_steps`` in steps: a float below 1 is a ratio of ``total_steps``, as in sd-scripts."""
        if isinstance(self.lr_warmup_steps, float):
            return int(self.lr_warmup_steps * total_steps)
        return self.lr_warmup_steps


META_FIELDS = frozenset({"sdxl", "script", "raw", "given", "warnings"})

# Our own command-line flags: what the watchdog and users need beyond kohya's list.
EXTENSION_FLAGS: dict[str, tuple[Any, str]] = {
    "allow_pickle": (bool, "allow loading .ckpt/.pt pickles (loaded with torch.load(weights_only=True))"),
    "fsdp": (str, "with several processes: shard the frozen denoiser across them (full_shard, shard_grad_op or "
                  "hybrid_shard: FSDP2); the LoRA stays whole on each"),
    "fsdp_offload_params": (bool, "with fsdp: each process's share of the denoiser waits in host RAM and is copied "
                                  "to the card for each gather (accelerate's name; slower, for a model that fits "
                                  "the cards only so)"),
    "fsdp_shard_size": (int, "with fsdp = hybrid_shard: the processes each group shards one copy of the denoiser "
                             "across (a divisor of their number); the groups hold a copy each and gather within "
                             "themselves (FSDP2's HSDP: fewer bytes gathered, more held)"),
    "shard_optimizer_state": (bool, "with several processes: each keeps the optimizer state of its share of the "
                                    "LoRA's parameters and sends them to the others after its update (ZeRO stage "
                                    "1: 1/N of the state per card, the LoRA once more over the link per step)"),
    "autotune_events_dir": (str, "folder for progress.json / oom.json / done.json events (the watchdog reads them)"),
    "autotune_retry_log": (str, "JSON list of OOM retries to record in the LoRA's metadata"),
    "autotune_state_dir": (str, "folder for state folders (default: output_dir, as in sd-scripts)"),
    "save_state_every_seconds": (float, "also save state when this many seconds passed since the last save"),
    "autotune_monitor_seconds": (float, "seconds between monitor.jsonl samples in the events folder (GPU, CPU, "
                                        "RAM; default 2, 0 = off)"),
    "t5xxl_tokenizer": (str, "FLUX.1: a local T5 tokenizer folder or tokenizer.json (default: one beside the t5xxl "
                             "file); nothing is downloaded"),
}


# Extensions a config file may hold too (sd-scripts ignores them there).
FILE_EXTENSIONS = ("allow_pickle", "fsdp", "fsdp_offload_params", "fsdp_shard_size", "shard_optimizer_state")


def _add_extension_flags(parser: argparse.ArgumentParser) -> None:
    import argparse

    group = parser.add_argument_group("lora-autotune extensions (command line; allow_pickle also in the config)")
    for name, (kind, help_text) in EXTENSION_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--{name}", action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(f"--{name}", type=kind, default=argparse.SUPPRESS, help=help_text)


def _closest(name: str, candidates: list[str] | tuple[str, ...]) -> str | None:
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _choices_text(choices: tuple[Any, ...]) -> str:
    shown = ", ".join(repr(c) for c in choices if c is not None)
    return shown + (" (or leave it out)" if None in choices else "")


class _Origins:
    """Where each value came from, so an error names the file (and section) or the command line."""

    def __init__(self) -> None:
        self.file: str | None = None
        self.section: dict[str, str | None] = {}
        self.cli: set[str] = set()

    def where(self, name: str) -> str:
        if name in self.cli:
            return f"command line: --{name}"
        if name in self.section:
            section = self.section[name]
            return f"{self.file}: {name}" + (f" (in [{section}])" if section else "")
        return f"default {name}"


def _check_kind(spec: ArgSpec, value: Any, where: str) -> Any:
    """Check a TOML value against the option's kind; return it in the form argparse would give."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_number = is_int or isinstance(value, float)
    ok = False
    if spec.kind == "store_true":
        ok = isinstance(value, bool)
    elif spec.kind == "int":
        ok = is_int
    elif spec.kind in ("float", "int_or_float"):
        ok = is_number
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{where}: expected a finite number, got {value!r}")
        if ok and spec.kind == "float":
            value = float(value)
    elif spec.kind in ("str", "Path"):
        ok = isinstance(value, str)
    elif spec.kind == "str[nargs=*]":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif spec.kind == "float[nargs=*]":
        if is_number:
            value, ok = [float(value)], True
        else:
            ok = isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  for v in value)
            value = [float(v) for v in value] if ok else value
    if not ok:
        wanted = _KEY_WORDS.get(spec.name, _KIND_WORDS[spec.kind])
        hint = " (write it without quotes)" if isinstance(value, str) and spec.kind in ("int", "float") else ""
        raise UserError(f"{where}: expected {wanted}, got {describe_value(value)}{hint}")
    return value


def _check_choices(spec: ArgSpec, value: Any, where: str) -> None:
    if spec.choices is None or value in spec.choices:
        return
    lower = {str(c).lower(): c for c in spec.choices if c is not None}
    near = lower.get(str(value).lower())
    hint = f"; did you mean {near!r}?" if near is not None else ""
    raise UserError(f"{where}: {value!r} is not one of {_choices_text(spec.choices)}{hint}")


def _is_inactive(spec: ArgSpec, value: Any) -> bool:
    """True when an option has no effect: its default, or a falsy value where the default is None."""
    if value == spec.default:
        return True
    return spec.default is None and not value


def _parse_pair(text: str, convert: type, where: str, example: str) -> tuple[Any, Any]:
    parts = [p.strip() for p in text.split(",")]
    try:
        numbers = [convert(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        numbers = numbers * 2
    if len(numbers) != 2 or any(n <= 0 for n in numbers):
        raise UserError(f"{where}: expected {example}, got {text!r}")
    return numbers[0], numbers[1]


def _parse_kv(entries: list[str], where: str, literal: bool) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict. Optimizer and scheduler values go through ast.literal_eval as
    in sd-scripts ("betas=0.9,0.999" -> a tuple); network_args values stay strings (the network parses)."""
    parsed: dict[str, Any] = {}
    for entry in entries:
        key, sep, text = entry.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            raise UserError(f"{where}: entry {entry!r} is not key=value")
        if literal:
            try:
                parsed[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise UserError(f"{where}: value of {key!r} is not a Python literal: {text!r} "
                                f"(quote strings: {key}=\"{text}\")") from None
        else:
            parsed[key] = text
    return parsed


def _resolve_name(value: str, supported: dict[str, str], kohya_only: tuple[str, ...], name: str, where: str) -> str:
    """Match a kohya optimizer/scheduler name case-insensitively; explain names we do not implement."""
    if value.lower() in supported:
        return supported[value.lower()]
    listing = ", ".join(dict.fromkeys(supported.values()))
    if value.lower() in {k.lower() for k in kohya_only}:
        raise UserError(f"{where}: {name} {value!r} is an sd-scripts option this engine does not implement; "
                        f"use one of {listing}")
    near = _closest(value.lower(), list(supported))
    hint = f"did you mean {supported[near]!r}? " if near else ""
    raise UserError(f"{where}: unknown {name} {value!r}; {hint}supported: {listing}")


def _normalize(values: dict[str, Any], origins: _Origins, script: str, warnings: list[str]) -> dict[str, Any]:
    """Turn argparse-form values into TrainingConfig field values, checking what kohya checks (and more)."""
    out = {name: values[name] for name in IMPLEMENTED - ALIASES}
    where = origins.where
    _normalize_legacy(values, out, origins, warnings)
    _normalize_values(out, where)
    _normalize_schedule(out, where, warnings)
    _normalize_network(out, where, script)
    _check_contradictions(out, where)
    _check_path_lengths(out, where)
    _normalize_outputs(out, where, script, warnings)
    out["blocks_to_swap"] = out["blocks_to_swap"] or 0  # kohya's None
    _normalize_offload(out, where, warnings)
    if script == "flux_train_network":
        _normalize_flux(out, where, warnings)
    elif script == "sd3_train_network":
        _normalize_sd3(out, where, warnings)
    if out["dataset_config"] is not None:
        for name in ("train_data_dir", "reg_data_dir"):
            if out[name]:
                warnings.append(f"{where(name)}: ignored because dataset_config is given (as in sd-scripts)")
    return out


def _normalize_legacy(values: dict[str, Any], out: dict[str, Any], origins: _Origins, warnings: list[str]) -> None:
    """Deprecated spellings, as sd-scripts maps them."""
    where = origins.where
    if values.get("caption_extention") is not None:
        if "caption_extension" not in origins.section and "caption_extension" not in origins.cli:
            out["caption_extension"] = values["caption_extention"]
        warnings.append(f"{where('caption_extention')}: misspelled legacy key; write caption_extension")
    for legacy, optimizer in (("use_8bit_adam", "AdamW8bit"), ("use_lion_optimizer", "Lion")):
        if values.get(legacy):
            if values["optimizer_type"]:
                raise UserError(f"{where(legacy)}: cannot be combined with optimizer_type; "
                                f"write optimizer_type = {optimizer!r} only")
            out["optimizer_type"] = optimizer


def _normalize_values(out: dict[str, Any], where: Callable[[str], str]) -> None:
    """Paths as strings, "W,H" pairs, key=value lists, one text-encoder rate, every bounded option in bounds."""
    for name in ("dataset_config", "resume", "train_data_dir", "reg_data_dir", "pretrained_model_name_or_path",
                 "output_dir", "logging_dir", "sample_prompts", "config_file"):
        if isinstance(out[name], Path):
            out[name] = str(out[name])

    if out["resolution"] is not None:
        out["resolution"] = _parse_pair(out["resolution"], int, where("resolution"),
                                        'a string "W,H" such as "512,512"')
    if out["face_crop_aug_range"] is not None:
        out["face_crop_aug_range"] = _parse_pair(out["face_crop_aug_range"], float,
                                                 where("face_crop_aug_range"), 'a string "min,max" such as "2.0,4.0"')

    out["network_args"] = _parse_kv(out["network_args"] or [], where("network_args"), literal=False)
    out["optimizer_args"] = _parse_kv(out["optimizer_args"] or [], where("optimizer_args"), literal=True)
    out["lr_scheduler_args"] = _parse_kv(out["lr_scheduler_args"] or [], where("lr_scheduler_args"), literal=True)
    out["text_encoder_lr"] = tuple(out["text_encoder_lr"]) if out["text_encoder_lr"] else None
    if out["text_encoder_lr"] is not None and any(lr < 0 for lr in out["text_encoder_lr"]):
        raise UserError(f"{where('text_encoder_lr')}: learning rates must be 0 or more")
    if out["text_encoder_lr"] is not None and len(set(out["text_encoder_lr"])) > 1:
        raise UserError(f"{where('text_encoder_lr')}: {list(out['text_encoder_lr'])}: one learning rate per text "
                        "encoder is not supported; give a single value")

    for name in sorted(MIN_VALUES.keys() | MAX_VALUES.keys()):
        problem = bound_problem(name, out.get(name))
        if problem:
            raise UserError(f"{where(name)}: {problem}")
    if out["validation_split"] >= 1:
        raise UserError(f"{where('validation_split')}: must be below 1 (a fraction of the images), "
                        f"got {out['validation_split']!r}")


def _normalize_network(out: dict[str, Any], where: Callable[[str], str], script: str) -> None:
    """The network module this script takes (its default when unset), its rank, and its ``network_args``."""
    modules = network_modules(script)
    if out["network_module"] is None:
        out["network_module"] = modules[0]
    if out["network_module"] == LYCORIS_MODULE and script == "flux_train_network":
        raise UserError(f"{where('network_module')}: lycoris.kohya cannot train FLUX here (lycoris-lora would "
                        "wrap the diffusers layout and write keys sd-scripts and ComfyUI do not load); "
                        "use networks.lora_flux")
    if out["network_module"] not in modules:
        raise UserError(f"{where('network_module')}: {out['network_module']!r} is not supported by {script}; "
                        f"this engine trains {', '.join(modules)} there")
    if out["network_dim"] is None:
        out["network_dim"] = 4
    out["network_alpha"] = float(out["network_alpha"])
    if out["network_module"] == LYCORIS_MODULE and out["dim_from_weights"]:
        raise UserError(f"{where('dim_from_weights')}: not supported with lycoris.kohya here; give the "
                        "network_dim and network_args the file was trained with, and network_weights")
    out["network_args"] = parse_network_args(out["network_args"], out["network_module"],
                                             sdxl=script == "sdxl_train_network",
                                             rank=(out["network_dim"], out["network_alpha"]),
                                             where=where("network_args"))


def _normalize_outputs(out: dict[str, Any], where: Callable[[str], str], script: str, warnings: list[str]) -> None:
    """What is written (safetensors only, tensorboard logs), full fp16/bf16, kohya's v2 flags, what is cached."""
    if out["save_model_as"] is None:
        out["save_model_as"] = "safetensors"
    if out["save_model_as"] != "safetensors":
        raise UserError(f"{where('save_model_as')}: {out['save_model_as']!r} would write a pickle; this engine "
                        "writes safetensors only (save_model_as = \"safetensors\")")
    if out["log_with"] not in SUPPORTED_LOG_WITH:
        raise UserError(f"{where('log_with')}: {out['log_with']!r} is not supported; use log_with = \"tensorboard\"")

    if out["full_fp16"] and out["mixed_precision"] != "fp16":
        raise UserError(f"{where('full_fp16')}: needs mixed_precision = \"fp16\"")
    if out["full_bf16"] and out["mixed_precision"] != "bf16":
        raise UserError(f"{where('full_bf16')}: needs mixed_precision = \"bf16\"")
    if script == "sdxl_train_network" and out["v2"]:
        raise UserError(f"{where('v2')}: v2 cannot be enabled for SDXL (sdxl_train_network)")
    if out["v_parameterization"] and not out["v2"]:
        warnings.append("v_parameterization is set without v2: only SD 2.x-v models are trained with it")
    if out["cache_latents_to_disk"] and not out["cache_latents"]:
        out["cache_latents"] = True
    if out["cache_text_encoder_outputs_to_disk"] and not out["cache_text_encoder_outputs"]:
        out["cache_text_encoder_outputs"] = True
    if out["cache_text_encoder_outputs"] and not out["network_train_unet_only"]:
        raise UserError(f"{where('cache_text_encoder_outputs')}: cached text encoder outputs leave nothing to "
                        "train in the text encoders; also set network_train_unet_only = true")


# sd-scripts options this engine does not implement whose silent omission would train something else than asked
CHANGES_WHAT_TRAINS = {
    "network_train_text_encoder_only": "training the text encoders alone is not implemented by this engine (it would "
                                       "train the UNet too); train with your sd-scripts (autotune run --engine "
                                       "sd-scripts=PATH), or drop it",
}
def _normalize_schedule(out: dict[str, Any], where: Callable[[str], str], warnings: list[str]) -> None:
    """The optimizer and scheduler by kohya's names, the warm-up as steps or a ratio, and the pairs sd-scripts
    warns about (constant with a warm-up: ignored) or that cannot go together (adafactor's schedule elsewhere)."""
    warmup = out["lr_warmup_steps"]
    if isinstance(warmup, float):
        if warmup < 0 or (warmup >= 1 and not warmup.is_integer()):
            raise UserError(f"{where('lr_warmup_steps')}: expected a step count (integer) or a ratio in [0, 1), "
                            f"got {warmup!r}")
        out["lr_warmup_steps"] = int(warmup) if warmup >= 1 or warmup == 0 else warmup
    elif warmup < 0:
        raise UserError(f"{where('lr_warmup_steps')}: must be 0 or more, got {warmup!r}")

    optimizer_names = {key: canonical for key, (_, _, canonical) in OPTIMIZERS.items()}
    out["optimizer_type"] = _resolve_name(out["optimizer_type"] or "AdamW", optimizer_names, KOHYA_ONLY_OPTIMIZERS,
                                          "optimizer_type", where("optimizer_type"))
    scheduler_names = {name: name for name in SCHEDULERS}
    out["lr_scheduler"] = _resolve_name(out["lr_scheduler"], scheduler_names, KOHYA_ONLY_SCHEDULERS,
                                        "lr_scheduler", where("lr_scheduler"))
    if out["lr_scheduler"] == "constant" and out["lr_warmup_steps"] != 0:  # sd-scripts warns and goes on
        warnings.append(f"{where('lr_warmup_steps')}: ignored by lr_scheduler = 'constant' (as in sd-scripts); use "
                        "'constant_with_warmup' to warm up")
        out["lr_warmup_steps"] = 0
    if out["lr_scheduler"] == "adafactor" and out["optimizer_type"] != "AdaFactor":
        raise UserError(f"{where('lr_scheduler')}: 'adafactor' is AdaFactor's own schedule; with optimizer_type "
                        f"{out['optimizer_type']} use another lr_scheduler (e.g. cosine)")


def _check_not_implemented(raw: dict[str, Any], specs: dict[str, Any], origins: _Origins, warnings: list[str]) -> None:
    """sd-scripts options set away from their default that this engine does not implement: a warning, or a
    refusal for those whose omission would train something else (``CHANGES_WHAT_TRAINS``)."""
    for name in sorted(name for name in set(raw) - IMPLEMENTED - HELD_BY_CONSTRUCTION
                       if not _is_inactive(specs[name], raw[name])):
        if name in CHANGES_WHAT_TRAINS:
            raise UserError(f"{origins.where(name)}: {CHANGES_WHAT_TRAINS[name]}")
        warnings.append(f"{origins.where(name)}: sd-scripts option not implemented by this engine; ignored")


SEED_MAX = 2**32 - 1  # numpy's seed range, which sd-scripts' set_seed feeds


def _check_contradictions(out: dict[str, Any], where: Callable[[str], str]) -> None:
    """Settings that cannot both hold, or that would train on the wrong thing, said instead of one ignored."""
    from sd_scripts_compat.facts.dataset_spec import caption_extension_problem

    problem = caption_extension_problem(str(out["caption_extension"] or ""))
    if problem:
        raise UserError(f"{where('caption_extension')}: {out['caption_extension']!r}: {problem}")
    if out["dim_from_weights"] and not out["network_weights"]:
        raise UserError(f"{where('dim_from_weights')}: reads the rank from network_weights, which is not given; "
                        "give network_weights or drop dim_from_weights")
    low, high = out["min_timestep"], out["max_timestep"]
    for name, value in (("min_timestep", low), ("max_timestep", high)):
        if value is not None and not 0 <= value <= 1000:
            raise UserError(f"{where(name)}: {value} is outside 0..1000 (the scheduler's timesteps)")
    if low is not None and high is not None and low > high:
        raise UserError(f"{where('min_timestep')}: {low} is above max_timestep {high}; give min_timestep <= "
                        "max_timestep (equal bounds train at that one timestep)")
    seed = out["seed"]
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise UserError(f"{where('seed')}: {seed} is outside 0..{SEED_MAX} (the range sd-scripts can seed)")


NAME_MAX = 255  # bytes in one path component on Linux, macOS and Windows file systems
SAVED_NAME_EXTRA = 40  # what the engine adds to output_name: "-step00001234-state.old", ".safetensors", a temp part


def _check_path_lengths(out: dict[str, Any], where: Callable[[str], str]) -> None:
    """Path components the file system cannot hold, said now rather than at the first save after loading."""
    for name in ("output_dir", "logging_dir", "autotune_state_dir", "train_data_dir", "reg_data_dir", "dataset_config",
                 "pretrained_model_name_or_path", "network_weights", "sample_prompts", "resume"):
        value = out.get(name)
        if isinstance(value, str):
            long = next((part for part in Path(value).parts if len(part.encode()) > NAME_MAX), None)
            if long is not None:
                raise UserError(f"{where(name)}: the path component {long[:40]!r}... is {len(long.encode())} bytes; "
                                f"file systems take at most {NAME_MAX}; use a shorter name")
    output_name = out.get("output_name")
    if isinstance(output_name, str) and len(output_name.encode()) > NAME_MAX - SAVED_NAME_EXTRA:
        raise UserError(f"{where('output_name')}: {len(output_name.encode())} bytes; the saved files add up to "
                        f"{SAVED_NAME_EXTRA} more to it and a file name holds at most {NAME_MAX}: use at most "
                        f"{NAME_MAX - SAVED_NAME_EXTRA} bytes")


def most_blocks_to_swap(script: str) -> int:
    """The most blocks any family of ``script`` swaps (FLUX.1: 35): the family data's rule, checked here before
    anything loads; the model's own family narrows it once the file is read (``FamilySpec.swap_split``)."""
    from sd_scripts_compat.facts.families import family_names, get_family

    return max((get_family(name).max_blocks_to_swap for name in family_names()
                if get_family(name).script == script), default=0)


def _normalize_offload(out: dict[str, Any], where: Callable[[str], str], warnings: list[str]) -> None:
    """cpu_offload_checkpointing as sd-scripts' transformer scripts take it: it turns gradient checkpointing on
    (said), and block swap cannot go with it."""
    if not out["cpu_offload_checkpointing"]:
        return
    if out["blocks_to_swap"]:
        raise UserError(f"{where('cpu_offload_checkpointing')}: blocks_to_swap cannot go with it (as in sd-scripts); "
                        "remove one of them")
    if not out["gradient_checkpointing"]:
        out["gradient_checkpointing"] = True
        warnings.append("cpu_offload_checkpointing turns gradient_checkpointing on (as in sd-scripts)")


def _normalize_sd3(out: dict[str, Any], where: Callable[[str], str], warnings: list[str]) -> None:
    """sd3_train_network's own rules, as sd-scripts applies them (fp8_base_unet implies fp8_base)."""
    if out["fp8_base_unet"]:
        out["fp8_base"] = True
    most = most_blocks_to_swap("sd3_train_network")
    if out["blocks_to_swap"] > most:
        raise UserError(f"{where('blocks_to_swap')}: SD3.5 swaps at most {most} blocks (Large; Medium 22), got "
                        f"{out['blocks_to_swap']}")
    for name in ("training_shift", "logit_std"):
        if out[name] <= 0:
            raise UserError(f"{where(name)}: must be above 0, got {out[name]!r}")
    if out["max_token_length"] is not None:
        warnings.append(f"{where('max_token_length')}: not used by SD3 (77 CLIP tokens, t5xxl_max_token_length T5)")


def _normalize_flux(out: dict[str, Any], where: Callable[[str], str], warnings: list[str]) -> None:
    """flux_train_network's own rules, as sd-scripts applies them; Chroma's (``model_type = "chroma"``) as its
    docs and ``assert_extra_args`` state them: the T5 mask on, guidance 0 (Chroma is not distilled)."""
    if out["model_type"] == "chroma":
        if not out["apply_t5_attn_mask"]:
            raise UserError(f"{where('model_type')}: Chroma needs apply_t5_attn_mask = true (sd-scripts asserts it)")
        if out["guidance_scale"] != 0.0:
            raise UserError(f"{where('guidance_scale')}: {out['guidance_scale']!r} for Chroma, which is not "
                            "guidance-distilled; set guidance_scale = 0.0 (sd-scripts' docs: it must be 0)")
        if out["sample_prompts"]:
            raise UserError(f"{where('sample_prompts')}: sampling Chroma is not implemented by this engine; "
                            "remove sample_prompts")
    if out["fp8_base_unet"]:
        out["fp8_base"] = True  # sd-scripts: fp8_base_unet implies fp8_base for FLUX.1
    if out["split_mode"]:
        if out["blocks_to_swap"]:
            warnings.append(f"{where('split_mode')}: deprecated and ignored because blocks_to_swap is set")
        else:
            out["blocks_to_swap"] = 18
            warnings.append(f"{where('split_mode')}: deprecated; blocks_to_swap = 18 is used instead")
    most = most_blocks_to_swap("flux_train_network")
    if out["blocks_to_swap"] > most:
        raise UserError(f"{where('blocks_to_swap')}: FLUX.1 swaps at most {most} blocks, got {out['blocks_to_swap']}")
    for name in ("sigmoid_scale", "discrete_flow_shift", "logit_std"):
        if out[name] <= 0:
            raise UserError(f"{where(name)}: must be above 0, got {out[name]!r}")
    if out["max_token_length"] is not None:
        warnings.append(f"{where('max_token_length')}: not used by FLUX.1 (t5xxl_max_token_length is)")


def _read_config_file(cli: dict[str, Any], script: str, own: dict[str, Any], extensions: dict[str, Any],
                      origins: _Origins, warnings: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--config_file``'s values: (checked, "" -> None where kohya treats "" as unset; checked, as written).
    Wrapper keys are warned about, our file extensions go to ``extensions`` (the command line wins), and a key of
    another script at its default is ignored with a warning."""
    specs = load_arg_specs()
    toml_values: dict[str, Any] = {}
    toml_raw: dict[str, Any] = {}
    if not cli.get("config_file"):
        return toml_values, toml_raw
    config_path = str(cli["config_file"])
    path = Path(config_path if config_path.endswith(".toml") else config_path + ".toml")
    if not path.is_file():
        raise UserError(f"{path}: config file not found (--config_file)")
    source = str(path)
    flat, section_of = flatten(read_toml(path), source, warnings)
    origins.file = source
    for key, value in flat.items():
        section = f" (in [{section_of[key]}])" if section_of[key] else ""
        if key in WRAPPER_KEYS:
            warnings.append(f"{source}: {key}{section} is ignored: {WRAPPER_KEYS[key]}")
            continue
        if key in FILE_EXTENSIONS:  # the planner and the wizard write allow_pickle when the user allowed a pickle
            kind = EXTENSION_FLAGS[key][0]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                wanted = {bool: "true or false", int: "an integer"}.get(kind, "a string")
                raise UserError(f"{source}: {key}{section}: expected {wanted}, got {describe_value(value)}")
            extensions.setdefault(key, value)  # the command line wins
            continue
        if key not in specs:
            near = _closest(key, list(specs))
            hint = f"; did you mean {near!r}?" if near else ""
            raise UserError(f"{source}: unknown key {key!r}{section}{hint}")
        spec = specs[key]
        where = f"{source}: {key}{section}"
        if script not in spec.scripts:
            if not _is_inactive(spec, value):
                raise UserError(f"{where}: {key} is only for {scripts_text(spec)}; remove it or use that script")
            # at its default it changes nothing: configs shared between SD1 and SDXL runs stay usable
            warnings.append(f"{where}: option only for {scripts_text(spec)} ignored by {script}")
            continue
        if key == "config_file":
            warnings.append(f"{where}: ignored inside a config file (only --config_file on the command line)")
            continue
        spec = own[key]
        given, value = value, _check_kind(spec, value, where)
        # sd-scripts puts TOML values into its args unconverted: an integer for a float option stays an integer there
        # (and in its metadata: "4", not "4.0")
        toml_raw[key] = given if spec.kind == "float" and isinstance(given, int) else value
        if spec.kind in ("str", "Path") and value == "" and spec.default is None:
            value = None  # lora-scripts writes reg_data_dir = "" for "none"; sd-scripts treats it as unset
        _check_choices(spec, value, where)
        toml_values[key] = value
        origins.section[key] = section_of[key]
    return toml_values, toml_raw


def load_training_config(argv: list[str], *, sdxl: bool = False, script: str | None = None) -> TrainingConfig:
    """Parse kohya-style arguments (``--config_file`` TOML + flags) into a checked TrainingConfig.

    ``script`` (or ``sdxl`` for SDXL) selects the entry point (``kohya_args.SCRIPTS``): an option of
    another entry point only (SDXL's, FLUX.1's) is an error naming the scripts that take it.
    """
    script = script_name(sdxl=sdxl, script=script)
    sdxl = script == "sdxl_train_network"
    specs = load_arg_specs()
    own = arg_specs(script=script)  # this script's defaults and choices (discrete_flow_shift: FLUX 3.0, Lumina 6.0)
    parser = build_argparser(script=script, every_script=True, suppress_defaults=True)
    _add_extension_flags(parser)
    namespace, extras = parser.parse_known_args(argv)
    if extras:
        option = next((e for e in extras if e.startswith("--")), extras[0])
        near = _closest(option.lstrip("-").split("=")[0], list(specs))
        hint = f"; did you mean --{near}?" if near else ""
        raise UserError(f"command line: unknown option {option!r}{hint}")
    cli = vars(namespace)
    extensions = {name: cli.pop(name) for name in list(cli) if name in EXTENSION_FLAGS}
    for name in cli:
        if script not in specs[name].scripts:
            raise UserError(f"command line: --{name} is only for {scripts_text(specs[name])}")

    warnings: list[str] = []
    origins = _Origins()
    toml_values, toml_raw = _read_config_file(cli, script, own, extensions, origins, warnings)
    origins.cli = set(cli)

    values = {name: spec.default for name, spec in {**specs, **own}.items()}
    values.update(toml_values)
    values.update(cli)
    raw = {**toml_raw, **{k: (str(v) if isinstance(v, Path) else v) for k, v in cli.items()}}

    _check_not_implemented(raw, specs, origins, warnings)
    normalized = _normalize(values, origins, script, warnings)
    for message in warnings:
        log.warning("%s", message)
    return TrainingConfig(**normalized, **extensions, sdxl=sdxl, script=script, raw=raw, given=frozenset(raw),
                          warnings=tuple(warnings))


def dataset_args(cfg: TrainingConfig) -> dict[str, Any]:
    """The "command line" layer of kohya's dataset precedence, under dataset-config names."""
    names = ("resolution", "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps",
             "bucket_no_upscale", "prior_loss_weight", "validation_split", "validation_seed", "caption_extension",
             "caption_separator", "shuffle_caption", "keep_tokens", "keep_tokens_separator", "caption_prefix",
             "caption_suffix", "caption_dropout_rate", "caption_dropout_every_n_epochs", "caption_tag_dropout_rate",
             "color_aug", "flip_aug", "random_crop", "face_crop_aug_range", "token_warmup_min", "token_warmup_step")
    args = {name: getattr(cfg, name) for name in names}
    args["batch_size"] = cfg.train_batch_size
    # kohya options we carry but do not implement (warned about already when set)
    for name in ("secondary_separator", "enable_wildcard", "resize_interpolation", "alpha_mask", "cache_info"):
        args[name] = cfg.raw.get(name)
    return args


def dataset_group_from_config(cfg: TrainingConfig, *,
                              default_resolution: tuple[int, int] | None = None) -> DatasetGroupSpec:
    """The datasets of a run: from ``dataset_config`` when given (train/reg_data_dir then ignored, as in
    sd-scripts), else from the ``train_data_dir`` / ``reg_data_dir`` folder convention.

    ``default_resolution`` (the model family's) fills in when neither file sets a resolution.
    """
    args = dataset_args(cfg)
    if cfg.dataset_config is not None:
        return load_dataset_config(cfg.dataset_config, args, default_resolution=default_resolution)
    if not cfg.train_data_dir:
        raise UserError("no training images: set train_data_dir (folders named like '10_sks dog') "
                        "or dataset_config in the config file")
    return folder_dataset_group(cfg.train_data_dir, cfg.reg_data_dir, args, default_resolution=default_resolution)


def single_dataset(cfg: TrainingConfig, *, default_resolution: tuple[int, int] | None = None) -> DatasetSpec:
    """The one dataset this engine trains on (:func:`dataset_group_from_config`); several [[datasets]] blocks are
    one line naming the file, refused here, before any model loads."""
    group = dataset_group_from_config(cfg, default_resolution=default_resolution)
    if len(group.datasets) != 1:
        raise UserError(f"{cfg.dataset_config or 'dataset_config'}: {len(group.datasets)} [[datasets]] given; the "
                        "engine trains on exactly one (put several folders as [[datasets.subsets]] of one dataset)")
    return group.datasets[0]


def implemented_fields() -> list[str]:
    """TrainingConfig's kohya fields (everything but the bookkeeping ones and our extension flags)."""
    return [f.name for f in fields(TrainingConfig) if f.name not in META_FIELDS | EXTENSION_FLAGS.keys()]
