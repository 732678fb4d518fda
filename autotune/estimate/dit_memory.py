"""Analytic peak-VRAM, host-RAM and speed model of a LoRA step of a transformer (DiT) family with block swap.

One model for every DiT family, parameterised by data: the family's calibration entry in
``autotune/data/dit_calibration.json`` holds its architecture as block groups (each: count, weight elements,
fp8 and swappable elements, multiply-adds per image and per text token), the rest of the transformer, its text
encoders and AE, the text length, and the activation fit; the swap split is the engine's
(``FamilySpec.swap_split``, one count per block group). FLUX.1 is the first instance (19 double + 38 single
blocks, CLIP-L + T5-XXL run once while caching): a new family adds its entry and a calibration fit, not a
module. Fast (no torch); FLUX.1's entry is fitted by ``bench/calibrate_dit_memory.py`` from fake-tensor traces
of the full-size transformer (``autotune.calibration.dit_memtrace``, generic over DiT families) under CUDA
autocast's op lists (``calibration.cuda_autocast``); a CPU plan (``autocast_rules="cpu"``) reads the coefficients
traced under CPU autocast's, kept in each entry's ``cpu_rules``.

Training-phase tensor peak = resident transformer weights + LoRA params + grads + optimizer state + activations:

- Weights: bf16 (2 bytes) or, under ``fp8_base``, 1 byte for every Linear weight (float8_e4m3fn). Swapped
  blocks (the family's split, ``FamilySpec.swap_split``: n // 2 double and (n - n // 2) * 2 single, the last
  of each list; at most 35 for FLUX.1)
  keep only their ``.weight`` tensors on the host; in sd-scripts the block swapped in reuses the GPU storage
  of the one swapped out (no buffer: what the traces measure), our engine copies into fresh buffers with one
  prefetched, so ``swap_buffers`` adds two of the largest swapped blocks on top of the traced tensor peak
  (none for a family only sd-scripts trains: ``trained_here`` false). HunyuanImage's ``fp8_scaled`` counts as
  ``fp8_base`` (1 byte per Linear weight; its per-block scales are a few kB).
- LoRA: kohya's 304 modules (exact shapes from the architecture), fp32, and each optimizer's state layout
  (shared with the SD model: ``memory_model.optimizer_state_bytes``).
- Activations: ``c0 + c1*rank + batch*(d + tokens*(a + b*rank))`` per checkpointing setting (``d``: per sample
  beside its tokens, fitted where batch-2 traces were; 0 for FLUX.1), tokens = packed image
  tokens (side / 16)^2 + 512 T5 tokens (the family's text length; none for a cross-attention transformer:
  ``activation_tokens``); attention is flash / memory-efficient (O(tokens)). ``fp8_extra``: the
  traced difference under fp8_base (for a musubi-tuner family its ``fp8_scaled`` as it runs: each Linear's bf16
  dequantized copy kept for the backward, one block's with checkpointing, every block's without:
  ``dit_memtrace.musubi_fp8_scaled``). With AdamW at least one parameter-sized temporary (foreach AdamW's, the
  SD model's rule): a small checkpointed step peaks in the optimizer.
- ``cpu_offload_checkpointing`` (sd-scripts' option, our engine's ``training.offload_checkpointing``): with
  checkpointing, each block's saved input (bf16, its tokens x the hidden width) waits on the host but the one in
  flight, so the checkpointed activations lose ``(blocks - 1) x 2 x hidden x tokens x batch`` bytes (analytic: a
  fake-tensor trace runs on one device and cannot tell the host from the card) and host RAM gains them; the
  copies cross the host link twice per micro-step (``dit_speed.offload_seconds``).
- Text encoders resident (outputs not cached): CLIP-L bf16 + T5-XXL bf16 or fp8; the AE when latents are not
  cached (its encode transient uses the SD VAE encoder's traced bytes per pixel: the same encoder blocks).

Caching phase (outputs cached): sd-scripts moves the transformer and AE to the host and runs CLIP-L + T5-XXL
on the GPU, so that phase needs the encoders' weights plus a small transient (``caching_transient_bytes``): an
8-10 GB card cannot cache with a bf16 T5-XXL (9.5 GB), hence sd-scripts' fp8 T5 advice. The planner must fit
both phases: ``peak_bytes`` / ``total_bytes`` are the larger of the two.

Host RAM (training): the swapped weights (pageable: sd-scripts' ``.to("cpu", non_blocking=True)`` does not
pin) + the encoders and AE parked on the host + the process baseline; while loading, the whole transformer
passes through RAM at its file dtype.

Wan 2.2's two experts in one run (musubi's ``--dit_high_noise``; ``wan_train_network.py`` keeps the inactive
expert's state dict and swaps it in with ``load_state_dict(assign=True)`` when the sampled timestep crosses the
boundary; one LoRA serves both): each expert's resident blocks stay on the card and each one's swapped blocks on
the host (``weights_inactive_expert``: a second resident set), or, with ``offload_inactive_dit`` (no block swap
then), the inactive expert waits whole in host RAM and the card holds one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self, cast

from autotune.estimate.memory_model import (
    DEFAULT_ALLOCATOR_OVERHEAD,
    DEFAULT_CUDA_CONTEXT_GIB,
    DEFAULT_SAFETY_MARGIN_GIB,
    GIB,
    MemoryEstimate,
    canonical_optimizer,
    optimizer_state_bytes,
    state_share,
)
from autotune.estimate.sharded_weights import gathered_bytes, sharded_bytes
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, get_family

if TYPE_CHECKING:
    from sd_scripts_compat.facts.settings import TrainSettings

DIT_CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "data" / "dit_calibration.json"


@cache
def load_dit_calibration(path: str = str(DIT_CALIBRATION_PATH)) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{file}: transformer memory calibration missing; regenerate it with "
                        "bench/calibrate_dit_memory.py")
    return json.loads(file.read_text(encoding="utf-8"))


def dit_family_calibration(family: str, calibration: dict[str, Any] | None = None,
                           autocast_rules: str = "cuda") -> dict[str, Any]:
    """The calibration of one FLUX family: the file's top level (FLUX.1's 12 B transformer, shared by dev and
    schnell) with the family's own ``variants`` entry (architecture, activation coefficients) over it; under
    ``autocast_rules="cpu"`` (a CPU plan) the coefficients its ``cpu_rules`` entry holds (traced under CPU
    autocast's op lists) replace those traced under CUDA's."""
    cal = calibration or load_dit_calibration()
    variant = cal.get("variants", {}).get(family)
    entry = {**cal, **variant} if variant else cal
    if autocast_rules == "cpu":
        return {**entry, **(variant or cal).get("cpu_rules", {})}
    return entry


def is_dit_family(family: FamilySpec) -> bool:
    """True for the families this model covers (listed in the calibration file, not in code)."""
    return family.name in load_dit_calibration()["families"]


@dataclass(frozen=True)
class DitMemoryInputs:
    resolution: int
    batch_size: int = 1
    rank: int = 16
    gradient_checkpointing: bool = True
    optimizer: str = "AdamW8bit"
    fp8_base: bool = True
    blocks_to_swap: int = 0
    cpu_offload_checkpointing: bool = False  # the checkpointed block inputs wait on the host (with checkpointing)
    cache_text_encoder_outputs: bool = True
    cache_latents: bool = True
    t5_fp8: bool = False  # the T5-XXL file is float8 (t5xxl_fp8_e4m3fn): half the caching-phase weights
    text_encoders_on_cpu: bool = False  # caching runs the encoders on the CPU (HunyuanImage's text_encoder_cpu)
    frames: int = 1  # video frames of one sample (Wan's target_frames, N*4+1); 1 for an image
    pinned_block_swap: bool = False  # musubi's use_pinned_memory_for_block_swap: the swapped weights get pinned
    high_noise_expert: bool = False  # Wan 2.2: both experts in one run (musubi's --dit_high_noise)
    offload_inactive_dit: bool = False  # ... the inactive one in host RAM instead of on the card
    expert_switch_share: float = 0.0  # micro-steps whose expert differs from the one before (speed only)
    lora_dtype: str = "fp32"
    height: int | None = None
    family: str = "flux-dev"
    cuda_context_gib: float = DEFAULT_CUDA_CONTEXT_GIB
    allocator_overhead: float = DEFAULT_ALLOCATOR_OVERHEAD
    safety_margin_gib: float = DEFAULT_SAFETY_MARGIN_GIB
    autocast_rules: str = "cuda"  # "cpu" for a CPU plan: coefficients traced under CPU autocast's op lists
    shard_ranks: int = 1  # fsdp: the transformer sharded across this many processes (training.sharding)
    shard_offload: bool = False  # fsdp_offload_params: each process's share of the parameters in host RAM
    state_ranks: int = 1  # shard_optimizer_state: the LoRA's optimizer state split across this many processes

    @classmethod
    def of_trace(cls, config: dict[str, Any], family: str) -> DitMemoryInputs:
        """The inputs of one traced configuration (a ``traces`` row of the calibration file)."""
        keys = ("resolution", "batch_size", "rank", "gradient_checkpointing", "optimizer", "fp8_base", "blocks_to_swap")
        return cls(family=family, frames=config.get("frames", 1), **{key: config[key] for key in keys})


def dit_inputs_for_settings(family: FamilySpec, settings: TrainSettings, *, t5_fp8: bool = False,
                            processes: int = 1) -> DitMemoryInputs:
    """The FLUX model's inputs for one ``TrainSettings`` (the planner's and the OOM ladder's one mapping) in a run of
    ``processes``; what the settings do not hold (the machine's, the plan's profile) a caller adds with
    ``dataclasses.replace``."""
    width, height = settings.resolution
    return DitMemoryInputs(
        family=family.name, resolution=width, height=height if height != width else None,
        batch_size=settings.train_batch_size, rank=settings.network_dim,
        gradient_checkpointing=settings.gradient_checkpointing, optimizer=settings.optimizer_type,
        fp8_base=settings.fp8_base, blocks_to_swap=settings.blocks_to_swap,
        cpu_offload_checkpointing=settings.cpu_offload_checkpointing and settings.gradient_checkpointing,
        cache_text_encoder_outputs=settings.cache_text_encoder_outputs, cache_latents=settings.cache_latents,
        t5_fp8=t5_fp8, lora_dtype="bf16" if settings.full_bf16 else "fp16" if settings.full_fp16 else "fp32",
        frames=settings.frames,
        pinned_block_swap=settings.use_pinned_memory_for_block_swap and settings.blocks_to_swap > 0,
        high_noise_expert=settings.high_noise_expert, offload_inactive_dit=settings.offload_inactive_dit,
        shard_ranks=settings.shard_ranks(processes),
        shard_offload=bool(settings.fsdp and settings.fsdp_offload_params),
        state_ranks=settings.state_ranks(processes))


@dataclass(frozen=True)
class DitMemoryEstimate(MemoryEstimate):
    """Training-phase components (summing to the training total) plus the caching phase and host RAM."""

    TENSOR_PARTS: ClassVar[tuple[str, ...]] = (
        "weights_transformer", "weights_inactive_expert", "weights_text_encoders", "weights_vae", "lora_params",
        "lora_grads", "optimizer_state", "activations")
    caching_peak: int = 0  # text-encoder caching phase: tensors + context + allocator slack
    pinned_host_bytes: int = 0  # of host_ram_bytes, page-locked (musubi's swap staging or pinned swapped blocks)
    host_ram_bytes: int = 0  # while training
    host_ram_loading_bytes: int = 0  # while loading (the transformer passes through RAM) or caching on the CPU
    swapped_bytes: int = 0  # weight bytes of the swapped blocks (moved twice each way per step)

    @property
    def training_peak_bytes(self) -> int:
        return super().peak_bytes + self.components.get("swap_buffers", 0)

    @property
    def training_total_bytes(self) -> int:
        """Training phase only, with the safety margin (the OOM ladder's figure: caching is over by then)."""
        return self.training_peak_bytes + self.components["safety_margin"]

    @property
    def peak_bytes(self) -> int:
        return max(self.training_peak_bytes, self.caching_peak)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.components["safety_margin"]

    def training_only(self) -> Self:
        """Without the caching phases (text encoders, latents): they run before the steps."""
        return replace(self, caching_peak=0)

    def scaled(self, factor: float) -> Self:
        """The device figures times ``factor``, the caching phase's too (``MemoryEstimate.scaled``)."""
        return replace(super().scaled(factor), caching_peak=int(self.caching_peak * factor))


def _block_bytes(block: dict[str, Any], fp8: bool) -> tuple[int, int]:
    """(all bytes, swapped .weight bytes) of one block: fp8 Linear weights take 1 byte, the rest 2."""
    total = 2 * block["elements"] - (block["fp8_elements"] if fp8 else 0)
    swapped = 2 * block["swap_elements"] - (block["fp8_elements"] if fp8 else 0)
    return total, swapped


def _blocks(group: dict[str, Any]) -> list[dict[str, int]]:
    """Each block of a group with its sizes: all alike, or a group's ``per_block`` list where blocks differ
    (SD3.5 Medium's MMDiT-X blocks 0-12 and its pre-only last block)."""
    if "per_block" in group:
        return [{"elements": e, "swap_elements": s, "fp8_elements": f} for e, s, f in group["per_block"]]
    return [group] * group["count"]


def _swapped_blocks(arch: dict[str, Any], split: tuple[int, ...]) -> list[dict[str, int]]:
    """The blocks ``split`` swaps: the last ones of each group (the engine's and sd-scripts' rule)."""
    out: list[dict[str, int]] = []
    for n, group in zip(split, arch["block_groups"]):
        out += _blocks(group)[len(_blocks(group)) - n:] if n else []
    return out


def transformer_bytes(arch: dict[str, Any], fp8: bool, split: tuple[int, ...]) -> tuple[int, int]:
    """(resident GPU bytes, host bytes) of the transformer's weights with ``split`` blocks of each group swapped
    (``FamilySpec.swap_split``: the engine's rule, one count per block group in the family's order)."""
    rest = arch["rest"]
    full = sum(_block_bytes(block, fp8)[0] for group in arch["block_groups"] for block in _blocks(group)) \
        + 2 * rest["elements"] - (rest["fp8_elements"] if fp8 else 0)
    host = sum(_block_bytes(block, fp8)[1] for block in _swapped_blocks(arch, split))
    return full - host, host


def _each_block_bytes(arch: dict[str, Any], fp8: bool = False) -> list[int]:
    """Every block's bytes (16-bit, or its Linear weights in 1 byte with ``fp8``), in the family's order (the units a
    sharded transformer gathers)."""
    return [_block_bytes(block, fp8)[0] for group in arch["block_groups"] for block in _blocks(group)]


def _root_bytes(arch: dict[str, Any], fp8: bool) -> int:
    """The parameters and buffers outside the blocks (the root unit of a sharded transformer)."""
    rest = arch["rest"]
    return 2 * rest["elements"] - (rest["fp8_elements"] if fp8 else 0)


def sharded_transformer_bytes(arch: dict[str, Any], ranks: int, checkpoint_bytes: int | None = None,
                              fp8: bool = False) -> tuple[int, int]:
    """(bytes each of ``ranks`` processes holds, bytes gathered in flight at the step's peak) of a transformer sharded
    block by block (``estimate.sharded_weights``), with ``fp8`` its frozen Linear weights stored (and gathered) in
    float8. FLUX.1 dev's peak is at its last two single blocks (its double blocks come 38 freed inputs later),
    SD3.5 Large's at the pair before its smaller last block."""
    buffers = 2 * arch["rest"].get("buffer_elements", 0)
    return sharded_bytes(_each_block_bytes(arch, fp8), _root_bytes(arch, fp8) - buffers, buffers, ranks,
                         checkpoint_bytes)


def gathered_bytes_per_step(arch: dict[str, Any], ranks: int, offload: bool = False, fp8: bool = False) -> int:
    """Bytes each process receives per micro-step of a sharded transformer (``sharded_weights.gathered_bytes``)."""
    return gathered_bytes(_each_block_bytes(arch, fp8), _root_bytes(arch, fp8), ranks, offload)


def swap_buffer_bytes(arch: dict[str, Any], fp8: bool, split: tuple[int, ...]) -> int:
    """Device copies in flight beside the resident blocks: our engine's swapper (``training/block_swap.py``)
    copies a swapped block into a fresh buffer and prefetches the next, so up to two of the largest swapped
    blocks; sd-scripts copies into the storage of the block it evicts and needs none (the traces model that)."""
    sizes = [_block_bytes(block, fp8)[1] for block in _swapped_blocks(arch, split)]
    return 2 * max(sizes) if sizes else 0


def lora_sizes(arch: dict[str, Any], rank: int) -> list[tuple[int, int]]:
    """(elements, count) of every LoRA tensor (down [r, in], up [out, r])."""
    out = []
    for shape, count in arch["lora_modules"].items():
        fan_in, fan_out = (int(x) for x in shape.split("x"))
        out += [(rank * fan_in, count), (rank * fan_out, count)]
    return out


def encoder_bytes(arch: dict[str, Any], t5_fp8: bool) -> int:
    """The text encoders' bf16 bytes; ``t5_fp8``: the largest one (FLUX's / SD3's T5-XXL, HunyuanImage's
    Qwen2.5-VL under ``fp8_vl``) in fp8."""
    sizes = list(arch["text_encoders"].values())
    return 2 * sum(sizes) - (max(sizes) if t5_fp8 and sizes else 0)


def activation_tokens(arch: dict[str, Any], family: str, resolution: int, height: int | None = None,
                      frames: int = 1) -> int:
    """Tokens one sample's activations grow with: its image tokens (times its latent frames for a video),
    plus the text tokens where they join the sequence (joint attention); a cross-attention transformer (Anima,
    Wan) keeps the text beside it."""
    joint = any(group.get("attention") != "cross" for group in arch["block_groups"])
    spec = get_family(family)
    image = spec.image_tokens(resolution, height) * spec.latent_frames(frames)
    return image + (arch["text_tokens"] if joint else 0)


def offloaded_checkpoint_bytes(cal: dict[str, Any], i: DitMemoryInputs) -> int:
    """Bytes ``cpu_offload_checkpointing`` keeps on the host instead of the device: every checkpointed block's
    bf16 input (its tokens x the hidden width) but the one in flight (0 without offload or checkpointing)."""
    if not (i.cpu_offload_checkpointing and i.gradient_checkpointing):
        return 0
    arch = cal["architecture"]
    blocks = sum(group["count"] for group in arch["block_groups"])
    return (blocks - 1) * block_input_bytes(arch, i)


def block_input_bytes(arch: dict[str, Any], i: DitMemoryInputs) -> int:
    """One block's bf16 input (its tokens x the hidden width x the micro-batch): what checkpointing saves of it."""
    return 2 * int(arch["hidden"]) * activation_tokens(arch, i.family, i.resolution, i.height, i.frames) \
        * i.batch_size


def _activations(cal: dict[str, Any], i: DitMemoryInputs, lora_grad_bytes: int) -> int:
    gc = "gc" if i.gradient_checkpointing else "no_gc"
    coef = cal["activations"][gc]
    tokens = activation_tokens(cal["architecture"], i.family, i.resolution, i.height, i.frames)
    per_sample = coef.get("d", 0.0) + tokens * (coef["a"] + coef["b"] * i.rank)
    act = coef["c0"] + coef["c1"] * i.rank + i.batch_size * per_sample
    if i.fp8_base:
        act += cal["fp8_extra"][gc]
    act = max(0.0, act - offloaded_checkpoint_bytes(cal, i))
    if i.optimizer == "AdamW":  # foreach AdamW holds one parameter-sized temporary beside the gradients (traced:
        act = max(act, lora_grad_bytes)  # a small checkpointed step at rank 32 peaks in the optimizer)
    if not i.cache_latents:
        act = max(act, cal["ae_encode_per_image_pixel"] * i.batch_size * i.resolution * (i.height or i.resolution))
    return int(round(act))


def predict_dit_memory(inputs: DitMemoryInputs, calibration: dict[str, Any] | None = None) -> DitMemoryEstimate:
    """Predict both phases' peak VRAM and the host RAM of one FLUX LoRA step (see the module doc)."""
    if inputs.batch_size < 1 or inputs.rank < 1:
        raise UserError(f"FLUX memory model input {inputs}: batch_size and rank must be >= 1")
    inputs = replace(inputs, optimizer=canonical_optimizer(inputs.optimizer))
    cal = dit_family_calibration(inputs.family, calibration, inputs.autocast_rules)
    arch = cal["architecture"]
    family = get_family(inputs.family)
    split = family.swap_split(inputs.blocks_to_swap)
    resident, host = transformer_bytes(arch, inputs.fp8_base, split)
    offloaded = 0  # fsdp_offload_params: the share of the parameters waiting in (pinned) host RAM
    if inputs.shard_ranks > 1:  # no swapped blocks beside sharding (training.sharding.check_sharding)
        shard, gathered = sharded_transformer_bytes(
            arch, inputs.shard_ranks, block_input_bytes(arch, inputs) if inputs.gradient_checkpointing else None,
            inputs.fp8_base)
        offloaded = shard - 2 * arch["rest"].get("buffer_elements", 0) if inputs.shard_offload else 0
        resident, host = shard - offloaded + gathered, 0
    sizes = lora_sizes(arch, inputs.rank)
    n_params = sum(numel * count for numel, count in sizes)
    n_modules = sum(arch["lora_modules"].values())
    param_bytes = 4 if inputs.lora_dtype == "fp32" else 2
    encoders, ae = encoder_bytes(arch, inputs.t5_fp8), 2 * arch["ae_elements"]
    both_on_card = inputs.high_noise_expert and not inputs.offload_inactive_dit
    components = {
        "weights_transformer": resident + 4 * n_modules,
        "weights_inactive_expert": resident if both_on_card else 0,
        "weights_text_encoders": 0 if inputs.cache_text_encoder_outputs else encoders,
        "weights_vae": 0 if inputs.cache_latents else ae,
        "lora_params": param_bytes * n_params,
        "lora_grads": param_bytes * n_params,
        "optimizer_state": int(optimizer_state_bytes(inputs.optimizer, sizes, inputs.rank, param_bytes)
                               * state_share(sizes, inputs.state_ranks)),
        "activations": _activations(cal, inputs, param_bytes * n_params),
    }
    tensor_peak = sum(components.values())
    # our engine's swapper needs its buffers; a family only sd-scripts trains swaps into the evicted storage
    components["swap_buffers"] = swap_buffer_bytes(arch, inputs.fp8_base, split) if family.trained_here else 0
    context = int(inputs.cuda_context_gib * GIB)
    components["cuda_context"] = context
    components["allocator_overhead"] = int(inputs.allocator_overhead * tensor_peak)
    components["safety_margin"] = int(inputs.safety_margin_gib * GIB)
    notes = [f"blocks_to_swap {inputs.blocks_to_swap}: {host / GIB:.2f} GiB of block weights on the host"] \
        if inputs.blocks_to_swap else []
    if offloaded:
        notes.append(f"fsdp_offload_params: {offloaded / GIB:.2f} GiB of this process's share in pinned host RAM")
    caching = 0
    if inputs.cache_text_encoder_outputs and not inputs.text_encoders_on_cpu:
        cache_tensors = encoders + cal["caching_transient_bytes"]
        caching = int(cache_tensors * (1 + inputs.allocator_overhead)) + context
        if caching > tensor_peak * (1 + inputs.allocator_overhead) + context:
            notes.append(f"peak is the text-encoder caching ({'fp8' if inputs.t5_fp8 else 'bf16'} largest text "
                         "encoder on the GPU)")
    latent = latent_caching_bytes(cal, inputs)
    if latent:  # musubi runs its two caching steps apart: the caching phase is the larger of them
        latent = int(latent * (1 + inputs.allocator_overhead)) + context
        if latent > max(caching, tensor_peak * (1 + inputs.allocator_overhead) + context):
            notes.append("peak is the latent caching (the VAE encoding one sample at a time)")
        caching = max(caching, latent)
    host_base = int(cal["host_ram_baseline_gib"] * GIB)
    # sd-scripts parks the encoders and AE on the host; musubi-tuner caches in separate processes and trains
    # without them
    parked = 0 if family.trains_with.caches_apart else ae + (encoders if inputs.cache_text_encoder_outputs else 0)
    pinned = musubi_pinned_bytes(arch, inputs, split, host) if family.trains_with.host_swap_options else 0
    experts_host = inactive_expert_host_bytes(arch, inputs, host)
    loading = 2 * _all_elements(arch)  # a bf16 file passes through RAM whole (fp8_base casts after loading)
    # musubi's caching step on the CPU holds the encoders in RAM (sd-scripts' are counted in its loading already)
    if family.trains_with.caches_apart and inputs.cache_text_encoder_outputs and inputs.text_encoders_on_cpu:
        cpu_caching = encoders + cal["caching_transient_bytes"]
        if cpu_caching > loading:
            notes.append(f"host RAM peak is the text-encoder caching on the CPU ({cpu_caching / GIB:.1f} GiB)")
        loading = max(loading, cpu_caching)
    return DitMemoryEstimate(
        inputs=cast(Any, inputs),  # a DiT's inputs where the UNet estimate has its own
        components=components, lora_params=n_params, notes=tuple(notes), caching_peak=caching,
        pinned_host_bytes=pinned,  # the staging copies add to the host; pinned swapped blocks replace theirs
        host_ram_bytes=host + offloaded + experts_host + parked + host_base + offloaded_checkpoint_bytes(cal, inputs)
        + (pinned - host - experts_host if inputs.pinned_block_swap else pinned),
        host_ram_loading_bytes=loading + host_base + (0 if family.trains_with.caches_apart else encoders + ae)
        + (host if inputs.high_noise_expert else 0),  # the second expert loads beside the first's swapped blocks
        swapped_bytes=host)


def latent_caching_bytes(cal: dict[str, Any], inputs: DitMemoryInputs) -> int:
    """Tensor bytes of musubi's latent-caching step (``cache_latents``, one sample at a time): the VAE's weights and
    the encode transient from the family's traced fit (``a + b x pixels``; clips add ``d x pixels x`` their frames
    beyond the fit's); 0 without a fit (the
    families sd-scripts trains cache inside training, counted there)."""
    fit = cal.get("latent_caching")
    if not fit or not inputs.cache_latents:
        return 0
    pixels = inputs.resolution * (inputs.height or inputs.resolution)
    if inputs.frames > 1 and "clip" in fit:
        a, b, d, frames = fit["clip"]
        return int(fit["weights_bytes"] + a + b * pixels + d * pixels * (inputs.frames - frames))
    a, b = fit["image"]
    return int(fit["weights_bytes"] + a + b * pixels)


def inactive_expert_host_bytes(arch: dict[str, Any], inputs: DitMemoryInputs, host: int) -> int:
    """Host bytes of Wan 2.2's inactive expert: its swapped blocks (as many as the active one's), or with
    ``offload_inactive_dit`` all of its weights; 0 for one expert."""
    if not inputs.high_noise_expert:
        return 0
    return expert_bytes(arch, inputs.fp8_base) if inputs.offload_inactive_dit else host


def expert_bytes(arch: dict[str, Any], fp8: bool) -> int:
    """All weight bytes of one transformer (a Wan 2.2 expert), none swapped."""
    return sum(transformer_bytes(arch, fp8, (0,) * len(arch["block_groups"])))


def musubi_pinned_bytes(arch: dict[str, Any], inputs: DitMemoryInputs, split: tuple[int, ...], host: int) -> int:
    """Page-locked host bytes of musubi-tuner's block swap (``custom_offloading_utils.Offloader``): two staging
    copies of one block's weights (GPU->host and host->GPU) by default; with ``use_pinned_memory_for_block_swap``
    every swapped weight becomes pinned after its first round trip (both experts' where Wan 2.2 trains two), plus
    one block's spare buffers."""
    sizes = [_block_bytes(block, inputs.fp8_base)[1] for block in _swapped_blocks(arch, split)]
    if not sizes:
        return 0
    if inputs.pinned_block_swap:
        return host * (2 if inputs.high_noise_expert else 1) + max(sizes)
    return 2 * max(sizes)


def denoiser_loading_bytes(family: FamilySpec) -> int:
    """Bytes of the transformer as it passes through host RAM while loading (bf16)."""
    return 2 * _all_elements(dit_family_calibration(family.name)["architecture"])


def _all_elements(arch: dict[str, Any]) -> int:
    return sum(block["elements"] for group in arch["block_groups"] for block in _blocks(group)) \
        + arch["rest"]["elements"]
