"""``fsdp``: the frozen denoiser sharded across the run's processes (PyTorch's FSDP2 ``fully_shard``), so a model
that fits no one card fits several.

Each process keeps 1/N of every block's weights and gathers a block's whole weights just before the block runs
(forward, and again in backward); ``full_shard`` frees them after the block's forward, ``shard_grad_op`` keeps them
gathered until its backward (faster, more memory). ``hybrid_shard`` shards within groups of ``fsdp_shard_size``
processes, each group holding a whole copy (FSDP2's HSDP on a two-dimensional mesh): each process holds 1/G and
gathers the (G - 1)/G it lacks from its group alone, fewer bytes over the link than across all N.

The LoRA stays whole on every process, as in a data-parallel run: its few parameters are averaged across all N
once per optimizer step (``devices.average_gradients``), its optimizer state is each process's own, and rank 0
writes the same file as a one-process run.

The processes load the model in turn, each sharding its denoiser before the next begins (:func:`in_turn`): the
machine's RAM holds one whole denoiser at a time, not one per process (FLUX.1 dev's transformer is 23.8 GB in
bf16: four processes loading at once would hold 95 GB). Loading takes N reads one after another (the later ones
mostly from the page cache). The LoRA is made after sharding; its hooks wrap layers inside the units, so each unit
still gathers just its own weights.

Units are the family's own blocks (``transformer_block_groups``; a UNet's ResNet and transformer blocks), then the
rest of the denoiser as one root unit. ``fully_shard`` is called directly: accelerate's FSDP plugin shards what it
prepares together with the optimizer, and the LoRA the optimizer holds lives outside the denoiser (its hooks wrap
the denoiser's layers), so accelerate here only launches the processes and owns their process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar, cast

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings import hybrid_group_sizes

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from sd_scripts_compat.facts.families import FamilySpec

T = TypeVar("T")

# the strategy's name (accelerate's and FSDP1's spelling, lower case) -> FSDP2's reshard_after_forward
STRATEGIES = {"full_shard": True, "shard_grad_op": False, "hybrid_shard": True}
HYBRID = "hybrid_shard"  # sharded within groups of fsdp_shard_size processes, each group holding a whole copy


def check_sharding(strategy: str | None, *, world: int, blocks_to_swap: int, compiled: bool,
                   offload: bool = False, shard_size: int | None = None) -> None:
    """One line for a strategy this run cannot use, before any model is loaded."""
    if strategy is None:
        if offload:
            raise UserError("fsdp_offload_params: it offloads the shares of a sharded denoiser; set fsdp = "
                            "\"full_shard\" too, or remove it")
    elif strategy not in STRATEGIES:
        raise UserError(f"fsdp = {strategy!r}: one of {', '.join(STRATEGIES)}")
    elif world < 2:
        raise UserError(f"fsdp = {strategy!r}: sharding needs several processes; launch with accelerate launch "
                        "--num_processes N (one per GPU), or remove fsdp")
    _check_shard_size(strategy, world, shard_size)
    clash = "blocks_to_swap" if blocks_to_swap else "torch_compile" if compiled else None
    if strategy is not None and clash:
        raise UserError(f"fsdp = {strategy!r}: {clash} does not combine with sharding here; remove one of them")


def _check_shard_size(strategy: str | None, world: int, shard_size: int | None) -> None:
    """``fsdp_shard_size``: with hybrid_shard, a divisor of the processes between 2 and half of them; 0 or absent
    with any other (0: across every process)."""
    if strategy != HYBRID:
        if shard_size:
            raise UserError(f"fsdp_shard_size = {shard_size}: it sizes the groups of fsdp = \"{HYBRID}\"; set that "
                            "too, or remove it")
        return
    sizes = hybrid_group_sizes(world)
    if shard_size not in sizes:
        fits = f"one of {', '.join(map(str, sizes))}" if sizes else \
            f"none fits {world} processes (it needs 4 or more; use full_shard)"
        raise UserError(f"fsdp = \"{HYBRID}\": fsdp_shard_size = {shard_size} is not a size of group that divides "
                        f"the run's {world} processes into several: {fits}")


def shard_units(denoiser: torch.nn.Module, family: FamilySpec) -> list[torch.nn.Module]:
    """The blocks sharded one by one, in forward order: the family's transformer blocks; in a UNet every ResNet
    block and every transformer block (:func:`unet_units`)."""
    import torch

    if not family.transformer_block_groups:
        return unet_units(denoiser)
    units: list[Any] = []
    for name in (group["modules"] for group in family.transformer_block_groups):
        found = getattr(denoiser, name, None)
        if isinstance(found, torch.nn.ModuleList):
            units.extend(found)
        elif isinstance(found, torch.nn.Module):
            units.append(found)
    return units


def unet_units(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """A UNet's ResNet and transformer blocks (diffusers' classes) in the order its forward runs them: each down and
    up block's ResNet then attention, the middle block's first ResNet then attention and ResNet in turn. Its down /
    mid / up blocks would be too coarse: SDXL's first up block alone is 2.3 of its 4.9 GiB, and gathered beside its
    neighbour it holds more than the unsharded model (traced: 8.2 GiB per process at 1024 px against 5.8 unsharded);
    its largest ResNet or transformer block is 94 MiB."""
    from itertools import chain, zip_longest

    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    kinds = (BasicTransformerBlock, ResnetBlock2D)
    order: list[Any] = []
    mid: Any = unet.mid_block
    blocks: list[Any] = [*cast(Any, unet.down_blocks), mid, *cast(Any, unet.up_blocks)]
    for block in blocks:
        resnets, attentions = list(getattr(block, "resnets", [])), list(getattr(block, "attentions", None) or [])
        if block is mid:
            parts = [*resnets[:1], *chain.from_iterable(zip(attentions, resnets[1:]))]
        else:
            parts = [p for pair in zip_longest(resnets, attentions) for p in pair if p is not None]
        order += [m for part in parts for m in part.modules() if isinstance(m, kinds)]
    seen = {id(m) for m in order}  # a block of another kind: its units after, as the model holds them
    return order + [m for m in unet.modules() if isinstance(m, kinds) and id(m) not in seen]


def held_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of ``module``'s weights this process holds, bytes of the whole weights): a sharded parameter
    (a DTensor) counts its local shard."""
    held = whole = 0
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        held += local.numel() * local.element_size()
        whole += param.numel() * param.element_size()
    return held, whole


def process_mesh(device: torch.device, shard_size: int | None = None) -> DeviceMesh:
    """The processes of the default process group on ``device``'s type: one dimension over them all, or with
    ``shard_size`` (hybrid_shard) two, groups of that many consecutive ranks sharding one copy each and replicated
    across the groups (FSDP2 shards along the last dimension and replicates along the first)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not shard_size or shard_size == world:
        return init_device_mesh(device.type, (world,))
    return init_device_mesh(device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


def shard_denoiser(denoiser: torch.nn.Module, family: FamilySpec, strategy: str, mesh: DeviceMesh,
                   offload: bool = False) -> int:
    """Shard ``denoiser`` (on the host or the mesh's device, its LoRA hooks in place) across ``mesh``
    (:func:`process_mesh`): ``fully_shard`` moves each unit to the device in turn and keeps this process's share
    there, or with ``offload`` in host RAM (pinned beside a GPU), copied in for each gather (FSDP2's
    ``CPUOffloadPolicy``). The number of units sharded besides the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    reshard = STRATEGIES[strategy]
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    units = shard_units(denoiser, family)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(denoiser, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    return len(units)


def in_turn(world: int, rank: int, work: Callable[[], T]) -> T:
    """``work`` done by each of ``world`` processes in turn, in rank order, the others waiting at a collective.
    A UserError in one process's turn is raised in every process (the line each would have said loading at once),
    and no later process begins: nothing is left waiting for a turn that will not come."""
    import torch.distributed as dist

    done: list[T] = []
    for turn in range(world):
        refused: UserError | None = None
        if turn == rank:
            try:
                done.append(work())
            except UserError as error:
                refused = error
        said: list[tuple[str, int] | None] = [None] * world
        dist.all_gather_object(said, (str(refused), refused.exit_code) if refused else None)
        if refused is not None:
            raise refused
        first = next((s for s in said if s is not None), None)
        if first is not None:
            failed = UserError(first[0])
            failed.exit_code = first[1]
            raise failed
    return done[0]
