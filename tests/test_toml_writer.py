"""config.toml / dataset.toml: kohya names and types only, both layouts, accepted by our strict reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import toml

from autotune.hardware.gpu_catalog import lookup_gpu
from autotune.planning.planner import PlanRequest, Preferences, gpu_from_spec, gpu_from_vram, plan_training
from autotune.planning.toml_writer import SECTIONS, encode_value, render_config, write_plan_files
from sd_scripts_compat.config.dataset_config import read_dataset_config
from sd_scripts_compat.config.resolved_run import settings_from_files
from sd_scripts_compat.config.training_config import dataset_group_from_config, load_training_config
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.facts.kohya_args import arg_specs

LORA_SCRIPTS_SECTIONS = {name for name, _ in SECTIONS} | {"others"}


def make_dataset(root: Path) -> Path:
    for folder, count in (("10_sks dog", 4), ("5_style", 3)):
        (root / folder).mkdir(parents=True)
        for i in range(count):
            (root / folder / f"{i}.jpg").write_bytes(b"")
            (root / folder / f"{i}.txt").write_text("sks dog, grass", encoding="utf-8")
    return root


def check_kohya_types(values: dict, sdxl: bool) -> None:
    """Every key is a kohya option of this entry point and holds the type sd-scripts' argparse would."""
    specs = arg_specs(sdxl=sdxl)
    for key, value in values.items():
        assert key in specs, f"{key} is not an sd-scripts option"
        kind = specs[key].kind
        if kind == "store_true":
            assert isinstance(value, bool), key
        elif kind == "int":
            assert isinstance(value, int) and not isinstance(value, bool), key
        elif kind == "float":
            assert isinstance(value, float), key
        elif kind == "int_or_float":
            assert isinstance(value, (int, float)) and not isinstance(value, bool), key
        elif kind in ("str", "Path"):
            assert isinstance(value, str), key
        elif kind == "str[nargs=*]":
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), key
        elif kind == "float[nargs=*]":
            assert isinstance(value, list) and all(isinstance(v, float) for v in value), key
        if specs[key].choices is not None:
            assert value in specs[key].choices, key
    assert re.fullmatch(r"\d+,\d+", values["resolution"])
    for key in ("network_args", "optimizer_args"):
        for item in values.get(key, []):
            assert re.fullmatch(r"[a-z_0-9]+=[^=]+", item), item


CASES = [("sd15", "GTX 1080", "character", Preferences()), ("sd2-v", "RTX 3060", "style", Preferences()),
         ("sdxl", "RTX 4090", "concept", Preferences(optimizer="Prodigy")), ("sdxl", "RTX 3060", "character",
                                                                           Preferences(train_text_encoder=True))]


@pytest.mark.parametrize("family,gpu,goal,prefs", CASES)
@pytest.mark.parametrize("fmt", ["kohya", "lora-scripts"])
def test_written_configs_are_kohya_and_pass_the_strict_reader(tmp_path, family, gpu, goal, prefs, fmt):
    dataset = make_dataset(tmp_path / "data")
    out = tmp_path / "out"
    plan = plan_training(PlanRequest(dataset_dir=str(dataset), model=f"builtin:{family}", goal=goal,
                                     gpus=(gpu_from_spec(lookup_gpu(gpu)),), preferences=prefs,
                                     cpu_physical_cores=6, output_dir=str(out)))
    assert plan.fits, plan.message
    config_path, dataset_path = write_plan_files(plan, out, fmt)
    sdxl = get_family(family).is_sdxl
    parsed = toml.load(config_path)
    if fmt == "lora-scripts":
        assert set(parsed) <= LORA_SCRIPTS_SECTIONS and all(isinstance(v, dict) for v in parsed.values())
        flat = {k: v for section in parsed.values() for k, v in section.items()}
    else:
        assert not any(isinstance(v, dict) for v in parsed.values())
        flat = parsed
    assert flat == plan.kohya_values()
    check_kohya_types(flat, sdxl)

    # the strong check: our engine's strict reader takes both files without a warning
    cfg = load_training_config(["--config_file", str(config_path)], sdxl=sdxl)
    assert cfg.warnings == ()
    assert cfg.train_batch_size == plan.settings.train_batch_size
    assert cfg.gradient_checkpointing == plan.settings.gradient_checkpointing
    assert cfg.dataset_config == str(dataset_path)
    group = dataset_group_from_config(cfg)
    (ds,) = group.datasets
    assert ds.resolution == plan.settings.resolution and ds.batch_size == plan.settings.train_batch_size
    # the settings the engine resolves from the written files are the planned ones, field for field
    assert settings_from_files(config_path, dataset_path, sdxl=sdxl).settings == plan.settings
    assert sorted((Path(s.image_dir).name, s.num_repeats) for s in ds.subsets) == [("10_sks dog", 10), ("5_style", 5)]
    read_dataset_config(dataset_path)


def test_every_key_carries_its_reason_and_the_header_the_prediction(tmp_path):
    plan = plan_training(PlanRequest(dataset_dir=str(make_dataset(tmp_path / "d")), model="builtin:sdxl",
                                     gpus=(gpu_from_spec(lookup_gpu("RTX 3060")),), probe_summary="probe line"))
    text = render_config(plan, "kohya")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " = " in line and not line.startswith("#"):
            assert lines[i - 1].startswith("# ") and len(lines[i - 1]) > 5, line
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert f"lora-autotune {plan.version}" in header and "probe: probe line" in header
    assert f"{plan.prediction.peak_bytes / 2**30:.2f} GiB" in header
    assert "it/s" in header and "optimizer steps in" in header
    assert "accelerate launch" in header


def test_output_is_byte_identical_for_the_same_inputs(tmp_path):
    dataset = make_dataset(tmp_path / "d")
    texts = []
    for _ in range(2):
        request = PlanRequest(dataset_dir=str(dataset), model="builtin:sd15", gpus=(gpu_from_vram(8),),
                              output_dir=str(tmp_path / "out"))
        paths = write_plan_files(plan_training(request), tmp_path / "out", "lora-scripts")
        texts.append([p.read_bytes() for p in paths])
    assert texts[0] == texts[1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [  # and no temp files
        "autotune_plan.json", "config.toml", "dataset.toml"]


def test_unwritable_out_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    plan = plan_training(PlanRequest(dataset_dir=str(make_dataset(tmp_path / "d")), model="builtin:sd15",
                                     gpus=(gpu_from_vram(8),)))
    with pytest.raises(UserError, match="--out") as info:
        write_plan_files(plan, blocker / "sub", "kohya")
    assert "\n" not in str(info.value)


def test_encode_value_refuses_what_toml_0_5_cannot_hold():
    assert encode_value([1.0, 2.5]) == "[1.0, 2.5]"
    tricky = 'a "quoted" \\ path'
    assert toml.loads("x = " + encode_value(tricky))["x"] == tricky
    with pytest.raises(ValueError, match="mixed-type"):
        encode_value(["a", 1])
    with pytest.raises(ValueError):
        encode_value(float("nan"))


def test_a_plan_that_does_not_fit_writes_nothing(tmp_path):
    plan = plan_training(PlanRequest(dataset_dir=str(make_dataset(tmp_path / "d")), model="builtin:sdxl",
                                     gpus=(gpu_from_vram(1.5),)))
    with pytest.raises(UserError, match="nothing fits"):
        write_plan_files(plan, tmp_path / "out", "kohya")
    assert not (tmp_path / "out").exists()
