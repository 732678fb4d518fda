"""The analytic memory model: monotonic, components add up, exact LoRA counts, calibrated against a fresh trace."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.estimate.memory_model import MemoryInputs, canonical_optimizer, predict_memory
from sd_scripts_compat.facts.errors import UserError

KOHYA = Path(__file__).parent / "data" / "kohya"  # copies of shared/reference/kohya/keys_*.json
BASE = MemoryInputs(family="sd15", resolution=512, batch_size=2, rank=16, gradient_checkpointing=False,
                    optimizer="AdamW")


def tensor_peak(**changes: object) -> int:
    return predict_memory(replace(BASE, **changes)).tensor_peak_bytes


@pytest.mark.parametrize("family", ["sd15", "sd2", "sd2-v", "sdxl"])
def test_more_batch_resolution_rank_need_more_memory(family: str) -> None:
    base = replace(BASE, family=family)
    for field, values in (("batch_size", (1, 2, 4, 8)), ("resolution", (256, 512, 768, 1024)),
                          ("rank", (4, 16, 64, 128))):
        peaks = [predict_memory(replace(base, **{field: v})).tensor_peak_bytes for v in values]
        assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks), (family, field, peaks)


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_checkpointing_and_8bit_and_caching_save_memory(family: str) -> None:
    base = replace(BASE, family=family, resolution=1024 if family == "sdxl" else 512)
    on = predict_memory(replace(base, gradient_checkpointing=True))
    off = predict_memory(replace(base, gradient_checkpointing=False))
    assert on.components["activations"] < off.components["activations"]
    state = {opt: predict_memory(replace(base, optimizer=opt)).components["optimizer_state"]
             for opt in ("AdamW", "AdamW8bit", "Lion", "Prodigy", "Adafactor")}
    assert state["AdamW8bit"] < state["Lion"] < state["AdamW"] < state["Prodigy"]
    assert state["Adafactor"] < state["AdamW8bit"]
    assert state["AdamW8bit"] == pytest.approx(state["AdamW"] / 4, rel=0.05)
    cached = predict_memory(replace(base, cache_latents=True, cache_text_encoder_outputs=True))
    assert cached.components["weights_text_encoders"] == 0 and cached.components["weights_vae"] == 0
    resident = predict_memory(replace(base, cache_latents=False, cache_text_encoder_outputs=False))
    assert resident.components["weights_text_encoders"] > 0 and resident.components["weights_vae"] > 0
    trained = predict_memory(replace(base, train_text_encoder=True))
    assert trained.components["weights_text_encoders"] > 0
    assert trained.lora_params > cached.lora_params
    fp8 = predict_memory(replace(base, weight_dtype="fp8"))
    fp16 = predict_memory(replace(base, weight_dtype="fp16"))
    fp32 = predict_memory(replace(base, weight_dtype="fp32"))
    assert fp8.components["weights_unet"] < fp16.components["weights_unet"] < fp32.components["weights_unet"]
    assert fp32.components["activations"] > fp16.components["activations"]
    math = predict_memory(replace(base, attention="math", gradient_checkpointing=False))
    assert math.components["activations"] > off.components["activations"]


def test_components_sum_to_total() -> None:
    estimate = predict_memory(replace(BASE, family="sdxl", resolution=1024, train_text_encoder=True,
                                         cache_latents=False, cache_text_encoder_outputs=False))
    parts = estimate.components
    assert sum(parts.values()) == estimate.total_bytes
    assert estimate.total_bytes == estimate.peak_bytes + parts["safety_margin"]
    assert estimate.peak_bytes == estimate.tensor_peak_bytes + parts["cuda_context"] + parts["allocator_overhead"]
    assert all(v >= 0 for v in parts.values())
    assert len(estimate.explain()) >= len(parts)


@pytest.mark.parametrize(("keys_file", "family", "conv_dim"), [("keys_sd15.json", "sd15", None),
                                                                ("keys_sdxl.json", "sdxl", None),
                                                                ("keys_sd15_conv.json", "sd15", 4)])
def test_lora_param_count_matches_kohya_reference(keys_file: str, family: str, conv_dim: int | None) -> None:
    """kohya's own network at dim 16 (TE + UNet): the count the model derives from shapes must equal it."""
    path = KOHYA / keys_file
    if not path.is_file():
        pytest.skip(f"{path} not present")
    keys = json.loads(path.read_text())
    expected = sum(_numel(shape) for key, (shape, _dtype) in keys.items() if not key.endswith(".alpha"))
    estimate = predict_memory(replace(BASE, family=family, rank=16, conv_dim=conv_dim, train_text_encoder=True))
    assert estimate.lora_params == expected
    assert estimate.components["lora_params"] == 4 * expected == estimate.components["lora_grads"]


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_bad_input_is_a_user_error() -> None:
    with pytest.raises(UserError, match="optimizer"):
        predict_memory(replace(BASE, optimizer="SGDNesterov"))
    with pytest.raises(UserError, match="family"):
        predict_memory(replace(BASE, family="sd3"))
    assert canonical_optimizer("pagedadamw8bit") == "AdamW8bit"
    assert predict_memory(replace(BASE, optimizer="adamw8bit")).components["optimizer_state"] == \
        predict_memory(replace(BASE, optimizer="AdamW8bit")).components["optimizer_state"]


@pytest.mark.slow
@pytest.mark.parametrize("gc", [False, True])
def test_prediction_matches_fresh_small_trace(gc: bool) -> None:
    """SD1.5 at 384 px (a resolution the calibration never traced): analytic within 10 % of a fresh trace."""
    from autotune.calibration.memtrace import trace_training_step

    trace = trace_training_step("sd15", resolution=384, batch_size=1, rank=16, gradient_checkpointing=gc,
                                optimizer="AdamW", weight_dtype="fp16")
    estimate = predict_memory(MemoryInputs(family="sd15", resolution=384, batch_size=1, rank=16,
                                           gradient_checkpointing=gc, optimizer="AdamW"))
    assert estimate.components["weights_unet"] == trace.weights_bytes
    assert estimate.components["optimizer_state"] == trace.optimizer_state_bytes
    assert estimate.tensor_peak_bytes == pytest.approx(trace.peak_bytes, rel=0.10)


@pytest.mark.parametrize("family", ["tiny-sd15", "tiny-sdxl"])
def test_tiny_families_are_calibrated_from_their_own_traces(family: str) -> None:
    """Own coefficients (fp16 and fp32), the tiny VAE's 8x downsampling (the real families'), FLOP fits:
    nothing borrowed from the full-size twin for the activations."""
    from autotune.estimate.memory_model import family_calibration, load_calibration

    cal = family_calibration(family)
    assert cal["architecture"]["latent_downsample"] == 8
    assert set(cal["activations"]) == set(cal["activations_fp32"]) == {"gc", "no_gc"}
    assert not any(b.startswith("activations") for b in cal["borrowed"])
    assert load_calibration()["flops"][family]["latent_downsample"] == 8
    tiny = MemoryInputs(family=family, resolution=256, batch_size=1, rank=8, optimizer="AdamW", weight_dtype="fp32")
    peaks = [predict_memory(replace(tiny, resolution=r)).tensor_peak_bytes for r in (64, 128, 256, 384, 512)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 5
    with pytest.raises(UserError, match="resolution must be >= 64 px"):
        predict_memory(replace(tiny, resolution=32))
    from autotune.calibration.flops import count_flops
    from autotune.estimate.speed_model import step_flops

    counted = count_flops(family, 192, gradient_checkpointing=True)  # 192 px: between the counted 128/256/512
    shipped = step_flops(replace(tiny, resolution=192, gradient_checkpointing=True))
    assert shipped.unet_forward == pytest.approx(counted["forward"], rel=0.01)
    assert shipped.unet_backward == pytest.approx(counted["backward"], rel=0.01)


@pytest.mark.parametrize(("family", "gc", "weight_dtype"), [("tiny-sd15", False, "fp32"),
                                                             ("tiny-sdxl", True, "bf16")])
def test_tiny_prediction_matches_fresh_trace(family: str, gc: bool, weight_dtype: str) -> None:
    """192 px, batch 3, rank 16 (no fit trace has any of these): analytic within 10 % of a fresh trace."""
    from autotune.calibration.memtrace import trace_training_step

    trace = trace_training_step(family, resolution=192, batch_size=3, rank=16, gradient_checkpointing=gc,
                                optimizer="AdamW", weight_dtype=weight_dtype)
    estimate = predict_memory(MemoryInputs(family=family, resolution=192, batch_size=3, rank=16,
                                           gradient_checkpointing=gc, optimizer="AdamW",
                                           weight_dtype=weight_dtype))
    assert estimate.components["weights_unet"] == trace.weights_bytes
    assert estimate.components["optimizer_state"] == trace.optimizer_state_bytes
    assert estimate.tensor_peak_bytes == pytest.approx(trace.peak_bytes, rel=0.10)


FIT_CONFIGS = Path(__file__).resolve().parents[1] / "autotune" / "data" / "memory_fit_configs.json"
UNDER_BOUND = 0.02  # no configuration off the fit points may be under-predicted by more than 2 % (tensor peak)


def _check_inputs(family: str, row: dict[str, object]) -> tuple[MemoryInputs, dict[str, object]]:
    """A check row of memory_fit_configs.json as the model's inputs and the tracer's keyword arguments."""
    settings = {"optimizer": "AdamW", "weight_dtype": "fp16", "train_text_encoder": False, "cache_latents": True,
                "cache_text_encoder_outputs": True, **{k: v for k, v in row.items() if k != "gc"}}
    inputs = MemoryInputs(family=family, gradient_checkpointing=bool(row["gc"]), **settings)
    return inputs, {"gradient_checkpointing": bool(row["gc"]), **settings}


def test_check_rows_are_not_fit_rows_and_cover_the_range() -> None:
    """The check set is disjoint from the fit set and spans what the issue names: 512-1024 px, batch 1-8,
    rank 8-128, checkpointing on/off, fp16/bf16, trained text encoders, uncached text-encoder outputs."""
    data = json.loads(FIT_CONFIGS.read_text())["families"]
    for family in ("sd15", "sdxl"):
        fit = {json.dumps(r, sort_keys=True) for r in data[family]["fit"]}
        check = data[family]["check"]
        assert not fit & {json.dumps(r, sort_keys=True) for r in check}
    rows = data["sdxl"]["check"] + data["sd15"]["check"]
    assert {512, 768, 1024} <= {r["resolution"] for r in rows}
    assert {1, 2, 4, 8} <= {r["batch_size"] for r in rows}
    assert min(r["rank"] for r in rows) <= 8 and max(r["rank"] for r in rows) == 128
    assert {True, False} == {r["gc"] for r in rows}
    assert {"bf16"} <= {r.get("weight_dtype", "fp16") for r in rows}
    assert any(r.get("train_text_encoder") for r in rows)
    assert any(r.get("cache_text_encoder_outputs") is False and not r.get("train_text_encoder") for r in rows)


def test_shipped_check_traces_are_never_under_predicted() -> None:
    """Every check trace stored with the calibration (traced, never fitted): at most 2 % low, at most 5 % high."""
    from autotune.estimate.memory_model import load_calibration

    data = json.loads(FIT_CONFIGS.read_text())["families"]
    stored = {json.dumps(t["config"], sort_keys=True): t for t in load_calibration()["traces"]}
    checked = 0
    for family in ("sd15", "sdxl"):
        for row in data[family]["check"]:
            inputs, kwargs = _check_inputs(family, row)
            cfg = {"family": family, "attention": "sdpa", **kwargs}
            trace = stored[json.dumps(cfg, sort_keys=True)]
            assert not trace["used_for_fit"]
            error = predict_memory(inputs).tensor_peak_bytes / trace["peak_bytes"] - 1
            assert -UNDER_BOUND <= error <= 0.05, (family, row, f"{error:+.2%}")
            checked += 1
    assert checked >= 16


@pytest.mark.parametrize(("family", "index"), [
    ("sd15", 6),  # 512 px, batch 4, rank 8, GC, Prodigy: per-sample term, ~5 s
    pytest.param("sd15", 7, marks=pytest.mark.slow),  # 768 px, batch 8, rank 128, GC: the worst corner
    pytest.param("sdxl", 2, marks=pytest.mark.slow),  # 1024 px, rank 128, GC: was 5.5 % low
    pytest.param("sdxl", 3, marks=pytest.mark.slow),  # 512 px, batch 8: was 2.8 % low
])
def test_fresh_check_trace_is_not_under_predicted(family: str, index: int) -> None:
    """A fresh fake-tensor trace of a check row (never fitted): the model is at most 2 % below it."""
    from autotune.calibration.memtrace import trace_training_step

    row = json.loads(FIT_CONFIGS.read_text())["families"][family]["check"][index]
    inputs, kwargs = _check_inputs(family, row)
    trace = trace_training_step(family, **kwargs)
    estimate = predict_memory(inputs)
    assert estimate.components["optimizer_state"] == trace.optimizer_state_bytes
    assert estimate.tensor_peak_bytes >= (1 - UNDER_BOUND) * trace.peak_bytes
    assert estimate.tensor_peak_bytes <= 1.05 * trace.peak_bytes


@pytest.mark.parametrize("family", ["sd15", "sdxl", "tiny-sd15"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_never_negative_at_the_smallest_sizes(family, checkpointing):
    """The fitted planes reach below zero far under the sizes they were fitted at (SD1.5 at 64 px gave -0.01 GiB, in
    a plan for sd-scripts on this CPU): an activation figure is at least zero."""
    for resolution in (64, 128):
        estimate = predict_memory(MemoryInputs(family=family, resolution=resolution, batch_size=1, rank=4,
                                               gradient_checkpointing=checkpointing, optimizer="AdamW8bit"))
        assert estimate.components["activations"] >= 0
