"""Exact duplicates: images with the same bytes (sha256), anywhere in the dataset.

A copy trains as often as its folder's repeats say, on top of the original, so one picture quietly gets
double weight (a common accident when folders are merged or repeats are faked by copying files).
"""

from __future__ import annotations

from pathlib import Path

from autotune.doctor.report import WARNING, Problem
from sd_scripts_compat.facts.hashes import file_sha256


def duplicate_problems(images: list[tuple[str, Path]]) -> list[Problem]:
    """One warning per copy (every file after the first, in name order), naming the file it copies.
    Empty files are left to the image checks (they are all 'the same', and all errors already)."""
    first: dict[str, str] = {}
    problems = []
    for rel, path in sorted(images):
        try:
            if path.stat().st_size == 0:
                continue
            digest = file_sha256(path)
        except OSError:
            continue  # unreadable: the image checks report it
        if digest not in first:
            first[digest] = rel
            continue
        problems.append(Problem(WARNING, "duplicate", rel, f"the same bytes as {first[digest]}: that picture trains "
                                "twice as often as it should (each copy with its folder's repeats)",
                                "delete one copy (raise the folder's repeats instead if it should weigh more)"))
    return problems
