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

import contextlib
import json
import sqlite3
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from autotune.doctor.image_pool import Progress, check_images
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


def kept_or_made(facts: FileFacts, kinds: tuple[str, ...], paths: list[Path],
                 make: Callable[[list[Path]], dict[Path, T]], dump: Callable[[T], str | None],
                 load: Callable[[Path, str], T | None]) -> dict[Path, T]:
    """Each file's fact: the kept one of the first of ``kinds`` that has it for the file unchanged, else made now
    (``make`` of those files at once; a file it leaves out has none) and kept under the last kind, unless ``dump``
    says None (read again next time)."""
    identities = file_identities(paths)
    found: dict[Path, T] = {}
    for kind in kinds:
        for path, text in facts.known(kind, {p: i for p, i in identities.items() if p not in found}).items():
            value = load(path, text)
            if value is not None:
                found[path] = value
    made = make([path for path in paths if path not in found])
    fresh = [(path, identities[path], dumped) for path, value in made.items()
             if path in identities and (dumped := dump(value)) is not None]
    facts.keep(kinds[-1], fresh)
    return {**found, **made}


def cached_checks(facts: FileFacts, images: list[Path], root: Path, quick: bool,
                  progress: Progress | None) -> dict[Path, ImageCheck]:
    """Each image's check (``image_pool.check_images``, over the cores), kept for a file unchanged since; a full
    check serves a quick one too. A check with an error is not kept: a file made readable by ``chmod``, or a copy
    restored with its times, keeps its length and time, and errors are few."""
    named = {image: rel_name(image, root) for image in images}

    def make(todo: list[Path]) -> dict[Path, ImageCheck]:
        return dict(zip(todo, check_images([(path, named[path]) for path in todo], quick=quick, progress=progress)))

    def dump(check: ImageCheck) -> str | None:
        if any(problem.severity == ERROR for problem in check.problems):
            return None
        return json.dumps({"size": check.size, "mode": check.mode, "bytes": check.file_bytes,
                           "problems": [_row(problem) for problem in check.problems]})

    def load(path: Path, text: str) -> ImageCheck | None:
        try:
            data = json.loads(text)
            size = tuple(data["size"]) if data["size"] is not None else None
            problems = tuple(_problem(row, named[path]) for row in data["problems"])
            return ImageCheck(path, size, data["mode"], problems, data["bytes"])  # type: ignore[arg-type]
        except (ValueError, KeyError, TypeError):
            return None

    kinds = (check_kind(quick=False), check_kind(quick=True)) if quick else (check_kind(quick=False),)
    found = kept_or_made(facts, kinds, images, make, dump, load)
    return {image: found[image] for image in images}


def cached_sha256(facts: FileFacts, paths: list[Path]) -> dict[Path, str]:
    """Each file's sha256, read once ever while it is unchanged; a file that cannot be read is left out (the
    image checks report it)."""
    from sd_scripts_compat.facts.hashes import file_sha256

    def make(todo: list[Path]) -> dict[Path, str]:
        digests = {}
        for path in todo:
            with contextlib.suppress(OSError):
                digests[path] = file_sha256(path)
        return digests

    return kept_or_made(facts, ("sha256",), paths, make, str, lambda _, text: text)


def cached_captions(facts: FileFacts, paths: list[Path], root: Path) -> dict[Path, CaptionReading]:
    """Each caption file as the doctor reads it (``captions.read_caption_file``), read once while it is unchanged;
    one with an error is read again next time (as an image check with one)."""
    from autotune.doctor.captions import read_caption_file

    def dump(reading: CaptionReading) -> str | None:
        text, problem = reading
        if problem is not None and problem.severity == ERROR:
            return None
        return json.dumps([text, None if problem is None else _row(problem)])

    def load(path: Path, kept: str) -> CaptionReading | None:
        try:
            text, row = json.loads(kept)
            return text, None if row is None else _problem(row, rel_name(path, root))
        except (ValueError, TypeError, IndexError):
            return None

    return kept_or_made(facts, (CAPTION_KIND,), paths, lambda todo: {p: read_caption_file(p, root) for p in todo},
                        dump, load)


def _row(problem: Problem) -> list[str]:
    """A problem as kept: without its file's name (a file is named by the folder it is checked from)."""
    return [problem.severity, problem.code, problem.message, problem.fix]


def _problem(row: list[str], rel: str) -> Problem:
    severity, code, message, fix = row
    return Problem(severity, code, rel, message, fix)  # type: ignore[arg-type]


def file_identities(paths: Iterable[Path]) -> dict[Path, Identity]:
    """Each readable file's identity (a file gone since the listing is left out: its check reports it)."""
    found = {}
    for path in paths:
        with contextlib.suppress(OSError):
            stat = path.stat()
            found[path] = (stat.st_size, stat.st_mtime_ns)
    return found
