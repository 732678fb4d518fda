"""A run's live events as server-sent events: what the run's files say, as they change.

Polled from the folder twice a second (the run is another process; its files are the only channel, and the same
ones the report reads): ``progress`` (each line of the engine's progress.jsonl from the run's first step, so a page
opened late still draws whole curves: step, it/s, loss, and from our engine the learning rate and peak memory; a
run whose engine wrote only progress.json sends that), ``decision`` (each new line of logs/decisions.jsonl:
step-downs, rollbacks, resumes, each with its reason), ``sample`` (each new image under sample/), ``log`` (the
run's console as a terminal shows it: its last 64 KiB, then each new line, and the progress bar's current text
apart, since it redraws one line with carriage returns), ``state`` (queued, running, ... done). The stream ends
with ``end`` once the run is in a final state and everything was sent.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from autotune.layout import DECISIONS_JSONL, EVENTS_DIR
from sd_scripts_compat.facts.atomic import is_being_written
from sd_scripts_compat.facts.contract import PROGRESS_LOG

POLL_S = 0.5
FINAL = ("done", "failed", "interrupted", "unreadable")
MAX_SECONDS = 24 * 3600.0  # a stream a browser left open ends after a day; the page reconnects


LOG_TAIL_BYTES = 64 * 1024  # of a console log, what a page opened late gets
MAX_LINE = 1000  # characters of one console line sent (a progress bar over thousands of steps is one line)


class RunStates(Protocol):
    """What the stream reads of the run store (``ui.runs.RunStore``, which imports this module)."""

    runs_dir: Path

    def state(self, run_id: str) -> tuple[str, str | None]: ...

    def console_log(self, run_id: str) -> Path | None: ...


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, default=str)}\n\n"


def run_events(store: RunStates, run_id: str) -> Iterator[str]:
    folder = store.runs_dir / run_id
    sent_samples, last_progress, last_state = set(), None, None
    progress_log, decisions = JsonLines(folder / EVENTS_DIR / PROGRESS_LOG), JsonLines(folder / DECISIONS_JSONL)
    console: ConsoleTail | None = None
    began = time.monotonic()
    while time.monotonic() - began < MAX_SECONDS:
        state = store.state(run_id)
        if state != last_state:
            yield _event("state", {"state": state[0], "message": state[1]})
            last_state = state
        progress_log.poll()
        for line in progress_log.lines:
            yield _event("progress", line)
        if not progress_log.seen:  # an engine without the log: its latest progress.json
            latest = _read_text(folder / EVENTS_DIR / "progress.json")
            if latest and latest != last_progress:
                try:
                    yield _event("progress", json.loads(latest))
                except (ValueError, RecursionError):
                    pass  # caught mid-write: the next poll has it
                last_progress = latest
        decisions.poll()
        for line in decisions.lines:
            yield _event("decision", line)
        if console is None and (path := store.console_log(run_id)) is not None:
            console = ConsoleTail(path)
        if console is not None and console.poll():
            yield _event("log", {"lines": console.lines, "current": console.current})
        samples = folder / "sample"
        if samples.is_dir():
            for image in sorted(samples.glob("*.png")):
                if image.name not in sent_samples and not is_being_written(image):
                    sent_samples.add(image.name)
                    yield _event("sample", {"file": f"sample/{image.name}"})
        if state[0] in FINAL:
            yield _event("end", {"state": state[0]})
            return
        time.sleep(POLL_S)


class JsonLines:
    """A growing JSON-lines file read from where the last poll stopped; ``lines`` are the new whole lines,
    ``bad`` how many whole lines were no JSON at all (left out)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.seen, self.bad = path, 0, False, 0
        self.lines: list[Any] = []

    def poll(self) -> None:
        self.lines = []
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except OSError:
            return
        self.seen = True
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        for raw in chunk[:end].splitlines():
            try:
                self.lines.append(json.loads(raw))
            except (ValueError, RecursionError):
                self.bad += 1


class ConsoleTail:
    """A console log as a terminal shows it: ``lines`` are the lines ended since the last poll; ``current`` the
    text a progress bar redraws with carriage returns (what follows the last one). Read from where the last poll
    stopped (a first poll starts at the last ``LOG_TAIL_BYTES``), so a long run costs no re-reading."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, -1
        self.pending, self.shown = b"", b""
        self.lines: list[str] = []
        self.current: str = ""

    def poll(self) -> bool:
        """Read what was added; True when there is anything new to show."""
        try:
            with open(self.path, "rb") as file:
                size = file.seek(0, 2)
                if self.offset < 0 or size < self.offset:  # the first poll, or a log started again
                    self.offset = max(0, size - LOG_TAIL_BYTES)
                    self.pending = self.shown = b""
                    skip_partial = self.offset > 0
                else:
                    skip_partial = False
                file.seek(self.offset)
                chunk = file.read()
        except OSError:
            return False
        self.offset += len(chunk)
        if skip_partial:
            chunk = chunk[chunk.find(b"\n") + 1:] if b"\n" in chunk else b""
        before, data = self.current, self.pending + chunk
        self.lines, self.pending = [], b""
        for token in re.split(rb"(\r|\n)", data):
            if token == b"\n":
                self.lines.append(_text(self.pending or self.shown))
                self.pending = self.shown = b""
            elif token == b"\r":
                self.shown, self.pending = self.pending or self.shown, b""
            else:
                self.pending = (self.pending + token)[-4 * MAX_LINE:]
        self.current = _text(self.pending or self.shown)
        return bool(self.lines) or self.current != before


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")[-MAX_LINE:]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None
