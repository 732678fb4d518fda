"""Every image of a dataset checked over the machine's cores, in the dataset's order, with progress.

A full check decodes each picture (``images.check_image``): about a millisecond for a small PNG, tens for a 4 MP
JPEG, so at 100,000 images the decode is the doctor's cost. Hand-written over ``concurrent.futures`` (no library
checks images): worker processes take the images in chunks. They are forked from a process with one thread and
no torch (the CLI), and spawned otherwise (the web app serves from threads, and a fork under threads can deadlock;
a spawned worker re-imports the caller's main module, which the CLI and the web app guard as Python asks). A
quick check (headers only) and a small dataset stay in this process: starting the workers costs more.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from autotune.doctor.images import ImageCheck, check_image

POOL_FROM_IMAGES = 500  # fewer decodes than this take less time than starting the workers
CHUNK = 32  # images per task: few round trips, yet progress moves and the cores end together

Progress = Callable[[int, int], None]  # (images checked, images in all)


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_images(images: list[tuple[Path, str]], *, quick: bool = False, workers: int | None = None,
                 progress: Progress | None = None) -> list[ImageCheck]:
    """``check_image`` of each ``(path, name in problems)``, in order; ``progress`` is told after each one."""
    workers = usable_cores() if workers is None else workers
    if quick or workers < 2 or len(images) < POOL_FROM_IMAGES:
        checks = []
        for path, rel in images:
            checks.append(check_image(path, rel, quick))
            if progress is not None:
                progress(len(checks), len(images))
        return checks
    return _in_workers(images, workers, progress)


def _in_workers(images: list[tuple[Path, str]], workers: int, progress: Progress | None) -> list[ImageCheck]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    single = threading.active_count() == 1 and "torch" not in sys.modules  # no thread a fork could catch mid-lock
    context = multiprocessing.get_context("fork" if single and os.name == "posix" else "spawn")
    checks: list[ImageCheck] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        paths, rels = [path for path, _ in images], [rel for _, rel in images]
        for check in pool.map(check_image, paths, rels, itertools.repeat(False), chunksize=CHUNK):
            checks.append(check)
            if progress is not None:
                progress(len(checks), len(images))
    return checks
