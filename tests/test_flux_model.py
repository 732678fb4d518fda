"""FLUX.1 model side: the family data, building (tiny with random weights, full size on meta), and the
kohya FLUX LoRA network (BFL module names, fused projections) against sd-scripts' own key lists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sd_scripts_compat.config.network_args import NetworkArgs, parse_network_args
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.network.lora import FusedLoRAModule, create_network
from sd_scripts_compat.runtimes import load_base_model

REFERENCE = Path(__file__).parent / "data" / "kohya"  # copies of shared/reference/kohya/keys_flux_*.json


def test_flux_family_facts_are_data():
    dev, schnell, tiny = get_family("flux-dev"), get_family("flux-schnell"), get_family("tiny-flux")
    for family in (dev, schnell, tiny):
        assert family.denoiser_class == "FluxTransformer2DModel" and family.is_transformer
        assert family.flow_matching and family.kohya_script == "flux_train_network.py"
        assert family.ss_base_model_version == "flux1"
        assert family.vae["latent_channels"] == 16 and family.vae["use_quant_conv"] is False
        assert family.bucket_step == 16 and family.latent_downsample == 8
        assert [te.lora_prefix for te in family.text_encoders] == ["lora_te1", "lora_te3"]
        assert [te.tokenizer_kind for te in family.text_encoders] == ["clip", "t5"]
        assert family.unet["in_channels"] == family.vae["latent_channels"] * family.latent_patch_size ** 2
    assert dev.unet["guidance_embeds"] and not schnell.unet["guidance_embeds"] and tiny.unet["guidance_embeds"]
    assert (dev.modelspec_architecture, schnell.modelspec_architecture) == ("flux-1-dev", "flux-1-schnell")
    assert (dev.t5xxl_max_token_length, schnell.t5xxl_max_token_length) == (512, 256)
    assert dev.text_encoders[1].width == 4096 and dev.text_encoders[0].width == 768
    assert not get_family("sd15").is_transformer and get_family("sd15").bucket_step == 8


def test_builtin_tiny_flux_builds_deterministically():
    first, second = load_base_model("builtin:tiny-flux"), load_base_model("builtin:tiny-flux")
    assert type(first.denoiser).__name__ == "FluxTransformer2DModel"
    assert [type(te).__name__ for te in first.text_encoders] == ["CLIPTextModel", "T5EncoderModel"]
    assert first.tokenizers[1].pad_token_id == 0 and first.tokenizers[1].eos_token_id == 1
    for a, b in zip(first.denoiser.state_dict().values(), second.denoiser.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert sum(p.numel() for p in first.denoiser.parameters()) < 1_000_000


def test_full_size_builtins_build_on_meta_and_refuse_real_weights():
    bundle = load_base_model("builtin:flux-dev", device="meta")
    params = sum(p.numel() for p in bundle.denoiser.parameters())
    assert 11.8e9 < params < 12.0e9  # FLUX.1's 11.9 B transformer
    assert sum(p.numel() for p in bundle.text_encoders[1].parameters()) > 4.7e9  # T5-XXL encoder
    assert next(bundle.denoiser.parameters()).device.type == "meta"
    with pytest.raises(UserError, match="builtin:flux-schnell is a full-size model .* shape-only probes"):
        load_base_model("builtin:flux-schnell")


@pytest.mark.parametrize(("reference", "t5", "te_modules"), [("keys_flux_dev.json", False, 72),
                                                              ("keys_flux_dev_t5.json", True, 72 + 168)])
def test_flux_lora_keys_and_shapes_equal_kohya(reference, t5, te_modules):
    expected = json.loads((REFERENCE / reference).read_text())
    bundle = load_base_model("builtin:flux-dev", device="meta")
    args = parse_network_args({"train_t5xxl": "True"} if t5 else {}, "networks.lora_flux")
    network = create_network(bundle, network_dim=16, network_alpha=8, args=args)
    state_dict = network.kohya_state_dict()
    assert set(state_dict) == set(expected)
    assert {k: [list(v.shape), str(v.dtype)] for k, v in state_dict.items()} == expected
    assert network.unet_modules == 304 and network.text_encoder_modules == te_modules
    assert sum(v.numel() for k, v in state_dict.items() if k.endswith(".weight")) == (
        79_233_024 if not t5 else 108_331_008)
    assert not any("lora" in name for name in bundle.denoiser.state_dict())


def _flux_inputs(bundle, batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    config = bundle.denoiser.config
    tokens, text = 16, 5
    return {"hidden_states": torch.randn(batch, tokens, config.in_channels, generator=gen),
            "encoder_hidden_states": torch.randn(batch, text, config.joint_attention_dim, generator=gen),
            "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=gen),
            "timestep": torch.tensor([0.3, 0.7][:batch]), "guidance": torch.full((batch,), 3.5),
            "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(text, 3)}


def _randomize(network, seed=2):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora in network.loras():
            lora.lora_up.weight.copy_(torch.randn(lora.lora_up.weight.shape, generator=gen) * 0.05)


def test_fused_lora_equals_merged_kohya_weights():
    """The split lora_up acts exactly as kohya's fused layer: merging up @ down into the diffusers Linears
    (rows cut the way BFL stacks them) gives the same transformer output."""
    bundle = load_base_model("builtin:tiny-flux")
    network = create_network(bundle, network_dim=4, network_alpha=2, train_text_encoder=False)
    _randomize(network)
    inputs = _flux_inputs(bundle)
    with torch.no_grad():
        plain = bundle.denoiser(**inputs).sample
        network.apply_to()
        with_lora = bundle.denoiser(**inputs).sample
        network.remove()
        assert torch.equal(bundle.denoiser(**inputs).sample, plain)  # remove() restores the model
        assert (with_lora - plain).abs().max() > 1e-3  # the LoRA does something
        fused = [lora for lora in network.loras() if isinstance(lora, FusedLoRAModule)]
        assert len(fused) == 2 * 2 + 2  # img/txt qkv per double block, linear1 per single block
        for lora in network.loras():
            delta = (lora.lora_up.weight @ lora.lora_down.weight) * lora.scale
            parts = lora.targets.parts if isinstance(lora, FusedLoRAModule) else (lora.base,)
            start = 0
            for part in parts:
                part.weight += delta[start:start + part.out_features]
                start += part.out_features
            assert start == delta.shape[0]
        merged = bundle.denoiser(**inputs).sample
    assert torch.allclose(merged, with_lora, atol=1e-5), (merged - with_lora).abs().max()


def test_fused_lora_trains_and_shares_one_down_projection():
    bundle = load_base_model("builtin:tiny-flux")
    network = create_network(bundle, network_dim=4, network_alpha=4, train_text_encoder=False,
                             args=NetworkArgs(rank_dropout=0.5))
    network.apply_to()
    network.train()
    calls = []
    for lora in network.loras():
        lora.lora_down.register_forward_hook(lambda module, args, out: calls.append(module))
    out = bundle.denoiser(**_flux_inputs(bundle)).sample
    out.square().mean().backward()
    # one down projection per LoRA module per forward, fused or not
    assert len(calls) == len(network.loras())
    assert all(lora.lora_down.weight.grad is not None for lora in network.loras())
    assert all(lora._shared is None for lora in network.loras() if isinstance(lora, FusedLoRAModule))
    network.remove()


def test_t5_lora_only_on_request_and_bad_value():
    bundle = load_base_model("builtin:tiny-flux")
    assert not any(k.startswith("lora_te3_") for k in create_network(bundle).kohya_state_dict())
    keys = create_network(bundle, args=NetworkArgs(train_t5xxl=True)).kohya_state_dict()
    assert sum(k.startswith("lora_te3_") and k.endswith(".alpha") for k in keys) == 2 * 7
    with pytest.raises(UserError, match="train_t5xxl='maybe' is not a valid True or False"):
        parse_network_args({"train_t5xxl": "maybe"}, "networks.lora_flux")


def test_fused_lora_gradients_equal_with_gradient_checkpointing():
    """The shared down projection survives diffusers' gradient checkpointing (the block is run twice)."""
    grads = []
    for checkpointing in (False, True):
        bundle = load_base_model("builtin:tiny-flux")
        torch.manual_seed(1)  # the same LoRA both times (loading leaves the random stream as it was)
        network = create_network(bundle, network_dim=4, network_alpha=4, train_text_encoder=False)
        _randomize(network)
        network.apply_to()
        bundle.denoiser.train()
        if checkpointing:
            bundle.denoiser.enable_gradient_checkpointing()
        bundle.denoiser(**_flux_inputs(bundle)).sample.square().mean().backward()
        grads.append([lora.lora_down.weight.grad.clone() for lora in network.loras()])
        network.remove()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))
