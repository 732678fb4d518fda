"""The one dataset scan (sd_scripts_compat.facts.dataset_scan) and everything that reads a dataset through it:
the engine's folder convention, `autotune plan`'s summary and `autotune run`'s check. Real folders and files."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from autotune.cli import main as autotune_main
from autotune.launch.run import check_dataset, check_folder_convention
from autotune.planning.planner import scan_dataset
from sd_scripts_compat.config.dataset_config import folder_subsets
from sd_scripts_compat.facts.dataset_scan import (
    CAPTION_EXTENSIONS,
    IMAGE_EXTENSIONS,
    FolderListing,
    parse_repeat_folder,
    require_images,
    scan_dataset_folder,
)
from sd_scripts_compat.facts.errors import UserError


def touch(folder: Path, *names: str) -> None:
    """Empty files are enough: the scan lists and stats, it never decodes an image."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")


def test_parse_repeat_folder_is_kohyas_rule():
    assert parse_repeat_folder("10_sks dog") == (10, "sks dog")
    assert parse_repeat_folder("3_sks_cat") == (3, "sks_cat")  # only the first "_" splits
    assert parse_repeat_folder("10") == (10, "")
    assert parse_repeat_folder("0_off") == (0, "off")  # returned as is; callers skip counts below 1
    assert parse_repeat_folder("notes") is None
    assert parse_repeat_folder("x10_a") is None


def test_one_extension_list_in_any_case(tmp_path):
    assert IMAGE_EXTENSIONS == (".png", ".jpg", ".jpeg", ".webp", ".bmp")
    touch(tmp_path, "a.PNG", "b.webp", "c.bmp", "d.jpeg", "e.JPG", "f.gif", "g.txt", "h.png.txt")
    (tmp_path / "dir.png").mkdir()
    assert [p.name for p in FolderListing.read(tmp_path).images()] == ["a.PNG", "b.webp", "c.bmp", "d.jpeg", "e.JPG"]


def test_n_name_subfolders_repeats_tokens_and_captions(tmp_path):
    touch(tmp_path / "10_my char", "a.png", "a.txt", "b.jpg", "b.caption", "c.webp", "notes.md")
    touch(tmp_path / "2_style", "x.png", "x.txt", "x.caption")
    scan = scan_dataset_folder(tmp_path)
    assert not scan.top_level and scan.root == tmp_path.resolve()
    first, second = scan.subsets
    assert (first.folder.name, first.num_repeats, first.class_tokens) == ("10_my char", 10, "my char")
    assert [p.name for p in first.images] == ["a.png", "b.jpg", "c.webp"]
    assert tuple(first.caption_files) == CAPTION_EXTENSIONS
    assert [p.name for p in first.caption_files[".txt"]] == ["a.txt"]
    assert [p.name for p in first.caption_files[".caption"]] == ["b.caption"]
    assert first.caption_extensions() == [".txt", ".caption", None]
    assert second.caption_extensions() == [".txt"]  # the first extension wins when both exist
    assert scan.num_images == 4 and scan.views_per_epoch == 3 * 10 + 1 * 2
    assert scan.warnings == ()


def test_skipped_folders_are_warnings_that_say_why(tmp_path):
    touch(tmp_path / "5_ok", "a.png")
    touch(tmp_path / "notes", "x.jpg")
    touch(tmp_path / "0_off", "y.png")
    (tmp_path / "3_empty").mkdir()
    touch(tmp_path / ".cache", "z.png")  # hidden: passed over silently
    touch(tmp_path, "top.png")
    scan = scan_dataset_folder(tmp_path)
    assert [s.folder.name for s in scan.subsets] == ["5_ok"]
    text = " | ".join(scan.warnings)
    assert "notes/ skipped: not named N_name" in text
    assert "0_off/ skipped: 0 repeats means its images are seen 0 times" in text
    assert "0_off/ holds no images" not in text  # it holds one: the repeat count is why it is skipped
    assert "3_empty/ holds no images" in text
    assert "1 image(s) directly in" in text and "not used" in text
    assert ".cache" not in text
    assert len(scan.warnings) == 4


def test_top_level_images_are_one_subset_with_one_repeat(tmp_path):
    touch(tmp_path, "a.png", "a.txt", "b.JPEG")
    touch(tmp_path / "misc", "readme.md")
    scan = scan_dataset_folder(tmp_path)
    assert scan.top_level
    (subset,) = scan.subsets
    assert subset.folder == tmp_path.resolve() and subset.num_repeats == 1 and subset.class_tokens is None
    assert [p.name for p in subset.images] == ["a.png", "b.JPEG"]


def test_a_zero_repeat_folder_is_still_an_n_name_folder(tmp_path):
    """With N_name subfolders, top-level images are not read, even when every subfolder is skipped."""
    touch(tmp_path / "0_off", "a.png")
    touch(tmp_path, "top.png")
    scan = scan_dataset_folder(tmp_path)
    assert not scan.top_level and scan.subsets == ()
    with pytest.raises(UserError, match="holds no images in N_name subfolders") as info:
        require_images(scan)
    assert "0 repeats" in str(info.value) and "\n" not in str(info.value)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(UserError, match="not found"):
        scan_dataset_folder(tmp_path / "missing")
    empty = scan_dataset_folder(tmp_path)
    assert empty.subsets == () and empty.warnings == ()
    with pytest.raises(UserError, match="holds no images"):
        require_images(empty)


def test_engine_folder_convention_agrees_with_the_scan(tmp_path, caplog):
    touch(tmp_path / "10_sks dog", "a.png")
    touch(tmp_path / "3_sks_cat", "b.png")
    touch(tmp_path / "notes", "c.png")
    touch(tmp_path / "0_off", "d.png")
    with caplog.at_level(logging.WARNING, logger="sd_scripts_compat.config.dataset_config"):
        engine = folder_subsets(tmp_path, is_reg=False, option="train_data_dir")
    scan = scan_dataset_folder(tmp_path)
    assert [(Path(s["image_dir"]).name, s["num_repeats"], s["class_tokens"]) for s in engine] == [
        (s.folder.name, s.num_repeats, s.class_tokens) for s in scan.subsets]
    skipped = " ".join(r.getMessage() for r in caplog.records)
    assert "'notes'" in skipped and "'0_off'" in skipped


def test_plan_and_run_accept_the_same_folders(tmp_path):
    """scan_dataset (plan) and check_dataset (run) take the same rule: N_name folders, or top-level images."""
    nested = tmp_path / "nested"
    touch(nested / "4_a", "1.png", "1.txt", "2.png")
    flat = tmp_path / "flat"
    touch(flat, "1.png", "2.webp")
    for root in (nested, flat):
        summary, scan = scan_dataset(root), check_dataset(root)
        assert [(s.image_dir, s.num_repeats, s.num_images) for s in summary.subsets] == [
            (str(s.folder), s.num_repeats, s.num_images) for s in scan.subsets]
    assert scan_dataset(nested).subsets[0].num_captions == 1
    assert scan_dataset(flat).subsets[0].num_repeats == 1 and check_dataset(flat).top_level
    (tmp_path / "empty" / "5_x").mkdir(parents=True)
    for check in (scan_dataset, check_dataset):
        with pytest.raises(UserError, match="holds no images"):
            check(tmp_path / "empty")


def test_run_with_config_needs_n_name_folders(tmp_path, capsys):
    """`autotune run --config` without --dataset-config trains on train_data_dir: top-level images are an error
    there, named in one line before anything is written; a dataset.toml (--dataset-config) lifts it."""
    flat = tmp_path / "flat"
    touch(flat, "1.png")
    args = argparse.Namespace(config="my.toml", dataset_config=None, resume=False)
    with pytest.raises(UserError, match="N_name subfolders") as info:
        check_folder_convention(args, check_dataset(flat))
    assert "--dataset-config" in str(info.value)
    check_folder_convention(argparse.Namespace(config="my.toml", dataset_config="d.toml", resume=False),
                            check_dataset(flat))
    check_folder_convention(argparse.Namespace(config=None, dataset_config=None, resume=False), check_dataset(flat))
    config = tmp_path / "my.toml"
    config.write_text("max_train_steps = 1\n", encoding="utf-8")
    code = autotune_main(["run", str(flat), "--model", "builtin:tiny-sd15", "--config", str(config),
                          "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "train_data_dir" in err
    assert not (tmp_path / "out").exists()
