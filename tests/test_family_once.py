"""``autotune run`` turns the model into a ``FamilySpec`` once, at its edge: the engine check, the doctor, the plan,
the run folder's name, the watchdog's job and the measurement store all take that object (the engine, a child
process, reads the file itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

COUNTING = """
import collections, sys, traceback
from pathlib import Path
import sd_scripts_compat.models.detect as detect
calls = collections.Counter()
original = detect.detect_family
def counting(*args, **kwargs):
    frame = traceback.extract_stack()[-2]
    calls[f"{Path(frame.filename).name}:{frame.name}"] += 1
    return original(*args, **kwargs)
detect.detect_family = counting
from autotune.cli import main
code = main(sys.argv[1:])
print("DETECTED", dict(calls))
raise SystemExit(code)
"""


def _detections(tmp_path: Path, *argv: str) -> str:
    """The DETECTED line of ``autotune ARGV``: where detect_family was called from, and how often."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", COUNTING, *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("DETECTED"))


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "config.toml"
    config.write_text('max_train_steps = 2\nresolution = "32,32"\nnetwork_dim = 4\noptimizer_type = "AdamW"\n'
                      'max_data_loader_n_workers = 0\n', encoding="utf-8")
    return config


@pytest.mark.long
def test_a_run_detects_the_family_once(tmp_path):
    line = _detections(tmp_path, "run", str(ROOT / "examples" / "dataset"), "--model", "builtin:tiny-sd15",
                       "--steps", "2", "--vram", "8", "--out", str(tmp_path / "run"))
    assert line == "DETECTED {'run.py:run_family': 1}", line


@pytest.mark.long
def test_a_run_with_a_config_detects_the_family_once(tmp_path):
    """With --config, the doctor reads the config's settings for the same family (it detected again before)."""
    line = _detections(tmp_path, "run", str(ROOT / "examples" / "dataset"), "--model", "builtin:tiny-sd15",
                       "--config", str(_config(tmp_path)), "--out", str(tmp_path / "run"))
    assert line == "DETECTED {'run.py:run_family': 1}", line


def test_the_doctor_with_a_config_detects_the_family_once(tmp_path):
    line = _detections(tmp_path, "doctor", str(ROOT / "examples" / "dataset"), "--model", "builtin:tiny-sd15",
                       "--config", str(_config(tmp_path)))
    assert line == "DETECTED {'diagnose.py:resolve_family': 1}", line
