"""The ranges of numeric settings, one table for the training config and the dataset config.

sd-scripts assumes these without checking (a batch size of 0, ``clip_skip = 0``, a dropout rate of 5.0
all start a run that fails later or trains something else); here a value outside is a one-line error
wherever it is written: the command line, a training TOML or a ``dataset.toml``.
"""

from __future__ import annotations

import math
from typing import Any

# Lower bounds by the training config's names.
MIN_VALUES: dict[str, float] = {
    "train_batch_size": 1, "gradient_accumulation_steps": 1, "max_train_steps": 1, "max_train_epochs": 1,
    "network_dim": 1, "vae_batch_size": 1, "max_data_loader_n_workers": 0, "keep_tokens": 0,
    "min_bucket_reso": 1, "max_bucket_reso": 1, "bucket_reso_steps": 1, "lr_scheduler_num_cycles": 1,
    "save_every_n_epochs": 1, "save_every_n_steps": 1, "save_last_n_epochs": 1, "save_last_n_steps": 1,
    "save_last_n_epochs_state": 1, "save_last_n_steps_state": 1, "sample_every_n_steps": 1,
    "sample_every_n_epochs": 1, "validate_every_n_steps": 1, "validate_every_n_epochs": 1,
    "max_validation_steps": 1, "clip_skip": 1, "blocks_to_swap": 0, "t5xxl_max_token_length": 1, "ddp_timeout": 1,
    "caption_dropout_every_n_epochs": 0, "token_warmup_min": 0,
    "token_warmup_step": 0, "learning_rate": 0, "unet_lr": 0, "max_grad_norm": 0, "prior_loss_weight": 0,
    "network_alpha": 0, "noise_offset": 0, "min_snr_gamma": 0, "caption_dropout_rate": 0,
    "caption_tag_dropout_rate": 0, "validation_split": 0, "lr_scheduler_power": 0,
    "num_repeats": 1,  # dataset config only: 0 repeats would see the images 0 times
    "seed": 0, "validation_seed": 0,
}
RATES = ("caption_dropout_rate", "caption_tag_dropout_rate")  # fractions: at most 1
# Upper bounds: rates are fractions; seeds go to numpy, which takes 0 .. 2**32 - 1 (sd-scripts seeds it too).
MAX_VALUES: dict[str, float] = {**dict.fromkeys(RATES, 1), "seed": 2**32 - 1, "validation_seed": 2**32 - 1}
# dataset-config name -> training-config name, where they differ
DATASET_NAMES: dict[str, str] = {"batch_size": "train_batch_size"}


def bound_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is out of range for the setting ``name`` (either config's spelling), or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    name = DATASET_NAMES.get(name, name)
    if name not in MIN_VALUES and name not in MAX_VALUES:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if name in MIN_VALUES and value < MIN_VALUES[name]:
        return f"must be {MIN_VALUES[name]} or more, got {value!r}"
    if name in MAX_VALUES and value > MAX_VALUES[name]:
        if name in RATES:
            return f"a rate must be between 0 and 1, got {value!r}"
        return f"must be at most {MAX_VALUES[name]}, got {value!r}"
    return None
