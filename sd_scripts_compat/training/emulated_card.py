"""A card of a given size emulated on the CPU, so that the memory ladder, stepping up and learned memory can be
run end to end without a GPU (``SD_COMPAT_EMULATED_CARD_MIB``: ``autotune run --emulate-card MIB`` sets it on the
engine's environment; tests and benches use it).

The card holds what a GPU would during the training steps: the denoiser, the text encoders unless their outputs
are cached, the VAE unless the latents are, the network, the optimizer's state, and every tensor the steps make.
Their live bytes are counted per dispatched op (``live_bytes.LiveBytesCounter``); an op that leaves more than the
card holds raises ``torch.OutOfMemoryError``, as CUDA's allocator would. The engine then reports the card's
figures (its peak is what ``max_memory_allocated`` would show) instead of the process's resident memory, whose
~700 MiB of Python and libraries would drown a tiny model's few MiB of tensors. No allocator slack and no CUDA
context: the tuner predicts the card with those parts left out. Saves, samples and validation run off the card.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.training.live_bytes import LiveBytesCounter

if TYPE_CHECKING:
    import torch

CARD_ENV = "SD_COMPAT_EMULATED_CARD_MIB"


class EmulatedCard:
    """``size_mib`` of tensors: what is held (``hold``) and what the steps make (inside ``active()``)."""

    def __init__(self, size_mib: float) -> None:
        self.size_mib = size_mib
        self.counter = LiveBytesCounter(limit=int(size_mib * 2**20))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EmulatedCard | None:
        value = (environ if environ is not None else os.environ).get(CARD_ENV, "").strip()
        if not value:
            return None
        try:
            size = float(value)
        except ValueError:
            size = math.nan
        if not (math.isfinite(size) and size > 0):
            raise UserError(f"{CARD_ENV}={value!r}: the emulated card's size in MiB, a positive number (e.g. 64)")
        return cls(size)

    def hold(self, modules: Iterable[torch.nn.Module | None], tensors: Iterable[torch.Tensor] = ()) -> None:
        """Put these modules' parameters and buffers and these tensors on the card (each storage counted once)."""
        for module in modules:
            if module is not None:
                self.counter.register(module.parameters())
                self.counter.register(module.buffers())
        self.counter.register(tensors)

    def active(self) -> AbstractContextManager[Any]:
        """Count (and limit) what the ops inside make."""
        return self.counter.mode()

    @property
    def peak_mib(self) -> float:
        return self.counter.peak / 2**20

    def figures(self) -> dict[str, float]:
        """The card's figures for progress, done.json and oom.json (MiB)."""
        return {"emulated_card_mib": self.size_mib, "emulated_card_peak_mib": self.peak_mib,
                "emulated_card_live_mib": self.counter.current / 2**20}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (moments, step counts): on the card, also when loaded from a saved state."""
    import torch

    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]
