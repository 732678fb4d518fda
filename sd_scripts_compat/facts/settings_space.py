"""The space of settings a run can take: its moves, and the one way between ``TrainSettings`` and kohya's files.

Three callers walk this space. The planner searches it for the fastest fit, the OOM ladder steps down through it
from settings that ran out of memory, the wizard offers the single change that would make a user's values fit.
They share every move (the :data:`RUNGS` table below: micro-batch splits that keep the effective batch,
checkpointing, an 8-bit optimizer, caching the text encoders' outputs, UNet-only training, block swap, bucket and
training resolution, rank, fp8 weights) and differ only in the :class:`Policy` they pass: which rungs in which
order (the planner's order is per family, from its plan profile), and how a rung may move (a resumable run keeps
its effective batch exactly and its optimizer's family; a fresh plan may switch optimizer and sets alpha by its
rule). How each caller walks the rungs (a grid search, a cumulative step-down, one knob at a time) stays with it.

The kohya side: :func:`config_values` / :func:`dataset_values` are the one mapping of settings to config.toml and
dataset.toml values (dataset.toml's ``batch_size`` and ``resolution`` win over the config's in kohya, so both are
written), :func:`write_config` / :func:`write_dataset_config` put them into existing files, and
:func:`settings_from_values` reads them back from a flat mapping of kohya keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.kohya_toml import (
    parse_resolution,
    read_toml,
    set_config_values,
    set_dataset_values,
    without_keys,
    write_toml,
)
from sd_scripts_compat.facts.optimizers import state_splits
from sd_scripts_compat.facts.settings import TrainSettings, hybrid_group_sizes

# ---- kohya files: the one mapping and the one reader ---------------------------------------------------


@dataclass(frozen=True)
class ConfigKeys:
    """The keys of the settings whose names differ between the trainers a config is written for (one per family:
    ``FamilySpec.config_keys``)."""

    fp8_option: str | None = "fp8_base"  # fp8 base weights (HunyuanImage's script reads fp8_scaled); None: none
    # the LoRA's optimizer state split across the processes: our engine's key; sd-scripts' DeepSpeed ZeRO stage 2
    # (``families.TRAINERS``); () where the trainer has no such split (musubi-tuner)
    state_split: tuple[tuple[str, Any], ...] = (("shard_optimizer_state", True),)
    # blocks may be swapped with the state split (sd-scripts' DeepSpeed moves its whole model onto the card)
    swaps_with_split: bool = True


def config_values(s: TrainSettings, keys: ConfigKeys = ConfigKeys()) -> dict[str, Any]:
    """The settings as training-config values, in kohya's value types ("W,H" resolution), under the family's
    trainer's keys (``keys``)."""
    values: dict[str, Any] = {
        "train_batch_size": s.train_batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "resolution": f"{s.resolution[0]},{s.resolution[1]}",
        "gradient_checkpointing": s.gradient_checkpointing,
        "optimizer_type": s.optimizer_type,
        "network_dim": s.network_dim,
        "mixed_precision": s.mixed_precision,
        "cache_latents": s.cache_latents,
        "cache_text_encoder_outputs": s.cache_text_encoder_outputs,
    }
    if keys.fp8_option is not None:
        values[keys.fp8_option] = s.fp8_base
    if s.network_alpha is not None:
        values["network_alpha"] = s.network_alpha
    if s.max_bucket_reso is not None:
        values["max_bucket_reso"] = s.max_bucket_reso
    if s.network_train_unet_only or s.cache_text_encoder_outputs:
        values["network_train_unet_only"] = True  # kohya refuses TE caching while training the TE
    if s.xformers:
        values["xformers"] = True
    if s.blocks_to_swap:
        values["blocks_to_swap"] = s.blocks_to_swap
    if s.cpu_offload_checkpointing:
        values["cpu_offload_checkpointing"] = True
    if s.fsdp:  # our engine's keys (sd-scripts has no FSDP for its LoRA scripts); offload written either way
        values["fsdp"] = s.fsdp  # (a move from offloaded to not must clear it)
        values["fsdp_offload_params"] = s.fsdp_offload_params
        if s.fsdp == "hybrid_shard":
            values["fsdp_shard_size"] = s.fsdp_shard_size
    if s.shard_optimizer_state:  # our engine's key, or sd-scripts' DeepSpeed ZeRO stage 2
        values.update(keys.state_split)
    if s.use_pinned_memory_for_block_swap:
        values["use_pinned_memory_for_block_swap"] = True
    if s.high_noise_expert:  # written either way: a ladder move from offloading to block swap must clear it
        values["offload_inactive_dit"] = s.offload_inactive_dit
    values["torch_compile"] = s.torch_compile  # always: the plan writes why it is on or off
    if s.torch_compile:
        values["dynamo_backend"] = s.dynamo_backend
    values.update({"learning_rate": s.learning_rate, "lr_scheduler": s.lr_scheduler,
                   "lr_warmup_steps": s.lr_warmup_steps, "max_grad_norm": s.max_grad_norm,
                   "full_fp16": s.full_fp16, "full_bf16": s.full_bf16})
    if s.unet_lr is not None:
        values["unet_lr"] = s.unet_lr
    if s.text_encoder_lr is not None:
        values["text_encoder_lr"] = list(s.text_encoder_lr)
    return values


def dataset_values(s: TrainSettings) -> dict[str, Any]:
    """The dataset-level values of a dataset.toml (they win over the training config in kohya)."""
    values: dict[str, Any] = {"batch_size": s.train_batch_size, "resolution": list(s.resolution)}
    if s.max_bucket_reso is not None:
        values["max_bucket_reso"] = s.max_bucket_reso
    return values


def _changed(values: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    return values if before is None else {k: v for k, v in values.items() if before.get(k) != v}


def write_config(src: Path, dst: Path, settings: TrainSettings, header: str = "",
                 base: TrainSettings | None = None, keys: ConfigKeys = ConfigKeys()) -> None:
    """Write ``src`` with the settings' values set wherever kohya reads them, to ``dst``.

    Only keys that differ from ``base`` (the settings ``src`` describes) are written, so a config
    does not grow keys (and the engine's "ignored option" warnings) it never had; a key ``base`` writes and
    ``settings`` does not (``blocks_to_swap`` once none are swapped, ``fsdp_shard_size`` once sharded across every
    process) is removed.
    """
    values = config_values(settings, keys)
    before = None if base is None else config_values(base, keys)
    gone = set() if before is None else set(before) - set(values)
    write_toml(dst, set_config_values(without_keys(read_toml(src), gone), _changed(values, before)), header)


def write_dataset_config(src: Path, dst: Path, settings: TrainSettings, header: str = "",
                         base: TrainSettings | None = None) -> None:
    """The dataset.toml of ``settings``: batch size, resolution and bucket limits that changed, on every
    [[datasets]] block (they win over the main config in kohya)."""
    write_toml(dst, with_dataset_values(read_toml(src, "dataset config"), settings, base), header)


def with_dataset_values(document: dict[str, Any], settings: TrainSettings,
                        base: TrainSettings | None = None) -> dict[str, Any]:
    """A dataset.toml document with the values of ``settings`` that differ from ``base`` set on it."""
    return set_dataset_values(document, _changed(dataset_values(settings),
                                                 None if base is None else dataset_values(base)))


def settings_from_values(values: Mapping[str, Any]) -> TrainSettings:
    """The settings that a flat mapping of kohya keys describes (a plan's config.toml values, or the engine's
    resolved config with its dataset's batch and resolution); absent keys take kohya's defaults."""
    defaults = TrainSettings()
    alpha, warmup = values.get("network_alpha"), values.get("lr_warmup_steps", defaults.lr_warmup_steps)
    text_encoder_lr = values.get("text_encoder_lr")
    if isinstance(text_encoder_lr, (int, float)):
        text_encoder_lr = [text_encoder_lr]
    bucket = values.get("max_bucket_reso")
    return TrainSettings(
        train_batch_size=int(values.get("train_batch_size", defaults.train_batch_size)),
        gradient_accumulation_steps=max(1, int(values.get("gradient_accumulation_steps") or 1)),
        resolution=parse_resolution(values.get("resolution", defaults.resolution)),
        gradient_checkpointing=bool(values.get("gradient_checkpointing", False)),
        optimizer_type=str(values.get("optimizer_type") or defaults.optimizer_type),
        network_dim=int(values.get("network_dim") or defaults.network_dim),
        network_alpha=None if alpha is None else float(alpha),
        network_train_unet_only=bool(values.get("network_train_unet_only", False)),
        mixed_precision=str(values.get("mixed_precision") or defaults.mixed_precision),
        fp8_base=any(bool(values.get(key, False)) for key in ("fp8_base", "fp8_base_unet", "fp8_scaled")),
        cache_latents=bool(values.get("cache_latents", False)),
        cache_text_encoder_outputs=bool(values.get("cache_text_encoder_outputs", False)),
        max_bucket_reso=int(bucket) if values.get("enable_bucket") and bucket is not None else None,
        xformers=bool(values.get("xformers", False)),
        learning_rate=float(values.get("learning_rate", defaults.learning_rate)),
        unet_lr=None if values.get("unet_lr") is None else float(values["unet_lr"]),
        text_encoder_lr=tuple(float(lr) for lr in text_encoder_lr) if text_encoder_lr else None,
        lr_scheduler=str(values.get("lr_scheduler") or defaults.lr_scheduler),
        lr_warmup_steps=warmup if isinstance(warmup, int) else float(warmup),
        max_grad_norm=float(values.get("max_grad_norm", defaults.max_grad_norm) or 0.0),
        full_fp16=bool(values.get("full_fp16", False)),
        full_bf16=bool(values.get("full_bf16", False)),
        blocks_to_swap=int(values.get("blocks_to_swap") or 0),
        cpu_offload_checkpointing=bool(values.get("cpu_offload_checkpointing", False)),
        fsdp=str(values["fsdp"]) if values.get("fsdp") else None,
        fsdp_offload_params=bool(values.get("fsdp_offload_params", False)),
        fsdp_shard_size=int(values.get("fsdp_shard_size") or 0) if values.get("fsdp") == "hybrid_shard" else 0,
        shard_optimizer_state=bool(values.get("shard_optimizer_state", False)) or _deepspeed_splits_state(values),
        network_module=str(values.get("network_module") or defaults.network_module),
        network_args=tuple(str(entry) for entry in values.get("network_args") or ()),
        torch_compile=bool(values.get("torch_compile", False)),
        dynamo_backend=str(values.get("dynamo_backend") or defaults.dynamo_backend),
        use_pinned_memory_for_block_swap=bool(values.get("use_pinned_memory_for_block_swap", False)),
        high_noise_expert=bool(values.get("dit_high_noise")),
        offload_inactive_dit=bool(values.get("offload_inactive_dit", False)),
    )


def _deepspeed_splits_state(values: Mapping[str, Any]) -> bool:
    """sd-scripts' ``deepspeed`` splits the LoRA's optimizer state across its processes from ZeRO stage 1 on (its
    default stage is 2)."""
    stage = values.get("zero_stage", 2)
    return bool(values.get("deepspeed")) and isinstance(stage, int) and stage >= 1


# ---- the moves -------------------------------------------------------------------------------------------

EIGHT_BIT_OPTIMIZERS = {"adamw": "AdamW8bit", "lion": "Lion8bit", "pagedadamw": "PagedAdamW8bit",
                        "pagedlion": "PagedLion8bit"}


@dataclass(frozen=True)
class Limits:
    """What the family and the machine allow a move to do."""

    is_sdxl: bool = False
    fp8_supported: bool = False  # float8 storage of the base weights on this device (and in the family's script)
    keys: ConfigKeys = ConfigKeys()  # the family's trainer's keys (FamilySpec.config_keys): fp8's, the split's
    te_cache_allowed: bool = True  # False when captions change between steps (shuffle, dropout)
    max_blocks_to_swap: int = 0  # the family's (FamilySpec.max_blocks_to_swap)
    resolution_step: int = 64
    min_resolution: int = 256
    min_rank: int = 4
    frame_step: int = 4  # a clip's frames go 1 + k x this (FamilySpec.temporal_stride: Wan's VAE packs 4)
    shard_processes: int = 1  # a run of this many processes whose engine shards the family (training.sharding)


@dataclass(frozen=True)
class Policy:
    """How a caller walks the space: its rungs in order, and how far each may move."""

    rungs: tuple[str, ...]
    exact_micro_batches: bool = True  # only micro-batches that divide the effective batch (it stays exactly)
    switch_optimizer: bool = False  # may leave the optimizer's family for AdamW8bit (a fresh plan sets its rates)
    alpha: Callable[[int], float] | None = None  # alpha of a new rank; None: in proportion (the scale is kept)
    bucket_follows: str = "clamp"  # "clamp": the max bucket drops with the resolution; "double": 2x the side
    rank_floor: int = 4  # where "rank" stops ("rank_min" goes on to Limits.min_rank)


@dataclass(frozen=True)
class Candidate:
    settings: TrainSettings
    label: str  # what was given up, for a plan's list ("rank 8", "blocks_to_swap 12")


@dataclass(frozen=True)
class Rung:
    """One kind of move: its name in messages, why it saves memory, and its candidates (mildest first)."""

    title: str
    why: str
    moves: Callable[[TrainSettings, Policy, Limits], list[Candidate]]


def micro_batch_splits(effective: int, devices: int = 1, *, exact: bool = True,
                       below: int | None = None) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs per device for ``effective`` samples per optimizer step, largest first.

    ``exact``: every micro-batch that divides the per-device batch, so the effective batch stays exactly (what a
    run that resumes needs); else powers of two, accumulation rounded up (the planner's grid). ``below``: only
    micro-batches smaller than this."""
    per_device = max(1, effective // devices)
    if exact:
        micros = [m for m in range(per_device, 0, -1) if per_device % m == 0]
    else:
        micros = [2**i for i in range(per_device.bit_length() - 1, -1, -1)]
    return [(m, per_device // m if exact else max(1, math.ceil(effective / (m * devices))))
            for m in micros if below is None or m < below]


def _micro_batch(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    splits = micro_batch_splits(s.effective_batch, exact=p.exact_micro_batches, below=s.train_batch_size)
    return [Candidate(replace(s, train_batch_size=m, gradient_accumulation_steps=a), f"micro-batch {m}")
            for m, a in splits]


def _checkpointing(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    return [] if s.gradient_checkpointing else [
        Candidate(replace(s, gradient_checkpointing=True), "gradient checkpointing")]


def eight_bit_optimizer(optimizer: str, switch: bool) -> str | None:
    """The 8-bit twin of ``optimizer`` (AdamW -> AdamW8bit, Lion -> Lion8bit), else AdamW8bit when ``switch``
    allows leaving the optimizer's family (Prodigy -> AdamW8bit); None: no 8-bit move."""
    twin = EIGHT_BIT_OPTIMIZERS.get(optimizer.lower())
    if twin is None and switch and optimizer != "AdamW8bit":
        twin = "AdamW8bit"
    return twin


def _optimizer(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    eight = eight_bit_optimizer(s.optimizer_type, p.switch_optimizer)
    return [] if eight is None else [Candidate(replace(s, optimizer_type=eight), f"optimizer {eight} (8-bit state)")]


def _te_cache(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    if not (lim.is_sdxl and lim.te_cache_allowed) or s.cache_text_encoder_outputs:
        return []
    return [Candidate(replace(s, cache_text_encoder_outputs=True), "cached text-encoder outputs")]


def _unet_only(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    if s.network_train_unet_only:
        return []
    label = "UNet only" + (" with cached text-encoder outputs" if lim.is_sdxl else "")
    return [Candidate(replace(s, network_train_unet_only=True,
                              cache_text_encoder_outputs=s.cache_text_encoder_outputs or lim.is_sdxl), label)]


def _shard(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    """Shard the frozen denoiser within groups of the run's processes (hybrid_shard, smallest groups first), or
    across all of them, or shard it more (gathered only while a block runs), then offload each process's share to
    host RAM."""
    n = lim.shard_processes
    if n < 2 or s.fsdp_offload_params or s.blocks_to_swap:
        return []
    sharded = replace(s, fsdp="full_shard", fsdp_shard_size=0)
    groups = [Candidate(replace(s, fsdp="hybrid_shard", fsdp_shard_size=g),
                        f"sharded within groups of {g} of the {n} processes")
              for g in hybrid_group_sizes(n) if g > s.shard_ranks(n)]  # larger groups than shard one copy now
    offloaded = Candidate(replace(sharded, fsdp_offload_params=True),
                          f"sharded across {n} processes, each one's share in host RAM")
    if s.fsdp == "full_shard":
        return [offloaded]
    return [*groups, Candidate(sharded, f"sharded across {n} processes"), offloaded]


def _split_state(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    if lim.shard_processes < 2 or s.shard_optimizer_state or not state_splits(s.optimizer_type) or (
            s.blocks_to_swap and not lim.keys.swaps_with_split):
        return []
    return [Candidate(replace(s, shard_optimizer_state=True),
                      f"the optimizer's state split across {lim.shard_processes} processes")]


def _swap(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    if s.fsdp or (s.shard_optimizer_state and not lim.keys.swaps_with_split):  # a sharded denoiser swaps no
        return []  # blocks (training.sharding), nor does sd-scripts' DeepSpeed
    base = replace(s, offload_inactive_dit=False)  # musubi refuses block swap beside an offloaded Wan 2.2 expert
    return [Candidate(replace(base, blocks_to_swap=n), f"blocks_to_swap {n}")
            for n in range(s.blocks_to_swap + 1, lim.max_blocks_to_swap + 1)]  # the fewest that fit win


def _max_bucket(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    if s.max_bucket_reso is None:
        return []
    sizes = range(s.max_bucket_reso - lim.resolution_step, max(s.resolution) - 1, -lim.resolution_step)
    return [Candidate(replace(s, max_bucket_reso=size), f"max bucket {size}") for size in sizes]


def _resolution(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    out = []
    width, height = s.resolution
    while min(width, height) - lim.resolution_step >= lim.min_resolution:
        width, height = width - lim.resolution_step, height - lim.resolution_step
        bucket = s.max_bucket_reso
        if p.bucket_follows == "double":
            bucket = 2 * max(width, height) if bucket is not None else None
        elif bucket is not None:
            bucket = min(bucket, max(width, height))
        out.append(Candidate(replace(s, resolution=(width, height), max_bucket_reso=bucket), f"resolution {width}"))
    return out


def _frames(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    """Shorter clips, one latent frame at a time, down to two latent frames (a video family's clips only)."""
    counts = range(s.frames - lim.frame_step, lim.frame_step, -lim.frame_step) if s.frames > 1 else ()
    return [Candidate(replace(s, frames=n), f"{n} frames") for n in counts]


def at_square_resolution(s: TrainSettings, side: int) -> TrainSettings:
    """Square ``side`` px with buckets up to twice that (the planner's bucket rule: tall and wide images keep
    their shape)."""
    return replace(s, resolution=(side, side), max_bucket_reso=2 * side)


def _ranks(s: TrainSettings, p: Policy, floor: int) -> list[Candidate]:
    out, dim = [], s.network_dim
    while dim // 2 >= floor:
        dim //= 2
        new = s.with_rank(dim) if p.alpha is None else replace(s, network_dim=dim, network_alpha=p.alpha(dim))
        out.append(Candidate(new, f"rank {dim}"))
    return out


def _fp8(s: TrainSettings, p: Policy, lim: Limits) -> list[Candidate]:
    option = lim.keys.fp8_option
    label = "fp8 base weights" if option == "fp8_base" else f"fp8 weights ({option})"
    return [Candidate(replace(s, fp8_base=True), label)] if lim.fp8_supported and option and not s.fp8_base else []


RUNGS: dict[str, Rung] = {
    "micro_batch": Rung("micro-batch", "smaller micro-batch with more gradient accumulation keeps the effective "
                        "batch", _micro_batch),
    "checkpointing": Rung("gradient checkpointing", "gradient checkpointing recomputes activations instead of "
                          "storing them (~20-30% slower)", _checkpointing),
    "optimizer": Rung("8-bit optimizer", "an 8-bit optimizer stores its moments in a quarter of the memory",
                      _optimizer),
    "te_cache": Rung("text-encoder caching", "caching text-encoder outputs moves the text encoders off the device "
                     "(UNet-only training)", _te_cache),
    "unet_only": Rung("UNet only", "the text encoders stop training (SDXL: their outputs are cached and they leave "
                      "the device)", _unet_only),
    "shard": Rung("sharding", "each process holds 1/N of the frozen denoiser (1/G within groups of G: "
                  "hybrid_shard) and gathers a block's weights only while it runs (FSDP); then each one's share "
                  "waits in host RAM, copied in for its gathers",
                  _shard),
    "split_state": Rung("optimizer state split", "each process keeps the optimizer state of its share of the "
                        "LoRA's parameters (nothing trained changes; the LoRA crosses the link once more per step)",
                        _split_state),
    "swap": Rung("block swap", "swapped blocks wait in host memory and are copied in around their use (slower only "
                 "once the host link is the bottleneck)", _swap),
    "max_bucket": Rung("max bucket resolution", "a lower max bucket resolution caps the largest (most "
                       "memory-hungry) buckets", _max_bucket),
    "resolution": Rung("resolution", "a lower training resolution shrinks every activation", _resolution),
    "frames": Rung("frames", "shorter clips shrink every activation in proportion to their latent frames", _frames),
    "rank": Rung("rank", "a lower rank shrinks the LoRA, its gradients and optimizer state (alpha kept in "
                 "proportion)", lambda s, p, lim: _ranks(s, p, p.rank_floor)),
    "rank_min": Rung("rank", "a lower rank shrinks the LoRA, its gradients and optimizer state (alpha kept in "
                     "proportion)", lambda s, p, lim: _ranks(s, p, lim.min_rank)),
    "fp8": Rung("fp8 base", "fp8 storage halves the frozen base weights", _fp8),
}


def rungs(settings: TrainSettings, policy: Policy, limits: Limits) -> list[tuple[str, Rung, list[Candidate]]]:
    """Each of the policy's rungs with its candidates from ``settings`` (mildest first): (name, rung, candidates).
    Every rung starts from ``settings``; a walker that carries one rung's move into the next applies it itself."""
    return [(name, RUNGS[name], RUNGS[name].moves(settings, policy, limits)) for name in policy.rungs]


# The OOM ladder's order: cheapest loss of quality or speed first (the optimizer's state split across a run's
# processes, where our engine runs several, loses neither); all of it resumes from the saved state except
# the optimizer, text-encoder and rank moves (their tensors change shape).
OOM_POLICY = Policy(rungs=("split_state", "micro_batch", "checkpointing", "optimizer", "te_cache", "shard", "swap",
                           "max_bucket",
                           "resolution", "frames", "rank_min", "fp8"))
