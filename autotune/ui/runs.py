"""The web app's runs: every run folder under ``--runs``, started from the page or the CLI, read from its files.

A run started here is ``python -m autotune.ui.start_run RECORD OUT``: the request the server validated, kept in
``RUNS/.autotune-ui/RUN.json``, run through ``autotune run``'s own function (the watchdog, the step-down ladder and
resume are the CLI's; no command line is made from the page's values), spawned in a session of its own so that it
outlives the page and the server. One
GPU trains one run at a time: a start while another trains joins a queue kept in ``RUNS/.autotune-ui/queue.json``,
which a restarted server reads back and keeps serving. Nothing of a run's state lives in the server: the state
comes from the folder (the run's OS lock says it is alive; ``logs/decisions.jsonl`` how it went; the engine's
``progress.json`` where it is), so a restarted server finds running and finished runs as they are.

States: queued, running, stepping down (its last attempt ran out of memory and it resumes with less), rolled back
(its loss diverged and it resumes from a good state), done, failed, interrupted, and unreadable: a file of the run
(its progress, decisions, record, plan) that is not what the engine writes; one line says which, and the list, the
queue and the other runs go on. Every file read here is validated by its model below; run names are ``RunName``s.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from stat import S_ISREG
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from autotune.layout import DECISIONS_JSONL, EVENTS_DIR, MARKERS, PLAN_FILE, is_run_name, run_name
from autotune.ui.errors import BadRequest
from autotune.ui.schemas import RunName
from autotune.ui.security import AccessPolicy

UI_DIR = ".autotune-ui"  # in the runs folder: the queue, each started run's command and console output
QUEUE_FILE = "queue.json"
FINAL_FAILURES = ("crash", "user_error", "disk_full", "bad_data", "give_up", "exhausted", "unstable")
STEPPING_DOWN = ("oom", "os_kill")
ROLLED_BACK = ("diverged",)
PROGRESS_FILE = "progress.json"


class Progress(BaseModel):
    """The engine's ``progress.json``: where the run is (other keys pass through to the page)."""

    model_config = ConfigDict(extra="allow")
    step: int | None = None
    max_train_steps: int | None = None
    it_per_s: float | None = None
    loss: float | None = None
    lr: float | None = None
    peak_memory_mib: float | None = None


class Decision(BaseModel):
    """One line of ``logs/decisions.jsonl``: the watchdog's event and its one line."""

    model_config = ConfigDict(extra="allow")
    event: str
    text: str | None = None


class EngineChoice(BaseModel):
    """The engine a run trains with, as ``autotune ui`` offers it: its name and its own ``--engine`` / ``--python``."""

    name: str
    engine: str
    python: str | None = None


class Record(BaseModel):
    """``RUNS/.autotune-ui/RUN.json``: how the server started the run: the validated values of ``autotune run``'s
    options and the engine (None: ours); ``argv``: a run recorded by an earlier server as a command line."""

    values: dict[str, Any] | None = None
    engine: EngineChoice | None = None
    argv: list[str] = []
    dataset: str | None = None
    model: str | None = None
    created: float | None = None


class QueueEntry(BaseModel):
    id: RunName
    resume: bool = False
    argv: list[str] = []  # a queue an earlier server wrote: the command line to run


class Prediction(BaseModel):
    peak_bytes: int | None = None
    usable_bytes: int | None = None
    ram_peak_bytes: int | None = None
    ram_usable_bytes: int | None = None


class PlanFile(BaseModel):
    """What the run page reads of ``plan.json``: the family, the card and the predicted peaks."""

    family: str | None = None
    device: Any = None
    prediction: Prediction = Prediction()


class Unreadable(Exception):
    """A run file that is not what its model says: the run shows ``unreadable`` with this one line."""


class RunStore:
    """The runs under ``runs_dir`` and the queue; ``tick`` starts the next queued run when none trains."""

    def __init__(self, runs_dir: Path, policy: AccessPolicy) -> None:
        self.runs_dir, self.policy = runs_dir, policy
        self.ui_dir = runs_dir / UI_DIR
        self.lock = threading.Lock()
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    # ---- reading -------------------------------------------------------------------------------------

    def ids(self) -> list[str]:
        found = set()
        if self.runs_dir.is_dir():
            found |= {p.name for p in self.runs_dir.iterdir() if p.is_dir() and _is_run(p)}
        if self.ui_dir.is_dir():
            found |= {p.stem for p in self.ui_dir.glob("*.json") if p.name != QUEUE_FILE}
        return sorted(name for name in found if is_run_name(name))

    def folder(self, run_id: str) -> Path:
        if not is_run_name(run_id):
            raise BadRequest(f"run {run_id[:80]!r}: not a run name (letters, digits, '.', '_', '-'; up to 128)",
                             status=404)
        folder = (self.runs_dir / run_id).resolve()
        if folder.parent != self.runs_dir.resolve() or run_id not in self.ids():
            raise BadRequest(f"run {run_id}: no such run under {self.runs_dir}", status=404)
        return folder

    def info(self, run_id: str) -> dict[str, Any]:
        """One run as the runs page shows it (state, step, it/s, ETA, what it trains)."""
        folder = self.folder(run_id)
        try:
            events = _decisions(folder)  # read once: the state and the duration both come from it
            record = self._record(run_id)
            progress = _read_model(folder / EVENTS_DIR / PROGRESS_FILE, Progress) or Progress()
            plan = _read_model(folder / PLAN_FILE, PlanFile)
        except Unreadable as error:
            return {"id": run_id, "folder": str(folder), "state": "unreadable", "message": str(error)}
        state, message = self.state(run_id, events)
        step, total, rate = progress.step, progress.max_train_steps, progress.it_per_s
        eta = (total - step) / rate if rate and step is not None and total else None
        planned = None if plan is None else {"device": plan.device, **plan.prediction.model_dump()}
        return {"id": run_id, "folder": str(folder), "state": state, "message": message, "step": step,
                "max_train_steps": total, "it_per_s": rate, "eta_s": eta, "loss": progress.loss,
                "lr": progress.lr, "peak_memory_mib": progress.peak_memory_mib,
                "dataset": record.dataset if record else None, "model": record.model if record else None,
                "engine": _engine_of(record), "started_here": record is not None, "planned": planned,
                "family": _family(folder, plan), "duration_s": _duration(events, state),
                **run_outputs(folder, run_id)}

    def state(self, run_id: str, events: list[Decision] | None = None) -> tuple[str, str | None]:
        """The run's state word and its one line (``unreadable`` and why when a file of it is malformed);
        ``events``: its decisions, when the caller has read them."""
        from autotune.launch.out_lock import lock_holder

        folder = self.runs_dir / run_id
        if events is None:
            try:
                events = _decisions(folder)
            except Unreadable as error:
                return "unreadable", str(error)
        last = events[-1].text if events else None
        if lock_holder(folder) is not None or self._starting(run_id):
            after_start = [e.event for e in events if e.event not in ("resume", "cleanup")]
            latest = after_start[-1] if after_start else "start"
            word = ("stepping down" if latest in STEPPING_DOWN else "rolled back" if latest in ROLLED_BACK
                    else "running")
            return word, last
        if run_id in self.queue():
            return "queued", None
        finals = [e for e in events if e.event in ("done", "interrupted", *FINAL_FAILURES)]
        if finals:
            final = finals[-1]
            word = {"done": "done", "interrupted": "interrupted"}.get(final.event, "failed")
            return word, final.text
        log = self.ui_dir / f"{run_id}.log"
        if log.is_file() and not events:  # refused before it trained: its one line
            lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            return "failed", lines[-1] if lines else None
        return "interrupted", last

    def queue(self) -> list[str]:
        return [entry.id for entry in self._queued()]

    def console_log(self, run_id: str) -> Path | None:
        """What the run prints, as in a terminal: the console of a run started here, else its trainer's log."""
        from autotune.layout import CHILD_LOG

        for path in (self.ui_dir / f"{run_id}.log", self.runs_dir / run_id / CHILD_LOG):
            if path.is_file():
                return path
        return None

    def _queued(self) -> list[QueueEntry]:
        """The queue file's entries; one that is not a ``QueueEntry`` is left out (the rest of the queue goes on)."""
        entries = _read_json(self.ui_dir / QUEUE_FILE)
        queued = []
        for entry in entries if isinstance(entries, list) else []:
            try:
                queued.append(QueueEntry.model_validate(entry))
            except ValidationError:
                continue
        return queued

    # ---- changing ------------------------------------------------------------------------------------

    def start(self, values: dict[str, Any], engine: EngineChoice | None, dataset: str, model: str,
              name: str | None) -> dict[str, Any]:
        """Queue ``autotune run`` with the validated ``values`` into a new folder (named for the dataset and
        family, or ``name``; ``-2``, ``-3``... when taken), whose name the LoRA file takes unless the values name it,
        and start it at once when nothing trains."""
        from sd_scripts_compat.models.detect import detect_family

        with self.lock:
            base = name or run_name(Path(dataset), detect_family(model))
            run_id, n = base, 1
            while (self.runs_dir / run_id).exists() or (self.ui_dir / f"{run_id}.json").exists():
                n += 1
                run_id = f"{base}-{n}"
            self.ui_dir.mkdir(parents=True, exist_ok=True)
            if not values.get("output_name"):  # LoRA files named per run, not per dataset: they meet in one folder
                values = {**values, "output_name": run_id}
            record = Record(values=values, engine=engine, dataset=dataset, model=model, created=time.time())
            _write_json(self.ui_dir / f"{run_id}.json", record.model_dump(mode="json"))
            self._enqueue(QueueEntry(id=run_id))
        self.tick()
        return self.info(run_id)

    def resume(self, run_id: str) -> dict[str, Any]:
        """Queue the run once more with ``--resume`` (its own command when it was started here)."""
        state = self.info(run_id)["state"]  # 404 for a run that is not there
        if state in ("running", "stepping down", "rolled back", "queued", "done", "unreadable"):
            raise BadRequest(f"run {run_id} is {state}; only an interrupted or failed run resumes", status=409)
        try:
            record = self._record(run_id)
        except Unreadable as error:
            raise BadRequest(str(error), status=409) from None
        if record is None or (record.values is None and not record.argv):
            raise BadRequest(f"run {run_id} was started from the command line; resume it there with autotune run "
                             f"--resume {self.runs_dir / run_id}", status=409)
        entry = QueueEntry(id=run_id, resume=True, argv=[*record.argv, "--resume"] if record.argv else [])
        with self.lock:
            self._enqueue(entry)
        self.tick()
        return self.info(run_id)

    def stop(self, run_id: str) -> dict[str, Any]:
        """SIGTERM to the run's supervisor (it saves the state and stops the trainer), or out of the queue."""
        from autotune.launch.out_lock import lock_holder

        self.folder(run_id)
        with self.lock:
            queued = self._queued()
            if any(entry.id == run_id for entry in queued):
                _write_queue(self.ui_dir, [e for e in queued if e.id != run_id])
        holder = lock_holder(self.runs_dir / run_id)
        if holder and holder > 0:
            os.kill(holder, signal.SIGTERM)
        return self.info(run_id)

    def tick(self) -> None:
        """Start the first queued run when none trains (called by the server's loop and after each change)."""
        with self.lock:
            if self._busy():
                return
            queued = self._queued()
            if not queued:
                return
            entry, rest = queued[0], queued[1:]
            _write_queue(self.ui_dir, rest)
            log = open(self.ui_dir / f"{entry.id}.log", "ab")  # noqa: SIM115 (the child owns it)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            command = ["autotune", *entry.argv] if entry.argv else [
                "autotune.ui.start_run", str(self.ui_dir / f"{entry.id}.json"), str(self.runs_dir / entry.id),
                *(["--resume"] if entry.resume else [])]
            self.children[entry.id] = subprocess.Popen(
                [sys.executable, "-m", *command], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=self.runs_dir)
            log.close()

    def _enqueue(self, entry: QueueEntry) -> None:
        queued = [e for e in self._queued() if e.id != entry.id]
        _write_queue(self.ui_dir, [*queued, entry])

    def _busy(self) -> bool:
        from autotune.launch.out_lock import lock_holder

        if any(child.poll() is None for child in self.children.values()):
            return True
        return self.runs_dir.is_dir() and any(lock_holder(p) is not None for p in self.runs_dir.iterdir()
                                              if p.is_dir())

    def _starting(self, run_id: str) -> bool:
        child = self.children.get(run_id)
        return child is not None and child.poll() is None

    def _record(self, run_id: str) -> Record | None:
        return _read_model(self.ui_dir / f"{run_id}.json", Record)


def _family(folder: Path, plan: PlanFile | None) -> str | None:
    """The family the run's plan names, else (a run of the user's own config) the one its engine said it trained."""
    from sd_scripts_compat.facts.contract import DONE, read_event

    if plan is not None and plan.family:
        return plan.family
    family = (read_event(folder / EVENTS_DIR, DONE) or {}).get("family")
    return family if isinstance(family, str) else None


def _duration(events: list[Decision], state: str) -> float | None:
    """Seconds from the run's first decision to its last, or to now while it trains (its pauses included)."""
    times = [t for t in (_decision_time(e) for e in events) if t is not None]
    if not times:
        return None
    end = time.time() if state in ("running", "stepping down", "rolled back") else times[-1]
    return max(0.0, end - times[0])


def _decision_time(event: Decision) -> float | None:
    stamp = getattr(event, "time", None)  # DecisionLog's local time, to the second
    try:
        return time.mktime(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, OverflowError):
        return None


def run_outputs(folder: Path, run_id: str) -> dict[str, Any]:
    """What the run wrote that a page links to: the LoRA's size, the report page, the config that trained (the
    final one, else the plan's) and TensorBoard's log folder with the command that shows it."""
    from autotune.layout import CONFIG, FINAL_CONFIG, LOGS_DIR
    from autotune.report.load import run_lora

    lora = run_lora(folder)
    size = _file_size(lora) if folder in lora.resolve().parents else None
    config = next((name for name in (FINAL_CONFIG, CONFIG) if (folder / name).is_file()), None)
    base = f"/api/runs/{run_id}"
    links = {"report": f"{base}/report.html" if (folder / EVENTS_DIR).is_dir() else None,
             "config": f"{base}/files/{config}" if config else None}
    logs = folder / LOGS_DIR
    return {"lora_bytes": size, "links": links, "tensorboard": {"logdir": str(logs),
            "command": f"tensorboard --logdir {shlex.quote(str(logs))}"} if logs.is_dir() else None}


def _file_size(path: Path) -> int | None:
    """A file's size; None when it is no file or is gone (a running trainer trims its older LoRAs between our
    finding one and our look)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size if S_ISREG(stat.st_mode) else None


def _is_run(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in MARKERS)


def _decisions(folder: Path) -> list[Decision]:
    from autotune.ui.events import JsonLines

    decisions = JsonLines(folder / DECISIONS_JSONL)  # whole lines only: one being written is left for later
    decisions.poll()
    try:
        parsed = [Decision.model_validate(line) for line in decisions.lines]
    except ValidationError:
        parsed = None
    if parsed is None or decisions.bad:
        raise Unreadable(f"{DECISIONS_JSONL}: a line that is not a decision of the watchdog "
                         "({\"event\": ..., \"text\": ...})")
    return parsed


def _read_model(path: Path, model: type[Any]) -> Any:
    """``path`` validated by ``model``; None when there is no such file; ``Unreadable`` when it is not one."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise Unreadable(f"{path.name}: cannot be read ({error.strerror})") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise Unreadable(f"{path.name}: not what the run writes there ({_first_problem(error)})") from None


def _first_problem(error: ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    return f"{where}: {first['msg']}"[:160] if where else str(first["msg"])[:160]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _write_queue(ui_dir: Path, entries: list[QueueEntry]) -> None:
    _write_json(ui_dir / QUEUE_FILE, [entry.model_dump() for entry in entries])


def _write_json(path: Path, data: Any) -> None:
    from sd_scripts_compat.facts.atomic import write_json_atomic

    write_json_atomic(path, data)


def _engine_of(record: Record | None) -> str:
    """The engine a run trains with: the one the server offered under its name; an earlier server's command
    line: ``--engine KIND=PATH``'s kind; else autotune's own."""
    if record is not None and record.engine is not None:
        return record.engine.name
    argv = record.argv if record is not None else []
    if "--engine" in argv[:-1]:
        return str(argv[argv.index("--engine") + 1]).partition("=")[0]
    return "autotune"
