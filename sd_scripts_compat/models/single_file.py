"""Single-file checkpoints in the original (LDM/SGM) layout: read, detect the family, convert, write.

Reading converts with diffusers' own converters (``diffusers.loaders.single_file_utils``) fed with
our shipped family configs, so nothing is fetched. Writing is hand-written because the diffusers
package ships only the loading direction (original -> diffusers).

Original layout, per part:
  UNet      ``model.diffusion_model.`` + LDM names (see ``unet_names``)
  VAE       ``first_stage_model.`` + encoder.down.i.block.j..., mid.attn_1.{q,k,v,proj_out} as 1x1 convs
  SD1       ``cond_stage_model.transformer.text_model.`` + transformers CLIP names
  SD2       ``cond_stage_model.model.`` OpenCLIP (resblocks with fused in_proj; one more layer than we use)
  SDXL      ``conditioner.embedders.0.transformer.text_model.`` (CLIP-L) and
            ``conditioner.embedders.1.model.`` (OpenCLIP bigG incl. text_projection)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.atomic import atomic_path
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, model_config
from sd_scripts_compat.models.checkpoint import (
    SD1_TE_PREFIX,
    SD2_TE_PREFIX,
    SDXL_TE1_PREFIX,
    SDXL_TE2_PREFIX,
    UNET_PREFIX,
    VAE_PREFIX,
    Checkpoint,
    detect_layout,
    read_checkpoint,
)
from sd_scripts_compat.models.detect import (
    ENGINE_STATED_BY,
    V_PRED_KEY,
    all_families,
    checkpoint_candidates,
    choose_family,
    file_prediction,
)
from sd_scripts_compat.models.unet_names import diffusers_to_ldm_unet_name

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from sd_scripts_compat.models.build import ModelBundle

# The original text-encoder layouts (a family's ``single_file_layout`` names one of them).
LAYOUT_NAMES = {"sd1": "SD 1.x (CLIP-L text encoder)", "sd2": "SD 2.x (OpenCLIP-H text encoder)",
                "sdxl": "SDXL (CLIP-L + OpenCLIP-bigG text encoders)", "flux": "a FLUX.1 transformer (BFL layout)"}


# ----------------------------------------------------------------------------------------- writing


def _vae_name_to_original(name: str, config: Mapping[str, Any]) -> str:
    """diffusers AutoencoderKL name -> original VAE name (hand-written: diffusers only converts the other way)."""
    num_up = len(config["up_block_types"])
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
    name = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.",
                  lambda m: f"decoder.up.{num_up - 1 - int(m.group(1))}.block.", name)
    name = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
                  lambda m: f"decoder.up.{num_up - 1 - int(m.group(1))}.upsample.", name)
    name = re.sub(r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", name)
    name = name.replace(".mid_block.attentions.0.", ".mid.attn_1.")
    name = name.replace(".conv_shortcut.", ".nin_shortcut.").replace(".conv_norm_out.", ".norm_out.")
    for new, old in (("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
        name = name.replace(f".mid.attn_1.{new}.", f".mid.attn_1.{old}.")
    return name


def original_vae_state(vae: AutoencoderKL) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL's tensors under the original VAE names, without ``first_stage_model.`` (the
    layout of FLUX.1's ae.safetensors and of the VAE inside SD / SD3 single files)."""
    config = dict(vae.config)
    out = {}
    for name, tensor in vae.state_dict().items():
        original = _vae_name_to_original(name, config)
        if ".mid.attn_1." in original and original.endswith(".weight") and tensor.ndim == 2:
            tensor = tensor[:, :, None, None]  # the original VAE attention uses 1x1 convs
        out[original] = tensor
    return out


def _clip_state(prefix: str, text_encoder: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers CLIP text model -> ``<prefix>embeddings...`` (the original SD1 / SDXL-TE1 layout)."""
    out = {}
    for name, tensor in text_encoder.state_dict().items():
        if name.startswith("text_projection"):
            continue  # CLIP-L in SD1/SDXL is used without its projection
        out[prefix + name.removeprefix("text_model.")] = tensor
    return out


def _open_clip_state(prefix: str, text_encoder: CLIPTextModel | CLIPTextModelWithProjection,
                     extra_layer: bool) -> tuple[dict[str, torch.Tensor], set[str]]:
    """transformers CLIP -> OpenCLIP layout with fused q/k/v ``in_proj``.

    ``extra_layer``: SD2 checkpoints hold 24 resblocks while diffusers' SD2 text encoder keeps the 23 it
    uses (SD2 conditions on the penultimate layer); we write the unused last block as a copy of the
    final one so other tools find the layout they expect. Returns the tensors and the names of such
    placeholders (not needed to rebuild the model).
    """
    import torch

    state = {name.removeprefix("text_model."): t for name, t in text_encoder.state_dict().items()}
    layers = text_encoder.config.num_hidden_layers
    out: dict[str, torch.Tensor] = {
        prefix + "token_embedding.weight": state["embeddings.token_embedding.weight"],
        prefix + "positional_embedding": state["embeddings.position_embedding.weight"],
        prefix + "ln_final.weight": state["final_layer_norm.weight"],
        prefix + "ln_final.bias": state["final_layer_norm.bias"],
    }
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
               "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
    for i in range(layers):
        src, dst = f"encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch.cat(
                [state[f"{src}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")], dim=0)
            for ours, theirs in renames.items():
                out[f"{dst}{theirs}.{kind}"] = state[f"{src}{ours}.{kind}"]
    placeholders: set[str] = set()
    if "text_projection.weight" in state:
        out[prefix + "text_projection"] = state["text_projection.weight"].T
    if extra_layer:
        last, extra = f"{prefix}transformer.resblocks.{layers - 1}.", f"{prefix}transformer.resblocks.{layers}."
        for name in [n for n in out if n.startswith(last)]:
            placeholders.add(extra + name[len(last):])
            out[extra + name[len(last):]] = out[name]
        hidden = text_encoder.config.hidden_size
        out[prefix + "text_projection"] = torch.eye(hidden, dtype=out[prefix + "ln_final.weight"].dtype,
                                                    device=out[prefix + "ln_final.weight"].device)
        placeholders.add(prefix + "text_projection")
    out[prefix + "logit_scale"] = torch.ones((), dtype=out[prefix + "ln_final.weight"].dtype,
                                             device=out[prefix + "ln_final.weight"].device) * 4.6052
    placeholders.add(prefix + "logit_scale")
    return out, placeholders


def original_state_dict(bundle: ModelBundle, include_placeholders: bool = True) -> dict[str, torch.Tensor]:
    """The bundle's tensors under their original single-file names (views of the module weights).

    ``include_placeholders=False`` leaves out tensors that exist only for other tools' sake (SD2's
    unused 24th text block, OpenCLIP's logit_scale): that is the set a loader needs.
    """
    layout = bundle.family.single_file_layout
    unet_config = dict(bundle.unet.config)
    out = {UNET_PREFIX + diffusers_to_ldm_unet_name(name, unet_config): t
           for name, t in bundle.unet.state_dict().items()}
    out.update({VAE_PREFIX + name: tensor for name, tensor in original_vae_state(bundle.vae).items()})
    placeholders: set[str] = set()
    if layout == "sd1":
        out.update(_clip_state(SD1_TE_PREFIX, bundle.text_encoders[0]))
    elif layout == "sd2":
        te, placeholders = _open_clip_state(SD2_TE_PREFIX, bundle.text_encoders[0], extra_layer=True)
        out.update(te)
    else:
        out.update(_clip_state(SDXL_TE1_PREFIX, bundle.text_encoders[0]))
        te, placeholders = _open_clip_state(SDXL_TE2_PREFIX, bundle.text_encoders[1], extra_layer=False)
        out.update(te)
    if not include_placeholders:
        out = {k: v for k, v in out.items() if k not in placeholders}
    return out


def save_single_file(bundle: ModelBundle, path: str | os.PathLike[str], dtype: torch.dtype | None = None,
                     metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``bundle`` as one original-layout ``.safetensors`` checkpoint, atomically.

    ``dtype`` casts floating tensors (e.g. ``torch.float16`` for a half-size file). v-prediction
    families also get the ``v_pred`` marker key and ``modelspec.prediction_type = "v"``.
    """
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {}
    seen: set[int] = set()  # safetensors refuses tensors sharing storage (SD2's copied placeholder block)
    for name, tensor in original_state_dict(bundle).items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    if bundle.prediction_type == "v_prediction":
        tensors[V_PRED_KEY] = torch.zeros(0)
    meta = {"format": "pt", "modelspec.sai_model_spec": "1.0.1",
            "modelspec.architecture": bundle.family.modelspec_architecture,
            "modelspec.prediction_type": "v" if bundle.prediction_type == "v_prediction" else "epsilon",
            "modelspec.resolution": f"{bundle.family.resolution}x{bundle.family.resolution}"}
    meta.update(metadata or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


# ----------------------------------------------------------------------------------------- reading


def expected_shapes(family: FamilySpec) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors a loader needs from ``family``'s single file (built on the meta device).

    Memoised by the family's configs: sd2 and sd2-v share one build, and a second load skips it.
    """
    return dict(_expected_shapes_cached(_FamilyKey(family)))


@dataclass(frozen=True, eq=False)
class _FamilyKey:
    """Hashable stand-in for a FamilySpec (whose config dicts are not hashable), keyed by the configs."""

    family: FamilySpec

    @property
    def signature(self) -> str:
        f = self.family
        return json.dumps([f.ss_base_model_version, f.unet, f.vae, [te.config for te in f.text_encoders]],
                          sort_keys=True)

    def __hash__(self) -> int:
        return hash(self.signature)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FamilyKey) and other.signature == self.signature


@lru_cache(maxsize=16)
def _expected_shapes_cached(key: _FamilyKey) -> dict[str, tuple[int, ...]]:
    import torch

    with torch.device("meta"):
        bundle = _empty_bundle(key.family)
    return {k: tuple(v.shape) for k, v in original_state_dict(bundle, include_placeholders=False).items()}


def _mismatch(shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> str | None:
    for key, shape in expected.items():
        if key not in shapes:
            return f"{key} missing"
        if tuple(shapes[key]) != shape:
            return f"{key} is {list(shapes[key])}, expected {list(shape)}"
    return None


def detect_family(checkpoint: Checkpoint, stated: FamilySpec | None = None,
                  candidates: Iterable[FamilySpec] | None = None) -> FamilySpec:
    """The family of a single file: the cheap candidates of ``models.detect`` (layout, first conv), then
    every tensor shape, then ``detect.choose_family`` (stated family, v-prediction markers).

    A stated family outside the family data is the only candidate (custom variants, tests). A stated
    family that the file contradicts is a UserError naming both. A file of a family sd-scripts trains for us
    (Lumina 2, HunyuanImage-2.1, Anima: told by its header) is a UserError naming sd-scripts' script; an SD3 file
    never comes here (``models.sd3_files``).
    """
    from sd_scripts_compat.models.detect import header_marker_candidates

    own = header_marker_candidates(checkpoint.shapes, all_families())
    if own:
        raise UserError(f"{checkpoint.path}: a {own[0].description} file; this engine does not train it, "
                        f"sd-scripts' {own[0].kohya_script} does (autotune run --engine sd-scripts=PATH)")
    layout = detect_layout(checkpoint)
    pool = list(candidates) if candidates is not None else all_families()
    if stated is not None and stated not in pool:
        pool = [stated]
    matched, reasons = [], []
    for family in checkpoint_candidates(checkpoint.shapes, layout, pool):
        reason = _mismatch(checkpoint.shapes, expected_shapes(family))
        if reason is None:
            matched.append(family)
        else:
            reasons.append(f"{family.name}: {reason}")
    stated_name = stated.name if stated is not None else None
    if not matched:
        detail = "; ".join(reasons[:2]) or "no family of that layout"
        wanted = f" (requested family {stated_name})" if stated_name else ""
        raise UserError(f"{checkpoint.path} looks like {LAYOUT_NAMES[layout]} but its tensor shapes match no known "
                        f"family{wanted}: {detail}")
    return choose_family(matched, file_prediction(checkpoint.shapes, checkpoint.metadata), stated_name,
                         subject=str(checkpoint.path), noun="checkpoint", stated_by=ENGINE_STATED_BY)


def convert_checkpoint(tensors: Mapping[str, torch.Tensor], family: FamilySpec) -> dict[str, dict[str, Any]]:
    """Original-layout tensors -> diffusers state dicts per part ("unet", "vae", "text_encoder", "text_encoder_2").

    Uses diffusers' converters with our family configs (nothing is fetched).
    """
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )

    layout = family.single_file_layout
    parts: dict[str, dict[str, Any]] = {
        "unet": convert_ldm_unet_checkpoint(dict(tensors), model_config(family.unet)),
        "vae": convert_ldm_vae_checkpoint(dict(tensors), model_config(family.vae)),
    }
    text_parts = []
    if layout == "sd1":
        text_parts.append(convert_ldm_clip_checkpoint(_only(tensors, SD1_TE_PREFIX[:-len("text_model.")])))
    elif layout == "sd2":
        text_parts.append(_convert_open_clip(tensors, SD2_TE_PREFIX, family.text_encoders[0].config,
                                             convert_open_clip_checkpoint))
    else:
        text_parts.append(convert_ldm_clip_checkpoint(_only(tensors, SDXL_TE1_PREFIX[:-len("text_model.")])))
        text_parts.append(_convert_open_clip(tensors, SDXL_TE2_PREFIX, family.text_encoders[1].config,
                                             convert_open_clip_checkpoint))
    for index, (state, spec) in enumerate(zip(text_parts, family.text_encoders, strict=True)):
        if spec.class_name == "CLIPTextModel":  # flattened in transformers >= 5.6: no "text_model." level
            state = {k.removeprefix("text_model."): v for k, v in state.items() if k != "text_projection.weight"}
        parts["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = state
    return parts


def _only(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith(prefix)}


def _convert_open_clip(tensors: Mapping[str, torch.Tensor], prefix: str, config: Mapping[str, Any],
                       convert: Callable[..., dict[str, torch.Tensor]]) -> dict[str, Any]:
    """OpenCLIP -> transformers names, first dropping blocks beyond the ones our text encoder keeps.

    diffusers skips SD2's unused 24th block by a hard-coded key list (``resblocks.23``); dropping by our
    config's layer count does the same for any size, tiny variants included.
    """
    from types import SimpleNamespace

    layers = int(config["num_hidden_layers"])
    pattern = re.compile(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.")
    kept = {}
    for key, value in tensors.items():
        if not key.startswith(prefix):
            continue
        match = pattern.match(key)
        if match and int(match.group(1)) >= layers:
            continue
        if key == prefix + "text_projection" and config["_class_name"] == "CLIPTextModel":
            continue
        kept[key] = value
    # the converter only reads config.hidden_size (to split in_proj) when there is no text_projection
    fake_model = SimpleNamespace(config=SimpleNamespace(hidden_size=int(config["hidden_size"])))
    return convert(fake_model, kept, prefix=prefix)


def _strict_load(module: torch.nn.Module, state: Mapping[str, torch.Tensor], part: str, path: Path,
                 dtype: torch.dtype | None) -> None:
    """Load converted weights into an empty (meta) module; every parameter must come from the file."""
    import torch

    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected and not k.endswith("position_ids")]
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise UserError(f"{path}: the {part} weights do not fit the detected family ({what}, "
                        f"{len(missing)} missing, {len(unexpected)} unexpected)")
    target = dtype or torch.float32
    converted = {}
    for key in expected:
        value = state[key]
        if tuple(value.shape) != tuple(expected[key].shape):
            raise UserError(f"{path}: {part} tensor {key} has shape {list(value.shape)}, expected "
                            f"{list(expected[key].shape)}")
        converted[key] = value.to(target) if value.is_floating_point() else value
    module.load_state_dict(converted, strict=True, assign=True)


def load_single_file(path: str | os.PathLike[str], *, family: FamilySpec | None = None,
                     allow_pickle: bool = False, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, vae_dtype: torch.dtype | None = None) -> ModelBundle:
    """Load an original-layout checkpoint into a ModelBundle of diffusers/transformers modules, each tensor cast
    to its module's dtype as it is read (``dtype``, the VAE ``vae_dtype``; default fp32).

    ``device="meta"`` reads only the header (family detection) and builds shapes, for memory probes.
    """
    from sd_scripts_compat.models.build import ModelBundle, build_modules, load_tokenizer

    header_only = str(device) == "meta" and Path(path).suffix.lower() == ".safetensors"
    vae_dtype = vae_dtype or dtype
    checkpoint = read_checkpoint(path, allow_pickle=allow_pickle, header_only=header_only,
                                 dtype_of=lambda key: vae_dtype if key.startswith(VAE_PREFIX) else dtype)
    spec = detect_family(checkpoint, stated=family)
    if str(device) == "meta":
        bundle = build_modules(spec, device="meta", dtype=dtype, seed=None)
    else:
        assert checkpoint.tensors is not None
        parts = convert_checkpoint(checkpoint.tensors, spec)
        bundle = _empty_bundle(spec)
        modules = {"unet": bundle.unet, "vae": bundle.vae}
        for index, te in enumerate(bundle.text_encoders):
            modules["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = te
        for part, module in modules.items():
            _strict_load(module, parts[part], part, checkpoint.path, vae_dtype if part == "vae" else dtype)
            module.to(device)
        bundle.tokenizers = [load_tokenizer(pad_token=te.tokenizer["pad_token"],
                                            max_length=te.tokenizer["model_max_length"])
                             for te in spec.text_encoders]
    return ModelBundle(family=spec, unet=bundle.unet, vae=bundle.vae, text_encoders=bundle.text_encoders,
                       tokenizers=bundle.tokenizers, scheduler_config=dict(spec.scheduler),
                       prediction_type=spec.prediction_type, source=str(path),
                       extra={"format": "single_file", "metadata": checkpoint.metadata})


def vae_from_state(state: Mapping[str, torch.Tensor], family: FamilySpec, path: Path,
                   dtype: torch.dtype | None) -> AutoencoderKL:
    """The family's AutoencoderKL from a VAE's tensors in original or diffusers names (``first_stage_model.``
    removed), every shape checked; a VAE of another latent width is one line naming the file."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    from sd_scripts_compat.models.build import empty_modules

    conv_out = state.get("encoder.conv_out.weight", state.get("encoder.conv_out.bias"))
    wanted = 2 * int(family.vae["latent_channels"])  # mean and log-variance
    if conv_out is not None and conv_out.shape[0] != wanted:
        raise UserError(f"{path} is a {conv_out.shape[0] // 2}-channel VAE; {family.description} needs a "
                        f"{wanted // 2}-channel one")
    diffusers_names = any(k.startswith("decoder.up_blocks.") for k in state)
    converted = state if diffusers_names else convert_ldm_vae_checkpoint(dict(state), model_config(family.vae))
    vae = empty_modules(family)[1]
    _strict_load(vae, converted, "vae", path, dtype)
    return vae


def load_vae_file(path: str | os.PathLike[str], family: FamilySpec, dtype: torch.dtype | None) -> AutoencoderKL:
    """sd-scripts' ``vae`` option: a VAE file (alone, or inside a checkpoint under ``first_stage_model.``)."""
    path = Path(path).expanduser()
    tensors = read_checkpoint(path, dtype_of=lambda key: dtype).state
    if any(k.startswith(VAE_PREFIX) for k in tensors):
        tensors = {k[len(VAE_PREFIX):]: v for k, v in tensors.items() if k.startswith(VAE_PREFIX)}
    if not any(k.startswith("decoder.") for k in tensors):
        raise UserError(f"{path} holds no VAE (no decoder.* tensors); give a VAE file as vae")
    return vae_from_state(tensors, family, path, dtype)


def _empty_bundle(family: FamilySpec) -> ModelBundle:
    """Modules with parameters on the meta device and real buffers, to be filled by ``assign=True``.

    Saves building random weights that would be overwritten at once (seconds and gigabytes for SDXL).
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from sd_scripts_compat.models.build import ModelBundle, build_text_encoder

    with init_empty_weights(include_buffers=False):
        unet = UNet2DConditionModel(**model_config(family.unet))
        vae = AutoencoderKL(**model_config(family.vae))
        text_encoders = [build_text_encoder(te.config) for te in family.text_encoders]
    for module in (unet, vae, *text_encoders):
        module.requires_grad_(False)
        module.eval()
    return ModelBundle(family=family, unet=unet, vae=vae, text_encoders=text_encoders, tokenizers=[],
                       scheduler_config=dict(family.scheduler), prediction_type=family.prediction_type)
