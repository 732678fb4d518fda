"""The engine tells its watchdog what it is doing: ``phase.json`` (see ``contract``), so a long silent phase is not
taken for a stall. Loading states how many bytes it reads, caching counts its images, the loop's rare events
(validation, saves, samples) name themselves; the watchdog scales its stall limit to each (``recovery.stall``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from sd_scripts_compat.facts.contract import ENGINE_PHASES, PHASE, write_event

WRITE_EVERY_S = 1.0  # progress inside a phase is written at most this often
_TIMER_EVENTS = {"validation": "validating", "save": "saving", "sample": "sampling"}  # PhaseTimer's names


class PhaseReporter:
    """Writes ``phase.json`` into ``events_dir`` (nothing when None or not the main process)."""

    def __init__(self, events_dir: Path | None, *, enabled: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.events_dir = events_dir if enabled else None
        self.clock = clock
        self.phase: str | None = None
        self.total: int | None = None
        self.bytes: int | None = None
        self.done = 0
        self.written_at = float("-inf")

    def enter(self, phase: str, *, total: int | None = None, size_bytes: int | None = None) -> None:
        """A new phase (one of ``contract.ENGINE_PHASES``: the names the watchdog knows)."""
        if phase not in ENGINE_PHASES:
            raise ValueError(f"phase {phase!r} is not one of {ENGINE_PHASES}")
        self.phase, self.total, self.bytes, self.done = phase, total, size_bytes, 0
        self._write()

    def advance(self, count: int = 1) -> None:
        """``count`` more items of the phase are done."""
        self.done += count
        if self.clock() - self.written_at >= WRITE_EVERY_S or self.done == self.total:
            self._write()

    def timer_event(self, name: str, begun: bool) -> None:
        """``PhaseTimer``'s listener: the loop's validation, saves and samples, and back to training after them."""
        if name in _TIMER_EVENTS:
            self.enter(_TIMER_EVENTS[name] if begun else "training")

    def compiling(self, begun: bool) -> None:
        """``torch_compile``'s listener: dynamo compiles a block (a first compile, or a recompile for a new size)
        inside a training step, for as long as it takes; back to training when that compile ends."""
        if self.phase in ("training", "compiling"):
            self.enter("compiling" if begun else "training")

    def _write(self) -> None:
        if self.events_dir is None or self.phase is None:
            return
        now = self.clock()
        payload: dict[str, object] = {"phase": self.phase, "done": self.done, "time": now}
        if self.total is not None:
            payload["total"] = self.total
        if self.bytes is not None:
            payload["bytes"] = self.bytes
        write_event(self.events_dir, PHASE, payload)
        self.written_at = now


def size_on_disk(paths: Iterable[str | None]) -> int:
    """Bytes of the given files and folders that exist (built-in models and hub names count 0)."""
    total = 0
    for name in paths:
        if not name:
            continue
        path = Path(name)
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            for root, _, files in os.walk(path):
                total += sum((Path(root) / f).stat().st_size for f in files if (Path(root) / f).is_file())
    return total
