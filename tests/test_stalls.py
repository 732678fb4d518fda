"""The stall detector on real tiny runs with the default settings (issue 22): a model that loads slowly is left to
load, a frozen training step is killed and the run resumed. Test hooks: ``SD_COMPAT_TEST_LOAD_DELAY`` (loading
waits, as a large file on a slow disk does), ``SD_COMPAT_INJECT_FREEZE`` (a step that never ends, once) and
``SD_COMPAT_TEST_TRAINING_FLOOR_S`` (the training phase's 60 s floor made 8 s, so the runs take seconds, not
minutes: a load longer than that floor must not be judged by it, a frozen step must be)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import toml
from PIL import Image

from sd_scripts_compat.network.lora_file import read_lora_file

FLOOR_S = 8
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "SD_COMPAT_TEST_TRAINING_FLOOR_S": str(FLOOR_S)}
STEPS = 12


def autotune_run(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    folder = tmp_path / "data" / "1_toy"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"toy, picture {i}", encoding="utf-8")
    config = tmp_path / "run.toml"
    config.write_text(toml.dumps({"max_train_steps": STEPS, "resolution": "64,64", "network_dim": 4,
                                  "learning_rate": 1e-4, "max_data_loader_n_workers": 0, "caption_extension": ".txt",
                                  "output_name": "lora"}))
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(folder.parent), "--model", "builtin:tiny-sd15",
                           "--out", str(out), "--config", str(config), "--save-state-every", "1"],
                          cwd=tmp_path, env={**ENV, **env}, capture_output=True, text=True, timeout=1200)
    return done, out


def retries(out: Path) -> list[dict]:
    path = out / "logs/retries.json"
    return json.loads(path.read_text()) if path.exists() else []


def final_steps(out: Path) -> int:
    return int(read_lora_file(out / "lora.safetensors")[1]["ss_steps"])


@pytest.mark.slow
def test_a_model_that_loads_for_three_training_floors_is_not_killed(tmp_path):
    done, out = autotune_run(tmp_path, {"SD_COMPAT_TEST_LOAD_DELAY": str(3 * FLOOR_S)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert retries(out) == [] and "stall" not in done.stdout
    assert final_steps(out) == STEPS


@pytest.mark.slow
def test_a_frozen_training_step_is_killed_and_the_run_resumed(tmp_path):
    done, out = autotune_run(tmp_path, {"SD_COMPAT_INJECT_FREEZE": "step=5"})
    assert done.returncode == 0, done.stderr[-3000:]
    [retry] = retries(out)
    waited = re.search(r"no progress while training for (\d+) s", retry["message"])
    assert retry["failure"] == "stall" and waited and int(waited[1]) >= FLOOR_S, retry  # 10 steps' time, or the floor
    assert final_steps(out) == STEPS
