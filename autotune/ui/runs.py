"""The web app's runs: every run folder under ``--runs``, started from the page or the CLI, read from its files.

A run started here is ``python -m autotune run ...`` (the very command the CLI runs, so the watchdog, the step-down
ladder and resume are the same), spawned in a session of its own so that it outlives the page and the server. One
GPU trains one run at a time: a start while another trains joins a queue kept in ``RUNS/.autotune-ui/queue.json``,
which a restarted server reads back and keeps serving. Nothing of a run's state lives in the server: the state
comes from the folder (the run's OS lock says it is alive; ``logs/decisions.jsonl`` how it went; the engine's
``progress.json`` where it is), so a restarted server finds running and finished runs as they are.

States: queued, running, stepping down (its last attempt ran out of memory and it resumes with less), rolled back
(its loss diverged and it resumes from a good state), done, failed, interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from autotune.layout import DECISIONS_JSONL, EVENTS_DIR, MARKERS, PLAN_FILE, run_name
from autotune.ui.security import AccessPolicy

UI_DIR = ".autotune-ui"  # in the runs folder: the queue, each started run's command and console output
QUEUE_FILE = "queue.json"
FINAL_FAILURES = ("crash", "user_error", "disk_full", "bad_data", "give_up", "exhausted", "unstable")
STEPPING_DOWN = ("oom", "os_kill")
ROLLED_BACK = ("diverged",)


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
        return sorted(found)

    def folder(self, run_id: str) -> Path:
        from autotune.ui.api import BadRequest

        folder = (self.runs_dir / run_id).resolve()
        if folder.parent != self.runs_dir.resolve() or run_id not in self.ids():
            raise BadRequest(f"run {run_id}: no such run under {self.runs_dir}", status=404)
        return folder

    def info(self, run_id: str) -> dict[str, Any]:
        """One run as the runs page shows it (state, step, it/s, ETA, what it trains)."""
        folder = self.folder(run_id)
        record = self._record(run_id)
        progress = _read_json(folder / EVENTS_DIR / "progress.json") or {}
        step, total, rate = progress.get("step"), progress.get("max_train_steps"), progress.get("it_per_s")
        eta = (total - step) / rate if rate and step is not None and total else None
        state, message = self.state(run_id)
        argv = record.get("argv") or []
        return {"id": run_id, "folder": str(folder), "state": state, "message": message, "step": step,
                "max_train_steps": total, "it_per_s": rate, "eta_s": eta, "loss": progress.get("loss"),
                "lr": progress.get("lr"), "peak_memory_mib": progress.get("peak_memory_mib"),
                "dataset": record.get("dataset"), "model": record.get("model"),
                "engine": _engine_of(argv), "started_here": bool(record),
                "planned": _planned(folder)}

    def state(self, run_id: str) -> tuple[str, str | None]:
        from autotune.launch.out_lock import lock_holder

        folder = self.runs_dir / run_id
        events = _decisions(folder)
        last = events[-1] if events else {}
        if lock_holder(folder) is not None or self._starting(run_id):
            after_start = [e["event"] for e in events if e["event"] not in ("resume", "cleanup")]
            latest = after_start[-1] if after_start else "start"
            word = ("stepping down" if latest in STEPPING_DOWN else "rolled back" if latest in ROLLED_BACK
                    else "running")
            return word, last.get("text")
        if run_id in self.queue():
            return "queued", None
        finals = [e for e in events if e["event"] in ("done", "interrupted", *FINAL_FAILURES)]
        if finals:
            final = finals[-1]
            word = {"done": "done", "interrupted": "interrupted"}.get(final["event"], "failed")
            return word, final.get("text")
        log = self.ui_dir / f"{run_id}.log"
        if log.is_file() and not events:  # refused before it trained: its one line
            lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            return "failed", lines[-1] if lines else None
        return "interrupted", last.get("text")

    def queue(self) -> list[str]:
        return [entry["id"] for entry in _read_json(self.ui_dir / QUEUE_FILE) or []]

    # ---- changing ------------------------------------------------------------------------------------

    def start(self, argv: list[str], dataset: str, model: str, name: str | None) -> dict[str, Any]:
        """Queue ``autotune run`` with ``argv`` into a new folder (named for the dataset and family, or ``name``)
        and start it at once when nothing trains."""
        from sd_scripts_compat.models.detect import detect_family

        with self.lock:
            base = name or run_name(Path(dataset), detect_family(model).name)
            run_id, n = base, 1
            while (self.runs_dir / run_id).exists() or (self.ui_dir / f"{run_id}.json").exists():
                n += 1
                run_id = f"{base}-{n}"
            self.ui_dir.mkdir(parents=True, exist_ok=True)
            argv = [*argv, "--out", str(self.runs_dir / run_id)]
            _write_json(self.ui_dir / f"{run_id}.json", {"argv": argv, "dataset": dataset, "model": model,
                                                          "created": time.time()})
            self._enqueue(run_id, argv)
        self.tick()
        return self.info(run_id)

    def resume(self, run_id: str) -> dict[str, Any]:
        """Queue the run once more with ``--resume`` (its own command when it was started here)."""
        from autotune.ui.api import BadRequest

        state, _ = self.state(run_id)
        if state in ("running", "stepping down", "rolled back", "queued", "done"):
            raise BadRequest(f"run {run_id} is {state}; only an interrupted or failed run resumes", status=409)
        argv = self._record(run_id).get("argv")
        if not argv:
            raise BadRequest(f"run {run_id} was started from the command line; resume it there with autotune run "
                             f"--resume {self.runs_dir / run_id}", status=409)
        with self.lock:
            self._enqueue(run_id, [*argv, "--resume"])
        self.tick()
        return self.info(run_id)

    def stop(self, run_id: str) -> dict[str, Any]:
        """SIGTERM to the run's supervisor (it saves the state and stops the trainer), or out of the queue."""
        from autotune.launch.out_lock import lock_holder

        self.folder(run_id)
        with self.lock:
            queued = _read_json(self.ui_dir / QUEUE_FILE) or []
            if any(entry["id"] == run_id for entry in queued):
                _write_json(self.ui_dir / QUEUE_FILE, [e for e in queued if e["id"] != run_id])
        holder = lock_holder(self.runs_dir / run_id)
        if holder and holder > 0:
            os.kill(holder, signal.SIGTERM)
        return self.info(run_id)

    def tick(self) -> None:
        """Start the first queued run when none trains (called by the server's loop and after each change)."""
        with self.lock:
            if self._busy():
                return
            queued = _read_json(self.ui_dir / QUEUE_FILE) or []
            if not queued:
                return
            entry, rest = queued[0], queued[1:]
            _write_json(self.ui_dir / QUEUE_FILE, rest)
            log = open(self.ui_dir / f"{entry['id']}.log", "ab")  # noqa: SIM115 (the child owns it)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.children[entry["id"]] = subprocess.Popen(
                [sys.executable, "-m", "autotune", *entry["argv"]], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=self.runs_dir)
            log.close()

    def _enqueue(self, run_id: str, argv: list[str]) -> None:
        queued = [e for e in _read_json(self.ui_dir / QUEUE_FILE) or [] if e["id"] != run_id]
        _write_json(self.ui_dir / QUEUE_FILE, [*queued, {"id": run_id, "argv": argv}])

    def _busy(self) -> bool:
        from autotune.launch.out_lock import lock_holder

        if any(child.poll() is None for child in self.children.values()):
            return True
        return self.runs_dir.is_dir() and any(lock_holder(p) is not None for p in self.runs_dir.iterdir()
                                              if p.is_dir())

    def _starting(self, run_id: str) -> bool:
        child = self.children.get(run_id)
        return child is not None and child.poll() is None

    def _record(self, run_id: str) -> dict[str, Any]:
        return _read_json(self.ui_dir / f"{run_id}.json") or {}


def _planned(folder: Path) -> dict[str, Any] | None:
    """What the run's plan predicted and for which card (the run page draws memory against it)."""
    plan = _read_json(folder / PLAN_FILE)
    if not isinstance(plan, dict):
        return None
    prediction = plan.get("prediction") or {}
    return {"device": plan.get("device"), "peak_bytes": prediction.get("peak_bytes"),
            "usable_bytes": prediction.get("usable_bytes"), "ram_peak_bytes": prediction.get("ram_peak_bytes"),
            "ram_usable_bytes": prediction.get("ram_usable_bytes")}


def _is_run(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in MARKERS)


def _decisions(folder: Path) -> list[dict[str, Any]]:
    from autotune.ui.events import JsonLines

    decisions = JsonLines(folder / DECISIONS_JSONL)  # whole lines only: one being written is left for later
    decisions.poll()
    return decisions.lines


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: Any) -> None:
    from sd_scripts_compat.atomic import write_json_atomic

    write_json_atomic(path, data)


def _engine_of(argv: list[str]) -> str:
    """The engine a run's command line names: ``--engine KIND=PATH``'s kind, else autotune's own."""
    if "--engine" in argv[:-1]:
        return str(argv[argv.index("--engine") + 1]).partition("=")[0]
    return "autotune"
