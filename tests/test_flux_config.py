"""FLUX.1's options (flux_train_network): the option table, the reader's FLUX rules, the settings it resolves."""

from __future__ import annotations

import ast
import csv
from pathlib import Path

import pytest
import toml

from sd_scripts_compat.config.resolved_run import settings_from_files
from sd_scripts_compat.config.training_config import load_training_config
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.kohya_args import FLUX_ARGS_TSV, arg_specs, build_argparser

REPO = Path(__file__).resolve().parents[1]
REFERENCE_TSV = REPO.parent / "shared" / "reference" / "kohya" / "flux_train_network_args.tsv"
FLUX = "flux_train_network"


def load(tmp_path: Path, values: dict, *extra: str, script: str = FLUX):
    path = tmp_path / "config.toml"
    path.write_text(toml.dumps(values), encoding="utf-8")
    return load_training_config(["--config_file", str(path), *extra], script=script)


def error_of(tmp_path: Path, values: dict, *extra: str, script: str = FLUX) -> str:
    with pytest.raises(UserError) as caught:
        load(tmp_path, values, *extra, script=script)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.skipif(not REFERENCE_TSV.is_file(), reason="shared reference checkout not present")
def test_shipped_flux_table_is_the_reference_list_in_our_notation():
    kinds = {"flag": "store_true", "list[str]": "str[nargs=*]", "list[float]": "float[nargs=*]"}
    with REFERENCE_TSV.open(encoding="utf-8", newline="") as handle:
        reference = list(csv.DictReader(handle, delimiter="\t"))
    with FLUX_ARGS_TSV.open(encoding="utf-8", newline="") as handle:
        ours = list(csv.DictReader(handle, delimiter="\t"))
    assert [r["name"] for r in ours] == [r["name"] for r in reference]
    for mine, theirs in zip(ours, reference):
        assert mine["kind"] == kinds.get(theirs["kind"], theirs["kind"]) and mine["default"] == theirs["default"]
        choices = [str(c) for c in ast.literal_eval(theirs["choices"])] if theirs["choices"] else []
        assert (mine["choices"].split("|") if mine["choices"] else []) == choices, mine["name"]
        assert (mine["flux_only"] == "yes") == (theirs["flux_only"] == "True")


def test_each_script_takes_its_own_options():
    flux = arg_specs(script=FLUX)
    assert flux["discrete_flow_shift"].default == 3.0 and flux["guidance_scale"].default == 3.5
    assert flux["timestep_sampling"].choices == ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
    assert flux["model_prediction_type"].default == "sigma_scaled"
    assert "cache_text_encoder_outputs" in flux and "blocks_to_swap" not in arg_specs(sdxl=True)
    args = build_argparser(script=FLUX).parse_args(["--blocks_to_swap", "8", "--apply_t5_attn_mask"])
    assert args.blocks_to_swap == 8 and args.apply_t5_attn_mask is True
    with pytest.raises(UserError, match="blocks_to_swap"):
        build_argparser(sdxl=True).parse_args(["--blocks_to_swap", "8"])


def test_flux_values_are_read_and_checked(tmp_path):
    cfg = load(tmp_path, {"timestep_sampling": "shift", "discrete_flow_shift": 3.1582, "model_prediction_type": "raw",
                          "guidance_scale": 1.0, "blocks_to_swap": 12, "t5xxl_max_token_length": 256,
                          "network_train_unet_only": True, "cache_text_encoder_outputs_to_disk": True})
    assert cfg.script == FLUX and not cfg.sdxl
    assert (cfg.timestep_sampling, cfg.discrete_flow_shift, cfg.model_prediction_type) == ("shift", 3.1582, "raw")
    assert cfg.blocks_to_swap == 12 and cfg.t5xxl_max_token_length == 256 and cfg.cache_text_encoder_outputs
    assert load(tmp_path, {}).blocks_to_swap == 0  # kohya's None
    assert "not one of" in error_of(tmp_path, {"timestep_sampling": "logit"})
    assert "at most 35" in error_of(tmp_path, {"blocks_to_swap": 36})
    assert "at most 35" in error_of(tmp_path, {}, "--blocks_to_swap", "40")
    assert "must be above 0" in error_of(tmp_path, {"discrete_flow_shift": 0.0})


def test_chroma_is_one_line_and_split_mode_means_18_blocks(tmp_path):
    assert "model_type" in error_of(tmp_path, {"model_type": "chroma"})
    cfg = load(tmp_path, {"split_mode": True})
    assert cfg.blocks_to_swap == 18 and any("deprecated" in w for w in cfg.warnings)
    assert load(tmp_path, {"split_mode": True, "blocks_to_swap": 4}).blocks_to_swap == 4
    assert load(tmp_path, {"fp8_base_unet": True}).fp8_base  # sd-scripts: fp8_base_unet implies fp8_base for FLUX


def test_flux_options_are_errors_for_the_sd_scripts(tmp_path):
    said = error_of(tmp_path, {"guidance_scale": 1.0}, script="train_network")
    assert "only for FLUX.1 / Chroma (flux_train_network)" in said
    assert "only for FLUX.1" in error_of(tmp_path, {"blocks_to_swap": 4}, script="sdxl_train_network")
    cfg = load(tmp_path, {"guidance_scale": 3.5}, script="train_network")  # at its default: a warning
    assert any("ignored by train_network" in w for w in cfg.warnings)


def test_lora_scripts_sectioned_flux_config_is_accepted(tmp_path):
    """The shape lora-scripts' FLUX GUI writes: sections, its GUI keys, kohya's FLUX keys."""
    values = {
        "model_train_type": "flux-lora",
        "pretrained_model_name_or_path": "/models/flux1-dev.safetensors",
        "ae": "/models/ae.safetensors", "clip_l": "/models/clip_l.safetensors",
        "t5xxl": "/models/t5xxl_fp16.safetensors",
        "timestep_sampling": "sigmoid", "sigmoid_scale": 1.0, "model_prediction_type": "raw",
        "discrete_flow_shift": 1.0, "guidance_scale": 1.0, "loss_type": "l2", "resolution": "768,768",
        "network_module": "networks.lora_flux", "network_dim": 16, "network_alpha": 8, "network_train_unet_only": True,
        "cache_text_encoder_outputs": True, "cache_text_encoder_outputs_to_disk": True, "fp8_base": True,
        "mixed_precision": "bf16", "sdpa": True, "gradient_checkpointing": True, "optimizer_type": "AdamW8bit",
        "learning_rate": 1e-4, "lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 1,
        "max_train_epochs": 10, "save_every_n_epochs": 2, "output_name": "flux-lora", "seed": 1337,
    }
    path = tmp_path / "flux.toml"
    sections = {"model_arguments": {}, "training_arguments": {}}
    for i, (key, value) in enumerate(values.items()):
        sections["model_arguments" if i < 5 else "training_arguments"][key] = value
    path.write_text(toml.dumps(sections), encoding="utf-8")
    cfg = load_training_config(["--config_file", str(path)], script=FLUX)
    assert cfg.ae == "/models/ae.safetensors" and cfg.timestep_sampling == "sigmoid" and cfg.fp8_base
    assert cfg.network_module == "networks.lora_flux" and load(tmp_path, {}).network_module == "networks.lora_flux"
    assert "networks.lora_flux" in error_of(tmp_path, {"network_module": "networks.lora"})
    assert "networks.lora" in error_of(tmp_path, {"network_module": "networks.lora_flux"}, script="train_network")
    assert any("model_train_type" in w for w in cfg.warnings)


def test_settings_from_files_knows_the_flux_script(tmp_path):
    data = tmp_path / "data" / "1_dog"
    data.mkdir(parents=True)
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps({"train_data_dir": str(data.parent), "resolution": "512,512", "blocks_to_swap": 9}),
                      encoding="utf-8")
    run = settings_from_files(config, None, script=FLUX)
    assert run.settings.blocks_to_swap == 9 and run.config.script == FLUX
    assert "blocks_to_swap" in error_of(tmp_path, {"blocks_to_swap": 9}, script="sdxl_train_network")


def test_settings_from_files_knows_a_sharded_run(tmp_path):
    """A config (a plan's for several cards, or the user's) that shards the transformer within groups and splits
    the optimizer's state: the settings the watchdog starts from say so (they said neither, so its predictions were
    a data-parallel run's and its ladder offered what the run already did)."""
    data = tmp_path / "data" / "1_dog"
    data.mkdir(parents=True)
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps({"train_data_dir": str(data.parent), "resolution": "512,512", "fsdp": "hybrid_shard",
                                  "fsdp_shard_size": 2, "fsdp_offload_params": True, "shard_optimizer_state": True}),
                      encoding="utf-8")
    s = settings_from_files(config, None, script=FLUX).settings
    assert (s.fsdp, s.fsdp_shard_size, s.fsdp_offload_params, s.shard_optimizer_state) == ("hybrid_shard", 2, True,
                                                                                            True)


def test_a_local_t5_tokenizer_reaches_the_loader(tmp_path):
    """``--t5xxl_tokenizer`` (ours: sd-scripts downloads google/t5-v1_1-xxl's): parsed, and the engine's loader
    reads it, so a folder without a tokenizer.json is the loader's one-line error naming that folder."""
    from sd_scripts_compat.runtimes import load_base_model

    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    cfg = load(tmp_path, {"pretrained_model_name_or_path": "builtin:tiny-flux"}, "--t5xxl_tokenizer", str(empty))
    assert cfg.t5xxl_tokenizer == str(empty)
    with pytest.raises(UserError) as caught:
        load_base_model(cfg.pretrained_model_name_or_path, t5xxl_tokenizer=cfg.t5xxl_tokenizer)
    assert str(empty) in str(caught.value) and "\n" not in str(caught.value)
