"""Interop: a LoRA we train and save loads in diffusers' own ``load_lora_weights`` with every key used,
and the diffusers-loaded LoRA changes UNet and text-encoder outputs exactly as our network does.

Tolerance: max |ours - diffusers| <= 1e-5 absolute (measured here: 0.0 in all three cases; up to ~1e-6 with
LoCon in ad-hoc runs with other inputs; the LoRA's own effect on the outputs is > 1e-2, so the check means something).
"""

from __future__ import annotations

import pytest
import torch
from fixtures.diffusers_load import load_lora_complaints

from sd_scripts_compat.config.network_args import NetworkArgs
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from sd_scripts_compat.network.lora_file import read_lora_file, save_lora_file

ATOL = 1e-5


def _encode(bundle, ids):
    """UNet conditioning the way each family uses it (SDXL: penultimate states of both encoders)."""
    if not bundle.family.is_sdxl:
        return bundle.text_encoders[0](ids).last_hidden_state, {}
    first = bundle.text_encoders[0](ids, output_hidden_states=True)
    second = bundle.text_encoders[1](ids, output_hidden_states=True)
    context = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
    size = float(bundle.family.resolution)
    time_ids = torch.tensor([[size, size, 0.0, 0.0, size, size]]).repeat(ids.shape[0], 1)
    return context, {"added_cond_kwargs": {"text_embeds": second.text_embeds, "time_ids": time_ids}}


def _outputs(bundle, ids, latents, timesteps):
    with torch.no_grad():
        context, extra = _encode(bundle, ids)
        return context, bundle.unet(latents, timesteps, context, **extra).sample


def _pipeline(bundle):
    from diffusers import DDPMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    scheduler = DDPMScheduler.from_config(bundle.scheduler_config)
    if bundle.family.is_sdxl:
        return StableDiffusionXLPipeline(vae=bundle.vae, text_encoder=bundle.text_encoders[0],
                                         text_encoder_2=bundle.text_encoders[1], tokenizer=bundle.tokenizers[0],
                                         tokenizer_2=bundle.tokenizers[1], unet=bundle.unet, scheduler=scheduler)
    return StableDiffusionPipeline(vae=bundle.vae, text_encoder=bundle.text_encoders[0],
                                   tokenizer=bundle.tokenizers[0], unet=bundle.unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


@pytest.mark.parametrize(("family", "conv_dim"), [("tiny-sd15", None), ("tiny-sd15", 2), ("tiny-sdxl", 2)])
def test_diffusers_load_lora_weights_matches_our_network(tmp_path, family, conv_dim):
    from peft.tuners.lora import LoraLayer

    bundle = build_modules(get_family(family), seed=0)
    torch.manual_seed(0)
    network = create_network(bundle, network_dim=4, network_alpha=2,
                             args=NetworkArgs(conv_dim=conv_dim, conv_alpha=1))
    network.apply_to()
    optimizer = torch.optim.AdamW(network.prepare_optimizer_params(None, None, 1e-2))
    ids = bundle.tokenizers[0](["a photo of sks dog", "grass"], padding="max_length", max_length=77,
                               return_tensors="pt").input_ids
    network.train()
    for _ in range(3):  # a few real steps: random latents, noise prediction, MSE
        latents = torch.randn(2, 4, 8, 8)
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, 1000, (2,))
        context, extra = _encode(bundle, ids)
        prediction = bundle.unet(latents + noise, timesteps, context, **extra).sample
        loss = torch.nn.functional.mse_loss(prediction, noise)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    network.eval()
    trained = network.kohya_state_dict()
    ups = {k: v for k, v in trained.items() if k.endswith("lora_up.weight")}
    assert all(torch.count_nonzero(v) > 0 for k, v in ups.items() if k.startswith("lora_unet_"))
    # SDXL conditions on the penultimate layer, so the last text-encoder layer gets no gradient (as in kohya)
    for te in bundle.family.text_encoders:
        assert any(torch.count_nonzero(v) > 0 for k, v in ups.items() if k.startswith(te.lora_prefix + "_"))

    path = tmp_path / "trained.safetensors"
    save_lora_file(path, trained, {"ss_network_module": "networks.lora"})
    reloaded, _ = read_lora_file(path)
    assert set(reloaded) == set(trained) and all(torch.equal(reloaded[k], trained[k]) for k in trained)

    generator = torch.Generator().manual_seed(7)
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([50, 800])
    ours_context, ours_unet = _outputs(bundle, ids, latents, timesteps)
    network.remove()
    base_context, base_unet = _outputs(bundle, ids, latents, timesteps)
    assert (ours_unet - base_unet).abs().max() > 1e-2 and (ours_context - base_context).abs().max() > 1e-2

    pipe = _pipeline(bundle)
    complaints = load_lora_complaints(pipe, path)
    assert complaints == []
    unet_layers = sum(isinstance(m, LoraLayer) for m in bundle.unet.modules())
    te_layers = sum(isinstance(m, LoraLayer) for te in bundle.text_encoders for m in te.modules())
    assert (unet_layers, te_layers) == (network.unet_modules, network.text_encoder_modules)

    diffusers_context, diffusers_unet = _outputs(bundle, ids, latents, timesteps)
    context_error = (diffusers_context - ours_context).abs().max().item()
    unet_error = (diffusers_unet - ours_unet).abs().max().item()
    print(f"{family} conv_dim={conv_dim}: max |ours - diffusers| text encoder {context_error:.2e}, "
          f"UNet {unet_error:.2e}")
    assert context_error <= ATOL and unet_error <= ATOL
