"""One family detector: which family (``data/families/*.json``) a model is, cheaply and from data only.

``detect_family(model, stated)`` answers for ``builtin:ID``, a diffusers folder and a single-file
``.safetensors`` checkpoint by reading headers and config files only (no weights, no torch), so the
planner, ``autotune run`` and ``autotune train`` can ask it before anything heavy. The engine's
loaders keep their stricter checks (every tensor shape) but narrow and choose with the same pieces:

- ``checkpoint_candidates``: families whose single-file layout (the ``single_file_layout`` fact) and
  first UNet conv match a checkpoint's keys and shapes;
- ``unet_config_candidates``: families whose UNet config agrees on the keys that tell families apart;
- ``file_prediction``: the v-prediction markers a single file can carry;
- ``choose_family``: the one rule that picks among the candidates: the stated family when it is one
  of them and the file does not contradict it, else the one with the model's prediction type (epsilon
  when the model does not say), full-size families before their tiny twins; a stated family that the
  model contradicts is a one-line UserError naming both.

Nothing here branches on a family name: the facts are in the family files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, family_names, get_family
from sd_scripts_compat.models.checkpoint import PICKLE_SUFFIXES

BUILTIN_PREFIX = "builtin:"
V_PRED_KEY = "v_pred"  # an empty tensor some tools (sd-scripts, ComfyUI) use to mark v-prediction SD2 files
V_PREDICTION_NAMES = ("v", "v_prediction", "v-prediction")  # modelspec.prediction_type values meaning v
# UNet config keys that tell the families apart (a real diffusers config has both; others may differ in form)
UNET_DISTINGUISHING_KEYS = ("cross_attention_dim", "block_out_channels")
# the same for a transformer denoiser (FLUX): widths, depths, and dev's guidance embedder (Wan's ffn_dim; Z-Image
# names its widths and depth its own way)
TRANSFORMER_DISTINGUISHING_KEYS = ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads",
                                   "joint_attention_dim", "guidance_embeds", "ffn_dim", "n_layers", "dim", "n_heads",
                                   "cap_feat_dim")
DENOISER_FOLDERS = ("unet", "transformer")  # where a diffusers pipeline keeps its denoiser's config
ENGINE_STATED_BY = "the family option"  # how the engine's loaders name a stated family in their errors


def all_families() -> list[FamilySpec]:
    return [get_family(name) for name in family_names()]


def known_family(name: str, stated_by: str = "--family") -> FamilySpec:
    """The family called ``name``, or a one-line UserError listing the known ones."""
    if name not in family_names():
        raise UserError(f"unknown model family {name!r} ({stated_by}); known: {', '.join(family_names())}")
    return get_family(name)


def detect_family(model: str | os.PathLike[str], stated: str | FamilySpec | None = None, *,
                  stated_by: str = "--family", allow_pickle: bool = False) -> FamilySpec:
    """The family of ``builtin:ID``, a diffusers folder or a ``.safetensors`` file, from headers and configs.

    ``stated`` is the user's word for it (e.g. ``sd2-v`` for an SD2 768-v file without a v-prediction marker: a name
    at the edge, the engine's ``FamilySpec`` of kohya's flags inside); ``stated_by`` names where it came from in
    error messages. A model that contradicts it is a UserError; a model that cannot be read cheaply (missing, a
    pickle checkpoint) takes it on trust, so a plan can be made for a model that is elsewhere. ``allow_pickle``: the
    user allowed a ``.ckpt`` / ``.pt``; unless stated, it is loaded (``torch.load(weights_only=True)``) to read its
    family.
    """
    if isinstance(stated, FamilySpec):
        stated = stated.name
    if stated is not None:
        known_family(stated, stated_by)
    text = os.fspath(model)
    if text.startswith(BUILTIN_PREFIX):
        return _builtin(text, stated, stated_by)
    path = Path(text).expanduser()
    if path.is_dir():
        return _family_of_folder(path, stated, stated_by)
    if path.is_file() and path.suffix.lower() in (".safetensors", ".gguf"):  # a GGUF file is refused by name
        return _family_of_single_file(path, stated, stated_by)
    if path.is_file() and allow_pickle and stated is None and path.suffix.lower() in PICKLE_SUFFIXES:
        return _family_of_single_file(path, stated, stated_by, allow_pickle=True)
    if stated is not None:
        return get_family(stated)
    if path.is_file():
        raise UserError(f"{path}: cannot tell the family of a {path.suffix or 'suffix-less'} file without loading "
                        f"it; name it with {stated_by} ({', '.join(family_names())})")
    raise UserError(f"model {text} not found; give a .safetensors file, a diffusers folder or builtin:<id> "
                    f"({', '.join(family_names())})")


def _builtin(model: str, stated: str | None, stated_by: str) -> FamilySpec:
    name = model[len(BUILTIN_PREFIX):]
    if name not in family_names():
        raise UserError(f"unknown built-in model {model}; known: "
                        f"{', '.join(BUILTIN_PREFIX + n for n in family_names())}")
    if stated is not None and stated != name:
        raise UserError(f"{model} is a {name} model but family {stated} was requested; drop {stated_by} or use "
                        f"{BUILTIN_PREFIX}{stated}")
    return get_family(name)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: unreadable config ({error}); repair the diffusers folder") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; expected a diffusers config")
    return data


def denoiser_config_file(folder: Path) -> Path | None:
    """``unet/config.json`` or ``transformer/config.json`` of a pipeline folder, or a lone transformer
    folder's own ``config.json`` (a FLUX transformer saved by itself); None when there is none."""
    for part in DENOISER_FOLDERS:
        if (folder / part / "config.json").is_file():
            return folder / part / "config.json"
    own = folder / "config.json"
    if own.is_file() and str(_read_config(own).get("_class_name", "")).endswith("Transformer2DModel"):
        return own
    return None


def _family_of_folder(folder: Path, stated: str | None, stated_by: str) -> FamilySpec:
    """A diffusers folder: the denoiser's config and the scheduler's prediction type."""
    unet_file = denoiser_config_file(folder)
    if unet_file is None:
        raise UserError(f"{folder}: no unet/config.json or transformer/config.json; expected a diffusers folder "
                        "with model_index.json or a .safetensors file")
    unet = _read_config(unet_file)
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    prediction = _read_config(scheduler_file).get("prediction_type") if scheduler_file.is_file() else None
    matched = unet_config_candidates(unet, all_families())
    if not matched:
        if stated is not None:
            return get_family(stated)
        keys = TRANSFORMER_DISTINGUISHING_KEYS if "num_single_layers" in unet else UNET_DISTINGUISHING_KEYS
        facts = ", ".join(f"{key} {unet.get(key)}" for key in keys)
        raise UserError(f"{unet_file}: {facts} match no known family ({', '.join(family_names())}); expected an "
                        f"SD1.x, SD2.x, SDXL or FLUX.1 model, or name its family with {stated_by}")
    return choose_family(matched, prediction, stated, subject=str(folder), stated_by=stated_by)


def _family_of_single_file(path: Path, stated: str | None, stated_by: str,
                           allow_pickle: bool = False) -> FamilySpec:
    """A single file: its layout from the header's keys, the first UNet conv, the v-prediction markers."""
    from sd_scripts_compat.models.checkpoint import detect_layout, read_checkpoint

    checkpoint = read_checkpoint(path, header_only=True, allow_pickle=allow_pickle)
    own = (header_marker_candidates(checkpoint.shapes, all_families())
           or most_markers(header_marker_candidates(checkpoint.shapes, all_families(), fewer_blocks=True)))
    if own:  # SD3.5 (ours), Lumina 2, HunyuanImage-2.1, Anima (sd-scripts), musubi's DiTs: told by the header
        return choose_family(own, None, stated, subject=str(path), noun="checkpoint", stated_by=stated_by)
    layout = detect_layout(checkpoint)
    matched = (checkpoint_candidates(checkpoint.shapes, layout, all_families())
               or checkpoint_candidates(checkpoint.shapes, layout, all_families(), fewer_blocks=True))
    if not matched:
        if stated is not None:
            return get_family(stated)
        what = "transformer shape (widths, block counts)" if layout == "flux" else "first UNet convolution"
        raise UserError(f"{path}: its {what} matches no known family ({', '.join(family_names())}); "
                        f"expected an SD1.x, SD2.x, SDXL or FLUX.1 checkpoint, or name its family with {stated_by}")
    prediction = file_prediction(checkpoint.shapes, checkpoint.metadata)
    return choose_family(matched, prediction, stated, subject=str(path), noun="checkpoint", stated_by=stated_by)


# ------------------------------------------------------------------------------------- shared pieces


def _same(a: object, b: object) -> bool:
    return (list(a) if isinstance(a, (list, tuple)) else a) == (list(b) if isinstance(b, (list, tuple)) else b)


def unet_config_candidates(config: Mapping[str, Any], pool: Iterable[FamilySpec]) -> list[FamilySpec]:
    """Families whose denoiser config agrees with ``config`` on every distinguishing key ``config`` has (none
    when it has none of them: nothing to tell the families apart by). A config's ``_class_name``, when it
    has one, must be the family's denoiser class."""
    out = []
    for family in pool:
        wanted = TRANSFORMER_DISTINGUISHING_KEYS if family.is_transformer else UNET_DISTINGUISHING_KEYS
        keys = [key for key in wanted if key in config]
        named = config.get("_class_name")
        if named is not None and named != family.denoiser_class:
            continue
        if keys and all(_same(config[key], family.unet.get(key, False if key == "guidance_embeds" else None))
                        for key in keys):
            out.append(family)
    return out


def checkpoint_candidates(shapes: Mapping[str, tuple[int, ...]], layout: str, pool: Iterable[FamilySpec], *,
                          fewer_blocks: bool = False) -> list[FamilySpec]:
    """Families of single-file ``layout`` whose first UNet conv has the shape in ``shapes`` (when present);
    for a FLUX transformer file: its input layer, block counts and whether it has a guidance embedder
    (``fewer_blocks``: as many as the family's or fewer, ``models.file_depth``)."""
    from sd_scripts_compat.models.checkpoint import UNET_PREFIX

    shape = shapes.get(UNET_PREFIX + "input_blocks.0.0.weight")
    out = []
    for family in pool:
        unet = family.unet
        if family.is_transformer:
            if family.single_file_layout == layout and _transformer_header_fits(
                    shapes, family, family.flux_model_type or "flux", fewer_blocks):
                out.append(family)
            continue
        kernel = unet.get("conv_in_kernel", 3)
        expected = (unet["block_out_channels"][0], unet.get("in_channels", 4), kernel, kernel)
        if family.single_file_layout == layout and (shape is None or tuple(shape) == expected):
            out.append(family)
    return out


OWN_LAYOUT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")  # ComfyUI / SD3 files, Anima's


def header_marker_candidates(shapes: Mapping[str, Any], pool: Iterable[FamilySpec], *,
                             fewer_blocks: bool = False) -> list[FamilySpec]:
    """Families with ``header_markers`` whose every marker and block lists' counts the header shows (every list:
    FLUX.2 dev and klein 9B both have 8 double blocks, 48 and 24 single; ``fewer_blocks``: at least one and at
    most the family's in every list, for the layouts whose depth is read from the file: ``models.file_depth``)."""
    from sd_scripts_compat.models.file_depth import DEPTH_FROM_FILE, fewer_blocks_fit

    keys = set()
    for key in shapes:
        prefix = next((p for p in OWN_LAYOUT_PREFIXES if key.startswith(p)), "")
        keys.add(key[len(prefix):])
    out = []
    for family in pool:
        if not family.header_markers or not all(any(k.startswith(m) for k in keys) for m in family.header_markers):
            continue
        lists = [entry["kohya"].split("{i}")[0] for entry in family.lora_layout]  # "joint_blocks.", "blocks." ...
        counts = [len({k[len(blocks):].split(".")[0] for k in keys if k.startswith(blocks)}) for blocks in lists]
        if all(count == wanted for count, wanted in zip(counts, family.swap_block_counts) if wanted):
            out.append(family)
        elif fewer_blocks and family.single_file_layout in DEPTH_FROM_FILE and fewer_blocks_fit(family, shapes):
            out.append(family)
    return out


def most_markers(matched: list[FamilySpec]) -> list[FamilySpec]:
    """The candidates with the most header markers: the most specific (a depth-2 SD3 file with MMDiT-X attention
    is SD3.5 Medium, whose markers include ``x_block.attn2``, not Large, whose markers it also shows)."""
    most = max((len(family.header_markers) for family in matched), default=0)
    return [family for family in matched if len(family.header_markers) == most]


def _transformer_header_fits(shapes: Mapping[str, tuple[int, ...]], family: FamilySpec, model_type: str,
                             fewer_blocks: bool) -> bool:
    from sd_scripts_compat.models.file_depth import fewer_blocks_fit
    from sd_scripts_compat.models.flux_layout import bfl_shapes_hint

    config = family.unet
    hint = bfl_shapes_hint(shapes)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    counts = (hint["num_layers"], hint["num_single_layers"]) == (config["num_layers"], config["num_single_layers"])
    if not (counts or fewer_blocks and fewer_blocks_fit(family, shapes)):
        return False
    return (hint["inner"], hint["in_channels"], hint["guidance"], hint["context"], hint["model_type"]) == (
        inner, config["in_channels"], bool(config.get("guidance_embeds")), config["joint_attention_dim"], model_type)


def file_prediction(shapes: Mapping[str, Any], metadata: Mapping[str, str]) -> str | None:
    """"v_prediction" / "epsilon" when a single file says so, else None (SD2 768-v files often carry no marker)."""
    if V_PRED_KEY in shapes:
        return "v_prediction"
    stated = metadata.get("modelspec.prediction_type", "").lower()
    if stated in V_PREDICTION_NAMES:
        return "v_prediction"
    if stated == "epsilon":
        return "epsilon"
    return None


def choose_family(matched: list[FamilySpec], prediction: str | None, stated: str | None, *, subject: str,
                  noun: str = "model", stated_by: str = "--family") -> FamilySpec:
    """The one rule that picks a family among ``matched`` (see the module docstring)."""
    ordered = sorted(matched, key=lambda f: f.tiny)  # stable: full-size first, else family-name order
    if stated is not None:
        for family in ordered:
            if family.name == stated and prediction in (None, family.prediction_type):
                return family
    wanted = prediction or "epsilon"
    detected = next((f for f in ordered if f.prediction_type == wanted), ordered[0])
    if stated is not None and stated != detected.name:
        raise UserError(f"{subject} is a {detected.name} {noun} but family {stated} was requested; "
                        f"drop {stated_by} or use {detected.name}")
    return detected


def family_for_kohya_flags(v2: bool, v_parameterization: bool) -> FamilySpec | None:
    """The full-size family kohya's ``--v2`` / ``--v_parameterization`` flags name, None without ``--v2``
    (kohya has no family flag; without ``--v2`` the file decides)."""
    if not v2:
        return None
    wanted = "v_prediction" if v_parameterization else "epsilon"
    return next(f for f in all_families() if f.v2 and not f.tiny and f.prediction_type == wanted)
