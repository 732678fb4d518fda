"""diffusers <-> LDM/SGM UNet names, checked against kohya's real SDXL LoRA key lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sd_scripts_compat.facts.families import get_family, model_config
from sd_scripts_compat.models.unet_names import diffusers_to_ldm_unet_name, ldm_to_diffusers_unet_name

REFERENCE = Path(__file__).parent / "data" / "kohya"  # copies of shared/reference/kohya/keys_*.json


def _meta_unet(family: str):
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel(**model_config(get_family(family).unet))


def _reference_unet_modules(filename: str) -> set[str]:
    path = REFERENCE / filename
    if not path.is_file():
        pytest.skip(f"reference file {path} not present")
    keys = json.loads(path.read_text(encoding="utf-8"))
    return {key.split(".")[0] for key in keys if key.startswith("lora_unet_")}


def _kohya_names(unet, parent_classes: tuple[type, ...]) -> set[str]:
    """kohya-style LoRA module names: Linear/Conv2d children of the target blocks, LDM names."""
    names = set()
    for parent_name, parent in unet.named_modules():
        if not isinstance(parent, parent_classes):
            continue
        for child_name, child in parent.named_modules():
            if child_name and isinstance(child, (torch.nn.Linear, torch.nn.Conv2d)):
                ldm = diffusers_to_ldm_unet_name(f"{parent_name}.{child_name}", unet.config)
                names.add("lora_unet_" + ldm.replace(".", "_"))
    return names


def test_sdxl_transformer_modules_match_kohya_keys():
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    unet = _meta_unet("sdxl")
    expected = _reference_unet_modules("keys_sdxl.json")
    got = _kohya_names(unet, (Transformer2DModel,))
    assert len(expected) == 722
    assert got == expected


def test_sdxl_conv_modules_match_kohya_conv_keys():
    from diffusers.models.resnet import Downsample2D, ResnetBlock2D, Upsample2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    unet = _meta_unet("sdxl")
    expected = _reference_unet_modules("keys_sdxl_conv.json")
    got = _kohya_names(unet, (Transformer2DModel, ResnetBlock2D, Downsample2D, Upsample2D))
    assert len(expected) == 788
    assert got == expected


@pytest.mark.parametrize("family", ["sd15", "sd2", "sdxl", "tiny-sd15", "tiny-sdxl"])
def test_round_trip_all_parameters_and_modules(family):
    unet = _meta_unet(family)
    params = [name for name, _ in unet.named_parameters()]
    ldm = [diffusers_to_ldm_unet_name(name, unet.config) for name in params]
    assert len(set(ldm)) == len(params)  # the map is injective
    assert [ldm_to_diffusers_unet_name(name, unet.config) for name in ldm] == params
    # module names of every leaf layer map and round-trip too
    for name, module in unet.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm)):
            assert ldm_to_diffusers_unet_name(diffusers_to_ldm_unet_name(name, unet.config), unet.config) == name


def test_ldm_names_match_diffusers_converter_layout():
    """Our LDM names are exactly the keys diffusers' own single-file converter reads."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    unet = _meta_unet("tiny-sdxl")
    config = dict(unet.config)
    state = {"model.diffusion_model." + diffusers_to_ldm_unet_name(name, config): torch.zeros(1)
             for name, _ in unet.named_parameters()}
    converted = convert_ldm_unet_checkpoint(state, config)
    assert set(converted) == {name for name, _ in unet.named_parameters()}


def test_known_sdxl_names_and_prefix():
    config = get_family("sdxl").unet
    assert diffusers_to_ldm_unet_name("down_blocks.1.attentions.0", config) == "input_blocks.4.1"
    op = "input_blocks.3.0.op.weight"
    assert diffusers_to_ldm_unet_name("down_blocks.0.downsamplers.0.conv.weight", config) == op
    assert diffusers_to_ldm_unet_name("up_blocks.0.upsamplers.0.conv", config) == "output_blocks.2.2.conv"
    skip = "output_blocks.5.0.skip_connection"
    assert diffusers_to_ldm_unet_name("up_blocks.1.resnets.2.conv_shortcut", config) == skip
    assert diffusers_to_ldm_unet_name("mid_block.attentions.0.proj_in", config) == "middle_block.1.proj_in"
    assert diffusers_to_ldm_unet_name("add_embedding.linear_2.bias", config) == "label_emb.0.2.bias"
    assert ldm_to_diffusers_unet_name("model.diffusion_model.out.2.weight", config) == "conv_out.weight"
    sd15 = get_family("sd15").unet
    assert diffusers_to_ldm_unet_name("up_blocks.0.upsamplers.0.conv", sd15) == "output_blocks.2.1.conv"
    assert diffusers_to_ldm_unet_name("down_blocks.3.resnets.1.time_emb_proj", sd15) == "input_blocks.11.0.emb_layers.1"


def test_names_without_counterpart_raise():
    config = get_family("tiny-sd15").unet
    with pytest.raises(ValueError, match="down_blocks.0"):
        diffusers_to_ldm_unet_name("down_blocks.0", config)
    with pytest.raises(ValueError, match="input_blocks.99"):
        ldm_to_diffusers_unet_name("input_blocks.99.0.in_layers.0.weight", config)
