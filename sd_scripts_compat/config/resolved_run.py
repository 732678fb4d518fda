"""What a run resolves to: a kohya config (+ dataset config) read with the engine's own reader, and the
settings it really trains with. Beside the reader (``training_config``), not in the torch-free facts, because it
needs the reader's checked ``TrainingConfig``."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sd_scripts_compat.config.training_config import TrainingConfig, load_training_config, single_dataset
from sd_scripts_compat.facts.dataset_spec import DatasetSpec
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import settings_from_values

# ---- what a run resolves to -------------------------------------------------------------------------

def resolved_settings(config: TrainingConfig, dataset: DatasetSpec) -> TrainSettings:
    """The settings a run really uses, from the engine's checked config and its (one) resolved dataset: the one
    reader (:func:`settings_from_values`) over the config's values and the dataset's batch, size and buckets."""
    values = {name: getattr(config, name) for name in _CONFIG_KEYS}
    values["network_args"] = [f"{key}={value}" for key, value in config.network_args.entries.items()]
    values.update(train_batch_size=dataset.batch_size, resolution=tuple(dataset.resolution),
                  enable_bucket=dataset.enable_bucket, max_bucket_reso=dataset.max_bucket_reso)
    return settings_from_values(values)


# the TrainingConfig fields settings_from_values reads (the dataset supplies batch, resolution and buckets)
_CONFIG_KEYS = ("gradient_accumulation_steps", "gradient_checkpointing", "optimizer_type", "network_dim",
                "network_alpha", "network_train_unet_only", "mixed_precision", "fp8_base", "fp8_base_unet",
                "cache_latents", "cache_text_encoder_outputs", "xformers", "learning_rate", "unet_lr",
                "text_encoder_lr", "lr_scheduler", "lr_warmup_steps", "max_grad_norm", "full_fp16", "full_bf16",
                "blocks_to_swap", "cpu_offload_checkpointing", "network_module", "torch_compile", "dynamo_backend",
                "fsdp", "fsdp_offload_params", "fsdp_shard_size", "shard_optimizer_state")


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
                        script: str | None = None, default_resolution: tuple[int, int] | None = None,
                        train_data_dir: str | Path | None = None) -> ResolvedRun:
    """Read config.toml (+ dataset.toml) with the engine's own reader, exactly as a training run will.

    The reader's warnings are not shown here (the engine shows them when it starts); its errors are
    the engine's one-line errors, raised now rather than after a model has loaded. ``script`` names the
    entry point (``"flux_train_network"``); without it ``sdxl`` chooses SD 1.x/2.x or SDXL.
    ``train_data_dir`` is given on the "command line" (it wins over the file's), as ``autotune run`` does.
    """
    argv = ["--config_file", str(config_path)]
    if dataset_config_path is not None:
        argv += ["--dataset_config", str(dataset_config_path)]
    elif train_data_dir is not None:
        argv += ["--train_data_dir", str(train_data_dir)]
    loggers = [logging.getLogger(name) for name in ("sd_scripts_compat.config.training_config",
                                                    "sd_scripts_compat.config.dataset_config")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        config = load_training_config(argv, sdxl=sdxl, script=script)
        dataset = single_dataset(config, default_resolution=default_resolution)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return ResolvedRun(config=config, dataset=dataset, settings=resolved_settings(config, dataset))
