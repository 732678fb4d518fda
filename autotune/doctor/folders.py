"""Folder-level problems: what the engine's one dataset scan skipped (its warnings, named by folder), files in
an image format the engine does not read, and a dataset with nothing to train on.

The folder rules are the scan's (``sd_scripts_compat.facts.dataset_scan``); this module only turns what the scan
says into problems, classifying skipped folders with the scan's own ``parse_repeat_folder``.
"""

from __future__ import annotations

import os
from pathlib import Path

from autotune.doctor.report import ERROR, WARNING, Problem, rel_name
from sd_scripts_compat.facts.dataset_scan import (
    IMAGE_EXTENSIONS,
    MIN_REPEATS,
    DatasetScan,
    SubsetScan,
    parse_repeat_folder,
)

# image formats people drop into datasets that the engine's scan does not list (it reads IMAGE_EXTENSIONS)
UNSUPPORTED_IMAGE_EXTENSIONS = (".gif", ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl", ".jfif", ".jp2",
                                ".ico", ".psd", ".svg", ".exr", ".dng", ".raw", ".cr2", ".nef")
SUPPORTED = ", ".join(IMAGE_EXTENSIONS)


def scan_problems(scan: DatasetScan) -> list[Problem]:
    """One warning per scan warning, naming the folder it is about; an error when nothing is left to train."""
    folders = sorted((scan.root / name for name in scan.listing.folders if not name.startswith(".")),
                     key=lambda p: -len(p.name))  # longest first: "10_a b/" must not match a folder "10_a"
    problems = []
    for warning in scan.warnings:
        folder = next((p for p in folders if warning.startswith(f"{p.name}/ ")), None)
        if folder is None:  # images directly in the folder, beside N_name subfolders
            problems.append(Problem(WARNING, "top-level-ignored", ".", warning,
                                    "move them into an N_name subfolder (e.g. 10_mychar/) or delete them"))
            continue
        problems.append(Problem(WARNING, "folder-skipped", folder.name, warning.removeprefix(f"{folder.name}/ "),
                                _folder_fix(folder.name)))
    if not scan.subsets:
        problems.append(Problem(ERROR, "no-images", ".", "no images to train on (in N_name subfolders or directly "
                                "in the folder)", f"put images ({SUPPORTED}) in e.g. {scan.root.name}/10_mychar/"))
    return problems


def _folder_fix(name: str) -> str:
    parsed = parse_repeat_folder(name)
    if parsed is None:
        return f"rename it N_{name} (N = repeats per epoch, e.g. 10_{name}) if its images should train"
    repeats, tokens = parsed
    if repeats < MIN_REPEATS:
        return f"rename it with 1 or more repeats (e.g. 1_{tokens or 'name'})"
    return f"add images ({SUPPORTED}) or delete the folder"


def unsupported_files(subset: SubsetScan, root: Path) -> list[Problem]:
    """Image files the scan passes over because of their format: they silently never train."""
    return [Problem(WARNING, "unsupported-format", rel_name(subset.folder / name, root),
                    f"{suffix} is not a format the engine reads ({SUPPORTED}); the file is skipped",
                    "convert it to PNG (or JPEG) if it should train, or move it out of the dataset")
            for name in sorted(subset.listing.files)
            if (suffix := os.path.splitext(name)[1].lower()) in UNSUPPORTED_IMAGE_EXTENSIONS]
