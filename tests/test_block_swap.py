"""blocks_to_swap on CPU: the swap really happens (copies counted, weights at rest on the host) and
training with it gives bit-identical LoRA weights, with and without gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family, swap_split
from sd_scripts_compat.network.lora import LoRAModule
from sd_scripts_compat.runtimes.flow_matching import flux_prediction
from sd_scripts_compat.training.block_swap import enable_flux_block_swap, place_except_swapped
from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(in_channels=64, num_layers=4, num_single_layers=6, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    model.requires_grad_(False)
    return model


def add_lora(model) -> list[LoRAModule]:
    torch.manual_seed(1)
    loras = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "blocks" in name:
            lora = LoRAModule(name, module, dim=4, alpha=4)
            torch.nn.init.normal_(lora.lora_up.weight, std=0.01)  # non-zero, so every weight gets a gradient
            lora.apply_to()
            loras.append(lora)
    return loras


def train(blocks_to_swap: int, checkpointing: bool, steps: int = 3, fp8: bool = False):
    model = tiny_flux()
    if fp8:
        store_frozen_weights_in_fp8(model, torch.float32)
    swap = enable_flux_block_swap(model, blocks_to_swap, "cpu")
    place_except_swapped(model, swap, "cpu", torch.float32)
    if checkpointing:
        model.enable_gradient_checkpointing()
    loras = add_lora(model)
    params = [p for lora in loras for p in lora.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        latents = torch.randn(2, 16, 8, 8, generator=generator)
        t5, pooled = torch.randn(2, 5, 32, generator=generator), torch.randn(2, 32, generator=generator)
        prediction = flux_prediction(model, latents, torch.tensor([700.0, 200.0]), t5, pooled, None, 3.5)
        loss = torch.nn.functional.mse_loss(prediction, torch.zeros_like(prediction))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], swap, model


def test_swap_counts_follow_sd_scripts_and_limit_the_blocks():
    assert get_family("flux-dev").swap_split(35) == (17, 36)  # FLUX.1's most (two of each list stay resident)
    assert get_family("flux-dev").swap_split(18) == (9, 18)
    assert get_family("tiny-flux").swap_split(1) == (0, 2)
    with pytest.raises(UserError, match="at most 35"):
        get_family("flux-dev").swap_split(36)
    assert swap_split(38, 19, 38) == (19, 38)  # without the family's resident blocks (a bare test model)
    with pytest.raises(UserError, match="at most 6"):
        swap_split(7, 4, 6)  # the tiny test model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_block_swap_gives_bit_identical_lora_weights(checkpointing):
    plain, none, _ = train(0, checkpointing)
    swapped, swap, model = train(4, checkpointing)
    assert none is None
    assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
    assert sorted(swap.slots) == [2, 3, 6, 7, 8, 9]  # the last 2 double and the last 4 single blocks
    # every swapped block came in for each forward and again for each backward: 3 steps x 6 blocks x 2
    assert swap.stats.blocks_in == 3 * 6 * 2 and swap.stats.backward_swaps == 3 * 6
    assert swap.resident_blocks() == []  # at rest on the host after the step
    slot = swap.slots[9]
    assert all(p.data_ptr() == m.data_ptr() for p, m in zip(slot.params, slot.masters))


def test_backward_reads_the_weights_from_the_fresh_copy():
    """Without checkpointing the saved weights are references, so backward fails if a block is not back."""
    model = tiny_flux()
    swap = enable_flux_block_swap(model, 2, "cpu")
    loras = add_lora(model)
    latents, t5, pooled = torch.randn(1, 16, 4, 4), torch.randn(1, 3, 32), torch.randn(1, 32)
    prediction = flux_prediction(model, latents, torch.tensor([500.0]), t5, pooled, None, 3.5)
    assert swap.resident_blocks() == []
    swap.before_backward_of = lambda slot: None  # break the backward swap-in
    with pytest.raises(RuntimeError, match="not on the device for its backward"):
        prediction.sum().backward()
    assert loras


def test_block_swap_with_fp8_weights_and_no_grad():
    plain, _, _ = train(0, False, steps=2, fp8=True)
    swapped, swap, model = train(4, False, steps=2, fp8=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
    assert any(m.dtype == torch.float8_e4m3fn for m in swap.slots[2].masters)  # fp8 at rest: half the copy
    before = swap.stats.blocks_in
    with torch.no_grad():
        flux_prediction(model, torch.randn(1, 16, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 32),
                        torch.randn(1, 32), None, 3.5)
    assert swap.stats.blocks_in - before == 6 and swap.resident_blocks() == []
