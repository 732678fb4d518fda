"""A kohya-format LoRA under diffusers' peft names, for the pipelines that do not convert kohya names themselves.

Hand-written (one line why): diffusers converts kohya LoRAs for SD 1.x/2.x, SDXL, FLUX.1 and Chroma, but its
``SD3LoraLoaderMixin`` takes only its own names, and no library converts a kohya SD3 LoRA (the format sd-scripts
and we write, which ComfyUI and Forge read as it is).

Every kohya module is found as our network finds it (``network.lora.iter_target_modules`` on the family's modules,
full size on the meta device), so each name resolves to the diffusers module it wraps: ``lora_down`` becomes
``lora_A``; ``lora_up`` times ``alpha / rank`` becomes ``lora_B`` (peft then scales by 1); a fused module (SD3's
``qkv``) gives one pair per diffusers Linear, its ``lora_up`` rows split in order. Names are the pipeline's
components: ``transformer.`` (or ``unet.``), ``text_encoder.``, ``text_encoder_2.`` ...
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.models.build import ModelBundle


def component_paths(bundle: ModelBundle) -> dict[int, str]:
    """Each module of the bundle (by identity) -> its name in a diffusers pipeline."""
    owners = [("transformer" if bundle.family.is_transformer else "unet", bundle.unet)]
    owners += [("text_encoder" if i == 0 else f"text_encoder_{i + 1}", encoder)
               for i, encoder in enumerate(bundle.text_encoders)]
    return {id(module): f"{owner}.{name}" for owner, root in owners for name, module in root.named_modules()}


def to_diffusers_lora(state: Mapping[str, torch.Tensor], bundle: ModelBundle) -> dict[str, torch.Tensor]:
    """``state`` (kohya keys) under diffusers' peft names; a key no module of ``bundle``'s family takes is a
    one-line UserError (the LoRA is of another family)."""
    from sd_scripts_compat.network.lora import FusedTargets, file_order, iter_target_modules

    state = file_order(bundle.family, dict(state))  # the file's row order -> the diffusers module's (SD3)
    paths = component_paths(bundle)
    enable = {te.lora_enable_arg for te in bundle.family.text_encoders if te.lora_enable_arg}
    out: dict[str, Any] = {}
    used: set[str] = set()
    for lora_name, _, base, _ in iter_target_modules(bundle, conv=True, enable=enable):
        down = state.get(f"{lora_name}.lora_down.weight")
        if down is None:
            continue
        up = state[f"{lora_name}.lora_up.weight"]
        alpha = state.get(f"{lora_name}.alpha")
        rank = down.shape[0]
        scale = (float(alpha) if alpha is not None else rank) / rank
        used.update(f"{lora_name}.{suffix}" for suffix in ("lora_down.weight", "lora_up.weight", "alpha"))
        row = 0
        for part in base.parts if isinstance(base, FusedTargets) else (base,):
            rows = int(getattr(part, "out_channels", None) or getattr(part, "out_features"))  # noqa: B009
            out[f"{paths[id(part)]}.lora_A.weight"] = down.clone()
            out[f"{paths[id(part)]}.lora_B.weight"] = (up[row:row + rows].float() * scale).to(up.dtype)
            row += rows
    left = sorted(set(state) - used)
    if left:
        raise UserError(f"LoRA key {left[0]} ({len(left)} in all) fits no module of {bundle.family.name}; "
                        "convert a LoRA with the model family it was trained on")
    return out


COPY_MARK = {"written_by": "lora-autotune inspect --diffusers-out"}  # a later export may replace only such a file


def export_diffusers_file(lora: str | os.PathLike[str], out: str | os.PathLike[str], family: FamilySpec) -> int:
    """Write ``lora`` (a kohya file of ``family``) as a diffusers-named copy at ``out``, atomically; the module
    paths come from the family built on the meta device (nothing is allocated). The copy keeps the training
    metadata (``ss_*``, ``modelspec.*``), its ``sshs_*`` hashes computed again for its own tensors as sd-scripts
    computes them. Returns the tensors written."""
    from safetensors.torch import save_file

    from sd_scripts_compat.facts.atomic import atomic_path
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora_file import read_lora_file, training_hashes

    source, target = Path(lora), Path(out)
    if target.resolve() == source.resolve():
        raise UserError(f"{target}: the diffusers copy would overwrite the LoRA it is made from; name another file")
    if target.suffix.lower() != ".safetensors":
        raise UserError(f"{target}: the diffusers copy is a .safetensors file; give a name ending in .safetensors")
    state, written = read_lora_file(source)
    tensors = {k: v.contiguous() for k, v in to_diffusers_lora(state, build_modules(family, device="meta",
                                                                                     seed=None)).items()}
    kept = {k: v for k, v in (written or {}).items() if k.startswith(("ss_", "modelspec."))}
    if kept:
        kept.update(training_hashes(tensors, kept))
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp), metadata={**kept, "format": "pt", **COPY_MARK})
    return len(tensors)
