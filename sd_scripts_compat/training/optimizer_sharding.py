"""``shard_optimizer_state``: with several processes, each keeps the optimizer state of its share of the LoRA's
parameters (ZeRO stage 1, through torch's ``ZeroRedundancyOptimizer``), not of all of them.

The LoRA itself stays whole on every process (its hooks wrap the denoiser's layers; a sharded denoiser's gathers
need it whole), and so do its gradients, averaged once per optimizer step as before. Each process steps only the
parameters it owns, with the optimizer the config names (bitsandbytes' 8-bit ones too: the parameters are plain
tensors, not the DTensors FSDP2 would make of them), and broadcasts them to the others afterwards: per optimizer
step the LoRA crosses the link once more, and 1/N of the state is held (FLUX.1 dev at rank 32 on four cards, AdamW:
0.29 of 1.14 GiB per card).

Saving the state needs every process: the owners send their parts to rank 0 (:func:`gather_state`, a collective)
before rank 0 writes the one state folder a one-process run writes, which any run resumes from (each process keeps
its own part of it). So a run saves state only where all of its processes are: at the step and epoch saves, a
stop (Ctrl-C, SIGTERM: the processes agree on the step), the end, and a timed save the processes agree on
(:func:`agreed_by_main`); not after an out-of-memory error (another process may be mid-step), where the last saved
state stands.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import torch


def check_state_sharding(enabled: bool, world: int, optimizer: str) -> None:
    """One line for a run that cannot shard its optimizer state, before any model is loaded."""
    from sd_scripts_compat.facts.optimizers import state_splits

    if enabled and world < 2:
        raise UserError("shard_optimizer_state: it splits the optimizer's state across several processes; launch "
                        "with accelerate launch --num_processes N (one per GPU), or remove it")
    if enabled and not state_splits(optimizer):
        raise UserError(f"shard_optimizer_state: {optimizer}'s step sums over all of the LoRA's parameters, so each "
                        "process would step its share by its own sums and the LoRA would differ; remove "
                        "shard_optimizer_state, or use AdamW / AdamW8bit")


def sharded_optimizer(optimizer_class: type, param_groups: list[dict[str, Any]], **defaults: Any) -> Any:
    """``optimizer_class`` over this process's share of ``param_groups`` (kept whole, as the scheduler and the
    saved state see them), partitioned across the default process group."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(param_groups, optimizer_class=optimizer_class, **defaults)


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ZeroRedundancyOptimizer; asked without importing ``torch.distributed.optim``
    (0.45 s of every engine's start) where nothing did, since then no optimizer can be one."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this process's state tensors and runs the update: the one inside a sharded
    optimizer, else ``optimizer`` itself."""
    return optimizer.optim if is_sharded(optimizer) else optimizer  # type: ignore[attr-defined]


def owned_share(optimizer: Any) -> tuple[int, int]:
    """(elements of the LoRA's parameters whose state this process keeps, elements of them all)."""
    owned = sum(p.numel() for group in optimizer.optim.param_groups for p in group["params"])
    return owned, sum(p.numel() for group in optimizer.param_groups for p in group["params"])


def gather_state(optimizer: Any) -> None:
    """Every process of the run: each owner's state sent to rank 0, whose ``state_dict()`` is then whole (nothing
    to do for an optimizer that is not sharded)."""
    if is_sharded(optimizer):
        optimizer.consolidate_state_dict(to=0)


def agreed_by_main(due: bool, world: int) -> bool:
    """Rank 0's ``due`` (its clock decides a timed save), known to every process: one all-reduce of a flag."""
    import torch.distributed as dist

    from sd_scripts_compat.training.devices import any_process

    return any_process(due and dist.get_rank() == 0) if world > 1 else due
