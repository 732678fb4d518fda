"""The families kohya trains in musubi-tuner (Qwen-Image, FLUX.2 dev / klein base 4B / 9B, Wan 2.2 T2V A14B,
Wan 2.1 T2V 1.3B, Z-Image), built full size on the meta device from their family data with diffusers' classes:
the denoiser's parameter count equals musubi's own model's (``musubi_stats_*.json``), our kohya LoRA network at
dim 16 has musubi's keys and shapes exactly (``musubi_keys_*.json``, when ``shared/reference`` is beside the
repository), and ``blocks_to_swap`` stops where musubi's own assert does."""

from __future__ import annotations

import json

import pytest

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family, musubi_flux2_split
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from tests.fixtures.local import REFERENCE

# family: (musubi's tag, DiT params, LoRA modules, LoRA params at dim 16, swap max) from the reference README
FACTS = {
    "qwen-image": ("qwen_image", 20_430_401_088, 840, 147_456_840, 59),
    "flux2-dev": ("flux_2_dev", 32_223_281_152, 160, 97_517_728, 29),
    "flux2-klein-4b": ("flux_2_klein_4b", 3_875_544_576, 80, 23_101_520, 13),
    "flux2-klein-9b": ("flux_2_klein_9b", 9_078_581_248, 112, 41_418_864, 16),
    "wan2.2-t2v-a14b": ("wan22_t2v_a14b", 14_288_491_584, 400, 76_677_520, 39),
    "wan2.1-t2v-1.3b": ("wan21_t2v_1_3b", 1_418_996_800, 300, 21_872_940, 29),
    "z-image": ("zimage", 6_154_908_736, 210, 35_021_010, 28),
}


def _build(name: str):
    import torch

    with torch.device("meta"):
        bundle = build_modules(get_family(name), device="meta", seed=None)
        network = create_network(bundle, network_dim=16, network_alpha=8, train_unet=True, train_text_encoder=False)
    return bundle, network


@pytest.mark.parametrize("name", FACTS)
def test_musubi_family_builds_at_musubi_size_with_its_lora_modules(name):
    _tag, params, modules, lora_params, swap_max = FACTS[name]
    bundle, network = _build(name)
    family = get_family(name)
    assert family.trainer == "musubi-tuner" and not family.trained_here
    assert sum(p.numel() for p in bundle.unet.parameters()) == params
    assert network.unet_modules == modules and not network.text_encoder_loras
    state = network.kohya_state_dict()
    assert sum(t.numel() for k, t in state.items() if not k.endswith(".alpha")) + modules == lora_params
    assert family.max_blocks_to_swap == swap_max


@pytest.mark.parametrize("name", FACTS)
def test_musubi_family_lora_keys_and_shapes_equal_musubis_own(name):
    path = REFERENCE / "musubi" / f"musubi_keys_{FACTS[name][0]}.json"
    if not path.is_file():
        pytest.skip(f"{path} is not beside the repository")
    reference = {key: tuple(shape) for key, (shape, _dtype) in json.loads(path.read_text()).items()}
    _bundle, network = _build(name)
    ours = {key: tuple(tensor.shape) for key, tensor in network.kohya_state_dict().items()}
    assert ours == reference


def test_musubi_flux2_swap_split_follows_its_ratio_rule_and_bound():
    """musubi's ``Flux2.enable_block_swap``: doubles = round(n / (1 + r / 2)) with r = singles / doubles, singles =
    round(doubles * r), shifted while a list keeps fewer than two blocks on the device."""
    assert musubi_flux2_split(0, 8, 48) == (0, 0)
    assert musubi_flux2_split(10, 8, 48) == (2, 12)  # r 6: round(2.5) = 2 (Python rounds half to even, as musubi)
    assert musubi_flux2_split(29, 8, 48) == (6, 44)
    assert musubi_flux2_split(1, 5, 20) == (0, 1)  # nothing by the ratio: one single block, as musubi
    with pytest.raises(UserError, match="swaps at most 29 in musubi-tuner"):
        get_family("flux2-dev").swap_split(30)
    with pytest.raises(UserError, match="at most 59"):
        get_family("qwen-image").swap_split(60)


@pytest.mark.parametrize("name", FACTS)
def test_musubi_family_facts_name_its_scripts(name):
    family = get_family(name)
    facts = family.musubi
    assert family.kohya_script.endswith("_train_network.py")
    assert facts["cache_latents"].endswith("_cache_latents.py")
    assert facts["cache_text_encoder_outputs"].endswith("_cache_text_encoder_outputs.py")
    assert family.bucket_step == 16
