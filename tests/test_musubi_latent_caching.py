"""musubi-tuner's latent-caching step in the memory model: each family's VAE (diffusers' class, full size, on fake
tensors) encoding one sample, fitted as weights + a + b x pixels (``bench/calibrate_latent_caching.py``), checked
here against a fresh trace at a size the fit never saw; the written caching command encodes one sample at a time,
as the model assumes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.calibration.dit_memtrace import trace_latent_caching
from autotune.estimate.dit_memory import (
    DitMemoryInputs,
    dit_family_calibration,
    latent_caching_bytes,
    predict_dit_memory,
)

MUSUBI = ["qwen-image", "flux2-dev", "flux2-klein-4b", "flux2-klein-9b", "wan2.1-t2v-1.3b", "wan2.2-t2v-a14b",
          "z-image"]


@pytest.mark.parametrize("family", MUSUBI)
def test_the_fit_matches_a_held_out_trace(family: str) -> None:
    cal = dit_family_calibration(family)
    video = "clip" in cal["latent_caching"]
    side, frames = (704, 21) if video else (896, 1)
    traced = trace_latent_caching(family, side, frames)
    actual = traced["weights_bytes"] + traced["transient_bytes"]
    predicted = latent_caching_bytes(cal, DitMemoryInputs(family=family, resolution=side, frames=frames))
    assert 0.98 <= predicted / actual <= 1.10, (family, predicted / actual)


def test_the_caching_phase_holds_the_larger_step_and_says_when_it_is_the_peak() -> None:
    small = predict_dit_memory(DitMemoryInputs(family="wan2.1-t2v-1.3b", resolution=640, frames=33,
                                               blocks_to_swap=29))
    cal = dit_family_calibration("wan2.1-t2v-1.3b")
    latent = latent_caching_bytes(cal, small.inputs)
    assert latent > 0 and small.caching_peak >= latent
    image = predict_dit_memory(DitMemoryInputs(family="flux-dev", resolution=1024))
    assert latent_caching_bytes(dit_family_calibration("flux-dev"), image.inputs) == 0  # sd-scripts' caches in-process


def test_the_written_latent_caching_encodes_one_sample_at_a_time(tmp_path) -> None:
    from autotune.planning.musubi_writer import musubi_commands
    from autotune.planning.planner import PlanRequest, gpu_from_vram, plan_training

    plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:qwen-image", gpus=(gpu_from_vram(16),),
                                     cpu_physical_cores=8))
    latents = musubi_commands(plan)[0]
    assert latents[latents.index("--batch_size") + 1] == "1"


def test_text_encoder_caching_on_the_cpu_counts_in_host_ram() -> None:
    """musubi's ``--device cpu`` caching (the planner's choice where the encoder does not fit the card) holds the
    encoder in RAM: the host figure covers it, the card's does not. With a caching transient made larger than the
    model's loading (a stand-in calibration), the host peak is the caching step's and says so."""
    import copy

    from autotune.estimate.dit_memory import encoder_bytes, load_dit_calibration

    inputs = DitMemoryInputs(family="qwen-image", resolution=1024, blocks_to_swap=40)
    on_gpu, on_cpu = predict_dit_memory(inputs), predict_dit_memory(replace(inputs, text_encoders_on_cpu=True))
    assert on_cpu.caching_peak < on_gpu.caching_peak
    calibration = copy.deepcopy(load_dit_calibration())
    calibration["variants"]["qwen-image"]["caching_transient_bytes"] = 100 * 2**30
    big = predict_dit_memory(replace(inputs, text_encoders_on_cpu=True), calibration)
    encoders = encoder_bytes(dit_family_calibration("qwen-image")["architecture"], False)
    assert big.host_ram_loading_bytes - on_cpu.host_ram_loading_bytes > 50 * 2**30
    assert big.host_ram_loading_bytes >= encoders + 100 * 2**30
    assert any("text-encoder caching on the CPU" in note for note in big.notes)
