"""What a cache holds and where its files live: the entry types, the file names and the readers.

The dataset reads caches while batching and the caching modules write them; both import this module,
which imports nothing from ``dataset/``, so neither side has to import the other.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

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


def latent_cache_path(record: CachedImage, cache_dir: Path | None = None) -> Path:
    """Beside the image (or under ``cache_dir``, see :func:`cache_folder`); the bucket is in the name so
    several resolutions can coexist."""
    width, height = record.bucket
    return cache_folder(record.path.parent, cache_dir, "latents") / \
        f"{record.path.name}.{width}x{height}{LATENT_CACHE_SUFFIX}"


def text_cache_path(record: CachedImage, cache_dir: Path | None = None) -> Path:
    return cache_folder(record.path.parent, cache_dir, "text") / (record.path.name + TEXT_CACHE_SUFFIX)


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


def read_latent_file(path: Path) -> LatentEntry:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return LatentEntry(tensors["latents"], tensors.get("latents_flipped"))


def read_text_file(path: Path) -> TextEntry:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return TextEntry(tensors["encoder_hidden_states"], tensors.get("pooled"), tensors.get("attention_mask"))
