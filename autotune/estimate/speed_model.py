"""Predicted training speed: FLOPs per step from the architectures, the card's rate, an efficiency.

FLOPs are counted once per family with ``torch.utils.flop_counter.FlopCounterMode`` on the meta
device (on fake CPU tensors the CPU flash-attention op counts as 0 FLOPs; on meta SDPA takes the
math path, whose two matmuls are the standard attention FLOPs) and shipped as per-sample fits in
latent pixels P (``f1*P + f2*P^2``: convs/linears ~P, self-attention ~P^2) in the
``flops`` section of ``autotune/data/memory_calibration.json`` (``bench/calibrate_memory.py
--flops-only`` regenerates it), so planning never traces.

- Backward of a frozen-weight UNet with LoRA is counted, not assumed: it needs the input gradients
  of every layer (~1x forward) but weight gradients only for the small LoRA matrices, so it comes
  out ~1.1-1.15x the forward (SD1.5 512: 0.92 vs 0.80 TFLOP; SDXL 1024: 7.5 vs 6.8).
- Gradient checkpointing recomputes the checkpointed blocks' forward during backward: counted too
  (diffusers checkpoints the resnet / transformer blocks, ~0.77x of a full forward).
- Text encoders add their forward when not cached (and their backward when trained); the VAE adds
  its encoder when latents are not cached.

Efficiency (achieved / catalogue dense fp16-with-fp32-accumulate rate) rises with the work per
micro-step ``w`` (TFLOP): ``eff = 0.33 * w / (w + 3.5)``. Small batches leave the GPU waiting on
kernel launches, the optimizer and the data loader, so small steps run far from peak. Fitted to
published LoRA throughput (``shared/reference/vram_datapoints.md``): row 1, SD1.5 512 bs1 on a
2080 Ti at ~3.3 it/s (1.8 TFLOP/step, 5.9 TFLOP/s of 53.8: 11 %) and row 18, SDXL bs8 with GC on
a 4090 at ~3 s/it (159 TFLOP/step, 53 TFLOP/s of 165: 32 %); row 17 (SDXL 1024 bs1 on a 3090 Ti,
1.12 s/it) is predicted at 0.7-0.95 s/it, i.e. the curve is somewhat optimistic at bs1.
On the CPU (no GPU given) a micro-step costs a fixed overhead, its memory traffic and its FLOPs:
``seconds = overhead + UNet weight bytes / weight rate + FLOPs / (cores x FLOP rate) + activation bytes /
activation rate``, with the weight bytes at the compute dtype (every frozen weight is read in the forward and again
for the input gradients) and the activation bytes the memory model's without checkpointing, scaled by the
checkpointing recompute's FLOPs when it is on (the elementwise and normalisation work that runs at memory speed,
which is what a tiny model's step is made of). ``CpuCoefficients`` holds the four per
precision; ``autotune.calibration.cpu_speed.fit_cpu_speed`` fits them (non-negative least squares on relative
error) from ``autotune bench`` points (``bench/learned_plan.py --calibrate-cpu``): on this project's 2-core machine
(2 threads) tiny-sd15 at 64 / 128 / 256 px, tiny-sdxl at 256 px and sd15 at 256 px, micro-batch 1 and 4, fp32 and
bf16: 20 points, every one within 0.68-1.26x (fp32) and 0.73-1.35x (bf16) of its fit. bf16 autocast on a CPU with
native bf16 (avx512_bf16 / AMX: ``cpu_bf16=True``) computes ``CPU_NATIVE_BF16_GAIN`` x the fp32 FLOP rate (the
sd15 per-sample slope: 0.65 vs 1.71 s) but pays more per-op overhead (casts), so a tiny model runs slower in bf16
and a full-size one 1.8-2.3x faster; without native bf16 it is emulated, its FLOP part ~3.6x slower. A measured
figure of the same settings on the same machine (``autotune.measure``) beats all of this: the planner uses it when
it has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.estimate.memory_model import MemoryInputs
    from autotune.hardware.gpu_catalog import GpuSpec

EFFICIENCY_MAX = 0.33
EFFICIENCY_HALF_TFLOP = 3.5


@dataclass(frozen=True)
class CpuCoefficients:
    """The CPU micro-step model's four terms for one compute precision (see the module docstring)."""

    overhead_s: float
    weight_gbs: float  # GB/s of frozen weight bytes (at the compute dtype)
    gflops_per_core: float
    activation_gbs: float  # GB/s of the memory model's activation bytes


CPU_FP32 = CpuCoefficients(overhead_s=0.020, weight_gbs=2.28, gflops_per_core=231.5, activation_gbs=0.59)
CPU_NATIVE_BF16_GAIN = 2.62  # bf16 FLOP rate / fp32's on a CPU with native bf16
CPU_BF16 = CpuCoefficients(overhead_s=0.0535, weight_gbs=4.91, gflops_per_core=231.5 * CPU_NATIVE_BF16_GAIN,
                           activation_gbs=0.32)
CPU_BF16_SLOWDOWN = 3.6  # emulated bf16 (no native support): the FLOP part this much slower than fp32


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one micro-step (whole batch), by part."""

    unet_forward: float
    unet_backward: float  # includes the gradient-checkpointing recompute when on
    text_encoders: float
    vae_encode: float

    @property
    def total(self) -> float:
        return self.unet_forward + self.unet_backward + self.text_encoders + self.vae_encode


@dataclass(frozen=True)
class SpeedEstimate:
    """``it_per_s`` counts optimizer steps (one step = ``gradient_accumulation_steps`` micro-steps),
    as kohya's progress bar does."""

    it_per_s: float
    seconds_per_step: float
    total_seconds: float
    steps: int
    flops_per_micro_step: float
    efficiency: float
    peak_tflops: float
    achieved_tflops: float
    device: str


def _poly(coef: list[float], pixels: float) -> float:
    return sum(c * pixels**i for i, c in enumerate(coef))


def step_flops(inputs: MemoryInputs, calibration: dict[str, Any] | None = None) -> StepFlops:
    """FLOPs of one micro-step for ``inputs`` (a ``MemoryInputs``), from the shipped fits."""
    from autotune.estimate.memory_model import CALIBRATION_PATH, load_calibration
    from sd_scripts_compat.facts.errors import UserError

    calibration = calibration or load_calibration()
    table = calibration.get("flops", {})
    name = inputs.family
    if name not in table:  # a family sharing another's architecture (sd2-v -> sd2)
        name = calibration.get("families", {}).get(name, {}).get("calibrated_as", name)
    if name not in table:
        raise UserError(f"{CALIBRATION_PATH.name}: no FLOP counts for family {inputs.family!r}; "
                        "regenerate them with bench/calibrate_memory.py --flops-only")
    fam = table[name]
    height = inputs.height or inputs.resolution
    down = int(fam.get("latent_downsample", 8))
    pixels = (inputs.resolution // down) * (height // down)
    bs = inputs.batch_size
    forward = bs * _poly(fam["unet_forward"], pixels)
    backward = bs * _poly(fam["unet_backward_gc" if inputs.gradient_checkpointing else "unet_backward"], pixels)
    text = 0.0
    if inputs.train_text_encoder:
        text = bs * fam["text_encoder_forward"] * (1 + fam["text_encoder_backward_ratio"])
    elif not inputs.cache_text_encoder_outputs:
        text = bs * fam["text_encoder_forward"]
    vae = 0.0 if inputs.cache_latents else bs * _poly(fam["vae_encode"], pixels)
    return StepFlops(unet_forward=forward, unet_backward=backward, text_encoders=text, vae_encode=vae)


def efficiency(tflop_per_micro_step: float) -> float:
    """Fraction of the card's dense tensor rate a LoRA step reaches (see the module doc for the source)."""
    w = max(tflop_per_micro_step, 0.0)
    return EFFICIENCY_MAX * w / (w + EFFICIENCY_HALF_TFLOP)


def card_rate_tflops(gpu: GpuSpec, precision: str) -> float:
    """The catalogue rate for the compute precision: bf16/fp16 tensor rate, else plain fp32."""
    if precision == "bf16":
        rate = getattr(gpu, "bf16_tensor_tflops", None) or getattr(gpu, "fp16_tensor_tflops", None)
    elif precision in ("fp16", "fp8"):
        rate = getattr(gpu, "fp16_tensor_tflops", None)
    else:
        rate = None
    return float(rate or gpu.fp32_tflops)


def compute_precision(inputs: MemoryInputs) -> str:
    mixed = getattr(inputs, "mixed_precision", None)
    if mixed in ("fp16", "bf16"):
        return mixed
    if mixed == "no":
        return "fp32"
    return {"fp8": "fp16"}.get(inputs.weight_dtype, inputs.weight_dtype)


def cpu_coefficients(precision: str, native_bf16: bool) -> CpuCoefficients:
    """The CPU model's terms under ``precision`` (fp16 autocast stays fp32 on a CPU; emulated bf16 is fp32's with
    its FLOP rate ``CPU_BF16_SLOWDOWN`` x lower)."""
    if precision != "bf16":
        return CPU_FP32
    if native_bf16:
        return CPU_BF16
    return replace(CPU_FP32, gflops_per_core=CPU_FP32.gflops_per_core / CPU_BF16_SLOWDOWN)


def cpu_traffic_bytes(inputs: MemoryInputs, flops: float,
                      calibration: dict[str, Any] | None = None) -> tuple[float, float]:
    """The CPU model's two traffic terms of one micro-step: (frozen UNet weight bytes at the compute dtype,
    activation bytes of the work done). Shared with the calibration that fits their rates."""
    from autotune.estimate.memory_model import family_calibration, predict_memory

    compute_bytes = 2 if compute_precision(inputs) == "bf16" else 4
    weights = family_calibration(inputs.family, calibration)["architecture"]["unet"]["float_elements"]
    activations: float = predict_memory(inputs, calibration).components["activations"]
    if getattr(inputs, "gradient_checkpointing", False):  # it keeps fewer activations but does all that work,
        plain = replace(inputs, gradient_checkpointing=False)  # and the recompute again
        activations = (predict_memory(plain, calibration).components["activations"]
                       * flops / step_flops(plain, calibration).total)
    return weights * compute_bytes, activations


def cpu_micro_step_seconds(inputs: MemoryInputs, flops: float, cores: int, native_bf16: bool,
                           calibration: dict[str, Any] | None = None) -> float:
    """Seconds of one micro-step on ``cores`` CPU cores: overhead + weight traffic + FLOPs + activation traffic."""
    k = cpu_coefficients(compute_precision(inputs), native_bf16)
    weights, activations = cpu_traffic_bytes(inputs, flops, calibration)
    return (k.overhead_s + weights / (k.weight_gbs * 1e9) + flops / (cores * k.gflops_per_core * 1e9)
            + activations / (k.activation_gbs * 1e9))


def cpu_bf16_speed(native: bool) -> str:
    """How bf16 autocast runs on this CPU against fp32: the one sentence the plan and the wizard both say."""
    if native:
        return (f"this CPU computes bf16 natively (avx512_bf16 / AMX): bf16 autocast computes about "
                f"{CPU_NATIVE_BF16_GAIN:g}x the fp32 FLOP rate (full-size steps ~2x faster; a tiny model's step, "
                "mostly per-op overhead, slower)")
    return f"this CPU has no native bf16: bf16 autocast is emulated, about {CPU_BF16_SLOWDOWN:g}x slower than fp32"


def unet_gather_seconds(inputs: MemoryInputs, gpu: GpuSpec, calibration: dict[str, Any] | None = None) -> float:
    """Seconds per micro-step that a sharded UNet's gathers spend on the link between the cards (0 unsharded),
    NVLink or PCIe as the transformer families' (``dit_speed.gather_seconds``), at their link efficiency."""
    if inputs.shard_ranks < 2:
        return 0.0
    from autotune.estimate.dit_memory import load_dit_calibration
    from autotune.estimate.memory_model import family_calibration, unet_shard_units
    from autotune.estimate.sharded_weights import gathered_bytes
    from autotune.hardware.gpu_links import collective_gbps

    units, root = unet_shard_units(family_calibration(inputs.family, calibration)["architecture"], inputs.weight_dtype)
    link = load_dit_calibration()["speed"]
    rate = collective_gbps(gpu, inputs.shard_ranks, link["default_pcie_gbps"]) * 1e9 * link["link_efficiency"]
    return gathered_bytes(units, root, inputs.shard_ranks) / rate


def predict_speed(inputs: MemoryInputs, gpu: GpuSpec | None = None, *, steps: int = 1,
                  gradient_accumulation_steps: int = 1, peak_tflops: float | None = None, cpu_cores: int | None = None,
                  cpu_bf16: bool = False, calibration: dict[str, Any] | None = None) -> SpeedEstimate:
    """Seconds per optimizer step and for ``steps`` steps.

    The rate is ``peak_tflops`` when given (a plain number), else the ``gpu``'s catalogue rate
    (anything with ``fp16_tensor_tflops`` / ``bf16_tensor_tflops`` / ``fp32_tflops``, e.g.
    ``autotune.hardware.gpu_catalog.GpuSpec``), else the CPU's (``cpu_cores`` physical cores; ``cpu_bf16``:
    the CPU computes bf16 natively).
    """
    flops = step_flops(inputs, calibration)
    precision = compute_precision(inputs)
    tflop = flops.total / 1e12
    if peak_tflops is not None or gpu is not None:
        if peak_tflops is not None:
            rate = float(peak_tflops)
        else:
            assert gpu is not None
            rate = card_rate_tflops(gpu, precision)
        eff = efficiency(tflop)
        device = getattr(gpu, "name", None) or f"{rate:g} TFLOP/s"
    else:
        cores = max(1, int(cpu_cores or 1))
        rate = cores * cpu_coefficients(precision, cpu_bf16).gflops_per_core / 1000
        seconds = cpu_micro_step_seconds(inputs, flops.total, cores, cpu_bf16, calibration)
        eff = tflop / seconds / rate if seconds > 0 else 0.0  # overhead and traffic lower the achieved rate
        device = f"cpu x{cores}"
    achieved = rate * eff
    micro = tflop / achieved if achieved > 0 else math.inf
    if gpu is not None:  # a sharded UNet's gathers overlap its compute (FSDP prefetches the next block)
        micro = max(micro, unet_gather_seconds(inputs, gpu, calibration))
    per_step = micro * max(1, gradient_accumulation_steps)
    if gpu is not None and inputs.state_ranks > 1:  # shard_optimizer_state: the owners' broadcast after the update
        per_step += unet_state_sync_seconds(inputs, gpu, calibration)
    return SpeedEstimate(it_per_s=1.0 / per_step, seconds_per_step=per_step, total_seconds=per_step * steps,
                         steps=steps, flops_per_micro_step=flops.total, efficiency=eff, peak_tflops=rate,
                         achieved_tflops=achieved, device=device)


def unet_state_sync_seconds(inputs: MemoryInputs, gpu: GpuSpec, calibration: dict[str, Any] | None = None) -> float:
    """Seconds per optimizer step in which a UNet's LoRA reaches every process from its owners
    (``sharded_weights.state_sync_bytes``), over the link at the transformer families' efficiency."""
    from autotune.estimate.dit_memory import load_dit_calibration
    from autotune.estimate.memory_model import predict_memory
    from autotune.estimate.sharded_weights import state_sync_bytes
    from autotune.hardware.gpu_links import collective_gbps

    link = load_dit_calibration()["speed"]
    rate = collective_gbps(gpu, inputs.state_ranks, link["default_pcie_gbps"]) * 1e9 * link["link_efficiency"]
    return state_sync_bytes(predict_memory(inputs, calibration).components["lora_params"], inputs.state_ranks) / rate
