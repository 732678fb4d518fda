"""FLUX.1's flow-matching objective: each timestep_sampling, prediction type and weighting, packing."""

from __future__ import annotations

import math

import pytest
import torch

from sd_scripts_compat.runtimes.flow_matching import (
    FlowMatchSettings,
    apply_prediction_type,
    flow_loss,
    flow_target,
    flux_mu,
    flux_prediction,
    image_ids,
    loss_weighting,
    noisy_latents,
    pack_latents,
    sample_sigmas,
    shifted_schedule,
    unpack_latents,
)


def draw(n: int = 4096, hw: tuple[int, int] = (64, 64), **options) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return sample_sigmas(FlowMatchSettings(**options), n, hw, generator, "cpu")


def test_uniform_and_sigmoid_sampling():
    timesteps, sigmas = draw(timestep_sampling="uniform")
    assert torch.allclose(timesteps, sigmas * 1000) and 0 <= sigmas.min() and sigmas.max() < 1
    assert abs(sigmas.mean().item() - 0.5) < 0.02
    _, narrow = draw(timestep_sampling="sigmoid", sigmoid_scale=1.0)
    _, wide = draw(timestep_sampling="sigmoid", sigmoid_scale=3.0)
    assert abs(narrow.mean().item() - 0.5) < 0.02 and wide.std() > narrow.std()  # a larger scale spreads sigma


def test_shift_moves_sigmas_up_by_the_discrete_flow_shift():
    _, plain = draw(timestep_sampling="shift", discrete_flow_shift=1.0)
    _, shifted = draw(timestep_sampling="shift", discrete_flow_shift=3.0)
    expected = plain * 3.0 / (1 + 2.0 * plain)  # same draws (same generator), shifted
    assert torch.allclose(shifted, expected) and shifted.mean() > plain.mean()


def test_flux_shift_grows_with_the_image():
    _, small = draw(timestep_sampling="flux_shift", hw=(32, 32))  # 256 tokens: mu 0.5
    _, large = draw(timestep_sampling="flux_shift", hw=(128, 128))  # 4096 tokens: mu 1.15
    assert flux_mu(256) == pytest.approx(0.5) and flux_mu(4096) == pytest.approx(1.15)
    assert large.mean() > small.mean()
    _, base = draw(timestep_sampling="shift", discrete_flow_shift=1.0)
    assert torch.allclose(small, math.exp(0.5) / (math.exp(0.5) + (1 / base - 1)))


def test_sigma_sampling_reads_the_shifted_schedule():
    timesteps, table = shifted_schedule(3.0)
    assert len(table) == 1000 and table[0] == pytest.approx(1.0) and torch.allclose(timesteps, table * 1000)
    assert table[-1] == pytest.approx(3.0 * 0.001 / (1 + 2.0 * 0.001))
    ts, sigmas = draw(timestep_sampling="sigma")
    assert torch.allclose(ts, sigmas * 1000) and set(sigmas.tolist()) <= set(table.tolist())
    assert sigmas.mean() > 0.6  # shift 3 favours noisy timesteps
    _, logit = draw(timestep_sampling="sigma", weighting_scheme="logit_normal", logit_mean=2.0)
    assert logit.mean() < sigmas.mean()  # u indexes the schedule from sigma 1 down: high u, low sigma


def test_noisy_input_target_and_prediction_types():
    latents, noise = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    sigmas = torch.tensor([0.0, 1.0])
    noisy = noisy_latents(latents, noise, sigmas)
    assert torch.equal(noisy[0], latents[0]) and torch.equal(noisy[1], noise[1])
    assert torch.equal(flow_target(latents, noise), noise - latents)
    prediction = torch.randn_like(latents)
    raw, weight = apply_prediction_type(FlowMatchSettings(model_prediction_type="raw"), prediction, noisy, sigmas)
    assert raw is prediction and weight is None
    additive, _ = apply_prediction_type(FlowMatchSettings(model_prediction_type="additive"), prediction, noisy, sigmas)
    assert torch.equal(additive, prediction + noisy)
    scaled, weight = apply_prediction_type(FlowMatchSettings(), prediction, noisy, torch.tensor([0.5, 0.25]))
    assert torch.allclose(scaled[1], -0.25 * prediction[1] + noisy[1]) and torch.equal(weight, torch.ones(2))


def test_weighting_schemes_and_loss():
    sigmas = torch.tensor([0.5, 0.25])
    assert torch.allclose(loss_weighting("sigma_sqrt", sigmas), torch.tensor([4.0, 16.0]))
    assert torch.allclose(loss_weighting("cosmap", sigmas), 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2)))
    assert torch.equal(loss_weighting("none", sigmas), torch.ones(2))
    prediction, target = torch.zeros(2, 4, 2, 2), torch.ones(2, 4, 2, 2)
    loss = flow_loss(prediction, target, torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.5]))
    assert torch.allclose(loss, torch.tensor([1.0, 1.5]))


def test_packing_round_trips_and_matches_the_2x2_patch_layout():
    latents = torch.arange(2 * 16 * 4 * 6, dtype=torch.float32).reshape(2, 16, 4, 6)
    tokens = pack_latents(latents)
    assert tokens.shape == (2, 2 * 3, 64)
    # token (row 1, column 2), channel 5: the patch's 4 pixels in row-major order
    assert tokens[0, 1 * 3 + 2, 5 * 4:5 * 4 + 4].tolist() == latents[0, 5, 2:4, 4:6].flatten().tolist()
    assert torch.equal(unpack_latents(tokens, 2, 3), latents)
    ids = image_ids(2, 3)
    assert ids.shape == (6, 3) and ids[5].tolist() == [0.0, 1.0, 2.0]


def test_flux_transformer_call_with_mask_and_guidance():
    """A diffusers FLUX transformer from a tiny config: the shapes, the guidance input, the T5 mask."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    latents, t5, pooled = torch.randn(2, 16, 8, 8), torch.randn(2, 5, 32), torch.randn(2, 32)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = flux_prediction(model, latents, torch.tensor([500.0, 100.0]), t5, pooled, mask, 3.5)
    assert out.shape == latents.shape
    t5_changed = t5.clone()
    t5_changed[:, 4] += 5.0  # a padding token of sample 0, a real one of sample 1
    changed = flux_prediction(model, latents, torch.tensor([500.0, 100.0]), t5_changed, pooled, mask, 3.5)
    assert torch.allclose(changed[0], out[0], atol=1e-6) and not torch.allclose(changed[1], out[1])
    other_guidance = flux_prediction(model, latents, torch.tensor([500.0, 100.0]), t5, pooled, mask, 1.0)
    assert not torch.allclose(other_guidance, out)
