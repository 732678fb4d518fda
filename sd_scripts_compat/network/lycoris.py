"""LyCORIS (LoCon, LoHa, LoKr, ...) through lycoris-lora's kohya entry point, as sd-scripts trains it.

``network_module = "lycoris.kohya"`` in sd-scripts calls ``lycoris.kohya.create_network`` with the
``network_args`` as keywords; so does this module, with the same package (the ``lycoris`` extra). The
modules, their math and their tensor names are lycoris-lora's. What is ours is the naming seam: our
models are diffusers modules, sd-scripts' are kohya's, so each module name lycoris derives from our
model is renamed to the one it derives from sd-scripts' (transformers-4 ``text_model.`` CLIP names,
SDXL's SGM UNet names); modules lycoris picks by a diffusers-only name (``conv_in``, ``conv_out``,
``time_embedding.*``) are dropped for SDXL, whose SGM UNet has no such names in sd-scripts. The file then
has the keys lycoris writes in sd-scripts, and loads where those load (ComfyUI, A1111/Forge).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sd_scripts_compat.config.network_args import NetworkArgs, check_lycoris_installed
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from types import ModuleType

    from lycoris.kohya import LycorisNetworkKohya  # untyped library (mypy reads it as Any)

    from sd_scripts_compat.models.build import ModelBundle

def _import_kohya_entry(quiet: bool) -> ModuleType:
    check_lycoris_installed()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU-kernel notice on import
    import lycoris.kohya

    # its per-network INFO lines go; its warnings (a rank that falls back to full matrices) stay unless quiet
    logging.getLogger("LyCORIS").setLevel(logging.ERROR if quiet else logging.WARNING)
    return lycoris.kohya


def _kohya_names(bundle: ModelBundle) -> dict[str, str]:
    """lycoris' module name for our model -> the name it gives sd-scripts' model, for every module."""
    from sd_scripts_compat.network.lora import _clip_name

    family = bundle.family
    names: dict[str, str] = {}
    many = len(bundle.text_encoders) > 1
    for index, (spec, encoder) in enumerate(zip(family.text_encoders, bundle.text_encoders, strict=True)):
        ours = f"lora_te{index + 1}" if many else "lora_te"
        rename = _clip_name if spec.class_name.startswith("CLIP") else str
        for name, _ in encoder.named_modules():
            if name:
                names[f"{ours}_{name}".replace(".", "_")] = f"{spec.lora_prefix}_{rename(name)}".replace(".", "_")
    sgm = family.unet_lora_names == "sgm"
    if sgm:
        from sd_scripts_compat.models.unet_names import diffusers_to_ldm_unet_name
    config = dict(bundle.unet.config)
    for name, _ in bundle.unet.named_modules():
        if not name:
            continue
        try:
            kohya = diffusers_to_ldm_unet_name(name, config) if sgm else name
        except ValueError:
            continue  # a container (down_blocks.0) that holds no target of its own
        names[f"lora_unet_{name}".replace(".", "_")] = f"lora_unet_{kohya}".replace(".", "_")
    return names


class LycorisNetwork(nn.Module):
    """lycoris-lora's network behind the interface the training loop uses (``apply_to``, parameter groups,
    kohya state dicts); its ``inner`` is the package's ``LycorisNetworkKohya``."""

    def __init__(self, bundle: ModelBundle, inner: LycorisNetworkKohya, names: dict[str, str]) -> None:
        super().__init__()
        self.bundle = bundle
        self.inner = inner
        self._to_kohya = names
        self._from_kohya = {kohya: ours for ours, kohya in names.items()}
        self.applied = False

    @property
    def unet_modules(self) -> int:
        return len(self.inner.unet_loras)

    @property
    def text_encoder_modules(self) -> int:
        return len(self.inner.text_encoder_loras)

    def loras(self) -> list[nn.Module]:
        return list(self.inner.text_encoder_loras) + list(self.inner.unet_loras)

    def apply_to(self) -> None:
        if self.applied:
            return
        self.applied = True
        encoders = list(self.bundle.text_encoders)
        self.inner.apply_to(encoders if len(encoders) > 1 else encoders[0], self.bundle.unet,
                            bool(self.inner.text_encoder_loras), bool(self.inner.unet_loras))

    def prepare_optimizer_params(self, text_encoder_lr: float | None, unet_lr: float | None,
                                 default_lr: float) -> list[dict[str, Any]]:
        """lycoris' own groups (LoRA+ included, zero-lr groups left out); parameters in no group are frozen."""
        groups, _ = self.inner.prepare_optimizer_params(text_encoder_lr, unet_lr, default_lr)
        groups = [{**group, "params": list(group["params"])} for group in groups]
        kept = {id(p) for group in groups for p in group["params"]}
        for param in self.inner.parameters():
            param.requires_grad_(id(param) in kept)
        return groups

    def kohya_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in self.inner.state_dict().items():
            name, _, rest = key.partition(".")
            out[f"{self._to_kohya.get(name, name)}.{rest}"] = value.detach()
        return out

    def load_kohya_state_dict(self, sd: dict[str, torch.Tensor], strict: bool = True,
                              source: str = "LoRA weights") -> None:
        ours = {}
        for key, value in sd.items():
            name, _, rest = key.partition(".")
            ours[f"{self._from_kohya.get(name, name)}.{rest}"] = value
        own = self.inner.state_dict()
        unexpected, missing = sorted(set(ours) - set(own)), sorted(set(own) - set(ours))
        if strict and (unexpected or missing):
            detail = f"{len(unexpected)} unexpected keys" if unexpected else f"{len(missing)} keys missing"
            raise UserError(f"{source}: LyCORIS weights do not match this network ({detail}); train with the "
                            "network_args the file was made with")
        for key, value in ours.items():
            if key in own and tuple(value.shape) != tuple(own[key].shape):
                raise UserError(f"{source}: {key} has shape {list(value.shape)}, the network expects "
                                f"{list(own[key].shape)}; train with the network_args the file was made with")
        self.inner.load_state_dict({k: v for k, v in ours.items() if k in own}, strict=False)


def create_lycoris_network(bundle: ModelBundle, *, network_dim: int, network_alpha: float,
                           dropout: float | None, args: NetworkArgs, train_unet: bool = True,
                           train_text_encoder: bool = True, multiplier: float = 1.0,
                           quiet: bool = False) -> LycorisNetwork:
    """``lycoris.kohya.create_network`` on our model with the user's network_args, as sd-scripts calls it
    (``network_dropout`` is passed as ``dropout`` there too); ``quiet``: without lycoris' warnings (counting)."""
    kohya_entry = _import_kohya_entry(quiet)
    encoders = list(bundle.text_encoders)
    kwargs: dict[str, Any] = dict(args.lycoris or {})
    if dropout is not None:
        kwargs.setdefault("dropout", dropout)
    try:
        inner = kohya_entry.create_network(multiplier, network_dim, network_alpha, None,
                                           encoders if len(encoders) > 1 else encoders[0], bundle.unet,
                                           warn_on_unmatched=False, **kwargs)
    except (ValueError, TypeError, KeyError, AssertionError) as error:
        if "duplicated lora name" in str(error):  # lycoris-lora 4.x targets SD's time embedding twice
            raise UserError(f"lycoris-lora {_version()} cannot build a network for {bundle.family.name} "
                            f"({error}); install a 3.x release: pip install 'lycoris-lora>=3.2,<4'") from None
        if isinstance(error, KeyError) and error.args == (kwargs.get("algo"),):
            raise UserError(f"network_args for lycoris.kohya: algo={kwargs['algo']}: lycoris-lora {_version()}'s "
                            "kohya entry point (the one sd-scripts calls too) has no module for it; choose another "
                            "algo") from None
        raise UserError(f"network_args for lycoris.kohya: {error}") from None
    names = _kohya_names(bundle)
    if bundle.family.unet_lora_names == "sgm":
        by_name = {f"lora_unet_{name}".replace(".", "_") for name in type(inner).UNET_TARGET_REPLACE_NAME}
        inner.unet_loras = [lora for lora in inner.unet_loras if lora.lora_name not in by_name]
    if not train_unet:
        inner.unet_loras = []
    if not train_text_encoder:
        inner.text_encoder_loras = []
    inner.loras = inner.text_encoder_loras + inner.unet_loras
    return LycorisNetwork(bundle, inner, names)


def _version() -> str:
    from importlib.metadata import version

    return version("lycoris-lora")
