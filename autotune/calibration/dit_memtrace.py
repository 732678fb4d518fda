"""Peak tensor memory of one LoRA training step of a transformer (DiT) family, on fake CPU tensors.

Same method as ``autotune.calibration.memtrace`` (build on the meta device, swap parameters for empty fake
CPU tensors, count live storages per dispatched op with its ``LiveBytesCounter``), for any family the engine
builds, parameterised by the family's data:

- The transformer is the engine's own (``models.build.build_modules`` from the family JSON; a test may give
  another denoiser config) with the engine's own kohya LoRA network (``network.lora.create_network``: FLUX's
  304 modules, fused ``img_attn_qkv`` / ``linear1`` as kohya's), fp32 as kohya trains it.
- Block swap follows the family's rule (``FamilySpec.swap_split`` over its ``transformer_block_groups``): the
  last blocks of each group; only their ``.weight`` tensors live on the host (biases and other parameters stay
  on the GPU) and a block swapped in takes the GPU storage of the block swapped out (sd-scripts'
  ``swap_weight_devices_cuda`` copies into it), so the counter ignores the swapped weights' storages.
- The step feeds the denoiser what its training script feeds it with cached latents and text-encoder outputs:
  one function per denoiser class (:data:`FORWARDS`; FLUX.1's packed tokens, T5 and CLIP outputs, ids,
  guidance), the only part a new architecture adds besides its family data.

Text encoders and the AE are not traced in the step (plans cache their outputs); their sizes come from the
engine's modules (:func:`dit_architecture_facts`), the caching phase from :func:`trace_text_encoder_caching`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from autotune.calibration.cuda_autocast import autocast_rules as op_lists
from autotune.calibration.memtrace import (
    LiveBytesCounter,
    _local,
    _storage_bytes,
    fakeify,
    sharded_across,
    steady_state_optimizer,
)
from sd_scripts_compat.facts.families import FamilySpec, get_family, model_config

if TYPE_CHECKING:
    import torch
    from diffusers import ModelMixin

    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.network.lora import LoRANetwork

DEFAULT_FAMILY = "flux-dev"


def trace_family(family: str | FamilySpec = DEFAULT_FAMILY, config: dict[str, Any] | None = None) -> FamilySpec:
    """The family to trace; ``config`` replaces its denoiser's config (tests trace tiny variants)."""
    spec = get_family(family) if isinstance(family, str) else family
    if config is None:
        return spec
    return replace(spec, unet={"_class_name": spec.unet["_class_name"], **config})


def build_bundle(spec: FamilySpec, *, materialize: bool = False, dtype: torch.dtype | None = None,
                 device: str = "cpu") -> ModelBundle:
    """The engine's modules of ``spec`` on the meta device, the denoiser frozen in ``dtype`` (bf16); with
    ``materialize`` the denoiser gets real random weights (N(0, 0.02)) on ``device`` (a GPU draws 12 B of them in
    seconds, a host core in minutes), the rest stays meta."""
    import torch

    from sd_scripts_compat.models.build import build_modules

    bundle = build_modules(spec, device="meta", seed=None)
    bundle.unet.requires_grad_(False)
    bundle.unet.to(dtype or torch.bfloat16)
    if materialize:
        bundle.unet = bundle.unet.to_empty(device=device)
        with torch.no_grad():
            for tensor in [*bundle.unet.parameters(), *bundle.unet.buffers()]:
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
    return bundle


def engine_lora(bundle: ModelBundle, rank: int, alpha: float | None = None) -> LoRANetwork:
    """The engine's kohya LoRA network on the bundle's denoiser (where its weights are), applied, in fp32."""
    import torch

    from sd_scripts_compat.network.lora import create_network

    network = create_network(bundle, network_dim=rank, network_alpha=float(alpha if alpha is not None else rank),
                             train_unet=True, train_text_encoder=False)
    network.apply_to()
    network.to(torch.float32)
    return network


def enable_checkpointing(model: ModelMixin) -> None:
    """diffusers' gradient checkpointing, with a checkpoint function that takes keyword arguments (diffusers'
    own does not, and HunyuanImage's blocks pass ``attention_mask=`` to it)."""
    import functools

    import torch

    model.enable_gradient_checkpointing(gradient_checkpointing_func=functools.partial(
        torch.utils.checkpoint.checkpoint, use_reentrant=False))
    model.train()


def block_lists(model: ModelMixin, spec: FamilySpec) -> list[list[Any]]:
    """The denoiser's block lists in the family's swap order (``transformer_block_groups``)."""
    return [list(getattr(model, group["modules"])) for group in spec.transformer_block_groups]


def swapped_weights(model: ModelMixin, spec: FamilySpec, blocks_to_swap: int) -> list[Any]:
    """The ``.weight`` tensors sd-scripts keeps on the host: of the last blocks of each group the split names."""
    import torch

    lists = block_lists(model, spec)
    split = spec.swap_split(blocks_to_swap)
    out = []
    for count, blocks in zip(split, lists):
        for block in blocks[len(blocks) - count:] if count else []:
            out += [m.weight for m in block.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)]
    return out


@dataclass(frozen=True)
class DitTraceResult:
    """Peak live tensor bytes of one transformer LoRA step and its split (as ``memtrace.TraceResult``)."""

    resolution: int
    batch_size: int
    rank: int
    gradient_checkpointing: bool
    optimizer: str
    fp8_base: bool
    blocks_to_swap: int
    peak_bytes: int
    weights_bytes: int  # resident frozen weights (swapped block weights excluded)
    swapped_weight_bytes: int  # on the host
    lora_param_bytes: int
    lora_grad_bytes: int
    optimizer_state_bytes: int
    activations_peak_bytes: int
    lora_params: int
    peak_phase: str
    seconds: float
    frames: int = 1  # video frames of one sample (Wan); 1 for an image
    autocast_rules: str = "cuda"  # whose autocast op lists the step ran under (autotune.calibration.cuda_autocast)
    shard_ranks: int = 1  # the transformer sharded across this many processes (one traced), as ``fsdp`` says
    fsdp: str | None = None
    shard_offload: bool = False  # fsdp_offload_params: the process's share in host RAM (swapped_weight_bytes)
    shard_size: int | None = None  # hybrid_shard: sharded within groups of this many of the processes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SwapAwareCounter(LiveBytesCounter):
    """Counts nothing for storages that live on the host (the swapped blocks' weights)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host = host

    def _track(self, tensor: torch.Tensor) -> None:
        import torch

        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided \
                and tensor.untyped_storage()._cdata in self.host:
            return
        super()._track(tensor)


def trace_dit_step(family: str | FamilySpec = DEFAULT_FAMILY, *, resolution: int, batch_size: int = 1,
                   rank: int = 16, gradient_checkpointing: bool = True, optimizer: str = "AdamW8bit",
                   fp8_base: bool = False, blocks_to_swap: int = 0, config: dict[str, Any] | None = None,
                   text_tokens: int | None = None, frames: int = 1, fake: bool = True,
                   autocast_rules: str = "cuda", shard_ranks: int = 1, fsdp: str = "full_shard",
                   shard_offload: bool = False, shard_size: int | None = None) -> DitTraceResult:
    """One LoRA step of ``family`` (bf16 autocast, cached latents and text-encoder outputs) on fake CPU tensors.

    ``config``: another denoiser config (tests use a tiny one); ``text_tokens``: the text length (default: the
    family's T5 length); ``fake=False``: the same step on real CPU tensors with random weights (tiny configs: how
    the tests check the fake figure against a real run); ``autocast_rules``: ``"cuda"`` casts as a GPU does (the
    traces GPU plans are fitted to), ``"cpu"`` as CPU autocast does (``autotune.calibration.cuda_autocast``);
    ``shard_ranks`` above 1: the transformer sharded by the engine's own ``fsdp`` (``training.sharding``) across
    that many processes of a fake process group, the step of one of them traced (:func:`sharded_across`); with
    ``shard_offload`` its share of the parameters counted as host memory (``fsdp_offload_params``; the copy of a
    block's share to the card before its gather, 1/N of a block, is not seen on a CPU); with ``shard_size``
    (``fsdp = "hybrid_shard"``) within groups of that many of them."""

    started = time.perf_counter()
    if shard_ranks > 1:  # before the model is built, as the engine checks it
        from sd_scripts_compat.training.sharding import check_sharding

        check_sharding(fsdp, world=shard_ranks, blocks_to_swap=blocks_to_swap, compiled=False,
                       offload=shard_offload, shard_size=shard_size)
    spec = trace_family(family, config)
    model, network, fake_mode = _traced_modules(spec, rank=rank, fp8_base=fp8_base, fake=fake,
                                                gradient_checkpointing=gradient_checkpointing)
    host = swapped_weights(model, spec, blocks_to_swap)
    counter = _SwapAwareCounter({t.untyped_storage()._cdata for t in host})
    with contextlib.ExitStack() as stack:
        if shard_ranks > 1:
            stack.enter_context(sharded_across(model, spec, shard_ranks, fsdp, fake_mode, counter, shard_offload,
                                               shard_size))
            if shard_offload:  # the share of every parameter waits on the host
                host = [_local(p) for p in model.parameters()]
                counter.host |= {t.untyped_storage()._cdata for t in host}
        lora_params = list(network.parameters())
        frozen = [_local(t) for t in [*model.parameters(), *model.buffers()]
                  if _local(t).untyped_storage()._cdata not in counter.host]
        weights_bytes, swapped_bytes = _storage_bytes(frozen), _storage_bytes(host)
        with fake_mode:
            opt, _, state = steady_state_optimizer(optimizer, lora_params)
            state_bytes = _storage_bytes(state)
            counter.register([*frozen, *lora_params, *state])
            counter.reset_peak()
            with counter.mode(), op_lists(autocast_rules):
                FORWARDS[spec.denoiser_class](model, counter, spec, batch_size, resolution,
                                              text_tokens or spec.denoiser_text_tokens,
                                              **({"frames": frames} if frames > 1 else {}))
                grad_bytes = _storage_bytes([p.grad for p in lora_params if p.grad is not None])
                counter.phase = "optimizer"
                opt.step()
                opt.zero_grad(set_to_none=True)
    # the modules kohya's DiT file holds beside the transformer (Anima's LLM adapter): resident, frozen, their
    # small forward fed in as its output (what the step hands the blocks)
    all_extra, linear_extra = _extras_elements(spec)
    extras = 2 * all_extra - (linear_extra if fp8_base else 0)
    weights_bytes += extras
    counter.peak += extras
    persistent = weights_bytes + _storage_bytes(lora_params) + grad_bytes + state_bytes
    return DitTraceResult(
        resolution=resolution, batch_size=batch_size, rank=rank, gradient_checkpointing=gradient_checkpointing,
        optimizer=optimizer, fp8_base=fp8_base, blocks_to_swap=blocks_to_swap, peak_bytes=counter.peak,
        weights_bytes=weights_bytes, swapped_weight_bytes=swapped_bytes, lora_param_bytes=_storage_bytes(lora_params),
        lora_grad_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
        activations_peak_bytes=counter.peak - persistent, lora_params=sum(p.numel() for p in lora_params),
        peak_phase=counter.peak_phase, seconds=round(time.perf_counter() - started, 2), frames=frames,
        autocast_rules=autocast_rules, shard_ranks=shard_ranks, fsdp=fsdp if shard_ranks > 1 else None,
        shard_offload=shard_offload, shard_size=shard_size)


def _traced_modules(spec: FamilySpec, *, rank: int, fp8_base: bool, fake: bool,
                    gradient_checkpointing: bool) -> tuple[ModelMixin, LoRANetwork, Any]:
    """(denoiser, its applied LoRA, the fake mode) as :func:`trace_dit_step` traces them: on fake CPU tensors
    (``fake``; else real random ones), fp8 as the family's trainer stores it, checkpointed as asked."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    bundle = build_bundle(spec, materialize=not fake)
    model = bundle.unet
    if fp8_base and spec.trains_with.fp8_scaled_weights:
        musubi_fp8_scaled(model)
    elif fp8_base:
        from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

        store_frozen_weights_in_fp8(model, torch.bfloat16)  # --fp8_base: every frozen Linear weight in 1 byte
    network = engine_lora(bundle, rank)
    if gradient_checkpointing:
        enable_checkpointing(model)
    fake_mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    if fake:
        fakeify([model, network], fake_mode)
    return model, network, fake_mode


def musubi_fp8_scaled(model: ModelMixin) -> int:
    """musubi-tuner's ``--fp8_base --fp8_scaled`` as it runs (``modules/fp8_optimization_utils``): each frozen
    Linear weight stored in float8 with a per-channel scale, dequantized to bf16 in every forward
    (``fp8_linear_forward_patch``: ``weight.to(bf16) * scale_weight``) and handed to ``F.linear``, which keeps that
    bf16 copy for the backward; our engine's upcast (``training/precision``) keeps only the fp8 weight. So under
    musubi a checkpointed step holds one block's bf16 copies while it recomputes, and an uncheckpointed one holds
    every block's. Returns how many layers it patched."""
    import torch
    import torch.nn.functional as F

    count = 0
    for layer in model.modules():
        if not isinstance(layer, torch.nn.Linear) or layer.weight.requires_grad:
            continue
        layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
        layer.register_buffer("scale_weight", torch.ones(layer.out_features, 1, dtype=torch.bfloat16,
                                                         device=layer.weight.device))

        def forward(x: torch.Tensor, layer: torch.nn.Linear = layer) -> torch.Tensor:
            scale = layer.get_buffer("scale_weight")
            return F.linear(x, layer.weight.to(scale.dtype) * scale, layer.bias)

        setattr(layer, "forward", forward)  # noqa: B010 - an instance attribute over the class's method
        count += 1
    return count


def _flow_step(model: ModelMixin, counter: LiveBytesCounter, latents: torch.Tensor, inputs: dict[str, Any], *,
               pack: Callable[[Any], Any] = lambda x: x) -> None:
    """One flow-matching step: noise the latents, run the denoiser on ``inputs`` under bf16 autocast, MSE to
    the velocity, backward. ``pack`` turns the noisy latents into the denoiser's ``hidden_states``."""
    import torch

    counter.phase = "forward"
    noise = torch.randn_like(latents)
    sigma = torch.rand(latents.shape[0], *([1] * (latents.dim() - 1)))
    noisy = (1 - sigma) * latents + sigma * noise
    with torch.autocast(latents.device.type, dtype=torch.bfloat16):  # the CPU under traces, CUDA in gpu_validate
        pred = model(hidden_states=pack(noisy.to(torch.bfloat16)), timestep=sigma.flatten() * 1000, **inputs,
                     return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float().reshape(noise.shape), (noise - latents).float())
    del pred, noisy, noise, latents, inputs
    counter.phase = "backward"
    loss.backward()
    del loss


def _latents(model: ModelMixin, spec: FamilySpec, batch_size: int, resolution: int) -> torch.Tensor:
    """Cached latents of one batch: [B, C, side, side] in latent pixels, fp32 as the cache holds them."""
    import torch

    side = resolution // spec.latent_downsample
    return torch.empty(batch_size, model.config.in_channels, side, side, dtype=torch.float32)


def _text(batch_size: int, tokens: int, width: int) -> torch.Tensor:
    import torch

    return torch.empty(batch_size, tokens, width, dtype=torch.bfloat16)


def _flux_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                           resolution: int, text_tokens: int) -> None:
    """FLUX.1 and Chroma: packed 2x2 latent tokens, cached T5 (and CLIP-L pooled) outputs, ids, guidance (what
    flux_train_network feeds; Chroma takes neither pooled output nor guidance)."""
    import torch

    tokens, side = spec.image_tokens(resolution), resolution // spec.bucket_step
    cfg = model.config
    counter.phase = "inputs"
    latents = torch.empty(batch_size, tokens, cfg.in_channels, dtype=torch.float32)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, cfg.joint_attention_dim),
              "img_ids": torch.zeros(side * side, 3), "txt_ids": torch.zeros(text_tokens, 3)}
    if "pooled_projection_dim" in cfg:
        inputs["pooled_projections"] = torch.empty(batch_size, cfg.pooled_projection_dim, dtype=torch.bfloat16)
    if cfg.get("guidance_embeds"):
        inputs["guidance"] = torch.full((batch_size,), 3.5)
    _flow_step(model, counter, latents, inputs)


def _sd3_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                          resolution: int, text_tokens: int) -> None:
    """SD3: latent image in, CLIP-L/G + T5 context (77 + 256 tokens of 4096) and the 2048-wide pooled vector."""
    import torch

    counter.phase = "inputs"
    cfg = model.config
    latents = _latents(model, spec, batch_size, resolution)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, cfg.joint_attention_dim),
              "pooled_projections": torch.empty(batch_size, cfg.pooled_projection_dim, dtype=torch.bfloat16)}
    _flow_step(model, counter, latents, inputs)


def _lumina_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                             resolution: int, text_tokens: int) -> None:
    """Lumina 2: latent image in, Gemma2 hidden states, an all-ones caption mask (captions padded alike take
    the unmasked attention). Its rotary embedder reads caption lengths on the host, which a fake tensor cannot
    give, so it runs on real tensors (no weights; its outputs are the small rotary tables)."""
    import torch

    counter.phase = "inputs"
    latents = _latents(model, spec, batch_size, resolution)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.cap_feat_dim),
              "encoder_attention_mask": _host_ones(batch_size, text_tokens)}
    rope = model.rope_embedder
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.device("cpu"):
        rope.freqs_cis = rope._precompute_freqs_cis(rope.axes_dim, rope.axes_lens, rope.theta)  # built on meta
    rope.forward = _on_real_tensors(rope.forward)
    try:
        _flow_step(model, counter, latents, inputs)
    finally:
        del rope.forward


def _on_real_tensors(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run outside the fake mode on real stand-ins of the same shapes (empty tensors)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(*args: Any) -> Any:
        with unset_fake_temporarily():
            return forward(*(torch.ones(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
                             for a in args))

    return real


def _hunyuan_image_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                                    resolution: int, text_tokens: int) -> None:
    """HunyuanImage-2.1: 64-channel latents of the 32x VAE and the text context. The model packs the valid
    Qwen2.5-VL and byT5 tokens by boolean indexing (a data-dependent shape a fake tensor cannot take), so the
    trace feeds the whole context (1024 + 128 tokens) as one Qwen2.5-VL-wide input: the same tokens through
    every block; only byT5's small input projection is left out."""
    counter.phase = "inputs"
    latents = _latents(model, spec, batch_size, resolution)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.text_embed_dim),
              "encoder_attention_mask": _host_ones(batch_size, text_tokens)}
    _flow_step(model, counter, latents, inputs)


def _cosmos_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                             resolution: int, text_tokens: int) -> None:
    """Anima (Cosmos-Predict2 DiT): one-frame video latents, the LLM adapter's 512 x 1024 context (the adapter's
    own small transient is not traced), and the padding mask the model concatenates as a channel, given at
    latent size. diffusers resizes that mask with torchvision, which is not our dependency: a nearest-neighbour
    stand-in serves the (identity) resize."""
    import sys
    from types import SimpleNamespace

    import torch

    counter.phase = "inputs"
    latents = _latents(model, spec, batch_size, resolution).unsqueeze(2)
    side = latents.shape[-1]
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.text_embed_dim),
              "padding_mask": torch.zeros(1, 1, side, side, dtype=torch.bfloat16)}
    module = sys.modules[type(model).__module__]
    if not hasattr(module, "transforms"):
        module.transforms = SimpleNamespace(  # type: ignore[attr-defined]
            InterpolationMode=SimpleNamespace(NEAREST="nearest"),
            functional=SimpleNamespace(resize=lambda t, size, interpolation=None: torch.nn.functional.interpolate(
                t, size=size, mode="nearest")))
    _flow_step(model, counter, latents, inputs)


def _qwen_image_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                                 resolution: int, text_tokens: int) -> None:
    """Qwen-Image (musubi-tuner): 2x2-packed 16-channel latents (64 per token), the cached Qwen2.5-VL states with
    their mask, and the latent grid each sample's rotary table is built for."""
    import torch

    counter.phase = "inputs"
    side = resolution // spec.bucket_step
    latents = torch.empty(batch_size, side * side, model.config.in_channels, dtype=torch.float32)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.joint_attention_dim),
              "encoder_hidden_states_mask": _host_ones(batch_size, text_tokens),
              "img_shapes": [[(1, side, side)]] * batch_size}
    rope = model.pos_embed  # its frequency tables are plain attributes, built on meta: rebuilt on the host
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.device("cpu"):
        model.pos_embed = type(rope)(theta=10000, axes_dim=list(model.config.axes_dims_rope), scale_rope=True)
    try:
        _flow_step(model, counter, latents, inputs)
    finally:
        model.pos_embed = rope


def _flux2_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                            resolution: int, text_tokens: int) -> None:
    """FLUX.2 (musubi-tuner): 2x2-packed 32-channel AE latents (128 per token), the cached Mistral 3 / Qwen3
    states, 4-axis position ids, and guidance for dev (klein has no guidance embedder)."""
    import torch

    counter.phase = "inputs"
    side = resolution // spec.bucket_step
    latents = torch.empty(batch_size, side * side, model.config.in_channels, dtype=torch.float32)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.joint_attention_dim),
              "img_ids": torch.zeros(batch_size, side * side, 4), "txt_ids": torch.zeros(batch_size, text_tokens, 4)}
    if model.config.get("guidance_embeds"):
        inputs["guidance"] = torch.full((batch_size,), 4.0)
    _flow_step(model, counter, latents, inputs)


def _wan_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                          resolution: int, text_tokens: int, frames: int = 1) -> None:
    """Wan (musubi-tuner): video latents [B, 16, 1 + (frames - 1) / 4, side / 8, side / 8] of the causal VAE
    and the cached UMT5 states the blocks cross-attend to (512 tokens)."""
    import torch

    counter.phase = "inputs"
    side = resolution // spec.latent_downsample
    latents = torch.empty(batch_size, model.config.in_channels, spec.latent_frames(frames), side, side,
                          dtype=torch.float32)
    inputs = {"encoder_hidden_states": _text(batch_size, text_tokens, model.config.text_dim)}
    _flow_step(model, counter, latents, inputs)


def _zimage_forward_backward(model: ModelMixin, counter: LiveBytesCounter, spec: FamilySpec, batch_size: int,
                             resolution: int, text_tokens: int) -> None:
    """Z-Image (musubi-tuner): per-sample lists of [16, 1, side / 8, side / 8] latents and [tokens, 2560] Qwen3
    states (the model pads and joins them into one sequence itself); ``t`` in 0-1."""
    import torch

    counter.phase = "forward"
    side = resolution // spec.latent_downsample
    latents = torch.empty(batch_size, model.config.in_channels, 1, side, side, dtype=torch.float32)
    noise = torch.randn_like(latents)
    sigma = torch.rand(batch_size, 1, 1, 1, 1)
    noisy = ((1 - sigma) * latents + sigma * noise).to(torch.bfloat16)
    with torch.autocast(latents.device.type, dtype=torch.bfloat16):
        pred = model(x=list(noisy.unbind(0)), t=sigma.flatten(),
                     cap_feats=list(_text(batch_size, text_tokens, model.config.cap_feat_dim).unbind(0)),
                     return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(torch.stack(pred).float().reshape(noise.shape), (noise - latents).float())
    del pred, noisy, noise, latents
    counter.phase = "backward"
    loss.backward()
    del loss


def _host_ones(batch_size: int, tokens: int) -> torch.Tensor:
    """An all-ones attention mask made outside the fake mode (the model reads it on the host)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.ones(batch_size, tokens, dtype=torch.bool)


def _block_sizes(block: torch.nn.Module) -> dict[str, int]:
    """Elements of one block: all, ``.weight`` tensors (what a swap moves), Linear weights (fp8 under fp8_base)."""
    import torch

    return {
        "elements": sum(p.numel() for p in block.parameters()),
        "swap_elements": sum(weight.numel() for m in block.modules()
                             if isinstance(weight := getattr(m, "weight", None), torch.Tensor)),
        "fp8_elements": sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear)),
    }


def _extras_elements(spec: FamilySpec) -> tuple[int, int]:
    """(all, Linear weight) elements of the modules kohya's DiT file holds beside the transformer (Anima's LLM
    adapter), built on the meta device."""
    import diffusers
    import torch

    total = linear = 0
    for extra in spec.denoiser_extras:
        with torch.device("meta"):
            module = getattr(diffusers, extra["_class_name"])(**model_config(extra))
        total += sum(p.numel() for p in module.parameters())
        linear += sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
    return total, linear


def dit_architecture_facts(family: str | FamilySpec = DEFAULT_FAMILY,
                           config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Exact counts the transformer memory and speed model (``estimate.dit_memory``) needs, read off the engine's
    meta-device modules of ``family``: per block group its count, sizes and multiply-adds per image and per text
    token, the rest of the transformer, the engine's LoRA module shapes (in x out, with counts), the text
    encoders and the AE by size."""
    from collections import Counter

    import torch

    spec = trace_family(family, config)
    bundle = build_bundle(spec)
    model = bundle.unet
    lists = block_lists(model, spec)
    in_blocks = sum(p.numel() for blocks in lists for block in blocks for p in block.parameters())
    all_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    rest_linear = all_linear - sum(_block_sizes(block)["fp8_elements"] for blocks in lists for block in blocks)
    extra = _extras_elements(spec)
    network = engine_lora(bundle, rank=1)
    lora: Counter[str] = Counter(f"{m.lora_down.in_features}x{m.lora_up.out_features}" for m in network.unet_loras)

    def macs(block: torch.nn.Module, prefixes: list[str]) -> int:
        return sum(m.weight.numel() for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)
                   and name.startswith(tuple(prefixes)) and "norm" not in name)

    groups = [{"name": group["name"], "count": len(blocks), **_block_sizes(blocks[0]),
               **({"attention": group["attention"]} if "attention" in group else {}),
               "macs_per_image_token": sum(macs(b, group["image_linears"]) for b in blocks) // len(blocks),
               "macs_per_text_token": sum(macs(b, group["text_linears"]) for b in blocks) // len(blocks)}
              for group, blocks in zip(spec.transformer_block_groups, lists)]
    for group, blocks in zip(groups, lists):
        sizes = [_block_sizes(block) for block in blocks]
        if any(size != sizes[0] for size in sizes):  # SD3.5 Medium: MMDiT-X blocks 0-12, a pre-only last block
            group["per_block"] = [[size["elements"], size["swap_elements"], size["fp8_elements"]] for size in sizes]
    cfg = model.config
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())  # whole on each process when sharded
    return {
        "config": model_config(spec.unet),
        "block_groups": groups,
        # buffers count too: SD3's positional table (384^2 x 1536 for Medium) is one, and lives on the device
        "rest": {"elements": sum(p.numel() for p in model.parameters()) - in_blocks + extra[0] + buffers,
                 "fp8_elements": rest_linear + extra[1], "buffer_elements": buffers},
        "lora_modules": dict(sorted(lora.items())),
        "text_encoders": {te.file_option or te.lora_prefix: sum(p.numel() for p in encoder.parameters())
                          for te, encoder in zip(spec.text_encoders, bundle.text_encoders)},
        "ae_elements": sum(p.numel() for p in bundle.vae.parameters()),
        "hidden": int(cfg.get("hidden_size") or cfg.get("dim") or cfg.num_attention_heads * cfg.attention_head_dim),
        "text_tokens": spec.denoiser_text_tokens,
        "latent_downsample": spec.latent_downsample,
    }


def trace_text_encoder_caching(family: str | FamilySpec = DEFAULT_FAMILY, tokens: int | None = None,
                               autocast_rules: str = "cuda") -> dict[str, int]:
    """Peak live bytes of caching one caption: the family's text encoders (FLUX.1: CLIP-L and T5-XXL; SD3 adds
    CLIP-G; Lumina's Gemma2, HunyuanImage's Qwen2.5-VL + byT5, Anima's Qwen3), all resident as sd-scripts
    keeps them, each run in turn on a caption of its own token length under no_grad on fake tensors, built
    from the family's configs with transformers' defaults (what sd-scripts runs; the engine's own modules
    choose another attention kernel and would understate sd-scripts' transient). ``tokens`` replaces the
    length of every encoder that is not CLIP.

    Returns the weights and the transient above them (hidden states, T5's fp32 attention scores, an LLM's
    logits), the figure the transformer model adds to the encoders' weights for the caching phase, under
    ``autocast_rules`` (CUDA's op lists by default: sd-scripts caches on the GPU)."""
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = trace_family(family)
    with torch.device("meta"):
        encoders = [getattr(transformers, te.class_name)(getattr(transformers, te.class_name).config_class(
            **model_config(te.config))).to(torch.bfloat16) for te in spec.text_encoders]
    lengths = [te.tokenizer["model_max_length"] if te.tokenizer_kind == "clip" or tokens is None else tokens
               for te in spec.text_encoders]
    fake_mode = FakeTensorMode()
    fakeify(encoders, fake_mode)
    weights = [t for encoder in encoders for t in (*encoder.parameters(), *encoder.buffers())]
    counter = LiveBytesCounter()
    with fake_mode:
        counter.register(weights)
        counter.reset_peak()
        with counter.mode(), torch.no_grad(), op_lists(autocast_rules), torch.autocast("cpu", dtype=torch.bfloat16):
            for encoder, length in zip(encoders, lengths):
                encoder(input_ids=torch.zeros(1, length, dtype=torch.long))
    weight_bytes = _storage_bytes(weights)
    return {"weights_bytes": weight_bytes, "transient_bytes": counter.peak - weight_bytes}


def trace_latent_caching(family: str | FamilySpec, side: int, frames: int = 1) -> dict[str, int]:
    """Peak live bytes of caching one sample's latents (a ``side`` x ``side`` image, or a clip of ``frames``):
    the family's VAE (diffusers' class from the family's ``vae`` config) encoding it in bf16 under no_grad on fake
    tensors, one sample at a time as the written caching command asks (``--batch_size 1``). Returns the VAE's
    weights and the transient above them."""
    import diffusers
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = trace_family(family)
    config = {k: v for k, v in spec.vae.items() if not k.startswith("_") and not k.startswith("scale_factor")}
    vae_class = getattr(diffusers, spec.vae["_class_name"])
    with torch.device("meta"):
        vae = vae_class(**config).to(torch.bfloat16)
    fake_mode = FakeTensorMode()
    fakeify([vae], fake_mode)
    weights = [*vae.parameters(), *vae.buffers()]
    video = "Wan" in vae_class.__name__  # a 3D VAE takes (batch, channels, frames, height, width), images too
    counter = LiveBytesCounter()
    with fake_mode:
        counter.register(weights)
        counter.reset_peak()
        with counter.mode(), torch.no_grad():
            shape = (1, 3, frames, side, side) if video else (1, 3, side, side)
            vae.encode(torch.zeros(shape, dtype=torch.bfloat16))
    weight_bytes = _storage_bytes(weights)
    return {"weights_bytes": weight_bytes, "transient_bytes": counter.peak - weight_bytes}


def fit_latent_caching(family: str | FamilySpec, sides: tuple[int, int] = (512, 1024),
                       clip_frames: tuple[int, int] = (33, 81)) -> dict[str, Any]:
    """The latent-caching calibration of a musubi family: the VAE's weights and the transient as ``a + b x pixels``
    for images, through traces at two sides (a VAE's transient grows with the pixels it encodes); for a video
    family's clips ``[a, b, d, F0]``: ``a + b x pixels + d x pixels x (frames - F0)``, a third trace at the longer
    clip giving ``d`` (a clip is encoded in chunks of a few frames, so its length adds little: 3-4 % from 33 to 81
    frames)."""
    spec = trace_family(family)

    def transient(side: int, frames: int) -> int:
        return trace_latent_caching(spec, side, frames)["transient_bytes"]

    (s0, s1), (f0, f1) = sides, clip_frames
    out: dict[str, Any] = {"weights_bytes": trace_latent_caching(spec, s1)["weights_bytes"]}
    for mode, frames in (("image", 1), *((("clip", f0),) if (spec.musubi or {}).get("video") else ())):
        t0, t1 = transient(s0, frames), transient(s1, frames)
        slope = (t1 - t0) / (s1 * s1 - s0 * s0)
        out[mode] = [t0 - slope * s0 * s0, slope]
        if mode == "clip":
            out[mode] += [(transient(s1, f1) - t1) / (s1 * s1 * (f1 - f0)), f0]
    return out


# what each denoiser class is fed in a training step with cached inputs (FLUX.1: flux_train_network's call)
FORWARDS: dict[str, Callable[[Any, LiveBytesCounter, FamilySpec, int, int, int], None]] = {
    "FluxTransformer2DModel": _flux_forward_backward,
    "ChromaTransformer2DModel": _flux_forward_backward,
    "SD3Transformer2DModel": _sd3_forward_backward,
    "Lumina2Transformer2DModel": _lumina_forward_backward,
    "HunyuanImageTransformer2DModel": _hunyuan_image_forward_backward,
    "CosmosTransformer3DModel": _cosmos_forward_backward,
    "QwenImageTransformer2DModel": _qwen_image_forward_backward,
    "Flux2Transformer2DModel": _flux2_forward_backward,
    "WanTransformer3DModel": _wan_forward_backward,
    "ZImageTransformer2DModel": _zimage_forward_backward,
}
