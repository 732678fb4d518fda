"""NaN / Inf in the weights a run starts from: found before training, named by file and tensor.

A damaged download or a bad merge carries non-finite weights; trained on, they look exactly like a divergence
(a NaN loss at the first step) and a watchdog would retry with lower learning rates for nothing. Base models
are checked on a sample of each tensor (a few thousand evenly spaced values plus both ends: seconds for a
12 B model would be spent on a full pass, and damage is rarely a single value); LoRA weights, being small, in full.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import BadWeights

if TYPE_CHECKING:
    import torch

SAMPLE = 4096  # values looked at per tensor of a base model


def first_nonfinite(tensors: Iterable[tuple[str, torch.Tensor]], *, sample: int | None = SAMPLE) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf (in ``sample`` evenly spaced values and the
    last one; None: every value), or None."""
    import torch

    with torch.no_grad():
        for name, tensor in tensors:
            if not tensor.is_floating_point() or tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            flat = tensor.detach().reshape(-1)
            if sample is not None and flat.numel() > sample:
                flat = torch.cat([flat[:: flat.numel() // sample], flat[-1:]])
            if not bool(torch.isfinite(flat.float()).all()):  # float8 has no isfinite of its own
                return name
    return None


def check_finite(source: str, what: str, tensors: Iterable[tuple[str, torch.Tensor]], *,
                 sample: int | None = SAMPLE) -> None:
    """Raise :class:`BadWeights` naming ``source`` and the tensor when a checked value is NaN or Inf."""
    bad = first_nonfinite(tensors, sample=sample)
    if bad is not None:
        raise BadWeights(f"{source}: {what} hold NaN or Inf (tensor {bad}); the file is damaged: download or make "
                         "it again")
