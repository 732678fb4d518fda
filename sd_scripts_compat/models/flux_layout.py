"""FLUX.1's two naming schemes: Black Forest Labs' (the released flux1-dev.safetensors, which kohya trains)
and diffusers' ``FluxTransformer2DModel`` (which we run), as one table read both ways.

BFL fuses projections that diffusers keeps apart: a double block's ``img_attn.qkv`` is diffusers'
``attn.to_q | to_k | to_v`` stacked on the output axis, ``txt_attn.qkv`` is ``add_q_proj | add_k_proj |
add_v_proj``, a single block's ``linear1`` is ``attn.to_q | to_k | to_v | proj_mlp``. The LoRA network
(``network.lora``) and the single-file reader both use ``DOUBLE_BLOCK`` / ``SINGLE_BLOCK`` below.

Hand-written (one line why): diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` hard-codes
inner_dim 3072 and mlp_ratio 4 (so it cannot read the tiny family) and has no reverse direction; the
tests check this table against it on full-size shapes (meta tensors).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel
    from torch import nn

# BFL name inside a block -> diffusers names inside the block, in BFL's stacking order (one name: not fused)
DOUBLE_BLOCK: dict[str, tuple[str, ...]] = {
    "img_mod.lin": ("norm1.linear",),
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "img_mlp.0": ("ff.net.0.proj",),
    "img_mlp.2": ("ff.net.2",),
    "txt_mod.lin": ("norm1_context.linear",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
    "txt_mlp.0": ("ff_context.net.0.proj",),
    "txt_mlp.2": ("ff_context.net.2",),
}
SINGLE_BLOCK: dict[str, tuple[str, ...]] = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation.lin": ("norm.linear",),
}
# RMSNorm scales: BFL ``.scale`` -> diffusers ``.weight``
DOUBLE_BLOCK_NORMS = {"img_attn.norm.query_norm.scale": "attn.norm_q.weight",
                      "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
                      "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
                      "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight"}
SINGLE_BLOCK_NORMS = {"norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight"}
# Linears outside the blocks (BFL -> diffusers); guidance_in only in guidance-distilled models (dev)
OUTER_LINEARS = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
}
# Chroma's modulation approximator (``distilled_guidance_layer``), per layer i (BFL -> diffusers)
APPROXIMATOR_LAYER = {"in_layer": "linear_1", "out_layer": "linear_2"}
# AdaLayerNormContinuous: BFL stores (shift, scale), diffusers (scale, shift)
SWAPPED_HALVES = {"final_layer.adaLN_modulation.1": "norm_out.linear"}
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI-style full checkpoints carry one


def approximator_names(config: Mapping[str, Any]) -> dict[str, str]:
    """Chroma's approximator tensors, BFL name -> diffusers name (none for FLUX.1)."""
    if "approximator_layers" not in config:
        return {}
    out = {f"distilled_guidance_layer.{p}.{k}": f"distilled_guidance_layer.{p}.{k}"
           for p in ("in_proj", "out_proj") for k in ("weight", "bias")}
    for i in range(int(config["approximator_layers"])):
        for old, new in APPROXIMATOR_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"distilled_guidance_layer.layers.{i}.{old}.{kind}"] = \
                    f"distilled_guidance_layer.layers.{i}.{new}.{kind}"
        out[f"distilled_guidance_layer.norms.{i}.scale"] = f"distilled_guidance_layer.norms.{i}.weight"
    return out


def block_tables(config: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, tuple[str, ...]], dict[str, str]]]:
    """``(bfl_block, diffusers_block, linears, norms)`` for every double and single block of ``config``."""
    for i in range(int(config["num_layers"])):
        yield f"double_blocks.{i}", f"transformer_blocks.{i}", DOUBLE_BLOCK, DOUBLE_BLOCK_NORMS
    for i in range(int(config["num_single_layers"])):
        yield f"single_blocks.{i}", f"single_transformer_blocks.{i}", SINGLE_BLOCK, SINGLE_BLOCK_NORMS


def lora_targets(
        transformer: FluxTransformer2DModel | ChromaTransformer2DModel) -> Iterator[tuple[str, tuple[nn.Module, ...]]]:
    """``(bfl_name, linears)`` for every Linear kohya's ``networks.lora_flux`` wraps by default (the
    DoubleStreamBlock / SingleStreamBlock Linears), with the diffusers modules that make up a fused one.
    Chroma's blocks have no modulation Linears (its approximator feeds them), so they yield none."""
    modules = dict(transformer.named_modules())
    for bfl_block, block, linears, _norms in block_tables(transformer.config):
        for bfl_name, parts in linears.items():
            if all(f"{block}.{part}" in modules for part in parts):
                yield f"{bfl_block}.{bfl_name}", tuple(modules[f"{block}.{part}"] for part in parts)


def table_lora_targets(transformer: nn.Module, layout: tuple[dict[str, Any], ...]
                       ) -> Iterator[tuple[str, tuple[nn.Module, ...]]]:
    """``(kohya_name, linears)`` from a family's ``lora_layout`` (SD3, Lumina 2, HunyuanImage, Anima): each
    block list's kohya Linears with their diffusers parts; a Linear a block lacks (SD3's last, pre-only context
    block has no context MLP; MMDiT-X's second attention ends at block 12) is not targeted, as in kohya."""
    modules = dict(transformer.named_modules())
    for group in layout:
        kohya, diffusers = group["kohya"], group["diffusers"]
        if "{i}" in diffusers:
            count = len(modules[diffusers.split(".{i}")[0]])
            blocks = [(kohya.format(i=i), diffusers.format(i=i)) for i in range(count)]
        else:
            blocks = [(kohya, diffusers)]
        for kohya_block, block in blocks:
            for name, parts in group["linears"].items():
                if all(f"{block}.{part}" in modules for part in parts):
                    yield f"{kohya_block}.{name}", tuple(modules[f"{block}.{part}"] for part in parts)


def to_diffusers(bfl: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A BFL-layout transformer state dict -> ``FluxTransformer2DModel`` names (fused tensors split by the
    widths of ``config``). Keys it does not know are left out; the strict loader reports what is missing."""
    import torch

    bfl = {_strip(k): v for k, v in bfl.items()}
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    out: dict[str, torch.Tensor] = {new: bfl[old] for old, new in approximator_names(config).items() if old in bfl}
    for old, new in OUTER_LINEARS.items():
        for kind in ("weight", "bias"):
            if f"{old}.{kind}" in bfl:
                out[f"{new}.{kind}"] = bfl[f"{old}.{kind}"]
    for old, new in SWAPPED_HALVES.items():
        for kind in ("weight", "bias"):
            if f"{old}.{kind}" in bfl:
                shift, scale = bfl[f"{old}.{kind}"].chunk(2, dim=0)
                out[f"{new}.{kind}"] = torch.cat([scale, shift], dim=0)
    for bfl_block, block, linears, norms in block_tables(config):
        for old, new in norms.items():
            if f"{bfl_block}.{old}" in bfl:
                out[f"{block}.{new}"] = bfl[f"{bfl_block}.{old}"]
        for bfl_name, parts in linears.items():
            for kind in ("weight", "bias"):
                tensor = bfl.get(f"{bfl_block}.{bfl_name}.{kind}")
                if tensor is None:
                    continue
                sizes = [inner] * len(parts)
                sizes[-1] = tensor.shape[0] - inner * (len(parts) - 1)  # linear1's last part is the MLP
                for part, piece in zip(parts, torch.split(tensor, sizes, dim=0)):
                    out[f"{block}.{part}.{kind}"] = piece
    return out


def to_bfl(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``FluxTransformer2DModel`` (or ``ChromaTransformer2DModel``) state dict -> BFL names (the layout of
    flux1-dev.safetensors / Chroma's file); a part the model lacks (Chroma's modulation Linears) is left out."""
    import torch

    out: dict[str, torch.Tensor] = {old: state[new] for old, new in approximator_names(config).items()}
    for old, new in OUTER_LINEARS.items():
        for kind in ("weight", "bias"):
            if f"{new}.{kind}" in state:
                out[f"{old}.{kind}"] = state[f"{new}.{kind}"]
    for old, new in SWAPPED_HALVES.items():
        for kind in ("weight", "bias"):
            if f"{new}.{kind}" in state:
                scale, shift = state[f"{new}.{kind}"].chunk(2, dim=0)
                out[f"{old}.{kind}"] = torch.cat([shift, scale], dim=0)
    for bfl_block, block, linears, norms in block_tables(config):
        for old, new in norms.items():
            out[f"{bfl_block}.{old}"] = state[f"{block}.{new}"]
        for bfl_name, parts in linears.items():
            for kind in ("weight", "bias"):
                if all(f"{block}.{p}.{kind}" in state for p in parts):
                    out[f"{bfl_block}.{bfl_name}.{kind}"] = torch.cat([state[f"{block}.{p}.{kind}"] for p in parts])
    return out


def _strip(key: str) -> str:
    for prefix in BFL_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def is_bfl_transformer(keys: Iterable[str]) -> bool:
    """Whether a file's keys are a BFL-layout FLUX transformer (with or without a ComfyUI prefix)."""
    return any(_strip(k).startswith("double_blocks.") for k in keys) and any(
        _strip(k).startswith("img_in.") for k in keys)


def bfl_shapes_hint(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The facts a header tells (no weights): inner width, input channels, block counts, guidance, model type."""
    stripped = {_strip(k): tuple(v) for k, v in shapes.items()}
    img_in = stripped.get("img_in.weight")
    doubles = {int(k.split(".")[1]) for k in stripped if k.startswith("double_blocks.")}
    singles = {int(k.split(".")[1]) for k in stripped if k.startswith("single_blocks.")}
    return {"inner": img_in[0] if img_in else None, "in_channels": img_in[1] if img_in else None,
            "num_layers": len(doubles), "num_single_layers": len(singles),
            "guidance": "guidance_in.in_layer.weight" in stripped,
            "context": stripped.get("txt_in.weight", (None, None))[1],
            # Chroma: the modulation approximator instead of per-block modulation Linears
            "model_type": "chroma" if any(k.startswith("distilled_guidance_layer.") for k in stripped) else "flux"}
