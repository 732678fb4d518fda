"""Model families (SD 1.x, SD 2.x, SDXL, FLUX.1 and their tiny test twins) as data.

Each family is one JSON file in ``data/families/``: diffusers-style configs for the denoiser (a UNet
or a transformer, named by its ``_class_name``; the JSON key stays ``unet`` for every family), the
VAE / AE and text encoder(s), the noise-scheduler config, and the few facts kohya needs (base model
version, modelspec architecture, LoRA key prefixes, whether it is a ``--v2`` model, which training
script trains it, the layout of its single-file checkpoints, the training objective). Code asks the
spec; it never branches on a family name. ``sd_scripts_compat.models.detect`` tells which family a
model is.
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
    hidden_state: str  # "last", "penultimate" (which layer conditions the UNet) or "pooled" (FLUX's CLIP-L)
    file_option: str | None = None  # the kohya option naming its own file when the base file lacks it (FLUX)
    lora_by_default: bool = True  # False: LoRA only on request (FLUX's T5-XXL: network_args train_t5xxl=True)
    lora_enable_arg: str | None = None  # the network_args key that requests it ("train_t5xxl")

    @property
    def class_name(self) -> str:
        return self.config["_class_name"]

    @property
    def tokenizer_kind(self) -> str:
        """"clip" (BPE vocabulary shipped with us) or "t5" (SentencePiece, read from the user's folder)."""
        return self.tokenizer.get("kind", "clip")

    @property
    def width(self) -> int:
        """Hidden size (transformers calls it ``hidden_size`` for CLIP, ``d_model`` for T5)."""
        return int(self.config.get("hidden_size", self.config.get("d_model", 0)))


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
    objective: str = "noise_prediction"  # "noise_prediction" (epsilon / v) or "flow_matching" (FLUX)
    modelspec_implementation: str | None = None  # modelspec.implementation when the family fixes it
    latent_patch_size: int = 1  # latent pixels packed into one transformer token along a side (FLUX: 2)
    t5xxl_max_token_length: int | None = None  # kohya's default for FLUX: dev 512, schnell 256
    flux_model_type: str | None = None  # kohya's --model_type value ("flux") for FLUX-family files
    builtin_meta_only: bool = False  # builtin:<name> only on the meta device (too large for random weights)
    network_module: str = "networks.lora"  # kohya's --network_module for this family (FLUX: networks.lora_flux)

    @property
    def denoiser_class(self) -> str:
        """The denoiser's diffusers class: "UNet2DConditionModel" or "FluxTransformer2DModel"."""
        return self.unet["_class_name"]

    @property
    def is_transformer(self) -> bool:
        """True when the denoiser takes packed latent tokens instead of a latent image."""
        return not self.denoiser_class.startswith("UNet")

    @property
    def flow_matching(self) -> bool:
        return self.objective == "flow_matching"

    @property
    def bucket_step(self) -> int:
        """The smallest image-size step the model takes: VAE downsampling times latent patch packing
        (8 for SD, 16 for FLUX)."""
        return self.latent_downsample * self.latent_patch_size

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
