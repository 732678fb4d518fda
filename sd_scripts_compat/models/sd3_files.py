"""SD3 / SD3.5 as sd-scripts' ``sd3_train_network.py`` takes them, loaded offline into one ModelBundle.

  pretrained_model_name_or_path  the official single file: the MMDiT under ``model.diffusion_model.``, the VAE
                                 under ``first_stage_model.`` and, in the files that include them, the text
                                 encoders under ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.``
                                 (sd3.5_medium.safetensors, sd3.5_large.safetensors), or builtin:ID
  clip_l / clip_g / t5xxl        text-encoder files (the release's text_encoders/ folder; t5xxl fp16 or fp8)
  vae                            a VAE file (original or diffusers names) in place of the one inside
  t5xxl_tokenizer                the T5 tokenizer folder or file (see ``models.t5_tokenizer``)

A part given as a file wins over the same part inside the model file; a part found in neither is a one-line
error naming the option. CLIP-L without ``text_projection`` gets the identity, as sd-scripts' ``load_clip_l``
does. The MMDiT converts through diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers`` (it reads the
geometry from the file, so tiny twins convert too), the VAE through ``convert_ldm_vae_checkpoint``.
``to_sd3`` writes the other way (hand-written: diffusers converts one way only; the tests check it against
diffusers' converter by a round trip), for ``save_sd3_files``: real files for tests and demos.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.models.build import ModelBundle

MMDIT_PREFIX = "model.diffusion_model."
VAE_FILE_PREFIX = "first_stage_model."
TEXT_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
                 "t5xxl": "text_encoders.t5xxl.transformer."}
PART_OPTIONS = ("clip_l", "clip_g", "t5xxl", "vae")
# a key each part's own file holds (a file given for the wrong option is named as what it is)
_MARKERS = {"t5xxl": "encoder.block.0.layer.0.", "vae": "decoder.conv_out.weight",
            "mmdit": "joint_blocks.0.", "clip": "text_model.embeddings.token_embedding.weight"}
_EXPECTED = {"clip_l": "clip_l.safetensors", "clip_g": "clip_g.safetensors",
             "t5xxl": "t5xxl_fp16.safetensors or t5xxl_fp8_e4m3fn.safetensors", "vae": "an SD3 VAE file"}
# diffusers' name outside the joint blocks -> the SD3 name (the joint blocks follow the family's lora_layout)
_OUTER = {"pos_embed.pos_embed": "pos_embed", "pos_embed.proj": "x_embedder.proj",
          "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
          "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
          "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
          "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
          "context_embedder": "context_embedder", "proj_out": "final_layer.linear",
          "norm_out.linear": "final_layer.adaLN_modulation.1"}
_BLOCK_NORMS = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
                "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
                "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
_SWAPPED = ("final_layer.adaLN_modulation.1", "context_block.adaLN_modulation.1")  # (shift, scale) in SD3 files


def swapped_halves(family: FamilySpec) -> frozenset[str]:
    """The SD3 file's Linears (MMDiT names) whose two output halves diffusers keeps the other way round: the
    final layer's and the last (pre-only) block's context modulation are ``AdaLayerNormContinuous`` in diffusers,
    (scale, shift), and (shift, scale) in the file, sd-scripts' MMDiT and ComfyUI. Empty for other families.
    Model files (``to_sd3``) and LoRA files (``network.lora``: a ``lora_up``'s rows) are written in the file's
    order and read back into ours by this one fact."""
    if family.single_file_layout != "sd3":
        return frozenset()
    last = int(family.unet["num_layers"]) - 1
    return frozenset({_SWAPPED[0], f"joint_blocks.{last}.{_SWAPPED[1]}"})


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(a, b) -> (b, a) along the output rows: diffusers' order <-> the SD3 file's (its own inverse)."""
    import torch

    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def load_sd3_model(pretrained: str | os.PathLike[str], *, parts: Mapping[str, str | None],
                   t5xxl_tokenizer: str | None = None, family: FamilySpec | None = None,
                   device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   vae_dtype: torch.dtype | None = None) -> ModelBundle:
    """The SD3 bundle from sd-scripts' options (see the module docstring); ``parts`` maps ``clip_l`` / ``clip_g``
    / ``t5xxl`` / ``vae`` to files or None. Weights are held in ``dtype`` (the VAE in ``vae_dtype``), cast tensor
    by tensor as they are read."""
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.detect import ENGINE_STATED_BY, detect_family

    text = os.fspath(pretrained)
    spec = detect_family(text, family, stated_by=ENGINE_STATED_BY)
    if spec.single_file_layout != "sd3":
        raise UserError(f"{text} is a {spec.name} model, not SD3; clip_g belongs to SD3 / SD3.5 "
                        "(sd3_train_network.py)")
    meta = str(device) == "meta"
    if meta or text.startswith("builtin:"):
        bundle = build_modules(spec, device=device, dtype=dtype, seed=None if meta else 0,
                               builtin=text.startswith("builtin:"), vae_dtype=vae_dtype)
        if not meta:
            _replace_parts(bundle, parts, dtype, vae_dtype or dtype)
    elif Path(text).expanduser().is_dir():
        raise UserError(f"{text} is a folder; sd-scripts' sd3_train_network.py reads SD3 as one file "
                        "(sd3.5_medium.safetensors or sd3.5_large.safetensors) with clip_l / clip_g / t5xxl")
    else:
        bundle = _from_single_file(Path(text).expanduser(), spec, parts, dtype, vae_dtype or dtype)
    found = _tokenizer(t5xxl_tokenizer, parts.get("t5xxl") or (None if text.startswith("builtin:") else text))
    from sd_scripts_compat.models.build import family_tokenizers

    bundle.tokenizers = family_tokenizers(spec, None if found is None else str(found))
    bundle.extra.update({"t5xxl": parts.get("t5xxl"), "t5_tokenizer": None if found is None else str(found)})
    for module in (bundle.unet, bundle.vae, *bundle.text_encoders):
        module.requires_grad_(False)
        module.eval()
        if not meta:
            module.to(device)
    return bundle


def _tokenizer(option: str | None, beside: str | None) -> Path | None:
    from sd_scripts_compat.models.t5_tokenizer import find_t5_tokenizer

    return find_t5_tokenizer(option, beside)


def _from_single_file(path: Path, spec: FamilySpec, parts: Mapping[str, str | None], dtype: torch.dtype | None,
                      vae_dtype: torch.dtype | None) -> ModelBundle:
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    from sd_scripts_compat.models.build import ModelBundle, empty_modules
    from sd_scripts_compat.models.checkpoint import read_checkpoint
    from sd_scripts_compat.models.file_depth import at_file_depth
    from sd_scripts_compat.models.single_file import _strict_load

    inside = {option: prefix for option, prefix in TEXT_PREFIXES.items() if not parts.get(option)}
    inside["vae"] = "" if parts.get("vae") else VAE_FILE_PREFIX
    header = read_checkpoint(path, header_only=True).shapes
    missing = [option for option, prefix in inside.items() if prefix and not any(k.startswith(prefix) for k in header)]
    if missing:
        raise UserError(f"{path} holds no {', '.join(missing)}; also give "
                        + ", ".join(f"{option} ({_EXPECTED[option]})" for option in missing))

    wanted = (MMDIT_PREFIX, *(prefix for prefix in inside.values() if prefix))  # a part given as a file: not read
    tensors = read_checkpoint(path, keep=lambda key: key.startswith(wanted),
                              dtype_of=lambda key: vae_dtype if key.startswith(VAE_FILE_PREFIX) else dtype).state
    spec = at_file_depth(spec, header)  # an MMDiT of fewer blocks: its depth and width, as sd-scripts reads them
    transformer, vae, text_encoders = empty_modules(spec)
    mmdit = {k: v for k, v in tensors.items() if k.startswith(MMDIT_PREFIX)}
    _strict_load(transformer, convert_sd3_transformer_checkpoint_to_diffusers(mmdit), "MMDiT", path, dtype)
    bundle = ModelBundle(family=spec, unet=transformer, vae=vae, text_encoders=text_encoders, tokenizers=[],
                         scheduler_config=dict(spec.scheduler), prediction_type=spec.prediction_type,
                         source=str(path), extra={"format": "sd3_single_file"})
    for option, prefix in inside.items():
        if prefix:
            _load_part(bundle, option, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                       path, vae_dtype if option == "vae" else dtype)
    _replace_parts(bundle, parts, dtype, vae_dtype)
    return bundle


def _load_part(bundle: ModelBundle, option: str, state: Mapping[str, torch.Tensor], path: Path,
               dtype: torch.dtype | None) -> None:
    """One part's tensors (prefix removed) into the bundle's module, names converted, every shape checked."""
    from sd_scripts_compat.models.build import empty_text_encoder
    from sd_scripts_compat.models.flux_files import t5_encoder, t5_state
    from sd_scripts_compat.models.single_file import _strict_load, vae_from_state

    spec = bundle.family
    if option == "vae":
        bundle.vae = vae_from_state(state, spec, path, dtype)
        return
    index = next(i for i, te in enumerate(spec.text_encoders) if te.file_option == option)
    if option == "t5xxl":
        encoder = t5_encoder(bundle, index, state)
        converted = t5_state(state, encoder)
    else:
        encoder = empty_text_encoder(spec.text_encoders[index])
        converted = {k: v for k, v in state.items() if not k.endswith("position_ids") and k != "logit_scale"}
        if option == "clip_l" and "text_projection.weight" not in converted:  # as sd-scripts' load_clip_l
            import torch

            width = int(spec.text_encoders[index].config["hidden_size"])
            converted["text_projection.weight"] = torch.eye(width, dtype=dtype or torch.float32)
    _strict_load(encoder, converted, option, path, dtype)
    bundle.text_encoders[index] = encoder


def _replace_parts(bundle: ModelBundle, parts: Mapping[str, str | None], dtype: torch.dtype | None,
                   vae_dtype: torch.dtype | None) -> None:
    """Each part given as its own file, read and loaded in place of the bundle's (a wrong file: one line)."""
    from sd_scripts_compat.models.checkpoint import read_checkpoint

    for option in PART_OPTIONS:
        given = parts.get(option)
        if not given:
            continue
        path = Path(os.fspath(given)).expanduser()
        part_dtype = vae_dtype if option == "vae" else dtype

        def held_as(key: str, d: torch.dtype | None = part_dtype) -> torch.dtype | None:
            return d

        checkpoint = read_checkpoint(path, dtype_of=held_as)
        widths = {te.file_option or "": int(te.config.get("hidden_size", 0)) for te in bundle.family.text_encoders}
        tensors = _own_names(checkpoint.state, option, path, widths)
        _load_part(bundle, option, tensors, path, part_dtype)


def _own_names(tensors: Mapping[str, torch.Tensor], option: str, path: Path,
               widths: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A part file's tensors under the part's own names (a whole SD3 file given as a part gives its copy), or a
    one-line error saying what the file holds instead."""
    keys = list(tensors)
    prefix = VAE_FILE_PREFIX if option == "vae" else TEXT_PREFIXES[option]
    if any(k.startswith(prefix) for k in keys):
        return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    marker = _MARKERS["clip" if option.startswith("clip") else option]
    if any(marker in k for k in keys):
        width = tensors.get("text_model.embeddings.token_embedding.weight")
        other = {"clip_l": "clip_g", "clip_g": "clip_l"}.get(option)
        if width is not None and other and width.shape[1] == widths[other] != widths[option]:
            raise UserError(f"{path} is {other} (width {width.shape[1]}), not {option}; give {_EXPECTED[option]} "
                            f"as {option}")
        return dict(tensors)
    found = next((name for name, mark in _MARKERS.items() if any(mark in k for k in keys)), None)
    what = {"mmdit": "an SD3 MMDiT", "clip": "a CLIP text encoder", "t5xxl": "a T5 encoder",
            "vae": "a VAE"}.get(found or "", "no SD3 part we know")
    raise UserError(f"{path} holds {what}, not what {option} needs; give {_EXPECTED[option]} as {option}")


# ------------------------------------------------------------------------------------------- writing


def to_sd3(state: Mapping[str, torch.Tensor], family: FamilySpec) -> dict[str, torch.Tensor]:
    """diffusers SD3Transformer2DModel names -> the SD3 file's MMDiT names (without ``model.diffusion_model.``);
    the fused ``qkv`` as the family's ``lora_layout`` stacks them."""
    import torch

    blocks = int(family.unet["num_layers"])
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _OUTER.items():
        for suffix in ("", ".weight", ".bias"):
            if ours + suffix in state and (suffix or ours == "pos_embed.pos_embed"):
                out[theirs + suffix] = state[ours + suffix]
    linears = family.lora_layout[0]["linears"]
    for i in range(blocks):
        here = f"transformer_blocks.{i}."
        for sd3_name, names in linears.items():
            for kind in ("weight", "bias"):
                pieces = [state.get(f"{here}{name}.{kind}") for name in names]
                found = [piece for piece in pieces if piece is not None]
                if len(found) == len(pieces):
                    out[f"joint_blocks.{i}.{sd3_name}.{kind}"] = torch.cat(found, dim=0)
        for ours, theirs in _BLOCK_NORMS.items():
            if f"{here}{ours}.weight" in state:
                out[f"joint_blocks.{i}.{theirs}.weight"] = state[f"{here}{ours}.weight"]
    swapped = swapped_halves(family)
    for key in [k for k in out if k.rpartition(".")[0] in swapped]:
        out[key] = swap_halves(out[key])  # diffusers keeps (scale, shift); the file (shift, scale)
    return out


def save_sd3_files(bundle: ModelBundle, folder: str | os.PathLike[str], *, text_encoders_inside: bool = True,
                   dtype: torch.dtype | None = None) -> dict[str, Path]:
    """Write ``bundle`` as the SD3.5 release ships it: one file with the MMDiT and VAE (and, with
    ``text_encoders_inside``, the three text encoders), else also clip_l / clip_g / t5xxl files beside it;
    atomically. Returns option -> path (``pretrained_model_name_or_path`` for the model file)."""
    from sd_scripts_compat.models.flux_files import write_part_file
    from sd_scripts_compat.models.single_file import original_vae_state

    folder = Path(folder)
    model = {MMDIT_PREFIX + k: v for k, v in to_sd3(bundle.unet.state_dict(), bundle.family).items()}
    model.update({VAE_FILE_PREFIX + k: v for k, v in original_vae_state(bundle.vae).items()})
    files: dict[str, dict[str, Any]] = {}
    for spec, encoder in zip(bundle.family.text_encoders, bundle.text_encoders, strict=True):
        state = {k: v for k, v in encoder.state_dict().items()
                 if not k.endswith("position_ids") and k != "encoder.embed_tokens.weight"}
        option = spec.file_option or ""  # every SD3 encoder has its file option (clip_l, clip_g, t5xxl)
        if text_encoders_inside:
            model.update({TEXT_PREFIXES[option] + k: v for k, v in state.items()})
        else:
            files[option] = state
    name = f"{bundle.family.name}.safetensors"
    out = {"pretrained_model_name_or_path": write_part_file(folder / name, model, dtype)}
    for option, state in files.items():
        out[option] = write_part_file(folder / f"{option}.safetensors", state, dtype)
    return out
