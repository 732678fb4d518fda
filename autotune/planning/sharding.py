"""Data parallel or sharded, on a machine with several cards: the planner searches each way and keeps the one with
more predicted images per second that fits (``training.sharding`` in the engine). Where sharded fits no card, or
fits only by giving something up (fp8 weights, a smaller rank ...), it also searches sharded with each process's
share offloaded to host RAM (``fsdp_offload_params``). On four cards or more it also searches sharded within groups
of cards (``hybrid_shard``), each group holding a whole copy.

Data parallel holds the whole transformer on every card (swapping blocks to the host where it does not fit);
sharded (``fsdp = "full_shard"``) holds 1/N of it on each and gathers each block over the link between the cards
as it runs. Our engine shards every family it trains (FLUX.1, Chroma, SD3.5, SD 1.x / 2.x, SDXL); the families
trained in the user's sd-scripts / musubi-tuner are planned data parallel only.

Either way the LoRA's optimizer state may be split across the cards (:func:`choose_state`): our engine's
``shard_optimizer_state``; for the families trained in sd-scripts, its DeepSpeed at ZeRO stage 2
(``FamilySpec.config_keys``); musubi-tuner has no such split. Not for Prodigy, whose step sums over every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.optimizers import state_splits

if TYPE_CHECKING:
    from collections.abc import Callable

    from autotune.planning.search import Scored, SearchResult
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.settings import TrainSettings

GIB = 1024**3
STRATEGY = "full_shard"  # the planner's; shard_grad_op keeps each block gathered from its forward to its backward
SPEED_TIE = 0.02  # predicted speeds this close are as fast: the speed model is no finer than that


# what each trainer that is not our engine has for sharding, as of the versions in shared/reference
TRAINER_SHARDING = {
    "sd-scripts": ("whose one way to shard the model is DeepSpeed ZeRO stage 3 (--deepspeed --zero_stage 3), which "
                   "fails or hangs while its LoRA scripts load the model (rank 0 builds the text encoder inside "
                   "DeepSpeed's zero.Init, a collective, while the others wait at sd-scripts' load-in-turn barrier: "
                   "measured with sd-scripts' own versions), so plans do not write it; its stage 2 splits the LoRA's "
                   "optimizer state where that helps (the deepspeed row); lora-autotune's engine shards the families "
                   "it trains (SD 1.x / 2.x, SDXL, FLUX.1, Chroma, SD3.5)"),
    "musubi-tuner": ("which has no sharding of its own (only DDP's options: ddp_timeout, "
                     "ddp_gradient_as_bucket_view, ddp_static_graph); lora-autotune's engine shards the families it "
                     "trains (SD 1.x / 2.x, SDXL, FLUX.1, Chroma, SD3.5)"),
}


def several_cards(start: TrainSettings, family: FamilySpec, devices: int, plain: SearchResult,
                  search: Callable[[TrainSettings], SearchResult]) -> tuple[SearchResult, str | None, str | None]:
    """On several cards: the search the plan takes (``plain``: data parallel, whole state), why it is data parallel
    or sharded, and why the LoRA's optimizer state is split across the cards or whole on each (None: one card, or
    a trainer that cannot split it). Our engine's families: data parallel or sharded (:func:`choose_sharding`),
    each with the state whole and split; sd-scripts': data parallel, the state whole or split by its DeepSpeed
    (ZeRO stage 2); musubi-tuner's: data parallel."""
    if devices < 2:
        return plain, None, None
    sharded = can_shard(family, devices)
    whole = choose_sharding(start, devices, plain, search) if sharded else ShardingChoice(
        plain, not_sharded_reason(family))
    if not family.config_keys.state_split:
        return whole.found, whole.reason, None
    if not state_splits(start.optimizer_type):
        best = whole.found.chosen
        other = best.settings.optimizer_type if best is not None else start.optimizer_type
        return whole.found, whole.reason, (
            f"the LoRA's optimizer state kept whole on each card: {start.optimizer_type}'s step sums over all of "
            "the LoRA's parameters (its estimate of d), which each card would make from its own share if split"
            + (f"; to fit, the plan trains with {other} instead (the optimizer row says why)"
               if other != start.optimizer_type else ""))
    split_start = replace(start, shard_optimizer_state=True)
    split_found = search(split_start)
    split = choose_sharding(split_start, devices, split_found, search) if sharded else ShardingChoice(
        split_found, whole.reason)
    chosen, state_reason = choose_state(start, devices, whole, split)
    return chosen.found, chosen.reason, state_reason


def can_shard(family: FamilySpec, devices: int) -> bool:
    """Whether a plan over ``devices`` cards may shard ``family``: our engine trains it (its transformer blocks, or
    a UNet's ResNet and transformer blocks, are the units)."""
    return devices > 1 and family.trained_here


def not_sharded_reason(family: FamilySpec) -> str:
    """Why a plan over several cards is data parallel without a comparison: which trainer shards which family."""
    return f"data parallel: {family.name} trains in your {family.trainer}, {TRAINER_SHARDING[family.trainer]}"


@dataclass(frozen=True)
class ShardingChoice:
    found: SearchResult  # the search whose settings the plan takes
    reason: str  # why, with the other way's figures


def _figures(scored: Scored) -> str:
    swap = f", {scored.settings.blocks_to_swap} blocks swapped" if scored.settings.blocks_to_swap else ""
    return (f"{scored.peak / GIB:.1f} GiB per card{swap}, micro-batch {scored.settings.train_batch_size}, "
            f"{scored.samples_per_s:.3g} samples/s")


def choose_sharding(start: TrainSettings, devices: int, plain: SearchResult,
                    search: Callable[[TrainSettings], SearchResult]) -> ShardingChoice:
    """Search again from ``start`` sharded across ``devices``, and with each process's share in host RAM where
    sharded alone fits no card or only by giving something up (fp8 weights, a smaller rank ...). Of those that fit,
    keep the one that lowered the fewest of the training's own settings (rank, resolution, buckets, frames, the
    text encoders' learning), then the fastest (within :data:`SPEED_TIE`, as fast), then the one that gave up less
    to fit, else the first of data parallel (no gathers to depend on), sharded within groups (fewer gathers),
    sharded across every card, offloaded. (``shard_grad_op`` is not a way: it keeps every block gathered from its
    forward to its backward, so a card holds the whole frozen model and its share, more than data parallel, and a
    frozen model has no gradients whose reduce-scatter it would save.)"""
    across = f"sharded across {devices} cards (fsdp {STRATEGY})"
    sharded = search(replace(start, fsdp=STRATEGY))
    ways = [("data parallel", plain), *_hybrid_ways(start, devices, search), (across, sharded)]
    if sharded.chosen is None or sharded.fallbacks:
        ways.append((f"{across}, each one's share in host RAM",
                     search(replace(start, fsdp=STRATEGY, fsdp_offload_params=True))))
    fitting = [(name, found) for name, found in ways if found.chosen is not None]
    if not fitting:
        need = sharded.smallest.required / GIB
        return ShardingChoice(plain, f"data parallel: {across} fits no card (needs {need:.1f} GiB per card at its "
                                     "smallest settings)")
    best = fitting[0]
    for way in fitting[1:]:
        if _ahead(start, way[1], best[1]):
            best = way
    others = "; ".join(_against(start, best[1], name, found) for name, found in ways if found is not best[1])
    return ShardingChoice(best[1], f"{best[0]}: {_figures(_chosen(best[1]))}; {others}")


def choose_state(start: TrainSettings, devices: int, whole: ShardingChoice,
                 split: ShardingChoice) -> tuple[ShardingChoice, str]:
    """The LoRA's optimizer state split across the cards (``shard_optimizer_state``: each process keeps that of its
    share of the parameters) where the plan is ahead for it (:func:`_ahead`: fewer of the training's settings
    lowered, faster, less given up to fit; as good by all three, the shares of a sharded denoiser kept on the cards
    rather than in host RAM), else kept whole on each (no extra pass of the LoRA over the link per step); (the
    choice, why, with both ways' state per card and figures)."""
    if split.found.chosen is None or (whole.found.chosen is not None and not _state_ahead(start, split, whole)):
        if whole.found.chosen is None:
            return whole, "the LoRA's optimizer state kept whole on each card"
        if split.found.chosen is None:
            return whole, ("the LoRA's optimizer state kept whole on each card: split across them nothing fits "
                           f"(needs {split.found.smallest.required / GIB:.1f} GiB per card at its smallest settings"
                           f"{'' if split.found.smallest.settings.blocks_to_swap else ', no blocks swapped'})")
        slower = _chosen(whole.found).samples_per_s > _chosen(split.found).samples_per_s * (1 + SPEED_TIE)
        return whole, (f"the LoRA's optimizer state kept whole on each card ({_state(whole.found)}): split across "
                       f"them ({_state(split.found)}) the plan {'is slower' if slower else 'gains nothing'} "
                       f"({_figures(_chosen(split.found))}) and the LoRA would cross the link once more per step")
    if whole.found.chosen is None:
        return split, (f"the LoRA's optimizer state split across the {devices} cards ({_state(split.found)}): kept "
                       "whole on each, nothing fits")
    extra = ", ".join(f for f in whole.found.fallbacks if f not in split.found.fallbacks)
    if _lowered(start, whole.found) > _lowered(start, split.found):
        cost = f"the plan needs {extra} to fit, which lowers what trains"
    elif _chosen(split.found).samples_per_s > _chosen(whole.found).samples_per_s * (1 + SPEED_TIE):
        cost = "it is slower"
    elif extra:
        cost = f"it needs {extra} to fit"
    else:
        cost = "the shares of the denoiser must wait in host RAM to fit"
    return split, (f"the LoRA's optimizer state split across the {devices} cards ({_state(split.found)}; "
                   f"{_figures(_chosen(split.found))}): kept whole on each ({_state(whole.found)}) {cost} "
                   f"({_figures(_chosen(whole.found))})")


def _state_ahead(start: TrainSettings, split: ShardingChoice, whole: ShardingChoice) -> bool:
    if _ahead(start, split.found, whole.found):
        return True
    if _ahead(start, whole.found, split.found):
        return False
    return _chosen(whole.found).settings.fsdp_offload_params and not _chosen(split.found).settings.fsdp_offload_params


def _state(found: SearchResult) -> str:
    return f"{dict(_chosen(found).components).get('optimizer_state', 0) / GIB:.2f} GiB per card"


def _hybrid_ways(start: TrainSettings, devices: int,
                 search: Callable[[TrainSettings], SearchResult]) -> list[tuple[str, SearchResult]]:
    """Sharded within groups of cards, each group holding a whole copy (``fsdp = "hybrid_shard"``): more weights
    per card than across all of them, fewer bytes gathered over the link ((G - 1) / G of each block, not
    (N - 1) / N). Smallest groups first: of two as fast, the one that gathers less."""
    from sd_scripts_compat.facts.settings import hybrid_group_sizes

    return [(f"sharded within {devices // size} groups of {size} cards (fsdp hybrid_shard)",
             search(replace(start, fsdp="hybrid_shard", fsdp_shard_size=size))) for size in hybrid_group_sizes(devices)]


def _chosen(found: SearchResult) -> Scored:
    assert found.chosen is not None
    return found.chosen


def _lowered(start: TrainSettings, found: SearchResult) -> int:
    """How many of the training's own settings the search lowered to fit (not how it runs: fp8, swap, offload,
    an optimizer's 8-bit twin): rank, resolution, buckets, frames, the text encoders' learning, the optimizer's
    family left (Prodigy for AdamW8bit)."""
    from sd_scripts_compat.facts.settings_space import eight_bit_optimizer

    s = _chosen(found).settings
    left = s.optimizer_type not in (start.optimizer_type, eight_bit_optimizer(start.optimizer_type, False))
    return sum((s.network_dim < start.network_dim, s.resolution != start.resolution,
                s.max_bucket_reso != start.max_bucket_reso, s.frames < start.frames,
                s.network_train_unet_only and not start.network_train_unet_only, left))


def _ahead(start: TrainSettings, one: SearchResult, other: SearchResult) -> bool:
    """``one`` lowered fewer settings than ``other``; or as many and it is faster; or as fast, having given up
    less to fit."""
    if _lowered(start, one) != _lowered(start, other):
        return _lowered(start, one) < _lowered(start, other)
    mine, theirs = _chosen(one).samples_per_s, _chosen(other).samples_per_s
    if mine > theirs * (1 + SPEED_TIE):
        return True
    return mine >= theirs * (1 - SPEED_TIE) and len(one.fallbacks) < len(other.fallbacks)


def _against(start: TrainSettings, chosen: SearchResult, name: str, other: SearchResult) -> str:
    """How the chosen way stands against another: faster or as fast, what the other needs to fit, or that it fits
    no card."""
    if other.chosen is None:
        return f"{name} fits no card (needs {other.smallest.required / GIB:.1f} GiB per card at its smallest settings)"
    needs = f", which needs {', '.join(other.fallbacks)} to fit" if len(other.fallbacks) > len(chosen.fallbacks) \
        else ""
    mine, theirs = _chosen(chosen).samples_per_s, other.chosen.samples_per_s
    if _lowered(start, other) > _lowered(start, chosen) and theirs > mine * (1 + SPEED_TIE):
        return f"{name} is faster but lowers what trains{needs} ({_figures(other.chosen)})"
    how = "faster than" if mine > theirs * (1 + SPEED_TIE) else \
        "slower than" if theirs > mine * (1 + SPEED_TIE) else "as fast as"
    return f"{how} {name}{needs} ({_figures(other.chosen)})"
