"""Peak tensor memory of one FLUX.1 LoRA training step, on fake CPU tensors (the FLUX side of ``memtrace``).

Same method as ``autotune.calibration.memtrace`` (build on the meta device, swap parameters for empty fake
CPU tensors, count live storages per dispatched op with its ``LiveBytesCounter``); what differs is the
model and two FLUX mechanisms:

- The transformer is diffusers' ``FluxTransformer2DModel`` at FLUX.1-dev's config (12 B parameters) with
  a LoRA of kohya's shapes (``networks/lora_flux``: 304 modules; ``img_attn_qkv`` is one rank-r module
  over to_q/to_k/to_v, ``linear1`` one over to_q/k/v + proj_mlp, as kohya's fused linears are), applied
  by ``FusedLoRA`` below, fp32 as kohya trains it.
- Block swap (``blocks_to_swap``) follows sd-scripts' ``Flux.enable_block_swap``: n blocks = n // 2 double
  blocks and (n - n // 2) * 2 single blocks, the last of each list; only their ``.weight`` tensors live on
  the host (biases and other parameters stay on the GPU) and a block swapped in takes the GPU storage of
  the block swapped out (``swap_weight_devices_cuda`` copies into it), so the GPU never holds more than
  the resident blocks' weights. The counter therefore ignores the swapped weights' storages.

Text encoders (CLIP-L, T5-XXL) and the AE are not traced: FLUX plans cache their outputs, and their
weights when resident are counted exactly from the architecture (``flux_architecture_facts``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from autotune.calibration.memtrace import (
    LiveBytesCounter,
    _storage_bytes,
    fakeify,
    steady_state_optimizer,
)
from sd_scripts_compat.models.families import get_family, model_config, swap_split
from sd_scripts_compat.models.flux_layout import DOUBLE_BLOCK, SINGLE_BLOCK

# FLUX.1-dev's transformer config and T5 length: the engine's family data (what sd-scripts' configs["dev"] holds)
FLUX_DEV_CONFIG: dict[str, Any] = model_config(get_family("flux-dev").unet)
T5_TOKENS = get_family("flux-dev").t5xxl_max_token_length or 512
# kohya module name suffix -> the diffusers Linear(s) it covers: the engine's BFL <-> diffusers table
DOUBLE_TARGETS = {bfl.replace(".", "_"): parts for bfl, parts in DOUBLE_BLOCK.items()}
SINGLE_TARGETS = {bfl.replace(".", "_"): parts for bfl, parts in SINGLE_BLOCK.items()}


class FusedLoRA:
    """One kohya LoRA module over one or more diffusers Linears that share their input (kohya's fused qkv).

    ``down`` [r, in], ``up`` [sum(out), r]; each member Linear returns base(x) + its slice of up(down(x)) * scale,
    computed once per input. Hand-written because peft has no LoRA spanning several Linears.
    """

    def __init__(self, members: list[Any], rank: int, alpha: float, device: Any = "meta") -> None:
        import torch

        fan_in = members[0].in_features
        self.outs = [m.out_features for m in members]
        self.down = torch.nn.Linear(fan_in, rank, bias=False, device=device)
        self.up = torch.nn.Linear(rank, sum(self.outs), bias=False, device=device)
        if device != "meta":
            torch.nn.init.zeros_(self.up.weight)  # kohya's init: a fresh LoRA changes nothing
        self.scale = alpha / rank
        self._cache: tuple[Any, list[Any], set[int]] | None = None
        for index, member in enumerate(members):
            original = member.forward

            def forward(x: Any, index: int = index, original: Any = original) -> Any:
                return original(x) + self._delta(x, index)

            member.forward = forward

    def _delta(self, x: Any, index: int) -> Any:
        import torch

        if self._cache is None or self._cache[0] is not x:
            delta = self.up(self.down(x)) * self.scale
            self._cache = (x, list(torch.split(delta, self.outs, dim=-1)), set())
        part = self._cache[1][index]
        self._cache[2].add(index)
        if len(self._cache[2]) == len(self.outs):  # every member served: drop the shared delta
            self._cache = None
        return part

    def modules(self) -> list[Any]:
        return [self.down, self.up]


def build_flux(config: dict[str, Any] | None = None, dtype: Any = None) -> Any:
    """diffusers' FluxTransformer2DModel on the meta device (no weights, built in well under a second)."""
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**(config or FLUX_DEV_CONFIG))
    model.requires_grad_(False)
    return model.to(dtype or torch.bfloat16)


def _resolve(module: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        module = module[int(name)] if name.isdigit() else getattr(module, name)
    return module


def apply_flux_lora(model: Any, rank: int, alpha: float, device: Any = "meta") -> list[FusedLoRA]:
    """kohya's 304 FLUX LoRA modules (lora_unet_double_blocks_N_* / single_blocks_N_*) on ``model``
    (``device``: where the LoRA weights live; meta for traces, the GPU for bench/gpu_validate_flux.py)."""
    loras = []
    for blocks, targets in ((model.transformer_blocks, DOUBLE_TARGETS), (model.single_transformer_blocks,
                                                                         SINGLE_TARGETS)):
        for block in blocks:
            for members in targets.values():
                loras.append(FusedLoRA([_resolve(block, m) for m in members], rank, alpha, device))
    return loras


@dataclass(frozen=True)
class FluxTraceResult:
    """Peak live tensor bytes of one FLUX step and its split (as ``memtrace.TraceResult``)."""

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SwapAwareCounter(LiveBytesCounter):
    """Counts nothing for storages that live on the host (the swapped blocks' weights)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.host = host

    def _track(self, tensor: Any) -> None:
        import torch

        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided \
                and tensor.untyped_storage()._cdata in self.host:
            return
        super()._track(tensor)


def swapped_weights(model: Any, blocks_to_swap: int) -> list[Any]:
    """The ``.weight`` tensors sd-scripts keeps on the host: of the last swapped double and single blocks."""
    import torch

    double, single = swap_split(blocks_to_swap, len(model.transformer_blocks), len(model.single_transformer_blocks))
    blocks = list(model.transformer_blocks)[len(model.transformer_blocks) - double:] if double else []
    blocks += list(model.single_transformer_blocks)[len(model.single_transformer_blocks) - single:] if single else []
    out = []
    for block in blocks:
        for module in block.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                out.append(weight)
    return out


def trace_flux_step(*, resolution: int, batch_size: int = 1, rank: int = 16, gradient_checkpointing: bool = True,
                    optimizer: str = "AdamW8bit", fp8_base: bool = False, blocks_to_swap: int = 0,
                    config: dict[str, Any] | None = None, text_tokens: int = T5_TOKENS,
                    fake: bool = True, family: str | None = None) -> FluxTraceResult:
    """One FLUX LoRA step (bf16 autocast, cached latents and text-encoder outputs) on fake CPU tensors.

    ``config``: another transformer config (tests use a tiny one); ``text_tokens``: T5 sequence length;
    ``fake=False``: the same step on real CPU tensors with random weights (tiny configs: how the tests check
    the fake figure against a real run); ``family``: trace the engine's own model and LoRA network
    (``sd_scripts_compat.network.lora``, fused FLUX modules) of that family instead (fake only)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    model = build_flux(config) if family is None else _engine_bundle(family).unet
    if not fake:
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
    if fp8_base:
        from sd_scripts_compat.training.precision import store_frozen_weights_in_fp8

        store_frozen_weights_in_fp8(model, torch.bfloat16)  # --fp8_base: every frozen Linear weight in 1 byte
    if family is not None:
        lora_modules = [_engine_network(family, rank, model)]
    else:
        loras = apply_flux_lora(model, rank, float(rank), device="meta" if fake else "cpu")
        lora_modules = [m for lora in loras for m in lora.modules()]
    for m in lora_modules:
        m.to(torch.float32)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
        model.train()
    fake_mode: Any = FakeTensorMode() if fake else contextlib.nullcontext()
    if fake:
        fakeify([model, *lora_modules], fake_mode)
    host = swapped_weights(model, blocks_to_swap)
    host_ids = {t.untyped_storage()._cdata for t in host}
    lora_params = [p for m in lora_modules for p in m.parameters()]
    frozen = [t for t in [*model.parameters(), *model.buffers()] if t.untyped_storage()._cdata not in host_ids]
    weights_bytes, swapped_bytes = _storage_bytes(frozen), _storage_bytes(host)
    counter = _SwapAwareCounter(host_ids)
    with fake_mode:
        opt, _, state = steady_state_optimizer(optimizer, lora_params)
        state_bytes = _storage_bytes(state)
        counter.register([*frozen, *lora_params, *state])
        counter.reset_peak()
        with counter.mode():
            _flux_forward_backward(model, counter, batch_size, resolution, text_tokens)
            grad_bytes = _storage_bytes([p.grad for p in lora_params if p.grad is not None])
            counter.phase = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
    persistent = weights_bytes + _storage_bytes(lora_params) + grad_bytes + state_bytes
    return FluxTraceResult(
        resolution=resolution, batch_size=batch_size, rank=rank, gradient_checkpointing=gradient_checkpointing,
        optimizer=optimizer, fp8_base=fp8_base, blocks_to_swap=blocks_to_swap, peak_bytes=counter.peak,
        weights_bytes=weights_bytes, swapped_weight_bytes=swapped_bytes, lora_param_bytes=_storage_bytes(lora_params),
        lora_grad_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
        activations_peak_bytes=counter.peak - persistent, lora_params=sum(p.numel() for p in lora_params),
        peak_phase=counter.peak_phase, seconds=round(time.perf_counter() - started, 2))


def _engine_bundle(family: str) -> Any:
    """The engine's modules of ``family`` on the meta device, the denoiser in bf16 and frozen (cached per call)."""
    import torch

    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.families import get_family

    bundle = build_modules(get_family(family), device="meta", seed=None)
    bundle.unet.requires_grad_(False)
    bundle.unet.to(torch.bfloat16)
    _BUNDLES[id(bundle.unet)] = bundle
    return bundle


_BUNDLES: dict[int, Any] = {}


def _engine_network(family: str, rank: int, model: Any) -> Any:
    """The engine's kohya LoRA network (fused FLUX modules) on ``model``, fp32, applied."""
    import torch

    from sd_scripts_compat.network.lora import create_network

    bundle = _BUNDLES.pop(id(model))
    network = create_network(bundle, network_dim=rank, network_alpha=float(rank), train_unet=True,
                             train_text_encoder=False)
    network.apply_to()
    network.to(torch.float32)
    return network


def image_tokens(resolution: int, height: int | None = None) -> int:
    """Packed latent tokens of FLUX.1 (the family's rule: (side / 16)^2)."""
    return get_family("flux-dev").image_tokens(resolution, height)


def _flux_forward_backward(model: Any, counter: LiveBytesCounter, batch_size: int, resolution: int,
                           text_tokens: int) -> None:
    """Flow-matching step on packed latents with cached T5 / CLIP outputs (what flux_train_network feeds)."""
    import torch

    tokens = image_tokens(resolution)
    side = resolution // get_family("flux-dev").bucket_step
    cfg = model.config
    counter.phase = "inputs"
    latents = torch.empty(batch_size, tokens, cfg.in_channels, dtype=torch.float32)
    t5 = torch.empty(batch_size, text_tokens, cfg.joint_attention_dim, dtype=torch.bfloat16)
    pooled = torch.empty(batch_size, cfg.pooled_projection_dim, dtype=torch.bfloat16)
    img_ids = torch.zeros(side * side, 3)
    txt_ids = torch.zeros(text_tokens, 3)
    counter.phase = "forward"
    noise = torch.randn_like(latents)
    sigma = torch.rand(batch_size, 1, 1)
    noisy = (1 - sigma) * latents + sigma * noise
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(hidden_states=noisy.to(torch.bfloat16), encoder_hidden_states=t5, pooled_projections=pooled,
                     timestep=sigma.flatten(), img_ids=img_ids, txt_ids=txt_ids,
                     guidance=torch.full((batch_size,), 3.5), return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())
    del pred, noisy, noise, latents, t5, pooled
    counter.phase = "backward"
    loss.backward()
    del loss


def _block_sizes(block: Any) -> dict[str, int]:
    """Elements of one block: all, ``.weight`` tensors (what a swap moves), Linear weights (fp8 under fp8_base)."""
    import torch

    return {
        "elements": sum(p.numel() for p in block.parameters()),
        "swap_elements": sum(m.weight.numel() for m in block.modules()
                             if isinstance(getattr(m, "weight", None), torch.Tensor)),
        "fp8_elements": sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear)),
    }


def _text_encoder_elements() -> dict[str, int]:
    """CLIP-L and T5-XXL encoder parameters, built on the meta device from their published configs."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                          max_position_embeddings=77, vocab_size=49408, projection_dim=768)
    t5 = T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
    with torch.device("meta"):
        return {"clip_l": sum(p.numel() for p in CLIPTextModel(clip).parameters()),
                "t5xxl": sum(p.numel() for p in T5EncoderModel(t5).parameters())}


def _ae_elements() -> int:
    import torch
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        ae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                           layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)
    return sum(p.numel() for p in ae.parameters())


def flux_architecture_facts(config: dict[str, Any] | None = None, family: str | None = None) -> dict[str, Any]:
    """Exact counts the FLUX memory and speed model needs, read off the meta-device architecture.

    Per-block sizes (double / single), the rest of the transformer, kohya's LoRA module shapes (in x out
    with counts), the text encoders and the AE, and the multiply-adds per token of the blocks' Linears
    (image-stream, text-stream and joint) for the FLOP count.
    """
    from collections import Counter

    import torch

    if family is not None:  # the family's own modules (its transformer, CLIP-L, T5 and AE configs)
        bundle = _engine_bundle(family)
        _BUNDLES.pop(id(bundle.unet), None)
        model, config = bundle.unet, model_config(get_family(family).unet)
        clip, t5 = (sum(p.numel() for p in te.parameters()) for te in bundle.text_encoders)
        encoders, ae = {"clip_l": clip, "t5xxl": t5}, sum(p.numel() for p in bundle.vae.parameters())
        tokens = int(get_family(family).t5xxl_max_token_length or T5_TOKENS)
    else:
        model, encoders, ae, tokens = build_flux(config), _text_encoder_elements(), _ae_elements(), T5_TOKENS
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    in_blocks = sum(p.numel() for b in [*model.transformer_blocks, *model.single_transformer_blocks]
                    for p in b.parameters())
    rest_linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - (
        len(model.transformer_blocks) * _block_sizes(double)["fp8_elements"]
        + len(model.single_transformer_blocks) * _block_sizes(single)["fp8_elements"])
    lora: Counter[str] = Counter()
    for blocks, targets in ((model.transformer_blocks, DOUBLE_TARGETS), (model.single_transformer_blocks,
                                                                         SINGLE_TARGETS)):
        for members in targets.values():
            layers = [_resolve(blocks[0], m) for m in members]
            lora[f"{layers[0].in_features}x{sum(layer.out_features for layer in layers)}"] += len(blocks)

    def macs(block: Any, prefixes: tuple[str, ...]) -> int:
        return sum(m.weight.numel() for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)
                   and name.startswith(prefixes) and "norm" not in name)

    cfg = model.config
    image_double = macs(double, ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out", "ff."))
    text_double = macs(double, ("attn.add_", "attn.to_add_out", "ff_context."))
    both_single = macs(single, ("attn.", "proj_mlp", "proj_out"))
    groups = [  # the transformer model's block groups (estimate.dit_memory), in the engine's swap-split order
        {"name": "double", "count": len(model.transformer_blocks), **_block_sizes(double),
         "macs_per_image_token": image_double, "macs_per_text_token": text_double},
        {"name": "single", "count": len(model.single_transformer_blocks), **_block_sizes(single),
         "macs_per_image_token": both_single, "macs_per_text_token": both_single},
    ]
    return {
        "config": dict(config or FLUX_DEV_CONFIG),
        "block_groups": groups,
        "rest": {"elements": sum(p.numel() for p in model.parameters()) - in_blocks, "fp8_elements": rest_linear},
        "lora_modules": dict(sorted(lora.items())),
        "text_encoders": encoders, "ae_elements": ae,
        "hidden": cfg.num_attention_heads * cfg.attention_head_dim, "text_tokens": tokens,
        "latent_downsample": get_family(family or "flux-dev").latent_downsample,
    }


def trace_text_encoder_caching(tokens: int = T5_TOKENS) -> dict[str, int]:
    """Peak live bytes of caching one caption: CLIP-L and T5-XXL forwards under no_grad on fake tensors.

    Returns the weights and the transient above them (hidden states, T5's fp32 attention scores), the figure
    the FLUX model adds to the encoders' weights for the caching phase."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        clip = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                            num_attention_heads=12, max_position_embeddings=77, vocab_size=49408,
                                            projection_dim=768)).to(torch.bfloat16)
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                                     vocab_size=32128, feed_forward_proj="gated-gelu",
                                     relative_attention_num_buckets=32)).to(torch.bfloat16)
    fake_mode = FakeTensorMode()
    fakeify([clip, t5], fake_mode)
    weights = [*clip.parameters(), *clip.buffers(), *t5.parameters(), *t5.buffers()]
    counter = LiveBytesCounter()
    with fake_mode:
        counter.register(weights)
        counter.reset_peak()
        with counter.mode(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            clip(torch.zeros(1, 77, dtype=torch.long))
            t5(input_ids=torch.zeros(1, tokens, dtype=torch.long))
    weight_bytes = _storage_bytes(weights)
    return {"weights_bytes": weight_bytes, "transient_bytes": counter.peak - weight_bytes}
