"""Speed model: FLOPs counted on meta match the reference figures; predictions behave."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune.calibration.flops import count_flops
from autotune.estimate.memory_model import MemoryInputs
from autotune.estimate.speed_model import efficiency, predict_speed, step_flops

SD15 = MemoryInputs(family="sd15", resolution=512, batch_size=1, rank=16, gradient_checkpointing=False)
SDXL = MemoryInputs(family="sdxl", resolution=1024, batch_size=1, rank=16, gradient_checkpointing=False)


def test_sd15_forward_flops_match_reference() -> None:
    """Reference (stack notes): SD1.5 UNet forward at 512 px bs1 ~0.80 TFLOP, forward+backward 1.80."""
    counted = count_flops("sd15", 512, gradient_checkpointing=False)
    assert counted["forward"] == pytest.approx(0.80e12, rel=0.05)
    assert counted["forward"] + counted["backward"] == pytest.approx(1.80e12, rel=0.05)
    assert 1.0 < counted["backward"] / counted["forward"] < 1.3  # frozen base: input grads + small LoRA grads


@pytest.mark.slow
def test_sdxl_flops_match_reference() -> None:
    """Reference: SDXL 1024 bs1 forward ~6.76 TFLOP; forward+backward 14.70 (GC off) / 19.89 (GC on)."""
    plain = count_flops("sdxl", 1024, gradient_checkpointing=False)
    gc = count_flops("sdxl", 1024, gradient_checkpointing=True)
    assert plain["forward"] == pytest.approx(6.76e12, rel=0.05)
    assert plain["forward"] + plain["backward"] == pytest.approx(14.70e12, rel=0.05)
    assert gc["forward"] + gc["backward"] == pytest.approx(19.89e12, rel=0.05)


def test_shipped_fits_reproduce_reference_figures() -> None:
    sd15 = step_flops(SD15)
    assert sd15.unet_forward == pytest.approx(0.80e12, rel=0.05)
    sdxl = step_flops(SDXL)
    assert sdxl.unet_forward == pytest.approx(6.76e12, rel=0.05)
    assert sdxl.total == pytest.approx(14.70e12, rel=0.05)
    assert step_flops(replace(SDXL, gradient_checkpointing=True)).total == pytest.approx(19.89e12, rel=0.05)
    assert step_flops(replace(SDXL, batch_size=4)).total == pytest.approx(4 * sdxl.total, rel=1e-9)
    uncached = step_flops(replace(SD15, cache_latents=False, cache_text_encoder_outputs=False))
    assert uncached.vae_encode > 0 and uncached.text_encoders > 0
    trained = step_flops(replace(SD15, train_text_encoder=True))
    assert trained.text_encoders > uncached.text_encoders


def test_predictions_behave() -> None:
    fast = predict_speed(SD15, peak_tflops=100.0, steps=1000)
    assert fast.total_seconds == pytest.approx(1000 * fast.seconds_per_step)
    assert fast.it_per_s == pytest.approx(1 / fast.seconds_per_step)
    big = predict_speed(replace(SD15, batch_size=8), peak_tflops=100.0)
    assert big.seconds_per_step > fast.seconds_per_step
    assert big.efficiency > fast.efficiency  # bigger steps use the card better
    assert 8 / big.seconds_per_step > 1 / fast.seconds_per_step  # so samples/s rise with batch
    gc = predict_speed(replace(SD15, gradient_checkpointing=True), peak_tflops=100.0)
    assert gc.seconds_per_step > fast.seconds_per_step
    ga = predict_speed(SD15, peak_tflops=100.0, gradient_accumulation_steps=4)
    assert ga.seconds_per_step == pytest.approx(4 * fast.seconds_per_step)
    slow_card = predict_speed(SD15, peak_tflops=50.0)
    assert slow_card.seconds_per_step == pytest.approx(2 * fast.seconds_per_step)
    cpu = predict_speed(SD15, cpu_cores=2)
    assert cpu.device == "cpu x2" and cpu.seconds_per_step > 5  # ~12 s per SD1.5 512 step on 2 cores
    assert efficiency(0.0) == 0.0 and efficiency(1000.0) < 0.33


def test_gpu_catalogue_rate_by_precision() -> None:
    from autotune.hardware.gpu_catalog import lookup_gpu

    gpu = lookup_gpu("RTX 4090")
    fp16 = predict_speed(replace(SD15, weight_dtype="fp16"), gpu)
    fp32 = predict_speed(replace(SD15, weight_dtype="fp32"), gpu)
    assert fp16.peak_tflops == gpu.fp16_tensor_tflops
    assert fp32.peak_tflops == gpu.fp32_tflops
    assert fp32.seconds_per_step > fp16.seconds_per_step


def test_cpu_micro_step_is_overhead_traffic_and_flops_and_native_bf16_pays_off_on_full_size_steps():
    """The CPU model: a tiny step is mostly fixed overhead and activation traffic, a full-size one weight traffic
    and FLOPs. Native bf16 computes faster but pays more per op, so it wins on a full-size step and loses on a tiny
    one (as measured: tiny-sd15 64 px bs 1 0.021 s fp32, 0.048 s bf16; sd15 256 px bs 4 8.2 s, 3.6 s)."""
    from autotune.estimate.speed_model import CPU_FP32

    tiny = MemoryInputs(family="tiny-sd15", resolution=64, batch_size=1, rank=32, gradient_checkpointing=False,
                        mixed_precision="no")
    fp32 = predict_speed(tiny, cpu_cores=2)
    assert CPU_FP32.overhead_s < fp32.seconds_per_step < 2 * CPU_FP32.overhead_s
    four = predict_speed(replace(tiny, batch_size=4), cpu_cores=2)
    assert 4 / four.seconds_per_step > 1 / fp32.seconds_per_step  # the overhead is shared by the batch
    assert predict_speed(replace(tiny, mixed_precision="bf16"), cpu_cores=2, cpu_bf16=True).seconds_per_step > \
        fp32.seconds_per_step
    full = replace(SD15, resolution=256, rank=32, batch_size=4, gradient_checkpointing=False)
    native = predict_speed(replace(full, mixed_precision="bf16"), cpu_cores=2, cpu_bf16=True)
    plain = predict_speed(replace(full, mixed_precision="no"), cpu_cores=2)
    emulated = predict_speed(replace(full, mixed_precision="bf16"), cpu_cores=2, cpu_bf16=False)
    assert native.seconds_per_step < plain.seconds_per_step < emulated.seconds_per_step
    assert 1.5 < plain.seconds_per_step / native.seconds_per_step < 2.5
    checkpointed = predict_speed(replace(full, mixed_precision="no", gradient_checkpointing=True), cpu_cores=2)
    assert checkpointed.seconds_per_step > plain.seconds_per_step  # the recompute costs, never saves


def test_fit_cpu_speed_recovers_the_four_terms():
    from autotune.calibration.cpu_speed import CpuPoint, fit_cpu_speed

    truth = (0.02, 2.0, 200.0, 0.5)  # overhead s, weight GB/s, GFLOP/s per core, activation GB/s

    def point(flops: float, weights: float, activations: float) -> CpuPoint:
        seconds = truth[0] + weights / (truth[1] * 1e9) + flops / (2 * truth[2] * 1e9) + activations / (truth[3] * 1e9)
        return CpuPoint(flops, weights, activations, 2, seconds)

    points = [point(1e9, 1e7, 1e6), point(4e9, 1e7, 2e7), point(4e11, 3.4e9, 4e8), point(1.6e12, 3.4e9, 1.9e9),
              point(2e10, 5e7, 1e8)]
    fit = fit_cpu_speed(points)
    assert fit == pytest.approx(truth, rel=1e-6)
    fixed = fit_cpu_speed(points, gflops_per_core=200.0)
    assert fixed == pytest.approx(truth, rel=1e-6)
    with pytest.raises(ValueError):
        fit_cpu_speed(points[:3])
