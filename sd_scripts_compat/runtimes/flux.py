"""The FLUX.1 runtime, Chroma included (kohya's ``flux_train_network.py``).

Loads a transformer file or folder with kohya's ``clip_l`` / ``t5xxl`` / ``ae`` / ``t5xxl_tokenizer``
(``models.flux_files``); encodes CLIP-L's pooled output (none for Chroma) and T5-XXL with its mask; trains
flow matching as sd-scripts defines it for FLUX.1 (``flow_matching``); samples with its Euler schedule
(``flux_sampling``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning
    from sd_scripts_compat.runtimes import Encode, Objective, TextOptions

LOAD_PRIORITY = 10
PARTS = ("clip_l", "t5xxl", "ae", "t5xxl_tokenizer")  # kohya's FLUX.1 part options


def claims_source(text: str, stated: FamilySpec | None, parts: Mapping[str, str | None]) -> bool:
    """Any of FLUX.1's part options, or a FLUX transformer file or folder on its own (a built-in loads as the
    UNet runtime builds every built-in)."""
    return any(parts.get(key) for key in PARTS) or _is_flux_source(text)


def _is_flux_source(text: str) -> bool:
    """A FLUX transformer file or folder (by its header or config; builtin ids load as they are)."""
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX, denoiser_config_file

    path = Path(text).expanduser()
    if text.startswith(BUILTIN_PREFIX) or not path.exists():
        return False
    if path.is_dir():
        config = denoiser_config_file(path)
        return config is not None and config.parent.name != "unet"
    if path.suffix.lower() != ".safetensors":
        return False
    from sd_scripts_compat.models.checkpoint import read_checkpoint
    from sd_scripts_compat.models.flux_layout import is_bfl_transformer

    return is_bfl_transformer(read_checkpoint(path, header_only=True).shapes)


def load(text: str, *, stated: FamilySpec | None, parts: Mapping[str, str | None], allow_pickle: bool,
         device: str | torch.device, dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
    from sd_scripts_compat.models.flux_files import load_flux_model
    from sd_scripts_compat.models.loading import replace_vae

    bundle = load_flux_model(text, **{key: parts.get(key) for key in PARTS}, family=stated, device=device,
                             dtype=dtype, vae_dtype=vae_dtype)
    return replace_vae(bundle, parts.get("vae"), device=device, dtype=vae_dtype or dtype)  # a one-line refusal


def encode_prompts(bundle: ModelBundle, captions: list[str], options: TextOptions) -> TextConditioning:
    from sd_scripts_compat.models.text_encoding import encode_flux_tokens, tokenize_flux

    ids = tokenize_flux(bundle, captions, options.t5xxl_max_token_length)
    return encode_flux_tokens(bundle, ids, apply_t5_attn_mask=options.apply_t5_attn_mask, dtype=options.dtype)


def text_cache_key(options: TextOptions) -> tuple[int | None, str]:
    """T5's length, and the masks (a cache made without them is rebuilt)."""
    variant = f"+t5_mask={options.apply_t5_attn_mask}" + ("+lg_mask=True" if options.apply_lg_attn_mask else "")
    return options.t5xxl_max_token_length, variant


def conditioning(bundle: ModelBundle, hidden: torch.Tensor, pooled: torch.Tensor | None,
                 mask: torch.Tensor | None, batch: Mapping[str, Any],
                 options: TextOptions) -> tuple[Any, Any]:
    """T5's hidden states; the pooled CLIP-L vector (None for Chroma) and the T5 mask when applied."""
    mask = mask.to(hidden.device) if mask is not None and options.apply_t5_attn_mask else None
    pooled = pooled.to(hidden.device, options.dtype) if pooled is not None else None
    return hidden, {"pooled": pooled, "t5_attn_mask": mask}


def build_objective(config: TrainingConfig, device: torch.device, bundle: ModelBundle,
                    v_parameterization: bool) -> Objective:
    from sd_scripts_compat.runtimes.flow_matching import FlowMatchingObjective, FlowMatchSettings

    return FlowMatchingObjective(FlowMatchSettings.from_config(config), device)


def render_samples(bundle: ModelBundle, prompts: list[Any], encode: Encode, *, config: TrainingConfig,
                   out_dir: Path, name: str, device: torch.device, dtype: torch.dtype) -> list[Path]:
    from sd_scripts_compat.runtimes.flux_sampling import render_flux_samples

    def texts(captions: list[str]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(T5 hidden states, pooled CLIP-L, T5 mask or None)."""
        encoded = encode(captions)
        mask = getattr(encoded, "attention_mask", None) if config.apply_t5_attn_mask else None
        return encoded.encoder_hidden_states, encoded.pooled, mask

    return render_flux_samples(bundle, prompts, texts, guidance_scale=config.guidance_scale, out_dir=out_dir,
                               name=name, device=device, dtype=dtype)


def file_metadata(config: TrainingConfig) -> dict[str, str]:
    from sd_scripts_compat.runtimes.flow_matching import flux_metadata

    return flux_metadata(config)
