"""Where a run's files go when the user names no folder: ``output/<dataset>-<family>``, one folder per model trained
on a dataset (``autotune run`` and the wizard alike), so two models trained on one dataset never share a folder."""

from __future__ import annotations

import re
from pathlib import Path

DEFAULT_ROOT = Path("output")


def run_name(dataset_dir: Path, family: str) -> str:
    """``<dataset folder>-<family>``, with anything but letters, digits, ``_`` and ``-`` made ``_``."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(dataset_dir).name).strip("_") or "lora"
    return f"{stem}-{family}"


def default_out(dataset_dir: Path, family: str) -> Path:
    return (DEFAULT_ROOT / run_name(dataset_dir, family)).resolve()
