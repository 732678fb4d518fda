"""Saving and restoring a training run's state for an exact-step resume.

A state folder (kohya's names: ``{output_name}-step{N:08d}-state``, ``{output_name}-state``) holds
``train_state.json`` (counters, RNG states of Python and NumPy, non-tensor optimizer/scheduler
state) and ``tensors.safetensors`` (LoRA weights, optimizer tensors, torch RNG states). Written by
hand instead of ``accelerate.save_state`` because that pickles the optimizer and RNG states and we
never load pickles we did not ask for; here nothing needs unpickling at all.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.atomic import atomic_folder, atomic_path, write_text_atomic
from sd_scripts_compat.facts.contract import STATE_FILE, disk_full_guard

if TYPE_CHECKING:
    import torch

TENSOR_FILE = "tensors.safetensors"


@dataclass
class TrainCounters:
    global_step: int = 0  # optimizer steps done
    epoch: int = 0  # 0-based epoch the next step belongs to
    step_in_epoch: int = 0  # batches of `epoch` already consumed (micro-batches)
    seconds_trained: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def rebatch(self, old_batch: int, new_batch: int) -> None:
        """The epoch's position in micro-batches of ``new_batch`` samples (a resume or an in-process change of
        the micro-batch): rounded down, so no sample is skipped unseen; at most one micro-batch is seen twice."""
        self.step_in_epoch = self.step_in_epoch * old_batch // new_batch
        self.extra["micro_batch"] = new_batch

    @property
    def epochs_begun(self) -> int:
        """sd-scripts' epoch number: the 1-based epoch in progress, or the one just finished at an epoch's end
        (its ``current_epoch`` in train_state.json, and the final LoRA's ``ss_epoch``: 20 after 20 whole epochs,
        where ``epoch`` is still 19 when the last step ended the run before the epoch-end bookkeeping)."""
        return self.epoch + (1 if self.step_in_epoch > 0 else 0)


def _encode(value: Any, tensors: dict[str, Any], path: str) -> Any:
    """Turn a nested optimizer/scheduler state into JSON, moving tensors into ``tensors``."""
    import torch

    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().cpu().clone()  # clone: bitsandbytes shares qmap tensors across params
        return {"__tensor__": path}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, tensors, f"{path}/k{i}"), _encode(v, tensors, f"{path}/{i}")]
                             for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, tensors, f"{path}/{i}") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if hasattr(value, "tolist") and type(value).__module__ == "numpy":
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"cannot save a {type(value).__name__} in a training state ({path})")


def _decode(value: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__dict__" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__dict__"]}
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if "__ndarray__" in value:
            import numpy as np

            return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    return value


def step_generator(seed: int, global_step: int, micro_step: int, device: str | torch.device) -> torch.Generator:
    """A generator that depends only on (seed, step): resumed runs draw the same noise."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + global_step * 257 + micro_step) % (2**63))
    return generator


def rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_train_state(folder: Path, *, lora_state: dict[str, Any], optimizer: torch.optim.Optimizer,
                     lr_scheduler: torch.optim.lr_scheduler.LRScheduler, counters: TrainCounters,
                     settings: dict[str, Any]) -> Path:
    """Write a complete state folder atomically (temp folder, then rename over any old one)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors: dict[str, Any] = {f"lora/{k}": v.detach().contiguous().cpu() for k, v in lora_state.items()}
    document = {
        "format": "lora-autotune-state/1",
        "counters": asdict(counters),
        "settings": settings,
        "optimizer": _encode(optimizer.state_dict(), tensors, "optimizer"),
        "lr_scheduler": _encode(lr_scheduler.state_dict(), tensors, "lr_scheduler"),
        "rng": _encode(rng_state(), tensors, "rng"),
        # kohya's train_state.json keys, so sd-scripts users recognise the folder
        "current_epoch": counters.epochs_begun,
        "current_step": counters.global_step,
    }
    text = json.dumps(document, indent=1)
    needed = sum(t.numel() * t.element_size() for t in tensors.values()) + len(text)
    # a full disk: one line naming the folder and the space needed; the previous state folder stays whole
    with disk_full_guard(folder.parent, needed, f"the training state {folder.name}"), atomic_folder(folder) as tmp:
        with atomic_path(tmp / TENSOR_FILE) as tensor_file:  # atomic_path: the umask's permissions, not 0600
            save_file(tensors, str(tensor_file))
        write_text_atomic(tmp / STATE_FILE, text)
    return folder


@dataclass
class LoadedState:
    counters: TrainCounters
    settings: dict[str, Any]
    lora_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    lr_scheduler_state: dict[str, Any]
    rng: dict[str, Any]


def load_train_state(folder: Path) -> LoadedState:
    from safetensors.torch import load_file

    from sd_scripts_compat.facts.errors import UserError

    folder = Path(folder)
    state_file, tensor_file = folder / STATE_FILE, folder / TENSOR_FILE
    if not state_file.is_file() or not tensor_file.is_file():
        raise UserError(f"{folder}: not a lora-autotune state folder (needs {STATE_FILE} and {TENSOR_FILE}); "
                        "pass a folder written with --save_state")
    try:
        document = json.loads(state_file.read_text(encoding="utf-8"))
        tensors = load_file(str(tensor_file))
    except (OSError, ValueError) as error:
        raise UserError(f"{folder}: state is unreadable ({error}); resume from an older state folder") from None
    if document.get("format") != "lora-autotune-state/1":
        raise UserError(f"{state_file}: unknown state format {document.get('format')!r}")
    return LoadedState(
        counters=TrainCounters(**document["counters"]),
        settings=document.get("settings", {}),
        lora_state={k[len("lora/"):]: v for k, v in tensors.items() if k.startswith("lora/")},
        optimizer_state=_decode(document["optimizer"], tensors),
        lr_scheduler_state=_decode(document["lr_scheduler"], tensors),
        rng=_decode(document["rng"], tensors),
    )
