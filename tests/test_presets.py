"""Presets in and out (issue 51 item 1): kohya_ss GUI presets (tests/fixtures/kohya_ss_presets: seven files of
bmaltais/kohya_ss' presets/lora at 45088f04, as they are) and sd-scripts TOMLs imported as the plan's options, then
planned; the config we write is compared key by key with what the GUI passes sd-scripts for the preset (the rules of
kohya_ss' lora_gui.train_model, written out per preset below); every key the plan does not take as given is listed
under ``planned`` or ``ignored``, none dropped. A plan exported as a GUI preset imports back to its own options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import toml

from autotune.launch.presets import LYCORIS_DEFAULTS, from_kohya_gui, from_sd_scripts
from autotune.ui.api import KOHYA_SS_PRESET, imported_preset, run_plan
from autotune.ui.schemas import command_schema

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "tests" / "fixtures" / "kohya_ss_presets"
DATASET = ROOT / "examples" / "dataset"
LOHA_ARGS = ("preset=full conv_dim=8 conv_alpha=4 use_tucker=False rank_dropout=0 bypass_mode=False dora_wd=False "
             "module_dropout=0 use_tucker=False use_scalar=False rank_dropout_scale=False algo=loha train_norm=False")
LOKR_ARGS = ("preset=full conv_dim=64 conv_alpha=64 use_tucker=False rank_dropout=0 bypass_mode=False dora_wd=False "
             "module_dropout=0 factor=-1 use_cp=False use_scalar=False decompose_both=False rank_dropout_scale=False "
             "algo=lokr train_norm=False")
# what the GUI passes sd-scripts for each preset, by lora_gui.train_model's rules: LoRA_type -> network_module and
# network_args (the LyCORIS types' full list), epoch -> the run's length (the GUI writes the steps those epochs take
# over the dataset; we write the epochs), lr_warmup percent -> lr_warmup_steps (0 here), lr_scheduler_num_cycles ""
# -> the epochs, values of 0 / "" left out
GUI_PASSES = {
    "loha-sd15.json": ("builtin:sd15", {
        "network_module": "lycoris.kohya", "network_args": LOHA_ARGS.split(), "network_dim": 32, "network_alpha": 16,
        "optimizer_type": "AdamW", "learning_rate": 0.0001, "train_batch_size": 1, "gradient_accumulation_steps": 4,
        "max_train_epochs": 2, "resolution": "512,512", "lr_scheduler": "cosine", "lr_warmup_steps": 0,
        "lr_scheduler_num_cycles": 2, "save_every_n_epochs": 1, "min_snr_gamma": 10, "clip_skip": 1}),
    "lokr-sd15.json": ("builtin:sd15", {
        "network_module": "lycoris.kohya", "network_args": LOKR_ARGS.split(), "network_dim": 64, "network_alpha": 64,
        "optimizer_type": "Prodigy", "learning_rate": 1.0, "train_batch_size": 1, "gradient_accumulation_steps": 4,
        "resolution": "512,512", "lr_scheduler": "cosine", "lr_warmup_steps": 0, "min_snr_gamma": 10,
        "clip_skip": 1}),
    "ia3-sd15.json": ("builtin:sd15", {  # iA3 is not ours: listed, and the rest trains a LoRA
        "network_dim": 64, "network_alpha": 64, "optimizer_type": "Prodigy", "learning_rate": 1.0,
        "train_batch_size": 1, "gradient_accumulation_steps": 1, "max_train_epochs": 4, "resolution": "512,512",
        "lr_scheduler": "cosine", "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 4, "save_every_n_epochs": 1,
        "min_snr_gamma": 10, "clip_skip": 1}),
    "sd15 - EDG_LoraOptiSettings.json": ("builtin:sd15", {
        "network_module": "networks.lora", "network_dim": 64, "network_alpha": 64, "optimizer_type": "AdamW8bit",
        "learning_rate": 0.0001, "train_batch_size": 3, "gradient_accumulation_steps": 1, "max_train_epochs": 1,
        "lr_scheduler": "constant", "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 1, "save_every_n_epochs": 1,
        "seed": 1234, "noise_offset": 0.05, "clip_skip": 2, "max_data_loader_n_workers": 1}),
    "SDXL - LoRA AI_Now prodigy v1.0.json": ("builtin:sdxl", {
        "network_module": "networks.lora", "network_dim": 32, "network_alpha": 16, "optimizer_type": "Prodigy",
        "learning_rate": 1.0, "train_batch_size": 8, "gradient_accumulation_steps": 1, "max_train_epochs": 160,
        "resolution": "1024,1024", "lr_scheduler": "constant", "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 1,
        "save_every_n_epochs": 10, "min_snr_gamma": 5, "clip_skip": 1}),
    "SDXL - LoRA adafactor v1.0.json": ("builtin:sdxl", {
        "network_module": "networks.lora", "network_dim": 128, "network_alpha": 128, "optimizer_type": "Adafactor",
        "learning_rate": 1.0, "train_batch_size": 5, "gradient_accumulation_steps": 1, "max_train_epochs": 30,
        "resolution": "1024,1024", "lr_scheduler": "adafactor", "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 1,
        "save_every_n_epochs": 5, "noise_offset": 0.0357, "clip_skip": 1}),
    "flux1D - adamw8bit fp8.json": ("builtin:flux-dev", {
        "network_module": "networks.lora_flux", "network_dim": 16, "network_alpha": 16, "optimizer_type": "AdamW8bit",
        "learning_rate": 0.0003, "train_batch_size": 1, "gradient_accumulation_steps": 1, "max_train_steps": 1000,
        "resolution": "512,512", "lr_scheduler": "constant", "lr_warmup_steps": 0, "lr_scheduler_num_cycles": 1,
        "max_grad_norm": 1, "save_every_n_epochs": 1, "save_every_n_steps": 50, "seed": 42, "noise_offset": 0.05,
        "min_snr_gamma": 7, "clip_skip": 1, "sample_sampler": "euler",
        "output_name": "Flux.my-super-duper-model-name-goes-here-v1.0"}),
}


def lycoris_args(args: list[str]) -> dict[str, str]:
    """network_args as lycoris-lora reads them, its defaults left out (the same network either way)."""
    out = {}
    for arg in args:
        key, value = arg.split("=", 1)
        default = LYCORIS_DEFAULTS.get(key)
        if default is not None and str(default) == value:
            continue
        out[key] = value
    return out


def planned_config(values: dict, model: str) -> tuple[dict, dict]:
    """Our plan of the imported values (on an H100, where every pinned split fits): config.toml and the files."""
    schema = command_schema("plan")
    args = schema.namespace({**values, "dataset": str(DATASET), "model": model, "gpu": ["H100 SXM"]})
    planned = run_plan(args)
    return toml.loads(planned["configs"]["config.toml"]), planned["configs"]


@pytest.mark.parametrize("name", sorted(GUI_PASSES))
def test_a_kohya_ss_gui_preset_plans_to_the_settings_the_gui_passes(name):
    preset = json.loads((PRESETS / name).read_text(encoding="utf-8"))
    imported = imported_preset({"format": "kohya_ss", "text": (PRESETS / name).read_text()}, command_schema("plan"))
    buckets = [set(imported[b]) for b in ("applied", "planned", "ignored")] + [set(imported["unset"])]
    assert set().union(*buckets) == set(preset), set(preset) - set().union(*buckets)  # every key accounted for
    assert sum(len(b) for b in buckets) == len(preset)  # and once
    model, gui = GUI_PASSES[name]
    config, _ = planned_config(imported["values"], model)
    for key, value in gui.items():
        if key == "network_args":
            assert lycoris_args(config.get(key, [])) == lycoris_args(value), (key, config.get(key))
        else:
            assert config.get(key) == value, (key, config.get(key), value)
    if name == "ia3-sd15.json":
        assert "LyCORIS/iA3" in imported["ignored"]["LoRA_type"] and config["network_module"] == "networks.lora"
    # what the plan decides for the card is listed with the preset's value (the attention, precision, caching)
    assert {"mixed_precision", "xformers"} <= set(imported["planned"]), imported["planned"]


def test_what_cannot_be_honoured_is_listed_with_its_reason():
    flux = imported_preset({"format": "kohya_ss", "text": (PRESETS / "flux1D - adamw8bit fp8.json").read_text()},
                           command_schema("plan"))
    assert "prompt text" in flux["ignored"]["sample_prompts"] and "beside" in flux["ignored"]["t5xxl"]
    assert flux["planned"]["fp8_base"] is True and flux["planned"]["timestep_sampling"] == "sigmoid"
    edg = from_kohya_gui(json.loads((PRESETS / "sd15 - EDG_LoraOptiSettings.json").read_text()))
    assert "512,650: plans train square buckets" in edg.ignored["max_resolution"]
    loha = from_kohya_gui(json.loads((PRESETS / "loha-sd15.json").read_text()))
    assert "multires_noise_iterations" in loha.ignored and "use_cp" in loha.ignored  # the GUI's LoKr-only field
    # a value the plan refuses leaves the options with the plan's own line
    odd = imported_preset({"format": "kohya_ss", "text": json.dumps({"network_dim": -3, "seed": "7"})},
                          command_schema("plan"))
    assert odd["values"] == {"seed": 7, "network": "lora", "lr_warmup_steps": 0}
    assert odd["ignored"]["network_dim"].startswith("rank: "), odd


def test_a_sd_scripts_toml_imports_flat_or_sectioned():
    flat = {"network_module": "lycoris.kohya", "network_args": ["algo=lokr", "factor=8"], "network_dim": 16,
            "network_alpha": 8.0, "optimizer_type": "adamw8bit", "learning_rate": 2e-4, "resolution": "768,768",
            "lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 3, "max_train_steps": 900,
            "sample_prompts": "/data/prompts.txt", "sample_every_n_steps": 100, "mixed_precision": "fp16",
            "huber_c": 0.3, "prior_loss_weight": 1.0, "caption_dropout_rate": 0}
    imported = from_sd_scripts(flat)
    assert imported.values == {"network": "lokr", "network_arg": ["factor=8"], "rank": 16, "alpha": 8,
                               "optimizer": "AdamW8bit", "lr": 0.0002, "resolution": 768,
                               "lr_scheduler": "cosine_with_restarts", "lr_scheduler_num_cycles": 3, "steps": 900,
                               "sample_prompts": "/data/prompts.txt", "sample_every_n_steps": 100}
    assert imported.planned == {"mixed_precision": "fp16"} and "huber_c" in imported.ignored
    assert imported.applied["prior_loss_weight"] == "sd-scripts' default"  # what the plan leaves it at
    assert imported.unset == ["caption_dropout_rate"]
    sectioned = {"additional_network_arguments": {k: flat[k] for k in ("network_module", "network_args",
                                                                      "network_dim", "network_alpha")},
                 "optimizer_arguments": {"optimizer_type": "adamw8bit", "learning_rate": 2e-4}}
    assert from_sd_scripts(sectioned).values == {"network": "lokr", "network_arg": ["factor=8"], "rank": 16,
                                                 "alpha": 8, "optimizer": "AdamW8bit", "lr": 0.0002}


def test_a_plan_exported_as_a_gui_preset_imports_back_to_its_options():
    """The page's kohya_ss_gui.json of a plan (LoKr with a factor, a pinned rank, scheduler and warm-up share) is
    a preset the GUI loads: imported again, it gives the same options."""
    pins = {"network": "lokr", "network_arg": ["factor=4"], "rank": 8, "alpha": 4, "optimizer": "AdamW",
            "lr": 0.0002, "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 0.1, "epochs": 3,
            "resolution": 512, "seed": 5}
    config, files = planned_config(pins, "builtin:sd15")
    exported = json.loads(files[KOHYA_SS_PRESET])
    assert exported["LoRA_type"] == "LyCORIS/LoKr" and exported["factor"] == 4 and exported["lr_warmup"] == 10
    assert exported["epoch"] == 3 and exported["max_resolution"] == "512,512" and exported["sdxl"] is False
    back = imported_preset({"format": "kohya_ss", "text": json.dumps(exported)}, command_schema("plan"))["values"]
    for key, value in pins.items():
        assert back[key] == value, (key, back.get(key), value)
    assert config["network_args"] == ["algo=lokr", "factor=4"] or "factor=4" in config["network_args"]
