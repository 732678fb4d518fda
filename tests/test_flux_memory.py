"""The FLUX.1 memory and speed model against fake-tensor traces of the full-size transformer, and its swap rules."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from autotune.estimate.dit_memory import (
    DitMemoryInputs,
    load_dit_calibration,
    predict_dit_memory,
    transformer_bytes,
)
from autotune.estimate.dit_speed import dit_step_flops, predict_dit_speed, swap_seconds
from autotune.hardware.gpu_catalog import load_catalog, lookup_gpu
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family

GIB = 2**30
TINY = dict(patch_size=1, in_channels=64, num_layers=4, num_single_layers=6, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
            axes_dims_rope=[4, 6, 6])


def _inputs(cfg: dict) -> DitMemoryInputs:
    return DitMemoryInputs(resolution=cfg["resolution"], batch_size=cfg["batch_size"], rank=cfg["rank"],
                            gradient_checkpointing=cfg["gradient_checkpointing"], optimizer=cfg["optimizer"],
                            fp8_base=cfg["fp8_base"], blocks_to_swap=cfg["blocks_to_swap"])


def test_model_matches_full_size_traces_the_fit_did_not_use() -> None:
    cal = load_dit_calibration()
    held_out = [t for t in cal["traces"] if not t["used_for_fit"]]
    configs = [t["config"] for t in held_out]
    assert len(held_out) >= 6
    assert {c["resolution"] for c in configs} >= {512, 1024} and {c["batch_size"] for c in configs} >= {1, 2}
    assert {c["gradient_checkpointing"] for c in configs} == {True, False}
    assert {c["fp8_base"] for c in configs} == {True, False}
    assert len({c["blocks_to_swap"] for c in configs}) >= 4
    for trace in held_out:
        ratio = predict_dit_memory(_inputs(trace["config"])).tensor_peak_bytes / trace["peak_bytes"]
        assert 0.98 <= ratio <= 1.10, (trace["config"], ratio)


def test_swap_split_is_sd_scripts_rule() -> None:
    # Flux.enable_block_swap: n // 2 double blocks, (n - n // 2) * 2 single blocks (the family data's rule)
    flux = get_family("flux-dev")
    assert [flux.swap_split(n) for n in (0, 1, 16, 22, 28, 35)] == [(0, 0), (0, 2), (8, 16), (11, 22), (14, 28),
                                                                    (17, 36)]
    assert flux.max_blocks_to_swap == 35
    with pytest.raises(UserError, match="at most 35"):
        flux.swap_split(36)


def test_swapped_weights_leave_the_gpu_and_land_in_host_ram() -> None:
    arch = load_dit_calibration()["architecture"]
    none = predict_dit_memory(DitMemoryInputs(resolution=1024, blocks_to_swap=0))
    some = predict_dit_memory(DitMemoryInputs(resolution=1024, blocks_to_swap=16))
    _, host = transformer_bytes(arch, True, get_family("flux-dev").swap_split(16))
    assert none.components["weights_transformer"] - some.components["weights_transformer"] == host
    assert some.swapped_bytes == host and some.host_ram_bytes - none.host_ram_bytes == host
    assert some.components["activations"] == none.components["activations"]
    # our engine's swapper: a swapped block in flight plus one prefetched (sd-scripts reuses storage: 0)
    assert none.components["swap_buffers"] == 0
    double = arch["block_groups"][0]
    assert some.components["swap_buffers"] == 2 * (2 * double["swap_elements"] - double["fp8_elements"])
    assert some.training_peak_bytes > some.tensor_peak_bytes + some.components["swap_buffers"]


def test_fp8_t5_is_what_lets_a_small_card_cache_text_encoder_outputs() -> None:
    bf16 = predict_dit_memory(DitMemoryInputs(resolution=512, blocks_to_swap=35))
    fp8 = predict_dit_memory(DitMemoryInputs(resolution=512, blocks_to_swap=35, t5_fp8=True))
    assert bf16.caching_peak / GIB > 10 > 8 > fp8.caching_peak / GIB
    assert bf16.peak_bytes == bf16.caching_peak and any("caching" in n for n in bf16.notes)


def test_swap_costs_nothing_until_the_link_is_the_bottleneck() -> None:
    gpu = lookup_gpu("RTX 4090")
    base = DitMemoryInputs(resolution=1024, gradient_checkpointing=True)
    assert predict_dit_speed(base, gpu).it_per_s == predict_dit_speed(replace(base, blocks_to_swap=8), gpu).it_per_s
    small = replace(base, resolution=256, blocks_to_swap=35)
    assert swap_seconds(small, gpu) > dit_step_flops(small)["total"] / 165e12
    assert predict_dit_speed(small, gpu).seconds_per_step == pytest.approx(swap_seconds(small, gpu))
    slow = lookup_gpu("RTX 4060 Ti 16GB")  # PCIe 4.0 x8: half a 4090's link
    assert swap_seconds(small, slow) == pytest.approx(2 * swap_seconds(small, gpu))


def test_every_catalogue_card_has_its_host_link() -> None:
    assert all(card.pcie_gbps in (15.75, 31.5, 63.0) for card in load_catalog())


def test_flops_count_matches_torch_counter_on_a_tiny_flux() -> None:
    """The analytic FLOP count against torch's FlopCounterMode on a tiny FLUX forward on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from autotune.calibration.dit_memtrace import build_bundle, dit_architecture_facts, trace_family

    arch = dit_architecture_facts(config=TINY)
    arch["text_tokens"] = 8
    cal = {**load_dit_calibration(), "architecture": arch}
    model = build_bundle(trace_family(config=TINY), dtype=torch.float32).unet
    tokens = get_family("flux-dev").image_tokens(128)
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        model(hidden_states=torch.empty(1, tokens, 64), encoder_hidden_states=torch.empty(1, 8, 32),
              pooled_projections=torch.empty(1, 16), timestep=torch.ones(1), img_ids=torch.zeros(tokens, 3),
              txt_ids=torch.zeros(8, 3), guidance=torch.ones(1))
    predicted = dit_step_flops(DitMemoryInputs(resolution=128, batch_size=1), cal)["forward"]
    # the counter also sees the embedders, modulation and output Linears the model leaves out as negligible
    # at full size; on this tiny model they are a few percent
    assert 0.85 <= predicted / counter.get_total_flops() <= 1.0


def test_tiny_trace_drops_exactly_the_swapped_weights() -> None:
    """A real fake-tensor trace: swapping moves only the swapped blocks' .weight storages off the GPU."""
    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_dit_step

    arch = dit_architecture_facts(config=TINY)
    results = {}
    for swap in (0, 4):
        results[swap] = trace_dit_step(resolution=128, rank=4, blocks_to_swap=swap, fp8_base=True,
                                       optimizer="AdamW", config=TINY, text_tokens=8)
    _, host = transformer_bytes(arch, True, get_family("flux-dev").swap_split(4))
    assert results[4].swapped_weight_bytes == host > 0
    assert results[0].peak_bytes - results[4].peak_bytes == host
    assert results[0].activations_peak_bytes == results[4].activations_peak_bytes
    assert get_family("flux-dev").t5xxl_max_token_length == 512  # the keyword did not change the family's


def test_fake_trace_matches_a_real_cpu_step_on_a_tiny_flux() -> None:
    """The tracer's fake-tensor figure against the same step on real CPU tensors (random weights)."""
    from autotune.calibration.dit_memtrace import trace_dit_step

    kwargs = dict(resolution=128, rank=4, blocks_to_swap=2, fp8_base=False, optimizer="AdamW", config=TINY,
                  text_tokens=8)
    fake, real = trace_dit_step(**kwargs), trace_dit_step(**kwargs, fake=False)
    assert real.weights_bytes == fake.weights_bytes and real.lora_params == fake.lora_params
    assert abs(real.peak_bytes - fake.peak_bytes) <= 0.02 * fake.peak_bytes


def test_lora_shapes_are_kohyas_flux_keys() -> None:
    """The modelled LoRA modules are exactly sd-scripts' lora_flux ones (reference key list, rank 16)."""
    import json
    from collections import Counter
    from pathlib import Path

    from autotune.estimate.dit_memory import lora_sizes

    keys = Path(__file__).resolve().parent / "data" / "kohya" / "keys_flux_dev.json"
    if not keys.is_file():
        pytest.skip("reference key list not here")
    table = json.loads(keys.read_text(encoding="utf-8"))
    kohya = Counter()
    for key, (shape, _dtype) in table.items():
        if key.startswith("lora_unet_") and key.endswith(".lora_down.weight"):
            up = table[key.replace("lora_down", "lora_up")][0]
            kohya[f"{shape[1]}x{up[0]}"] += 1
    arch = load_dit_calibration()["architecture"]
    assert dict(kohya) == arch["lora_modules"]
    unet_params = sum(math.prod(s) for k, (s, _) in table.items() if k.startswith("lora_unet_") and "alpha" not in k)
    assert sum(n * c for n, c in lora_sizes(arch, 16)) == unet_params


def test_the_tracer_traces_the_engines_own_lora_network_and_the_facts_count_it() -> None:
    """The tracer applies the engine's kohya FLUX network (``network.lora``: fused qkv / linear1 as one module);
    its traced parameters are exactly what the architecture facts (and so the memory model) count."""
    from autotune.calibration.dit_memtrace import dit_architecture_facts, trace_dit_step
    from autotune.estimate.dit_memory import lora_sizes

    arch = dit_architecture_facts("tiny-flux")
    traced = trace_dit_step("tiny-flux", resolution=128, rank=4, blocks_to_swap=2, fp8_base=True,
                            optimizer="AdamW", text_tokens=8)
    assert traced.lora_params == sum(n * c for n, c in lora_sizes(arch, 4)) > 0
    assert traced.lora_param_bytes == 4 * traced.lora_params  # fp32, as kohya trains it
    assert sum(arch["lora_modules"].values()) == 2 * 10 + 2 * 3  # per double block 10 modules, per single 3
