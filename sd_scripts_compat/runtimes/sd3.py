"""The SD3 runtime: SD3.5 Medium and Large (kohya's ``sd3_train_network.py``).

Loads an SD3 single file, diffusers folder or built-in with kohya's ``clip_l`` / ``clip_g`` / ``t5xxl`` /
``vae`` (``models.sd3_files``); encodes CLIP-L and CLIP-G (penultimate layers, padded to T5's width) before
T5-XXL, with their masks; trains flow matching as sd-scripts defines it for SD3 (``sd3_flow``); samples with
its shifted Euler schedule (``sd3_sampling``). The conditioning is FLUX.1's; the text cache's key too, marked
where the masks are given to the encoders (before, they zeroed the outputs: such a cache is made again).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.runtimes import flux
from sd_scripts_compat.runtimes.flux import conditioning

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning
    from sd_scripts_compat.runtimes import Encode, Objective, TextOptions

__all__ = ["conditioning"]
LOAD_PRIORITY = 0  # asked first: its clip_g, and SD3 files that would otherwise pass for other layouts
PARTS = ("clip_l", "clip_g", "t5xxl", "vae")  # kohya's SD3 part options


def text_cache_key(options: TextOptions) -> tuple[int | None, str]:
    """FLUX.1's key; with a mask, marked as given to the encoders (``models.text_encoding.encode_sd3_tokens``)."""
    length, variant = flux.text_cache_key(options)
    masked = options.apply_t5_attn_mask or options.apply_lg_attn_mask
    return length, variant + ("+masks_in_encoders" if masked else "")


def claims_source(text: str, stated: FamilySpec | None, parts: Mapping[str, str | None]) -> bool:
    """``clip_g`` (SD3's own option), or a built-in, folder or .safetensors file whose family, told from its
    headers or configs alone, runs on this runtime."""
    from sd_scripts_compat.facts.errors import UserError
    from sd_scripts_compat.models.detect import BUILTIN_PREFIX, ENGINE_STATED_BY, detect_family

    if parts.get("clip_g"):
        return True
    path = Path(text).expanduser()
    if not (text.startswith(BUILTIN_PREFIX) or path.is_dir()
            or (path.is_file() and path.suffix.lower() == ".safetensors")):
        return False
    try:
        return detect_family(text, stated, stated_by=ENGINE_STATED_BY).runtime == __name__.rpartition(".")[2]
    except UserError:
        return False  # the family's own loader says what is wrong, in its words


def load(text: str, *, stated: FamilySpec | None, parts: Mapping[str, str | None], allow_pickle: bool,
         device: str | torch.device, dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
    from sd_scripts_compat.models.sd3_files import load_sd3_model

    return load_sd3_model(text, parts={key: parts.get(key) for key in PARTS},
                          t5xxl_tokenizer=parts.get("t5xxl_tokenizer"), family=stated, device=device, dtype=dtype,
                          vae_dtype=vae_dtype)


def encode_prompts(bundle: ModelBundle, captions: list[str], options: TextOptions) -> TextConditioning:
    from sd_scripts_compat.models.text_encoding import encode_sd3_tokens, tokenize_sd3

    ids = tokenize_sd3(bundle, captions, options.t5xxl_max_token_length)
    return encode_sd3_tokens(bundle, ids, dtype=options.dtype, apply_lg_attn_mask=options.apply_lg_attn_mask,
                             apply_t5_attn_mask=options.apply_t5_attn_mask)


def build_objective(config: TrainingConfig, device: torch.device, bundle: ModelBundle,
                    v_parameterization: bool) -> Objective:
    from sd_scripts_compat.runtimes.sd3_flow import Sd3FlowObjective, Sd3FlowSettings

    return Sd3FlowObjective(Sd3FlowSettings.from_config(config))


def render_samples(bundle: ModelBundle, prompts: list[Any], encode: Encode, *, config: TrainingConfig,
                   out_dir: Path, name: str, device: torch.device, dtype: torch.dtype) -> list[Path]:
    from sd_scripts_compat.runtimes.sd3_sampling import render_sd3_samples

    return render_sd3_samples(bundle, prompts, encode, out_dir=out_dir, name=name, device=device, dtype=dtype)


def file_metadata(config: TrainingConfig) -> dict[str, str]:
    from sd_scripts_compat.runtimes.sd3_flow import sd3_metadata

    return sd3_metadata(config)
