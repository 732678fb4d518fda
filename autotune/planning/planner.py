"""The planner: from a dataset, a model family and a GPU to the fastest LoRA settings that fit, with reasons.

``plan_training(PlanRequest) -> Plan`` never touches torch: it asks the analytic memory model
(``autotune.estimate.memory_model``) and speed model (``autotune.estimate.speed_model``) about a few hundred candidate
settings and keeps the best, so ``autotune plan`` answers in well under a second.

Decision rules (each chosen value carries its rule as a reason string):

- **Precision.** ``mixed_precision = "bf16"`` where the card has compute capability >= 8.0 (AMD: where the
  catalogue says bf16), else ``"fp16"``; on a machine without a GPU ``"no"`` (fp32). Frozen base weights are
  held in that dtype (kohya casts them), the LoRA stays fp32.
- **Caching.** Latents are always cached (to disk, so reruns and OOM retries reuse them): the VAE leaves the
  GPU and each step skips the encoder. Text-encoder outputs are cached only for SDXL when the text encoders are
  not trained (sd-scripts allows it only then, and only for SDXL).
- **Goal** sets the LoRA rank/alpha (alpha = rank / 2 always, so the LoRA's scale and hence the learning-rate
  rule do not depend on rank), the effective batch, and the amount of training (image-views, below).
- **Priority** sets the optimizer preference (quality: AdamW with fp32 state; speed/balanced: AdamW8bit) and
  scales the image-views (speed 0.75x, balanced 1x, quality 1.25x). A ``Preferences.optimizer`` overrides it.
- **Search.** For each point of the *fallback ladder* (below), every micro-batch in {1, 2, 4, ...} up to the
  effective batch and gradient checkpointing off/on are predicted; candidates whose predicted peak exceeds the
  usable VRAM (total minus what other processes and a display hold; the memory model adds the CUDA context,
  allocator overhead and safety margin to its peak) are dropped, and the highest predicted throughput
  (samples/s across all devices) wins; ties go to no checkpointing, then the smaller micro-batch.
  Gradient accumulation = effective batch / (micro-batch x devices), rounded up.
- **Fallback ladder** (walked cumulatively, mildest first, only while nothing fits):
  1. optimizer -> AdamW8bit (if another was preferred);
  2. train the UNet only (SDXL: and cache the text-encoder outputs);
  3. rank halved, down to the goal's floor;
  4. resolution lowered in 64 px steps, down to 5/8 of the family's native size (bucket limits follow);
  5. fp8 base weights (``fp8_base``), where the card can (compute capability >= 8.9, as the engine requires);
  6. rank halved below the goal's floor, down to 4.
  When even the last point does not fit, the plan says so and what that smallest configuration needs.
- **Several GPUs** (data parallel): every device gets the same settings, the smallest usable VRAM decides them,
  the slowest card sets the pace; throughput = devices x per-device rate x 0.9 (gradient all-reduce).
- **Workers.** ``max_data_loader_n_workers`` = min(2, physical cores // 2) with cached latents (a batch is
  a few small arrays), else min(8, physical cores - 1).
- **Amount of training.** target image-views = clamp(views_per_image(goal) x images, min, max) x priority scale;
  epochs = max(1, round(target / views per epoch)), where views per epoch = sum(images x repeats) over the
  ``N_name`` folders; optimizer steps = epochs x ceil(views per epoch / effective batch).
  **CPU plans of tiny families** (``tiny`` in the family data, demos and tests) are capped to a short run: as
  many whole epochs as fit in ``TINY_CPU_MAX_STEPS`` optimizer steps (at least one). On the CPU a tiny model's
  step costs per-op overhead, not FLOPs (measured here: ~1 s per optimizer step of 4 micro-steps at 256 px
  against the speed model's 0.08 s), so the full view count would take minutes for a smoke test.
- **Learning rate** (AdamW family): unet_lr = base(goal) x sqrt(effective batch / 4), clamped to
  [2.5e-5, 4e-4]; text_encoder_lr = unet_lr / 2. Prodigy sets its own step size: all rates 1.0.
  Schedule: cosine with 5% linear warm-up (in steps).

Deterministic: the same request gives the same plan (no clocks, no randomness, stable iteration order).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune import __version__
from sd_scripts_compat.errors import UserError
from sd_scripts_compat.models.families import FamilySpec, family_names, get_family

if TYPE_CHECKING:
    from autotune.hardware.gpu_catalog import GpuSpec

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_EXTENSIONS = (".txt", ".caption")
GOALS = ("character", "style", "concept")
PRIORITIES = ("speed", "balanced", "quality")
OPTIMIZERS = ("AdamW8bit", "AdamW", "Prodigy")
GIB = 1024**3
DDP_EFFICIENCY = 0.9  # all-reduce of the LoRA gradients each step; small LoRAs make it cheap but not free
RESOLUTION_STEP = 64  # kohya's bucket_reso_steps default; latents must be multiples of 8 px, buckets of 64
MIN_RESOLUTION_FRACTION = 5 / 8  # 1024 -> 640, 512 -> 320: below that a family's outputs fall apart
# Cards without a name (--vram only) plan with these rates: a mid Ampere card, bf16 capable.
GENERIC_GPU_NAME = "RTX 3090"
# CPU plans of tiny families are short runs (module docstring)
TINY_CPU_MAX_STEPS = 40  # quickstart on a 2-core CPU: ~1 s per step, about a minute with startup


def bucket_rules(family: FamilySpec, resolution: int) -> tuple[int, int]:
    """(bucket_reso_steps, min_bucket_reso) for a family at a training resolution: half the resolution,
    in kohya's 64 px steps, never below 256 px. The same for every family: the tiny twins' VAEs downsample
    8x like the full-size ones, so they exercise the same bucket arithmetic (``family`` stays in the
    signature: a family whose VAE downsampled otherwise would need another step)."""
    return RESOLUTION_STEP, max(256, resolution // 2 // RESOLUTION_STEP * RESOLUTION_STEP)


@dataclass(frozen=True)
class GoalProfile:
    """What a training goal asks for. Numbers are community practice for kohya LoRAs, see module docstring."""

    rank: int
    rank_floor: int
    effective_batch: int
    views_per_image: int
    min_views: int
    max_views: int
    unet_lr: float


GOAL_PROFILES: dict[str, GoalProfile] = {
    # A character needs identity detail: mid rank, many views per image on a small set.
    "character": GoalProfile(rank=32, rank_floor=8, effective_batch=4, views_per_image=100, min_views=1200,
                             max_views=4000, unet_lr=1e-4),
    # A style spreads over many images: higher rank, larger batch for smoother gradients, fewer views each.
    "style": GoalProfile(rank=64, rank_floor=16, effective_batch=8, views_per_image=50, min_views=2400,
                         max_views=10000, unet_lr=1e-4),
    # A single object or pose: low rank is enough.
    "concept": GoalProfile(rank=16, rank_floor=4, effective_batch=4, views_per_image=80, min_views=1600,
                           max_views=6000, unet_lr=1e-4),
}
PRIORITY_VIEW_SCALE = {"speed": 0.75, "balanced": 1.0, "quality": 1.25}
PRIORITY_OPTIMIZER = {"speed": "AdamW8bit", "balanced": "AdamW8bit", "quality": "AdamW"}


# ----------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class SubsetInfo:
    """One image folder of the dataset: kohya's ``N_name`` -> N repeats, class tokens ``name``."""

    image_dir: str
    num_repeats: int
    class_tokens: str | None
    num_images: int
    num_captions: int


@dataclass(frozen=True)
class DatasetSummary:
    root: str
    subsets: tuple[SubsetInfo, ...]
    caption_extension: str
    warnings: tuple[str, ...] = ()

    @property
    def num_images(self) -> int:
        return sum(s.num_images for s in self.subsets)

    @property
    def views_per_epoch(self) -> int:
        """Images seen in one kohya epoch: each folder's images times its repeats."""
        return sum(s.num_images * s.num_repeats for s in self.subsets)


@dataclass(frozen=True)
class GpuTarget:
    """One device to plan for: its memory, what others already hold on it, and its catalogue rates."""

    name: str
    total_bytes: int
    held_bytes: int = 0  # other processes + display, from the live probe; 0 for a named card
    compute_capability: str | None = None
    bf16: bool = False
    fp8: bool = False
    spec: GpuSpec | None = None
    source: str = "catalogue"  # "probe", "catalogue", "--vram"

    @property
    def usable_bytes(self) -> int:
        return max(0, self.total_bytes - self.held_bytes)

    @property
    def cc_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @property
    def bf16_capable(self) -> bool:
        cc = self.cc_tuple
        return cc >= (8, 0) if cc is not None else self.bf16

    @property
    def fp8_base_capable(self) -> bool:
        """fp8_base stores frozen weights in float8; our engine (as fp8 pays off) wants compute capability 8.9+."""
        cc = self.cc_tuple
        return cc is not None and cc >= (8, 9)


@dataclass(frozen=True)
class Preferences:
    """What the user pinned. None = let the planner choose."""

    optimizer: str | None = None  # AdamW8bit | AdamW | Prodigy
    train_text_encoder: bool | None = None
    rank: int | None = None
    resolution: int | None = None
    attention: str = "sdpa"  # sdpa | xformers
    allow_fp8: bool = True
    epochs: int | None = None
    seed: int = 42
    output_name: str | None = None


@dataclass(frozen=True)
class PlanRequest:
    dataset_dir: str | None
    model: str  # "builtin:sdxl" or a path (safetensors file / diffusers folder)
    family: str | None = None  # detected from ``model`` when None
    gpus: tuple[GpuTarget, ...] = ()  # empty: plan for this machine's CPU
    goal: str = "character"
    priority: str = "balanced"
    preferences: Preferences = field(default_factory=Preferences)
    cpu_physical_cores: int = 4
    cpu_memory_bytes: int | None = None  # for CPU-only plans
    dataset: DatasetSummary | None = None  # given instead of scanning ``dataset_dir`` (templates)
    output_dir: str | None = None  # where config.toml goes; trained LoRAs go to <output_dir>/output
    probe_summary: str = ""  # one line describing the probe, for the config header


# ---------------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Choice:
    """One planned setting. ``kohya`` False: informational (effective batch, devices), not a config key."""

    key: str
    value: Any
    reason: str
    kohya: bool = True


@dataclass(frozen=True)
class Settings:
    """The memory- and speed-relevant knobs of one candidate."""

    resolution: int
    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    optimizer: str
    mixed_precision: str  # "bf16" | "fp16" | "no"
    fp8_base: bool
    rank: int
    train_text_encoder: bool
    cache_text_encoder_outputs: bool
    attention: str

    @property
    def alpha(self) -> int:
        return max(1, self.rank // 2)

    @property
    def weight_dtype(self) -> str:
        if self.fp8_base:
            return "fp8"
        return {"bf16": "bf16", "fp16": "fp16"}.get(self.mixed_precision, "fp32")


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int  # tensors + CUDA context + allocator slack: what max_memory_reserved / nvidia-smi show
    required_bytes: int  # peak + the memory model's safety margin; must not exceed usable_bytes
    usable_bytes: int
    components: tuple[tuple[str, int], ...]
    it_per_s: float  # optimizer steps per second: what kohya's progress bar shows
    micro_steps_per_s: float  # forward+backward passes per second per device (= it/s at accumulation 1)
    samples_per_s: float  # across all devices
    seconds_per_step: float  # one optimizer step (all accumulation micro-steps)
    total_seconds: float
    optimizer_steps: int


@dataclass(frozen=True)
class Plan:
    fits: bool
    message: str
    version: str
    model: str
    family: str
    goal: str
    priority: str
    device: str  # "2 x NVIDIA GeForce RTX 3060 (12.0 GiB)", "CPU"
    num_processes: int
    settings: Settings | None
    choices: tuple[Choice, ...]
    dataset: DatasetSummary | None
    dataset_config: dict[str, Any]
    prediction: Prediction | None
    launch_command: tuple[str, ...]
    fallbacks: tuple[str, ...]  # what the ladder gave up, in order
    warnings: tuple[str, ...]
    probe_summary: str
    output_dir: str | None

    def kohya_values(self) -> dict[str, Any]:
        return {c.key: c.value for c in self.choices if c.kohya}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``autotune plan --json``)."""
        out = asdict(self)
        out["choices"] = [asdict(c) for c in self.choices]
        if self.prediction is not None:
            out["prediction"]["components"] = dict(self.prediction.components)
            out["prediction"]["peak_gib"] = round(self.prediction.peak_bytes / GIB, 3)
            out["prediction"]["usable_gib"] = round(self.prediction.usable_bytes / GIB, 3)
        out["launch_command"] = list(self.launch_command)
        return json.loads(json.dumps(out, default=str))


# ---------------------------------------------------------------------------------------------- dataset


def _leading_int(name: str) -> tuple[int, str] | None:
    head, sep, tail = name.partition("_")
    if sep and head.isdigit() and int(head) > 0:
        return int(head), tail.strip()
    return None


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def scan_dataset(path: str | os.PathLike[str]) -> DatasetSummary:
    """Count images and repeats the way sd-scripts reads ``--train_data_dir``.

    Subfolders ``N_name`` hold images repeated N times with class tokens ``name``; a subfolder without a
    leading integer is skipped with a warning (as kohya does). Images directly in the folder (no ``N_name``
    subfolders) form one subset with 1 repeat, since a dataset.toml can point at any folder.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise UserError(f"dataset folder {path} not found; give a folder of images or of N_name subfolders "
                        "(e.g. 10_mychar/)")
    subsets: list[SubsetInfo] = []
    warnings: list[str] = []
    caption_counts = dict.fromkeys(CAPTION_EXTENSIONS, 0)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    candidates: list[tuple[Path, int, str | None]] = []
    for folder in folders:
        parsed = _leading_int(folder.name)
        if parsed is None:
            if _images_in(folder):
                warnings.append(f"{folder.name}/ skipped: not named N_name (N = repeats), as sd-scripts skips it")
            continue
        candidates.append((folder, parsed[0], parsed[1] or None))
    if not candidates and _images_in(root):
        candidates.append((root, 1, None))
    for folder, repeats, tokens in candidates:
        images = _images_in(folder)
        if not images:
            warnings.append(f"{folder.name}/ holds no images ({', '.join(IMAGE_EXTENSIONS)}); skipped")
            continue
        captions = 0
        for image in images:
            for ext in CAPTION_EXTENSIONS:
                if image.with_suffix(ext).is_file():
                    caption_counts[ext] += 1
                    captions += 1
                    break
        subsets.append(SubsetInfo(image_dir=str(folder), num_repeats=repeats, class_tokens=tokens,
                                  num_images=len(images), num_captions=captions))
    if not subsets:
        raise UserError(f"dataset folder {root} holds no images in N_name subfolders; put images "
                        f"({', '.join(IMAGE_EXTENSIONS)}) in e.g. {root / '10_mychar'}")
    # The caption files that exist decide the extension; ".txt" when there are none (lora-scripts' default).
    caption_extension = max(CAPTION_EXTENSIONS, key=lambda ext: (caption_counts[ext], ext == ".txt"))
    uncaptioned = [s for s in subsets if s.num_captions < s.num_images and not s.class_tokens]
    for s in uncaptioned:
        warnings.append(f"{Path(s.image_dir).name}/: {s.num_images - s.num_captions} image(s) without a "
                        f"{caption_extension} caption and no class tokens in the folder name")
    return DatasetSummary(root=str(root), subsets=tuple(subsets), caption_extension=caption_extension,
                          warnings=tuple(warnings))


def nominal_dataset(num_images: int = 20, repeats: int = 10) -> DatasetSummary:
    """A stand-in dataset for templates: one ``10_subject`` folder of 20 captioned images."""
    return DatasetSummary(root="./train", subsets=(SubsetInfo(image_dir=f"./train/{repeats}_subject",
                                                              num_repeats=repeats, class_tokens="subject",
                                                              num_images=num_images, num_captions=num_images),),
                          caption_extension=".txt")


# ------------------------------------------------------------------------------------------------ model


def detect_family(model: str, stated: str | None = None) -> FamilySpec:
    """The family of ``builtin:ID`` or a model path, cheaply (headers and config files only, no weights).

    A safetensors file: key layout from its header (SD1 / SD2 / SDXL) plus the v-prediction markers;
    a diffusers folder: ``unet/config.json`` cross-attention width plus the scheduler's prediction type.
    SD2 files often carry no v-prediction marker: pass ``--family sd2-v`` for 768-v models.
    """
    if stated is not None:
        if stated not in family_names():
            raise UserError(f"--family {stated}: unknown family; known: {', '.join(family_names())}")
        if not model.startswith("builtin:"):
            return get_family(stated)
    if model.startswith("builtin:"):
        name = model.split(":", 1)[1]
        if name not in family_names():
            raise UserError(f"--model {model}: unknown built-in model; known: "
                            f"{', '.join('builtin:' + n for n in family_names())}")
        if stated is not None and stated != name:
            raise UserError(f"--model {model} is family {name}, but --family {stated} was given; drop --family")
        return get_family(name)
    path = Path(model).expanduser()
    if path.is_dir():
        return _family_of_diffusers_folder(path)
    if path.is_file() and path.suffix.lower() == ".safetensors":
        return _family_of_single_file(path)
    if path.is_file():
        raise UserError(f"--model {model}: cannot tell the family of a {path.suffix or 'suffix-less'} file "
                        f"without loading it; add --family ({', '.join(family_names())})")
    raise UserError(f"--model {model} not found; give a .safetensors file, a diffusers folder or builtin:<id> "
                    f"({', '.join(family_names())})")


def _family_of_single_file(path: Path) -> FamilySpec:
    from sd_scripts_compat.models.single_file import V_PRED_KEY, detect_layout, read_checkpoint

    checkpoint = read_checkpoint(path, header_only=True)
    layout = detect_layout(checkpoint)
    if layout == "sd1":
        return get_family("sd15")
    if layout == "sdxl":
        return get_family("sdxl")
    stated = checkpoint.metadata.get("modelspec.prediction_type", "").lower()
    v_pred = V_PRED_KEY in checkpoint.shapes or stated in ("v", "v_prediction", "v-prediction")
    return get_family("sd2-v" if v_pred else "sd2")


def _family_of_diffusers_folder(path: Path) -> FamilySpec:
    unet_config = path / "unet" / "config.json"
    if not unet_config.is_file():
        raise UserError(f"--model {path}: no unet/config.json; expected a diffusers folder with model_index.json "
                        "or a .safetensors file")
    try:
        cross = json.loads(unet_config.read_text(encoding="utf-8")).get("cross_attention_dim")
        scheduler_file = path / "scheduler" / "scheduler_config.json"
        scheduler = json.loads(scheduler_file.read_text(encoding="utf-8")) if scheduler_file.is_file() else {}
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"--model {path}: unreadable config ({error}); repair the diffusers folder") from None
    by_width = {768: "sd15", 1024: "sd2", 2048: "sdxl"}
    if cross not in by_width:
        raise UserError(f"{unet_config}: cross_attention_dim {cross} matches no SD1/SD2/SDXL family; add --family")
    name = by_width[cross]
    if name == "sd2" and scheduler.get("prediction_type") == "v_prediction":
        name = "sd2-v"
    return get_family(name)


# ----------------------------------------------------------------------------------------------- targets


def gpu_from_spec(spec: GpuSpec, vram_gb: float | None = None, held_bytes: int = 0,
                  source: str = "catalogue", name: str | None = None) -> GpuTarget:
    """A planning target from a catalogue card; ``vram_gb`` overrides its memory (emulating a smaller card)."""
    gb = spec.vram_gb if vram_gb is None else vram_gb
    return GpuTarget(name=name or spec.name, total_bytes=int(round(gb * GIB)), held_bytes=held_bytes,
                     compute_capability=spec.compute_capability, bf16=spec.bf16, fp8=spec.fp8, spec=spec,
                     source=source)


def gpu_from_vram(vram_gb: float, base: GpuSpec | None = None) -> GpuTarget:
    """``--vram GB`` alone: a card of that size with the rates of ``base`` (default: a generic Ampere card)."""
    if vram_gb <= 0:
        raise UserError(f"--vram {vram_gb}: must be a positive number of GB, e.g. --vram 12")
    if base is None:
        from autotune.hardware.gpu_catalog import lookup_gpu

        base = lookup_gpu(GENERIC_GPU_NAME)
    return gpu_from_spec(base, vram_gb=vram_gb, source="--vram", name=f"{_fmt_gb(vram_gb)} GB GPU ({base.name} rates)")


def _fmt_gb(value: float) -> str:
    return f"{value:g}"


# ------------------------------------------------------------------------------------------- predictions


class _Predictor:
    """Adapts the memory and speed models to ``Settings``; caches by settings (the ladder revisits points)."""

    def __init__(self, family: FamilySpec, gpus: tuple[GpuTarget, ...], cpu_cores: int) -> None:
        self.family = family
        self.gpus = gpus
        self.cpu_cores = cpu_cores
        self._cache: dict[Settings, _Estimate] = {}

    def memory_inputs(self, s: Settings) -> Any:
        from autotune.estimate.memory_model import MemoryInputs

        return MemoryInputs(
            family=self.family.name, resolution=s.resolution, batch_size=s.micro_batch, rank=s.rank,
            gradient_checkpointing=s.gradient_checkpointing, optimizer=s.optimizer, weight_dtype=s.weight_dtype,
            train_text_encoder=s.train_text_encoder, cache_latents=True,
            cache_text_encoder_outputs=s.cache_text_encoder_outputs, attention=s.attention,
        )

    def predict(self, s: Settings) -> _Estimate:
        """Memory on one device and micro-steps/s of the slowest device."""
        hit = self._cache.get(s)
        if hit is not None:
            return hit
        from autotune.estimate.memory_model import predict_memory
        from autotune.estimate.speed_model import predict_speed

        inputs = self.memory_inputs(s)
        estimate = predict_memory(inputs)
        components = dict(estimate.components)
        extra = 0
        if len(self.gpus) > 1:
            # DDP keeps a second copy of the trainable gradients as all-reduce buckets.
            extra = components.get("lora_grads", 0)
            components["ddp_buckets"] = extra
        rates = []
        for gpu in self.gpus or (None,):
            speed = predict_speed(inputs, gpu.spec if gpu is not None else None, steps=1, cpu_cores=self.cpu_cores)
            rates.append(float(speed.it_per_s))
        result = _Estimate(required=int(estimate.total_bytes) + extra, peak=int(estimate.peak_bytes) + extra,
                           components=tuple((str(k), int(v)) for k, v in components.items()), it_per_s=min(rates))
        self._cache[s] = result
        return result


@dataclass(frozen=True)
class _Estimate:
    required: int  # peak + the memory model's safety margin: must fit in the usable VRAM
    peak: int  # what max_memory_reserved / nvidia-smi would show
    components: tuple[tuple[str, int], ...]
    it_per_s: float


# ------------------------------------------------------------------------------------------------ search


@dataclass(frozen=True)
class _Scored:
    settings: Settings
    required: int
    peak: int
    components: tuple[tuple[str, int], ...]
    it_per_s: float
    samples_per_s: float


def _micro_batches(effective: int) -> list[int]:
    out, b = [], 1
    while b <= effective:
        out.append(b)
        b *= 2
    return out


def _best_at(point: Settings, effective_batch: int, devices: int, usable: int,
             predictor: _Predictor) -> tuple[_Scored | None, _Scored]:
    """The fastest fitting (micro-batch, checkpointing) at one ladder point, and the smallest candidate there."""
    best: _Scored | None = None
    smallest: _Scored | None = None
    for gc in (False, True):
        for mb in _micro_batches(max(1, effective_batch // devices)):
            accum = max(1, math.ceil(effective_batch / (mb * devices)))
            s = replace(point, micro_batch=mb, grad_accum=accum, gradient_checkpointing=gc)
            e = predictor.predict(s)
            scale = devices * (DDP_EFFICIENCY if devices > 1 else 1.0)
            scored = _Scored(s, e.required, e.peak, e.components, e.it_per_s, e.it_per_s * mb * scale)
            if smallest is None or e.required < smallest.required:
                smallest = scored
            if e.required > usable:
                continue
            # Highest samples/s; ties: no checkpointing first (loop order), then smaller micro-batch.
            if best is None or scored.samples_per_s > best.samples_per_s * (1 + 1e-9):
                best = scored
    assert smallest is not None
    return best, smallest


def _resolutions(native: int, pinned: int | None) -> list[int]:
    top = pinned or native
    floor = max(256, int(native * MIN_RESOLUTION_FRACTION) // RESOLUTION_STEP * RESOLUTION_STEP)
    out = [top]
    r = top - RESOLUTION_STEP
    while r >= floor:
        out.append(r)
        r -= RESOLUTION_STEP
    return out


def _halvings(start: int, stop: int) -> list[int]:
    out, r = [], start
    while r // 2 >= stop:
        r //= 2
        out.append(r)
    return out


def _ladder(start: Settings, family: FamilySpec, goal: GoalProfile, fp8_ok: bool,
            pinned_resolution: int | None) -> list[tuple[str, Settings]]:
    """Ladder points after the start, each with the step that produced it (see module docstring)."""
    points: list[tuple[str, Settings]] = []
    cur = start
    if cur.optimizer != "AdamW8bit":
        cur = replace(cur, optimizer="AdamW8bit")
        points.append(("optimizer AdamW8bit (8-bit state)", cur))
    if cur.train_text_encoder:
        cur = replace(cur, train_text_encoder=False, cache_text_encoder_outputs=family.is_sdxl)
        points.append(("UNet only" + (" with cached text-encoder outputs" if family.is_sdxl else ""), cur))
    for rank in _halvings(cur.rank, goal.rank_floor):
        cur = replace(cur, rank=rank)
        points.append((f"rank {rank}", cur))
    for res in _resolutions(family.resolution, pinned_resolution)[1:]:
        cur = replace(cur, resolution=res)
        points.append((f"resolution {res}", cur))
    if fp8_ok:
        cur = replace(cur, fp8_base=True)
        points.append(("fp8 base weights", cur))
    for rank in _halvings(cur.rank, 4):
        cur = replace(cur, rank=rank)
        points.append((f"rank {rank}", cur))
    return points


# -------------------------------------------------------------------------------------------- planning


def _validate(request: PlanRequest) -> None:
    if request.goal not in GOALS:
        raise UserError(f"--goal {request.goal}: unknown goal; choose one of {', '.join(GOALS)}")
    if request.priority not in PRIORITIES:
        raise UserError(f"--priority {request.priority}: unknown priority; choose one of {', '.join(PRIORITIES)}")
    prefs = request.preferences
    if prefs.optimizer is not None and prefs.optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {prefs.optimizer}: the planner chooses among {', '.join(OPTIMIZERS)}")
    if prefs.rank is not None and prefs.rank < 1:
        raise UserError(f"--rank {prefs.rank}: must be a positive integer, e.g. 16")
    if prefs.resolution is not None and (prefs.resolution < 256 or prefs.resolution % RESOLUTION_STEP):
        raise UserError(f"--resolution {prefs.resolution}: must be a multiple of {RESOLUTION_STEP}, at least 256")
    if prefs.attention not in ("sdpa", "xformers"):
        raise UserError(f"--attention {prefs.attention}: choose sdpa or xformers")


def plan_training(request: PlanRequest) -> Plan:
    """Plan a LoRA training run; see the module docstring for every rule. Deterministic."""
    _validate(request)
    family = detect_family(request.model, request.family)
    dataset = request.dataset or (scan_dataset(request.dataset_dir) if request.dataset_dir else nominal_dataset())
    goal = GOAL_PROFILES[request.goal]
    prefs = request.preferences
    gpus = request.gpus
    devices = max(1, len(gpus))

    # Precision: the weakest device decides (all ranks of a DDP run share one setting).
    if not gpus:
        precision, precision_reason = "no", "no GPU: CPU training runs in fp32 (CPU autocast gains nothing here)"
    elif all(g.bf16_capable for g in gpus):
        precision, precision_reason = "bf16", "compute capability >= 8.0: bf16 has fp32's range, no loss scaling"
    else:
        precision, precision_reason = "fp16", "compute capability < 8.0: no fast bf16, fp16 with loss scaling"

    usable = min(g.usable_bytes for g in gpus) if gpus else int(request.cpu_memory_bytes or 16 * GIB)
    effective = max(1, min(goal.effective_batch, dataset.num_images))
    if devices > effective:
        effective = devices
    preferred_opt = prefs.optimizer or PRIORITY_OPTIMIZER[request.priority]
    train_te = prefs.train_text_encoder if prefs.train_text_encoder is not None else not family.is_sdxl
    rank = prefs.rank or goal.rank
    start = Settings(
        resolution=prefs.resolution or family.resolution, micro_batch=1, grad_accum=effective,
        gradient_checkpointing=False, optimizer=preferred_opt, mixed_precision=precision, fp8_base=False,
        rank=rank, train_text_encoder=train_te,
        cache_text_encoder_outputs=family.is_sdxl and not train_te, attention=prefs.attention,
    )
    fp8_ok = bool(gpus) and prefs.allow_fp8 and all(g.fp8_base_capable for g in gpus)
    predictor = _Predictor(family, gpus, request.cpu_physical_cores)

    points = [("", start), *_ladder(start, family, goal, fp8_ok, prefs.resolution)]
    chosen: _Scored | None = None
    fallbacks: list[str] = []
    smallest: _Scored | None = None
    for label, point in points:
        best, small = _best_at(point, effective, devices, usable, predictor)
        if label:
            fallbacks.append(label)
        smallest = small
        if best is not None:
            chosen = best
            break
    device = _device_label(gpus)
    warnings = tuple(dataset.warnings)
    if chosen is None:
        assert smallest is not None
        s = smallest.settings
        need = smallest.required + (max(g.held_bytes for g in gpus) if gpus else 0)
        message = (f"nothing fits {device}: the smallest configuration "
                   f"({s.resolution} px, batch 1, rank {s.rank}, gradient checkpointing, {s.optimizer}"
                   f"{', fp8 base' if s.fp8_base else ''}{', UNet only' if not s.train_text_encoder else ''}) "
                   f"needs {smallest.required / GIB:.1f} GiB with the safety margin; use a card with at least "
                   f"{math.ceil(need / GIB)} GB "
                   f"free, or free memory held by other processes")
        return Plan(fits=False, message=message, version=__version__, model=request.model, family=family.name,
                    goal=request.goal, priority=request.priority, device=device, num_processes=devices,
                    settings=None, choices=(), dataset=dataset, dataset_config={}, prediction=None,
                    launch_command=(), fallbacks=tuple(fallbacks), warnings=warnings,
                    probe_summary=request.probe_summary, output_dir=request.output_dir)

    s = chosen.settings
    views_per_epoch = dataset.views_per_epoch
    target_views = _target_views(goal, dataset.num_images, request.priority)
    epochs = prefs.epochs or max(1, round(target_views / views_per_epoch))
    effective_real = s.micro_batch * s.grad_accum * devices
    steps_per_epoch = math.ceil(views_per_epoch / effective_real)
    short_cpu_run = not gpus and family.tiny and not prefs.epochs
    if short_cpu_run:
        epochs = max(1, min(epochs, TINY_CPU_MAX_STEPS // steps_per_epoch))
    steps = epochs * steps_per_epoch
    seconds_per_step = s.grad_accum / chosen.it_per_s
    prediction = Prediction(
        peak_bytes=chosen.peak, required_bytes=chosen.required, usable_bytes=usable, components=chosen.components,
        it_per_s=1.0 / seconds_per_step, micro_steps_per_s=chosen.it_per_s, samples_per_s=chosen.samples_per_s,
        seconds_per_step=seconds_per_step,
        total_seconds=steps * seconds_per_step, optimizer_steps=steps,
    )
    context = _Context(request=request, family=family, dataset=dataset, goal=goal, settings=s, devices=devices,
                       effective=effective_real, epochs=epochs, steps=steps, target_views=target_views,
                       precision_reason=precision_reason, fallbacks=tuple(fallbacks), preferred_opt=preferred_opt,
                       usable=usable, peak=chosen.peak)
    choices = _choices(context)
    launch = _launch_command(family, devices, precision, request.output_dir)
    summary = (f"{family.name} on {device}: micro-batch {s.micro_batch} x accumulation {s.grad_accum}"
               f"{f' x {devices} devices' if devices > 1 else ''}, {s.resolution} px, rank {s.rank}, "
               f"predicted peak {chosen.peak / GIB:.2f} of {usable / GIB:.2f} GiB usable")
    return Plan(fits=True, message=summary, version=__version__, model=request.model, family=family.name,
                goal=request.goal, priority=request.priority, device=device, num_processes=devices, settings=s,
                choices=choices, dataset=dataset, dataset_config=_dataset_config(context),
                prediction=prediction, launch_command=launch, fallbacks=tuple(fallbacks), warnings=warnings,
                probe_summary=request.probe_summary, output_dir=request.output_dir)


def _target_views(goal: GoalProfile, num_images: int, priority: str) -> int:
    views = min(max(goal.views_per_image * num_images, goal.min_views), goal.max_views)
    return int(round(views * PRIORITY_VIEW_SCALE[priority]))


def _device_label(gpus: Sequence[GpuTarget]) -> str:
    if not gpus:
        return "CPU"
    labels = [f"{g.name} ({g.usable_bytes / GIB:.1f} GiB usable)" for g in gpus]
    if len(set(labels)) == 1:
        return labels[0] if len(labels) == 1 else f"{len(labels)} x {labels[0]}"
    return ", ".join(labels)


def learning_rate(goal: GoalProfile, effective_batch: int) -> float:
    """unet_lr = base x sqrt(effective batch / 4), clamped to [2.5e-5, 4e-4], 3 significant digits."""
    lr = goal.unet_lr * math.sqrt(effective_batch / 4)
    lr = min(max(lr, 2.5e-5), 4e-4)
    return float(f"{lr:.3g}")


@dataclass(frozen=True)
class _Context:
    request: PlanRequest
    family: FamilySpec
    dataset: DatasetSummary
    goal: GoalProfile
    settings: Settings
    devices: int
    effective: int
    epochs: int
    steps: int
    target_views: int
    precision_reason: str
    fallbacks: tuple[str, ...]
    preferred_opt: str
    usable: int
    peak: int


def _output_paths(request: PlanRequest) -> tuple[str, str]:
    if request.output_dir is None:
        return "./output", "./logs"
    base = Path(request.output_dir).expanduser().resolve()
    return str(base / "output"), str(base / "logs")


def _output_name(request: PlanRequest, dataset: DatasetSummary, family: FamilySpec) -> str:
    if request.preferences.output_name:
        return request.preferences.output_name
    stem = Path(dataset.root).name if request.dataset_dir else "lora"
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in stem).strip("_") or "lora"
    return f"{safe}-{family.name}"


def _choices(c: _Context) -> tuple[Choice, ...]:
    """Every setting in config.toml, with its reason, in the order the file shows them."""
    s, fam, req, goal = c.settings, c.family, c.request, c.goal
    fell = set(c.fallbacks)
    out: list[Choice] = []

    def add(key: str, value: Any, reason: str, kohya: bool = True) -> None:
        out.append(Choice(key, value, reason, kohya))

    # model
    add("pretrained_model_name_or_path", req.model,
        "builtin:<id> is understood by lora-autotune's engine only" if req.model.startswith("builtin:")
        else "the base model you gave")
    if fam.name in ("sd2", "sd2-v"):
        add("v2", True, "SD 2.x: OpenCLIP text encoder and 1024-wide cross-attention")
    if fam.v_parameterization:
        add("v_parameterization", True, "768-v model: the UNet predicts v, not noise")
    # dataset
    dataset_toml = "dataset.toml" if req.output_dir is None else str(Path(req.output_dir).expanduser().resolve()
                                                                     / "dataset.toml")
    add("dataset_config", dataset_toml,
        "images, repeats and captions: the dataset.toml written next to this file" if req.output_dir is not None
        else "images, repeats and captions: dataset.toml, relative to the folder you launch from")
    res_reason = (f"{fam.name}'s native size" if s.resolution == fam.resolution and not req.preferences.resolution
                  else "your --resolution" if req.preferences.resolution and s.resolution == req.preferences.resolution
                  else f"lowered from {fam.resolution}: nothing fit at the native size (quality cost)")
    add("resolution", f"{s.resolution},{s.resolution}", res_reason + "; activation memory grows with its square")
    add("enable_bucket", True, "keeps each image's aspect ratio; bucket area never exceeds resolution^2")
    step, min_bucket = bucket_rules(fam, s.resolution)
    add("min_bucket_reso", min_bucket, "half the resolution: narrower buckets waste pixels")
    add("max_bucket_reso", s.resolution * 2, "twice the resolution: tall/wide images keep their shape")
    add("bucket_reso_steps", step, f"bucket sides in {step} px steps (kohya's default, 8 latent pixels)")
    add("bucket_no_upscale", True, "small images are not blown up past their own size")
    add("cache_latents", True, "VAE encodes each image once; the VAE leaves VRAM and steps skip the encoder")
    add("cache_latents_to_disk", True, "reruns and OOM retries reuse the cache (files next to the images)")
    if s.cache_text_encoder_outputs:
        add("cache_text_encoder_outputs", True,
            "text encoders run once and leave VRAM (SDXL UNet-only training); captions cannot be shuffled")
    workers = min(2, req.cpu_physical_cores // 2)
    add("max_data_loader_n_workers", workers,
        f"{req.cpu_physical_cores} physical cores; cached latents make a batch cheap to load, so 0-2 workers")
    if workers > 0:
        add("persistent_data_loader_workers", True, "workers survive between epochs (no restart stall)")
    # network
    add("network_module", "networks.lora", "kohya's LoRA (LierLa: linear layers of attention and MLPs)")
    rank_reason = ("your --rank" if req.preferences.rank and s.rank == req.preferences.rank
                   else f"goal {req.goal}: rank {goal.rank}" if s.rank == goal.rank
                   else f"lowered from {req.preferences.rank or goal.rank} to fit memory (fewer LoRA parameters)")
    add("network_dim", s.rank, rank_reason)
    add("network_alpha", float(s.alpha),
        "alpha = rank / 2: LoRA scale 0.5 whatever the rank, so the learning rate holds")
    if not s.train_text_encoder:
        te_reason = ("UNet only: fit memory" if any(f.startswith("UNet only") for f in fell)
                     else "your choice" if req.preferences.train_text_encoder is False
                     else "SDXL: training its two text encoders costs much memory for little gain")
        add("network_train_unet_only", True, te_reason)
    # optimizer
    opt_reason = {
        "AdamW8bit": "8-bit Adam state (2 bytes/param instead of 8), same quality in practice",
        "AdamW": "fp32 Adam state: the reference optimizer (priority quality)",
        "Prodigy": "Prodigy estimates its own step size (learning rates 1.0)",
    }[s.optimizer]
    if s.optimizer != c.preferred_opt:
        opt_reason = f"switched from {c.preferred_opt} to fit memory; " + opt_reason
    elif req.preferences.optimizer:
        opt_reason = "your --optimizer; " + opt_reason
    add("optimizer_type", s.optimizer, opt_reason)
    if s.optimizer == "Prodigy":
        add("optimizer_args", ["decouple=True", "weight_decay=0.01", "use_bias_correction=True",
                               "safeguard_warmup=True"], "Prodigy's usual LoRA settings (decoupled weight decay)")
        unet_lr, te_lr = 1.0, 1.0
        lr_reason = "Prodigy: 1.0 means 'use the estimated step size'"
    else:
        unet_lr = learning_rate(goal, c.effective)
        te_lr = float(f"{unet_lr / 2:.3g}")
        lr_reason = (f"goal {req.goal}: {goal.unet_lr:g} x sqrt(effective batch {c.effective} / 4), "
                     "clamped to [2.5e-5, 4e-4]")
    add("learning_rate", unet_lr, "same as unet_lr (kohya uses the per-part rates below)")
    add("unet_lr", unet_lr, lr_reason)
    if s.train_text_encoder:
        add("text_encoder_lr", [te_lr], "half the UNet rate: text encoders overfit fast")
    warmup = int(round(0.05 * c.steps))
    add("lr_scheduler", "cosine", "decays to zero by the last step")
    add("lr_warmup_steps", warmup, f"5% of {c.steps} steps: protects the fresh LoRA from large early updates")
    # training
    add("train_batch_size", s.micro_batch, _batch_reason(c))
    add("gradient_accumulation_steps", s.grad_accum,
        f"effective batch {c.effective} = {s.micro_batch} x {s.grad_accum}"
        + (f" x {c.devices} devices" if c.devices > 1 else "") + f" (goal {req.goal} wants {goal.effective_batch})")
    add("gradient_checkpointing", s.gradient_checkpointing,
        "needed to fit: recomputes activations in backward (~30% slower, far less memory)"
        if s.gradient_checkpointing else "off: everything fits without recomputing activations (faster)")
    add("mixed_precision", s.mixed_precision, c.precision_reason)
    if s.fp8_base:
        add("fp8_base", True, "last resort to fit: frozen base weights stored in fp8 (half of 16-bit; slight "
                              "quality cost)")
    if s.attention == "xformers":
        add("xformers", True, "your --attention xformers: memory-efficient attention kernel")
    else:
        add("sdpa", True, "PyTorch scaled-dot-product attention: flash / memory-efficient kernels, no extra install")
    if fam.is_sdxl and s.mixed_precision == "fp16":
        add("no_half_vae", True, "SDXL's VAE overflows in fp16 (NaN latents); it only runs while caching")
    epochs_reason = (f"~{c.target_views} image-views for goal {req.goal} ({c.dataset.num_images} images, "
                     f"{c.dataset.views_per_epoch} views per epoch) -> {c.steps} optimizer steps")
    if not req.gpus and fam.tiny and not req.preferences.epochs:
        epochs_reason += f"; tiny model on CPU: capped to a short run (<= {TINY_CPU_MAX_STEPS} steps, >= 1 epoch)"
    add("max_train_epochs", c.epochs, epochs_reason)
    add("seed", req.preferences.seed, "fixed seed: reruns are reproducible")
    # saving / logging
    output_dir, logging_dir = _output_paths(req)
    add("output_dir", output_dir, "trained LoRA files go here")
    add("output_name", _output_name(req, c.dataset, fam), "dataset folder and family")
    add("save_model_as", "safetensors", "safe format, kohya's default")
    add("save_precision", "fp16", "half-size LoRA files, loadable everywhere")
    add("save_every_n_epochs", max(1, math.ceil(c.epochs / 4)), "about four checkpoints to compare")
    add("logging_dir", logging_dir, "TensorBoard logs")
    add("log_with", "tensorboard", "loss curves without an account")
    # informational
    add("effective_batch", c.effective, "samples per optimizer step across accumulation and devices", kohya=False)
    add("num_processes", c.devices, "data-parallel processes (one per GPU)", kohya=False)
    if c.fallbacks:
        add("fallbacks", ", ".join(c.fallbacks), "given up, in this order, because nothing fit before",
            kohya=False)
    return tuple(out)


def _batch_reason(c: _Context) -> str:
    return (f"fastest fitting micro-batch: predicted peak {c.peak / GIB:.2f} GiB of {c.usable / GIB:.2f} GiB "
            f"usable per device")


def _dataset_config(c: _Context) -> dict[str, Any]:
    """kohya's dataset.toml: [general] + one [[datasets]] with a [[datasets.subsets]] per N_name folder."""
    s = c.settings
    subsets = []
    for sub in c.dataset.subsets:
        entry: dict[str, Any] = {"image_dir": sub.image_dir, "num_repeats": sub.num_repeats}
        if sub.class_tokens:
            entry["class_tokens"] = sub.class_tokens
        subsets.append(entry)
    general: dict[str, Any] = {"caption_extension": c.dataset.caption_extension,
                               "shuffle_caption": not s.cache_text_encoder_outputs, "keep_tokens": 1}
    if s.cache_text_encoder_outputs:
        general["keep_tokens"] = 0
    dataset = {
        "resolution": [s.resolution, s.resolution],
        "batch_size": s.micro_batch,
        "enable_bucket": True,
        "min_bucket_reso": bucket_rules(c.family, s.resolution)[1],
        "max_bucket_reso": s.resolution * 2,
        "bucket_reso_steps": bucket_rules(c.family, s.resolution)[0],
        "bucket_no_upscale": True,
        "subsets": subsets,
    }
    return {"general": general, "datasets": [dataset]}


def _launch_command(family: FamilySpec, devices: int, precision: str, output_dir: str | None) -> tuple[str, ...]:
    """The sd-scripts command line for this plan (our engine takes the same --config_file)."""
    script = "sdxl_train_network.py" if family.is_sdxl else "train_network.py"
    config = "config.toml" if output_dir is None else str(Path(output_dir).expanduser().resolve() / "config.toml")
    cmd = ["accelerate", "launch", "--num_processes", str(devices)]
    if devices > 1:
        cmd.append("--multi_gpu")
    if precision in ("fp16", "bf16"):
        cmd += ["--mixed_precision", precision]
    cmd += ["--num_cpu_threads_per_process", "1", script, "--config_file", config]
    return tuple(cmd)
