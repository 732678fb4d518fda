"""The engine registry (``autotune.launch.engines``): ours, the user's sd-scripts and musubi-tuner by name, and an
engine an installed package registers under the ``lora_autotune.engines`` entry points.

A made-up trainer (``toy_train.py``: its own output lines, its own state folders, an out-of-memory line once at step
3) and its engine package (one module and a dist-info folder, written into a temporary folder on ``PYTHONPATH``) run
under the real watchdog through ``autotune run --engine toy=PATH``: the OOM steps down on the memory ladder and the
next attempt resumes at the step the trainer saved. What cannot exist here is a GPU: the OOM is the trainer's line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.launch.engines import OURS, check_engine_trains, engine_for, parse_engine, registered_engines
from autotune.layout import DECISIONS_JSONL
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"

TOY_TRAINER = '''\
"""A made-up trainer: kohya's config keys, its own log lines and state folders, out of memory once at step 3."""
import argparse, os, sys, tomllib
from pathlib import Path

parser = argparse.ArgumentParser()
for option in ("--config_file", "--dataset_config", "--resume", "--states"):
    parser.add_argument(option)
args = parser.parse_args()
flat = {}
for key, value in tomllib.loads(Path(args.config_file).read_text()).items():
    flat.update(value) if isinstance(value, dict) else flat.__setitem__(key, value)
steps, batch = int(flat["max_train_steps"]), int(flat["train_batch_size"])
start = int(Path(args.resume).name[len("toy-step"):]) if args.resume else 0
marks = Path(os.environ["TOY_MARKS"])
marks.mkdir(exist_ok=True)
(marks / f"attempt-from-{start}-batch-{batch}").touch()
states = Path(args.states)
states.mkdir(parents=True, exist_ok=True)
for step in range(start + 1, steps + 1):
    if step == 3 and not (marks / "oomed").exists():
        (marks / "oomed").touch()
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        sys.exit(1)
    print(f"step {step}/{steps} loss {1.0 / step:.4f}", flush=True)
    folder = states / f"toy-step{step:04d}"
    folder.mkdir(exist_ok=True)
    (folder / "whole").touch()
import numpy as np
from safetensors.numpy import save_file
save_file({"toy": np.zeros(1, dtype=np.float32)}, str(Path(flat["output_dir"]) / f"{flat['output_name']}.safetensors"))
'''

TOY_ENGINE = '''\
"""The toy trainer's engine: kohya configs planned by autotune, its lines made into progress events, its folders
read as states."""
import re, sys, time
from dataclasses import replace
from pathlib import Path

from autotune.launch.engines import EngineKind
from autotune.launch.kohya_job import kohya_job
from sd_scripts_compat.facts.kohya_toml import flat_values, read_toml
from sd_scripts_compat.facts.contract import PROGRESS, Outcome, write_event
from sd_scripts_compat.facts.errors import UserError

STATE = re.compile(r"^toy-step(\\d{4})$")
LINE = re.compile(r"^step (\\d+)/(\\d+) loss ([0-9.]+)$")


class ToyEngine:
    def __init__(self, root):
        self.root, self.config = root, None

    def attempt_argv(self, attempt, files, state, log):
        self.config = files.config
        argv = [sys.executable, str(self.root / "toy_train.py"), "--config_file", str(files.config),
                "--states", str(files.states_dir)]
        if files.dataset is not None:
            argv += ["--dataset_config", str(files.dataset)]
        return argv + (["--resume", str(state[0])] if state else [])

    def newest_state(self, states_dir):
        found = [(int(m.group(1)), folder) for folder in states_dir.glob("toy-step*")
                 if (m := STATE.match(folder.name)) and (folder / "whole").is_file()]
        return (max(found)[1], max(found)[0]) if found else None

    def line_handler(self, events_dir):
        def feed(line):
            match = LINE.match(line.strip())
            if match:
                write_event(events_dir, PROGRESS, {"step": int(match.group(1)), "loss": float(match.group(3)),
                                                   "max_train_steps": int(match.group(2)), "time": time.time(),
                                                   "it_per_s": None, "engine": "toy"})
        return feed

    def child_started(self, pid):
        pass

    def finish(self, result, log):
        if result.outcome is not Outcome.DONE:
            return result
        flat = flat_values(read_toml(self.config))
        output = Path(flat["output_dir"]) / f"{flat['output_name']}.safetensors"
        return replace(result, done_event={"output_file": str(output) if output.is_file() else None})


def check(args):
    root = Path(args.engine.partition("=")[2])
    if not (root / "toy_train.py").is_file():
        raise UserError(f"--engine {args.engine}: no toy_train.py there")


def job(args, out, scan, probe, started, family):
    root = Path(args.engine.partition("=")[2]).resolve()
    return kohya_job(args, out, scan, probe, started, family, lambda *_: (ToyEngine(root), out / "toy_states"))


ENGINE = EngineKind(name="toy", checkout="a toy trainer folder", trainer="sd-scripts", check=check, job=job)
'''


def install_toy(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The toy trainer's folder, and the environment in which its engine package is installed."""
    site = tmp_path / "site"
    info = site / "toy_engine-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lora_autotune.engines]\ntoy = toy_engine:ENGINE\n")
    (site / "toy_engine.py").write_text(TOY_ENGINE)
    trainer = tmp_path / "toy"
    trainer.mkdir()
    (trainer / "toy_train.py").write_text(TOY_TRAINER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")])),
           "TOY_MARKS": str(tmp_path / "marks")}
    return trainer, env


def test_a_registered_engine_trains_under_the_watchdog_through_an_oom_and_a_resume(tmp_path):
    trainer, env = install_toy(tmp_path)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(DATASET), "--model", "builtin:tiny-sd15",
                           "--vram", "8", "--steps", "6", "--out", str(out), "--engine", f"toy={trainer}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    marks = sorted(p.name for p in (tmp_path / "marks").iterdir())
    first = next(m for m in marks if m.startswith("attempt-from-0-"))
    resumed = next(m for m in marks if m.startswith("attempt-from-2-"))  # step 2's state: whole when it OOMed
    assert int(resumed.rpartition("-")[2]) < int(first.rpartition("-")[2])  # the ladder's smaller micro-batch
    decisions = [json.loads(line) for line in (out / DECISIONS_JSONL).read_text().splitlines()]
    assert [d["event"] for d in decisions] == ["start", "oom", "resume", "done"]
    assert "out of memory" in decisions[1]["text"] and Path(decisions[2]["state"]).name == "toy-step0002"
    lora = out / "toy_states"
    assert (lora / "toy-step0006" / "whole").is_file()
    lora_line = next(line for line in done.stdout.splitlines() if line.startswith("LoRA: "))
    assert Path(lora_line.removeprefix("LoRA: ")).is_file()


def test_the_registry_names_every_engine_once_and_parses_name_equals_path(tmp_path):
    kinds = registered_engines()
    assert {OURS, "sd-scripts", "musubi-tuner"} <= set(kinds)
    assert parse_engine(None)[0].name == OURS
    kind, path = parse_engine(f"musubi-tuner={tmp_path}")
    assert kind.name == "musubi-tuner" and path == tmp_path
    for bad in ("musubi=/x", "sd-scripts=", f"{OURS}=/x", "nothing"):
        with pytest.raises(UserError, match="expected sd-scripts=PATH .* or musubi-tuner=PATH"):
            parse_engine(bad)


def test_each_family_is_offered_the_engine_that_trains_it():
    assert engine_for(get_family("sdxl")).name == OURS
    assert engine_for(get_family("lumina2")).name == "sd-scripts"
    assert engine_for(get_family("qwen-image")).name == "musubi-tuner"
    kinds = registered_engines()
    with pytest.raises(UserError, match="is not trained by musubi-tuner; drop --engine"):
        check_engine_trains(kinds["musubi-tuner"], get_family("sd15"), "m.safetensors")
    with pytest.raises(UserError, match="trained by musubi-tuner .*add --engine musubi-tuner=PATH"):
        check_engine_trains(kinds[OURS], get_family("qwen-image"), "q.safetensors")


def test_a_broken_engine_package_is_one_line(tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "broken_engine-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lora_autotune.engines]\nbroken = no_such_module:ENGINE\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(UserError, match="engine 'broken' .*cannot load it"):
        registered_engines()
