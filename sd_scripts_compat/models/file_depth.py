"""A transformer file with fewer blocks than its family: its depth read from the file, as sd-scripts reads it.

sd-scripts sizes FLUX.1 and SD3 from the file, not from a fixed table: ``flux_utils.analyze_checkpoint_state``
counts ``double_blocks.N`` and ``single_blocks.N`` (a pruned FLUX.1 has fewer than dev's 19 and 38), and
``sd3_utils.analyze_state_dict_state`` counts ``joint_blocks.N`` and makes the MMDiT as wide as its ``x_embedder``
(64 x depth in its own files: one head per block), with the MMDiT-X attention where ``x_block.attn2`` is and the
position table from ``pos_embed``. A T5 encoder file's layers are ``encoder.block.N``. Our engine does the same,
so that such a file loads, and so that our step can be compared with sd-scripts' on a model small enough for this
machine (``bench/equivalence.py``).

The family stays the family (its name, its LoRA layout, its trainer); ``at_file_depth`` gives its spec with the
denoiser config the file has, which the loaders put into the bundle, so what reads the depth from the bundle's
family (SD3's last block, the LoRA targets, block swap) sees the model that was loaded. Detection reads the same
facts: a file matches a family at fewer blocks only when it matches none at its full depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from sd_scripts_compat.facts.families import FamilySpec, TextEncoderSpec

T5_BLOCKS = "encoder.block."
DEPTH_FROM_FILE = ("flux", "sd3")  # the single-file layouts whose depth our loaders read from the file


def block_count(keys: Iterable[str], prefix: str) -> int:
    """How many blocks ``prefix{N}.`` the keys hold (``prefix`` with any file prefix before it)."""
    found = set()
    for key in keys:
        _, hit, rest = key.partition(prefix)
        if hit and rest.split(".", 1)[0].isdigit():
            found.add(int(rest.split(".", 1)[0]))
    return len(found)


def sd3_geometry(shapes: Mapping[str, tuple[int, ...]], head_dim: int) -> dict[str, Any]:
    """An SD3 MMDiT file's depth facts as diffusers' config names them, read from the file as sd-scripts'
    ``analyze_state_dict_state`` reads them: the blocks, the width (``x_embedder``'s output; sd-scripts' files are
    64 x depth wide, one head per block), the MMDiT-X layers where ``x_block.attn2`` is, the position table."""
    keys = list(shapes)
    depth = block_count(keys, "joint_blocks.")
    dual = sorted({int(key.partition("joint_blocks.")[2].split(".", 1)[0]) for key in keys
                   if ".x_block.attn2." in key})
    geometry: dict[str, Any] = {"num_layers": depth, "dual_attention_layers": dual}
    width = next((shape[0] for key, shape in shapes.items() if key.endswith("x_embedder.proj.weight")), None)
    if width is not None:
        whole = int(width) % head_dim == 0  # else 0 heads: not this family's head width
        geometry.update(num_attention_heads=int(width) // head_dim if whole else 0, caption_projection_dim=int(width))
    context = next((shape for key, shape in shapes.items() if key.endswith("context_embedder.weight")), None)
    if context is not None:
        geometry["joint_attention_dim"] = int(context[1])
    pos = next((shape for key, shape in shapes.items() if key.endswith("pos_embed")), None)
    if pos is not None:
        geometry["pos_embed_max_size"] = round(int(pos[1]) ** 0.5)
    return geometry


def flux_geometry(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """A BFL FLUX.1 / Chroma file's block counts, as its header hint counts them (``flux_layout.bfl_shapes_hint``)."""
    from sd_scripts_compat.models.flux_layout import bfl_shapes_hint

    hint = bfl_shapes_hint(shapes)
    return {"num_layers": hint["num_layers"], "num_single_layers": hint["num_single_layers"]}


def file_geometry(spec: FamilySpec, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The denoiser config values the file has where they differ from the family's (empty: the family's own)."""
    if spec.single_file_layout not in DEPTH_FROM_FILE:
        return {}
    if spec.single_file_layout == "sd3":
        found = sd3_geometry(shapes, int(spec.unet["attention_head_dim"]))
    else:
        found = flux_geometry(shapes)
    return {key: value for key, value in found.items() if _plain(spec.unet.get(key)) != _plain(value)}


def fewer_blocks_fit(spec: FamilySpec, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether the file is the family with fewer blocks: at least one and at most the family's in every list, whole
    heads of the family's width, and the family's text width (a tiny twin's file is not its full-size family's)."""
    found = file_geometry(spec, shapes)
    counts = [key for key in ("num_layers", "num_single_layers") if key in found]
    return (bool(counts) and all(0 < int(found[key]) <= int(spec.unet[key]) for key in counts)
            and found.get("num_attention_heads") != 0 and "joint_attention_dim" not in found)


def at_file_depth(spec: FamilySpec, shapes: Mapping[str, tuple[int, ...]]) -> FamilySpec:
    """The family's spec with the file's depth (the spec itself when the file has the family's)."""
    found = file_geometry(spec, shapes)
    return dataclasses.replace(spec, unet={**spec.unet, **found}) if found else spec


def t5_at_file_depth(encoder: TextEncoderSpec, keys: Iterable[str]) -> TextEncoderSpec:
    """A T5 encoder's spec with the file's layer count when it holds fewer than the family's (sd-scripts' T5-XXL
    config is fixed at 24 layers; a file of fewer loads here as what it is; one of more is left to the strict
    loader's one line)."""
    layers = block_count(keys, T5_BLOCKS)
    if not 0 < layers < int(encoder.config.get("num_layers", layers)):
        return encoder
    return dataclasses.replace(encoder, config={**encoder.config, "num_layers": layers})


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
