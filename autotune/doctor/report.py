"""What `autotune doctor` found: problems (each an error or a warning naming one file), per-subset facts,
the bucket histogram and the true steps per epoch, as frozen dataclasses.

One report feeds every view (terminal, JSON, HTML) and every caller (`autotune run`, the wizard), so they
cannot disagree about what is wrong. Paths are relative to the dataset folder, with ``/`` separators, so
a report reads the same on every machine and in tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Severity = Literal["error", "warning"]
ERROR: Severity = "error"
WARNING: Severity = "warning"



def rel_name(path: Path, root: Path) -> str:
    """A file's name in the report: its path under the dataset folder, with ``/``. By its text where it can (a
    report of 100,000 images names each file several times; ``Path.relative_to`` costs ten times more)."""
    text, prefix = str(path), str(root)
    if text.startswith(prefix) and text[len(prefix):len(prefix) + 1] == os.sep:
        return text[len(prefix) + 1:].replace(os.sep, "/")
    return path.relative_to(root).as_posix()

@dataclass(frozen=True)
class Problem:
    """One thing wrong with one file (or folder). ``code`` is a stable identifier (see render_json)."""

    severity: Severity
    code: str
    file: str  # relative to the dataset folder; "." is the folder itself
    message: str
    fix: str


@dataclass(frozen=True)
class SubsetFacts:
    """One ``N_name`` folder as the engine will read it."""

    folder: str
    num_repeats: int
    class_tokens: str | None
    images: int  # images the scan lists (supported extensions)
    usable_images: int  # of those, the ones that reach a bucket: no error on the image itself
    captions_found: int
    captions_missing: int  # images without a caption file of the dataset's caption extension
    captions_orphaned: int  # caption files without an image beside them
    captions_empty: int  # caption files that are empty or whose first line is blank
    modes: tuple[tuple[str, int], ...]  # PIL mode -> images, as they are stored on disk
    top_tags: tuple[tuple[str, int], ...]  # the engine's tag frequency (comma-split, lower-cased), top N
    clips: str | None = None  # a clip dataset's folder: its videos, frame counts and length (videos.clip_summary)


@dataclass(frozen=True)
class BucketRow:
    """One aspect-ratio bucket: its images, the views with repeats, and how the engine batches them."""

    width: int
    height: int
    images: int  # distinct images
    views: int  # images times their repeats: what one epoch draws from this bucket
    batches: int  # ceil(views / batch): steps this bucket contributes to an epoch
    last_batch: int  # size of the last batch (== batch when it divides evenly)


@dataclass(frozen=True)
class DoctorSettings:
    """The training settings the report was computed for (the planner's bucket rules)."""

    family: str | None  # None: no --model, the rules of a full-size family
    resolution: int
    batch_size: int
    bucket_reso_steps: int
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_no_upscale: bool
    caption_extension: str
    max_token_length: int
    bomb_limit_pixels: int
    frames: int = 1  # the planned clip length of a video family (musubi's target_frames); 1: images
    quick: bool = False  # --quick: image headers only, nothing decoded


@dataclass(frozen=True)
class DoctorReport:
    root: str  # the dataset folder, absolute
    settings: DoctorSettings
    subsets: tuple[SubsetFacts, ...]
    buckets: tuple[BucketRow, ...]
    steps_per_epoch: int  # what the engine's sampler yields per epoch (one process)
    views_per_epoch: int  # usable images times repeats
    problems: tuple[Problem, ...]  # errors first, then by file

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == ERROR)

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == WARNING)

    @property
    def ok(self) -> bool:
        """No errors (warnings allowed): what `autotune run` needs to start."""
        return not self.errors

    @property
    def num_images(self) -> int:
        return sum(s.images for s in self.subsets)


def sort_problems(problems: list[Problem]) -> tuple[Problem, ...]:
    """Errors first, then by file and code, so the order never depends on the folder listing."""
    return tuple(sorted(problems, key=lambda p: (p.severity != ERROR, p.file, p.code, p.message)))


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def summary_line(report: DoctorReport) -> str:
    """One line for other commands: counts of errors and warnings, images and the true steps per epoch."""
    s = report.settings
    captioned = sum(subset.captions_found for subset in report.subsets)
    return (f"doctor: {_plural(len(report.errors), 'error')}, {_plural(len(report.warnings), 'warning')} in "
            f"{_plural(report.num_images, 'image')} ({_plural(len(report.subsets), 'subset')}); "
            f"{captioned} of {report.num_images} images captioned ({s.caption_extension}); "
            f"{report.steps_per_epoch} steps per epoch at batch {s.batch_size}, {s.resolution} px")


def brief(report: DoctorReport, limit: int = 3) -> list[str]:
    """The summary line and the first ``limit`` problems, one line each (what `autotune run` shows)."""
    lines = [summary_line(report)]
    for problem in report.problems[:limit]:
        lines.append(f"  {problem.severity}: {problem.file}: {problem.message}")
    if len(report.problems) > limit:
        lines.append(f"  ... {len(report.problems) - limit} more: autotune doctor {report.root}")
    return lines
