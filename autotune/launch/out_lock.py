"""One run per output folder: an OS lock that dies with the process that holds it.

``autotune run`` holds ``flock`` on ``OUT/.autotune.lock`` for as long as it supervises; the kernel drops the
lock when that process ends however it ends (SIGKILL included), so there is no stale lock to clean up. The
file holds the holder's PID only so that a second run can name it. Written by hand: the standard library's
``fcntl.flock`` is the whole mechanism, and no well-kept library adds anything a few lines need.
Where ``fcntl`` does not exist (Windows), the folder is not locked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from autotune.layout import LOCK_FILE
from sd_scripts_compat.facts.errors import UserError


@contextlib.contextmanager
def locked_output(out: Path) -> Iterator[None]:
    """Create ``out`` if needed and hold its lock for the block; a one-line UserError naming the holder's PID
    when another live run holds it."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--out {out}: cannot create the folder ({error.strerror or error}); "
                        "choose another --out") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: the folder is not writable; choose another --out")
    try:
        import fcntl
    except ImportError:  # no flock here: the folder is used unlocked
        yield
        return
    path = out / LOCK_FILE
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            created = False  # the holder's file
            raise UserError(f"--out {out}: another autotune run (PID {holder}) is using this folder; wait for it "
                            "to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode("ascii"), 0)
        yield
    except BaseException:
        if created:  # a start that failed leaves nothing behind, the lock's file included
            path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)  # the lock goes with the descriptor


def lock_holder(out: Path) -> int | None:
    """The PID of the live ``autotune run`` holding ``out``'s lock, else None (never creates the lock file)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(Path(out) / LOCK_FILE, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
