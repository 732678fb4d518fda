"""Small device and process helpers of the training run: moving modules and batches, memory figures,
the one gradient all-reduce. Each is a function of its arguments only."""

from __future__ import annotations

import gc
from typing import Any


def place(module: Any, device: Any, dtype: Any) -> None:
    """Move a module; cast only when its dtype differs (diffusers warns on every dtype cast)."""
    if next(module.parameters()).dtype == dtype:
        module.to(device)
    else:
        module.to(device, dtype=dtype)


def to_device(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """A batch's tensors on ``device``; ``non_blocking`` on CUDA, where the loader pinned them."""
    import torch

    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def free_device_memory(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_mib(device: Any) -> float:
    """Peak reserved CUDA memory, or the process's peak resident memory on CPU."""
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's wrapper (its state dict is what a state folder holds)."""
    return getattr(optimizer, "optimizer", optimizer)


def average_gradients(params: list[Any], world: int) -> None:
    """Average LoRA gradients across processes with one all-reduce.

    The LoRA hooks into the UNet's layers, so its own forward is never called through a DDP wrapper;
    one flat all-reduce per optimizer step is what DDP would do for these few parameters.
    """
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
