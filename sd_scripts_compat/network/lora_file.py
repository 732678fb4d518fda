"""kohya LoRA files: safetensors with sd-scripts' metadata, atomic writes, reading and describing.

Facts of the format (sd-scripts): every metadata value is a string; ``ss_*`` keys describe the
training run, ``modelspec.*`` the model (SAI model spec), and ``sshs_model_hash`` /
``sshs_legacy_hash`` are hashes of the safetensors buffer that holds the tensors and only the
``ss_*`` metadata: the model hash is the sha256 of everything after the 8-byte header length and the
header JSON (the tensor data), the legacy hash the first 8 hex digits of the sha256 of the 64 KiB at
offset 1 MiB of that buffer.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.atomic import write_bytes_atomic
from sd_scripts_compat.facts.contract import disk_full_guard
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.hashes import legacy_hash
from sd_scripts_compat.network.lora_header import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.facts.families import FamilySpec

SAI_MODEL_SPEC_VERSION = "1.0.1"
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"
NETWORK_MODULE = "networks.lora"
_TE_PREFIXES = ("lora_te1", "lora_te2", "lora_te3", "lora_te")
_DTYPE_NAMES = {"float": "float32", "fp32": "float32", "float32": "float32", "fp16": "float16",
                "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


# ---------------------------------------------------------------------------------------------- hashes
def model_hash(buffer: bytes) -> str:
    """sha256 of the tensor-data part of a safetensors buffer (after the length and the header JSON)."""
    header_len = int.from_bytes(buffer[:8], "little")
    return hashlib.sha256(memoryview(buffer)[8 + header_len:]).hexdigest()


def training_hashes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, str]:
    """``sshs_model_hash`` and ``sshs_legacy_hash`` as sd-scripts' (and musubi-tuner's)
    ``precalculate_safetensors_hashes`` computes them: of a buffer holding ``tensors`` and only the ``ss_*`` keys of
    ``metadata`` (contiguous CPU tensors)."""
    from safetensors.torch import save

    hashed = save(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")} or None)
    return {"sshs_model_hash": model_hash(hashed), "sshs_legacy_hash": legacy_hash(hashed)}


# ----------------------------------------------------------------------------------------------- write
def resolve_save_dtype(save_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None`` (keep), "float"/"fp16"/"bf16" (sd-scripts' save_precision names) or a torch dtype."""
    import torch

    if save_dtype is None or isinstance(save_dtype, torch.dtype):
        return save_dtype
    name = _DTYPE_NAMES.get(str(save_dtype).lower())
    if name is None:
        raise UserError(f"save_precision {save_dtype!r} is not one of float, fp16, bf16")
    return getattr(torch, name)


def save_lora_file(path: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], metadata: dict[str, str],
                   save_dtype: str | torch.dtype | None = None) -> dict[str, str]:
    """Write a kohya LoRA safetensors file atomically (temp file in the same folder, then ``os.replace``).

    Floating tensors (``alpha`` included, as sd-scripts does) are cast to ``save_dtype``; the hashes are
    computed from the cast tensors and added to the metadata. Returns the metadata written.
    """
    from safetensors.torch import save

    dtype = resolve_save_dtype(save_dtype)
    tensors = {}
    for key, value in state_dict.items():
        value = value.detach().to("cpu")
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[key] = value.contiguous()
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    meta.update(training_hashes(tensors, meta))
    write_atomic(Path(path), save(tensors, meta))
    return meta


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder; no partial file on failure."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise UserError(f"{path}: folder {folder} does not exist; create it or choose another output_dir")
    try:
        with disk_full_guard(folder, len(data), f"the LoRA {path.name}"):  # a full disk: its own one line, exit 28
            write_bytes_atomic(path, data)
    except OSError as error:
        raise UserError(f"{path}: cannot write ({error.strerror or error}); check the folder's permissions "
                        "and free space") from None


# ------------------------------------------------------------------------------------------------ read
def read_lora_file(path: str | os.PathLike[str], *,
                   lycoris: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a kohya LoRA safetensors file: ``(state_dict, metadata)``; not a LoRA / corrupt -> UserError.
    ``lycoris``: a LyCORIS file (LoHa, LoKr, ... under kohya's module names) is accepted too."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix.lower() != ".safetensors":
        raise UserError(f"{path}: only .safetensors LoRA files are read (pickled .pt/.ckpt LoRAs are not loaded)")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            state_dict = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
    except Exception as error:  # safetensors raises its own SafetensorError / OSError variants
        raise UserError(f"{path}: not a readable safetensors file (corrupt or truncated?): {error}") from None
    problem = None if lycoris and is_lycoris(state_dict) else lora_problem(state_dict)
    if problem:
        raise UserError(f"{path} is not a kohya LoRA file: {problem}")
    return state_dict, metadata


LYCORIS_SUFFIXES = (".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".oft_blocks", ".oft_diag", ".diff")


def is_lycoris(state_dict: dict[str, Any]) -> bool:
    """A LyCORIS network's tensors under kohya module names (``lora_unet_...hada_w1_a``)."""
    return any(k.startswith("lora_") and k.endswith(LYCORIS_SUFFIXES) for k in state_dict)


def lora_problem(state_dict: dict[str, Any]) -> str | None:
    """Why ``state_dict`` is not a kohya LoRA (None when it is one)."""
    keys = list(state_dict)
    if not keys:
        return "it holds no tensors"
    if any(k.endswith(".lora_down.weight") and k.startswith("lora_") for k in keys):
        incomplete = sorted(k for k in keys if k.endswith(".lora_down.weight")
                            and k.replace(".lora_down.weight", ".lora_up.weight") not in state_dict)
        if incomplete:
            return f"{incomplete[0]} has no matching lora_up.weight"
        return None
    if any(k.startswith(("model.diffusion_model.", "first_stage_model.", "conditioner.", "cond_stage_model."))
           for k in keys):
        return "it looks like a Stable Diffusion model checkpoint (base model), not a LoRA"
    if any(".lora_A." in k or ".lora_B." in k or ".lora.down." in k or ".lora_linear_layer." in k for k in keys):
        return "it is a diffusers/peft-format LoRA (lora_A/lora_B keys); only kohya-format LoRAs are read"
    if is_lycoris(state_dict):
        return "it is a LyCORIS (LoHa/LoKr/OFT) network, not a plain LoRA"
    return f"no '<module>.lora_down.weight' keys (first key: {keys[0]})"


# -------------------------------------------------------------------------------------------- describe
def _part(lora_name: str) -> str:
    if lora_name.startswith("lora_unet_"):
        return "unet"
    for prefix in _TE_PREFIXES:
        if lora_name.startswith(prefix + "_"):
            return prefix
    return "other"


def lora_layout(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The structural facts of a kohya state dict that identify the model family it was made for.

    ``te_prefixes`` (prefix -> module count), ``unet_names`` ("diffusers", "sgm" or None),
    ``cross_attention_dim`` (UNet attn2 context width), ``te_widths`` (prefix -> hidden size), ``label``.
    """
    te_prefixes: Counter[str] = Counter()
    unet_names = None
    cross = None
    width = None  # a FLUX transformer's hidden width
    te_widths: dict[str, int] = {}
    tables = _table_block_prefixes()
    blocks: set[str] = set()  # the block-table prefixes the keys use
    for key, value in state_dict.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        part = _part(name)
        if part == "unet":
            body = name[len("lora_unet_"):]
            if body.startswith(("input_blocks_", "middle_block_", "output_blocks_")):
                unet_names = "sgm"
            elif body.startswith(("down_blocks_", "mid_block_", "up_blocks_")):
                unet_names = unet_names or "diffusers"
            elif body.startswith(("double_blocks_", "single_blocks_")):
                unet_names = "bfl"  # FLUX (Black Forest Labs' names, as kohya trains it)
            elif body.startswith(tables):
                unet_names = unet_names or "table"  # the family data's block table (SD3's joint_blocks, ...)
                blocks.add(next(prefix for prefix in tables if body.startswith(prefix)))
            if name.endswith("_attn2_to_k") and cross is None:
                cross = int(value.shape[1])
            if name.endswith(("_img_attn_proj", "_x_block_attn_proj")) and width is None:
                width = int(value.shape[1])  # the transformer's hidden width (FLUX.1's image stream, SD3's x)
        elif part != "other":
            te_prefixes[part] += 1
            if name.endswith(("_self_attn_q_proj", "_SelfAttention_q")) and part not in te_widths:
                te_widths[part] = int(value.shape[1])
    layout: dict[str, Any] = {"te_prefixes": dict(te_prefixes), "unet_names": unet_names, "cross_attention_dim": cross,
              "te_widths": te_widths, "denoiser_width": width, "block_prefixes": sorted(blocks)}
    matches = match_families(layout)
    if matches:
        label = " / ".join(matches)
    elif unet_names == "bfl":
        label = "a FLUX.1-layout model"
    elif unet_names == "sgm" or "lora_te1" in te_prefixes or "lora_te2" in te_prefixes:
        label = "an SDXL-layout model"
    else:
        label = "an SD 1.x/2.x-layout model"
    if cross is not None and not matches:
        label += f" with cross-attention width {cross}"
    layout["label"] = label
    layout["families"] = matches
    return layout


def _block_prefixes(family: FamilySpec) -> list[str]:
    """The kohya key prefixes of a family's block table (``joint_blocks_`` for SD3, ``blocks_`` for Wan, ...)."""
    return [entry["kohya"].split("{i}")[0].replace(".", "_") for entry in family.lora_layout if "{i}" in entry["kohya"]]


def _table_block_prefixes() -> tuple[str, ...]:
    """Every family's block-table prefixes, the FLUX names excepted (read as FLUX.1's above)."""
    from sd_scripts_compat.facts.families import family_names, get_family

    prefixes = {prefix for name in family_names() for prefix in _block_prefixes(get_family(name))}
    return tuple(sorted(prefixes - {"double_blocks_", "single_blocks_"}))


def match_families(layout: dict[str, Any]) -> list[str]:
    """Names of the known families whose key scheme and widths fit ``layout`` (shapes only)."""
    from sd_scripts_compat.facts.families import family_names, get_family

    found = []
    for name in family_names():
        family = get_family(name)
        prefixes = {te.lora_prefix: te.width for te in family.text_encoders}
        if not layout["te_prefixes"] and not layout["unet_names"]:
            continue
        if set(layout["te_prefixes"]) - set(prefixes):
            continue
        if layout["unet_names"] and layout["unet_names"] != family.unet_lora_names:
            continue
        if set(layout.get("block_prefixes") or ()) - set(_block_prefixes(family)):
            continue
        if layout["cross_attention_dim"] is not None and layout["cross_attention_dim"] != family.unet.get(
                "cross_attention_dim"):
            continue
        if any(prefixes.get(p) != w for p, w in layout["te_widths"].items()):
            continue
        heads, head_dim = family.unet.get("num_attention_heads", 0), family.unet.get("attention_head_dim", 0)
        if layout.get("denoiser_width") is not None and family.is_transformer and (
                layout["denoiser_width"] != heads * head_dim):
            continue
        found.append(name)
    return found


def _family_from_metadata(candidates: list[str], metadata: dict[str, str]) -> list[str]:
    """Narrow shape-based candidates (e.g. sd2 vs sd2-v) with the file's own metadata when it has any."""
    from sd_scripts_compat.facts.families import get_family

    version = metadata.get("ss_base_model_version")
    arch = metadata.get("modelspec.architecture", "").removesuffix("/lora")
    prediction = metadata.get("modelspec.prediction_type")
    narrowed = candidates
    if version:
        narrowed = [c for c in narrowed if get_family(c).ss_base_model_version == version] or narrowed
    if arch:
        narrowed = [c for c in narrowed if get_family(c).modelspec_architecture == arch] or narrowed
    if prediction:
        want = "v_prediction" if prediction == "v" else prediction
        narrowed = [c for c in narrowed if get_family(c).prediction_type == want] or narrowed
    non_tiny = [c for c in narrowed if not get_family(c).tiny]
    return non_tiny or narrowed


# Metadata shown first (label, key), in this order; the rest follows alphabetically.
TRAINING_FIELDS = [
    ("output name", "ss_output_name"), ("base model", "ss_sd_model_name"),
    ("base model version", "ss_base_model_version"),
    ("network module", "ss_network_module"), ("network dim", "ss_network_dim"), ("network alpha", "ss_network_alpha"),
    ("network args", "ss_network_args"), ("network dropout", "ss_network_dropout"), ("resolution", "ss_resolution"),
    ("learning rate", "ss_learning_rate"), ("unet lr", "ss_unet_lr"), ("text encoder lr", "ss_text_encoder_lr"),
    ("optimizer", "ss_optimizer"), ("lr scheduler", "ss_lr_scheduler"), ("mixed precision", "ss_mixed_precision"),
    ("train images", "ss_num_train_images"), ("reg images", "ss_num_reg_images"), ("epochs", "ss_num_epochs"),
    ("epoch", "ss_epoch"), ("steps", "ss_steps"), ("max train steps", "ss_max_train_steps"),
    ("batch size", "ss_total_batch_size"), ("seed", "ss_seed"), ("clip skip", "ss_clip_skip"),
    ("started", "ss_training_started_at"), ("finished", "ss_training_finished_at"),
    ("model hash", "sshs_model_hash"), ("legacy hash", "sshs_legacy_hash"),
]


def describe_lora(state_dict: dict[str, Any], metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything ``autotune inspect`` shows about a kohya LoRA, as plain JSON-able data.

    The family comes from the key scheme and widths (and the metadata to tell sd2 from sd2-v, or a
    full-size family from its tiny twin); module counts per part, ranks, alphas, precision.
    """
    metadata = dict(metadata or {})
    state_dict = {key: TensorInfo.of(value) for key, value in state_dict.items()}  # torch tensors or header facts
    problem = lora_problem(state_dict)
    if problem:
        raise UserError(f"not a kohya LoRA: {problem}")
    layout = lora_layout(state_dict)
    families = _family_from_metadata(layout["families"], metadata)
    modules: dict[str, dict[str, Any]] = {}
    for key, value in state_dict.items():
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        alpha = state_dict.get(f"{name}.alpha")
        rank = int(value.shape[0])
        modules[name] = {
            "part": _part(name),
            "rank": rank,
            "alpha": alpha.value if alpha is not None and alpha.value is not None else float(rank),
            "conv3x3": len(value.shape) == 4 and tuple(value.shape[2:]) != (1, 1),
        }
    parts = Counter(m["part"] for m in modules.values())
    ranks = Counter(m["rank"] for m in modules.values())
    alphas = Counter(m["alpha"] for m in modules.values())
    conv_ranks = Counter(m["rank"] for m in modules.values() if m["conv3x3"])
    weight_dtypes = Counter(v.dtype for k, v in state_dict.items() if k.endswith(".weight"))
    parameters = sum(v.numel for k, v in state_dict.items() if k.endswith(".weight"))
    training = {label: _readable(key, metadata[key]) for label, key in TRAINING_FIELDS if key in metadata}
    return {
        "family": families[0] if len(families) == 1 else None,
        "family_candidates": families,
        "family_label": layout["label"],
        "unet_names": layout["unet_names"],
        "cross_attention_dim": layout["cross_attention_dim"],
        "modules": {
            "total": len(modules),
            "unet": parts.get("unet", 0),
            "unet_conv3x3": sum(1 for m in modules.values() if m["conv3x3"]),
            "text_encoders": {p: parts[p] for p in sorted(parts) if p not in ("unet", "other")},
            "other": parts.get("other", 0),
        },
        "conv": any(m["conv3x3"] for m in modules.values()),
        "ranks": {str(k): v for k, v in sorted(ranks.items())},
        "conv_ranks": {str(k): v for k, v in sorted(conv_ranks.items())},
        "alphas": {f"{k:g}": v for k, v in sorted(alphas.items())},
        "precision": dict(weight_dtypes),
        "parameters": parameters,
        "network_module": metadata.get("ss_network_module"),
        "has_metadata": bool(metadata),
        "training": training,
    }


def _readable(key: str, value: str) -> str:
    """sd-scripts' start / end times are epoch seconds: shown as ISO 8601 (UTC)."""
    if key in ("ss_training_started_at", "ss_training_finished_at"):
        try:
            moment = datetime.datetime.fromtimestamp(float(value), tz=datetime.timezone.utc)
        except (ValueError, OverflowError, OSError):
            return value
        return moment.isoformat(timespec="seconds").replace("+00:00", "Z")
    return value


def describe_lora_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``describe_lora`` of a file, plus its path, size and full metadata: from its header alone (no torch)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix.lower() != ".safetensors":
        raise UserError(f"{path}: only .safetensors LoRA files are read (pickled .pt/.ckpt LoRAs are not loaded)")
    state_dict, metadata = read_header(path)
    problem = lora_problem(state_dict)
    if problem:
        raise UserError(f"{path} is not a kohya LoRA file: {problem}")
    info = describe_lora(state_dict, metadata)
    info["file"] = str(path)
    info["file_size"] = Path(path).stat().st_size
    info["metadata"] = metadata
    return info


# -------------------------------------------------------------------------------------------- metadata
@dataclass
class TrainingFacts:
    """The facts of one training run that sd-scripts writes into a LoRA's metadata.

    The training loop fills this explicitly; anything sd-scripts records that has no field here goes
    into ``extra`` (keys with or without the ``ss_`` prefix).
    """

    output_name: str
    network_dim: int
    network_alpha: float | int | None
    learning_rate: float
    optimizer: str  # e.g. "torch.optim.adamw.AdamW(weight_decay=0.01)", "torch.optim.adamw.AdamW"
    resolution: tuple[int, int]
    training_started_at: float  # time.time()
    session_id: int
    network_args: dict[str, str] | None = None  # the raw key=value pairs, as given
    network_module: str | None = None  # None: the family's own (networks.lora, networks.lora_flux)
    network_dropout: float | None = None
    unet_lr: float | None = None
    text_encoder_lr: float | None = None
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    mixed_precision: str = "no"
    num_train_images: int = 0
    num_reg_images: int = 0
    num_batches_per_epoch: int = 0
    num_epochs: int = 1
    epoch: int | None = None
    steps: int | None = None
    max_train_steps: int = 0
    batch_size_per_device: int = 1
    total_batch_size: int = 1
    gradient_checkpointing: bool = False
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0
    seed: int | None = None
    clip_skip: int | None = None
    max_token_length: int | None = None
    cache_latents: bool = False
    noise_offset: float | None = None
    min_snr_gamma: float | None = None
    training_finished_at: float | None = None
    sd_model_name: str = ""
    vae_name: str | None = None
    tag_frequency: dict[str, dict[str, int]] = field(default_factory=dict)  # dataset dir -> tag -> count
    dataset_dirs: dict[str, dict[str, int]] = field(default_factory=dict)  # dir -> {n_repeats, img_count}
    training_comment: str | None = None
    title: str | None = None  # modelspec.title; defaults to output_name
    author: str | None = None
    description: str | None = None
    license: str | None = None
    tags: str | None = None
    # sd-scripts' keys from its options, its dataset and its model files (``network.kohya_keys``); ``ss_datasets``
    # among them (a dataset config) replaces the batch, resolution and folder keys of a ``train_data_dir`` run
    kohya_keys: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def build_metadata(family: FamilySpec, facts: TrainingFacts) -> dict[str, str]:
    """sd-scripts' ``ss_*`` and ``modelspec.*`` metadata for ``facts`` (every value ``str(v)``).

    ``sshs_*`` hashes are added by ``save_lora_file`` because they depend on the saved tensors.
    """
    ss: dict[str, Any] = {
        "ss_session_id": facts.session_id,
        "ss_training_started_at": facts.training_started_at,
        "ss_output_name": facts.output_name,
        "ss_learning_rate": facts.learning_rate,
        "ss_text_encoder_lr": facts.text_encoder_lr,
        "ss_unet_lr": facts.unet_lr,
        "ss_num_train_images": facts.num_train_images,
        "ss_num_reg_images": facts.num_reg_images,
        "ss_num_batches_per_epoch": facts.num_batches_per_epoch,
        "ss_num_epochs": facts.num_epochs,
        "ss_gradient_checkpointing": facts.gradient_checkpointing,
        "ss_gradient_accumulation_steps": facts.gradient_accumulation_steps,
        "ss_max_train_steps": facts.max_train_steps,
        "ss_lr_warmup_steps": facts.lr_warmup_steps,
        "ss_lr_scheduler": facts.lr_scheduler,
        "ss_network_module": facts.network_module or family.network_module or NETWORK_MODULE,
        "ss_network_dim": facts.network_dim,
        "ss_network_alpha": facts.network_alpha,
        "ss_network_dropout": facts.network_dropout,
        "ss_mixed_precision": facts.mixed_precision,
        "ss_v2": family.ss_base_model_version.startswith("sd_v2"),
        "ss_base_model_version": family.ss_base_model_version,
        "ss_clip_skip": facts.clip_skip,
        "ss_max_token_length": facts.max_token_length,
        "ss_cache_latents": facts.cache_latents,
        "ss_seed": facts.seed,
        "ss_noise_offset": facts.noise_offset,
        "ss_min_snr_gamma": facts.min_snr_gamma,
        "ss_optimizer": facts.optimizer,
        "ss_max_grad_norm": facts.max_grad_norm,
        "ss_training_comment": facts.training_comment,
        "ss_batch_size_per_device": facts.batch_size_per_device,
        "ss_total_batch_size": facts.total_batch_size,
        "ss_resolution": tuple(facts.resolution),
        "ss_dataset_dirs": json.dumps(facts.dataset_dirs),
        "ss_tag_frequency": json.dumps(facts.tag_frequency),
        "ss_sd_model_name": facts.sd_model_name,
    }
    if facts.vae_name is not None:
        ss["ss_vae_name"] = facts.vae_name
    if "ss_datasets" in facts.kohya_keys:  # sd-scripts writes these only for a train_data_dir run
        for key in ("ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution"):
            del ss[key]
    ss.update(facts.kohya_keys)
    if facts.network_args:
        ss["ss_network_args"] = json.dumps(facts.network_args)
    if facts.training_finished_at is not None:
        ss["ss_training_finished_at"] = facts.training_finished_at
    if facts.steps is not None:
        ss["ss_steps"] = facts.steps
    if facts.epoch is not None:
        ss["ss_epoch"] = facts.epoch
    for key, value in facts.extra.items():
        ss[key if key.startswith("ss_") else f"ss_{key}"] = value
    width, height = facts.resolution
    stamp = facts.training_finished_at if facts.training_finished_at is not None else facts.training_started_at
    spec: dict[str, Any] = {
        "modelspec.sai_model_spec": SAI_MODEL_SPEC_VERSION,
        "modelspec.architecture": f"{family.modelspec_architecture}/lora",
        "modelspec.implementation": family.modelspec_implementation or (
            IMPL_STABILITY_AI if family.is_sdxl else IMPL_DIFFUSERS),
        "modelspec.title": facts.title or facts.output_name,
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.date": datetime.datetime.fromtimestamp(stamp).isoformat(),
    }
    if not family.flux_model_type:  # sd-scripts writes none for FLUX.1 / Chroma, "epsilon" for SD3 too
        spec["modelspec.prediction_type"] = "v" if family.v_parameterization else "epsilon"
    for key in ("author", "description", "license", "tags"):
        value = getattr(facts, key)
        if value is not None:
            spec[f"modelspec.{key}"] = value
    if facts.clip_skip is not None:
        spec["modelspec.encoder_layer"] = facts.clip_skip
    return {key: str(value) for key, value in {**ss, **spec}.items()}
