"""Reading a single-file checkpoint: its tensors (or only their header) and which original layout it has.

Apart from ``single_file`` (conversion and loading) so the cheap family detector (``models.detect``)
can read headers without importing the converters, and neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import torch

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_TE_PREFIX = "cond_stage_model.transformer.text_model."
# SD 1.x files saved with transformers before 4.x's text_model level: cond_stage_model.transformer.encoder.*
SD1_OLD_TE_PREFIX = "cond_stage_model.transformer."
SD2_TE_PREFIX = "cond_stage_model.model."
SDXL_TE1_PREFIX = "conditioner.embedders.0.transformer.text_model."
SDXL_TE2_PREFIX = "conditioner.embedders.1.model."

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth")


@dataclass
class Checkpoint:
    """A single file's tensors (or only their shapes) and its safetensors metadata."""

    path: Path
    shapes: dict[str, tuple[int, ...]]
    metadata: dict[str, str]
    tensors: dict[str, torch.Tensor] | None  # None when only the header was read

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors of a checkpoint read whole (a header-only read has none: a bug in the caller)."""
        if self.tensors is None:
            raise ValueError(f"{self.path}: only its header was read")
        return self.tensors


DtypeOf = Callable[[str], "torch.dtype | None"]  # a tensor's name -> the dtype to hold it in (None: the file's)


def read_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False,
                    header_only: bool = False, dtype_of: DtypeOf | None = None,
                    keep: Callable[[str], bool] | None = None) -> Checkpoint:
    """Read a ``.safetensors`` (or, behind ``allow_pickle``, a ``.ckpt``/``.pt``) checkpoint.

    ``dtype_of`` casts each floating tensor as it is read (the training dtype of the module it goes to), so the
    file's own copy of a tensor lives only until it is cast: loading needs the loaded modules' size, not the
    file's plus theirs. ``keep`` names the tensors to read (a .safetensors file's others are never read; default
    all). Every failure is a one-line UserError naming the file: missing, unknown suffix, pickle
    without the flag, unreadable / truncated / not a checkpoint at all.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"model file {path} not found; expected a .safetensors checkpoint, a diffusers folder "
                        "with model_index.json, or builtin:<id>")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return _current_text_encoder_names(_read_safetensors(path, header_only, dtype_of, keep))
    if suffix in PICKLE_SUFFIXES:
        if not allow_pickle:
            raise UserError(f"{path} is a pickle checkpoint, which can run code when loaded; convert it to "
                            ".safetensors (preferred) or pass --allow_pickle to load it with weights_only=True")
        return _current_text_encoder_names(_read_pickle(path, dtype_of))
    if suffix == ".gguf":
        raise UserError(f"{path} is a GGUF-quantized model, which sd-scripts cannot train from; use the model's "
                        ".safetensors file (bf16, fp16 or fp8)")
    raise UserError(f"{path}: unknown model file type {suffix or '(no suffix)'!r}; expected .safetensors "
                    "(or .ckpt/.pt with --allow_pickle) or a diffusers folder with model_index.json")


# integer weights: a quantized file (bitsandbytes int8 / nf4, or another scheme) no LoRA trainer can start from
_QUANTIZED = {"I8": "int8", "U8": "uint8 (4-bit packed)", "I16": "int16", "I32": "int32"}


def _refuse_quantized(path: Path, dtypes: dict[str, str]) -> None:
    """A weight or bias stored as integers cannot be trained on (sd-scripts would fail deep in loading): one line
    naming the dtype and a tensor. Integer buffers (CLIP's ``position_ids``) are no weights and pass."""
    for key, dtype in dtypes.items():
        if dtype in _QUANTIZED and key.endswith((".weight", ".bias")):
            raise UserError(f"{path} holds quantized weights ({_QUANTIZED[dtype]}, e.g. {key}), which cannot be "
                            "trained from; use the model's bf16, fp16 or fp8 .safetensors file")


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _read_safetensors(path: Path, header_only: bool, dtype_of: DtypeOf | None,
                      keep: Callable[[str], bool] | None = None) -> Checkpoint:
    from safetensors import safe_open

    from sd_scripts_compat.safetensors_file import read_tensors

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            keys = list(handle.keys())
            slices = {key: handle.get_slice(key) for key in keys}
            shapes = {key: tuple(piece.get_shape()) for key, piece in slices.items()}
            dtypes = {key: piece.get_dtype() for key, piece in slices.items()}
            _refuse_quantized(path, dtypes)
        # each tensor into its own buffer and cast at once: no mapped file stays resident beside the modules
        tensors = None if header_only else read_tensors(path, dtype_of or (lambda key: None), keep)
    except UserError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError plus OSError/ValueError
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path} is not a readable safetensors file (corrupt or truncated?): {reason}; "
                        "expected a Stable Diffusion checkpoint") from None
    return Checkpoint(path=path, shapes=shapes, metadata=metadata, tensors=tensors)


def _read_pickle(path: Path, dtype_of: DtypeOf | None) -> Checkpoint:
    import torch

    try:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path} could not be loaded with torch.load(weights_only=True) (corrupt, truncated or "
                        f"holds more than tensors): {reason[:200]}") from None
    if isinstance(raw, dict) and isinstance(raw.get("state_dict"), dict):
        raw = raw["state_dict"]
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a {type(raw).__name__}, not a state dict; "
                        "expected a Stable Diffusion checkpoint")
    tensors = {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    del raw  # the tensors' only other holder: a cast below then frees each original
    _refuse_quantized(path, {k: {torch.int8: "I8", torch.uint8: "U8"}.get(v.dtype, "") for k, v in tensors.items()})
    if dtype_of is not None:
        for key in list(tensors):  # one at a time: each original goes as soon as its cast copy exists
            tensors[key] = _cast(tensors[key], dtype_of(key))
    return Checkpoint(path=path, shapes={k: tuple(v.shape) for k, v in tensors.items()}, metadata={}, tensors=tensors)


def _old_sd1_name(key: str) -> str:
    """``cond_stage_model.transformer.encoder.*`` (older SD 1.x files) -> ``...transformer.text_model.encoder.*``."""
    if key.startswith(SD1_OLD_TE_PREFIX) and not key.startswith(SD1_TE_PREFIX):
        return SD1_TE_PREFIX + key[len(SD1_OLD_TE_PREFIX):]
    return key


def _current_text_encoder_names(checkpoint: Checkpoint) -> Checkpoint:
    """The older SD 1.x text-encoder layout converted on read, as sd-scripts and ComfyUI accept it."""
    if not any(_old_sd1_name(key) != key for key in checkpoint.shapes):
        return checkpoint
    tensors = None if checkpoint.tensors is None else {_old_sd1_name(k): v for k, v in checkpoint.tensors.items()}
    return Checkpoint(path=checkpoint.path, shapes={_old_sd1_name(k): v for k, v in checkpoint.shapes.items()},
                      metadata=checkpoint.metadata, tensors=tensors)


def detect_layout(checkpoint: Checkpoint) -> str:
    """"sd1", "sd2", "sdxl" or "flux" (a BFL-layout FLUX transformer) from the key structure; a UserError for
    LoRAs and other non-models."""
    from sd_scripts_compat.models.flux_layout import is_bfl_transformer

    keys = checkpoint.shapes.keys()
    if any(k.startswith(("lora_unet_", "lora_te")) or ".lora_down." in k or ".lora_A." in k for k in keys):
        raise UserError(f"{checkpoint.path} is a LoRA file, not a base model; pass it as network_weights and give "
                        "a Stable Diffusion checkpoint as the base model")
    if is_bfl_transformer(keys):
        return "flux"
    if not any(k.startswith(UNET_PREFIX) for k in keys):
        raise UserError(f"{checkpoint.path} holds no Stable Diffusion UNet (no '{UNET_PREFIX}*' keys); expected "
                        "an original-layout SD1/SD2/SDXL checkpoint")
    if any(k.startswith(SDXL_TE2_PREFIX) for k in keys):
        return "sdxl"
    if any(k.startswith(SD2_TE_PREFIX) for k in keys):
        return "sd2"
    if any(k.startswith(SD1_TE_PREFIX) for k in keys):
        return "sd1"
    raise UserError(f"{checkpoint.path} has a UNet but no known text encoder (expected cond_stage_model.* or "
                    "conditioner.embedders.*); expected a full SD1/SD2/SDXL checkpoint")
