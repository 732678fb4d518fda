"""The in-memory model bundle and building a family's modules from its configs (random weights).

Every loader (built-in id, diffusers folder, single-file checkpoint) returns a ``ModelBundle``, so
the trainer, the LoRA network and the memory tracer see one shape whatever the user's file was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.families import CLIP_TOKENIZER_DIR, FamilySpec, TextEncoderSpec, model_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


@dataclass
class ModelBundle:
    family: FamilySpec
    # diffusers modules (typed Any: mypy does not see diffusers' models as torch modules)
    unet: Any  # the denoiser: a UNet, or FLUX's FluxTransformer2DModel (see ``denoiser``)
    vae: Any  # the VAE / AE (AutoencoderKL)
    text_encoders: list[Any]  # transformers CLIPTextModel / CLIPTextModelWithProjection / T5EncoderModel
    tokenizers: list[Any]  # one per text encoder (CLIPTokenizer, T5TokenizerFast; None: not found yet)
    scheduler_config: dict[str, Any]
    prediction_type: str
    source: str = ""  # what it was loaded from: "builtin:tiny-sd15", a path, ...
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def denoiser(self) -> torch.nn.Module:
        """The family's denoiser whatever its kind (the field keeps the name ``unet`` for old callers)."""
        return self.unet


def load_tokenizer(folder: str | None = None, pad_token: str | None = "<|endoftext|>",
                   max_length: int = 77) -> PreTrainedTokenizerBase:
    """A CLIP tokenizer from ``folder`` (a model's own tokenizer) or from the vocabulary we ship.

    transformers 5 ignores ``vocab_file=``/``merges_file=`` keyword paths, so we always go through
    ``from_pretrained`` on a folder holding vocab.json + merges.txt (no hub access).
    ``pad_token=None`` keeps the folder's own pad token (a model folder knows best how it pads).
    """
    from transformers import CLIPTokenizer

    source = folder or str(CLIP_TOKENIZER_DIR)
    kwargs: dict[str, Any] = {} if pad_token is None else {"pad_token": pad_token}
    return CLIPTokenizer.from_pretrained(source, model_max_length=max_length, local_files_only=True, **kwargs)


def build_text_encoder(config: dict[str, Any]) -> torch.nn.Module:
    """A transformers text encoder named by ``_class_name`` (CLIPTextModel, T5EncoderModel, ...) from its config."""
    import transformers

    cls = getattr(transformers, config["_class_name"])
    return cls(cls.config_class(**model_config(config)))


def build_denoiser(config: dict[str, Any]) -> torch.nn.Module:
    """The diffusers denoiser named by ``_class_name`` (UNet2DConditionModel, FluxTransformer2DModel)."""
    import diffusers

    return getattr(diffusers, config["_class_name"])(**model_config(config))


def family_tokenizers(family: FamilySpec, t5_tokenizer: str | None = None) -> list[Any]:
    """One tokenizer per text encoder: CLIP from the shipped vocabulary; T5 from ``t5_tokenizer`` (a local
    folder or file), or the tiny one shipped for tiny families; None when there is none yet (the caller
    that encodes text reports where to put it)."""
    from sd_scripts_compat.models.t5_tokenizer import TINY_T5_TOKENIZER_DIR, load_t5_tokenizer

    out: list[Any] = []
    for te in family.text_encoders:
        max_length = te.tokenizer["model_max_length"]
        if te.tokenizer_kind == "clip":
            out.append(load_tokenizer(pad_token=te.tokenizer["pad_token"], max_length=max_length))
        elif t5_tokenizer is not None:
            out.append(load_t5_tokenizer(t5_tokenizer, max_length))
        else:
            out.append(load_t5_tokenizer(TINY_T5_TOKENIZER_DIR, max_length) if family.tiny else None)
    return out


def tiny_twin(family: FamilySpec) -> FamilySpec:
    """The tiny family trained by the same script as ``family`` (same FLUX model type): what to try it with."""
    from sd_scripts_compat.facts.families import family_names, get_family

    tiny = [get_family(name) for name in family_names() if get_family(name).tiny]
    return next((f for f in tiny if (f.kohya_script, f.flux_model_type) == (family.kohya_script,
                                                                            family.flux_model_type)), tiny[0])


def empty_modules(family: FamilySpec) -> tuple[Any, Any, list[Any]]:
    """A family's denoiser, VAE and text encoders with parameters on the meta device (real buffers), to be filled
    from a file by ``load_state_dict(assign=True)``: no random weights drawn only to be overwritten."""
    import diffusers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return (build_denoiser(family.unet),
                getattr(diffusers, family.vae.get("_class_name", "AutoencoderKL"))(**model_config(family.vae)),
                [empty_text_encoder(te) for te in family.text_encoders])


def empty_text_encoder(encoder: TextEncoderSpec) -> Any:
    """One text encoder with parameters on the meta device (see ``empty_modules``)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return build_text_encoder(encoder.config)


def check_trainable(family: FamilySpec, *, builtin: bool) -> None:
    """Our engine trains this family (else one line naming its trainer's script), and a built-in is more than
    a shape-only full-size stand-in."""
    from sd_scripts_compat.facts.errors import UserError

    if not family.trained_here:
        raise UserError(f"{family.name}: {family.description} is not trained by this engine; train it with "
                        f"{family.trainer}'s {family.kohya_script} (autotune run --engine {family.trainer}=PATH "
                        "supervises it)")
    if builtin and family.builtin_meta_only:
        raise UserError(f"builtin:{family.name} is a full-size model with random weights, for shape-only probes; "
                        "to train, give the real model file as pretrained_model_name_or_path (or use "
                        f"builtin:{tiny_twin(family).name} to try)")


def build_modules(family: FamilySpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  seed: int | None = 0, builtin: bool = False, vae_dtype: torch.dtype | None = None) -> ModelBundle:
    """Build a family's denoiser, VAE and text encoders from its configs with random weights.

    ``device="meta"`` builds only shapes (a full SDXL in well under a second, FLUX.1 in a few), for FLOP
    counting and memory tracing without allocating gigabytes. ``builtin``: the user asked for
    ``builtin:<name>``; a family too large for random weights (``builtin_meta_only``) is then a UserError
    off the meta device. Weights are drawn in fp32 (the same values whatever ``dtype``), then cast to ``dtype``
    (the VAE to ``vae_dtype`` when given).
    """
    import diffusers
    import torch

    if str(device) != "meta":
        check_trainable(family, builtin=builtin)

    # the weights come from their own seed, leaving the caller's random stream as it was: a run from builtin:ID
    # draws its LoRA and noise exactly as a run from the same weights saved as files
    with torch.random.fork_rng(devices=[]), torch.device(device):
        if seed is not None and str(device) != "meta":
            torch.manual_seed(seed)
        unet = build_denoiser(family.unet)
        vae = getattr(diffusers, family.vae.get("_class_name", "AutoencoderKL"))(**model_config(family.vae))
        text_encoders = [build_text_encoder(te.config) for te in family.text_encoders]
    modules = [unet, vae, *text_encoders]
    for module in modules:
        module.requires_grad_(False)
        module.eval()
        target = vae_dtype if module is vae and vae_dtype is not None else dtype
        if target is not None:
            module.to(target)
    tokenizers = family_tokenizers(family)
    return ModelBundle(family=family, unet=unet, vae=vae, text_encoders=text_encoders, tokenizers=tokenizers,
                       scheduler_config=dict(family.scheduler), prediction_type=family.prediction_type,
                       source=f"builtin:{family.name}")
