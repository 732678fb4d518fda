"""bench/gpu_sharding_check.py, the several-GPU part of issue 53, on this CPU (``--dry-run``: two gloo processes,
a small buffer): the script end to end, its table and its JSON. The GPUs and NCCL are what this machine lacks, so
the link figures are a CPU's; the engine's sharded LoRA is compared with the unsharded one for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_measures_a_gather_and_compares_the_engines_loras(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_sharding_check.py"), "--dry-run", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "sharding.json").read_text(encoding="utf-8"))
    assert result["link"]["backend"] == "gloo" and result["link"]["gbps"] > 0
    assert result["assumed"]["assumed_gbps"] > 0 and result["assumed"]["flux_bytes_per_micro_step"] > 20 * 2**30
    assert result["engine"]["max_abs_difference"] == 0.0 and result["engine"]["tensors"] > 0
    assert result["engine"]["state_split_max_abs_difference"] < 1e-6
    assert "| gloo |" in done.stdout


def test_without_two_gpus_it_says_so_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_sharding_check.py"), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "needs 2 (or --dry-run)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing written
