"""bench/gpu_compile_check.py, the eager-vs-compiled half of bench/gpu_validate.py, on the CPU: the same case code
the GPU runs, on the tiny SD1.5 twin, with dynamo's ``eager`` backend (inductor's compile would take minutes here);
the GPU itself is what this machine lacks, so the figures are not the point, the path is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@pytest.mark.slow
def test_compiled_blocks_and_flop_count_on_the_tiny_twin() -> None:
    import torch

    from bench.gpu_compile_check import _ratios, print_compile_table
    from bench.gpu_validate import device_spec, make_plan, run_case

    spec = device_spec(torch, dry_run=True)
    plan = make_plan("sd15", 24, spec, "character")
    eager = run_case(torch, plan, "tiny-sd15", "cpu", 24, 1, 1, resolution=64, count_flops=True)
    compiled = run_case(torch, plan, "tiny-sd15", "cpu", 24, 1, 1, resolution=64, compile_backend="eager")
    assert eager["flops_per_micro_step"] > 0 and "torch_compile" not in eager
    summary = compiled["torch_compile"]
    assert summary["backend"] == "eager" and summary["blocks"] > 0 and summary["failure"] is None
    assert compiled["timed_micro_steps"] >= 1 and compiled["warmup_seconds"] > 0
    row = {"family": "sd15", "resolution": 64, "train_batch_size": plan.settings.train_batch_size,
           "blocks_to_swap": 0, "eager": eager, "compiled": compiled}
    _ratios(row, rate=1e12)
    assert row["eager_mfu"] == pytest.approx(eager["flops_per_micro_step"] * eager["measured_it_per_s"] / 1e12)
    assert row["compiled_over_eager_s_per_step"] == pytest.approx(
        eager["measured_it_per_s"] / compiled["measured_it_per_s"])
    assert "compile_seconds" in row
    print_compile_table([row])
