"""``autotune inspect`` as a user runs it: a subprocess on a LoRA we wrote and on files that are not LoRAs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from sd_scripts_compat.config.network_args import NetworkArgs
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora import create_network
from sd_scripts_compat.network.lora_file import TrainingFacts, build_metadata, save_lora_file

ROOT = Path(__file__).resolve().parents[1]


def _autotune(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="160")
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    family = get_family("tiny-sdxl")
    network = create_network(build_modules(family), network_dim=8, network_alpha=4,
                             args=NetworkArgs(conv_dim=2, conv_alpha=1))
    facts = TrainingFacts(output_name="sks_dog", network_dim=8, network_alpha=4.0, learning_rate=1e-4,
                          optimizer="torch.optim.adamw.AdamW", resolution=(64, 64), training_started_at=1.7e9,
                          session_id=7, network_args={"conv_dim": "2", "conv_alpha": "1"}, steps=12, epoch=2,
                          tag_frequency={"5_sks dog": {"sks dog": 4, "grass": 3}})
    path = tmp_path_factory.mktemp("inspect") / "sks_dog.safetensors"
    save_lora_file(path, network.kohya_state_dict(), build_metadata(family, facts), save_dtype="bf16")
    return path


def test_inspect_table(lora_file):
    result = _autotune("inspect", str(lora_file))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "tiny-sdxl" in out
    assert "UNet 168" in out and "lora_te1 x12" in out and "lora_te2 x12" in out
    assert "yes: 26 3x3-conv modules" in out
    assert "bf16" in out and "networks.lora" in out and "sks_dog" in out
    assert "2 tags; top: sks dog (4), grass (3)" in out
    assert "modelspec.architecture" in out and "stable-diffusion-xl-v1-base/lora" in out


def test_inspect_json(lora_file):
    result = _autotune("inspect", str(lora_file), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["family"] == "tiny-sdxl"
    assert info["modules"]["unet"] == 168 and info["modules"]["text_encoders"] == {"lora_te1": 12, "lora_te2": 12}
    assert info["ranks"] == {"2": 26, "8": 166} and info["alphas"] == {"1": 26, "4": 166}
    assert info["precision"] == {"bf16": 384}
    assert info["file_size"] == lora_file.stat().st_size
    assert info["metadata"]["ss_steps"] == "12" and "sshs_model_hash" in info["metadata"]


def test_inspect_not_a_lora(tmp_path):
    base = tmp_path / "base.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(4, 4, 3, 3)}, str(base))
    result = _autotune("inspect", str(base))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "base.safetensors is not a kohya LoRA file" in lines[0] and "base model" in lines[0]
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    result = _autotune("inspect", str(junk))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "junk.safetensors" in result.stderr


def test_inspect_reads_a_100_mb_lora_from_its_header_without_torch_in_under_a_second(tmp_path):
    """A rank-128 LoRA for SD1.5 (the real module names and shapes, zeros, fp16: about 100 MB) answered from the
    header alone: torch is never imported, times show as ISO 8601, and the wall time is a fraction of the second
    the issue allows (the margin is the point: torch's import alone takes longer)."""
    import math
    import time

    from safetensors.numpy import save_file

    from sd_scripts_compat.network.lora import create_network
    from sd_scripts_compat.runtimes import load_base_model

    network = create_network(load_base_model("builtin:sd15", device="meta"), network_dim=128, network_alpha=64.0)
    tensors = {key: (np.full((), 64.0, np.float16) if key.endswith(".alpha") else
                     np.zeros(tuple(value.shape), np.float16)) for key, value in network.state_dict().items()}
    path = tmp_path / "big.safetensors"
    save_file(tensors, str(path), metadata={"ss_training_started_at": "1796225026.6", "ss_network_dim": "128"})
    size = path.stat().st_size
    assert 90e6 < size < 200e6, size
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "autotune", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "safetensors.torch" not in imported
    assert "sd15 (" in done.stdout and "128 x" in done.stdout and "2026-12-02T15:23:46Z" in done.stdout
    assert f"{sum(math.prod(t.shape) for k, t in tensors.items() if k.endswith('.weight')):,}" in done.stdout
    print(f"inspect of a {size / 1e6:.0f} MB LoRA: {seconds:.2f} s (python -X importtime included)")
    assert seconds < 1.0
