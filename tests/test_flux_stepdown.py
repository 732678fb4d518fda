"""The OOM ladder's block-swap rung (FLUX), against the real FLUX memory model (pure functions, no GPU)."""

from __future__ import annotations

from dataclasses import replace

from autotune.recovery.ladder import Decision, Exhausted, LadderLimits, TrainSettings, memory_predictor, next_settings
from sd_scripts_compat.facts.families import get_family

FLUX = TrainSettings(train_batch_size=1, gradient_accumulation_steps=4, resolution=(1024, 1024),
                     optimizer_type="AdamW8bit", network_dim=16, network_alpha=8.0, mixed_precision="bf16",
                     gradient_checkpointing=True, fp8_base=True, cache_latents=True, cache_text_encoder_outputs=True,
                     max_bucket_reso=1024)


def _limits(budget_mib: float, family: str = "flux-dev") -> LadderLimits:
    return LadderLimits(budget_mib=budget_mib, fp8_supported=True, min_resolution=512, resolution_step=64,
                        max_blocks_to_swap=get_family(family).max_blocks_to_swap)


def test_the_family_data_says_who_can_swap() -> None:
    assert get_family("flux-dev").max_blocks_to_swap == 35  # sd-scripts keeps two of each block list resident
    assert get_family("sdxl").max_blocks_to_swap == 0
    assert get_family("tiny-flux").max_blocks_to_swap == 2  # 2 + 2 blocks, none kept resident (our swapper)


def test_swap_comes_before_resolution_and_rank_and_takes_the_fewest_blocks() -> None:
    predict = memory_predictor(get_family("flux-dev"))
    budget = predict(replace(FLUX, blocks_to_swap=12)) + 1  # fits at 12 swapped blocks, not at 11
    decision = next_settings(FLUX, _limits(budget), predict, measured_mib=predict(FLUX))  # scale 1
    assert isinstance(decision, Decision)
    assert decision.changes == {"blocks_to_swap": (0, 12)}
    assert decision.settings.resolution == FLUX.resolution and decision.settings.network_dim == 16
    assert decision.resume_compatible and "block swap" in decision.reason


def test_swap_is_capped_at_the_family_maximum_then_resolution_follows() -> None:
    predict = memory_predictor(get_family("flux-dev"))
    at_max = replace(FLUX, blocks_to_swap=35)
    budget = (predict(at_max) + predict(replace(at_max, resolution=(960, 960), max_bucket_reso=960))) / 2
    decision = next_settings(FLUX, _limits(budget), predict, measured_mib=predict(FLUX))  # scale 1
    assert isinstance(decision, Decision)
    assert decision.settings.blocks_to_swap == 35 and decision.settings.resolution == (960, 960)
    exhausted = next_settings(FLUX, _limits(1.0), predict, measured_mib=predict(FLUX))
    assert isinstance(exhausted, Exhausted) and exhausted.floor.blocks_to_swap == 35


def test_a_family_that_cannot_swap_never_gets_the_rung() -> None:
    sd15 = TrainSettings(train_batch_size=1, gradient_accumulation_steps=1, resolution=(512, 512),
                         optimizer_type="AdamW8bit", network_dim=16, network_alpha=8.0, mixed_precision="fp16",
                         gradient_checkpointing=True, cache_latents=True)
    predict = memory_predictor(get_family("sd15"))
    exhausted = next_settings(sd15, _limits(1.0, "sd15"), predict, measured_mib=predict(sd15))
    assert isinstance(exhausted, Exhausted) and exhausted.floor.blocks_to_swap == 0
    assert not any("block swap" in step for step in exhausted.tried)


def test_text_encoders_our_engine_caches_are_off_the_card_in_the_ladders_figure_too() -> None:
    """The engine caches a frozen text encoder's outputs for fixed captions whatever the settings say; the ladder
    then leaves the encoders' weights out for a transformer as it does for a UNet (T5-XXL: ~9 GiB in bf16)."""
    live = replace(FLUX, cache_text_encoder_outputs=False, network_train_unet_only=True)
    kept = memory_predictor(get_family("flux-dev"))(live)
    cached = memory_predictor(get_family("flux-dev"), text_encoder_outputs_cached=True)(live)
    assert cached == memory_predictor(get_family("flux-dev"))(FLUX) and kept - cached > 4096
