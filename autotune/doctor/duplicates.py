"""Exact duplicates: images with the same bytes (sha256), anywhere in the dataset.

A copy trains as often as its folder's repeats say, on top of the original, so one picture quietly gets
double weight (a common accident when folders are merged or repeats are faked by copying files).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.doctor.images import ImageCheck
from autotune.doctor.report import WARNING, Problem

Hashes = Callable[[list[Path]], dict[Path, str]]  # files -> their sha256 (a file that cannot be read left out)


def duplicate_problems(images: list[tuple[str, ImageCheck]], hashes: Hashes) -> list[Problem]:
    """One warning per copy (every file after the first, in name order), naming the file it copies. Only files
    of equal length can be copies, so only those are hashed (most datasets: none). Empty and unreadable
    files are left to the image checks (they are all 'the same', and all errors already)."""
    by_length: dict[int, list[tuple[str, ImageCheck]]] = {}
    for rel, check in images:
        if check.file_bytes:
            by_length.setdefault(check.file_bytes, []).append((rel, check))
    groups = [sorted(group, key=lambda item: item[0]) for group in by_length.values() if len(group) > 1]
    digests = hashes([check.path for group in groups for _, check in group])
    problems = []
    for group in groups:
        problems += _copies(group, digests)
    return sorted(problems, key=lambda problem: problem.file)


def _copies(group: list[tuple[str, ImageCheck]], digests: dict[Path, str]) -> list[Problem]:
    first: dict[str, str] = {}
    problems = []
    for rel, check in group:
        digest = digests.get(check.path)
        if digest is None:
            continue  # unreadable: the image checks report it
        if digest not in first:
            first[digest] = rel
            continue
        problems.append(Problem(WARNING, "duplicate", rel, f"the same bytes as {first[digest]}: that picture trains "
                                "twice as often as it should (each copy with its folder's repeats)",
                                "delete one copy (raise the folder's repeats instead if it should weigh more)"))
    return problems
