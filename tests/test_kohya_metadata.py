"""sd-scripts' ``ss_*`` keys in the LoRA files our engine writes (issue 52, item 2): every key sd-scripts'
``train_network.py`` writes for the same run, in its value forms, and the base model's hashes as its
``library/train_util.py`` computes them.

The reference key sets are read from sd-scripts' source (commit 48d368f: ``train_network.py``'s ``metadata = {...}``
block, its two dataset branches, the model-name block and the keys set at each save), not recorded by running it.
Each case really trains ``tiny-sd15`` in a child process and reads the file back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_hostile_inputs import dataset, text_file
from test_valid_inputs import metadata, trains

SD_SCRIPTS_COMMON = {
    "ss_session_id", "ss_training_started_at", "ss_output_name", "ss_learning_rate", "ss_text_encoder_lr",
    "ss_unet_lr", "ss_num_train_images", "ss_num_validation_images", "ss_num_reg_images", "ss_num_batches_per_epoch",
    "ss_num_epochs", "ss_gradient_checkpointing", "ss_gradient_accumulation_steps", "ss_max_train_steps",
    "ss_lr_warmup_steps", "ss_lr_scheduler", "ss_network_module", "ss_network_dim", "ss_network_alpha",
    "ss_network_dropout", "ss_mixed_precision", "ss_full_fp16", "ss_v2", "ss_base_model_version", "ss_clip_skip",
    "ss_max_token_length", "ss_cache_latents", "ss_seed", "ss_lowram", "ss_noise_offset",
    "ss_multires_noise_iterations", "ss_multires_noise_discount", "ss_adaptive_noise_scale", "ss_zero_terminal_snr",
    "ss_training_comment", "ss_sd_scripts_commit_hash", "ss_optimizer", "ss_max_grad_norm",
    "ss_caption_dropout_rate", "ss_caption_dropout_every_n_epochs", "ss_caption_tag_dropout_rate",
    "ss_face_crop_aug_range", "ss_prior_loss_weight", "ss_min_snr_gamma", "ss_scale_weight_norms",
    "ss_ip_noise_gamma", "ss_debiased_estimation", "ss_noise_offset_random_strength",
    "ss_ip_noise_gamma_random_strength", "ss_loss_type", "ss_huber_schedule", "ss_huber_scale", "ss_huber_c",
    "ss_fp8_base", "ss_fp8_base_unet", "ss_validation_seed", "ss_validation_split", "ss_max_validation_steps",
    "ss_validate_every_n_epochs", "ss_validate_every_n_steps", "ss_resize_interpolation",
    "ss_sd_model_name", "ss_training_finished_at", "ss_steps", "ss_epoch"}
SD_SCRIPTS_FOLDER_RUN = {
    "ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution", "ss_color_aug", "ss_flip_aug",
    "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale", "ss_min_bucket_reso",
    "ss_max_bucket_reso", "ss_keep_tokens", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency",
    "ss_bucket_info"}
SD_SCRIPTS_DATASET_CONFIG_RUN = {"ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"}
MODEL_FILE = {"ss_sd_model_hash", "ss_new_sd_model_hash"}


def _model_file(root: Path) -> Path:
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.single_file import save_single_file

    return save_single_file(build_modules(get_family("tiny-sd15"), seed=0), root / "tiny-sd15.safetensors")


def test_a_folder_run_writes_every_key_sd_scripts_writes_with_its_value_forms(tmp_path):
    model = _model_file(tmp_path)
    _, out = trains(tmp_path, pretrained_model_name_or_path=str(model), shuffle_caption=True, keep_tokens=1,
                    prior_loss_weight=0.5)
    meta = metadata(out / "lora.safetensors")
    written = {key for key in meta if key.startswith("ss_")}
    assert SD_SCRIPTS_COMMON | SD_SCRIPTS_FOLDER_RUN | MODEL_FILE <= written, sorted(
        (SD_SCRIPTS_COMMON | SD_SCRIPTS_FOLDER_RUN | MODEL_FILE) - written)
    assert "ss_datasets" not in written and "ss_vae_name" not in written  # no dataset config, no vae given
    data = model.read_bytes()
    assert meta["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
    assert meta["ss_sd_model_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert meta["ss_sd_model_name"] == model.name
    # the forms: flags as str(bool), options as argparse holds them, the resolution as a tuple
    assert (meta["ss_shuffle_caption"], meta["ss_keep_tokens"], meta["ss_prior_loss_weight"]) == ("True", "1", "0.5")
    assert (meta["ss_flip_aug"], meta["ss_full_fp16"], meta["ss_lowram"]) == ("False", "False", "False")
    assert (meta["ss_loss_type"], meta["ss_huber_c"], meta["ss_face_crop_aug_range"]) == ("l2", "0.1", "None")
    assert meta["ss_resolution"] == "(64, 64)" and meta["ss_optimizer"] == "torch.optim.adamw.AdamW"
    assert json.loads(meta["ss_reg_dataset_dirs"]) == {} and json.loads(meta["ss_dataset_dirs"]) == {
        "2_toy": {"n_repeats": 2, "img_count": 2}}
    # without bucketing sd-scripts' dataset holds no bucket facts (bench/equivalence.py found ours writing them)
    assert (meta["ss_enable_bucket"], meta["ss_bucket_info"], meta["ss_min_bucket_reso"]) == ("False", "null", "None")
    assert meta["ss_network_alpha"] == "4"  # the TOML's integer, as sd-scripts' args keep it


def test_bucket_keys_and_network_values_as_sd_scripts_args_hold_them(tmp_path):
    _, out = trains(tmp_path, enable_bucket=True, min_bucket_reso=64, max_bucket_reso=128, bucket_reso_steps=64,
                    network_alpha=4.0, network_args=["conv_dim=4"], min_snr_gamma=5)
    meta = metadata(out / "lora.safetensors")
    assert json.loads(meta["ss_bucket_info"])["buckets"]["0"] == {"resolution": [64, 64], "count": 4}
    assert (meta["ss_min_bucket_reso"], meta["ss_max_bucket_reso"]) == ("64", "128")
    assert meta["ss_network_alpha"] == "4.0"  # a TOML float
    assert meta["ss_min_snr_gamma"] == "5"  # a TOML integer for a float option, kept as sd-scripts' args keep it
    assert json.loads(meta["ss_network_args"]) == {"conv_dim": "4", "dropout": None}  # sd-scripts adds dropout


def test_a_timestep_range_is_written_as_sd_scripts_model_spec_writes_it(tmp_path):
    """``modelspec.timestep_range`` when min_timestep or max_timestep is given (found by running sd-scripts with them:
    bench/equivalence.py's metadata comparison), the other end filled with 0 or 1000; absent otherwise."""
    for name in ("both", "low", "none"):
        (tmp_path / name).mkdir()
    _, out = trains(tmp_path / "both", min_timestep=100, max_timestep=900)
    assert metadata(out / "lora.safetensors")["modelspec.timestep_range"] == "100,900"
    _, out = trains(tmp_path / "low", min_timestep=100)
    assert metadata(out / "lora.safetensors")["modelspec.timestep_range"] == "100,1000"
    _, out = trains(tmp_path / "none")
    assert "modelspec.timestep_range" not in metadata(out / "lora.safetensors")


def test_a_dataset_config_run_writes_ss_datasets_instead_of_the_folder_keys(tmp_path):
    images = dataset(tmp_path) / "2_toy"
    toml_text = (f'[general]\nshuffle_caption = true\n[[datasets]]\nresolution = 64\nbatch_size = 1\n'
                 f'[[datasets.subsets]]\nimage_dir = "{images}"\nnum_repeats = 3\nkeep_tokens = 1\n'
                 f'class_tokens = "toy"\n')
    _, out = trains(tmp_path, train_data_dir=None,
                    dataset_config=str(text_file(tmp_path / "dataset.toml", toml_text)))
    meta = metadata(out / "lora.safetensors")
    written = {key for key in meta if key.startswith("ss_")}
    assert SD_SCRIPTS_COMMON | SD_SCRIPTS_DATASET_CONFIG_RUN <= written
    assert not (SD_SCRIPTS_FOLDER_RUN - SD_SCRIPTS_DATASET_CONFIG_RUN) & written  # sd-scripts writes neither
    assert "ss_sd_model_hash" not in written  # a built-in has no file to hash
    [record] = json.loads(meta["ss_datasets"])
    assert record["is_dreambooth"] is True and record["resolution"] == [64, 64] and record["num_train_images"] == 6
    [subset] = record["subsets"]
    assert subset["image_dir"] == "2_toy" and subset["num_repeats"] == 3 and subset["img_count"] == 2
    assert subset["shuffle_caption"] is True and subset["keep_tokens"] == 1 and subset["class_tokens"] == "toy"
    assert subset["is_reg"] is False and json.loads(meta["ss_dataset_dirs"]) == {
        "2_toy": {"n_repeats": 3, "img_count": 2}}


def test_the_key_table_in_the_module_lists_every_option_key():
    from sd_scripts_compat.network import kohya_keys

    doc = kohya_keys.__doc__ or ""
    assert all(f"| ``{key}`` | ``{option}`` | {form} |" in doc for key, option, form in kohya_keys.OPTION_KEYS)


FAMILY_REFERENCE = Path(__file__).parent / "fixtures" / "sd_scripts_family_metadata.json"
# the reference's family -> our entry point, its tiny twin, and the keys its options change from the reference's
FAMILY_RUNS = {
    "flux-dev": ("flux_train_network", {"pretrained_model_name_or_path": "builtin:tiny-flux"}, {}),
    "sd3.5-medium": ("sd3_train_network", {"pretrained_model_name_or_path": "builtin:tiny-sd3"}, {}),
    # the reference used default args; Chroma trains with apply_t5_attn_mask (sd-scripts asserts it) and guidance 0
    # (not guidance-distilled: our engine refuses sd-scripts' default 3.5 in one line)
    "chroma": ("flux_train_network", {"pretrained_model_name_or_path": "builtin:tiny-chroma", "model_type": "chroma",
                                      "apply_t5_attn_mask": True, "guidance_scale": 0.0},
               {"ss_apply_t5_attn_mask": "True", "ss_guidance_scale": "0.0"}),
}


@pytest.mark.long
def test_family_keys_and_modelspec_equal_what_sd_scripts_records_for_its_default_options(tmp_path):
    """The reference: each sd-scripts trainer's own ``update_metadata`` and ``get_sai_model_spec`` with default args
    (recorded by ``shared/reference/tools/dump_kohya_metadata.py``); ours: a run with the same options."""
    import subprocess
    import sys

    from test_hostile_inputs import ENV, config

    reference = json.loads(FAMILY_REFERENCE.read_text())
    volatile = {"modelspec.date", "modelspec.resolution", "modelspec.implementation_version"}
    for family, (script, options, changed) in FAMILY_RUNS.items():
        root = tmp_path / family
        done = subprocess.run([sys.executable, "-m", f"sd_scripts_compat.{script}", "--config_file",
                               str(config(root, t5xxl_max_token_length=16, network_train_unet_only=True,
                                          max_train_steps=1, output_name="my_lora", **options))],
                              cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        meta = metadata(root / "out" / "my_lora.safetensors")
        want = {**reference[family]["update_metadata_ss_keys"], **changed}
        assert {key: meta.get(key) for key in want} == want, family
        spec = reference[family]["modelspec"]
        assert {key for key in meta if key.startswith("modelspec.")} >= set(spec), family
        assert {k: meta[k] for k in spec if k not in volatile} == {k: v for k, v in spec.items() if k not in volatile}
        assert meta["modelspec.implementation_version"].startswith("lora-autotune/")
