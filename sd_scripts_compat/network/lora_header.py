"""A safetensors file's header without torch: each tensor's dtype and shape, the metadata, and the values of its
0-dim tensors (a LoRA's alphas). Enough to describe a LoRA (``autotune inspect``) in a fraction of a second.

The header itself is read by ``sd_scripts_compat.safetensors_file`` (by hand: the safetensors package reads
bfloat16 values only through torch, whose import alone takes a second or more).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.safetensors_file import Entry, read_entries

if TYPE_CHECKING:
    from typing import BinaryIO

    import torch

DTYPE_NAMES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "F64": "fp64", "F8_E4M3": "fp8_e4m3",
               "F8_E5M2": "fp8_e5m2"}
_SCALAR = {"F32": "<f", "F16": "<e", "F64": "<d", "I64": "<q", "I32": "<i", "I16": "<h", "I8": "<b", "U8": "<B"}
_TORCH_NAMES = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header tells it: shape, dtype name ("fp32", "bf16", ...) and, for a 0-dim one, its value."""

    shape: tuple[int, ...]
    dtype: str
    value: float | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        """A loaded torch tensor's info (or the info itself)."""
        if isinstance(tensor, TensorInfo):
            return tensor
        value = float(tensor.float().item()) if tensor.dim() == 0 else None
        dtype = _TORCH_NAMES.get(str(tensor.dtype), str(tensor.dtype).removeprefix("torch."))
        return cls(tuple(int(n) for n in tensor.shape), dtype, value)


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file; a one-line UserError naming it when it is not one."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            entries, metadata = read_entries(handle)
            tensors = {key: _info(handle, entry) for key, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error) or type(error).__name__
        raise UserError(f"{path}: not a readable safetensors file (corrupt or truncated?): {reason}") from None
    return tensors, metadata


def _info(handle: BinaryIO, entry: Entry) -> TensorInfo:
    value = None
    if not entry.shape:
        handle.seek(entry.start)
        raw = handle.read(entry.end - entry.start)
        if entry.dtype == "BF16":  # the upper half of a float32
            value = struct.unpack("<f", b"\0\0" + raw[:2])[0]
        elif entry.dtype in _SCALAR:
            value = float(struct.unpack(_SCALAR[entry.dtype], raw[: struct.calcsize(_SCALAR[entry.dtype])])[0])
    return TensorInfo(entry.shape, DTYPE_NAMES.get(entry.dtype, entry.dtype), value)
