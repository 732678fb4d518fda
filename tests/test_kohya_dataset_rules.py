"""Datasets read as sd-scripts reads them, and told when that differs from what the user probably meant:
hidden and macOS ``._`` files, a UTF-8 BOM, blank captions, caption extensions that match no file, ``N_name``
folders given directly, range-checked ``dataset.toml`` numbers, and ``doctor`` / ``run`` reading ``--config``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import toml
from PIL import Image

from sd_scripts_compat.config.dataset_config import folder_dataset_group, load_dataset_config
from sd_scripts_compat.dataset.captions import read_caption
from sd_scripts_compat.dataset.train_dataset import build_dataset
from sd_scripts_compat.facts.dataset_scan import caption_coverage, scan_dataset_folder
from sd_scripts_compat.facts.dataset_spec import DatasetSpec, SubsetSpec
from sd_scripts_compat.facts.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def images(folder: Path, count: int = 3, caption: str | None = ".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(folder / f"img{i}.png")
        if caption:
            (folder / f"img{i}{caption}").write_text(f"tag{i}, a toy", encoding="utf-8")
    return folder


def autotune(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "240"}
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def build(subset: SubsetSpec) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = build_dataset(DatasetSpec(subsets=(subset,), resolution=(64, 64)), seed=1)
    return dataset, [str(w.message) for w in caught]


def test_hidden_and_macos_resource_files_are_skipped_and_counted(tmp_path):
    folder = images(tmp_path / "data" / "2_toy")
    (folder / "._img0.png").write_bytes(b"\x00\x05\x16\x07 macOS resource fork")  # not an image at all
    Image.new("RGB", (64, 64)).save(folder / ".thumb.png")
    scan = scan_dataset_folder(tmp_path / "data")
    assert [p.name for p in scan.subsets[0].images] == ["img0.png", "img1.png", "img2.png"]
    assert any("2 hidden image file(s) skipped" in w for w in scan.warnings)
    dataset, _ = build(SubsetSpec(image_dir=str(folder), caption_extension=".txt"))
    assert dataset.num_train_images == 3  # before: "cannot identify image" stopped the run at ._img0.png


def test_bom_is_stripped_and_blank_captions_are_said(tmp_path):
    folder = images(tmp_path / "1_toy")
    (folder / "img0.txt").write_bytes("\ufefftag0, a toy".encode())
    (folder / "img1.txt").write_text("   \n", encoding="utf-8")
    assert read_caption(folder / "img0.png", ".txt") == "tag0, a toy"
    dataset, said = build(SubsetSpec(image_dir=str(folder), caption_extension=".txt"))
    assert "tag0" in dataset.tag_frequencies["1_toy"] and "\ufefftag0" not in dataset.tag_frequencies["1_toy"]
    assert any("1 caption file(s)" in message and "blank" in message for message in said)


@pytest.mark.parametrize(("written", "read_as", "normalized"), [
    (".txt", "txt", ".txt"),  # sd-scripts adds the dot: it reads the captions
    (".TXT", ".txt", ".txt"),  # file names are case-sensitive: nothing is read, and we say so
    (".txt", ".caption", ".caption"),  # sd-scripts' default beside lora-scripts' .txt files
])
def test_a_caption_extension_that_matches_no_file_is_said(tmp_path, written, read_as, normalized):
    folder = images(tmp_path / "1_toy", caption=written)
    subset = SubsetSpec(image_dir=str(folder), caption_extension=read_as)
    assert subset.caption_extension == normalized
    coverage = caption_coverage(sorted(folder.glob("*.png")), subset.caption_extension)
    _, said = build(subset)
    if written == normalized:
        assert coverage.line() == "3 of 3 images captioned (.txt)" and coverage.problem() is None
        assert not any("not read" in message for message in said)
    else:
        assert coverage.line() == f"0 of 3 images captioned ({normalized})"
        assert any(f"a {written} one beside them, which is not read" in message for message in said), said


def test_doctor_plan_and_run_say_captions_under_another_extension(tmp_path):
    data = tmp_path / "data"
    images(data / "1_toy", caption=".TXT")
    config = tmp_path / "config.toml"
    config.write_text('caption_extension = ".txt"\nresolution = "64,64"\ntrain_batch_size = 2\n')
    doctor = autotune("doctor", str(data), "--model", "builtin:tiny-sd15", "--config", str(config))
    assert doctor.returncode == 0, doctor.stderr
    assert "0 of 3 images captioned (.txt)" in doctor.stdout and "caption_extension" in doctor.stdout
    assert "at batch 2, 64 px" in doctor.stdout  # the config's batch and resolution, not the defaults
    plan = autotune("plan", str(data), "--model", "builtin:tiny-sd15")
    assert plan.returncode == 0, plan.stderr
    assert "0 of 3 images captioned (.txt)" in plan.stdout and "a .TXT one beside them" in plan.stdout


def test_an_n_name_folder_given_directly_keeps_its_repeats_and_tokens(tmp_path):
    folder = images(tmp_path / "10_sks dog")
    scan = scan_dataset_folder(folder)
    assert scan.top_level and scan.subsets[0].num_repeats == 10 and scan.subsets[0].class_tokens == "sks dog"
    with pytest.raises(UserError, match=f"is itself an N_name folder.*give its parent '{tmp_path}'"):
        folder_dataset_group(folder, None, {}, default_resolution=(64, 64))
    config = tmp_path / "config.toml"
    config.write_text('resolution = "64,64"\n')
    done = autotune("run", str(folder), "--model", "builtin:tiny-sd15", "--config", str(config),
                    "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert f"pass its parent {tmp_path}" in done.stderr


@pytest.mark.parametrize(("key", "value", "said"), [
    ("batch_size", 0, "batch_size in [[datasets]] #1: must be 1 or more, got 0"),
    ("keep_tokens", -1, "keep_tokens in [[datasets]] #1: must be 0 or more, got -1"),
    ("caption_dropout_rate", 5.0, "caption_dropout_rate in [[datasets]] #1: a rate must be between 0 and 1"),
    ("num_repeats", 0, "num_repeats in [[datasets]] #1: must be 1 or more"),
])
def test_dataset_toml_numbers_are_range_checked_like_the_command_line(tmp_path, key, value, said):
    path = tmp_path / "dataset.toml"
    path.write_text(toml.dumps({"datasets": [{key: value, "subsets": [{"image_dir": str(tmp_path)}]}]}))
    with pytest.raises(UserError) as error:
        load_dataset_config(path, default_resolution=(64, 64))
    assert str(error.value) == f"{path}: {said}" or said in str(error.value)
    assert str(path) in str(error.value)
