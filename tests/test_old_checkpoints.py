"""Older checkpoints as lora-scripts users keep them: a ``.ckpt`` through ``autotune plan`` / ``run`` with
``--allow-pickle`` (and refused in one line naming that flag without it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import toml
import torch

from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.models.single_file import original_state_dict
from tests.test_run_e2e import make_dataset

ROOT = Path(__file__).resolve().parents[1]


def tiny_ckpt(path: Path) -> Path:
    bundle = build_modules(get_family("tiny-sd15"))
    torch.save({"state_dict": {k: v.clone() for k, v in original_state_dict(bundle).items()}, "global_step": 1},
               path)
    return path


def autotune(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_ckpt_without_the_flag_is_one_line_naming_it(tmp_path, command):
    data = make_dataset(tmp_path)
    done = autotune(command, str(data), "--model", str(tiny_ckpt(tmp_path / "model.ckpt")), "--cpu-cores", "2",
                    "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "--allow-pickle" in done.stderr and "model.ckpt" in done.stderr and "can run code" in done.stderr
    assert not (tmp_path / "o").exists()


def test_plan_reads_the_family_of_an_allowed_ckpt_and_says_so_in_the_config(tmp_path):
    data = make_dataset(tmp_path)
    done = autotune("plan", str(data), "--model", str(tiny_ckpt(tmp_path / "model.ckpt")), "--allow-pickle",
                    "--out", str(tmp_path / "plan"))
    assert done.returncode == 0, done.stderr[-2000:]
    config = toml.loads((tmp_path / "plan" / "config.toml").read_text())
    assert config["allow_pickle"] is True and config["pretrained_model_name_or_path"].endswith("model.ckpt")
    assert "tiny-sd15" in done.stdout


@pytest.mark.long
def test_run_trains_an_allowed_ckpt(tmp_path):
    data = make_dataset(tmp_path)
    out = tmp_path / "run"
    done = autotune("run", str(data), "--model", str(tiny_ckpt(tmp_path / "model.ckpt")), "--allow-pickle",
                    "--epochs", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(out.glob("*.safetensors"))
