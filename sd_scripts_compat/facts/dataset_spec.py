"""Typed dataset description shared by the config reader and the dataset builder.

The config reader (``--train_data_dir`` folders or a ``--dataset_config`` TOML) produces these,
already merged by kohya's precedence (subset > dataset > [general] > command line > default) and
validated; the dataset builder only consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # the images a subset's folder holds


def caption_extension_problem(extension: str, media: tuple[str, ...] = IMAGE_EXTENSIONS) -> str | None:
    """Why ``extension`` cannot be the captions' extension (it is the media's own, so each image would be read as
    its own caption), or None."""
    if extension.lower() in media:
        return "an image extension, so each image would be read as its own caption; use the captions' extension " \
               "(.txt, .caption)"
    return None


def normalize_caption_extension(extension: str) -> str:
    """sd-scripts' rule: a caption extension without its dot gets one ("txt" -> ".txt"); the case is kept."""
    return "." + extension if extension and not extension.startswith(".") else extension


@dataclass(frozen=True)
class SubsetSpec:
    image_dir: str
    num_repeats: int = 1
    class_tokens: str | None = None
    is_reg: bool = False
    caption_extension: str = ".caption"
    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    color_aug: bool = False
    flip_aug: bool = False
    random_crop: bool = False
    face_crop_aug_range: tuple[float, float] | None = None
    token_warmup_min: int = 1
    token_warmup_step: float = 0.0
    # kohya dataset-config keys the config reader accepts and carries; the reader warns when one is set
    # to a non-default value that the dataset builder does not implement yet.
    secondary_separator: str | None = None
    enable_wildcard: bool = False
    cache_info: bool = False
    alpha_mask: bool = False
    resize_interpolation: str | None = None
    metadata_file: str | None = None  # fine-tuning subset (captions from a metadata JSON), else DreamBooth
    custom_attributes: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "caption_extension", normalize_caption_extension(self.caption_extension))


@dataclass(frozen=True)
class DatasetSpec:
    subsets: tuple[SubsetSpec, ...]
    resolution: tuple[int, int] = (512, 512)  # (width, height)
    batch_size: int = 1
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    network_multiplier: float = 1.0
    validation_split: float = 0.0
    validation_seed: int | None = None
    prior_loss_weight: float = 1.0  # loss weight of is_reg subsets' images
    resize_interpolation: str | None = None


@dataclass(frozen=True)
class DatasetGroupSpec:
    datasets: tuple[DatasetSpec, ...] = field(default_factory=tuple)


# ---- kohya's N_name folders (the config reader builds subsets from them; dataset.scan walks them) ----


def parse_repeat_folder(name: str) -> tuple[int, str] | None:
    """kohya's folder rule: ``"10_sks dog"`` -> ``(10, "sks dog")``; None when the name does not start with
    an integer. Like sd-scripts, the count is the text before the first ``_`` and the class tokens are the
    rest, as they are (``"10"`` -> ``(10, "")``). A count below 1 is returned as it is: such a folder is
    skipped (see ``MIN_REPEATS``)."""
    head, _, tail = name.partition("_")
    try:
        return int(head), tail
    except ValueError:
        return None


MIN_REPEATS = 1  # a folder with fewer repeats is skipped, as sd-scripts skips it
