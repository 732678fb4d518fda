"""What the doctor learned about each file, kept between commands: a second `autotune doctor` (or the checks
`autotune run` and the web app make before training) reads no image or caption it has already read, unchanged.

One SQLite file in the user cache folder (``measure.store.cache_dir``; never the dataset folder). A row is keyed
by the file's absolute path and by what was learned: an image check (of this version of the checks and of
Pillow, full or ``--quick``), a caption file's reading, or the file's sha256; it holds the file's length and
modification time (ns), so a file that changed no longer matches and is read again. A cache that cannot be
opened, read or written is passed over with one warning: the checks then run as if it were empty. Hand-written
over ``sqlite3`` (one table; no library keeps per-file facts keyed by a file's identity).
"""

from __future__ import annotations

import json
import sqlite3
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from autotune.doctor.images import ImageCheck
from autotune.doctor.report import ERROR, Problem, rel_name

if TYPE_CHECKING:
    from autotune.doctor.captions import CaptionReading

FACTS_NAME = "file_facts.sqlite"
CHECKS_VERSION = 1  # raise it when an image check changes what it finds: the rows of older checks are then unused
CAPTION_KIND = f"caption/{CHECKS_VERSION}"
SCHEMA = ("CREATE TABLE IF NOT EXISTS facts (path TEXT NOT NULL, kind TEXT NOT NULL, bytes INTEGER NOT NULL, "
          "mtime_ns INTEGER NOT NULL, value TEXT NOT NULL, PRIMARY KEY (path, kind))")

Identity = tuple[int, int]  # (length, modification time in ns)
T = TypeVar("T")


def identity(path: Path) -> Identity | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def check_kind(quick: bool) -> str:
    import PIL

    return f"image-check/{CHECKS_VERSION}/pillow-{PIL.__version__}/{'quick' if quick else 'full'}"


class FileFacts:
    """The cache, open for one command (``with FileFacts.open() as facts``); every method is safe to call when
    the cache could not be opened (``connection`` None): it then remembers nothing."""

    def __init__(self, connection: sqlite3.Connection | None) -> None:
        self.connection = connection

    @classmethod
    def open(cls, folder: Path | None = None) -> FileFacts:
        from autotune.measure.store import cache_dir

        path = (folder or cache_dir()) / FACTS_NAME
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(path, timeout=30)
            connection.execute(SCHEMA)
        except (OSError, sqlite3.Error) as error:
            warnings.warn(f"{path}: the doctor's file cache cannot be used ({error}); every image is checked",
                          stacklevel=2)
            return cls(None)
        return cls(connection)

    def __enter__(self) -> FileFacts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None

    def known(self, kind: str, files: dict[Path, Identity]) -> dict[Path, str]:
        """The values of ``kind`` kept for those of ``files`` (path -> identity) that are unchanged since."""
        if self.connection is None or not files:
            return {}
        lowest, highest = min(map(str, files)), max(map(str, files))
        try:
            rows = self.connection.execute("SELECT path, bytes, mtime_ns, value FROM facts WHERE kind = ? AND "
                                           "path BETWEEN ? AND ?", (kind, lowest, highest)).fetchall()
        except sqlite3.Error as error:
            self._lost(error)
            return {}
        found = {}
        for path, length, mtime_ns, value in rows:
            file = Path(path)
            if files.get(file) == (length, mtime_ns):
                found[file] = value
        return found

    def keep(self, kind: str, values: Iterable[tuple[Path, Identity, str]]) -> None:
        if self.connection is None:
            return
        try:
            with self.connection:
                self.connection.executemany("INSERT OR REPLACE INTO facts VALUES (?, ?, ?, ?, ?)",
                                            [(str(path), kind, ident[0], ident[1], value)
                                             for path, ident, value in values])
        except sqlite3.Error as error:
            self._lost(error)

    def _lost(self, error: sqlite3.Error) -> None:
        warnings.warn(f"the doctor's file cache failed ({error}); continuing without it", stacklevel=3)
        self.connection = None


def keeps(check: ImageCheck) -> bool:
    """Whether a check is kept: not one with an error, which is checked again each time (a file made readable
    by ``chmod`` keeps its modification time, and errors are few)."""
    return not any(problem.severity == ERROR for problem in check.problems)


def check_to_json(check: ImageCheck) -> str:
    """A check without its path and its problems' file names (a file is named by the folder it is checked from)."""
    return json.dumps({"size": check.size, "mode": check.mode, "bytes": check.file_bytes,
                       "problems": [[p.severity, p.code, p.message, p.fix] for p in check.problems]})


def check_from_json(path: Path, rel: str, text: str) -> ImageCheck | None:
    """The check kept for ``path`` named ``rel``, or None when the row is not one this version wrote."""
    try:
        data = json.loads(text)
        size = tuple(data["size"]) if data["size"] is not None else None
        problems = tuple(Problem(severity, code, rel, message, fix)
                         for severity, code, message, fix in data["problems"])
        return ImageCheck(path, size, data["mode"], problems, data["bytes"])  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError):
        return None


def kept_or_made(facts: FileFacts, kind: str, paths: list[Path], make: Callable[[Path], T | None],
                 dump: Callable[[T], str | None], load: Callable[[Path, str], T | None]) -> dict[Path, T]:
    """Each file's fact of ``kind``: the kept one where the file is unchanged, else ``make(path)`` (None: none,
    the file is left out), kept for next time unless ``dump`` says None."""
    identities = file_identities(paths)
    found: dict[Path, T] = {}
    for path, text in facts.known(kind, identities).items():
        value = load(path, text)
        if value is not None:
            found[path] = value
    fresh = []
    for path in paths:
        if path in found:
            continue
        made = make(path)
        if made is None:
            continue
        found[path] = made
        dumped = dump(made)
        if path in identities and dumped is not None:
            fresh.append((path, identities[path], dumped))
    facts.keep(kind, fresh)
    return found


def cached_sha256(facts: FileFacts, paths: list[Path]) -> dict[Path, str]:
    """Each file's sha256, read once ever while it is unchanged; a file that cannot be read is left out (the
    image checks report it)."""
    from sd_scripts_compat.facts.hashes import file_sha256

    def digest(path: Path) -> str | None:
        try:
            return file_sha256(path)
        except OSError:
            return None

    return kept_or_made(facts, "sha256", paths, digest, str, lambda _, text: text)


def cached_captions(facts: FileFacts, paths: list[Path], root: Path) -> dict[Path, CaptionReading]:
    """Each caption file as the doctor reads it (``captions.read_caption_file``), read once while it is unchanged."""
    from autotune.doctor.captions import read_caption_file

    def dump(reading: CaptionReading) -> str | None:
        text, problem = reading
        if problem is not None and problem.severity == ERROR:
            return None  # read again next time: a permission fixed or a file re-saved may not change its time
        return json.dumps([text, None if problem is None else [problem.severity, problem.code, problem.message,
                                                               problem.fix]])

    def load(path: Path, kept: str) -> CaptionReading | None:
        try:
            text, problem = json.loads(kept)
            return text, None if problem is None else Problem(problem[0], problem[1], rel_name(path, root),
                                                             problem[2], problem[3])
        except (ValueError, TypeError, IndexError):
            return None

    return kept_or_made(facts, CAPTION_KIND, paths, lambda path: read_caption_file(path, root), dump, load)


def file_identities(paths: Iterable[Path]) -> dict[Path, Identity]:
    """Each readable file's identity (a file gone since the listing is left out: its check reports it)."""
    found = {}
    for path in paths:
        ident = identity(path)
        if ident is not None:
            found[path] = ident
    return found

