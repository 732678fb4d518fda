"""The OOM step-down ladder, against the real analytic memory model (pure functions, no GPU).

Budgets are set relative to the model's own predictions, so the tests check the ladder's order and
rules, not particular coefficients of the memory model.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.recovery.ladder import (
    Decision,
    Exhausted,
    LadderLimits,
    TrainSettings,
    memory_predictor,
    next_settings,
    rescale_factor,
)
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.facts.settings_space import config_values, dataset_values

SDXL = TrainSettings(train_batch_size=4, gradient_accumulation_steps=2, resolution=(1024, 1024),
                     optimizer_type="AdamW", network_dim=32, network_alpha=16.0, mixed_precision="bf16",
                     cache_latents=True, max_bucket_reso=2048)
SD15 = TrainSettings(train_batch_size=4, gradient_accumulation_steps=1, resolution=(512, 512),
                     optimizer_type="AdamW", network_dim=16, network_alpha=8.0, mixed_precision="fp16",
                     cache_latents=True)


@pytest.fixture(scope="module")
def sdxl_predict():
    return memory_predictor(get_family("sdxl"))


@pytest.fixture(scope="module")
def sd15_predict():
    return memory_predictor(get_family("sd15"))


def test_smaller_micro_batch_first_keeps_effective_batch(sdxl_predict):
    budget = (sdxl_predict(replace(SDXL, train_batch_size=2)) + sdxl_predict(SDXL)) / 2
    decision = next_settings(SDXL, LadderLimits(budget_mib=budget, is_sdxl=True), sdxl_predict)
    assert isinstance(decision, Decision)
    assert decision.settings.train_batch_size == 2 and decision.settings.gradient_accumulation_steps == 4
    assert decision.settings.effective_batch == SDXL.effective_batch
    assert set(decision.changes) == {"train_batch_size", "gradient_accumulation_steps"}
    assert "effective batch" in decision.reason and decision.resume_compatible
    assert decision.predicted_mib <= budget


def test_micro_batch_only_takes_divisors_of_the_effective_batch(sd15_predict):
    failed = replace(SD15, train_batch_size=3, gradient_accumulation_steps=2)  # effective 6
    budget = sd15_predict(replace(failed, train_batch_size=2)) * 1.01
    decision = next_settings(failed, LadderLimits(budget_mib=budget), sd15_predict)
    assert isinstance(decision, Decision)
    assert (decision.settings.train_batch_size, decision.settings.gradient_accumulation_steps) == (2, 3)


def test_checkpointing_after_micro_batch_one(sdxl_predict):
    one = replace(SDXL, train_batch_size=1, gradient_accumulation_steps=8)
    with_gc = replace(one, gradient_checkpointing=True)
    assert sdxl_predict(with_gc) < sdxl_predict(one)
    budget = (sdxl_predict(with_gc) + sdxl_predict(one)) / 2
    decision = next_settings(SDXL, LadderLimits(budget_mib=budget, is_sdxl=True), sdxl_predict,
                             measured_mib=sdxl_predict(SDXL))
    assert isinstance(decision, Decision)
    assert decision.settings == with_gc
    assert [r.split(":")[0] for r in decision.reasons] == ["micro-batch", "gradient checkpointing"]


def test_ladder_order_down_to_rank(sdxl_predict):
    """With a budget that only the lowest rungs meet, the changes appear in the documented order."""
    limits = LadderLimits(budget_mib=1.0, is_sdxl=True, fp8_supported=True)
    floor = next_settings(SDXL, limits, sdxl_predict, measured_mib=sdxl_predict(SDXL))
    assert isinstance(floor, Exhausted)
    names = [t.split(" (")[0] for t in floor.tried]
    assert names == ["micro-batch", "gradient checkpointing", "8-bit optimizer", "text-encoder caching",
                     "max bucket resolution", "resolution", "rank", "fp8 base"]
    f = floor.floor
    assert (f.train_batch_size, f.gradient_accumulation_steps) == (1, 8)
    assert f.gradient_checkpointing and f.optimizer_type == "AdamW8bit" and f.cache_text_encoder_outputs
    assert f.resolution == (256, 256) and f.max_bucket_reso == 256 and f.network_dim == 4 and f.fp8_base
    assert f.network_alpha == pytest.approx(2.0)  # alpha / dim kept at 0.5
    message = floor.message()
    assert "nothing left to step down" in message and "needs about" in message and "GiB" in message


def test_te_caching_and_fp8_only_where_allowed(sd15_predict, sdxl_predict):
    sd15_floor = next_settings(SD15, LadderLimits(budget_mib=1.0, fp8_supported=False), sd15_predict,
                               measured_mib=sd15_predict(SD15))
    assert isinstance(sd15_floor, Exhausted)
    assert not sd15_floor.floor.cache_text_encoder_outputs and not sd15_floor.floor.fp8_base
    names = [t.split(" (")[0] for t in sd15_floor.tried]
    assert "text-encoder caching" not in names and "fp8 base" not in names
    shuffled = next_settings(SDXL, LadderLimits(budget_mib=1.0, is_sdxl=True, te_cache_allowed=False),
                             sdxl_predict, measured_mib=sdxl_predict(SDXL))
    assert isinstance(shuffled, Exhausted) and not shuffled.floor.cache_text_encoder_outputs


def test_rescale_by_measurement_goes_deeper(sd15_predict):
    """A measured peak twice the prediction makes the ladder skip the step the raw model would take."""
    two = replace(SD15, train_batch_size=2, gradient_accumulation_steps=2)
    budget = sd15_predict(two) * 1.05
    raw = next_settings(SD15, LadderLimits(budget_mib=budget), sd15_predict)
    assert isinstance(raw, Decision) and raw.settings == two
    measured = 2.0 * sd15_predict(SD15)
    scaled = next_settings(SD15, LadderLimits(budget_mib=budget), sd15_predict, measured_mib=measured)
    assert scaled.scale == pytest.approx(2.0 * sd15_predict(SD15) / sd15_predict(SD15))
    assert not isinstance(scaled, Decision) or scaled.settings != two
    if isinstance(scaled, Decision):
        assert scaled.predicted_mib == pytest.approx(sd15_predict(scaled.settings) * 2.0)


def test_rescale_factor_puts_the_failed_settings_over_budget():
    assert rescale_factor(1000.0, 500.0, 800.0) == pytest.approx(0.816)  # model over-predicts: scaled down
    assert rescale_factor(1000.0, None, 2000.0) == pytest.approx(2.04)
    assert rescale_factor(1000.0, 3000.0, 2000.0) == pytest.approx(3.0)
    for predicted, measured, budget in ((1000.0, 500.0, 800.0), (10.0, None, 5000.0), (9e4, 1200.0, 1250.0)):
        assert predicted * rescale_factor(predicted, measured, budget) > budget


def test_tried_settings_are_not_proposed_again(sd15_predict):
    two = replace(SD15, train_batch_size=2, gradient_accumulation_steps=2)
    budget = sd15_predict(two) * 1.05
    decision = next_settings(SD15, LadderLimits(budget_mib=budget), sd15_predict, tried=[two])
    assert isinstance(decision, Decision) and decision.settings != two


def test_rank_or_optimizer_change_is_not_resume_compatible(sd15_predict):
    floor = next_settings(SD15, LadderLimits(budget_mib=1.0), sd15_predict, measured_mib=sd15_predict(SD15))
    assert isinstance(floor, Exhausted)
    rank_only = replace(SD15, network_dim=8, network_alpha=4.0)
    # a budget that the rank rung meets but nothing milder does not exist for every model; check the flag logic
    budget = sd15_predict(floor.floor) * 1.5
    decision = next_settings(SD15, LadderLimits(budget_mib=budget), sd15_predict, measured_mib=sd15_predict(SD15))
    assert isinstance(decision, Decision)
    breaking = {"network_dim", "optimizer_type", "cache_text_encoder_outputs"} & set(decision.changes)
    assert decision.resume_compatible == (not breaking)
    assert config_values(rank_only)["network_alpha"] == 4.0


def test_settings_event_round_trip_and_kohya_values():
    s = replace(SD15, resolution=(768, 512), max_bucket_reso=1024)
    event = s.to_event()
    assert event["resolution"] == [768, 512] and set(event) == set(TrainSettings.__dataclass_fields__)
    assert TrainSettings.from_event(json.loads(json.dumps(event))) == s
    # the stability fields: rates (one per text encoder), warm-up as steps or a ratio, clipping, precision
    stable = replace(s, learning_rate=5e-5, unet_lr=1e-4, text_encoder_lr=(5e-5, 2e-5), lr_warmup_steps=0.05,
                     lr_scheduler="cosine", max_grad_norm=0.0, mixed_precision="fp16", full_fp16=True)
    back = TrainSettings.from_event(json.loads(json.dumps(stable.to_event())))
    assert back == stable and back.text_encoder_lr == (5e-5, 2e-5) and hash(back) == hash(stable)
    assert replace(stable, lr_warmup_steps=40).to_event()["lr_warmup_steps"] == 40
    values = config_values(stable)
    assert values["text_encoder_lr"] == [5e-5, 2e-5] and values["unet_lr"] == 1e-4 and values["full_fp16"] is True
    assert values["max_grad_norm"] == 0.0 and values["lr_scheduler"] == "cosine"
    assert "unet_lr" not in config_values(s) and "text_encoder_lr" not in config_values(s)
    with pytest.raises(ValueError, match="lacks network_dim"):
        TrainSettings.from_event({k: v for k, v in event.items() if k != "network_dim"})
    values = config_values(replace(s, cache_text_encoder_outputs=True))
    assert values["resolution"] == "768,512" and values["network_train_unet_only"] is True
    assert dataset_values(s) == {"batch_size": 4, "resolution": [768, 512], "max_bucket_reso": 1024}
    assert s.with_rank(4).network_alpha == 2.0 and s.with_rank(4).network_dim == 4


def test_tiny_family_ladder_on_its_own_calibration():
    """tiny-sd15 on CPU (fp32, 128-256 px): predictions are the tiny family's own model, no borrowed twin,
    and the ladder walks down to the floor resolution in kohya's 64 px steps, as for the full-size families."""
    from autotune.estimate.memory_model import MemoryInputs, predict_memory
    from sd_scripts_compat.facts.errors import UserError

    predict = memory_predictor(get_family("tiny-sd15"), cuda=False)
    tiny = TrainSettings(train_batch_size=4, gradient_accumulation_steps=1, resolution=(256, 256), network_dim=16,
                         network_alpha=8.0, mixed_precision="no", cache_latents=True)
    direct = predict_memory(MemoryInputs(
        family="tiny-sd15", resolution=256, batch_size=4, rank=16, gradient_checkpointing=False, optimizer="AdamW",
        weight_dtype="fp32", train_text_encoder=True, cache_latents=True, cache_text_encoder_outputs=False,
        cuda_context_gib=0.0, safety_margin_gib=0.0))
    assert predict(tiny) == direct.total_bytes / 2**20
    limits = LadderLimits(budget_mib=(predict(replace(tiny, train_batch_size=2)) + predict(tiny)) / 2,
                          min_resolution=128, resolution_step=64)
    decision = next_settings(tiny, limits, predict)
    assert isinstance(decision, Decision) and decision.settings.train_batch_size == 2
    floor = next_settings(tiny, replace(limits, budget_mib=0.001), predict, measured_mib=predict(tiny))
    assert isinstance(floor, Exhausted) and floor.floor.resolution == (128, 128)
    with pytest.raises(UserError, match="no memory calibration"):
        memory_predictor(replace(get_family("sd15"), name="sd15-uncalibrated-twin"))


def _resolved_run(tmp_path, name: str, config: dict, subsets: list[dict]):
    """A run as the engine's own reader resolves it, from real config.toml + dataset.toml files."""
    import toml

    from sd_scripts_compat.config.resolved_run import settings_from_files

    folder = tmp_path / name
    folder.mkdir()
    for subset in subsets:
        (folder / subset["image_dir"]).mkdir()
    dataset = {"general": {"resolution": 1024}, "datasets": [{"subsets": [
        {**subset, "image_dir": str(folder / subset["image_dir"])} for subset in subsets]}]}
    (folder / "dataset.toml").write_text(toml.dumps(dataset))
    (folder / "config.toml").write_text(toml.dumps({"pretrained_model_name_or_path": "builtin:sdxl", **config}))
    return settings_from_files(folder / "config.toml", folder / "dataset.toml", sdxl=True)


def test_engine_side_text_encoder_caching_takes_the_encoders_off_the_prediction_and_the_ladder(tmp_path):
    """A UNet-only run with fixed captions: our engine caches the text-encoder outputs itself, so the
    predictor leaves the encoders out and `autotune run` offers no text-encoder caching rung."""
    import argparse

    from autotune.hardware.probe import probe_system
    from autotune.launch.kohya_job import _limits
    from sd_scripts_compat.facts.families import get_family

    unet_only = replace(SDXL, cache_text_encoder_outputs=False, network_train_unet_only=True)
    resident = memory_predictor(get_family("sdxl"))
    engine_cached = memory_predictor(get_family("sdxl"), text_encoder_outputs_cached=True)
    assert engine_cached(unet_only) == resident(replace(unet_only, cache_text_encoder_outputs=True))
    assert engine_cached(unet_only) < resident(unet_only) - 1000  # SDXL's two encoders: over 1.5 GB in fp16

    args = argparse.Namespace(memory_limit=20000, vram=None)
    probe, family = probe_system(), get_family("sdxl")

    def limits(name: str, config: dict, subsets: list[dict]) -> LadderLimits:
        return _limits(probe, family, _resolved_run(tmp_path, name, config, subsets), args, cuda=False,
                       usable_mib=None)

    fixed = limits("fixed", {"network_train_unet_only": True}, [{"image_dir": "a"}])
    shuffled = limits("shuffled", {"network_train_unet_only": True, "shuffle_caption": True}, [{"image_dir": "a"}])
    trains_te = limits("te", {}, [{"image_dir": "a"}])
    assert not fixed.te_cache_allowed and not shuffled.te_cache_allowed and trains_te.te_cache_allowed
    assert (fixed.resolution_step, fixed.min_resolution) == (64, 256)  # kohya's bucket step, the 256 px floor
    # a caption option set on one subset of a dataset.toml counts too
    one_subset = limits("subset", {}, [{"image_dir": "a"}, {"image_dir": "b", "caption_dropout_rate": 0.1}])
    assert not one_subset.te_cache_allowed


def test_run_ladder_steps_tiny_families_like_full_size_ones(tmp_path):
    """`autotune run`'s ladder limits: kohya's 64 px resolution steps and the 256 px floor for every family,
    the tiny twins included (their VAEs downsample 8x, like the full-size ones)."""
    import argparse

    from autotune.hardware.probe import probe_system
    from autotune.launch.kohya_job import _limits
    from sd_scripts_compat.facts.families import get_family

    resolved = _resolved_run(tmp_path, "run", {}, [{"image_dir": "a"}])
    args = argparse.Namespace(memory_limit=20000, vram=None)
    for name in ("tiny-sd15", "tiny-sdxl", "sd15", "sdxl"):
        limits = _limits(probe_system(), get_family(name), resolved, args, cuda=False, usable_mib=None)
        assert (limits.min_resolution, limits.resolution_step) == (256, 64), name
