"""sd-scripts' ``cpu_offload_checkpointing``: gradient checkpointing whose saved block inputs wait in host memory.

Checkpointing keeps only each block's inputs for the backward pass; for a transformer at 1024 px those inputs are
most of the activation memory (FLUX.1: 57 blocks x tokens x 3072 x 2 bytes). This checkpoint function, given to
diffusers' ``enable_gradient_checkpointing``, moves a block's tensor inputs to the host before the checkpoint saves
them and back to the device inside the recomputed function, as sd-scripts' ``to_cpu`` / ``to_cuda`` do: the device
holds one block's input at a time. Hand-written (one line why): torch's ``save_on_cpu`` offloads every saved
tensor of the whole graph, not the checkpoints alone, and diffusers has no such option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def offloaded_checkpoint(function: Callable[..., T], *args: object, **kwargs: Any) -> T:
    """``torch.utils.checkpoint.checkpoint(function, *args)`` (non-reentrant) with the tensor ``args`` kept on the
    host between forward and backward; gradients flow back through the copies to the device tensors."""
    import torch
    from torch.utils.checkpoint import checkpoint

    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type == "cpu":
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    host = tuple(a.to("cpu", non_blocking=True) if isinstance(a, torch.Tensor) else a for a in args)

    def on_device(*inputs: object) -> T:
        return function(*(a.to(device, non_blocking=True) if isinstance(a, torch.Tensor) else a for a in inputs))

    return checkpoint(on_device, *host, use_reentrant=False, **kwargs)
