"""The settings that decide a run's memory, speed and stability: one type, with kohya's names, everywhere.

The planner chooses a ``TrainSettings``, the writer turns it into config.toml / dataset.toml, the
engine reports the one it actually resolved (after kohya's precedence: subset > dataset > general >
config > defaults), and the OOM ladder (memory) and the stability ladder (learning rate, warm-up,
clipping, precision) step down from that report. Because every side uses this
type and the same reader (:func:`settings_from_files` runs the engine's own config reader), a value
cannot be lost between them: the micro-batch a dataset.toml sets is the micro-batch the ladder sees.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.config.kohya_toml import parse_resolution
from sd_scripts_compat.errors import UserError

if TYPE_CHECKING:
    from sd_scripts_compat.config.dataset_spec import DatasetSpec
    from sd_scripts_compat.config.training_config import TrainingConfig


@dataclass(frozen=True)
class TrainSettings:
    """Memory-, speed- and stability-relevant knobs of one run, by their kohya names.

    ``train_batch_size`` is the micro-batch the dataset really uses (a dataset.toml's ``batch_size``
    wins over the config's), ``resolution`` is (width, height), ``max_bucket_reso`` is None when
    bucketing is off. The learning-rate fields default to kohya's defaults (TrainingConfig's); the
    planner writes its own rates through its choices, so it never reads them from here.
    """

    train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    resolution: tuple[int, int] = (512, 512)
    gradient_checkpointing: bool = False
    optimizer_type: str = "AdamW"
    network_dim: int = 16
    network_alpha: float | None = None
    network_train_unet_only: bool = False
    mixed_precision: str = "no"
    fp8_base: bool = False
    cache_latents: bool = False
    cache_text_encoder_outputs: bool = False
    max_bucket_reso: int | None = None
    xformers: bool = False
    learning_rate: float = 2e-6
    unet_lr: float | None = None
    text_encoder_lr: tuple[float, ...] | None = None
    lr_scheduler: str = "constant"
    lr_warmup_steps: int | float = 0  # int: steps; float in (0, 1): a ratio of the total steps (kohya)
    max_grad_norm: float = 1.0  # 0: no clipping
    full_fp16: bool = False
    full_bf16: bool = False
    blocks_to_swap: int = 0  # FLUX: transformer blocks kept in host memory and copied in around their use

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step on one device."""
        return self.train_batch_size * self.gradient_accumulation_steps

    @property
    def weight_dtype(self) -> str:
        """The frozen base weights' storage: fp8, bf16, fp16 or fp32."""
        if self.fp8_base:
            return "fp8"
        return {"bf16": "bf16", "fp16": "fp16"}.get(self.mixed_precision, "fp32")

    @property
    def attention(self) -> str:
        return "xformers" if self.xformers else "sdpa"

    def with_rank(self, network_dim: int, network_alpha: float | None = None) -> TrainSettings:
        """Another rank; alpha follows in proportion unless given, so the LoRA's scale alpha/dim holds."""
        if network_alpha is None and self.network_alpha is not None:
            network_alpha = self.network_alpha * network_dim / self.network_dim
        return replace(self, network_dim=network_dim, network_alpha=network_alpha)

    # ---- kohya files ------------------------------------------------------------------------------

    def config_values(self) -> dict[str, Any]:
        """The settings as training-config values, in kohya's value types ("W,H" resolution)."""
        values: dict[str, Any] = {
            "train_batch_size": self.train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "resolution": f"{self.resolution[0]},{self.resolution[1]}",
            "gradient_checkpointing": self.gradient_checkpointing,
            "optimizer_type": self.optimizer_type,
            "network_dim": self.network_dim,
            "mixed_precision": self.mixed_precision,
            "cache_latents": self.cache_latents,
            "cache_text_encoder_outputs": self.cache_text_encoder_outputs,
            "fp8_base": self.fp8_base,
        }
        if self.network_alpha is not None:
            values["network_alpha"] = self.network_alpha
        if self.max_bucket_reso is not None:
            values["max_bucket_reso"] = self.max_bucket_reso
        if self.network_train_unet_only or self.cache_text_encoder_outputs:
            values["network_train_unet_only"] = True  # kohya refuses TE caching while training the TE
        if self.xformers:
            values["xformers"] = True
        if self.blocks_to_swap:
            values["blocks_to_swap"] = self.blocks_to_swap
        values.update({"learning_rate": self.learning_rate, "lr_scheduler": self.lr_scheduler,
                       "lr_warmup_steps": self.lr_warmup_steps, "max_grad_norm": self.max_grad_norm,
                       "full_fp16": self.full_fp16, "full_bf16": self.full_bf16})
        if self.unet_lr is not None:
            values["unet_lr"] = self.unet_lr
        if self.text_encoder_lr is not None:
            values["text_encoder_lr"] = list(self.text_encoder_lr)
        return values

    def dataset_values(self) -> dict[str, Any]:
        """The dataset-level values of a dataset.toml (they win over the training config in kohya)."""
        values: dict[str, Any] = {"batch_size": self.train_batch_size, "resolution": list(self.resolution)}
        if self.max_bucket_reso is not None:
            values["max_bucket_reso"] = self.max_bucket_reso
        return values

    def changed_from(self, base: TrainSettings) -> dict[str, tuple[Any, Any]]:
        """Field -> (old, new) for every field that differs from ``base``."""
        old, new = asdict(base), asdict(self)
        return {k: (old[k], new[k]) for k in old if old[k] != new[k]}

    # ---- events -----------------------------------------------------------------------------------

    def to_event(self) -> dict[str, Any]:
        """JSON-ready, every field present (the ``settings`` block of the engine's events)."""
        out = asdict(self)
        out["resolution"] = list(self.resolution)
        out["text_encoder_lr"] = list(self.text_encoder_lr) if self.text_encoder_lr is not None else None
        return out

    @classmethod
    def from_event(cls, values: Mapping[str, Any]) -> TrainSettings:
        """Read a ``to_event`` block back; a missing or ill-typed field is a ValueError naming it."""
        names = {f.name for f in fields(cls)}
        missing = sorted(names - set(values))
        if missing:
            raise ValueError(f"settings block lacks {', '.join(missing)}")
        data = {name: values[name] for name in names}
        data["resolution"] = parse_resolution(data["resolution"])
        for name in ("train_batch_size", "gradient_accumulation_steps", "network_dim", "blocks_to_swap"):
            data[name] = int(data[name])
        if data["max_bucket_reso"] is not None:
            data["max_bucket_reso"] = int(data["max_bucket_reso"])
        for name in ("network_alpha", "unet_lr"):
            if data[name] is not None:
                data[name] = float(data[name])
        data["learning_rate"], data["max_grad_norm"] = float(data["learning_rate"]), float(data["max_grad_norm"])
        if data["text_encoder_lr"] is not None:
            data["text_encoder_lr"] = tuple(float(lr) for lr in data["text_encoder_lr"])
        warmup = data["lr_warmup_steps"]
        data["lr_warmup_steps"] = warmup if isinstance(warmup, int) else float(warmup)
        return cls(**data)

    def describe(self) -> str:
        parts = [f"micro-batch {self.train_batch_size} x accum {self.gradient_accumulation_steps}",
                 f"{self.resolution[0]}x{self.resolution[1]}", f"rank {self.network_dim}", self.optimizer_type]
        if self.gradient_checkpointing:
            parts.append("grad-checkpointing")
        if self.cache_text_encoder_outputs:
            parts.append("TE outputs cached")
        if self.max_bucket_reso is not None:
            parts.append(f"max bucket {self.max_bucket_reso}")
        if self.fp8_base:
            parts.append("fp8 base")
        if self.blocks_to_swap:
            parts.append(f"{self.blocks_to_swap} blocks swapped")
        parts.append(f"lr {self.learning_rate:g}")
        if self.lr_warmup_steps:
            parts.append(f"warm-up {self.lr_warmup_steps:g}")
        if not self.max_grad_norm:
            parts.append("no grad clipping")
        if self.full_fp16 or self.full_bf16:
            parts.append("full fp16" if self.full_fp16 else "full bf16")
        return ", ".join(parts)


def resolved_settings(config: TrainingConfig, dataset: DatasetSpec) -> TrainSettings:
    """The settings a run really uses, from the engine's checked config and its (one) resolved dataset."""
    return TrainSettings(
        train_batch_size=dataset.batch_size,
        gradient_accumulation_steps=max(1, config.gradient_accumulation_steps),
        resolution=tuple(dataset.resolution),
        gradient_checkpointing=bool(config.gradient_checkpointing),
        optimizer_type=config.optimizer_type,
        network_dim=config.network_dim,
        network_alpha=config.network_alpha,
        network_train_unet_only=bool(config.network_train_unet_only),
        mixed_precision=config.mixed_precision,
        fp8_base=bool(config.fp8_base or config.fp8_base_unet),
        cache_latents=bool(config.cache_latents),
        cache_text_encoder_outputs=bool(config.cache_text_encoder_outputs),
        max_bucket_reso=dataset.max_bucket_reso if dataset.enable_bucket else None,
        xformers=bool(config.xformers),
        learning_rate=float(config.learning_rate),
        unet_lr=config.unet_lr,
        text_encoder_lr=tuple(config.text_encoder_lr) if config.text_encoder_lr else None,
        lr_scheduler=config.lr_scheduler,
        lr_warmup_steps=config.lr_warmup_steps,
        max_grad_norm=float(config.max_grad_norm or 0.0),
        full_fp16=bool(config.full_fp16),
        full_bf16=bool(config.full_bf16),
        blocks_to_swap=int(config.blocks_to_swap or 0),
    )


def dataset_report(dataset: DatasetSpec) -> dict[str, Any]:
    """What the engine resolved for one dataset (the ``datasets`` list of its events)."""
    return {"batch_size": dataset.batch_size, "resolution": list(dataset.resolution),
            "enable_bucket": dataset.enable_bucket, "min_bucket_reso": dataset.min_bucket_reso,
            "max_bucket_reso": dataset.max_bucket_reso, "bucket_reso_steps": dataset.bucket_reso_steps,
            "bucket_no_upscale": dataset.bucket_no_upscale, "num_subsets": len(dataset.subsets)}


@dataclass(frozen=True)
class ResolvedRun:
    """A run's config and dataset as the engine will resolve them, read before it starts."""

    config: TrainingConfig
    dataset: DatasetSpec
    settings: TrainSettings


def settings_from_files(config_path: str | Path, dataset_config_path: str | Path | None, *, sdxl: bool = False,
                        script: str | None = None,
                        default_resolution: tuple[int, int] | None = None) -> ResolvedRun:
    """Read config.toml (+ dataset.toml) with the engine's own reader, exactly as a training run will.

    The reader's warnings are not shown here (the engine shows them when it starts); its errors are
    the engine's one-line errors, raised now rather than after a model has loaded. ``script`` names the
    entry point (``"flux_train_network"``); without it ``sdxl`` chooses SD 1.x/2.x or SDXL.
    """
    from sd_scripts_compat.config.training_config import dataset_group_from_config, load_training_config

    argv = ["--config_file", str(config_path)]
    if dataset_config_path is not None:
        argv += ["--dataset_config", str(dataset_config_path)]
    loggers = [logging.getLogger(name) for name in ("sd_scripts_compat.config.training_config",
                                                    "sd_scripts_compat.config.dataset_config")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        config = load_training_config(argv, sdxl=sdxl, script=script)
        group = dataset_group_from_config(config, default_resolution=default_resolution)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    if len(group.datasets) != 1:
        raise UserError(f"{dataset_config_path or config_path}: {len(group.datasets)} [[datasets]] given; the "
                        "engine trains on exactly one (put several folders as [[datasets.subsets]] of one dataset)")
    dataset = group.datasets[0]
    return ResolvedRun(config=config, dataset=dataset, settings=resolved_settings(config, dataset))
