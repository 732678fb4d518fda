"""Family runtimes: what differs between the families our engine trains, one module per runtime.

A family's JSON names its runtime (``"runtime": "unet"``, ``"flux"``, ``"sd3"``; a dotted module path for a
runtime kept outside this package). :func:`runtime_for` imports that module; the recipe, the loader, the
conditioner, the text cache and sampling ask it and never branch on a family. A runtime module defines what
:class:`FamilyRuntime` lists (a module satisfies the protocol by its functions). A new runtime is one module
plus the families' data naming it.

The modules beside the runtimes are theirs: ``noise_prediction`` (the UNet objective), ``flow_matching``
(FLUX.1's), ``sd3_flow`` (SD3's), the FLUX.1 and SD3 samplers and ``sample_files`` (how every sampler writes
its images).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, family_names, get_family

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.models.build import ModelBundle
    from sd_scripts_compat.models.text_encoding import TextConditioning
    from sd_scripts_compat.runtimes.flow_matching import FlowMatchingObjective
    from sd_scripts_compat.runtimes.noise_prediction import NoisePredictionObjective
    from sd_scripts_compat.runtimes.sd3_flow import Sd3FlowObjective

    # the training objective a runtime builds: what the loop calls ``forward`` / ``loss`` / ``fixed_forward`` on
    Objective = NoisePredictionObjective | FlowMatchingObjective | Sd3FlowObjective
    Encode = Callable[[list[str]], TextConditioning]  # captions -> text-encoder outputs, the run's options applied

PART_OPTIONS = ("clip_l", "clip_g", "t5xxl", "ae", "vae", "t5xxl_tokenizer")  # kohya's separate-file options


@dataclass(frozen=True)
class TextOptions:
    """How a run encodes captions (kohya's options; each runtime reads those its family has)."""

    max_token_length: int | None = None  # CLIP's 75 / 150 / 225 (SD 1/2/XL)
    clip_skip: int | None = None
    dtype: Any = None
    t5xxl_max_token_length: int | None = None  # T5-XXL's length (FLUX.1, SD3)
    apply_t5_attn_mask: bool = False
    apply_lg_attn_mask: bool = False  # SD3: CLIP-L/G do not attend to padding


class FamilyRuntime(Protocol):
    """What a runtime module defines."""

    LOAD_PRIORITY: int  # which runtime's ``claims_source`` is asked first (lowest first; ties by name)

    def claims_source(self, text: str, stated: FamilySpec | None, parts: Mapping[str, str | None]) -> bool:
        """Whether this runtime loads the base model ``text`` (with kohya's part options ``parts``)."""

    def load(self, text: str, *, stated: FamilySpec | None, parts: Mapping[str, str | None], allow_pickle: bool,
             device: str | torch.device, dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
        """Files and folders to modules: the bundle, its ``family`` detected (and checked against ``stated``)."""

    def encode_prompts(self, bundle: ModelBundle, captions: list[str], options: TextOptions) -> TextConditioning:
        """Tokenize and encode captions with every text encoder (keeps autograd)."""

    def text_cache_key(self, options: TextOptions) -> tuple[int | None, str]:
        """The token length and the variant a text-encoder cache records (a file made otherwise is rebuilt)."""

    def conditioning(self, bundle: ModelBundle, hidden: torch.Tensor, pooled: torch.Tensor | None,
                     mask: torch.Tensor | None, batch: Mapping[str, Any], options: TextOptions) -> tuple[Any, Any]:
        """``(encoder_hidden_states, added)``: what the denoiser takes besides the latents."""

    def build_objective(self, config: TrainingConfig, device: torch.device, bundle: ModelBundle,
                        v_parameterization: bool) -> Objective:
        """The training objective: noise, timesteps, target and loss (``forward`` / ``loss`` /
        ``fixed_forward``)."""

    def render_samples(self, bundle: ModelBundle, prompts: list[Any], encode: Encode, *, config: TrainingConfig,
                       out_dir: Path, name: str, device: torch.device, dtype: torch.dtype) -> list[Path]:
        """Render ``sample_prompts`` with the LoRA as trained so far."""

    def file_metadata(self, config: TrainingConfig) -> dict[str, str]:
        """The ``ss_`` keys the family's objective adds to a LoRA file."""


RUNTIME_MEMBERS = tuple(name for name in vars(FamilyRuntime)
                        if not name.startswith("_")) + tuple(FamilyRuntime.__annotations__)


def runtime_for(family: FamilySpec) -> FamilyRuntime:
    """The runtime module ``family`` names; a family our engine does not train is a one-line UserError."""
    if family.runtime is None:
        raise UserError(f"{family.description}: our engine does not train it (no runtime in its family data)")
    return _import_runtime(family.runtime)


def _import_runtime(name: str) -> FamilyRuntime:
    path = name if "." in name else f"{__name__}.{name}"
    try:
        module = importlib.import_module(path)
    except ImportError as error:
        raise UserError(f"runtime {name!r}: cannot import {path} ({error})") from None
    missing = [member for member in RUNTIME_MEMBERS if not hasattr(module, member)]
    if missing:
        raise UserError(f"runtime {name!r}: {path} does not define {', '.join(missing)}")
    return cast(FamilyRuntime, module)


def all_runtimes() -> list[FamilyRuntime]:
    """Every runtime some family names, in the order their ``claims_source`` is asked."""
    names = sorted({family.runtime for family in map(get_family, family_names()) if family.runtime})
    runtimes = [(_import_runtime(name), name) for name in names]
    return [runtime for runtime, _ in sorted(runtimes, key=lambda pair: (pair[0].LOAD_PRIORITY, pair[1]))]


def load_base_model(spec: str | os.PathLike[str], *, family: FamilySpec | None = None, allow_pickle: bool = False,
                    device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    vae_dtype: torch.dtype | None = None, **parts: str | None) -> ModelBundle:
    """Load (or build) a base model: every way a user holds one (``models.loading`` lists them), loaded by the
    first runtime that claims it. ``family`` is the user's statement of what the model is (a model that
    contradicts it is a UserError naming both); ``parts`` are kohya's separate-file options (``PART_OPTIONS``:
    FLUX.1's ``clip_l`` / ``t5xxl`` / ``ae`` / ``t5xxl_tokenizer``, SD3's ``clip_l`` / ``clip_g`` / ``t5xxl`` /
    ``vae``; ``vae`` replaces an SD model's VAE too). ``dtype`` is the dtype the weights train in (the VAE's
    ``vae_dtype``, default ``dtype``; both default fp32): each tensor is cast as it is read."""
    from sd_scripts_compat.models.loading import before_loading

    unknown = sorted(set(parts) - set(PART_OPTIONS))
    if unknown:
        raise TypeError(f"load_base_model: unknown part options {unknown}")
    before_loading()
    text = os.fspath(spec)
    for runtime in all_runtimes():
        if runtime.claims_source(text, family, parts):
            return runtime.load(text, stated=family, parts=parts, allow_pickle=allow_pickle, device=device,
                                dtype=dtype, vae_dtype=vae_dtype)
    raise UserError(f"{text}: no runtime loads this model")  # the UNet runtime claims every other source


def encode_prompts(bundle: ModelBundle, captions: list[str], options: TextOptions | None = None) -> TextConditioning:
    """Encode ``captions`` the way the bundle's family does."""
    return runtime_for(bundle.family).encode_prompts(bundle, captions, options or TextOptions())
