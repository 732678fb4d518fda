"""Turn a flat folder of images into kohya's ``<repeats>_<trigger>`` layout, without touching the user's files.

kohya's ``train_data_dir`` (and ``autotune run``) read images from ``N_name`` subfolders: N repeats per
epoch, ``name`` the class tokens that stand in for a missing caption. Many users hold a plain folder of
images instead. ``FlatLayout`` describes the new folder (planned without writing anything, so the plan can
be made from it and Ctrl-C before the end leaves no trace); ``create`` builds it at the end, in a hidden
temporary folder that is renamed into place, so it exists whole or not at all. Images and their caption
files are copied or symbolically linked; the originals are never moved or changed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.dataset_scan import CAPTION_EXTENSIONS, IMAGE_EXTENSIONS, FolderListing
from sd_scripts_compat.facts.errors import UserError

if TYPE_CHECKING:
    from autotune.planning.dataset import DatasetSummary

MODES = ("link", "copy")


def safe_name(text: str) -> str:
    """A folder-name-safe trigger word: letters, digits, ``-``, ``_`` and spaces kept (kohya splits on ``_``
    only once, so the class tokens may hold spaces)."""
    kept = "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in text.strip())
    return " ".join(kept.split()) or "subject"


def trigger_problem(text: str) -> str | None:
    """What is wrong with a trigger word the user typed (it names the folder, so it is kept as typed or refused,
    never changed without a word), or None."""
    if not text.strip():
        return "type a word, e.g. sks"
    if safe_name(text) != " ".join(text.split()):
        return (f"{text!r}: a trigger word names the folder: letters, digits, '-', '_' and spaces only "
                "(e.g. sks or my_cat)")
    return None


def default_target(source: Path) -> Path:
    """Next to the flat folder, named after it: ``photos/`` -> ``photos-kohya/``."""
    return source.parent / f"{source.name}-kohya"


@dataclass(frozen=True)
class FlatLayout:
    """``source``'s images (and captions) as ``target/<repeats>_<trigger>/``."""

    source: Path
    target: Path
    repeats: int
    trigger: str
    mode: str  # "link" | "copy"
    files: tuple[Path, ...]  # images and caption files of ``source`` that go along

    @property
    def subset_dir(self) -> Path:
        return self.target / f"{self.repeats}_{self.trigger}"

    def summary(self, flat: DatasetSummary) -> DatasetSummary:
        """The dataset summary the planner would get from the organised folder, from the flat folder's scan
        (same images and captions; one subset with the repeats and the trigger as class tokens)."""
        (subset,) = flat.subsets
        organised = replace(subset, image_dir=str(self.subset_dir), num_repeats=self.repeats,
                            class_tokens=self.trigger)
        missing = subset.num_images - subset.num_captions
        # The flat folder's own warnings are about the flat folder; a missing caption now has a stand-in.
        warnings = (f"{missing} image(s) without a caption file: kohya uses the trigger '{self.trigger}' "
                    "as their caption",) if missing > 0 else ()
        return replace(flat, root=str(self.target), subsets=(organised,), warnings=warnings)


def target_problem(text: str) -> str | None:
    """Why ``text`` cannot be the new dataset folder, or None: it must not exist yet (nothing is overwritten)
    and its parent must be a writable folder."""
    if not text.strip():
        return "type a folder path"
    target = Path(text).expanduser()
    if target.exists():
        return f"{target} exists already; choose a new folder (nothing is overwritten)"
    parent = target.resolve().parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    if not os.access(parent, os.W_OK):
        return f"{parent} is not writable; choose a folder you can write to"
    return None


def plan_layout(source: Path, target: Path, repeats: int, trigger: str, mode: str) -> FlatLayout:
    if mode not in MODES:
        raise UserError(f"--organise {mode}: choose one of {', '.join(MODES)}")
    problem = target_problem(str(target))
    if problem:
        raise UserError(f"--organise-into {target}: {problem}")
    source = source.expanduser().resolve()
    wanted = IMAGE_EXTENSIONS + CAPTION_EXTENSIONS
    listing = FolderListing.read(source)  # one listing, no stat per file: a flat folder may hold 100,000 images
    files = tuple(source / name for name in sorted(listing.files) if os.path.splitext(name)[1].lower() in wanted)
    return FlatLayout(source=source, target=target.expanduser().resolve(), repeats=repeats,
                      trigger=safe_name(trigger), mode=mode, files=files)


def create(layout: FlatLayout) -> Path:
    """Build the folder (all of it or none of it) and return the subset folder."""
    staging = layout.target.parent / f".{layout.target.name}.partial-{os.getpid()}"
    subset = staging / layout.subset_dir.name
    try:
        subset.mkdir(parents=True)
        for file in layout.files:
            if layout.mode == "link":
                (subset / file.name).symlink_to(file)
            else:
                shutil.copy2(file, subset / file.name)
        staging.rename(layout.target)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        hint = "; choose copy instead of link" if layout.mode == "link" else ""
        raise UserError(f"{layout.target}: cannot create the dataset folder ({error.strerror or error}){hint}") \
            from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return layout.subset_dir
