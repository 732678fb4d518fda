"""Speed model: FLOPs counted on meta match the reference figures; predictions behave."""

from __future__ import annotations

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
    assert step_flops(SDXL.with_(gradient_checkpointing=True)).total == pytest.approx(19.89e12, rel=0.05)
    assert step_flops(SDXL.with_(batch_size=4)).total == pytest.approx(4 * sdxl.total, rel=1e-9)
    uncached = step_flops(SD15.with_(cache_latents=False, cache_text_encoder_outputs=False))
    assert uncached.vae_encode > 0 and uncached.text_encoders > 0
    trained = step_flops(SD15.with_(train_text_encoder=True))
    assert trained.text_encoders > uncached.text_encoders


def test_predictions_behave() -> None:
    fast = predict_speed(SD15, peak_tflops=100.0, steps=1000)
    assert fast.total_seconds == pytest.approx(1000 * fast.seconds_per_step)
    assert fast.it_per_s == pytest.approx(1 / fast.seconds_per_step)
    big = predict_speed(SD15.with_(batch_size=8), peak_tflops=100.0)
    assert big.seconds_per_step > fast.seconds_per_step
    assert big.efficiency > fast.efficiency  # bigger steps use the card better
    assert 8 / big.seconds_per_step > 1 / fast.seconds_per_step  # so samples/s rise with batch
    gc = predict_speed(SD15.with_(gradient_checkpointing=True), peak_tflops=100.0)
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
    fp16 = predict_speed(SD15.with_(weight_dtype="fp16"), gpu)
    fp32 = predict_speed(SD15.with_(weight_dtype="fp32"), gpu)
    assert fp16.peak_tflops == gpu.fp16_tensor_tflops
    assert fp32.peak_tflops == gpu.fp32_tflops
    assert fp32.seconds_per_step > fp16.seconds_per_step


def test_cpu_micro_step_is_overhead_plus_flops_and_native_bf16_is_faster():
    """The CPU model: a tiny step is mostly fixed overhead (the quickstart measured ~0.1-0.25 s per micro-step, not
    the 0.02 s of its FLOPs); a full-size step mostly FLOPs. Native bf16 speeds up the FLOP part only; emulated
    bf16 slows it."""
    from autotune.estimate.speed_model import CPU_MICRO_STEP_OVERHEAD_S, CPU_NATIVE_BF16_GAIN

    tiny = MemoryInputs(family="tiny-sd15", resolution=256, batch_size=1, rank=32, gradient_checkpointing=False)
    fp32 = predict_speed(tiny, cpu_cores=2)
    assert CPU_MICRO_STEP_OVERHEAD_S < fp32.seconds_per_step < 2 * CPU_MICRO_STEP_OVERHEAD_S
    assert 4 < fp32.it_per_s < 15  # the old FLOPs-only figure was ~50
    four = predict_speed(tiny.with_(batch_size=4), cpu_cores=2)
    assert 4 / four.seconds_per_step > 1 / fp32.seconds_per_step  # the overhead is shared by the batch
    full = SD15.with_(resolution=256, rank=4)
    native = predict_speed(full.with_(mixed_precision="bf16"), cpu_cores=2, cpu_bf16=True)
    plain = predict_speed(full.with_(mixed_precision="no"), cpu_cores=2)
    emulated = predict_speed(full.with_(mixed_precision="bf16"), cpu_cores=2, cpu_bf16=False)
    assert native.seconds_per_step < plain.seconds_per_step < emulated.seconds_per_step
    assert plain.seconds_per_step / native.seconds_per_step == pytest.approx(CPU_NATIVE_BF16_GAIN, rel=0.1)


def test_fit_cpu_speed_recovers_overhead_and_rate():
    from autotune.calibration.cpu_speed import CpuPoint, fit_cpu_speed

    overhead, gflops = 0.08, 50.0
    points = [CpuPoint(flops, overhead + flops / (2 * gflops * 1e9), 2) for flops in (3e9, 3e10, 3.7e11)]
    fit = fit_cpu_speed(points)
    assert fit.overhead_s == pytest.approx(overhead, rel=1e-6)
    assert fit.gflops_per_core == pytest.approx(gflops, rel=1e-6)
    with pytest.raises(ValueError):
        fit_cpu_speed(points[:1])
