"""The fake-tensor tracer: its peak matches a real CPU run, and its optimizer / dtype accounting."""

from __future__ import annotations

import pytest

from autotune.calibration.memtrace import (
    LiveBytesCounter,
    architecture_facts,
    optimizer_state_shapes,
    trace_training_step,
)


@pytest.mark.parametrize(("weight_dtype", "gc", "optimizer"), [
    ("fp32", False, "AdamW"),
    pytest.param("bf16", True, "AdamW", marks=pytest.mark.slow),
    pytest.param("fp32", False, "Adafactor", marks=pytest.mark.slow),
])
def test_fake_peak_matches_real_cpu_run(weight_dtype: str, gc: bool, optimizer: str) -> None:
    """The same step on real tensors, counted by the same counter, peaks at the same bytes."""
    common = dict(resolution=64, batch_size=2, rank=4, gradient_checkpointing=gc, optimizer=optimizer,
                  weight_dtype=weight_dtype, train_text_encoder=True, cache_text_encoder_outputs=False)
    fake = trace_training_step("tiny-sd15", fake=True, **common)
    real = trace_training_step("tiny-sd15", fake=False, **common)
    assert real.peak_bytes > real.weights_bytes > 0
    assert fake.weights_bytes == real.weights_bytes
    assert fake.optimizer_state_bytes == real.optimizer_state_bytes
    assert fake.peak_bytes == pytest.approx(real.peak_bytes, rel=0.01)
    assert fake.peak_phase == real.peak_phase


def test_counter_counts_views_once_and_releases() -> None:
    import torch

    counter = LiveBytesCounter()
    with counter.mode():
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:20]
        b = a * 2
        assert counter.current == 8000
        del b
        assert counter.current == 4000
        del view, a
    assert counter.current == 0
    assert counter.peak == 8000


@pytest.mark.slow
def test_breakdown_and_optimizer_state() -> None:
    """Persistent parts are exact; 8-bit AdamW keeps ~1/4 of AdamW's state, Lion half, Prodigy twice."""
    runs = {opt: trace_training_step("tiny-sdxl", resolution=64, batch_size=1, rank=8, gradient_checkpointing=True,
                                     optimizer=opt) for opt in ("AdamW", "AdamW8bit", "Lion", "Prodigy")}
    adamw = runs["AdamW"]
    assert adamw.lora_param_bytes == 4 * adamw.lora_params
    assert adamw.lora_grad_bytes == adamw.lora_param_bytes
    assert not adamw.optimizer_state_simulated and runs["AdamW8bit"].optimizer_state_simulated
    assert adamw.optimizer_state_bytes >= 2 * adamw.lora_param_bytes
    assert runs["Lion"].optimizer_state_bytes == adamw.lora_param_bytes
    assert runs["Prodigy"].optimizer_state_bytes == 4 * adamw.lora_param_bytes
    assert runs["AdamW8bit"].optimizer_state_bytes < adamw.optimizer_state_bytes
    for run in runs.values():
        persistent = run.weights_bytes + run.lora_param_bytes + run.lora_grad_bytes + run.optimizer_state_bytes
        assert run.activations_peak_bytes == run.peak_bytes - persistent > 0


def test_8bit_state_layout_follows_bitsandbytes_threshold() -> None:
    import torch

    small = optimizer_state_shapes("AdamW8bit", [(8, 64)])  # 512 elements: 32-bit state
    assert [dtype for _, dtype in small] == [torch.float32, torch.float32]
    big = optimizer_state_shapes("AdamW8bit", [(16, 320)])  # 5120 elements: two uint8 states + absmax
    assert [dtype for _, dtype in big] == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    assert big[2][0] == (20,)


def test_caching_and_fp8_change_resident_weights() -> None:
    base = dict(resolution=64, batch_size=1, rank=4, gradient_checkpointing=False)
    cached = trace_training_step("tiny-sd15", **base)
    uncached = trace_training_step("tiny-sd15", cache_latents=False, cache_text_encoder_outputs=False, **base)
    fp8 = trace_training_step("tiny-sd15", weight_dtype="fp8", **base)
    assert uncached.weights_bytes > cached.weights_bytes
    assert "vae_encode" in uncached.phase_peaks and "vae_encode" not in cached.phase_peaks
    assert fp8.weights_bytes < cached.weights_bytes


def test_architecture_facts_lora_counts_match_the_network() -> None:
    """Per-rank module shapes in the facts give exactly the network's parameter count."""
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import create_network

    facts = architecture_facts("tiny-sdxl")
    rank = 8
    counted = 0
    for part in facts["lora_modules"].values():
        for shape, count in part["linear"].items():
            fan_in, fan_out = (int(x) for x in shape.split("x"))
            counted += rank * (fan_in + fan_out) * count
    bundle = build_modules(get_family("tiny-sdxl"), device="meta", seed=None)
    network = create_network(bundle, network_dim=rank, network_alpha=rank)
    assert counted == sum(p.numel() for p in network.parameters())
    assert facts["attn_self_scores_per_pixel2"] > 0 and facts["attn_cross_scores_per_pixel"] > 0
