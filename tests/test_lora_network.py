"""LoRA network math and wiring on the tiny families (real modules, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from sd_scripts_compat.config.network_args import NetworkArgs
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import LoRAModule, create_network, create_network_from_weights


@pytest.fixture(scope="module")
def sd15():
    return build_modules(get_family("tiny-sd15"))


@pytest.fixture(scope="module")
def sdxl():
    return build_modules(get_family("tiny-sdxl"))


def _randomize_up(network, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in network.loras():
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=generator) * 0.1)


def _unet_out(bundle, seed=1):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    context = torch.randn(2, 77, bundle.unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        return bundle.unet(latents, torch.tensor([10, 900]), context).sample


def _te_out(bundle):
    ids = bundle.tokenizers[0](["a photo of a dog"], padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        return bundle.text_encoders[0](ids.input_ids).last_hidden_state


def test_linear_delta_is_up_down_scale_multiplier():
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    lora = LoRAModule("lora_unet_x", base, dim=3, alpha=1.5, multiplier=0.7)
    nn.init.normal_(lora.lora_up.weight)
    x = torch.randn(2, 5, 12)
    expected = base(x) + (x @ lora.lora_down.weight.T @ lora.lora_up.weight.T) * (1.5 / 3) * 0.7
    lora.apply_to()
    assert torch.allclose(base(x), expected, rtol=0, atol=1e-6)
    assert lora.alpha.dim() == 0 and lora.alpha.item() == 1.5


def test_conv_lora_shapes_and_math():
    torch.manual_seed(0)
    base = nn.Conv2d(6, 10, kernel_size=3, stride=2, padding=1)
    lora = LoRAModule("lora_unet_c", base, dim=4, alpha=None)  # alpha None -> alpha = dim, scale 1
    assert lora.lora_down.kernel_size == (3, 3) and lora.lora_down.stride == (2, 2) and lora.lora_down.padding == (1, 1)
    assert lora.lora_up.kernel_size == (1, 1)
    assert tuple(lora.lora_down.weight.shape) == (4, 6, 3, 3) and tuple(lora.lora_up.weight.shape) == (10, 4, 1, 1)
    assert lora.scale == 1.0 and lora.alpha.item() == 4.0
    nn.init.normal_(lora.lora_up.weight)
    x = torch.randn(1, 6, 9, 9)
    down = nn.functional.conv2d(x, lora.lora_down.weight, stride=2, padding=1)
    expected = base(x) + nn.functional.conv2d(down, lora.lora_up.weight)
    lora.apply_to()
    assert torch.allclose(base(x), expected, rtol=0, atol=1e-5)


def test_init_kaiming_down_zero_up():
    torch.manual_seed(0)
    lora = LoRAModule("lora_unet_x", nn.Linear(400, 300), dim=8, alpha=0)
    bound = 1 / math.sqrt(400)  # kaiming_uniform(a=sqrt(5)) bound = 1/sqrt(fan_in)
    assert lora.lora_down.weight.abs().max() <= bound
    assert lora.lora_down.weight.abs().max() > 0.9 * bound
    assert torch.count_nonzero(lora.lora_up.weight) == 0
    assert lora.scale == 1.0  # alpha 0 -> alpha = dim


def test_zero_at_init_and_apply_remove_bit_exact(sd15):
    before_unet, before_te = _unet_out(sd15), _te_out(sd15)
    names_before = list(sd15.unet.state_dict())
    network = create_network(sd15, network_dim=4, network_alpha=2, args=NetworkArgs(conv_dim=2, conv_alpha=1))
    network.apply_to()
    assert torch.equal(_unet_out(sd15), before_unet)  # lora_up is zero: output unchanged
    assert torch.equal(_te_out(sd15), before_te)
    _randomize_up(network)
    changed_unet, changed_te = _unet_out(sd15), _te_out(sd15)
    assert (changed_unet - before_unet).abs().max() > 1e-3
    assert (changed_te - before_te).abs().max() > 1e-3
    assert list(sd15.unet.state_dict()) == names_before  # base tree and names unchanged while applied
    network.set_multiplier(0.0)
    assert torch.equal(_unet_out(sd15), before_unet)
    network.set_multiplier(1.0)
    network.remove()
    assert torch.equal(_unet_out(sd15), before_unet)
    assert torch.equal(_te_out(sd15), before_te)
    assert all("forward" not in lora.base.__dict__ for lora in network.loras())


def test_set_multiplier_scales_every_module_delta(sd15):
    network = create_network(sd15, network_dim=4, network_alpha=4, args=NetworkArgs(conv_dim=2, conv_alpha=1))
    _randomize_up(network)
    network.apply_to()
    try:
        for lora in network.loras():
            base = lora.base
            if isinstance(base, nn.Linear):
                x = torch.randn(2, 3, base.in_features)
            else:
                x = torch.randn(1, base.in_channels, 8, 8)
            with torch.no_grad():
                plain = type(base).forward(base, x)
                network.set_multiplier(1.0)
                full = base(x) - plain
                network.set_multiplier(0.5)
                half = base(x) - plain
            assert full.abs().max() > 0, lora.lora_name
            assert torch.allclose(half, full * 0.5, rtol=1e-5, atol=1e-6), lora.lora_name
    finally:
        network.set_multiplier(1.0)
        network.remove()


def test_kohya_dropouts_match_manual_computation():
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    lora = LoRAModule("lora_unet_x", base, dim=4, alpha=2, dropout=0.3, rank_dropout=0.25)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    lora.train()
    x = torch.randn(3, 5, 8)
    torch.manual_seed(123)
    got = base(x)
    torch.manual_seed(123)
    lx = nn.functional.dropout(x @ lora.lora_down.weight.T, p=0.3)  # dropout on the lora_down output
    mask = (torch.rand(3, 4) > 0.25).unsqueeze(1)  # rank dropout per sample and rank
    expected = nn.Linear.forward(base, x) + (lx * mask) @ lora.lora_up.weight.T * (2 / 4) / (1 - 0.25)
    assert torch.allclose(got, expected, atol=1e-6)
    lora.eval()  # no dropout outside training
    assert torch.allclose(base(x), base.__class__.forward(base, x) + lora.lora_delta(x), atol=0)


def test_module_dropout_skips_whole_module():
    base = nn.Linear(8, 6)
    lora = LoRAModule("lora_unet_x", base, dim=4, alpha=4, module_dropout=0.999999)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to()
    lora.train()
    x = torch.randn(2, 8)
    assert torch.equal(base(x), nn.Linear.forward(base, x))
    lora.eval()
    assert not torch.equal(base(x), nn.Linear.forward(base, x))


def test_parts_and_optimizer_groups(sd15):
    network = create_network(sd15, network_dim=4, network_alpha=1)
    assert network.text_encoder_modules == 12 and network.unet_modules == 48 and network.conv_modules == 0
    groups = network.prepare_optimizer_params(text_encoder_lr=5e-5, unet_lr=None, default_lr=1e-4)
    assert [g["lr"] for g in groups] == [5e-5, 1e-4]
    assert sum(len(g["params"]) for g in groups) == 2 * (12 + 48)
    assert set(map(id, groups[0]["params"])) == {id(p) for lora in network.text_encoder_loras for p in
                                                 lora.parameters()}
    groups = network.prepare_optimizer_params(text_encoder_lr=0, unet_lr=2e-4, default_lr=1e-4)
    assert [g["lr"] for g in groups] == [2e-4]  # lr 0 -> part not trained, as in sd-scripts
    assert not any(p.requires_grad for lora in network.text_encoder_loras for p in lora.parameters())
    unet_only = create_network(sd15, train_text_encoder=False)
    assert unet_only.text_encoder_modules == 0
    assert not any(k.startswith("lora_te") for k in unet_only.kohya_state_dict())
    te_only = create_network(sd15, train_unet=False)
    assert te_only.unet_modules == 0 and te_only.text_encoder_modules == 12


def test_load_accepts_int64_alpha_and_updates_scale(sd15):
    source = create_network(sd15, network_dim=4, network_alpha=1)
    _randomize_up(source)
    state = source.kohya_state_dict()
    state = {k: torch.tensor(2, dtype=torch.int64) if k.endswith(".alpha") else v for k, v in state.items()}
    target = create_network(sd15, network_dim=4, network_alpha=1)
    target.load_kohya_state_dict(state)
    assert all(lora.scale == 0.5 and lora.alpha.dtype == torch.float32 for lora in target.loras())
    for key, value in target.kohya_state_dict().items():
        if not key.endswith(".alpha"):
            assert torch.equal(value, state[key])


def test_wrong_family_is_user_error(sd15, sdxl):
    sd15_lora = create_network(sd15, network_dim=4).kohya_state_dict()
    sdxl_network = create_network(sdxl, network_dim=4)
    with pytest.raises(UserError, match="made for tiny-sd15"):
        sdxl_network.load_kohya_state_dict(sd15_lora, source="x.safetensors")
    with pytest.raises(UserError, match="x.safetensors"):
        sdxl_network.load_kohya_state_dict(sd15_lora, strict=False, source="x.safetensors")
    with pytest.raises(UserError, match="made for tiny-sd15"):
        create_network_from_weights(sdxl, sd15_lora)
    # same key scheme, other widths: full-size SD1.5 network (meta) refuses a tiny-sd15 LoRA
    sd15_full = create_network(build_modules(get_family("sd15"), device="meta"), network_dim=4)
    with pytest.raises(UserError, match="cross-attention width 32"):
        sd15_full.load_kohya_state_dict(sd15_lora)


def test_strict_load_reports_missing_keys(sd15):
    state = create_network(sd15, network_dim=4).kohya_state_dict()
    conv_network = create_network(sd15, network_dim=4, args=NetworkArgs(conv_dim=2, conv_alpha=1))
    with pytest.raises(UserError, match="missing"):
        conv_network.load_kohya_state_dict(state)
    conv_network.load_kohya_state_dict(state, strict=False)  # network_weights style: partial load is fine
    with pytest.raises(UserError, match="shape"):
        create_network(sd15, network_dim=8).load_kohya_state_dict(state)


def test_create_from_weights_reads_dims_and_alphas(sdxl):
    source = create_network(sdxl, network_dim=6, network_alpha=3,
                            args=NetworkArgs(conv_dim=2, conv_alpha=0.5))
    _randomize_up(source)
    state = source.kohya_state_dict()
    network = create_network_from_weights(sdxl, state)
    assert network.unet_modules == source.unet_modules and network.conv_modules == source.conv_modules > 0
    assert network.text_encoder_modules == 24
    loaded = network.kohya_state_dict()
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    scales = {lora.lora_name: lora.scale for lora in network.loras()}
    assert set(scales.values()) == {0.5, 0.25}
    unet_only = create_network_from_weights(sdxl, state, train_text_encoder=False)
    assert unet_only.text_encoder_modules == 0 and unet_only.unet_modules == source.unet_modules


