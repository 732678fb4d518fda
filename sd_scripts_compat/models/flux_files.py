"""FLUX.1 as sd-scripts takes it: four files, or a diffusers folder, loaded offline into one ModelBundle.

  pretrained_model_name_or_path  the transformer: a BFL single file (flux1-dev.safetensors: double_blocks.N...,
                                 with or without ComfyUI's ``model.diffusion_model.`` prefix), a diffusers
                                 pipeline folder (transformer/, and its text_encoder*/, vae/, tokenizer_2/
                                 when the options below are not given), a lone transformer folder, or builtin:ID
  clip_l                         CLIP-L text encoder single file (transformers names, ``text_model.`` optional)
  t5xxl                          T5-XXL encoder single file (bf16 / fp16 / fp32 or fp8 e4m3fn, cast on load)
  ae                             the 16-channel AE (BFL ae.safetensors: the original VAE names, no prefix)
  t5xxl_tokenizer                the T5 tokenizer folder or file (see ``models.t5_tokenizer``)

Conversions: the transformer through ``flux_layout`` (why hand-written is said there), the AE through
diffusers' ``convert_ldm_vae_checkpoint`` with our AE config. ``save_flux_files`` writes the same four
layouts (tests and demos use real files).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec
from sd_scripts_compat.models.build import empty_modules
from sd_scripts_compat.models.file_depth import T5_BLOCKS

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from sd_scripts_compat.models.build import ModelBundle

PART_OPTIONS = ("clip_l", "t5xxl", "ae")
# keys that tell each part's file apart (a file given for the wrong option is named as what it is)
_PART_MARKERS = {"clip_l": ("embeddings.token_embedding.weight",), "t5xxl": ("encoder.block.0.layer.0.",),
                 "ae": ("decoder.conv_out.weight",), "transformer": ("double_blocks.",)}
_WHAT = {"clip_l": "a CLIP-L text encoder (clip_l)", "t5xxl": "a T5-XXL encoder (t5xxl)",
         "ae": "a FLUX/SD autoencoder (ae)", "transformer": "a FLUX transformer (pretrained_model_name_or_path)",
         "sd": "a Stable Diffusion checkpoint"}
_EXPECTED = {"clip_l": "clip_l.safetensors (CLIP-L text encoder)", "t5xxl": "t5xxl_fp16.safetensors or "
             "t5xxl_fp8_e4m3fn.safetensors", "ae": "ae.safetensors (FLUX.1's 16-channel autoencoder)"}


def _kind_of(keys: Iterable[str]) -> str | None:
    keys = list(keys)
    if any(k.startswith(("model.diffusion_model.input_blocks", "first_stage_model.", "cond_stage_model.",
                         "conditioner.")) for k in keys):
        return "sd"
    for kind, markers in _PART_MARKERS.items():
        if any(marker in k for k in keys for marker in markers):
            return kind
    return None


def _read(path: str | os.PathLike[str], option: str, header_only: bool,
          dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A part's tensors (each cast to ``dtype`` as it is read), or for the meta device its shapes, with a
    one-line error for a wrong file."""
    from sd_scripts_compat.models.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(path, header_only=header_only, dtype_of=lambda key: dtype)
    kind = _kind_of(checkpoint.shapes)
    if kind != option:
        found = _WHAT.get(kind or "", "no FLUX part we know")
        raise UserError(f"{checkpoint.path} holds {found}, not what {option} needs; give {_EXPECTED[option]} "
                        f"as {option}")
    return dict(checkpoint.shapes) if header_only else checkpoint.state


def _fill(module: torch.nn.Module, state: Mapping[str, torch.Tensor], part: str, path: Path,
          dtype: torch.dtype | None) -> None:
    """Every parameter from the file, shapes checked (one line naming the file otherwise)."""
    from sd_scripts_compat.models.single_file import _strict_load

    _strict_load(module, state, part, path, dtype)


def clip_l_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """clip_l.safetensors -> our CLIPTextModel's names (transformers 5: no ``text_model.`` level); the unused
    projection and logit scale are dropped."""
    return {k.removeprefix("text_model."): v for k, v in tensors.items()
            if not k.startswith(("text_projection", "logit_scale"))}


def t5_state(tensors: Mapping[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """t5xxl.safetensors -> T5EncoderModel names; the tied embedding is stored once as either name. What an encoder
    has no use for (a decoder, an LM head) is dropped; an encoder weight it lacks (a layer more than the family's)
    stays, for the strict loader to name."""
    state = dict(tensors)
    for a, b in (("shared.weight", "encoder.embed_tokens.weight"), ("encoder.embed_tokens.weight", "shared.weight")):
        if a not in state and b in state:
            state[a] = state[b]
    own = module.state_dict()
    return {k: v for k, v in state.items() if k in own or k.startswith(T5_BLOCKS)}


def load_flux_model(pretrained: str | os.PathLike[str], *, clip_l: str | None = None, t5xxl: str | None = None,
                    ae: str | None = None, t5xxl_tokenizer: str | None = None, family: FamilySpec | None = None,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    vae_dtype: torch.dtype | None = None) -> ModelBundle:
    """The FLUX bundle from kohya's four options (see the module docstring); every failure one line. Weights are
    held in ``dtype`` (the AE in ``vae_dtype``; default fp32), cast tensor by tensor as the files are read."""
    from sd_scripts_compat.models.detect import ENGINE_STATED_BY, detect_family

    spec = detect_family(pretrained, family, stated_by=ENGINE_STATED_BY)
    if not spec.is_transformer:
        raise UserError(f"{pretrained} is a {spec.name} model, not FLUX.1; clip_l / t5xxl / ae belong to FLUX "
                        "(flux_train_network.py)")
    text = os.fspath(pretrained)
    folder = Path(text).expanduser()
    if str(device) == "meta" and not text.startswith("builtin:"):  # shapes only (traces): no file is read
        from sd_scripts_compat.models.build import build_modules

        bundle = build_modules(spec, device="meta", dtype=dtype, seed=None)
        bundle.source = text
    elif text.startswith("builtin:"):
        from sd_scripts_compat.models.build import build_modules

        bundle = build_modules(spec, device=device, dtype=dtype, seed=0, builtin=True, vae_dtype=vae_dtype)
    elif folder.is_dir():
        bundle = _from_folder(folder, spec, given={"clip_l": clip_l, "t5xxl": t5xxl, "ae": ae}, dtype=dtype,
                              vae_dtype=vae_dtype or dtype)
    else:
        bundle = _from_transformer_file(folder, spec, clip_l=clip_l, t5xxl=t5xxl, ae=ae, dtype=dtype)
    if str(device) != "meta":
        _replace_parts(bundle, {"clip_l": clip_l, "t5xxl": t5xxl, "ae": ae}, dtype, vae_dtype or dtype)
    _attach_tokenizers(bundle, t5xxl_tokenizer, t5xxl, folder if folder.is_dir() else None)
    for module in (bundle.unet, bundle.vae, *bundle.text_encoders):
        module.requires_grad_(False)
        module.eval()
        if str(device) != "meta":
            module.to(device)
    return bundle


def _from_transformer_file(path: Path, spec: FamilySpec, *, clip_l: str | None, t5xxl: str | None,
                           ae: str | None, dtype: torch.dtype | None) -> ModelBundle:
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.checkpoint import read_checkpoint
    from sd_scripts_compat.models.file_depth import at_file_depth
    from sd_scripts_compat.models.flux_layout import to_diffusers

    given = {"clip_l": clip_l, "t5xxl": t5xxl, "ae": ae}
    needed = [te.file_option for te in spec.text_encoders if te.file_option] + ["ae"]  # Chroma: no clip_l
    missing = [name for name in needed if not given.get(name)]
    if missing:
        raise UserError(f"{path} is a FLUX transformer file without text encoders or AE; also give "
                        f"{', '.join(missing)} (clip_l.safetensors, t5xxl_fp16.safetensors, ae.safetensors)")
    checkpoint = read_checkpoint(path, dtype_of=lambda key: dtype)
    spec = at_file_depth(spec, checkpoint.shapes)  # a pruned FLUX.1: its blocks, as sd-scripts reads them
    transformer, vae, text_encoders = empty_modules(spec)
    _fill(transformer, to_diffusers(checkpoint.state, transformer.config), "transformer", path, dtype)
    return ModelBundle(family=spec, unet=transformer, vae=vae, text_encoders=text_encoders, tokenizers=[],
                       scheduler_config=dict(spec.scheduler), prediction_type=spec.prediction_type, source=str(path),
                       extra={"format": "bfl_single_file", "t5xxl": t5xxl})


def _from_folder(folder: Path, spec: FamilySpec, *, given: Mapping[str, str | None], dtype: torch.dtype | None,
                 vae_dtype: torch.dtype | None) -> ModelBundle:
    """A diffusers FLUX pipeline folder (or a lone transformer folder plus the part files)."""
    import torch
    import transformers
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    from sd_scripts_compat.models.build import ModelBundle

    target = dtype or torch.float32
    pipeline = (folder / "transformer" / "config.json").is_file()
    parts = {"clip_l": "text_encoder", "t5xxl": "text_encoder_2", "ae": "vae"}
    absent = [option for option, sub in parts.items() if not given.get(option) and not (folder / sub).is_dir()]
    if absent:
        raise UserError(f"{folder} has no {', '.join(parts[o] + '/' for o in absent)}; give {', '.join(absent)} "
                        "as files or use a complete diffusers FLUX.1 folder")
    _, vae, text_encoders = empty_modules(spec)
    try:
        transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer" if pipeline else folder,
                                                             local_files_only=True, torch_dtype=target)
        if not given.get("ae"):
            vae = AutoencoderKL.from_pretrained(folder / "vae", local_files_only=True,
                                                torch_dtype=vae_dtype or torch.float32)
        for index, (option, te) in enumerate(zip(("clip_l", "t5xxl"), spec.text_encoders, strict=True)):
            if not given.get(option):
                cls = getattr(transformers, te.class_name)
                text_encoders[index] = cls.from_pretrained(folder / parts[option], local_files_only=True,
                                                           dtype=target)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{folder}: could not load the diffusers FLUX model ({reason[:200]}); expected a complete, "
                        "uncorrupted diffusers folder") from None
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    scheduler = dict(spec.scheduler)
    if scheduler_file.is_file():
        import json

        scheduler = json.loads(scheduler_file.read_text(encoding="utf-8"))
    return ModelBundle(family=spec, unet=transformer, vae=vae, text_encoders=text_encoders, tokenizers=[],
                       scheduler_config=scheduler, prediction_type=spec.prediction_type, source=str(folder),
                       extra={"format": "diffusers", "t5xxl": given.get("t5xxl")})


def _replace_parts(bundle: ModelBundle, given: Mapping[str, str | None], dtype: torch.dtype | None,
                   vae_dtype: torch.dtype | None) -> None:
    """Load each part file that was given into the bundle (replacing a folder's or a built-in's part)."""
    from sd_scripts_compat.models.build import empty_text_encoder
    from sd_scripts_compat.models.single_file import vae_from_state

    spec = bundle.family
    index = {te.file_option: i for i, te in enumerate(spec.text_encoders)}  # Chroma: T5 only, at index 0
    for option, path in given.items():
        if not path or (option != "ae" and option not in index):  # kohya ignores clip_l for Chroma
            continue
        part_dtype = vae_dtype if option == "ae" else dtype
        tensors = _read(path, option, header_only=False, dtype=part_dtype)
        if option == "ae":
            _check_latent_channels(tensors, spec, Path(path))
            bundle.vae = vae_from_state(tensors, spec, Path(path), vae_dtype)
        elif option == "clip_l":  # an empty CLIP-L alone: not the whole family's modules for it
            encoder = empty_text_encoder(spec.text_encoders[index[option]])
            _fill(encoder, clip_l_state(tensors), "clip_l", Path(path), dtype)
            bundle.text_encoders[index[option]] = encoder
        else:
            encoder = t5_encoder(bundle, index[option], tensors)
            _fill(encoder, t5_state(tensors, encoder), "t5xxl", Path(path), dtype)
            bundle.text_encoders[index[option]] = encoder


def t5_encoder(bundle: ModelBundle, index: int, tensors: Mapping[str, Any]) -> torch.nn.Module:
    """An empty T5 encoder with as many layers as the file holds (``models.file_depth``); the bundle's family is
    told when that is not the family's."""
    import dataclasses

    from sd_scripts_compat.models.build import empty_text_encoder
    from sd_scripts_compat.models.file_depth import t5_at_file_depth

    encoders = list(bundle.family.text_encoders)
    encoders[index] = t5_at_file_depth(encoders[index], tensors)
    if encoders[index] is not bundle.family.text_encoders[index]:
        bundle.family = dataclasses.replace(bundle.family, text_encoders=tuple(encoders))
    return empty_text_encoder(encoders[index])


def _check_latent_channels(tensors: Mapping[str, torch.Tensor], spec: FamilySpec, path: Path) -> None:
    """An SD VAE (4 latent channels) given as FLUX's 16-channel AE is named as such."""
    conv_out = tensors.get("encoder.conv_out.weight")
    wanted = 2 * int(spec.vae["latent_channels"])  # mean and log-variance
    if conv_out is not None and conv_out.shape[0] != wanted:
        raise UserError(f"{path} is a {conv_out.shape[0] // 2}-channel VAE, not FLUX.1's "
                        f"{wanted // 2}-channel AE; give ae.safetensors from the FLUX.1 release as ae")


def _attach_tokenizers(bundle: ModelBundle, option: str | None, t5xxl: str | None, folder: Path | None) -> None:
    from sd_scripts_compat.models.build import family_tokenizers
    from sd_scripts_compat.models.t5_tokenizer import find_t5_tokenizer

    found = find_t5_tokenizer(option, t5xxl, folder)
    bundle.tokenizers = family_tokenizers(bundle.family, None if found is None else str(found))
    bundle.extra["t5xxl"] = t5xxl
    bundle.extra["t5_tokenizer"] = None if found is None else str(found)


# ------------------------------------------------------------------------------------------- writing


def save_flux_files(bundle: ModelBundle, folder: str | os.PathLike[str],
                    dtype: torch.dtype | None = None) -> dict[str, Path]:
    """Write the bundle as sd-scripts' FLUX files (flux1.safetensors in BFL layout, clip_l, t5xxl, ae; Chroma
    without clip_l), atomically; returns option -> path. ``dtype`` casts floating tensors (e.g. bf16)."""
    from sd_scripts_compat.models.flux_layout import to_bfl
    from sd_scripts_compat.models.single_file import original_vae_state

    ae = original_vae_state(bundle.vae)
    parts = {"pretrained_model_name_or_path": ("flux1.safetensors", to_bfl(bundle.unet.state_dict(),
                                                                           bundle.unet.config)),
             "ae": ("ae.safetensors", ae)}
    for spec, encoder in zip(bundle.family.text_encoders, bundle.text_encoders):  # Chroma: T5 only
        state = encoder.state_dict()
        if spec.file_option == "clip_l":
            parts["clip_l"] = ("clip_l.safetensors", {f"text_model.{k}" if not k.startswith("text_model.") else k: v
                                                      for k, v in state.items() if not k.endswith("position_ids")})
        else:
            parts["t5xxl"] = ("t5xxl.safetensors", {k: v for k, v in state.items()
                                                    if k != "encoder.embed_tokens.weight"})
    out = {}
    for option, (name, tensors) in parts.items():
        out[option] = write_part_file(Path(folder) / name, tensors, dtype)
    return out


def write_part_file(path: Path, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> Path:
    from safetensors.torch import save_file

    from sd_scripts_compat.facts.atomic import atomic_path

    ready = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        ready[key] = tensor.contiguous().clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(ready, str(tmp), metadata={"format": "pt"})
    return path
