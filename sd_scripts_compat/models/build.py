"""The in-memory model bundle and building a family's modules from its configs (random weights).

Every loader (built-in id, diffusers folder, single-file checkpoint) returns a ``ModelBundle``, so
the trainer, the LoRA network and the memory tracer see one shape whatever the user's file was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.models.families import CLIP_TOKENIZER_DIR, FamilySpec, model_config

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel


@dataclass
class ModelBundle:
    family: FamilySpec
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoders: list[Any]  # transformers CLIPTextModel / CLIPTextModelWithProjection
    tokenizers: list[Any]  # transformers CLIPTokenizer, one per text encoder
    scheduler_config: dict[str, Any]
    prediction_type: str
    source: str = ""  # what it was loaded from: "builtin:tiny-sd15", a path, ...
    extra: dict[str, Any] = field(default_factory=dict)


def load_tokenizer(folder: str | None = None, pad_token: str | None = "<|endoftext|>", max_length: int = 77) -> Any:
    """A CLIP tokenizer from ``folder`` (a model's own tokenizer) or from the vocabulary we ship.

    transformers 5 ignores ``vocab_file=``/``merges_file=`` keyword paths, so we always go through
    ``from_pretrained`` on a folder holding vocab.json + merges.txt (no hub access).
    ``pad_token=None`` keeps the folder's own pad token (a model folder knows best how it pads).
    """
    from transformers import CLIPTokenizer

    source = folder or str(CLIP_TOKENIZER_DIR)
    kwargs = {} if pad_token is None else {"pad_token": pad_token}
    return CLIPTokenizer.from_pretrained(source, model_max_length=max_length, local_files_only=True, **kwargs)


def build_text_encoder(config: dict[str, Any]) -> Any:
    import transformers

    cls = getattr(transformers, config["_class_name"])
    return cls(transformers.CLIPTextConfig(**model_config(config)))


def build_modules(family: FamilySpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  seed: int | None = 0) -> ModelBundle:
    """Build a family's UNet, VAE and text encoders from its configs with random weights.

    ``device="meta"`` builds only shapes (a full SDXL in well under a second), for FLOP counting
    and memory tracing without allocating gigabytes.
    """
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**model_config(family.unet))
        vae = AutoencoderKL(**model_config(family.vae))
        text_encoders = [build_text_encoder(te.config) for te in family.text_encoders]
    modules = [unet, vae, *text_encoders]
    for module in modules:
        module.requires_grad_(False)
        module.eval()
        if dtype is not None:
            module.to(dtype)
    tokenizers = [load_tokenizer(pad_token=te.tokenizer["pad_token"], max_length=te.tokenizer["model_max_length"])
                  for te in family.text_encoders]
    return ModelBundle(family=family, unet=unet, vae=vae, text_encoders=text_encoders, tokenizers=tokenizers,
                       scheduler_config=dict(family.scheduler), prediction_type=family.prediction_type,
                       source=f"builtin:{family.name}")
