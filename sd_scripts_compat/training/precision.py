"""Weight storage precision: ``fp8_base`` keeps frozen base weights in float8, computes in the
mixed-precision dtype.

Hand-written because neither diffusers nor accelerate offers "store frozen Linear/Conv weights in
float8, upcast per call" for training. The upcast happens inside a small autograd function that
saves the float8 weight (1 byte per parameter) for backward and upcasts it again there; a plain
``F.linear(x, w.to(fp16))`` would keep every layer's fp16 copy alive until backward and give the
saving back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


FP8_MIN_CAPABILITY = (8, 0)  # float8 storage, upcast before each layer (no float8 matmul): RTX 30 cards on


def fp8_supported(device: str | torch.device) -> bool:
    """float8 storage of the frozen weights on this device: a CUDA card of compute capability 8.0+ (Ampere on, as
    sd-scripts' ``fp8_base`` runs on RTX 30 cards and the planner plans FLUX.1 there: each layer upcasts its
    weight, no float8 matmul is asked of the card); CPU tensors support the dtype."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    return hasattr(torch, "float8_e4m3fn")


def _upcast_functions() -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    class Fp8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight8, bias, dtype):  # type: ignore[override]
            ctx.save_for_backward(weight8)
            ctx.dtype = dtype
            return F.linear(x.to(dtype), weight8.to(dtype), None if bias is None else bias.to(dtype))

        @staticmethod
        def backward(ctx, grad_out):  # type: ignore[override]
            (weight8,) = ctx.saved_tensors
            grad_x = grad_out.to(ctx.dtype) @ weight8.to(ctx.dtype) if ctx.needs_input_grad[0] else None
            return grad_x, None, None, None

    class Fp8Conv2d(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight8, bias, dtype, stride, padding, dilation, groups):  # type: ignore[override]
            ctx.save_for_backward(weight8)
            ctx.conv = (x.shape, dtype, stride, padding, dilation, groups)
            bias = None if bias is None else bias.to(dtype)
            return F.conv2d(x.to(dtype), weight8.to(dtype), bias, stride, padding, dilation, groups)

        @staticmethod
        def backward(ctx, grad_out):  # type: ignore[override]
            (weight8,) = ctx.saved_tensors
            shape, dtype, stride, padding, dilation, groups = ctx.conv
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = torch.nn.grad.conv2d_input(shape, weight8.to(dtype), grad_out.to(dtype), stride, padding,
                                                    dilation, groups)
            return grad_x, None, None, None, None, None, None, None

    return Fp8Linear, Fp8Conv2d


def store_frozen_weights_in_fp8(module: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Cast every frozen Linear/Conv2d weight under ``module`` to float8_e4m3fn; returns how many."""
    import torch

    fp8_linear, fp8_conv = _upcast_functions()
    count = 0
    for layer in module.modules():
        if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) or layer.weight.requires_grad:
            continue
        if isinstance(layer, torch.nn.Conv2d) and layer.padding_mode != "zeros":
            continue
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
        if isinstance(layer, torch.nn.Linear):
            def forward(x, layer=layer):
                return fp8_linear.apply(x, layer.weight, layer.bias, compute_dtype)
        else:
            def forward(x, layer=layer):
                return fp8_conv.apply(x, layer.weight, layer.bias, compute_dtype, layer.stride, layer.padding,
                                      layer.dilation, layer.groups)
        setattr(layer, "forward", forward)  # noqa: B010 - an instance attribute over the class's method
        count += 1
    return count


class DynamicLossScale:
    """Loss scaling for ``full_fp16``, where LoRA weights and gradients are fp16.

    Hand-written because torch's GradScaler refuses to unscale fp16 gradients by design.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval, self.good_steps = scale, growth_interval, 0

    def unscale_and_check(self, params: list[Any]) -> bool:
        """Unscale the gradients in place; False (and a smaller scale) when any is not finite."""
        import torch

        grads = [p.grad for p in params if p.grad is not None]
        for grad in grads:
            grad.div_(self.scale)
        finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else True
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale, self.good_steps = max(self.scale / 2.0, 1.0), 0
        return finite
