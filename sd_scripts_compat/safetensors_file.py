"""Reading a safetensors file by hand where the package does not serve: its header without torch, and its tensors
one at a time into buffers of their own.

The format: an 8-byte little-endian header length, the JSON header (each tensor's dtype, shape and byte range),
then the data. Written by hand for two reasons: the safetensors package reads bfloat16 values only through torch
(whose import alone takes a second: ``autotune inspect`` must not), and it memory-maps the whole file, whose pages
stay resident while the handle is open, so a loader that casts each tensor as it reads still peaked at the file's
size plus the modules'. ``read_tensors`` reads each tensor into its own buffer with ``readinto``: loading holds
the modules and one tensor in flight, nothing of the file beside them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from types import ModuleType

    import torch

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class Entry:
    """One tensor as the header tells it: the safetensors dtype name ("F32", "BF16", ...), shape, and its bytes'
    place in the file (absolute offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_entries(handle: BinaryIO) -> tuple[dict[str, Entry], dict[str, str]]:
    """``(entries, metadata)`` of an open safetensors file; ValueError (KeyError, TypeError) when it is not one."""
    size = os.fstat(handle.fileno()).st_size
    length = int.from_bytes(handle.read(8), "little")
    if size < 8 or not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
        raise ValueError("the header length is not that of a safetensors file")
    header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries = {}
    for key, entry in header.items():
        start, end = (8 + length + int(n) for n in entry["data_offsets"])
        if not 8 + length <= start <= end <= size:
            raise ValueError(f"tensor {key} lies beyond the end of the file")
        entries[key] = Entry(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]), start, end)
    return entries, {str(k): str(v) for k, v in metadata.items()}


def read_tensors(path: str | os.PathLike[str], dtype_of: Callable[[str], torch.dtype | None],
                 keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Every tensor of ``path`` (or those ``keep`` names), each read into its own buffer and cast to
    ``dtype_of(name)`` when floating (None: kept as stored); the stored copy goes as soon as its cast exists.
    ValueError / OSError when unreadable."""
    import torch

    dtypes = _torch_dtypes(torch)
    tensors: dict[str, Any] = {}
    with Path(path).open("rb", buffering=0) as handle:
        entries, _ = read_entries(handle)
        for key, entry in entries.items():
            if keep is not None and not keep(key):
                continue
            stored = dtypes.get(entry.dtype)
            if stored is None:
                raise ValueError(f"tensor {key} has the unknown dtype {entry.dtype}")
            raw = torch.empty(entry.end - entry.start, dtype=torch.uint8)
            handle.seek(entry.start)
            if handle.readinto(raw.numpy().data) != raw.numel():
                raise ValueError(f"tensor {key} is cut short (truncated file)")
            tensor = raw.view(stored).reshape(entry.shape) if raw.numel() else torch.empty(entry.shape, dtype=stored)
            target = dtype_of(key)
            tensors[key] = tensor.to(target) if target is not None and tensor.is_floating_point() else tensor
    return tensors


def _torch_dtypes(torch: ModuleType) -> dict[str, Any]:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
