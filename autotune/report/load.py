"""A finished (or stopped) run's files, read for the report: the engine's events, its monitor trace, the plan.

An ``autotune run`` output folder (``autotune.layout``) holds ``logs/events/`` (done.json with its ``phases`` block,
progress.json, monitor.jsonl) and ``autotune_plan.json`` (the plan ``autotune run`` trained with). An engine's own
events folder (``--autotune_events_dir``) is read the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.layout import EVENTS_DIR, PLAN_FILE, RUN_STATE, run_root
from sd_scripts_compat.facts.errors import UserError


@dataclass(frozen=True)
class RunFiles:
    """What one run left behind; the monitor figures are those of its last engine process (attempt)."""

    folder: Path
    events_dir: Path
    done: dict[str, Any] | None
    progress: dict[str, Any] | None
    plan: dict[str, Any] | None
    header: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0
    resumed_changed: list[str] = field(default_factory=list)  # what changed before a --resume-changed

    @property
    def phases(self) -> dict[str, Any] | None:
        phases = (self.done or {}).get("phases")
        return phases if isinstance(phases, dict) and isinstance(phases.get("seconds"), dict) else None

    @property
    def max_steps(self) -> int | None:
        return self.header.get("max_steps") or (self.progress or {}).get("max_train_steps")


def load_run(folder: str | Path) -> RunFiles:
    """The run in ``folder`` (an ``autotune run --out`` or an events folder); a one-line UserError when there
    is none."""
    from autotune.report.detector import attempts
    from sd_scripts_compat.facts.contract import DONE, MONITOR_FILE, PROGRESS, read_event
    from sd_scripts_compat.training.monitor import read_monitor

    root = run_folder(Path(folder).expanduser())
    if not root.is_dir():
        raise UserError(f"{folder}: no such folder; give the --out folder of an autotune run "
                        "(or an engine's --autotune_events_dir)")
    events = root / EVENTS_DIR if (root / EVENTS_DIR).is_dir() else root
    done, progress = read_event(events, DONE), read_event(events, PROGRESS)
    runs = attempts(read_monitor(events / MONITOR_FILE))
    if done is None and progress is None and not runs:
        raise UserError(f"{folder}: no run to report here (no done.json, progress.json or {MONITOR_FILE} in "
                        f"{events}); give the --out folder of an autotune run")
    header, samples = runs[-1] if runs else ({}, [])
    changed = (_read_json(root / RUN_STATE) or {}).get("resumed_changed")
    return RunFiles(folder=root, events_dir=events, done=done, progress=progress, plan=_read_json(root / PLAN_FILE),
                    header=header, samples=samples, attempts=len(runs),
                    resumed_changed=[str(c) for c in changed] if isinstance(changed, list) else [])


def run_folder(path: Path) -> Path:
    """The run a path belongs to: the run folder holding it (the folder itself, the LoRA, ``config.toml``, a
    report page, anything under ``state/`` or ``logs/``), or an events folder itself; else the path as given."""
    if path.is_dir() and any((path / name).is_file() for name in ("done.json", "progress.json")):
        return path  # an engine's events folder itself
    root = run_root(path)
    return root if root is not None else path


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_lora(path: Path) -> Path:
    """A file as it is; a run folder (``autotune run --out``): the LoRA its done.json names, else its newest LoRA
    (state folders and cache files left out)."""
    if not path.is_dir():
        return path
    from sd_scripts_compat.facts.atomic import is_being_written
    from sd_scripts_compat.facts.contract import DONE, read_event

    done = read_event(run_folder(path) / EVENTS_DIR, DONE) or read_event(path, DONE) or {}
    if done.get("output_file") and Path(done["output_file"]).is_file():
        return Path(done["output_file"])
    found = [(modified, p) for pattern in ("*.safetensors", "*/*.safetensors") for p in path.glob(pattern)
             if not p.parent.name.endswith("-state") and not is_being_written(p)
             and not p.name.endswith((".latents.safetensors", ".te.safetensors"))
             and (modified := _modified_ns(p)) is not None]
    if not found:
        return path  # describe_lora_file says it is no file
    return max(found)[1]


def _modified_ns(path: Path) -> int | None:
    """A file's modification time; None when it is gone (a running trainer trims its older LoRAs between our
    listing and our look: a page asking then got a 500)."""
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None
