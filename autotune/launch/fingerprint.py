"""What a run was started from, so that ``--resume`` can tell when it would continue something else.

Recorded in ``state/autotune_run.json`` when a run starts; compared on ``--resume``. The dataset is its file list and
sizes (images and captions; our caches and hidden files left out, they change as a run trains), the model its
path, size and modification time (a file) or its id (built in), the options the user gave that shape the run,
and the bytes of a given ``--config`` / ``--dataset-config``. On ``--resume`` an option or file not given again
keeps the run's own (the resumed run trains from the configs in its folder): only what is given differently counts.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

# the plan options of `autotune run` that change what is trained
OPTIONS = ("family", "goal", "priority", "optimizer", "rank", "resolution", "epochs", "network", "network_arg",
           "no_fp8", "allow_pickle", "batch", "accum", "lr", "alpha", "plan_steps")
_FLAG_OF = {"plan_steps": "steps"}  # an option whose dest is not its flag


def run_fingerprint(args: argparse.Namespace, dataset_dir: Path) -> dict[str, Any]:
    return {"dataset": _dataset(dataset_dir), "model": _model(args.model),
            "options": {name: _plain(getattr(args, name, None)) for name in OPTIONS},
            "config": _file_digest(args.config), "dataset_config": _file_digest(args.dataset_config)}


def changes(started: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs, one short phrase each (empty: the same run)."""
    found = []
    before, after = started.get("dataset") or {}, now["dataset"]
    if before != after:
        found.append(f"the dataset ({before.get('files')} files, {before.get('bytes')} bytes -> "
                     f"{after['files']} files, {after['bytes']} bytes)"
                     if (before.get("files"), before.get("bytes")) != (after["files"], after["bytes"])
                     else "the dataset (files renamed or replaced)")
    if started.get("model") != now["model"]:
        found.append(f"the model ({_label(started.get('model'))} -> {_label(now['model'])})")
    for name, value in now["options"].items():  # an option not given again keeps its value: not a change
        old = (started.get("options") or {}).get(name)
        if value not in (None, False, []) and old != value:
            found.append(f"--{_FLAG_OF.get(name, name).replace('_', '-')} ({old} -> {value})")
    for key, flag in (("config", "--config"), ("dataset_config", "--dataset-config")):
        if now[key] is not None and started.get(key) != now[key]:
            found.append(f"the {flag} file")
    return found


def _dataset(folder: Path) -> dict[str, Any]:
    from sd_scripts_compat.dataset.cache_entries import LATENT_CACHE_SUFFIX, TEXT_CACHE_SUFFIX

    digest = hashlib.sha256()
    files = total = 0
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file() \
                or path.name.endswith((LATENT_CACHE_SUFFIX, TEXT_CACHE_SUFFIX)):
            continue
        size = path.stat().st_size
        digest.update(f"{relative.as_posix()}\0{size}\n".encode())
        files, total = files + 1, total + size
    return {"files": files, "bytes": total, "digest": digest.hexdigest()}


def _model(model: str) -> dict[str, Any]:
    path = Path(model).expanduser()
    if model.startswith("builtin:") or not path.exists():
        return {"id": model}
    target = path / "model_index.json" if path.is_dir() else path
    stat = target.stat() if target.exists() else path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _label(model: dict[str, Any] | None) -> str:
    if not model:
        return "unknown"
    return str(model.get("id") or f"{model.get('path')}, {model.get('size')} bytes")


def _file_digest(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value
