"""The ``ss_*`` keys sd-scripts' ``train_network.py`` writes from its options, its dataset and its model files,
beside those :func:`~sd_scripts_compat.network.lora_file.build_metadata` writes from the run's own figures.

sd-scripts writes ``str(value)`` of each: an option as argparse holds it after its checks (``None``, ``0.0``,
``l2``, a ``(w, h)`` tuple; a TOML integer for a float option stays an integer, ``5`` not ``5.0``, since
sd-scripts puts TOML values into its args unconverted), a flag as ``str(bool(...))``. Which option drives which
key (``OPTION_KEYS``):

| key | option | written as |
| --- | --- | --- |
| ``ss_full_fp16`` | ``full_fp16`` | flag |
| ``ss_lowram`` | ``lowram`` | value |
| ``ss_multires_noise_iterations`` | ``multires_noise_iterations`` | value |
| ``ss_multires_noise_discount`` | ``multires_noise_discount`` | value |
| ``ss_adaptive_noise_scale`` | ``adaptive_noise_scale`` | value |
| ``ss_zero_terminal_snr`` | ``zero_terminal_snr`` | value |
| ``ss_caption_dropout_rate`` | ``caption_dropout_rate`` | value |
| ``ss_caption_dropout_every_n_epochs`` | ``caption_dropout_every_n_epochs`` | value |
| ``ss_caption_tag_dropout_rate`` | ``caption_tag_dropout_rate`` | value |
| ``ss_face_crop_aug_range`` | ``face_crop_aug_range`` | value |
| ``ss_prior_loss_weight`` | ``prior_loss_weight`` | value |
| ``ss_scale_weight_norms`` | ``scale_weight_norms`` | value |
| ``ss_ip_noise_gamma`` | ``ip_noise_gamma`` | value |
| ``ss_debiased_estimation`` | ``debiased_estimation_loss`` | flag |
| ``ss_noise_offset_random_strength`` | ``noise_offset_random_strength`` | value |
| ``ss_ip_noise_gamma_random_strength`` | ``ip_noise_gamma_random_strength`` | value |
| ``ss_loss_type`` | ``loss_type`` | value |
| ``ss_huber_schedule`` | ``huber_schedule`` | value |
| ``ss_huber_scale`` | ``huber_scale`` | value |
| ``ss_huber_c`` | ``huber_c`` | value |
| ``ss_fp8_base`` | ``fp8_base`` | flag |
| ``ss_fp8_base_unet`` | ``fp8_base_unet`` | flag |
| ``ss_validation_seed`` | ``validation_seed`` | value |
| ``ss_validation_split`` | ``validation_split`` | value |
| ``ss_max_validation_steps`` | ``max_validation_steps`` | value |
| ``ss_validate_every_n_epochs`` | ``validate_every_n_epochs`` | value |
| ``ss_validate_every_n_steps`` | ``validate_every_n_steps`` | value |
| ``ss_resize_interpolation`` | ``resize_interpolation`` | value |

The dataset (:func:`dataset_keys`): a run from ``train_data_dir`` writes the flat keys (``ss_color_aug``,
``ss_flip_aug``, ``ss_random_crop``, ``ss_shuffle_caption``, ``ss_keep_tokens`` from the options;
``ss_enable_bucket``, ``ss_bucket_no_upscale``, ``ss_min_bucket_reso``, ``ss_max_bucket_reso`` from the dataset,
which without bucketing holds ``None``, ``None``, ``False`` and a ``null`` bucket info whatever was configured;
``ss_dataset_dirs``, ``ss_reg_dataset_dirs``, ``ss_tag_frequency``, ``ss_bucket_info`` as JSON); a run from a
``dataset_config`` writes ``ss_datasets`` (one JSON record per dataset, its subsets inside) with
``ss_tag_frequency`` and ``ss_dataset_dirs``, and none of the flat keys. The model files (:func:`file_keys`): a base
model or ``vae`` that is a path gets AUTOMATIC1111's old hash (``ss_sd_model_hash`` / ``ss_vae_hash``: 8 hex digits
of the SHA-256 of the 64 KiB at 1 MiB) and the file's SHA-256 (``ss_new_sd_model_hash`` / ``ss_new_vae_hash``), as
``library/train_util.py``'s ``model_hash`` and ``calculate_sha256`` compute them (a folder: ``IsADirectory``).
``ss_sd_scripts_commit_hash`` and ``modelspec.implementation_version`` name this engine and its version where
sd-scripts writes its commit. ``modelspec.timestep_range`` is ``min_timestep,max_timestep`` (0 and 1000 for the one
not given) when either is given, as ``get_sai_model_spec`` writes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.hashes import file_legacy_hash, file_sha256

if TYPE_CHECKING:
    from sd_scripts_compat.config.training_config import TrainingConfig
    from sd_scripts_compat.dataset.train_dataset import TrainDataset

FLAG, VALUE = "flag", "value"
OPTION_KEYS: tuple[tuple[str, str, str], ...] = (
    ("ss_full_fp16", "full_fp16", FLAG), ("ss_lowram", "lowram", VALUE),
    ("ss_multires_noise_iterations", "multires_noise_iterations", VALUE),
    ("ss_multires_noise_discount", "multires_noise_discount", VALUE),
    ("ss_adaptive_noise_scale", "adaptive_noise_scale", VALUE), ("ss_zero_terminal_snr", "zero_terminal_snr", VALUE),
    ("ss_caption_dropout_rate", "caption_dropout_rate", VALUE),
    ("ss_caption_dropout_every_n_epochs", "caption_dropout_every_n_epochs", VALUE),
    ("ss_caption_tag_dropout_rate", "caption_tag_dropout_rate", VALUE),
    ("ss_face_crop_aug_range", "face_crop_aug_range", VALUE), ("ss_prior_loss_weight", "prior_loss_weight", VALUE),
    ("ss_scale_weight_norms", "scale_weight_norms", VALUE), ("ss_ip_noise_gamma", "ip_noise_gamma", VALUE),
    ("ss_debiased_estimation", "debiased_estimation_loss", FLAG),
    ("ss_noise_offset_random_strength", "noise_offset_random_strength", VALUE),
    ("ss_ip_noise_gamma_random_strength", "ip_noise_gamma_random_strength", VALUE),
    ("ss_loss_type", "loss_type", VALUE), ("ss_huber_schedule", "huber_schedule", VALUE),
    ("ss_huber_scale", "huber_scale", VALUE), ("ss_huber_c", "huber_c", VALUE),
    ("ss_fp8_base", "fp8_base", FLAG), ("ss_fp8_base_unet", "fp8_base_unet", FLAG),
    ("ss_validation_seed", "validation_seed", VALUE), ("ss_validation_split", "validation_split", VALUE),
    ("ss_max_validation_steps", "max_validation_steps", VALUE),
    ("ss_validate_every_n_epochs", "validate_every_n_epochs", VALUE),
    ("ss_validate_every_n_steps", "validate_every_n_steps", VALUE),
    ("ss_resize_interpolation", "resize_interpolation", VALUE),
)
FLAT_OPTION_KEYS = (("ss_color_aug", "color_aug", FLAG), ("ss_flip_aug", "flip_aug", FLAG),
                    ("ss_random_crop", "random_crop", FLAG), ("ss_shuffle_caption", "shuffle_caption", FLAG),
                    ("ss_keep_tokens", "keep_tokens", VALUE))


def option_value(config: TrainingConfig, name: str) -> Any:
    """An sd-scripts option as its ``args`` holds it: ours where the config reader keeps it, else what the user gave,
    else the option table's default (the reader refuses a value our engine would not honour)."""
    from sd_scripts_compat.facts.kohya_args import arg_specs

    if hasattr(config, name):
        ours = getattr(config, name)
        given = config.raw.get(name)
        # a TOML integer for a float option: sd-scripts' args keep the integer
        return given if isinstance(given, int) and isinstance(ours, float) and given == ours else ours
    if name in config.raw:
        return config.raw[name]
    spec = arg_specs(script=config.script).get(name)
    return spec.default if spec is not None else None


def _written(config: TrainingConfig, table: tuple[tuple[str, str, str], ...]) -> dict[str, Any]:
    out = {}
    for key, option, form in table:
        value = option_value(config, option)  # the reader holds face_crop_aug_range as a tuple, as sd-scripts does
        out[key] = bool(value) if form == FLAG else value
    return out


def option_keys(config: TrainingConfig, num_validation_images: int) -> dict[str, Any]:
    """The keys sd-scripts writes straight from its options (``OPTION_KEYS``), the validation image count, and the
    implementation's name where sd-scripts writes its own commit (``modelspec.implementation_version`` too)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("lora-autotune")
    except PackageNotFoundError:
        release = "unknown"
    keys = {"ss_num_validation_images": num_validation_images, **_written(config, OPTION_KEYS),
            "ss_sd_scripts_commit_hash": f"lora-autotune {release}",
            "modelspec.implementation_version": f"lora-autotune/{release}"}
    low, high = config.min_timestep, config.max_timestep
    if low is not None or high is not None:  # train_util.get_sai_model_spec: the range trained, 0 and 1000 filled in
        keys["modelspec.timestep_range"] = f"{0 if low is None else low},{1000 if high is None else high}"
    return keys


def dataset_keys(config: TrainingConfig, dataset: TrainDataset) -> dict[str, Any]:
    """The dataset's keys: the flat ones for a ``train_data_dir`` run, ``ss_datasets`` for a dataset config."""
    if config.dataset_config:
        return {"ss_datasets": json.dumps([_dataset_record(dataset)]),
                "ss_tag_frequency": json.dumps(dataset.tag_frequencies),
                "ss_dataset_dirs": json.dumps(dataset.dataset_dirs())}
    buckets = _bucket_fields(dataset)
    return {**_written(config, FLAT_OPTION_KEYS), "ss_enable_bucket": buckets["enable_bucket"],
            "ss_bucket_no_upscale": buckets["bucket_no_upscale"], "ss_min_bucket_reso": buckets["min_bucket_reso"],
            "ss_max_bucket_reso": buckets["max_bucket_reso"], "ss_dataset_dirs": json.dumps(dataset.dataset_dirs()),
            "ss_reg_dataset_dirs": json.dumps(dataset.dataset_dirs(reg=True)),
            "ss_tag_frequency": json.dumps(dataset.tag_frequencies),
            "ss_bucket_info": json.dumps(buckets["bucket_info"])}


def _bucket_fields(dataset: TrainDataset) -> dict[str, Any]:
    """The bucket facts as sd-scripts' dataset holds them: without bucketing its min / max reso and bucket info are
    None and bucket_no_upscale False, whatever was configured."""
    spec = dataset.spec
    if not spec.enable_bucket:
        return {"enable_bucket": False, "bucket_no_upscale": False, "min_bucket_reso": None,
                "max_bucket_reso": None, "bucket_info": None}
    return {"enable_bucket": True, "bucket_no_upscale": bool(spec.bucket_no_upscale),
            "min_bucket_reso": spec.min_bucket_reso, "max_bucket_reso": spec.max_bucket_reso,
            "bucket_info": dataset.bucket_info()}


def _dataset_record(dataset: TrainDataset) -> dict[str, Any]:
    """One ``ss_datasets`` entry, as sd-scripts records a DreamBooth-style dataset and its subsets."""
    spec = dataset.spec
    subsets = []
    for index, subset in enumerate(spec.subsets):
        record = {"img_count": sum(1 for r in dataset.records if r.subset_index == index),
                  "num_repeats": subset.num_repeats, "color_aug": bool(subset.color_aug),
                  "flip_aug": bool(subset.flip_aug), "random_crop": bool(subset.random_crop),
                  "shuffle_caption": bool(subset.shuffle_caption), "keep_tokens": subset.keep_tokens,
                  "keep_tokens_separator": subset.keep_tokens_separator,
                  "secondary_separator": subset.secondary_separator, "enable_wildcard": bool(subset.enable_wildcard),
                  "caption_prefix": subset.caption_prefix, "caption_suffix": subset.caption_suffix,
                  "resize_interpolation": subset.resize_interpolation}
        if subset.image_dir:
            record["image_dir"] = os.path.basename(subset.image_dir)
        if subset.metadata_file is None:  # DreamBooth-style: class tokens and the regularization flag
            record.update(class_tokens=subset.class_tokens, is_reg=subset.is_reg)
        else:  # fine-tuning style: captions from a metadata file
            record["metadata_file"] = os.path.basename(subset.metadata_file)
        subsets.append(record)
    width, height = spec.resolution
    buckets = _bucket_fields(dataset)
    dreambooth = all(s.metadata_file is None for s in spec.subsets)
    return {"is_dreambooth": dreambooth, "batch_size_per_device": spec.batch_size,
            "num_train_images": dataset.num_train_images, "num_reg_images": dataset.num_reg_images,
            "resolution": [width, height], "enable_bucket": buckets["enable_bucket"],
            "min_bucket_reso": buckets["min_bucket_reso"], "max_bucket_reso": buckets["max_bucket_reso"],
            "tag_frequency": dataset.tag_frequencies, "bucket_info": buckets["bucket_info"],
            "resize_interpolation": spec.resize_interpolation, "subsets": subsets}


def file_keys(config: TrainingConfig) -> dict[str, Any]:
    """The base model's and the VAE's hashes and names where they are paths (a built-in has no file)."""
    out: dict[str, Any] = {}
    for option, prefix in (("pretrained_model_name_or_path", "sd_model"), ("vae", "vae")):
        given = option_value(config, option)
        if given and os.path.exists(given):
            folder = os.path.isdir(given)  # sd-scripts' hash functions answer "IsADirectory" for a folder
            out[f"ss_{prefix}_hash"] = "IsADirectory" if folder else file_legacy_hash(given)
            out[f"ss_new_{prefix}_hash"] = "IsADirectory" if folder else file_sha256(given)
            out[f"ss_{prefix}_name"] = Path(given).name
    return out
