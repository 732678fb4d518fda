"""Where a run's files lie: one layout for ``autotune run``, ``autotune plan --out`` and the wizard.

::

    output/<dataset>-<family>/          the default --out: one folder per model trained on a dataset
      config.toml  dataset.toml        the plan: they drop into sd-scripts / lora-scripts unchanged
      config.final.toml  dataset.final.toml   what trained, after any step-down or rollback
      <name>.safetensors               the LoRA (and its intermediate saves; sample/ holds sample images)
      autotune_plan.json               the plan with its reasons and predictions
      autotune_report.html             the report (`autotune report` prints it again)
      state/                           resumable states, the supervisor's run state, the trainer's PID
      logs/                            train.log, decisions.log, retries.json, events/, TensorBoard's logs

Every path below is relative to that folder. ``autotune report``, ``inspect`` and ``run --resume`` accept the
folder or any file in it (``run_root``).
"""

from __future__ import annotations

import re
from pathlib import Path

from sd_scripts_compat.facts.families import FamilySpec

DEFAULT_ROOT = Path("output")

CONFIG = "config.toml"
DATASET_CONFIG = "dataset.toml"
FINAL_CONFIG = "config.final.toml"
FINAL_DATASET_CONFIG = "dataset.final.toml"
PLAN_FILE = "autotune_plan.json"
REPORT_HTML = "autotune_report.html"
LOCK_FILE = ".autotune.lock"  # hidden: an OS lock held while a run trains into the folder

STATE_DIR = "state"  # our engine's state folders; the user's sd-scripts keeps its own beside the LoRA
RUN_STATE = f"{STATE_DIR}/autotune_run.json"  # the supervisor's state: current settings and retries, for --resume
TRAINER_PID = f"{STATE_DIR}/trainer.pid"  # the running trainer's PID, so a --resume never starts a second one
MUSUBI_LEDGER = f"{STATE_DIR}/musubi.json"  # the user's musubi-tuner: the target step and its whole state folders
SD_SCRIPTS_LEDGER = f"{STATE_DIR}/sd_scripts.json"  # the user's sd-scripts: its states' steps

LOGS_DIR = "logs"  # also the plan's logging_dir (TensorBoard)
EVENTS_DIR = f"{LOGS_DIR}/events"  # the engine's progress / oom / done / phase events and monitor.jsonl
CHILD_LOG = f"{LOGS_DIR}/train.log"
DECISIONS_LOG = f"{LOGS_DIR}/decisions.log"
DECISIONS_JSONL = f"{LOGS_DIR}/decisions.jsonl"
RETRY_LOG = f"{LOGS_DIR}/retries.json"

MARKERS = (RUN_STATE, PLAN_FILE, CONFIG)  # a folder holding one of these is a run folder


RUN_NAME_PATTERN = r"^(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"  # a run folder's name: one safe path part


def is_run_name(name: str) -> bool:
    return re.fullmatch(RUN_NAME_PATTERN, name) is not None


def run_name(dataset_dir: Path, family: FamilySpec) -> str:
    """``<dataset folder>-<family>``, with anything but letters, digits, ``_`` and ``-`` made ``_`` (and the stem
    cut to 80 characters, so the name stays a ``RunName``)."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(dataset_dir).name).strip("_")[:80] or "lora"
    return f"{stem}-{family.name}"


def default_out(dataset_dir: Path, family: FamilySpec) -> Path:
    return (DEFAULT_ROOT / run_name(dataset_dir, family)).resolve()


def run_root(path: Path) -> Path | None:
    """The run folder that holds ``path`` (the folder itself, or any file or folder inside it), or None."""
    path = Path(path).expanduser().resolve()
    start = path if path.is_dir() else path.parent
    for folder in (start, *start.parents[:4]):  # the deepest file we write is 4 folders down (TensorBoard's)
        if any((folder / marker).is_file() for marker in MARKERS):
            return folder
    return None
