"""Atomic file writes: a temp file in the target's folder, then ``os.replace``.

Every output of ours (LoRA files, caches, configs, events, sample images) goes through here, so a
crash, a kill or a full disk never leaves a half-written file under the real name.

Test hook: ``SD_COMPAT_TEST_SAVE_PAUSE=PATTERN:SECONDS`` makes every write whose target name matches the glob
``PATTERN`` wait ``SECONDS`` with its content complete but not yet renamed into place, so a test can kill the
process in the middle of a save (tests/test_signals.py). Read at each write; unset in normal use.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TEST_PAUSE_ENV = "SD_COMPAT_TEST_SAVE_PAUSE"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temp path beside ``path``; on normal exit it replaces ``path``, on error it is removed.

    For writers that want a file name (safetensors' ``save_file``, PIL's ``save``). A target that exists and is
    not a regular file (a device such as /dev/null, a FIFO, a socket, a folder) is refused in one line: the
    rename would replace it, and as root that replaces a device node.
    """
    target = Path(path)
    refuse_non_regular(target)
    mode = 0o666 & ~_umask()  # mkstemp makes 0600; a file we write gets the umask's permissions
    tmp = ""
    try:  # from the temp file's creation on: a Ctrl-C between it and the write must remove it too
        # the writer's PID in the name: a later run can tell a killed writer's leftover from a live one's
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=suffix, dir=target.parent)
        os.close(fd)
        os.chmod(tmp, mode)
        yield Path(tmp)
        os.chmod(tmp, mode)  # again: a writer may have replaced the file (safetensors' save_file writes 0600)
        _test_pause(target)
        os.replace(tmp, target)
    except BaseException:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temp folder beside ``path``; on normal exit it takes ``path``'s place, on error it is removed.

    An existing folder is first renamed to ``<name>.old`` and removed after the swap, so a kill between
    the two renames leaves ``<name>.old`` whole (the watchdog's cleanup puts it back).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    try:  # as in atomic_path: a Ctrl-C right after the folder's creation must remove it too
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        for file in tmp.rglob("*"):
            if file.is_file():
                os.chmod(file, 0o666 & ~_umask())
        _test_pause(target)
        old = target.with_name(target.name + ".old")
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_being_written(path: Path) -> bool:
    """Whether ``path`` is one of ``atomic_path`` / ``atomic_folder``'s temp names (hidden: a dot first), so a
    listing of a run's outputs (its samples, its LoRAs) leaves it out: it is renamed into place when whole, or
    removed. A sample's temp name keeps the image's suffix (PIL reads the format from it), so a glob for
    ``*.png`` finds it while it is written."""
    return path.name.startswith(".")


_TEMP_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.[A-Za-z0-9_]{8}\.tmp$")


def remove_stale_temp_files(folder: Path) -> int:
    """Delete the temp files ``atomic_path`` left in ``folder`` when its writer was killed (its PID no longer
    runs); a live writer's are kept. Returns how many went. Temp files survive a SIGKILL between their
    creation and the rename; a cache beside the user's images must not keep them for ever."""
    removed = 0
    try:
        entries = list(folder.iterdir())
    except OSError:
        return 0
    for entry in entries:
        match = _TEMP_NAME.match(entry.name)
        if match is None or _alive(int(match.group("pid"))):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, not ours to signal
        return True
    return True


def refuse_non_regular(target: Path) -> None:
    """UserError when ``target`` exists and is not a regular file (a symlink is judged by what it points to)."""
    import stat

    from sd_scripts_compat.facts.errors import UserError

    try:
        mode = target.stat().st_mode
    except OSError:  # not there (or a dangling link): nothing to replace
        return
    if stat.S_ISREG(mode):
        return
    kind = ("a folder" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise UserError(f"{target} is {kind}, not a regular file; write to a file path instead")


def _test_pause(target: Path) -> None:
    """The test hook of the module docstring: a pause before the rename, for writes named like the pattern."""
    spec = os.environ.get(TEST_PAUSE_ENV)
    if not spec:
        return
    import fnmatch
    import time

    pattern, _, seconds = spec.rpartition(":")
    if fnmatch.fnmatch(target.name, pattern):
        time.sleep(float(seconds))


def _umask() -> int:
    """The process umask (reading it means setting it; set it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], payload: Any) -> None:
    """JSON (sorted keys; values json cannot take are written with ``str``), creating the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(payload, indent=1, sort_keys=True, default=str))


class AppendOnlyFile:
    """A log of whole lines (monitor.jsonl): each line is one ``os.write`` on an ``O_APPEND`` descriptor, so
    lines from several writers never interleave and a kill leaves at most one torn last line (readers skip it).

    Rewriting a growing log atomically on every line would cost O(n^2); appending whole lines is the safe form.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write_line(self, line: str) -> None:
        if self._fd is not None:
            os.write(self._fd, (line.rstrip("\n") + "\n").encode("utf-8"))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
