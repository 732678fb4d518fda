"""Diffusers <-> original LDM/SGM names for UNet modules and parameters.

kohya names SDXL UNet LoRA modules with the original (SGM) names and the single-file checkpoint
layout uses them for every model, while we build diffusers ``UNet2DConditionModel`` s. The mapping
is derived from the UNet config (layers per block, which blocks have attentions / resamplers), so
it holds for the full-size families and for the tiny test twins alike. Hand-written because
diffusers ships only a one-way, whole-state-dict converter (LDM -> diffusers), not a per-name map.

Layout facts (L = layers per down block; an up block has L + 1 resnets):
  conv_in                         <-> input_blocks.0.0
  down_blocks.i.resnets.j         <-> input_blocks.{k}.0      (k counts resnets from 1)
  down_blocks.i.attentions.j      <-> input_blocks.{k}.1
  down_blocks.i.downsamplers.0    <-> input_blocks.{k}.0      (its ``conv`` is ``op``)
  mid_block.resnets.j             <-> middle_block.{2j}
  mid_block.attentions.j          <-> middle_block.{2j+1}
  up_blocks.i.resnets.j           <-> output_blocks.{k}.0
  up_blocks.i.attentions.j        <-> output_blocks.{k}.1
  up_blocks.i.upsamplers.0        <-> output_blocks.{last k of block i}.{1 or 2}
  time_embedding.linear_1/2       <-> time_embed.0/2
  add_embedding.linear_1/2        <-> label_emb.0.0/2
  conv_norm_out / conv_out        <-> out.0 / out.2
Inside resnets: norm1 in_layers.0, conv1 in_layers.2, time_emb_proj emb_layers.1, norm2 out_layers.0,
conv2 out_layers.3, conv_shortcut skip_connection. Transformer internals keep their names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RESNET_TO_LDM = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
RESNET_TO_DIFFUSERS = {v: k for k, v in RESNET_TO_LDM.items()}

TOP_TO_LDM = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
TOP_TO_DIFFUSERS = {v: k for k, v in TOP_TO_LDM.items()}


@dataclass(frozen=True)
class _Slot:
    """One LDM ``input_blocks.k`` / ``output_blocks.k`` entry and the diffusers modules it holds."""

    block: int  # diffusers down/up block index
    resnet: int | None  # resnet index inside that block (None: a pure downsampler slot)
    attention: bool  # whether sub-index 1 is an attention (else the upsampler sits there)
    resampler_index: int | None  # LDM sub-index of the down/upsampler in this slot, if any


def _per_block(value: Any, count: int) -> list[int]:
    if isinstance(value, int):
        return [value] * count
    values = [int(v) for v in value]
    if len(values) != count:
        raise ValueError(f"UNet config list {values} does not have one entry per block ({count})")
    return values


def _layout(unet_config: dict[str, Any]) -> tuple[dict[int, _Slot], dict[int, _Slot], bool]:
    """Input-block slots, output-block slots and whether the mid block has attention."""
    down_types = list(unet_config["down_block_types"])
    up_types = list(unet_config["up_block_types"])
    layers = _per_block(unet_config.get("layers_per_block", 2), len(down_types))
    up_layers = list(reversed(layers))

    inputs: dict[int, _Slot] = {}
    k = 1
    for i, block_type in enumerate(down_types):
        has_attn = "Attn" in block_type
        for j in range(layers[i]):
            inputs[k] = _Slot(block=i, resnet=j, attention=has_attn, resampler_index=None)
            k += 1
        if i < len(down_types) - 1:  # diffusers: every down block but the last downsamples
            inputs[k] = _Slot(block=i, resnet=None, attention=False, resampler_index=0)
            k += 1

    outputs: dict[int, _Slot] = {}
    k = 0
    for i, block_type in enumerate(up_types):
        has_attn = "Attn" in block_type
        n = up_layers[i] + 1
        for j in range(n):
            upsample = j == n - 1 and i < len(up_types) - 1
            outputs[k] = _Slot(block=i, resnet=j, attention=has_attn,
                               resampler_index=(2 if has_attn else 1) if upsample else None)
            k += 1

    mid_type = unet_config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    mid_attn = mid_type is not None and "Attn" in mid_type
    return inputs, outputs, mid_attn


def _resnet_rest_to_ldm(rest: list[str]) -> list[str]:
    if rest and rest[0] in RESNET_TO_LDM:
        return RESNET_TO_LDM[rest[0]].split(".") + rest[1:]
    return rest


def _resnet_rest_to_diffusers(rest: list[str]) -> list[str]:
    if len(rest) >= 2 and f"{rest[0]}.{rest[1]}" in RESNET_TO_DIFFUSERS:
        return [RESNET_TO_DIFFUSERS[f"{rest[0]}.{rest[1]}"]] + rest[2:]
    if rest and rest[0] in RESNET_TO_DIFFUSERS:
        return [RESNET_TO_DIFFUSERS[rest[0]]] + rest[1:]
    if rest and rest[0] in ("in_layers", "out_layers", "emb_layers"):
        raise ValueError(f"no diffusers equivalent for resnet part {'.'.join(rest)!r}")
    return rest


def _join(*parts: object) -> str:
    return ".".join(str(p) for p in parts if p != "")


def _top_level(name: str, table: dict[str, str]) -> str | None:
    for prefix, target in table.items():
        if name == prefix or name.startswith(prefix + "."):
            return target + name[len(prefix):]
    return None


def diffusers_to_ldm_unet_name(name: str, unet_config: dict[str, Any]) -> str:
    """The original LDM/SGM name of a diffusers UNet module or parameter name.

    ``unet_config`` is the diffusers UNet config (``unet.config`` or a family's ``unet`` dict).
    Raises ValueError for names that have no LDM counterpart (e.g. ``down_blocks.0`` as a whole).
    """
    top = _top_level(name, TOP_TO_LDM)
    if top is not None:
        return top
    inputs, outputs, _ = _layout(unet_config)
    parts = name.split(".")
    if parts[0] in ("down_blocks", "up_blocks") and len(parts) >= 4:
        block, kind, index, rest = int(parts[1]), parts[2], int(parts[3]), parts[4:]
        slots = inputs if parts[0] == "down_blocks" else outputs
        ldm_block = "input_blocks" if parts[0] == "down_blocks" else "output_blocks"
        for k, slot in slots.items():
            if slot.block != block:
                continue
            if kind == "resnets" and slot.resnet == index:
                return _join(ldm_block, k, 0, *_resnet_rest_to_ldm(rest))
            if kind == "attentions" and slot.resnet == index and slot.attention:
                return _join(ldm_block, k, 1, *rest)
            if kind == "downsamplers" and index == 0 and slot.resnet is None and ldm_block == "input_blocks":
                rest = ["op", *rest[1:]] if rest and rest[0] == "conv" else rest
                return _join(ldm_block, k, 0, *rest)
            if kind == "upsamplers" and index == 0 and slot.resampler_index is not None:
                return _join(ldm_block, k, slot.resampler_index, *rest)
    if parts[0] == "mid_block" and len(parts) >= 3:
        kind, index, rest = parts[1], int(parts[2]), parts[3:]
        if kind == "resnets":
            return _join("middle_block", 2 * index, *_resnet_rest_to_ldm(rest))
        if kind == "attentions":
            return _join("middle_block", 2 * index + 1, *rest)
    raise ValueError(f"diffusers UNet name {name!r} has no LDM/SGM counterpart")


def ldm_to_diffusers_unet_name(name: str, unet_config: dict[str, Any]) -> str:
    """The diffusers name of an original LDM/SGM UNet module or parameter name (inverse of the above).

    Accepts names with or without the ``model.diffusion_model.`` prefix of single-file checkpoints.
    """
    name = name.removeprefix("model.diffusion_model.")
    top = _top_level(name, TOP_TO_DIFFUSERS)
    if top is not None:
        return top
    inputs, outputs, _ = _layout(unet_config)
    parts = name.split(".")
    if parts[0] in ("input_blocks", "output_blocks") and len(parts) >= 3:
        k, sub, rest = int(parts[1]), int(parts[2]), parts[3:]
        slots = inputs if parts[0] == "input_blocks" else outputs
        prefix = "down_blocks" if parts[0] == "input_blocks" else "up_blocks"
        slot = slots.get(k)
        if slot is not None:
            if slot.resnet is None and sub == 0:  # a downsampler slot
                rest = ["conv", *rest[1:]] if rest and rest[0] == "op" else rest
                return _join(prefix, slot.block, "downsamplers", 0, *rest)
            if sub == 0:
                return _join(prefix, slot.block, "resnets", slot.resnet, *_resnet_rest_to_diffusers(rest))
            if sub == 1 and slot.attention:
                return _join(prefix, slot.block, "attentions", slot.resnet, *rest)
            if slot.resampler_index is not None and sub == slot.resampler_index:
                return _join(prefix, slot.block, "upsamplers", 0, *rest)
    if parts[0] == "middle_block" and len(parts) >= 2:
        k, rest = int(parts[1]), parts[2:]
        if k % 2 == 0:
            return _join("mid_block", "resnets", k // 2, *_resnet_rest_to_diffusers(rest))
        return _join("mid_block", "attentions", k // 2, *rest)
    raise ValueError(f"LDM/SGM UNet name {name!r} has no diffusers counterpart")
