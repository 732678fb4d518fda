"""What the adapters of the user's own trainers (sd-scripts, musubi-tuner) share, once: the Python that runs their
checkout and the options a script accepts (read from its ``--help``); their tqdm progress lines; when to save
(steps from a rate, since neither saves by time) and where to stop; the ledger of true steps of the state folders
they wrote; and the hooks on their child process. Each adapter says where to look, what its folders are called
and what to tell the user."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sd_scripts_compat.facts.atomic import write_json_atomic
from sd_scripts_compat.facts.contract import PROGRESS, write_event
from sd_scripts_compat.facts.errors import UserError

OPTION = re.compile(r"(?<![\w-])--(?P<name>[A-Za-z0-9][A-Za-z0-9_]*)")  # an option named on a command line


def option_names(text: str) -> list[str]:
    """Every ``--name`` in ``text`` (a command line, a script's ``--help``), in order."""
    return [match["name"] for match in OPTION.finditer(text)]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def choose_python(given: str | None, bases: Iterable[Path], places: tuple[str, ...], trainer: str,
                  none_found: str) -> tuple[str, str]:
    """(the Python, where it came from): ``--python``, else the first venv at ``places`` under ``bases``, else
    the Python running autotune (``none_found`` says why, e.g. "no venv beside it")."""
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise UserError(f"--python {given}: not an executable file; give the Python that runs {trainer}")
        return given, "given with --python"
    for base in bases:
        for place in places:
            candidate = base / place
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate), f"the venv in {base}"
    return sys.executable, f"{none_found}: the Python running autotune"


def read_help(python: str, script: Path, *, cwd: Path, env: Mapping[str, str], fix: str) -> tuple[str, str]:
    """``script --help``'s (stdout, stderr); a script that cannot run is one line ending in ``fix``."""
    try:
        done = subprocess.run([python, str(script), "--help"], cwd=cwd, env=dict(env), capture_output=True,
                              text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UserError(f"{script}: could not run it with --help ({error}); check --python") from None
    if done.returncode != 0:
        raise UserError(f"{script} --help failed: {last_line(done.stderr or done.stdout)}; {fix}")
    return done.stdout, done.stderr


# ---------------------------------------------------------------- progress lines

_BAR = re.compile(r"(?:^|\r)\s*(?P<desc>[^|\r]*?):?\s*(?P<pct>\d+)%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)"
                  r"\s*\[(?P<inner>[^\]]*)\]")
_RATE = re.compile(r"(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>it/s|s/it)")
_LOSS = re.compile(r"avr_loss=(?P<loss>[-+0-9.eE]+|nan|inf)")
# ASSUMED (both log it): logger.info(f"saving state at step {step_no}")
SAVING = re.compile(r"saving state at step (?P<step>\d+)")


@dataclass(frozen=True)
class Bar:
    """One tqdm redraw: its description, count, total and the rate and loss it shows (None: not yet)."""

    desc: str
    n: int
    total: int
    it_per_s: float | None
    loss: float | None

    @property
    def is_steps(self) -> bool:
        """The training bar is ``tqdm(..., desc="steps")`` in both; others are caching / loading bars."""
        return self.desc.strip().lower() == "steps"


def parse_bar(line: str) -> Bar | None:
    """A tqdm progress line as sd-scripts and musubi-tuner print it, or None for any other line."""
    match = _BAR.search(line)
    if match is None:
        return None
    inner = match["inner"]
    rate = _RATE.search(inner)
    it_per_s = None
    if rate is not None:
        value = float(rate["value"])
        it_per_s = value if rate["unit"] == "it/s" else (1.0 / value if value > 0 else None)
    loss_match = _LOSS.search(inner)
    loss = float(loss_match["loss"]) if loss_match else None
    return Bar(match["desc"], int(match["n"]), int(match["total"]), it_per_s, loss)


def write_progress(events_dir: Path, engine: str, step: int, target: int | None, it_per_s: float | None,
                   loss: float | None = None, phase: str | None = None, **more: object) -> None:
    """The attempt's progress event, in true steps (``more``: what one trainer adds, e.g. sd-scripts' epoch)."""
    payload = {"step": step, **more, "max_train_steps": target, "time": time.time(), "it_per_s": it_per_s,
               "loss": loss, "engine": engine}
    if phase:
        payload["phase"] = phase
    write_event(events_dir, PROGRESS, payload)


# ---------------------------------------------------------------- when to save, where to stop

DEFAULT_IT_PER_S = 1.0  # when neither a plan nor a measurement says: 1 step/s (saves more often than needed)


def save_rate(measured: float | None, planned: float | None) -> tuple[float, str]:
    """The step rate the save interval is reckoned at, and where it came from."""
    if measured:
        return measured, "measured in the last attempt"
    if planned:
        return planned / 2, "half the plan's prediction, to be safe"
    return DEFAULT_IT_PER_S, "no measurement yet"


def save_every_n_steps(save_every_s: float, it_per_s: float | None, target_steps: int | None = None) -> int:
    """Steps between state saves so that one comes about every ``save_every_s`` seconds at ``it_per_s``
    (neither trainer saves by time, only by step or epoch). At least 1; never more than the run is long."""
    rate = it_per_s if it_per_s and it_per_s > 0 else DEFAULT_IT_PER_S
    steps = max(1, int(save_every_s * rate))
    return min(steps, target_steps) if target_steps else steps


def remaining_divisor(remaining: int, wanted: int) -> int:
    """The largest save interval <= ``wanted`` that divides ``remaining``: a save falls on the target step."""
    wanted = max(1, min(wanted, remaining))
    return next(n for n in range(wanted, 0, -1) if remaining % n == 0)


# ---------------------------------------------------------------- the ledger of true steps


@dataclass
class StateLedger:
    """The run's target step and the true step of every state folder the trainer wrote while we watched.

    Kept in the run folder (``autotune run --resume`` reads it back). An entry is ``{"step": true step,
    "confirmed": whole, ...}`` plus what the adapter checks it by (sd-scripts: the ``mtime_ns`` of its
    ``train_state.json``, since a folder rewritten unseen may be half).
    """

    path: Path
    target_steps: int | None = None
    states: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> StateLedger:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls(path)
        if not isinstance(data, dict):
            return cls(path)
        target = data.get("target_steps")
        states: dict[str, dict[str, Any]] = data["states"] if isinstance(data.get("states"), dict) else {}
        if isinstance(data.get("whole"), dict):  # a musubi ledger written before this one: folder -> whole step
            states = {name: {"step": step, "confirmed": True} for name, step in data["whole"].items()
                      if isinstance(step, int)}
        return cls(path, target if isinstance(target, int) else None, states)

    def save(self) -> None:
        write_json_atomic(self.path, {"target_steps": self.target_steps, "states": self.states})

    def newest(self, states_dir: Path, stamp: Callable[[Path], int | None],
               unseen_step: Callable[[Path], int | None] = lambda folder: None) -> tuple[Path, int] | None:
        """The state folder to resume from and its true step: the highest step, then the newest ``stamp``.

        ``stamp`` is None for a folder that is not a state; a recorded folder counts when confirmed and, where
        its entry keeps an ``mtime_ns``, still stamped so; one never recorded at ``unseen_step`` (None: not at
        all).
        """
        best: tuple[int, int, Path] | None = None
        if not states_dir.is_dir():
            return None
        for folder in states_dir.iterdir():
            mark = stamp(folder)
            if mark is None:
                continue
            entry = self.states.get(folder.name)
            if entry is None:
                step = unseen_step(folder)
            elif entry.get("confirmed") and entry.get("mtime_ns", mark) == mark:
                step = int(entry["step"])
            else:
                continue
            if step is not None and (best is None or (step, mark) > best[:2]):
                best = (step, mark, folder)
        return (best[2], best[0]) if best else None


# ---------------------------------------------------------------- the child process


class LineWatch(Protocol):
    events_dir: Path | None

    def feed(self, line: str) -> None: ...

    def ask_step_up(self) -> None:
        """The watchdog wants a step up: stop the child once a state after the step it is at now is whole."""
        ...


class ChildHooks:
    """The ``Engine`` hooks both adapters implement alike: the child's process group (stopped as a group), and its
    output lines fed to this attempt's watch."""

    pid: int | None
    watch: LineWatch | None

    def child_started(self, pid: int) -> None:
        self.pid = pid

    def stop_child(self) -> None:
        from autotune.recovery.attempt import terminate_group

        terminate_group(self.pid)

    def changes_in_process(self, changes: Mapping[str, Any]) -> bool:
        return False  # neither trainer reads a change while it runs: a restart from its saved state makes it

    def stop_for_step_up(self) -> bool:
        """Neither trainer saves a state when stopped: the attempt's watch stops it after its next whole state."""
        assert self.watch is not None, "attempt_argv comes first"
        self.watch.ask_step_up()
        return True

    def line_handler(self, events_dir: Path) -> Callable[[str], None]:
        assert self.watch is not None, "attempt_argv comes first"
        self.watch.events_dir = events_dir
        return self.watch.feed
