"""One builder per cache entry: two runs caching the same image for the same model take turns.

The lock is ``flock`` on the image file itself (opened read-only): it needs no lock file in the user's
folder, dies with its process, and every run that caches that image agrees on it. Locks are taken in
path order and held for one batch only, so two runs cannot wait on each other. Where the file system
has no ``flock`` (some network mounts), building goes on unlocked: entries are written atomically with
identical contents, so the only cost is encoding twice.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


@contextlib.contextmanager
def images_locked(paths: Iterable[Path]) -> Iterator[None]:
    """Hold an exclusive lock on each image in ``paths`` (waiting for another run holding one) until the block ends."""
    import fcntl

    handles: list[int] = []
    try:
        for path in sorted({Path(p) for p in paths}):
            try:
                handle = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue  # gone: the read that follows names it
            handles.append(handle)
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        for handle in handles:
            os.close(handle)  # closing releases the lock
