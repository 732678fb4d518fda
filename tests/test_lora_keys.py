"""Our LoRA's key set and shapes equal sd-scripts' for the full-size SD1.5 and SDXL (built on meta)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sd_scripts_compat.config.network_args import NetworkArgs
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from sd_scripts_compat.network.lora_file import describe_lora

# copies of shared/reference/kohya/keys_*.json: the keys sd-scripts' own networks/lora.py produces
REFERENCE = Path(__file__).parent / "data" / "kohya"

CASES = [
    # reference file, family, conv_dim, TE modules per prefix, UNet modules
    ("keys_sd15.json", "sd15", None, {"lora_te": 72}, 192),
    ("keys_sd15_conv.json", "sd15", 4, {"lora_te": 72}, 278),
    ("keys_sdxl.json", "sdxl", None, {"lora_te1": 72, "lora_te2": 192}, 722),
    ("keys_sdxl_conv.json", "sdxl", 4, {"lora_te1": 72, "lora_te2": 192}, 788),
]


@pytest.mark.parametrize(("reference", "family", "conv_dim", "te_counts", "unet_count"), CASES,
                         ids=[case[0] for case in CASES])
def test_keys_and_shapes_equal_reference(reference, family, conv_dim, te_counts, unet_count):
    expected = json.loads((REFERENCE / reference).read_text())
    bundle = build_modules(get_family(family), device="meta")
    network = create_network(bundle, network_dim=16, network_alpha=8,
                             args=NetworkArgs(conv_dim=conv_dim, conv_alpha=1 if conv_dim else None))
    state_dict = network.kohya_state_dict()
    assert set(state_dict) == set(expected)
    for key, (shape, dtype) in expected.items():
        assert list(state_dict[key].shape) == shape, key
        assert str(state_dict[key].dtype) == dtype, key
        assert state_dict[key].device.type == "meta"  # shapes only: nothing allocated
    assert all(state_dict[k].dim() == 0 for k in state_dict if k.endswith(".alpha"))
    assert network.unet_modules == unet_count
    assert network.text_encoder_modules == sum(te_counts.values())
    conv3x3 = sum(1 for key, (shape, _) in expected.items()
                  if key.endswith(".lora_down.weight") and len(shape) == 4 and shape[2:] != [1, 1])
    assert network.conv_modules == conv3x3
    # base model untouched: no LoRA parameter leaked into the UNet's own state dict
    assert not any("lora" in name for name in bundle.unet.state_dict())


@pytest.mark.parametrize(("reference", "family", "conv_dim", "te_counts", "unet_count"), CASES,
                         ids=[case[0] for case in CASES])
def test_describe_reference_key_sets(reference, family, conv_dim, te_counts, unet_count):
    """A state dict with sd-scripts' own keys/shapes (weights on meta, alphas real) is described right."""
    expected = json.loads((REFERENCE / reference).read_text())
    state_dict = {key: torch.tensor(8.0) if key.endswith(".alpha") else torch.empty(shape, device="meta")
                  for key, (shape, _) in expected.items()}
    info = describe_lora(state_dict, {})
    assert info["family"] == family
    assert info["modules"]["unet"] == unet_count
    assert info["modules"]["text_encoders"] == te_counts
    assert info["conv"] == (conv_dim is not None)
    assert set(info["ranks"]) == ({"16", "4"} if conv_dim else {"16"})
