"""Settings changed while our engine trains, without a restart: the supervisor writes ``control.json`` into the
events folder (``contract.CONTROL_FILE``) and the loop reads it at each optimizer-step boundary (one ``stat``; no
device sync). What can change in the process (``IN_PROCESS``):

- gradient checkpointing, on or off: a checkpointed step computes the same numbers and keeps fewer activations;
- the micro-batch with its accumulation (the effective batch kept): the data is cut into the new batches from the
  same position, as a restart with them would resume (``recipe.rebatched``).

So the run goes on at the same step with nothing to reload; every other change needs a restart from a saved state.
The engine says it applied a change by that change's id in its next progress event (``control``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SWITCHES = ("gradient_checkpointing", "cpu_offload_checkpointing")  # on or off
SIZES = ("train_batch_size", "gradient_accumulation_steps")  # positive whole numbers, asked together
IN_PROCESS = SWITCHES + SIZES


def takes(changes: dict[str, Any]) -> bool:
    """Whether ``changes`` is a request the process can carry out: known settings, of their kinds, the sizes
    together."""
    switches_ok = all(isinstance(changes[k], bool) for k in SWITCHES if k in changes)
    sizes = [changes.get(k) for k in SIZES]
    sizes_ok = all(v is None for v in sizes) or all(type(v) is int and v > 0 for v in sizes)
    return bool(changes) and set(changes) <= set(IN_PROCESS) and switches_ok and sizes_ok


@dataclass
class ControlFile:
    """The supervisor's requests (``path``; None: nobody sends any), each taken once, in id order."""

    path: Path | None
    applied: int = 0  # the id of the last change applied
    seen_ns: int | None = None  # the file's modification time when last read

    def poll(self) -> dict[str, Any] | None:
        """A new request (``{"id": n, "gradient_checkpointing": bool, ...}``), or None. A request naming anything
        but ``IN_PROCESS`` settings, or not of their kinds (:func:`takes`), is not taken: the supervisor restarts for
        those."""
        if self.path is None:
            return None
        try:
            modified = self.path.stat().st_mtime_ns
        except OSError:
            return None
        if modified == self.seen_ns:
            return None
        self.seen_ns = modified
        try:
            request = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # half-written: the supervisor writes atomically, so the next poll reads it whole
        ident = request.get("id") if isinstance(request, dict) else None
        if not isinstance(ident, int) or ident <= self.applied:
            return None
        if not takes({k: v for k, v in request.items() if k != "id"}):
            return None
        self.applied = ident
        return request


def set_checkpointing(unet: Any, text_encoders: list[Any], *, on: bool, offload: bool, transformer: bool) -> None:
    """Gradient checkpointing of the denoiser (``offload``: its saved inputs on the host, a transformer's only)
    and, when they learn, of the text encoders (``text_encoders``: those that train)."""
    if on and offload and transformer:  # as sd-scripts: the offloaded variant checkpoints the denoiser alone
        from sd_scripts_compat.training.offload_checkpointing import offloaded_checkpoint

        unet.enable_gradient_checkpointing(gradient_checkpointing_func=offloaded_checkpoint)
        return
    if on:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()
    for encoder in text_encoders:
        if on:  # renamed in transformers 5
            (getattr(encoder, "activation_checkpointing_enable", None) or encoder.gradient_checkpointing_enable)()
        else:
            (getattr(encoder, "activation_checkpointing_disable", None) or encoder.gradient_checkpointing_disable)()


def reset_peak(device: torch.device) -> None:
    """A new peak from here on (CUDA's counters; the emulated card resets its own)."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
