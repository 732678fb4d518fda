"""How the memory models' figures are read for a target that is not the model's average device: a card emulated on
the CPU (``sd_scripts_compat.training.emulated_card``), a model deliberately scaled (``--memory-model-scale``) and a
card whose CUDA context a run measured (the model's constant replaced).
One home for both models (``memory_model``, ``dit_memory``), which share the fields it sets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from autotune.estimate.dit_memory import DitMemoryEstimate, DitMemoryInputs
from autotune.estimate.memory_model import MemoryEstimate, MemoryInputs

_Inputs = TypeVar("_Inputs", MemoryInputs, DitMemoryInputs)
_Estimate = TypeVar("_Estimate", MemoryEstimate, DitMemoryEstimate)


def emulated_card_inputs(inputs: _Inputs) -> _Inputs:
    """The inputs as the emulated card (``sd_scripts_compat.training.emulated_card``) counts: the live tensors alone
    (no CUDA context, no allocator slack, no margin: the card is exact), traced under the CPU's autocast lists."""
    return replace(inputs, cuda_context_gib=0.0, allocator_overhead=0.0, safety_margin_gib=0.0, autocast_rules="cpu")


@dataclass(frozen=True)
class MemoryView:
    """How the memory model's figures are read for a target: a card emulated on the CPU counts the live tensors
    of the training steps alone (``emulated``: ``emulated_card_inputs``, ``training_only``), and ``scale``
    multiplies every device figure (``--memory-model-scale``: a model deliberately wrong, for tests and benches of
    what a run learns); ``cuda_context_gib`` replaces the model's CUDA context constant by what a run on this card
    measured at its start (``autotune.measure.learned.measured_cuda_context``)."""

    emulated: bool = False
    scale: float = 1.0
    cuda_context_gib: float | None = None
    context_basis: str = ""  # where the measured context comes from (one line), said beside the memory figure

    def basis(self, figure: str = "memory model") -> str:
        """``figure``'s source line, with the measured context's where one replaced the model's constant."""
        return f"{figure}; {self.context_basis}" if self.context_basis else figure

    def predict(self, model: Callable[[_Inputs], _Estimate], inputs: _Inputs) -> _Estimate:
        if not self.emulated:
            if self.cuda_context_gib is not None and inputs.cuda_context_gib > 0:  # a GPU plan (a CPU's has none)
                inputs = replace(inputs, cuda_context_gib=self.cuda_context_gib)
            return model(inputs).scaled(self.scale)
        return model(emulated_card_inputs(inputs)).training_only().scaled(self.scale)


AS_MODELLED = MemoryView()  # the model's own figures for a real device
