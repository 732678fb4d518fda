"""Weight storage precision: ``fp8_base`` keeps frozen base weights in float8, computes in the
mixed-precision dtype.

Hand-written because neither diffusers nor accelerate offers "store frozen Linear/Conv weights in
float8, upcast per call" for training: each layer's forward upcasts its weight just in time, so the
resident copy costs 1 byte per parameter.
"""

from __future__ import annotations

from typing import Any


def fp8_supported(device: Any) -> bool:
    """float8 storage needs compute capability 8.9+ on CUDA to be worth it; CPU tensors support the dtype."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return hasattr(torch, "float8_e4m3fn")


def store_frozen_weights_in_fp8(module: Any, compute_dtype: Any) -> int:
    """Cast every frozen Linear/Conv2d weight under ``module`` to float8_e4m3fn; returns how many."""
    import torch
    import torch.nn.functional as F

    count = 0
    for layer in module.modules():
        if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) or layer.weight.requires_grad:
            continue
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
        if isinstance(layer, torch.nn.Linear):
            def forward(x, layer=layer):
                bias = None if layer.bias is None else layer.bias.to(compute_dtype)
                return F.linear(x.to(compute_dtype), layer.weight.to(compute_dtype), bias)
        else:
            def forward(x, layer=layer):
                bias = None if layer.bias is None else layer.bias.to(compute_dtype)
                return layer._conv_forward(x.to(compute_dtype), layer.weight.to(compute_dtype), bias)
        layer.forward = forward
        count += 1
    return count
