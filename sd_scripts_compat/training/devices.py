"""Small device and process helpers of the training run: moving modules and batches, memory figures,
the one gradient all-reduce. Each is a function of its arguments only."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def place(module: torch.nn.Module, device: str | torch.device, dtype: torch.dtype) -> None:
    """Move a module; cast only when its dtype differs (diffusers warns on every dtype cast)."""
    if next(module.parameters()).dtype == dtype:
        module.to(device)
    else:
        module.to(device, dtype=dtype)


def channels_last_pays(device_type: str, compute_dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether a conv UNet's convolutions run faster channels_last on this device.

    Yes on CUDA tensor cores (compute capability 7.0+) in fp16 / bf16: cuDNN's tensor-core convolutions run
    NHWC natively, so NCHW tensors pay a transpose around each one (NVIDIA's performance guide; diffusers converts
    its UNets the same way). No on the CPU: oneDNN ran SD1.5's bare step no faster (256 px, 2 cores, two runs each:
    bf16 1.84/1.88 vs 1.82/1.76 s, fp32 3.52/3.72 vs 3.71/3.29 s), and no in fp32 on a GPU, where no tensor-core
    kernel is chosen.
    """
    import torch

    half = compute_dtype in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None))
    return device_type == "cuda" and half and capability is not None and capability >= (7, 0)


def channels_last_for(device: torch.device, compute_dtype: torch.dtype, conv_unet: bool) -> bool:
    """The rule for this process's device (a ``torch.device``): only a conv UNet, where ``channels_last_pays``."""
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return conv_unet and channels_last_pays(device.type, compute_dtype, capability)


def to_channels_last(unet: torch.nn.Module) -> None:
    """The UNet's frozen 4-D weights stored channels_last, once. Its convolutions then run channels_last (PyTorch
    follows the weight's layout or the input's), and so do a LoCon's conv adapters on their channels_last inputs;
    the LoRA's own weights, and with them the optimizer's moments and the saved state, stay contiguous."""
    import torch

    unet.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits memory_format


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch's tensors on ``device``; ``non_blocking`` on CUDA, where the loader pinned them."""
    import torch

    non_blocking = device.type == "cuda"
    return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def free_device_memory(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_mib(device: torch.device) -> float:
    """Peak reserved CUDA memory, or the process's peak resident memory on CPU."""
    import torch

    from sd_scripts_compat.facts.contract import peak_rss_mib

    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return peak_rss_mib()


def resident_memory_mib(device: torch.device) -> float | None:
    """What stays allocated on a CUDA device between steps (weights, LoRA, optimizer state; read at a step boundary,
    a host-side count: no sync); None on the CPU, where resident memory says nothing of the tensors."""
    import torch

    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def cuda_context_mib(device: torch.device, nvml: Any = None) -> float | None:
    """What this process's CUDA context holds on ``device`` before any model is loaded, MiB: the driver's count of
    the process (NVML's ``usedGpuMemory``: context, kernels' images, the allocator's reserve) less what the
    caching allocator reserved. Read once, at start; None on the CPU or where NVML cannot answer (no nvidia-ml-py,
    a container that hides processes). ``nvml``: the ``pynvml`` module (tests pass a stand-in)."""
    import os

    import torch

    if device.type != "cuda":
        return None
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        torch.cuda.init()  # the context exists from here
        torch.cuda.synchronize(device)
        nvml.nvmlInit()
        uuid = torch.cuda.get_device_properties(device).uuid  # NVML and CUDA_VISIBLE_DEVICES number cards apart
        handle = nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        used = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
    except Exception:  # no driver library, a card NVML does not list: the run has no context figure
        return None
    if not used or not isinstance(used[0], int):  # NVML says "not available" (None) inside some containers
        return None
    return max(0.0, (used[0] - torch.cuda.memory_reserved(device)) / 2**20)


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (its state dict is what a state folder holds)."""
    return getattr(optimizer, "optimizer", optimizer)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is set in any process of the run: one all-reduce (MAX) of it, on the card with NCCL."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


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
