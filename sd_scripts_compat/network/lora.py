"""LoRA networks with sd-scripts ``networks.lora`` semantics and kohya's state-dict names.

Own modules, not peft: kohya's dropout (on the ``lora_down`` output), rank dropout, module dropout
and per-module ``alpha`` buffer differ from peft's input dropout and config-level alpha, and the
saved keys must be kohya's exactly. Each ``LoRAModule`` wraps one base Linear/Conv2d by replacing
that module's ``forward``; the base module tree, its parameter names and its weights stay untouched,
so ``remove()`` restores the model bit-exactly.

Targets (facts of sd-scripts, checked against ``shared/reference/kohya/keys_*.json``):
- UNet: every Linear and 1x1 Conv2d inside each ``Transformer2DModel`` (dim/alpha = network_dim/alpha);
  with ``conv_dim`` also the modules inside ``ResnetBlock2D``, ``Downsample2D``, ``Upsample2D``:
  3x3 convs get conv_dim/conv_alpha, their Linear (time_emb_proj) and 1x1 conv (conv_shortcut) get
  network_dim/network_alpha.
- FLUX (``networks.lora_flux``): every Linear of the double / single stream blocks under BFL's names
  (``lora_unet_double_blocks_0_img_attn_qkv``); a Linear BFL fuses is one fused module. Chroma: the same
  without the modulation Linears. SD3.5, Lumina 2, HunyuanImage-2.1, Anima: the family's ``lora_layout``.
- Lumina's Gemma2 and Anima's Qwen3 text encoders: the Linears of each decoder layer's attention and MLP.
- Text encoders: the Linear layers inside ``CLIPAttention`` / ``CLIPMLP`` (T5: ``T5Attention`` /
  ``T5DenseGatedActDense``, only with ``network_args = ["train_t5xxl=True"]``, as in sd-scripts).
Keys: ``lora_unet_<name>`` (SD1/2: diffusers names; SDXL: SGM names; FLUX: BFL names), ``lora_te_`` /
``lora_te1_`` / ``lora_te2_`` / ``lora_te3_`` (FLUX's T5) + transformers-4 CLIP names
(``text_model.encoder.layers.0...``) or T5 names (``encoder.block.0.layer.0.SelfAttention.q``), dots -> ``_``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch
from torch import nn

from sd_scripts_compat.config.network_args import SD_DOWN_UP_BLOCKS, NetworkArgs
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from sd_scripts_compat.facts.families import FamilySpec
    from sd_scripts_compat.models.build import ModelBundle

UNET_TARGETS = ("Transformer2DModel",)
UNET_CONV_TARGETS = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
# transformers 5 has one CLIPAttention class (SDPA is an attention backend, not a subclass); older
# releases had CLIPSdpaAttention / CLIPFlashAttention2 subclasses, kept so their models still match.
TEXT_ENCODER_TARGETS = ("CLIPAttention", "CLIPSdpaAttention", "CLIPFlashAttention2", "CLIPMLP",
                        "T5Attention", "T5DenseGatedActDense", "T5DenseActDense",
                        "Gemma2Attention", "Gemma2MLP", "Qwen3Attention", "Qwen3MLP")


# networks/lora.py's RE_UPDOWN: SD 1/2 UNet names (diffusers layout) -> block numbers for block weights / dims
_SD_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def block_index(lora_name: str, sdxl: bool) -> int:
    """The UNet block a module belongs to, numbered as sd-scripts' ``get_block_index`` numbers it
    (SD 1/2: down 1-11, mid 12, up 13-24; SDXL: 0 emb, 1-9 input, 10-12 middle, 13-21 output, 22 out);
    -1 for a name outside them, which Python indexing maps to the last block, as in sd-scripts."""
    name = lora_name.removeprefix("lora_unet_")
    if not sdxl:
        match = _SD_UPDOWN.search(lora_name)
        if match:
            side, i, kind, j = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
            idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
            return 1 + idx if side == "down" else SD_DOWN_UP_BLOCKS + 1 + idx
        return SD_DOWN_UP_BLOCKS if "mid_block_" in lora_name else -1
    if name.startswith(("time_embed_", "label_emb_")):
        return 0
    for prefix, first in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
        if name.startswith(prefix):
            return first + int(name.split("_")[2])
    return 22 if name.startswith("out_") else -1


class LoRAModule(nn.Module):
    """One low-rank adapter: ``base(x) + up(down(x)) * scale * multiplier`` (scale = alpha / dim).

    The base module is held as a plain (unregistered) reference so that this module's state dict
    holds only ``lora_down.weight``, ``lora_up.weight`` and ``alpha``.
    """

    def __init__(self, lora_name: str, base: nn.Module, dim: int, alpha: float | int | None,
                 multiplier: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None) -> None:
        super().__init__()
        self.lora_name = lora_name
        self.lora_dim = int(dim)
        device = cast(torch.Tensor, base.weight).device
        self.lora_down: nn.Linear | nn.Conv2d
        self.lora_up: nn.Linear | nn.Conv2d
        self.alpha: torch.Tensor
        if isinstance(base, nn.Conv2d):
            self.lora_down = nn.Conv2d(base.in_channels, self.lora_dim, cast(tuple[int, int], base.kernel_size),
                                       cast(tuple[int, int], base.stride), cast(tuple[int, int], base.padding),
                                       bias=False, device=device)
            self.lora_up = nn.Conv2d(self.lora_dim, base.out_channels, (1, 1), (1, 1), bias=False, device=device)
        elif isinstance(base, nn.Linear):
            self.lora_down = nn.Linear(base.in_features, self.lora_dim, bias=False, device=device)
            self.lora_up = nn.Linear(self.lora_dim, base.out_features, bias=False, device=device)
        else:
            raise TypeError(f"LoRA supports Linear and Conv2d, not {type(base).__name__} ({lora_name})")
        alpha = float(alpha) if alpha else float(self.lora_dim)  # None or 0 -> alpha = dim
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32, device=device))
        self.scale = alpha / self.lora_dim
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self.multiplier = multiplier
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self._base = (base,)  # tuple: not registered as a submodule
        self._saved_forward: Any = None
        self._had_instance_forward = False
        self.applied = False

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @property
    def is_conv(self) -> bool:
        return isinstance(self.lora_down, nn.Conv2d)

    def set_alpha(self, alpha: float) -> None:
        """Set alpha and the scale that follows from it (a loaded file's alpha must change the output)."""
        alpha = float(alpha) if alpha else float(self.lora_dim)
        self.alpha.fill_(alpha)
        self.scale = alpha / self.lora_dim

    def apply_to(self) -> None:
        if self.applied:
            return
        base = self.base
        self._had_instance_forward = "forward" in base.__dict__
        self._saved_forward = base.forward
        base.forward = self.forward
        self.applied = True

    def remove(self) -> None:
        if not self.applied:
            return
        base = self.base
        if self._had_instance_forward:
            base.forward = self._saved_forward
        else:
            del base.forward  # back to the class's own forward
        self._saved_forward = None
        self.applied = False

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``up(down(x)) * scale * multiplier`` with kohya's dropouts when training (no base output)."""
        weight_dtype = self.lora_down.weight.dtype
        if x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
            x = x.to(weight_dtype)  # under autocast the layer casts itself; a copy here would be kept for backward
        lx = self.lora_down(x)
        scale = self.scale
        if self.training and self.dropout:
            lx = nn.functional.dropout(lx, p=self.dropout)
        if self.training and self.rank_dropout:
            mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
            if lx.dim() == 3:  # Linear on [batch, tokens, dim]
                mask = mask.unsqueeze(1)
            elif lx.dim() == 4:  # Conv on [batch, dim, h, w]
                mask = mask.unsqueeze(-1).unsqueeze(-1)
            lx = lx * mask.to(lx.dtype)
            scale = scale / (1.0 - self.rank_dropout)  # keep the expected output unchanged
        return self.lora_up(lx) * (self.multiplier * scale)

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        base_out = self._saved_forward(x, *args, **kwargs)
        if self.multiplier == 0:
            return base_out
        if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
            return base_out
        delta = self.lora_delta(x)
        return base_out + (delta if delta.dtype == base_out.dtype else delta.to(base_out.dtype))


# ------------------------------------------------------------------------------ fused targets (FLUX)
# One LoRA module over several Linears that another layout fuses into one (FLUX: BFL's img_attn.qkv is
# diffusers' to_q/to_k/to_v; linear1 adds proj_mlp). kohya trains the fused Linear: one lora_down [dim, in]
# and one lora_up [sum(outs), dim]. The same two matrices drive the separate diffusers Linears: part i adds
# up[rows_i] @ down(x), exactly the fused layer's output cut into its parts, so the file's keys and shapes
# are kohya's. The parts see the same input tensor; down(x) (with its dropouts) is computed once for all.


@dataclass(frozen=True)
class FusedTargets:
    """Linears that one LoRA module covers, in the fused layer's output order (looks like one Linear to
    code that only reads ``in_features`` / ``out_features`` / ``weight``, such as the memory tracer)."""

    parts: tuple[nn.Linear, ...]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def weight(self) -> torch.Tensor:
        return self.parts[0].weight


class LoRAModuleOptions(TypedDict, total=False):
    """``LoRAModule``'s keyword options, as ``create_network`` passes them on to every module."""

    multiplier: float
    dropout: float | None
    rank_dropout: float | None
    module_dropout: float | None


class FusedLoRAModule(LoRAModule):
    """A LoRA module whose ``lora_up`` rows are split across ``targets.parts`` (see the module docstring)."""

    def __init__(self, lora_name: str, targets: FusedTargets, dim: int, alpha: float | int | None,
                 **kwargs: Unpack[LoRAModuleOptions]) -> None:
        stand_in = nn.Linear(targets.in_features, targets.out_features, bias=False, device="meta")
        super().__init__(lora_name, stand_in, dim, alpha, **kwargs)
        device = targets.weight.device
        if device.type != "meta":  # the stand-in put the parameters on meta; rebuild them where the model is
            self.lora_down = nn.Linear(targets.in_features, self.lora_dim, bias=False, device=device)
            self.lora_up = nn.Linear(self.lora_dim, targets.out_features, bias=False, device=device)
            nn.init.kaiming_uniform_(self.lora_down.weight, a=5 ** 0.5)
            nn.init.zeros_(self.lora_up.weight)
            self.alpha = torch.tensor(self.scale * self.lora_dim, dtype=torch.float32, device=device)
        self.targets = targets
        self._base = (targets.parts[0],)
        self._part_saved: list[tuple[Any, bool]] = []
        self._shared: tuple[torch.Tensor, torch.Tensor | None, set[int]] | None = None  # (x, down(x), parts left)
        self._shared_scale = self.scale
        offsets = [0]
        for part in targets.parts:
            offsets.append(offsets[-1] + part.out_features)
        self.offsets = tuple(offsets)

    def apply_to(self) -> None:
        if self.applied:
            return
        self._part_saved = []
        for index, part in enumerate(self.targets.parts):
            self._part_saved.append((part.forward, "forward" in part.__dict__))
            setattr(part, "forward", self._part_forward(index))  # noqa: B010 - an instance attribute, on purpose
        self.applied = True

    def remove(self) -> None:
        if not self.applied:
            return
        for part, (saved, had_instance_forward) in zip(self.targets.parts, self._part_saved):
            if had_instance_forward:
                setattr(part, "forward", saved)  # noqa: B010
            else:
                del part.forward
        self._part_saved = []
        self._shared = None
        self.applied = False

    def _down(self, x: torch.Tensor, index: int) -> tuple[torch.Tensor | None, float]:
        """``down(x)`` with kohya's dropouts, shared by the parts that see the same ``x`` (None: module dropout
        skipped the whole fused module this time)."""
        shared = self._shared
        lx: torch.Tensor | None
        if shared is not None and shared[0] is x and index in shared[2]:
            shared[2].discard(index)
            lx, scale = shared[1], self._shared_scale
        else:
            weight_dtype = self.lora_down.weight.dtype
            h = x if x.dtype == weight_dtype or torch.is_autocast_enabled(x.device.type) else x.to(weight_dtype)
            down: torch.Tensor = self.lora_down(h)
            lx = down
            scale = self.scale
            if self.training and self.module_dropout and torch.rand(()) < self.module_dropout:
                lx = None
            elif self.training and self.dropout:
                lx = nn.functional.dropout(down, p=self.dropout)
            if lx is not None and self.training and self.rank_dropout:
                mask = torch.rand((lx.size(0), self.lora_dim), device=lx.device) > self.rank_dropout
                lx = lx * (mask.unsqueeze(1) if lx.dim() == 3 else mask).to(lx.dtype)
                scale = scale / (1.0 - self.rank_dropout)
            self._shared = (x, lx, set(range(len(self.targets.parts))) - {index})
            self._shared_scale = scale
        if self._shared is not None and not self._shared[2]:
            self._shared = None  # every part has had it: do not keep activations alive
        return lx, scale

    def _part_forward(self, index: int) -> Callable[..., torch.Tensor]:
        saved = self._part_saved[index][0]
        start, stop = self.offsets[index], self.offsets[index + 1]

        def forward(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            base_out = saved(x, *args, **kwargs)
            if self.multiplier == 0:
                return base_out
            lx, scale = self._down(x, index)
            if lx is None:
                return base_out
            delta = nn.functional.linear(lx, self.lora_up.weight[start:stop]) * (self.multiplier * scale)
            return base_out + (delta if delta.dtype == base_out.dtype else delta.to(base_out.dtype))

        return forward

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        """The fused layer's output, parts stacked on the last axis (what kohya's fused Linear returns)."""
        return torch.cat([part(x) for part in self.targets.parts], dim=-1)


def _clip_name(name: str) -> str:
    """transformers-4 CLIP module name: transformers 5's CLIPTextModel dropped the ``text_model.`` level
    (CLIPTextModelWithProjection still has it), while kohya's keys always carry it."""
    return name if name.startswith("text_model.") else f"text_model.{name}"


def _lora_key(prefix: str, name: str) -> str:
    return f"{prefix}_{name.replace('.', '_')}"


def _is_1x1(module: nn.Module) -> bool:
    return isinstance(module, nn.Conv2d) and tuple(module.kernel_size) == (1, 1)


def iter_target_modules(bundle: ModelBundle, *, conv: bool, unet: bool = True, text_encoder: bool = True,
                        enable: frozenset[str] | set[str] = frozenset()) -> Iterator[tuple[str, str, Any, bool]]:
    """Yield ``(lora_name, part, base_module, uses_conv_dim)`` for every module kohya would wrap.

    ``part`` is "unet" or the text encoder's lora prefix; ``uses_conv_dim`` marks 3x3 convs. ``enable``
    names the network_args that add text encoders trained only on request (``train_t5xxl``). For FLUX's
    fused Linears ``base_module`` is a ``FusedTargets``.
    """
    family = bundle.family
    if text_encoder:
        for spec, encoder in zip(family.text_encoders, bundle.text_encoders, strict=True):
            if not spec.lora_by_default and spec.lora_enable_arg not in enable:
                continue
            rename = _clip_name if spec.class_name.startswith("CLIP") else str
            for name, module in encoder.named_modules():
                if type(module).__name__ not in TEXT_ENCODER_TARGETS:
                    continue
                for child_name, child in module.named_modules():
                    if isinstance(child, nn.Linear):
                        full = f"{name}.{child_name}" if child_name else name
                        yield _lora_key(spec.lora_prefix, rename(full)), spec.lora_prefix, child, False
    if unet and family.unet_lora_names in ("bfl", "table"):
        from sd_scripts_compat.models.flux_layout import lora_targets, table_lora_targets

        fused = lora_targets(bundle.unet) if family.unet_lora_names == "bfl" \
            else table_lora_targets(bundle.unet, family.lora_layout)
        for kohya_name, parts in fused:
            linears = cast(tuple[nn.Linear, ...], parts)
            yield _lora_key("lora_unet", kohya_name), "unet", \
                linears[0] if len(linears) == 1 else FusedTargets(linears), False
    elif unet:
        targets = UNET_TARGETS + (UNET_CONV_TARGETS if conv else ())
        unet_config = dict(bundle.unet.config)
        sgm = family.unet_lora_names == "sgm"
        if sgm:
            from sd_scripts_compat.models.unet_names import diffusers_to_ldm_unet_name
        for name, module in bundle.unet.named_modules():
            if type(module).__name__ not in targets:
                continue
            for child_name, child in module.named_modules():
                if not isinstance(child, nn.Linear | nn.Conv2d):
                    continue
                full = f"{name}.{child_name}" if child_name else name
                key_name = diffusers_to_ldm_unet_name(full, unet_config) if sgm else full
                uses_conv_dim = isinstance(child, nn.Conv2d) and not _is_1x1(child)
                yield _lora_key("lora_unet", key_name), "unet", child, uses_conv_dim


class LoRANetwork(nn.Module):
    """All LoRA modules of one model bundle; its ``state_dict()`` is the kohya state dict."""

    def __init__(self, bundle: ModelBundle, modules: list[tuple[str, LoRAModule]],
                 args: NetworkArgs | None = None) -> None:
        super().__init__()
        self.bundle = bundle
        self.args = args or NetworkArgs()  # LoRA+ ratios and block lr weights shape the optimizer groups
        self.unet_loras: list[LoRAModule] = []
        self.text_encoder_loras: list[LoRAModule] = []
        for part, lora in modules:
            self.add_module(lora.lora_name, lora)
            (self.unet_loras if part == "unet" else self.text_encoder_loras).append(lora)

    @property
    def unet_modules(self) -> int:
        return len(self.unet_loras)

    @property
    def text_encoder_modules(self) -> int:
        return len(self.text_encoder_loras)

    @property
    def conv_modules(self) -> int:
        """UNet modules on 3x3 convs (LoCon); 0 without conv_dim."""
        return sum(1 for lora in self.unet_loras
                   if isinstance(lora.lora_down, nn.Conv2d) and tuple(lora.lora_down.kernel_size) != (1, 1))

    def loras(self) -> list[LoRAModule]:
        return self.text_encoder_loras + self.unet_loras

    def apply_to(self) -> None:
        for lora in self.loras():
            lora.apply_to()

    def remove(self) -> None:
        for lora in self.loras():
            lora.remove()

    def set_multiplier(self, m: float) -> None:
        for lora in self.loras():
            lora.multiplier = float(m)

    def prepare_optimizer_params(self, text_encoder_lr: float | None, unet_lr: float | None,
                                 default_lr: float) -> list[dict[str, Any]]:
        """Optimizer param groups as sd-scripts builds them: text encoder groups, then UNet groups.

        A part's lr is its own lr when given, else ``default_lr``. With a LoRA+ ratio a part has two
        groups: its ``lora_down`` weights at lr and its ``lora_up`` weights at lr x ratio.
        With block lr weights the UNet has one group (pair) per block, in the order of the blocks' first
        modules, at lr x the block's weight. A group whose lr is 0 is left out (as sd-scripts does) and
        its parameters are frozen.
        """
        args = self.args
        te_lr = default_lr if text_encoder_lr is None else text_encoder_lr
        groups = _lora_groups(self.text_encoder_loras, te_lr, args.text_encoder_plus_ratio, "text_encoder")
        unet_lr = default_lr if unet_lr is None else unet_lr
        if args.block_lr_weight is None:
            return groups + _lora_groups(self.unet_loras, unet_lr, args.unet_plus_ratio, "unet")
        sdxl = self.bundle.family.unet_lora_names == "sgm"
        by_block: dict[int, list[LoRAModule]] = {}
        for lora in self.unet_loras:
            by_block.setdefault(block_index(lora.lora_name, sdxl), []).append(lora)
        for index, loras in by_block.items():
            groups += _lora_groups(loras, unet_lr * args.block_lr_weight[index], args.unet_plus_ratio, "unet")
        return groups

    def kohya_state_dict(self) -> dict[str, torch.Tensor]:
        """Exact kohya keys: ``<lora_name>.lora_down.weight``, ``.lora_up.weight``, ``.alpha`` (0-dim); each
        ``lora_up``'s rows in the file's order (``file_order``)."""
        return file_order(self.bundle.family, {key: value.detach() for key, value in self.state_dict().items()})

    def load_kohya_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True,
                              source: str = "LoRA weights") -> None:
        """Load kohya weights (alpha may be int64 or float; tensors of any float dtype are cast).

        Refuses, with a UserError naming ``source``, a file made for another family (other key scheme
        or other widths). ``strict``: the file's keys must be exactly this network's. Unlike sd-scripts,
        a loaded alpha also updates the module's scale, so the output follows the file.
        """
        check_lora_family(sd, self.bundle.family, source)
        sd = file_order(self.bundle.family, sd)  # the file's row order -> ours (the swap is its own inverse)
        own = self.state_dict()
        unexpected = sorted(set(sd) - set(own))
        missing = sorted(set(own) - set(sd))
        if strict and (unexpected or missing):
            detail = (f"{len(unexpected)} keys the model has no module for (e.g. {unexpected[0]})" if unexpected
                      else f"{len(missing)} keys missing (e.g. {missing[0]})")
            raise UserError(f"{source}: LoRA does not match this network: {detail}; "
                            "create the network from the file's own dims (dim_from_weights)")
        by_name = {lora.lora_name: lora for lora in self.loras()}
        for key, value in sd.items():
            if key not in own:
                continue
            target = own[key]
            if tuple(value.shape) != tuple(target.shape):
                raise UserError(f"{source}: {key} has shape {list(value.shape)}, the network expects "
                                f"{list(target.shape)}; use the file's own dims (dim_from_weights) or the "
                                "model family it was trained for")
        with torch.no_grad():
            for key, value in sd.items():
                if key not in own:
                    continue
                lora_name, _, param = key.partition(".")
                if param == "alpha":
                    by_name[lora_name].set_alpha(float(value.item()))
                else:
                    own[key].copy_(value.to(own[key].dtype))


def file_order(family: FamilySpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the ``lora_up`` rows of the modules whose base Linear orders its outputs differently in the
    model file than in our diffusers module (SD3's last context modulation: ``sd3_files.swapped_halves``) swapped:
    ours -> the file's, and back. A file's delta then lands on the rows every loader (sd-scripts, ComfyUI) adds it
    to."""
    from sd_scripts_compat.models.sd3_files import swap_halves, swapped_halves

    names = {f"{_lora_key('lora_unet', name)}.lora_up.weight" for name in swapped_halves(family)}
    return {key: swap_halves(value) if key in names else value for key, value in state.items()}


def _lora_groups(loras: list[LoRAModule], lr: float, plus_ratio: float | None, part: str) -> list[dict[str, Any]]:
    """One part's groups: every parameter at ``lr``, or with LoRA+ the ``lora_up`` weights apart at
    ``lr * plus_ratio``; empty or zero-lr groups are dropped and their parameters frozen. Each group names its
    ``part`` ("text_encoder" or "unet": what the progress bar's rate is read from)."""
    plain = [p for lora in loras for name, p in lora.named_parameters() if not (plus_ratio and "lora_up" in name)]
    plus = [p for lora in loras for name, p in lora.named_parameters() if plus_ratio and "lora_up" in name]
    groups = []
    for params, group_lr in ((plain, lr), (plus, lr * (plus_ratio or 0.0))):
        for param in params:
            param.requires_grad_(bool(group_lr))
        if params and group_lr:
            groups.append({"params": params, "lr": group_lr, "part": part})
    return groups


def _new_module(lora_name: str, base: torch.nn.Module | FusedTargets, dim: int, alpha: float | None,
                **kwargs: Unpack[LoRAModuleOptions]) -> LoRAModule:
    # Parameters are created on the base module's device (meta stays meta: shapes only).
    if isinstance(base, FusedTargets):
        return FusedLoRAModule(lora_name, base, dim, alpha, **kwargs)
    return LoRAModule(lora_name, base, dim, alpha, **kwargs)


def create_network(bundle: ModelBundle, *, network_dim: int = 4, network_alpha: float = 1.0,
                   dropout: float | None = None, args: NetworkArgs | None = None, train_unet: bool = True,
                   train_text_encoder: bool = True, multiplier: float = 1.0) -> LoRANetwork:
    """A fresh kohya LoRA network for ``bundle`` (not yet applied: call ``apply_to()``).

    ``dropout`` is sd-scripts' ``network_dropout``; ``args`` the typed ``network_args``: LoCon
    (``conv_dim``: modules on the ResnetBlock2D / Downsample2D / Upsample2D convs), rank and module
    dropout, block dims / alphas (a rank per UNet block; rank 0 or a block lr weight of 0: no module),
    FLUX's ``train_t5xxl`` (``lora_te3_``) and ``train_blocks``, LoRA+ and block lr weights (kept for
    :meth:`LoRANetwork.prepare_optimizer_params`). Parts not trained get no modules (no keys in the file).
    """
    args = args or NetworkArgs()
    if network_dim is None or network_dim < 1:
        raise UserError(f"network_dim must be a positive integer, got {network_dim!r}")
    options = LoRAModuleOptions(multiplier=multiplier, dropout=dropout, rank_dropout=args.rank_dropout,
                                module_dropout=args.module_dropout)
    conv = args.conv_dim is not None or args.conv_block_dims is not None
    sdxl = bundle.family.unet_lora_names == "sgm"
    modules = []
    enable = {"train_t5xxl"} if args.train_t5xxl else set()
    for lora_name, part, base, uses_conv_dim in iter_target_modules(
            bundle, conv=conv, unet=train_unet, text_encoder=train_text_encoder, enable=enable):
        if part == "unet" and args.train_blocks != "all" and f"_{args.train_blocks}_blocks_" not in lora_name:
            continue
        dim, alpha = _rank(lora_name, part == "unet", uses_conv_dim, args, (network_dim, network_alpha), sdxl)
        if dim:
            modules.append((part, _new_module(lora_name, base, dim, alpha, **options)))
    return LoRANetwork(bundle, modules, args)


def _rank(lora_name: str, in_unet: bool, uses_conv_dim: bool, args: NetworkArgs, rank: tuple[int, float],
          sdxl: bool) -> tuple[int | None, float | None]:
    """(dim, alpha) of one module as sd-scripts' ``create_modules`` picks it; dim 0 or None: no module."""
    if in_unet and args.block_dims is not None:
        index = block_index(lora_name, sdxl)
        if not uses_conv_dim:
            return args.block_dims[index], args.block_alphas[index] if args.block_alphas is not None else None
        if args.conv_block_dims is None:
            return None, None
        return args.conv_block_dims[index], \
            args.conv_block_alphas[index] if args.conv_block_alphas is not None else None
    return (args.conv_dim, args.conv_alpha) if uses_conv_dim else rank


def create_network_from_weights(bundle: ModelBundle, weights: dict[str, torch.Tensor] | str, *,
                                train_unet: bool = True, train_text_encoder: bool = True,
                                multiplier: float = 1.0, args: NetworkArgs | None = None) -> LoRANetwork:
    """A network shaped by a kohya file (``dim_from_weights``): one module per module in the file,
    dims from ``lora_down`` and alphas from ``alpha``; the file's weights are loaded into it. ``args``
    shape the optimizer groups (LoRA+, block lr weights), not the modules.

    Keys of a part not trained (``train_text_encoder=False``...) are ignored, as in sd-scripts.
    """
    source = "LoRA weights"
    if isinstance(weights, str):
        from sd_scripts_compat.network.lora_file import read_lora_file

        source = weights
        weights, _ = read_lora_file(weights)
    check_lora_family(weights, bundle.family, source)
    modules = []
    used: set[str] = set()
    every_arg = {te.lora_enable_arg for te in bundle.family.text_encoders if te.lora_enable_arg}
    for lora_name, part, base, _ in iter_target_modules(bundle, conv=True, unet=train_unet,
                                                       text_encoder=train_text_encoder, enable=every_arg):
        down = weights.get(f"{lora_name}.lora_down.weight")
        if down is None:
            continue
        alpha = weights.get(f"{lora_name}.alpha")
        module = _new_module(lora_name, base, int(down.shape[0]),
                             None if alpha is None else float(alpha.item()), multiplier=multiplier)
        modules.append((part, module))
        used.update(k for k in (f"{lora_name}.lora_down.weight", f"{lora_name}.lora_up.weight",
                                f"{lora_name}.alpha") if k in weights)
    prefixes = (["lora_unet_"] if train_unet else []) + (
        [f"{te.lora_prefix}_" for te in bundle.family.text_encoders] if train_text_encoder else [])
    wanted = {k: v for k, v in weights.items() if k.startswith(tuple(prefixes))}
    leftover = sorted(set(wanted) - used)
    if leftover:
        raise UserError(f"{source}: {len(leftover)} LoRA keys have no matching module in a "
                        f"{bundle.family.name} model (e.g. {leftover[0]}); is it for another model family?")
    network = LoRANetwork(bundle, modules, args)
    network.load_kohya_state_dict({k: weights[k] for k in used}, strict=False, source=source)
    return network


def check_lora_family(sd: dict[str, torch.Tensor], family: FamilySpec, source: str) -> None:
    """UserError when the key scheme of a kohya state dict (text-encoder prefixes, SD1/2 diffusers vs
    SDXL SGM UNet names) or its cross-attention / text-encoder widths do not fit ``family``."""
    from sd_scripts_compat.network.lora_file import lora_layout

    layout = lora_layout(sd)
    label = layout["label"]
    te_prefixes = {te.lora_prefix for te in family.text_encoders}
    foreign = sorted(set(layout["te_prefixes"]) - te_prefixes)
    if foreign or (layout["unet_names"] and layout["unet_names"] != family.unet_lora_names):
        raise UserError(f"{source}: this LoRA was made for {label}, but the model is {family.name} "
                        f"({family.description}); use a LoRA trained for this model family")
    cross = family.unet.get("cross_attention_dim")
    if layout["cross_attention_dim"] is not None and layout["cross_attention_dim"] != cross:
        raise UserError(f"{source}: this LoRA was made for {label} (cross-attention width "
                        f"{layout['cross_attention_dim']}), but the model {family.name} has {cross}")
    for te in family.text_encoders:
        width = layout["te_widths"].get(te.lora_prefix)
        if width is not None and width != te.width:
            raise UserError(f"{source}: this LoRA was made for {label} ({te.lora_prefix} width {width}), "
                            f"but the model {family.name} has {te.width}")
