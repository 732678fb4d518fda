"""Loading the base models of the UNet families, and what every load shares. ``runtimes.load_base_model`` is the
one entry point for every way a user holds a base model, all offline; each family's runtime loads its own.

Accepted specs:
  builtin:<id>                random-weight families (tiny ones for demos/tests, full-size ones for
                              shape-only probes with ``device="meta"``)
  a diffusers folder          with ``model_index.json`` (its own tokenizer folders are used)
  FILE.safetensors            original single-file layout (the way most users hold SD1.5/SDXL)
  FILE.ckpt / FILE.pt         the same, only with ``allow_pickle=True`` (``--allow_pickle``)
Every result is a ``ModelBundle``; every bad input is a one-line ``UserError`` naming the file.

Test hook: ``SD_COMPAT_TEST_LOAD_DELAY=SECONDS`` makes loading wait that long first (a model on a slow disk),
so the watchdog's stall limits are testable with a tiny model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import FamilySpec, family_names
from sd_scripts_compat.models.detect import BUILTIN_PREFIX, ENGINE_STATED_BY, detect_family

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.models.build import ModelBundle

LOAD_DELAY_ENV = "SD_COMPAT_TEST_LOAD_DELAY"
BUILTIN_IDS = tuple(family_names())  # every family can be built (random weights)
DIFFUSERS_TEXT_PARTS = ("text_encoder", "text_encoder_2")
DIFFUSERS_TOKENIZER_PARTS = ("tokenizer", "tokenizer_2")


def before_loading() -> None:
    """What every load does first: the test hook's delay."""
    if os.environ.get(LOAD_DELAY_ENV):
        import time

        time.sleep(float(os.environ[LOAD_DELAY_ENV]))


def load_sd_model(text: str, *, family: FamilySpec | None, allow_pickle: bool, device: str | torch.device,
                  dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
    """A built-in, a diffusers folder or an original-layout single file (SD 1/2/XL; every built-in)."""
    if text.startswith(BUILTIN_PREFIX):
        return _load_builtin(text, family=family, device=device, dtype=dtype, vae_dtype=vae_dtype)
    path = Path(text).expanduser()
    if path.is_dir():
        return load_diffusers_folder(path, family=family, device=device, dtype=dtype, vae_dtype=vae_dtype)
    from sd_scripts_compat.models.single_file import load_single_file

    return load_single_file(path, family=family, allow_pickle=allow_pickle, device=device, dtype=dtype,
                            vae_dtype=vae_dtype)


def replace_vae(bundle: ModelBundle, vae: str | None, *, device: str | torch.device,
                dtype: torch.dtype | None) -> ModelBundle:
    """kohya's ``vae``: a VAE file replaces the bundle's (not on the meta device); a flow-matching family
    takes its autoencoder as ``ae`` instead (one line)."""
    if vae and str(device) != "meta":
        from sd_scripts_compat.models.single_file import load_vae_file

        if bundle.family.flow_matching:
            raise UserError(f"vae = {vae}: {bundle.family.description} takes its autoencoder as ae; rename the key")
        bundle.vae = load_vae_file(vae, bundle.family, dtype).to(device)
    return bundle


def _load_builtin(model: str, *, family: FamilySpec | None, device: str | torch.device,
                  dtype: torch.dtype | None, vae_dtype: torch.dtype | None) -> ModelBundle:
    from sd_scripts_compat.models.build import build_modules

    return build_modules(detect_family(model, family, stated_by=ENGINE_STATED_BY), device=device, dtype=dtype,
                         seed=0, builtin=True, vae_dtype=vae_dtype)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} not found; expected a diffusers model folder part") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); expected a diffusers config") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object; expected a diffusers config")
    return data


def _shape_signature(modules: list[Any]) -> list[dict[str, tuple[int, ...]]]:
    return [{k: tuple(v.shape) for k, v in m.state_dict().items()} for m in modules]


def check_folder_shapes(spec: FamilySpec, unet: torch.nn.Module, vae: torch.nn.Module, text_encoders: list[Any],
                        folder: Path) -> None:
    """The strict check after loading: the modules have exactly the state-dict shapes of ``spec``, the
    family ``models.detect`` read from the folder's configs (a one-line UserError naming the first
    difference otherwise)."""
    import torch

    from sd_scripts_compat.models.single_file import _empty_bundle

    with torch.device("meta"):
        ref = _empty_bundle(spec)
    want = _shape_signature([ref.unet, ref.vae, *ref.text_encoders])
    got = _shape_signature([unet, vae, *text_encoders])
    if want == got:
        return
    raise UserError(f"{folder}: the model's shapes do not match family {spec.name}, which its configs name "
                    f"({_first_difference(want, got, spec)}); expected an SD1.x, SD2.x or SDXL base model")


def _first_difference(want: list[dict[str, tuple[int, ...]]], got: list[dict[str, tuple[int, ...]]],
                      spec: FamilySpec) -> str:
    if len(want) != len(got):
        return f"{len(got) - 2} text encoder(s), {spec.name} has {len(want) - 2}"
    parts = ("unet", "vae", *DIFFUSERS_TEXT_PARTS)
    for part, expected, shapes in zip(parts, want, got):
        for key in sorted(expected.keys() | shapes.keys()):
            if expected.get(key) != shapes.get(key):
                return f"{part} {key} is {shapes.get(key)}, expected {expected.get(key)}"
    return "same shapes"


def load_diffusers_folder(folder: str | os.PathLike[str], *, family: FamilySpec | None = None,
                          device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                          vae_dtype: torch.dtype | None = None) -> ModelBundle:
    """A diffusers pipeline folder (``model_index.json``), read with local files only.

    Its own ``tokenizer``/``tokenizer_2`` folders win over the shipped vocabulary; the scheduler
    config (and with it the prediction type) comes from ``scheduler/`` when present.
    """
    import torch
    import transformers
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from sd_scripts_compat.models.build import ModelBundle, load_tokenizer

    folder = Path(folder)
    index = _read_json(folder / "model_index.json") if (folder / "model_index.json").is_file() else None
    if index is None:
        raise UserError(f"{folder} is a folder without model_index.json; expected a diffusers model folder "
                        "(unet/, vae/, text_encoder/ ...) or a .safetensors file")
    for part in ("unet", "vae", "text_encoder"):
        if not (folder / part / "config.json").is_file():
            raise UserError(f"{folder / part / 'config.json'} not found; expected a complete diffusers model folder")
    spec = detect_family(folder, family, stated_by=ENGINE_STATED_BY)  # from its configs, before any weights
    target = dtype or torch.float32
    try:
        unet = UNet2DConditionModel.from_pretrained(folder / "unet", local_files_only=True, torch_dtype=target)
        vae = AutoencoderKL.from_pretrained(folder / "vae", local_files_only=True, torch_dtype=vae_dtype or target)
        text_encoders = []
        for part in DIFFUSERS_TEXT_PARTS:
            if not (folder / part).is_dir():
                continue
            class_name = (index.get(part) or [None, None])[1] or _read_json(folder / part / "config.json").get(
                "architectures", ["CLIPTextModel"])[0]
            cls = getattr(transformers, class_name, None)
            if cls is None or not class_name.startswith("CLIPTextModel"):
                raise UserError(f"{folder / part}: text encoder class {class_name!r} is not supported; expected "
                                "CLIPTextModel or CLIPTextModelWithProjection")
            text_encoders.append(cls.from_pretrained(folder / part, local_files_only=True, dtype=target))
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{folder}: could not load the diffusers model ({reason[:200]}); expected a complete, "
                        "uncorrupted diffusers folder") from None

    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    scheduler_config = _read_json(scheduler_file) if scheduler_file.is_file() else None
    prediction = scheduler_config.get("prediction_type") if scheduler_config else None
    check_folder_shapes(spec, unet, vae, text_encoders, folder)

    tokenizers, tokenizer_sources = [], []
    for te_spec, part in zip(spec.text_encoders, DIFFUSERS_TOKENIZER_PARTS, strict=False):
        own = folder / part
        max_length = te_spec.tokenizer["model_max_length"]
        # hub folders hold vocab.json + merges.txt; transformers 5's save_pretrained writes tokenizer.json
        if ((own / "vocab.json").is_file() and (own / "merges.txt").is_file()) or (own / "tokenizer.json").is_file():
            tokenizers.append(load_tokenizer(str(own), pad_token=None, max_length=max_length))
            tokenizer_sources.append(str(own))
        else:
            tokenizers.append(load_tokenizer(pad_token=te_spec.tokenizer["pad_token"], max_length=max_length))
            tokenizer_sources.append("shipped")
    for module in (unet, vae, *text_encoders):
        module.requires_grad_(False)
        module.eval()
        module.to(device)
    return ModelBundle(family=spec, unet=unet, vae=vae, text_encoders=text_encoders, tokenizers=tokenizers,
                       scheduler_config=dict(scheduler_config or spec.scheduler),
                       prediction_type=prediction or spec.prediction_type, source=str(folder),
                       extra={"format": "diffusers", "tokenizer_sources": tokenizer_sources})
