"""fp8 base-weight storage: float8 weights, the same gradients for the trainable parts, less memory kept."""

from __future__ import annotations

import pytest
import torch

from sd_scripts_compat.training.precision import fp8_supported, store_frozen_weights_in_fp8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Flatten(1),
                                torch.nn.Linear(8 * 6 * 6, 16))
    model.requires_grad_(False)
    return model


def test_fp8_storage_matches_an_fp8_rounded_reference_in_forward_and_backward():
    model = _model()
    reference = _model()
    for layer in reference:  # the reference: fp8-rounded weights held in fp32, plain layers
        if hasattr(layer, "weight"):
            layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn).to(torch.float32)
    assert store_frozen_weights_in_fp8(model, torch.float32) == 2
    assert model[0].weight.dtype == torch.float8_e4m3fn and model[2].weight.dtype == torch.float8_e4m3fn
    x1 = torch.randn(2, 4, 6, 6, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    out, expected = model(x1), reference(x2)
    assert torch.allclose(out, expected, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-4)


def test_fp8_layers_keep_only_the_one_byte_weight_for_backward():
    model = _model()
    store_frozen_weights_in_fp8(model, torch.float32)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(torch.randn(2, 4, 6, 6, requires_grad=True)).sum().backward()
    weights = [t for t in saved if t.dim() >= 2 and t.shape[0] in (8, 16) and t.shape != (2, 288)]
    assert weights and all(t.dtype == torch.float8_e4m3fn for t in weights)


@pytest.mark.parametrize(("capability", "supported"), [((7, 5), False), ((8, 0), True), ((8, 6), True),
                                                        ((8, 9), True), ((9, 0), True)])
def test_fp8_storage_is_taken_on_the_cards_the_planner_plans_it_for(monkeypatch, capability, supported):
    """An RTX 3060 (8.6) is planned fp8_base for FLUX.1 (the family's profile: 8.0, as sd-scripts runs it there):
    the engine takes it on such a card too. (The card's capability is faked: no GPU here.)"""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fp8_supported(torch.device("cuda", 0)) is supported
    assert fp8_supported("cpu")
