"""bench/vs_sd_scripts.py's planned sides: the real `autotune plan` writes the config they run, the bare loop runs
it at the plan's micro-batch under the bench's launcher, and the per-image arithmetic that sets the plan's
micro-batch against the recipe's one image.

The rounds given to ``compare`` are written by hand (named so): the timings come from runs of the user's sd-scripts,
which CI does not have; the bench itself runs them (README's benchmark section).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vs_sd_scripts import (  # noqa: E402
    TIMED_FROM,
    compare,
    images_per_step,
    plan_summary,
    run_side,
    write_plan,
)


def test_the_planned_side_runs_autotune_plans_config_on_a_copy_of_the_dataset(tmp_path):
    config, plan = write_plan(tmp_path, Path("builtin:tiny-sd15"), 64, 6)
    assert config == tmp_path / "planned-plan" / "config.toml" and config.is_file()
    assert plan["resolution"] == "64,64" and plan["network_dim"] == 8 and plan["max_train_steps"] == 6
    assert Path(plan["dataset_config"]).parent == config.parent  # the plan's dataset.toml reads the copy
    assert (tmp_path / "planned-dataset").is_dir() and str(tmp_path / "planned-dataset") in Path(
        plan["dataset_config"]).read_text()
    assert images_per_step(plan) == plan["train_batch_size"] * plan.get("gradient_accumulation_steps", 1)
    summary = plan_summary(plan)
    assert summary.startswith(f"micro-batch {plan['train_batch_size']} x") and "gradient checkpointing" in summary


def test_a_plan_that_fails_stops_the_bench_with_its_message(tmp_path):
    with pytest.raises(SystemExit, match="autotune plan failed"):
        write_plan(tmp_path, tmp_path / "missing.safetensors", 64, 6)


@pytest.mark.long
def test_the_bare_loop_runs_the_plans_config_at_its_micro_batch_under_the_launcher(tmp_path):
    from sd_scripts_compat.facts.families import get_family
    from sd_scripts_compat.models.build import build_modules
    from sd_scripts_compat.models.single_file import save_single_file

    model = save_single_file(build_modules(get_family("tiny-sd15"), seed=0), tmp_path / "tiny.safetensors")
    config, plan = write_plan(tmp_path, model, 64, 4)
    assert plan["train_batch_size"] > 1  # the point of the side: the floor at the plan's batch, not the recipe's 1
    result = run_side("planned-bare", config, tmp_path / "floor", {}, None)
    assert len(result["step_seconds"]) == 4 - TIMED_FROM and all(s > 0 for s in result["step_seconds"])
    assert result["peak_rss_mib"] > 0 and result["wall_s"] > 0


def side(lora: Path, step_s: float, wall_s: float, images: int = 1) -> dict:
    return {"step_seconds": [step_s], "wall_s": wall_s, "peak_rss_mib": 1000.0, "images_per_step": images,
            "lora": str(lora)}


def test_the_planned_ratio_is_per_image_against_the_recipe_per_round(tmp_path):
    import torch
    from safetensors.torch import save_file

    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(8, 4)}, str(lora))
    rounds = [{"ours": side(lora, 1.7, 40), "sd-scripts": side(lora, 2.0, 50), "planned": side(lora, 6.0, 60, 4),
               "planned-bare": side(lora, 5.2, 30, 4)},
              {"ours": side(lora, 1.6, 38), "sd-scripts": side(lora, 1.9, 48), "planned": side(lora, 5.6, 56, 4),
               "planned-bare": side(lora, 4.8, 28, 4)}]
    row = compare("bf16", rounds)
    assert row["same_modules"] and row["modules"] == 1
    assert row["planned_batch"] == 4
    assert row["planned_image_s"] == pytest.approx((1.5 + 1.4) / 2)
    assert row["planned_image_ratio"] == pytest.approx((1.5 / 2.0 + 1.4 / 1.9) / 2)
    assert row["planned_wall_image_ratio"] == pytest.approx((15 / 50 + 14 / 48) / 2)
    assert row["floor_batch"] == 4 and row["floor_image_s"] == pytest.approx((1.3 + 1.2) / 2)
    assert row["floor_image_ratio"] == pytest.approx((1.3 / 2.0 + 1.2 / 1.9) / 2)


def test_peak_rss_is_the_programs_own_not_a_big_parents(tmp_path):
    """ru_maxrss on Linux carries a forking parent's peak through exec; the engine's figure and the bench
    launcher's read VmHWM. The parent here touches 600 MiB before it starts the child; the child's own is ~50."""
    import subprocess

    child = "from sd_scripts_compat.facts.contract import peak_rss_mib; print(peak_rss_mib())"
    parent = ("import subprocess, sys; big = bytearray(600 * 2**20); big[::4096] = b'x' * len(big[::4096]); "
              f"sys.stdout.write(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, "
              "check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True, cwd=ROOT)
    assert float(out.stdout) < 300, out.stdout
