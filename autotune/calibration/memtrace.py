"""Peak tensor memory of one LoRA training step, measured on fake CPU tensors (no GPU, no weights).

The memory model (``autotune.estimate.memory_model``) is analytic so planning stays interactive; this tracer is
its ground truth. It runs one real training step -- forward under the mixed-precision autocast the
trainer uses, backward, optimizer step -- of the full-size built-in architectures on
``FakeTensorMode`` tensors, and sums the bytes of every live tensor storage after each dispatched op.

Facts this rests on (measured, see the stack notes): fake tensors must be CPU fake tensors (the
backward pass aborts with fake CUDA ones); modules cannot be built or ``.to()``-cast under
FakeTensorMode, so we build, cast and add the LoRA on the meta device and then swap every parameter
and buffer for an empty fake CPU tensor; on fake CPU tensors SDPA dispatches to the flash kernel,
which saves what CUDA flash / memory-efficient attention save. torch's MemTracker gives the same
figure but takes minutes (and rejects frozen parameters), hence the engine's small counter
(``sd_scripts_compat.training.live_bytes``).

The step is steady-state: optimizer state exists before it (step 2 onward on a GPU) and gradients
are created during backward (kohya zeroes them with ``set_to_none``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from autotune.calibration.cuda_autocast import autocast_rules as op_lists
from sd_scripts_compat.training.live_bytes import LiveBytesCounter

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.network.lora import LoRANetwork

WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "fp8")
OPTIMIZERS = ("AdamW", "AdamW8bit", "Lion", "Prodigy", "Adafactor")
ATTENTIONS = ("sdpa", "flash", "xformers", "math")
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit state for tensors with fewer elements
BNB_BLOCK = 256  # bitsandbytes' blockwise quantisation: one fp32 absmax per 256 values


@dataclass(frozen=True)
class TraceResult:
    """Peak live tensor bytes of one step and its breakdown (all in bytes).

    ``activations_peak_bytes`` = ``peak_bytes`` - persistent, where persistent = resident weights
    + LoRA params + LoRA grads + optimizer state (grads counted in full even if the peak came
    before backward finished them, so the split is the same one the analytic model uses).
    """

    family: str
    resolution: int
    batch_size: int
    rank: int
    gradient_checkpointing: bool
    optimizer: str
    weight_dtype: str
    mixed_precision: str
    train_text_encoder: bool
    cache_latents: bool
    cache_text_encoder_outputs: bool
    attention: str
    peak_bytes: int
    weights_bytes: int
    lora_param_bytes: int
    lora_grad_bytes: int
    optimizer_state_bytes: int
    activations_peak_bytes: int
    lora_params: int
    peak_phase: str
    phase_peaks: dict[str, int]  # highest live bytes seen in each phase (vae_encode, forward, backward, ...)
    optimizer_state_simulated: bool  # True where the optimizer's kernels cannot run on fake tensors
    seconds: float
    autocast_rules: str = "cuda"  # whose autocast op lists the step ran under (autotune.calibration.cuda_autocast)
    shard_ranks: int = 1  # the UNet sharded across this many processes (one traced; fsdp = "full_shard")
    shard_size: int | None = None  # ... or within groups of this many of them (fsdp = "hybrid_shard")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def latent_downsample(spec: FamilySpec) -> int:
    """Image pixels per latent pixel along a side: ``FamilySpec.latent_downsample`` (from the VAE config)."""
    return int(spec.latent_downsample)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    if name not in table:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {name!r}")
    return table[name]


def fakeify(modules: Iterable[Any], fake_mode: FakeTensorMode) -> None:
    """Replace every meta parameter / buffer with an empty fake CPU tensor of the same shape and dtype.

    Shared (tied) tensors stay shared. Done per tensor because ``Module.to()`` fails under FakeTensorMode.
    """
    import torch

    swapped: dict[int, Any] = {}
    with fake_mode:
        for root in modules:
            for module in root.modules():
                for name, param in list(module._parameters.items()):
                    if param is None:
                        continue
                    if id(param) not in swapped:
                        fake = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                        swapped[id(param)] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
                    module._parameters[name] = swapped[id(param)]
                for name, buf in list(module._buffers.items()):
                    if buf is None:
                        continue
                    if id(buf) not in swapped:
                        swapped[id(buf)] = torch.zeros(buf.shape, dtype=buf.dtype, device="cpu")
                    module._buffers[name] = swapped[id(buf)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a sharded parameter's (a DTensor's) local shard."""
    return getattr(tensor, "_local_tensor", tensor)


@contextlib.contextmanager
def sharded_across(model: torch.nn.Module, spec: FamilySpec, ranks: int, strategy: str, fake_mode: Any,
                   counter: LiveBytesCounter, offload: bool = False, shard_size: int | None = None) -> Iterator[None]:
    """``model`` sharded as the engine shards it (``training.sharding.shard_denoiser``) across ``ranks`` processes
    of torch's fake process group (collectives that move nothing: this process is rank 0), for the duration;
    with ``shard_size`` (hybrid_shard) within groups of that many on the engine's two-dimensional mesh.
    ``model`` has its LoRA already, where the engine shards first: the LoRA lives outside the units (its hooks wrap
    layers inside them), so the units and what each gathers are the same either way.

    FSDP frees a gathered weight by resizing its storage to 0 and gathers it again by resizing it back (its
    ``alloc_storage`` / ``free_storage``), which no dispatched op shows: both are wrapped for the duration to tell
    ``counter``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    from sd_scripts_compat.training.sharding import process_mesh, shard_denoiser

    if dist.is_initialized():
        raise RuntimeError("a sharded trace needs a process without a process group")
    alloc, free = fsdp_param.alloc_storage, fsdp_param.free_storage

    def told(resize: Callable[[torch.Tensor], None]) -> Any:  # Any: mypy will not let a module's def be replaced
        def wrapped(tensor: torch.Tensor) -> None:
            resize(tensor)
            counter.resized(tensor)

        return wrapped

    dist.init_process_group("fake", rank=0, world_size=ranks, store=dist.HashStore())
    try:
        mesh = process_mesh(torch.device("cpu"), shard_size)  # outside the fake mode: it reads its ranks' values
        with fake_mode:
            shard_denoiser(model, spec, strategy, mesh, offload=offload)
        fsdp_param.alloc_storage = fsdp_group.alloc_storage = told(alloc)
        fsdp_param.free_storage = told(free)
        yield
    finally:
        fsdp_param.alloc_storage = fsdp_group.alloc_storage = alloc
        fsdp_param.free_storage = free
        dist.destroy_process_group()


def _storage_bytes(tensors: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_shapes(optimizer: str, param_shapes: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], Any]]:
    """The state tensors an optimizer keeps per parameter, as (shape, torch dtype).

    Used for the optimizers whose kernels cannot run on fake tensors: bitsandbytes' 8-bit AdamW
    (CUDA/C kernels through ctypes pointers; state from bitsandbytes' layout: two uint8 states plus
    one fp32 absmax per 256 values, 32-bit state for tensors under 4096 elements), Lion (bitsandbytes'
    Lion32bit kernel; one fp32 momentum per parameter) and Prodigy (prodigyopt reads tensor values with
    ``.item()``, impossible on fake tensors; four fp32 states, counted in full although prodigyopt keeps
    ``p0`` as a scalar for a tensor that is all zeros, as lora_up is at the start).
    """
    import math

    import torch

    out: list[tuple[tuple[int, ...], Any]] = []
    for shape in param_shapes:
        numel = math.prod(shape)
        if optimizer == "AdamW8bit":
            if numel < BNB_MIN_8BIT_SIZE:
                out += [(shape, torch.float32), (shape, torch.float32)]
            else:
                blocks = (numel + BNB_BLOCK - 1) // BNB_BLOCK
                out += [(shape, torch.uint8), (shape, torch.uint8), ((blocks,), torch.float32),
                        ((blocks,), torch.float32)]
        elif optimizer == "Lion":
            out.append((shape, torch.float32))
        elif optimizer == "Prodigy":  # s, p0, exp_avg, exp_avg_sq (p0 is a scalar for an all-zero lora_up)
            out += [(shape, torch.float32)] * 4
        else:
            raise ValueError(f"no simulated state layout for optimizer {optimizer!r}")
    return out


class _SimulatedOptimizer:
    """Holds fake state tensors with the real optimizer's layout and does an elementwise update.

    The update's temporaries (one param-sized tensor at a time) stand in for the fused kernel's.
    """

    def __init__(self, params: list[Any], optimizer: str) -> None:
        import torch

        self.params = params
        self.state: list[list[Any]] = []
        for p in params:
            layout = optimizer_state_shapes(optimizer, [tuple(p.shape)])
            self.state.append([torch.zeros(s, dtype=d, device=p.device) for s, d in layout])

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-1e-4)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[Any]:
        return [t for group in self.state for t in group]


def make_optimizer(optimizer: str, params: list[Any]) -> tuple[Any, bool]:
    """The optimizer the trainer would build, or a state-faithful simulation; returns (opt, simulated)."""
    import torch

    if optimizer == "AdamW":
        # foreach=True: the CUDA default (CPU defaults to the per-tensor loop), with its temporaries
        return torch.optim.AdamW(params, lr=1e-4, foreach=True), False
    if optimizer == "Adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False, warmup_init=False), False
    if optimizer in ("AdamW8bit", "Lion", "Prodigy"):
        return _SimulatedOptimizer(params, optimizer), True
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")


def steady_state_optimizer(optimizer: str, params: list[Any]) -> tuple[Any, bool, list[Any]]:
    """(optimizer, simulated, its state tensors) after one step on zero gradients: the state exists before the
    traced step, as from a run's second step on. Call inside the fake mode."""
    import torch

    opt, simulated = make_optimizer(optimizer, params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt, simulated, _optimizer_state_tensors(opt)


def _optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[Any]:
    import torch

    if isinstance(opt, _SimulatedOptimizer):
        return opt.state_tensors()
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _attention_context(attention: str) -> AbstractContextManager[None]:
    """sdpa / flash / xformers all save O(N) per head on a GPU: the CPU flash kernel stands in for them."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention == "math":
        return sdpa_kernel(SDPBackend.MATH)
    if attention in ("sdpa", "flash", "xformers"):
        return contextlib.nullcontext()
    raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {attention!r}")


def build_lora(bundle: ModelBundle, rank: int, alpha: float, train_text_encoder: bool) -> LoRANetwork:
    """kohya's LoRA network (sd_scripts_compat.network.lora), applied on the meta device; returns the network."""
    from sd_scripts_compat.network.lora import create_network

    network = create_network(bundle, network_dim=rank, network_alpha=alpha, train_unet=True,
                             train_text_encoder=train_text_encoder)
    network.apply_to()
    return network


def trace_training_step(
    family: str,
    *,
    resolution: int,
    batch_size: int,
    rank: int,
    gradient_checkpointing: bool,
    optimizer: str = "AdamW",
    weight_dtype: str = "fp16",
    mixed_precision: str | None = None,
    train_text_encoder: bool = False,
    cache_latents: bool = True,
    cache_text_encoder_outputs: bool = True,
    attention: str = "sdpa",
    network_alpha: float | None = None,
    lora_builder: Callable[[Any, int, float, bool], Any] | None = None,
    fake: bool = True,
    autocast_rules: str = "cuda",
    shard_ranks: int = 1,
    shard_size: int | None = None,
) -> TraceResult:
    """Trace one LoRA training step of a built-in family on fake CPU tensors; peak live tensor bytes.

    ``mixed_precision`` defaults to the weight dtype (fp32/fp8 -> fp16 autocast for fp8, none for fp32). LoRA
    parameters are fp32, as kohya keeps them. Text encoders are resident when trained or when their outputs are not
    cached (then run under no_grad); the VAE is resident and encodes the batch under no_grad when latents are not
    cached. ``lora_builder`` lets tests use another network. ``fake=False`` runs the same step on real CPU tensors
    with random weights (tiny families only): how the tests check the fake figure against a real run.
    ``autocast_rules``: whose op lists autocast follows, ``"cuda"`` (GPU plans) or ``"cpu"`` (``cuda_autocast``).
    ``shard_ranks`` > 1: the UNet sharded by ``fsdp = "full_shard"`` on a fake process group (:func:`sharded_across`;
    with ``shard_size``, ``"hybrid_shard"`` within groups of that many)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sd_scripts_compat.facts.families import get_family

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {optimizer!r}")
    mixed_precision = mixed_precision or {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "fp16"}[weight_dtype]
    started = time.perf_counter()
    spec = get_family(family)
    bundle, network, module_dtype = _build_for_trace(spec, rank, weight_dtype, mixed_precision, train_text_encoder,
                                                     gradient_checkpointing, network_alpha, lora_builder, fake)
    # the text encoders when trained or encoding uncached captions, the VAE when latents are not cached
    resident: list[Any] = [bundle.unet, network, *(bundle.text_encoders if train_text_encoder or not
                                                   cache_text_encoder_outputs else []),
                           *([] if cache_latents else [bundle.vae])]
    fake_mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        fakeify(resident, fake_mode)
    counter = LiveBytesCounter()
    step = dict(batch_size=batch_size, resolution=resolution, module_dtype=module_dtype,
                autocast_dtype={"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision),
                cache_latents=cache_latents, train_text_encoder=train_text_encoder,
                cache_text_encoder_outputs=cache_text_encoder_outputs)
    with contextlib.ExitStack() as stack:
        if shard_ranks > 1:
            strategy = "hybrid_shard" if shard_size else "full_shard"
            stack.enter_context(sharded_across(bundle.unet, spec, shard_ranks, strategy, fake_mode, counter,
                                               shard_size=shard_size))
        lora_params = [p for p in network.parameters() if p.requires_grad]
        frozen = [_local(t) for m in resident for t in [*m.parameters(), *m.buffers()] if not t.requires_grad]
        weights_bytes = _storage_bytes(frozen)
        lora_param_bytes = _storage_bytes(lora_params)
        with fake_mode, op_lists(autocast_rules):
            simulated, optimizer_state_bytes, lora_grad_bytes = _counted_step(
                bundle, spec, counter, optimizer, lora_params, frozen, attention, step)

    persistent = weights_bytes + lora_param_bytes + lora_grad_bytes + optimizer_state_bytes
    return TraceResult(
        family=family, resolution=resolution, batch_size=batch_size, rank=rank,
        gradient_checkpointing=gradient_checkpointing, optimizer=optimizer, weight_dtype=weight_dtype,
        mixed_precision=mixed_precision, train_text_encoder=train_text_encoder, cache_latents=cache_latents,
        cache_text_encoder_outputs=cache_text_encoder_outputs, attention=attention,
        peak_bytes=counter.peak, weights_bytes=weights_bytes, lora_param_bytes=lora_param_bytes,
        lora_grad_bytes=lora_grad_bytes, optimizer_state_bytes=optimizer_state_bytes,
        activations_peak_bytes=counter.peak - persistent, lora_params=sum(p.numel() for p in lora_params),
        peak_phase=counter.peak_phase, phase_peaks=dict(counter.phase_peaks), optimizer_state_simulated=simulated,
        seconds=round(time.perf_counter() - started, 2), autocast_rules=autocast_rules, shard_ranks=shard_ranks,
        shard_size=shard_size)


def _counted_step(bundle: ModelBundle, spec: FamilySpec, counter: LiveBytesCounter, optimizer: str,
                  lora_params: list[Any], frozen: list[Any], attention: str,
                  step: dict[str, Any]) -> tuple[bool, int, int]:
    """One forward, backward and optimizer step under ``counter`` (inside the caller's fake mode): whether the
    optimizer state was simulated, its bytes, and the LoRA gradients' bytes."""
    opt, simulated, state_tensors = steady_state_optimizer(optimizer, lora_params)
    optimizer_state_bytes = _storage_bytes(state_tensors)
    counter.register([*frozen, *lora_params, *state_tensors])
    counter.reset_peak()
    with counter.mode(), _attention_context(attention):
        _forward_backward(bundle, spec, counter, **step)
        grads = [p.grad for p in lora_params if p.grad is not None]
        lora_grad_bytes = _storage_bytes(grads)
        del grads
        counter.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return simulated, optimizer_state_bytes, lora_grad_bytes


def _build_for_trace(spec: FamilySpec, rank: int, weight_dtype: str, mixed_precision: str, train_text_encoder: bool,
                     gradient_checkpointing: bool, network_alpha: float | None,
                     lora_builder: Callable[[Any, int, float, bool], Any] | None, fake: bool) -> tuple[Any, Any, Any]:
    """The family's modules (meta device when ``fake``) in the traced dtype, with the LoRA applied."""
    import torch

    from sd_scripts_compat.models.build import build_modules

    store_dtype = torch_dtype(weight_dtype)
    module_dtype = torch.float16 if weight_dtype == "fp8" else store_dtype
    bundle = build_modules(spec, device="meta" if fake else "cpu", dtype=module_dtype, seed=None if fake else 0)
    if weight_dtype == "fp8":  # the engine's fp8_base: UNet Linear/Conv weights in 1 byte, upcast per call
        from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

        store_frozen_weights_in_fp8(bundle.unet, torch.bfloat16 if mixed_precision == "bf16" else torch.float16)
    builder = lora_builder or build_lora
    network = builder(bundle, rank, float(network_alpha if network_alpha is not None else rank),
                      train_text_encoder)
    network.to(torch.float32)  # kohya trains LoRA weights in fp32 under mixed precision
    if gradient_checkpointing:
        bundle.unet.enable_gradient_checkpointing()
        bundle.unet.train()
        if train_text_encoder:
            for te in bundle.text_encoders:
                te.gradient_checkpointing_enable()
                te.train()
    return bundle, network, module_dtype


def _forward_backward(bundle: ModelBundle, spec: FamilySpec, counter: LiveBytesCounter, *, batch_size: int,
                      resolution: int, module_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
                      cache_latents: bool, train_text_encoder: bool, cache_text_encoder_outputs: bool) -> None:
    """One micro-step's inputs, forward and backward, each phase named on ``counter``."""
    import torch

    latent_size = resolution // latent_downsample(spec)
    latent_channels = spec.vae.get("latent_channels", 4)
    counter.phase = "inputs"
    if cache_latents:
        latents = torch.empty(batch_size, latent_channels, latent_size, latent_size, dtype=torch.float32)
    else:
        images = torch.empty(batch_size, 3, resolution, resolution, dtype=module_dtype)
        counter.phase = "vae_encode"
        with torch.no_grad():
            latents = bundle.vae.encode(images).latent_dist.sample().float() * 0.18215
        del images
    counter.phase = "text_encode"
    cond, pooled = _text_conditioning(bundle, batch_size, train_text_encoder, cache_text_encoder_outputs,
                                      module_dtype, autocast_dtype)
    counter.phase = "forward"
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (batch_size,))
    scale = torch.rand(batch_size, 1, 1, 1)
    noisy = latents * scale + noise * (1 - scale)
    added = None
    if spec.is_sdxl:
        added = {"text_embeds": pooled, "time_ids": torch.empty(batch_size, 6, dtype=cond.dtype)}
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        pred = bundle.unet(noisy, timesteps, cond, added_cond_kwargs=added).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
    del pred, noisy, noise, latents, cond, pooled, added
    counter.phase = "backward"
    loss.backward()
    del loss


def _text_conditioning(bundle: ModelBundle, batch_size: int, train_text_encoder: bool, cached: bool,
                       dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> tuple[Any, Any]:
    """UNet conditioning: cached embeddings, or the text encoders run (with grad only when trained).

    Mirrors how the trainer conditions: each encoder's ``hidden_state`` choice ("last" or
    "penultimate"), concatenated along features (SDXL), and the last encoder's pooled projection.
    """
    import torch

    specs = bundle.family.text_encoders
    width = sum(te.config["hidden_size"] for te in specs)
    pooled_width = specs[-1].config.get("projection_dim", specs[-1].config["hidden_size"])
    tokens = specs[0].tokenizer["model_max_length"]
    if cached and not train_text_encoder:
        return (torch.empty(batch_size, tokens, width, dtype=dtype),
                torch.empty(batch_size, pooled_width, dtype=dtype))
    grad = torch.enable_grad() if train_text_encoder else torch.no_grad()
    hidden, pooled = [], None
    with grad, torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        for te, te_spec in zip(bundle.text_encoders, specs, strict=True):
            ids = torch.zeros(batch_size, te_spec.tokenizer["model_max_length"], dtype=torch.long)
            out = te(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2] if te_spec.hidden_state == "penultimate" else out.last_hidden_state)
            pooled = out.text_embeds if hasattr(out, "text_embeds") else out.pooler_output
    cond = torch.cat(hidden, dim=-1) if len(hidden) > 1 else hidden[0]
    return cond, pooled


def architecture_facts(family: str, reference_resolution: int | None = None) -> dict[str, Any]:
    """Exact counts the analytic memory model needs, read off the meta-device architecture.

    Parameter counts per module (floating point, cast with the weight dtype; other buffer bytes kept
    as they are), how many UNet parameters are Linear/Conv2d weights (stored in 1 byte under fp8), the
    LoRA modules kohya would create (per part, as per-rank (down, up) element counts with
    multiplicities, so counts and bitsandbytes' 4096-element threshold are exact for any rank), and
    attention-score counts per sample (self-attention ~ latent_pixels^2, cross ~ latent_pixels) from
    the shapes every ``scaled_dot_product_attention`` call sees at ``reference_resolution``.
    """
    import math
    from collections import Counter

    import torch

    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.network.lora import iter_target_modules

    spec = get_family(family)
    bundle = build_modules(spec, device="meta", seed=None)

    def sizes(module: torch.nn.Module) -> dict[str, int]:
        floating = sum(p.numel() for p in module.parameters())
        other = 0
        for buf in module.buffers():
            if buf.is_floating_point():
                floating += buf.numel()
            else:
                other += buf.numel() * buf.element_size()
        return {"float_elements": floating, "other_buffer_bytes": other}

    from sd_scripts_compat.training.sharding import shard_units

    unet: dict[str, Any] = sizes(bundle.unet)
    unet["fp8_elements"] = sum(m.weight.numel() for m in bundle.unet.modules()
                               if isinstance(m, torch.nn.Linear | torch.nn.Conv2d))
    # the units fsdp shards one by one (a ResNet or transformer block each), in forward order
    unet["shard_unit_elements"] = [sum(p.numel() for p in unit.parameters())
                                   for unit in shard_units(bundle.unet, spec)]
    lora: dict[str, dict[str, Counter[str]]] = {}
    plain = {name for name, *_ in iter_target_modules(bundle, conv=False)}
    for name, part, base, uses_conv_dim in iter_target_modules(bundle, conv=True):
        if isinstance(base, torch.nn.Conv2d):
            down = base.in_channels * math.prod(base.kernel_size)
            out = base.out_channels
        else:
            down, out = base.in_features, base.out_features
        # "linear": network_dim modules always there; "conv": 3x3 convs (conv_dim); "locon_linear":
        # network_dim modules that only exist with conv_dim (resnet time_emb_proj, 1x1 shortcuts)
        kind = "conv" if uses_conv_dim else ("linear" if name in plain else "locon_linear")
        lora.setdefault(part, {}).setdefault(kind, Counter())[f"{down}x{out}"] += 1

    resolution = reference_resolution or spec.resolution
    scores = _attention_scores(bundle, resolution)
    return {
        "family": family,
        "unet": unet,
        "text_encoders": [sizes(te) for te in bundle.text_encoders],
        "text_encoder_prefixes": [te.lora_prefix for te in spec.text_encoders],
        "vae": sizes(bundle.vae),
        "lora_modules": {part: {kind: dict(sorted(c.items())) for kind, c in kinds.items()}
                         for part, kinds in lora.items()},
        "attention_reference_resolution": resolution,
        "latent_downsample": latent_downsample(spec),
        **scores,
    }


def _attention_scores(bundle: ModelBundle, resolution: int) -> dict[str, float]:
    """Attention-score elements per sample of one UNet forward, split self (~P^2) / cross (~P).

    Records the (heads, queries, keys) of every SDPA call in a meta forward; the wrapper is installed
    only for that call and restored after (diffusers looks the function up on each call).
    """
    import torch
    import torch.nn.functional as F

    calls: list[tuple[int, int, int]] = []
    original = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append((q.shape[-3] if q.dim() == 4 else 1, q.shape[-2], k.shape[-2]))
        return original(q, k, *args, **kwargs)

    unet = bundle.unet
    latent = resolution // latent_downsample(bundle.family)
    pixels = latent * latent
    cross_dim = unet.config.cross_attention_dim
    with torch.device("meta"):
        x = torch.empty(1, unet.config.in_channels, latent, latent)
        cond = torch.empty(1, 77, cross_dim)
        added = None
        if bundle.family.is_sdxl:
            pooled = unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim
            added = {"text_embeds": torch.empty(1, pooled),
                     "time_ids": torch.empty(1, 6)}
        setattr(F, "scaled_dot_product_attention", recording)  # noqa: B010 - traced, then put back
        try:
            with torch.no_grad():
                unet(x, torch.tensor([1]), cond, added_cond_kwargs=added)
        finally:
            F.scaled_dot_product_attention = original
    self_scores = [h * nq * nk for h, nq, nk in calls if nk != 77]
    cross_scores = [h * nq * nk for h, nq, nk in calls if nk == 77]
    return {
        "attn_self_scores_per_pixel2": sum(self_scores) / pixels**2,
        "attn_self_max_layer_per_pixel2": max(self_scores, default=0) / pixels**2,
        "attn_cross_scores_per_pixel": sum(cross_scores) / pixels,
    }
