"""The planner's view of a dataset: images and repeats per folder, from the engine's one dataset scan.

``scan_dataset`` summarises ``sd_scripts_compat.facts.dataset_scan.scan_dataset_folder`` (the rules are
there: ``N_name`` folders, image extensions, images directly in the folder as one subset) and picks
the caption extension the dataset.toml will name; ``nominal_dataset`` stands in for one (templates).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from sd_scripts_compat.facts.dataset_scan import (
    CAPTION_EXTENSIONS,
    IMAGE_EXTENSIONS,
    DatasetScan,
    caption_coverage,
    media_noun,
    require_images,
    scan_dataset_folder,
)

__all__ = ["CAPTION_EXTENSIONS", "IMAGE_EXTENSIONS", "DatasetSummary", "SubsetInfo", "nominal_dataset",
           "scan_dataset", "summarise"]


@dataclass(frozen=True)
class SubsetInfo:
    """One image folder of the dataset: kohya's ``N_name`` -> N repeats, class tokens ``name``."""

    image_dir: str
    num_repeats: int
    class_tokens: str | None
    num_images: int
    num_captions: int


@dataclass(frozen=True)
class DatasetSummary:
    root: str
    subsets: tuple[SubsetInfo, ...]
    caption_extension: str
    warnings: tuple[str, ...] = ()
    noun: str = "images"  # what a sample is: "videos" for a clip dataset (a video family's --frames)

    @property
    def num_images(self) -> int:
        return sum(s.num_images for s in self.subsets)

    @property
    def views_per_epoch(self) -> int:
        """Images seen in one kohya epoch: each folder's images times its repeats."""
        return sum(s.num_images * s.num_repeats for s in self.subsets)

    def line(self) -> str:
        """One line for the plan: images, folders, views per epoch, how many are captioned."""
        captioned = sum(s.num_captions for s in self.subsets)
        folders = f"{len(self.subsets)} folder{'s' if len(self.subsets) != 1 else ''}"
        return (f"dataset {self.root}: {self.num_images} {self.noun} in {folders}, {self.views_per_epoch} views per "
                f"epoch; {captioned} of {self.num_images} {self.noun} captioned ({self.caption_extension})")


def scan_dataset(path: str | os.PathLike[str], media: tuple[str, ...] = IMAGE_EXTENSIONS) -> DatasetSummary:
    """Count images and repeats the way sd-scripts reads ``--train_data_dir`` (plus images directly in the
    folder as one subset with 1 repeat, since a dataset.toml can point at any folder). A missing folder or
    one without images is a one-line UserError. ``media=VIDEO_EXTENSIONS``: a clip dataset's videos."""
    summary = summarise(require_images(scan_dataset_folder(path, media=media), media))
    return replace(summary, noun=media_noun(media))


def summarise(scan: DatasetScan) -> DatasetSummary:
    """The summary of a scan; the caption files that exist decide the extension (".txt" when there are none,
    lora-scripts' default), and folders with uncaptioned images and no class tokens get a warning."""
    counts = dict.fromkeys(CAPTION_EXTENSIONS, 0)
    subsets = []
    for subset in scan.subsets:
        found = [ext for ext in subset.caption_extensions() if ext is not None]
        for ext in found:
            counts[ext] += 1
        subsets.append(SubsetInfo(image_dir=str(subset.folder), num_repeats=subset.num_repeats,
                                  class_tokens=subset.class_tokens, num_images=subset.num_images,
                                  num_captions=len(found)))
    caption_extension = max(CAPTION_EXTENSIONS, key=lambda ext: (counts[ext], ext == ".txt"))
    warnings = list(scan.warnings)
    elsewhere = caption_coverage([i for s in scan.subsets for i in s.images], caption_extension,
                                 [s.listing for s in scan.subsets]).problem()
    if elsewhere:
        warnings.append(elsewhere)
    for s in subsets:
        if s.num_captions < s.num_images and not s.class_tokens:
            warnings.append(f"{Path(s.image_dir).name}/: {s.num_images - s.num_captions} image(s) without a "
                            f"{caption_extension} caption and no class tokens in the folder name")
    return DatasetSummary(root=str(scan.root), subsets=tuple(subsets), caption_extension=caption_extension,
                          warnings=tuple(warnings))


def nominal_dataset(num_images: int = 20, repeats: int = 10) -> DatasetSummary:
    """A stand-in dataset for templates: one ``10_subject`` folder of 20 captioned images."""
    return DatasetSummary(root="./train", subsets=(SubsetInfo(image_dir=f"./train/{repeats}_subject",
                                                              num_repeats=repeats, class_tokens="subject",
                                                              num_images=num_images, num_captions=num_images),),
                          caption_extension=".txt")
