"""Stepping up into measured headroom (``autotune.recovery.step_up``): the decision on its own, then real runs of
our engine on this CPU that step up, end at the planned step with the same effective batch, and never go back to
a setting that ran out of memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import toml

from autotune.recovery.step_up import STEADY_STEPS, MemoryWatcher, next_step_up
from sd_scripts_compat.facts.settings import TrainSettings

REPO = Path(__file__).resolve().parent.parent
BASE = replace(TrainSettings(resolution=(512, 512)), train_batch_size=1, gradient_accumulation_steps=4,
               gradient_checkpointing=True)


def _mib(s: TrainSettings) -> float:
    """A stand-in memory model: 1000 MiB, +1000 per sample, +2000 per sample without checkpointing."""
    return 1000.0 + s.train_batch_size * (1000.0 if s.gradient_checkpointing else 3000.0)


def _speed(s: TrainSettings) -> float:
    """A stand-in speed model: images/s grows 20% per micro-batch doubling and 30% without checkpointing."""
    return (1.2 ** (s.train_batch_size.bit_length() - 1)) * (1.0 if s.gradient_checkpointing else 1.3)


def _up(measured: float, budget: float = 10000.0, tried=()):
    return next_step_up(BASE, budget_mib=budget, measured_mib=measured, predict=_mib, images_per_s=_speed,
                        tried=tried)


def test_the_first_move_that_fits_and_pays_is_taken_with_its_measured_reason():
    up = _up(measured=2000.0)  # as predicted: micro-batch 2 needs 3000 MiB
    assert (up.settings.train_batch_size, up.settings.gradient_accumulation_steps) == (2, 2)
    assert up.settings.effective_batch == BASE.effective_batch and up.settings.gradient_checkpointing
    assert up.predicted_mib == pytest.approx(3000.0) and up.scale == pytest.approx(1.0)
    assert "measured peak 2000 MiB of 10000 MiB" in up.reason and "1.20x the images per second" in up.reason


def test_the_measured_ratio_decides_what_fits():
    assert _up(measured=2000.0, budget=3000.0) is None  # 3000 predicted > 90% of 3000
    pessimistic = _up(measured=1400.0, budget=3000.0)  # the model was 43% high here: 2100 MiB fits
    assert pessimistic is not None and pessimistic.settings.train_batch_size == 2
    assert pessimistic.predicted_mib == pytest.approx(2100.0)


def test_a_move_that_ran_out_of_memory_here_is_never_taken_again_nor_anything_heavier():
    oomed = replace(BASE, train_batch_size=2, gradient_accumulation_steps=2)
    up = _up(measured=2000.0, tried=[oomed])
    assert up.settings.train_batch_size == 1 and not up.settings.gradient_checkpointing  # the next rung


def test_a_pinned_micro_batch_is_left_as_given():
    fixed = frozenset({"train_batch_size", "gradient_accumulation_steps"})
    up = next_step_up(BASE, budget_mib=10000.0, measured_mib=2000.0, predict=_mib, images_per_s=_speed, fixed=fixed)
    assert (up.settings.train_batch_size, up.settings.gradient_checkpointing) == (1, False)


def test_a_move_that_does_not_pay_ten_percent_is_not_taken():
    flat = next_step_up(BASE, budget_mib=10000.0, measured_mib=2000.0, predict=_mib,
                        images_per_s=lambda s: 1.0 + 0.05 * s.train_batch_size)
    assert flat is None


def test_the_watcher_looks_for_a_step_down_at_every_event_and_up_once_after_the_steady_steps_not_near_the_end():
    asked = []

    def decide(settings, measured, progress, up):
        asked.append((measured, up))
        return _up(measured) if up else None

    watcher = MemoryWatcher(BASE, decide, "device")
    assert not watcher.see({"step": 5, "max_train_steps": 100, "peak_memory_mib": 1900.0}, None)
    assert not watcher.see({"step": 5 + STEADY_STEPS - 1, "max_train_steps": 100, "peak_memory_mib": 1950.0}, None)
    assert watcher.see({"step": 5 + STEADY_STEPS, "max_train_steps": 100, "peak_memory_mib": 2000.0}, None)
    assert not watcher.see({"step": 50, "max_train_steps": 100, "peak_memory_mib": 2000.0}, None)  # decided
    assert asked == [(1900.0, False), (1950.0, False), (2000.0, True)]
    assert watcher.decision.settings.train_batch_size == 2
    asked.clear()
    late = MemoryWatcher(BASE, decide, "address_space")
    late.see({"step": 0, "max_train_steps": STEADY_STEPS * 2}, 900.0)
    assert not late.see({"step": STEADY_STEPS, "max_train_steps": STEADY_STEPS * 2}, 900.0)  # too near the end
    assert asked == [(900.0, False), (900.0, False)]  # a step down is still looked for; a step up is not
    once = MemoryWatcher(BASE, decide, "device")
    once.see({"step": 0, "max_train_steps": 100}, None)  # no figure yet
    assert not once.see({"step": STEADY_STEPS, "max_train_steps": 100, "peak_memory_mib": 9500.0}, None)
    assert not once.see({"step": STEADY_STEPS + 9, "max_train_steps": 100, "peak_memory_mib": 2000.0}, None)
    assert asked[-2:] == [(9500.0, True), (2000.0, False)]  # the step up was asked once, at the steady step


# The engine reports progress every 2 s (its one host sync): at this machine's ~7 steps/s an event comes every ~14
# steps; 64 steps leave an event after the steady steps and before the end on a machine 4x faster too.
STEPS = 64


def _run(tmp_path: Path, name: str, *extra: str, env: dict[str, str] | None = None,
         steps: int = STEPS) -> tuple[subprocess.CompletedProcess, Path]:
    config = tmp_path / f"{name}.toml"
    config.write_text(toml.dumps({"max_train_steps": steps, "resolution": "64,64", "network_dim": 4,
                                  "optimizer_type": "AdamW", "max_data_loader_n_workers": 0, "train_batch_size": 1,
                                  "gradient_accumulation_steps": 4, "gradient_checkpointing": True,
                                  "caption_extension": ".txt", "seed": 1, "learning_rate": 1e-4,
                                  # still warming up at the end: the last rate says which step the schedule is at
                                  "lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 2 * steps}),
                      encoding="utf-8")
    out = tmp_path / name
    # the budget pinned (64 GiB of address space, its peak sampled): free RAM on a busy machine decides nothing
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(REPO / "examples" / "dataset"), "--model",
                           "builtin:tiny-sd15", "--config", str(config), "--out", str(out), "--memory-limit",
                           "65536", *extra],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done, out


def _finished_at(out: Path) -> int:
    return json.loads(next((out / "logs" / "events").glob("done.json")).read_text(encoding="utf-8"))["steps"]


@pytest.mark.long
def test_a_run_steps_up_into_measured_headroom_and_ends_at_its_step_with_the_same_effective_batch(tmp_path):
    """A user's config with micro-batch 1 x 4 and checkpointing on a CPU with GBs free: after its first steady
    steps the engine takes a larger micro-batch (the speed model's first paying move) at a step boundary, in the
    process, the same effective batch, and ends at its step; --no-step-up keeps the config's settings."""
    _, out = _run(tmp_path, "up")
    log = (out / "logs" / "decisions.log").read_text(encoding="utf-8")
    assert "step up in the process" in log and "measured peak" in log and "resuming from" not in log
    final = toml.loads((out / "config.final.toml").read_text(encoding="utf-8"))
    assert final["train_batch_size"] * final["gradient_accumulation_steps"] == 4
    assert (final["train_batch_size"], final.get("gradient_checkpointing")) != (1, True)  # it stepped up
    assert _finished_at(out) == STEPS
    retries = json.loads((out / "logs" / "retries.json").read_text(encoding="utf-8"))
    assert retries and all(r["failure"] == "step_up" and r["steps_lost"] == 0 for r in retries)  # one at a time
    assert all(len(r["changes"].keys() - {"gradient_accumulation_steps"}) == 1 for r in retries)

    _, kept = _run(tmp_path, "kept", "--no-step-up")
    assert "step up" not in (kept / "logs" / "decisions.log").read_text(encoding="utf-8")
    assert not (kept / "logs" / "retries.json").exists() or json.loads(
        (kept / "logs" / "retries.json").read_text(encoding="utf-8")) == []
    assert _finished_at(kept) == STEPS
    assert _last_lr(out) == pytest.approx(_last_lr(kept), rel=1e-9)  # the same schedule, step for step


def _last_lr(out: Path) -> float:
    lines = (out / "logs" / "events" / "progress.jsonl").read_text(encoding="utf-8").splitlines()
    last = json.loads(lines[-1])
    assert last["step"] == STEPS
    return float(last["lr"])


@pytest.mark.long
def test_a_step_up_that_runs_out_of_memory_steps_down_once_and_never_tries_that_rung_again(tmp_path):
    """An injected OOM above one 64 x 64 sample per micro-batch: the step up to micro-batch 2 fails, the ladder
    steps back to micro-batch 1, and no later attempt tries micro-batch 2 again."""
    _, out = _run(tmp_path, "oom", env={"SD_COMPAT_INJECT_OOM": "pixels_gt=4096"})
    retries = json.loads((out / "logs" / "retries.json").read_text(encoding="utf-8"))
    assert [r["failure"] for r in retries].count("oom") == 1, retries
    assert retries[0]["failure"] == "step_up" and retries[0]["changes"]["train_batch_size"] == [1, 2]
    assert retries[1]["failure"] == "oom" and retries[1]["changes"]["train_batch_size"] == [2, 1]
    assert all(r["changes"].get("train_batch_size", [0, 0])[1] != 2 for r in retries[2:])
    assert _finished_at(out) == STEPS
