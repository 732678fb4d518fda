"""Model families (SD 1.x, SD 2.x, SDXL and their tiny test twins) as data.

Each family is one JSON file in ``data/families/``: diffusers-style configs for the UNet, VAE and
text encoder(s), the noise-scheduler config, and the few facts kohya needs (base model version,
modelspec architecture, LoRA key prefixes, whether it is a ``--v2`` model, which training script
trains it, the text-encoder layout of its single-file checkpoints). Code asks the spec; it never
branches on a family name. ``sd_scripts_compat.models.detect`` tells which family a model is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

FAMILY_DIR = Path(__file__).resolve().parents[1] / "data" / "families"
CLIP_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "clip_tokenizer"


@dataclass(frozen=True)
class TextEncoderSpec:
    config: dict[str, Any]
    tokenizer: dict[str, Any]  # pad_token, model_max_length
    lora_prefix: str  # "lora_te", "lora_te1", "lora_te2"
    hidden_state: str  # "last" or "penultimate": which layer's output conditions the UNet

    @property
    def class_name(self) -> str:
        return self.config["_class_name"]


@dataclass(frozen=True)
class FamilySpec:
    name: str
    description: str
    tiny: bool
    ss_base_model_version: str
    modelspec_architecture: str
    resolution: int
    prediction_type: str
    v2: bool  # kohya's --v2: SD 2.x (OpenCLIP text encoder, 1024-wide cross-attention)
    kohya_script: str  # the sd-scripts entry point that trains it: train_network.py / sdxl_train_network.py
    single_file_layout: str  # text-encoder layout of its original-layout checkpoints: "sd1", "sd2", "sdxl"
    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: tuple[TextEncoderSpec, ...]
    unet_lora_names: str  # "diffusers" (SD1/2) or "sgm" (SDXL): how kohya names UNet LoRA modules
    scheduler: dict[str, Any]

    @property
    def is_sdxl(self) -> bool:
        return self.unet.get("addition_embed_type") == "text_time"

    @property
    def v_parameterization(self) -> bool:
        return self.prediction_type == "v_prediction"

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent pixel along a side: each VAE encoder block but the last halves the image
        (diffusers derives it the same way). 8 for the full-size VAEs."""
        return 2 ** (len(self.vae["block_out_channels"]) - 1)

    @property
    def engine_module(self) -> str:
        """Our engine's module for ``kohya_script`` (``python -m sd_scripts_compat.sdxl_train_network``)."""
        return "sd_scripts_compat." + self.kohya_script.removesuffix(".py")


def family_names() -> list[str]:
    return sorted(path.stem for path in FAMILY_DIR.glob("*.json"))


@cache
def get_family(name: str) -> FamilySpec:
    path = FAMILY_DIR / f"{name}.json"
    if not path.is_file():
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(family_names())}")
    raw = json.loads(path.read_text(encoding="utf-8"))
    raw["text_encoders"] = tuple(TextEncoderSpec(**te) for te in raw["text_encoders"])
    return FamilySpec(**raw)


def model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A diffusers/transformers config dict without the bookkeeping ``_class_name`` key."""
    return {k: v for k, v in config.items() if not k.startswith("_")}
