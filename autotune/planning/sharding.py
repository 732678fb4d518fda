"""Data parallel or sharded, on a machine with several cards: the planner searches both ways and keeps the one with
more predicted images per second that fits (``training.sharding`` in the engine). Where sharded fits no card, it
searches sharded with each process's share offloaded to host RAM (``fsdp_offload_params``) instead.

Data parallel holds the whole transformer on every card (swapping blocks to the host where it does not fit);
sharded (``fsdp = "full_shard"``) holds 1/N of it on each and gathers each block over the link between the cards
as it runs. Our engine shards every family it trains (FLUX.1, Chroma, SD3.5, SD 1.x / 2.x, SDXL); the families
trained in the user's sd-scripts / musubi-tuner are planned data parallel only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from autotune.planning.search import Scored, SearchResult
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.facts.settings import TrainSettings

GIB = 1024**3
STRATEGY = "full_shard"  # the planner's; shard_grad_op keeps each block gathered from its forward to its backward


# what each trainer that is not our engine has for sharding, as of the versions in shared/reference
TRAINER_SHARDING = {
    "sd-scripts": ("whose one way to shard is DeepSpeed ZeRO stage 3 (--deepspeed --zero_stage 3): DeepSpeed is not "
                   "in its requirements and not tried with its LoRA scripts here, so plans do not write it; "
                   "lora-autotune's engine shards the families it trains (SD 1.x / 2.x, SDXL, FLUX.1, Chroma, SD3.5)"),
    "musubi-tuner": ("which has no sharding of its own (only DDP's options: ddp_timeout, "
                     "ddp_gradient_as_bucket_view, ddp_static_graph); lora-autotune's engine shards the families it "
                     "trains (SD 1.x / 2.x, SDXL, FLUX.1, Chroma, SD3.5)"),
}


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
    """Search again from ``start`` sharded across ``devices`` and keep the faster of the two that fit; on a tie the
    one that gave up less to fit (fp8 weights, swapped blocks, ...), else data parallel (no gathers to depend
    on)."""
    sharded = search(replace(start, fsdp=STRATEGY))
    across = f"sharded across {devices} cards (fsdp {STRATEGY})"
    if sharded.chosen is None:  # shard more: each process's share waits in host RAM (fsdp_offload_params)
        sharded = search(replace(start, fsdp=STRATEGY, fsdp_offload_params=True))
        across = f"sharded across {devices} cards (fsdp {STRATEGY}), each one's share in host RAM"
    ours, theirs = sharded.chosen, plain.chosen
    if ours is None:
        need = sharded.smallest.required / GIB
        return ShardingChoice(plain, f"data parallel: {across} fits no card (needs {need:.1f} GiB per card at its "
                                     "smallest settings)")
    if theirs is None:
        need = plain.smallest.required / GIB
        return ShardingChoice(sharded, f"{across}: {_figures(ours)}; data parallel fits no card (needs "
                                       f"{need:.1f} GiB per card at its smallest settings)")
    if ours.samples_per_s > theirs.samples_per_s * (1 + 1e-9):
        return ShardingChoice(sharded, f"{across}: {_figures(ours)}; faster than data parallel ({_figures(theirs)})")
    tie = ours.samples_per_s >= theirs.samples_per_s * (1 - 1e-9)
    if tie and len(sharded.fallbacks) < len(plain.fallbacks):  # as fast, and it gave up less to fit
        return ShardingChoice(sharded, f"{across}: {_figures(ours)}; as fast as data parallel, which needs "
                                       f"{', '.join(plain.fallbacks)} to fit ({_figures(theirs)})")
    how = "as fast as" if tie else "faster than"
    return ShardingChoice(plain, f"data parallel: {_figures(theirs)}; {how} {across} ({_figures(ours)})")
