"""Predicted transformer (DiT) LoRA speed: FLOPs per step from the architecture, and what block swap costs.

FLOPs are counted analytically from ``dit_calibration.json``'s architecture (exact Linear sizes, no tracing):
per sample, every double block's image-stream Linears run over the image tokens and its text-stream Linears over
the 512 T5 tokens, every single block's Linears over both; joint attention costs 4 * tokens^2 * hidden per block
(QK^T and PV; a cross-attention block: image^2 + image x text pairs). The modulation Linears run once per
sample (negligible). Backward of frozen weights needs only
input gradients (1x the Linear FLOPs) plus flash attention's backward (``attention_backward_factor`` x its
forward); gradient checkpointing adds one more forward (every block is checkpointed).

Block swap moves each swapped block's weights down and back up once in the forward and once again in the
backward (sd-scripts' ``ModelOffloader``: a block leaves right after use and the next needed one comes in, the
two copies one after the other on a side stream), so 4 x the swapped bytes cross the link per micro-step, at
``link_efficiency`` of the card's ``pcie_gbps`` (pageable memory; ``pinned_link_efficiency`` under musubi's
``use_pinned_memory_for_block_swap``). The copies overlap the compute of other blocks,
so a micro-step takes max(compute, transfer): swapping is free until the link becomes the bottleneck, which is
what the planner weighs when it picks the fewest swapped blocks that fit. The compute runs at ``efficiency`` of
the card's bf16 rate times ``w / (w + 3.5)`` (w: TFLOP per micro-step), the UNet speed model's per-step overhead
term (launches, optimizer, loader), so a larger micro-batch is slightly faster per sample.

Wan 2.2's two experts with ``offload_inactive_dit``: when a micro-step's sampled timestep falls on the other
expert's side of the boundary, musubi moves the active expert to the host and the other one to the card, both
whole and synchronously (``swap_high_low_weights``), so ``expert_switch_share`` x 2 x one expert's bytes cross the
link per micro-step on top of the compute (:func:`expert_switch_share` gives that share from the sampling).
Without offloading the switch re-points tensors and costs nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from autotune.estimate.dit_memory import (
    DitMemoryInputs,
    dit_family_calibration,
    expert_bytes,
    offloaded_checkpoint_bytes,
    transformer_bytes,
)
from autotune.estimate.speed_model import EFFICIENCY_HALF_TFLOP, SpeedEstimate, card_rate_tflops
from sd_scripts_compat.facts.families import get_family

if TYPE_CHECKING:
    from autotune.hardware.gpu_catalog import GpuSpec

# A DiT on the CPU (tiny-flux: tests and demos) as one effective FLOP rate: its steps are overhead-bound, so this
# is what tiny-flux's runs measure on this project's 2-core machine (0.17 s per 256 px step of 4 micro-steps,
# bf16, predicted within 1 %); no full-size DiT trains on a CPU.
CPU_DIT_GFLOPS_PER_CORE = 13.9


def dit_step_flops(inputs: DitMemoryInputs, calibration: dict[str, Any] | None = None) -> dict[str, float]:
    """FLOPs of one micro-step (whole batch): forward, backward (incl. the checkpointing recompute)."""
    cal = dit_family_calibration(inputs.family, calibration)
    arch = cal["architecture"]
    family = get_family(inputs.family)
    img = family.image_tokens(inputs.resolution, inputs.height) * family.latent_frames(inputs.frames)
    txt = arch["text_tokens"]
    groups = arch["block_groups"]
    linear = 2.0 * sum(g["count"] * (img * g["macs_per_image_token"] + txt * g["macs_per_text_token"])
                       for g in groups)
    attention = 4.0 * arch["hidden"] * sum(g["count"] * _attention_pairs(g, img, txt) for g in groups)
    forward = inputs.batch_size * (linear + attention)
    backward = inputs.batch_size * (linear + cal["speed"]["attention_backward_factor"] * attention)
    if inputs.gradient_checkpointing:
        backward += forward
    return {"forward": forward, "backward": backward, "total": forward + backward}


def _attention_pairs(group: dict[str, Any], img: int, txt: int) -> int:
    """Query-key pairs per head-width of one block: joint attention over image and text tokens together (FLUX,
    SD3, Lumina, HunyuanImage), or self-attention over the image plus cross-attention to the text (Anima)."""
    return img * img + img * txt if group.get("attention") == "cross" else (img + txt) ** 2


def swap_seconds(inputs: DitMemoryInputs, gpu: GpuSpec | None, calibration: dict[str, Any] | None = None) -> float:
    """Seconds per micro-step that the swapped weights spend on the host link (0 without swap)."""
    cal = dit_family_calibration(inputs.family, calibration)
    if not inputs.blocks_to_swap:
        return 0.0
    split = get_family(inputs.family).swap_split(inputs.blocks_to_swap)
    _, host = transformer_bytes(cal["architecture"], inputs.fp8_base, split)
    link = getattr(gpu, "pcie_gbps", None) or cal["speed"]["default_pcie_gbps"]
    efficiency = cal["speed"]["pinned_link_efficiency" if inputs.pinned_block_swap else "link_efficiency"]
    return 4.0 * host / (link * 1e9 * efficiency)


def gather_seconds(inputs: DitMemoryInputs, gpu: GpuSpec | None, calibration: dict[str, Any] | None = None) -> float:
    """Seconds per micro-step that a sharded transformer's gathers spend on the link between the cards (0
    unsharded): over NVLink where the probe found every pair of a shard group linked, else over PCIe through the
    host (``hardware.gpu_links.collective_gbps``), at the link's efficiency; an offloaded share's copy from host RAM
    over PCIe; with ``fp8_base`` the Linear weights cross in 1 byte."""
    from autotune.estimate.dit_memory import gathered_bytes_per_step
    from autotune.hardware.gpu_links import collective_gbps

    if inputs.shard_ranks < 2:
        return 0.0
    cal = dit_family_calibration(inputs.family, calibration)
    pcie, efficiency = getattr(gpu, "pcie_gbps", None) or cal["speed"]["default_pcie_gbps"], \
        cal["speed"]["link_efficiency"]
    arch, ranks = cal["architecture"], inputs.shard_ranks
    gathers = gathered_bytes_per_step(arch, ranks, False, inputs.fp8_base)
    copies = gathered_bytes_per_step(arch, ranks, inputs.shard_offload, inputs.fp8_base) - gathers
    gather_gbps = collective_gbps(gpu, ranks, cal["speed"]["default_pcie_gbps"])
    return gathers / (gather_gbps * 1e9 * efficiency) + copies / (pcie * 1e9 * efficiency)


def expert_switch_seconds(inputs: DitMemoryInputs, gpu: GpuSpec | None,
                          calibration: dict[str, Any] | None = None) -> float:
    """Seconds per micro-step of moving Wan 2.2's experts between host and card (``offload_inactive_dit``):
    each switch moves one expert down and the other up, whole, in pageable memory; 0 without offloading."""
    if not (inputs.high_noise_expert and inputs.offload_inactive_dit):
        return 0.0
    cal = dit_family_calibration(inputs.family, calibration)
    expert = expert_bytes(cal["architecture"], inputs.fp8_base)
    link = getattr(gpu, "pcie_gbps", None) or cal["speed"]["default_pcie_gbps"]
    return inputs.expert_switch_share * 2.0 * expert / (link * 1e9 * cal["speed"]["link_efficiency"])


def expert_switch_share(boundary: float, shift: float, sigmoid_scale: float = 1.0) -> float:
    """The share of micro-steps that change expert, with musubi's ``shift`` timestep sampling
    (``t = s * u / (1 + (s - 1) * u)``, ``u = sigmoid(scale * N(0, 1))``; one expert per micro-step, chosen by its
    first sample): p = P(t >= boundary) for the high-noise expert, and consecutive draws differ with 2 p (1 - p)."""
    u = boundary / (shift - (shift - 1.0) * boundary)  # the u that shifts to the boundary
    z = math.log(u / (1.0 - u)) / sigmoid_scale
    p = 0.5 * math.erfc(z / math.sqrt(2.0))
    return 2.0 * p * (1.0 - p)


def offload_seconds(inputs: DitMemoryInputs, gpu: GpuSpec | None, calibration: dict[str, Any] | None = None) -> float:
    """Seconds per micro-step that ``cpu_offload_checkpointing``'s block inputs spend on the host link (down in
    the forward, up in the backward; 0 without it)."""
    cal = dit_family_calibration(inputs.family, calibration)
    link = getattr(gpu, "pcie_gbps", None) or cal["speed"]["default_pcie_gbps"]
    return 2.0 * offloaded_checkpoint_bytes(cal, inputs) / (link * 1e9 * cal["speed"]["link_efficiency"])


def predict_dit_speed(inputs: DitMemoryInputs, gpu: GpuSpec | None = None, *, steps: int = 1,
                       gradient_accumulation_steps: int = 1, cpu_cores: int | None = None,
                       calibration: dict[str, Any] | None = None) -> SpeedEstimate:
    """Seconds per optimizer step: max(compute, swap transfer) per micro-step, times the accumulation."""
    cal = dit_family_calibration(inputs.family, calibration)
    flops = dit_step_flops(inputs, cal)["total"]
    if gpu is not None:
        rate = card_rate_tflops(gpu, "bf16" if getattr(gpu, "bf16", True) else "fp16")
        tflop = flops / 1e12  # the UNet model's launch/optimizer overhead term: small steps run below the cap
        eff = cal["speed"]["efficiency"] * tflop / (tflop + EFFICIENCY_HALF_TFLOP)
        device = gpu.name
    else:
        rate = max(1, int(cpu_cores or 1)) * CPU_DIT_GFLOPS_PER_CORE / 1000
        eff = 1.0
        device = f"cpu x{cpu_cores or 1}"
    compute = flops / (rate * eff * 1e12)
    link = swap_seconds(inputs, gpu, cal) + offload_seconds(inputs, gpu, cal) + gather_seconds(inputs, gpu, cal) \
        if gpu is not None else 0.0
    micro = max(compute, link) + (expert_switch_seconds(inputs, gpu, cal) if gpu is not None else 0.0)
    per_step = micro * max(1, gradient_accumulation_steps)
    if gpu is not None and inputs.state_ranks > 1:  # shard_optimizer_state: the owners' broadcast after the update
        from autotune.estimate.dit_memory import predict_dit_memory
        from autotune.estimate.sharded_weights import state_sync_bytes
        from autotune.hardware.gpu_links import collective_gbps

        link = collective_gbps(gpu, inputs.state_ranks, cal["speed"]["default_pcie_gbps"]) * 1e9
        lora = predict_dit_memory(inputs, calibration).components["lora_params"]
        per_step += state_sync_bytes(lora, inputs.state_ranks) / (link * cal["speed"]["link_efficiency"])
    return SpeedEstimate(it_per_s=1.0 / per_step, seconds_per_step=per_step, total_seconds=per_step * steps,
                         steps=steps, flops_per_micro_step=flops, efficiency=eff, peak_tflops=rate,
                         achieved_tflops=flops / micro / 1e12, device=device)
