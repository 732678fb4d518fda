"""The six families sd-scripts trains beyond SD / SDXL / FLUX.1 (SD3.5 Medium and Large, Chroma, Lumina 2,
HunyuanImage-2.1, Anima), built full size on the meta device from their family data: parameter counts of the
denoiser, VAE and text encoders, and the kohya LoRA keys and shapes of our network at dim 16 against the lists
kohya's own network modules produce (``shared/reference/kohya/keys_*.json``, when that folder is beside the
repository; the counts below are from its README and run everywhere)."""

from __future__ import annotations

import json

import pytest

from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from tests.fixtures.local import REFERENCE

# family: (reference tag, denoiser params, LoRA tensors, DiT modules, TE modules by prefix, swap max)
FACTS = {
    "sd3.5-medium": ("sd35_medium", 2_243_171_520, 1581, 263, {"lora_te1": 72, "lora_te2": 192}, 22),
    "sd3.5-large": ("sd35_large", 8_056_627_520, 1923, 377, {"lora_te1": 72, "lora_te2": 192}, 36),
    "chroma": ("chroma", 8_899_983_424, 684, 228, {}, 35),
    "lumina2": ("lumina2", 2_609_769_152, 1086, 180, {"lora_te": 182}, 24),
    "hunyuan-image-2.1": ("hunyuan_image_2_1", 17_425_795_520, 960, 320, {}, 37),
    "anima": ("anima", 2_091_068_928, 1428, 280, {"lora_te": 196}, 26),
}


def _network(name: str):
    bundle = build_modules(get_family(name), device="meta", seed=None)
    return bundle, create_network(bundle, network_dim=16, network_alpha=8, train_unet=True, train_text_encoder=True)


def _denoiser_params(bundle) -> int:
    import diffusers

    extras = sum(sum(p.numel() for p in getattr(diffusers, extra["_class_name"])().parameters())
                 for extra in bundle.family.denoiser_extras) if bundle.family.denoiser_extras else 0
    return sum(p.numel() for p in bundle.unet.parameters()) + extras


@pytest.mark.parametrize("name", FACTS)
def test_family_builds_at_kohya_size_and_lora_counts(name):
    """Lumina's count is kohya's less its two 2304-element pad tokens (diffusers' NextDiT keeps one buffer
    fewer); every other denoiser matches kohya's to the parameter."""
    import torch

    _tag, params, tensors, dit_modules, te_modules, swap_max = FACTS[name]
    with torch.device("meta"):
        bundle, network = _network(name)
    assert abs(_denoiser_params(bundle) - params) <= 2304 if name == "lumina2" else _denoiser_params(bundle) == params
    assert len(network.kohya_state_dict()) == tensors
    assert network.unet_modules == dit_modules
    prefixes: dict[str, int] = {}
    for lora in network.text_encoder_loras:
        prefix = "_".join(lora.lora_name.split("_")[:2])
        prefixes[prefix] = prefixes.get(prefix, 0) + 1
    assert prefixes == te_modules
    assert get_family(name).max_blocks_to_swap == swap_max


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="shared/reference is not beside the repository")
@pytest.mark.parametrize("name", FACTS)
def test_lora_keys_and_shapes_equal_kohyas(name):
    tag = FACTS[name][0]
    reference = json.loads((REFERENCE / "kohya" / f"keys_{tag}.json").read_text())
    _bundle, network = _network(name)
    ours = {key: list(tensor.shape) for key, tensor in network.kohya_state_dict().items()}
    assert ours == {key: list(shape) for key, (shape, _dtype) in reference.items()}
    stats = json.loads((REFERENCE / "kohya" / f"stats_{tag}.json").read_text())
    assert get_family(name).max_blocks_to_swap == stats["blocks_to_swap_max_probed"]
