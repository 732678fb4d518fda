"""What a cache holds and where its files live: the entry types, the file names, the checks and the readers.

The dataset reads caches while batching and the caching modules write them; both import this module,
which imports nothing from ``dataset/``, so neither side has to import the other.

A file's name carries a key made from everything that shapes its tensors (VAE or text encoders, scaling,
dtype, flip, resize and crop; the caption and the image's own bytes are checked from its metadata), so two
runs of different models or settings on one dataset never write the same file, and two runs of the same
model write identical contents to it (atomically, one at a time: ``caching.build_lock``). Every entry is
checked (shape, dtype, finite) when it is read, by the caching pass and again by the data path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import torch

LATENT_CACHE_SUFFIX = ".latents.safetensors"
TEXT_CACHE_SUFFIX = ".te.safetensors"


class CachedImage(Protocol):
    """What a cache file name is made from (an ``ImageRecord`` is one)."""

    @property
    def path(self) -> Path: ...

    @property
    def bucket(self) -> tuple[int, int]: ...


@dataclass
class LatentEntry:
    latents: torch.Tensor  # (C, h, w), scaled by the VAE's scaling factor
    latents_flipped: torch.Tensor | None = None


@dataclass
class TextEntry:
    encoder_hidden_states: torch.Tensor  # (tokens, features)
    pooled: torch.Tensor | None = None  # SDXL text_embeds; FLUX.1's pooled CLIP-L output
    attention_mask: torch.Tensor | None = None  # FLUX.1's T5 mask (tokens,)


def entry_key(facts: Mapping[str, str]) -> str:
    """A short name for what shaped an entry (the metadata that is not about the image's own bytes)."""
    return hashlib.sha256(json.dumps(dict(facts), sort_keys=True).encode("utf-8")).hexdigest()[:10]


def latent_cache_path(record: CachedImage, key: str, cache_dir: Path | None = None) -> Path:
    """``<image name>.<W>x<H>.<key>.latents.safetensors`` beside the image (or under ``cache_dir``, see
    :func:`cache_folder`): the bucket and the key in the name let resolutions and models coexist."""
    width, height = record.bucket
    return cache_folder(record.path.parent, cache_dir, "latents") / \
        f"{record.path.name}.{width}x{height}.{key}{LATENT_CACHE_SUFFIX}"


def text_cache_path(record: CachedImage, key: str, cache_dir: Path | None = None) -> Path:
    """``<image name>.<key>.te.safetensors``: the key names the encoders and their settings."""
    return cache_folder(record.path.parent, cache_dir, "text") / f"{record.path.name}.{key}{TEXT_CACHE_SUFFIX}"


def cache_folder(image_dir: Path, cache_dir: Path | None, kind: str) -> Path:
    """Where cache files of the images in ``image_dir`` live: beside them (sd-scripts' place), or, given a
    ``cache_dir``, in ``cache_dir/<kind>/<hash of the image folder>`` (one folder per image folder, so two
    folders with the same file names do not share files). The file names and format are the same in both."""
    if cache_dir is None:
        return image_dir
    key = hashlib.sha256(os.fsencode(image_dir.resolve())).hexdigest()[:16]
    return cache_dir / kind / key


def folder_writable(folder: Path) -> bool:
    """Whether we may create files in ``folder`` (a read-only mount or an immutable folder says no, even to root)."""
    return os.access(folder, os.W_OK | os.X_OK)


class DamagedEntry(UserError):
    """A cache file that cannot be trained on: unreadable, of the wrong shape or dtype, or not finite."""


def latent_problem(entry: LatentEntry, shape: tuple[int, ...] | None, flip: bool) -> str | None:
    """Why ``entry`` cannot be trained on (None: it can): ``shape`` is (C, h, w) as the VAE makes it."""
    import torch

    tensors = [entry.latents] if entry.latents_flipped is None else [entry.latents, entry.latents_flipped]
    if flip and entry.latents_flipped is None:
        return "no flipped latents although flip_aug is on"
    for tensor in tensors:
        if tensor.dtype != torch.float32:
            return f"dtype {str(tensor.dtype).removeprefix('torch.')}, not float32"
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            return f"shape {tuple(tensor.shape)}, not {tuple(shape)}"
        if not bool(torch.isfinite(tensor).all()):
            return "values that are not finite (NaN or Inf)"
    return None


def text_problem(entry: TextEntry) -> str | None:
    """Why a text-encoder entry cannot be trained on (None: it can)."""
    import torch

    if entry.encoder_hidden_states.dim() != 2:
        return f"hidden states of shape {tuple(entry.encoder_hidden_states.shape)}, not (tokens, features)"
    for tensor in (entry.encoder_hidden_states, entry.pooled):
        if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return "values that are not finite (NaN or Inf)"
    return None


def load_latent_file(path: Path) -> LatentEntry:
    """The entry in ``path``, unchecked; OSError or a safetensors error when unreadable."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return LatentEntry(tensors["latents"], tensors.get("latents_flipped"))


def load_text_file(path: Path) -> TextEntry:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return TextEntry(tensors["encoder_hidden_states"], tensors.get("pooled"), tensors.get("attention_mask"))


_CHANGED = "it was checked when this run started: delete it and resume (--resume), it will be rebuilt"


def read_latent_file(path: Path, shape: tuple[int, ...] | None = None, flip: bool = False) -> LatentEntry:
    """The data path's read: a checked entry, or a one-line :class:`DamagedEntry` naming the file."""
    try:
        entry = load_latent_file(path)
    except Exception as error:  # noqa: BLE001 - missing, truncated or foreign: all say the same to the user
        raise DamagedEntry(f"{path}: the latent cache cannot be read ({_short(error)}); {_CHANGED}") from None
    problem = latent_problem(entry, shape, flip)
    if problem:
        raise DamagedEntry(f"{path}: the latent cache holds {problem}; {_CHANGED}")
    return entry


def read_text_file(path: Path) -> TextEntry:
    try:
        entry = load_text_file(path)
    except Exception as error:  # noqa: BLE001
        raise DamagedEntry(f"{path}: the text-encoder cache cannot be read ({_short(error)}); {_CHANGED}") from None
    problem = text_problem(entry)
    if problem:
        raise DamagedEntry(f"{path}: the text-encoder cache holds {problem}; {_CHANGED}")
    return entry


def _short(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    if isinstance(error, KeyError):
        return f"no {error.args[0]!r} tensor"
    return " ".join(str(error).split())[:120] or type(error).__name__
