"""Plans that learn: the measurement store, what the planner takes from it, and `autotune bench` (real runs).

The store lives in the per-test ``AUTOTUNE_CACHE_DIR`` (tests/conftest.py). Planner tests feed records by hand
(the store's own type); the bench tests train builtin:tiny-sd15 for real and read the store back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.measure.learned import heavier_or_equal
from autotune.measure.store import (
    Measurement,
    load_measurements,
    record_measurements,
    settings_key,
    store_path,
)
from autotune.planning.planner import PlanRequest, nominal_dataset, plan_training
from sd_scripts_compat.facts.settings import TrainSettings

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cpu:Test CPU"


def _plan(records=(), **kwargs):
    return plan_training(PlanRequest(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(),
                                     cpu_physical_cores=2, cpu_memory_bytes=8 * 2**30, measurements=tuple(records),
                                     measured_device=DEVICE, **kwargs))


def _done(settings: TrainSettings, seconds_per_step: float, device: str = DEVICE) -> Measurement:
    return Measurement(device=device, family="tiny-sd15", settings=settings.to_event(), outcome="done",
                       source="bench", seconds_per_step=seconds_per_step, peak_memory_mib=600.0, steps=4,
                       measured_at=1.0e9)


def test_store_round_trip_replaces_the_same_key_and_an_oom_it_clears():
    base = TrainSettings(train_batch_size=2, resolution=(256, 256), network_dim=8)
    oom = Measurement(device=DEVICE, family="tiny-sd15", settings=base.to_event(), outcome="oom", source="run")
    record_measurements([oom, _done(replace(base, train_batch_size=1), 0.5)])
    record_measurements([_done(base, 0.4), _done(base, 0.3)])  # the newer of the same key wins; the OOM goes
    records = load_measurements()
    assert [(r.outcome, r.key["train_batch_size"], r.seconds_per_step) for r in records] == \
        [("done", 1, 0.5), ("done", 2, 0.3)]
    document = json.loads(store_path().read_text())
    assert document["schema_version"] == 1 and len(document["records"]) == 2
    assert records[1].micro_steps_per_s == pytest.approx(1 / 0.3)
    assert not list(store_path().parent.glob("*.tmp"))  # written atomically, nothing left behind


def test_a_corrupt_store_is_ignored_with_one_warning_and_plan_still_answers(capsys):
    store_path().parent.mkdir(parents=True, exist_ok=True)
    store_path().write_text("{not json", encoding="utf-8")
    assert load_measurements() == []
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and str(store_path()) in warning[0] and "ignored" in warning[0]
    done = subprocess.run([sys.executable, "-m", "autotune", "plan", str(REPO / "examples" / "dataset"),
                           "--model", "builtin:tiny-sd15", "--json"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prediction"]["speed_source"] == "model"
    assert [line for line in done.stderr.splitlines() if line.startswith("warning:")] == [warning[0]]
    record_measurements([_done(TrainSettings(), 1.0)])  # a new record starts the store afresh
    assert len(load_measurements()) == 1


def test_plan_uses_an_exact_measurement_scales_the_nearest_and_falls_back_to_the_model():
    model = _plan()
    assert model.prediction.speed_source == "model"
    chosen = model.settings
    exact = _plan([_done(chosen, 2.0), *[_done(replace(chosen, train_batch_size=b,
                                                      gradient_accumulation_steps=4 // b), 50.0) for b in (1, 2)]])
    assert exact.settings == chosen
    assert exact.prediction.speed_source == "measured"
    assert exact.prediction.seconds_per_step == pytest.approx(2.0)
    assert "bench on cpu:Test CPU" in exact.prediction.speed_basis
    other_rank = _plan([_done(chosen.with_rank(8, 4.0), 2.0)])
    assert other_rank.prediction.speed_source == "measured-scaled"
    assert "ratio" in other_rank.prediction.speed_basis
    elsewhere = _plan([_done(chosen, 2.0, device="cpu:Another CPU")])
    assert elsewhere.prediction.speed_source == "model"
    assert elsewhere.to_dict()["prediction"]["speed_source"] == "model"


def test_a_setting_that_ran_out_of_memory_here_is_not_proposed_and_the_plan_says_why():
    chosen = _plan().settings
    oom = Measurement(device=DEVICE, family="tiny-sd15", settings=chosen.to_event(), outcome="oom", source="run",
                      budget_mib=None, measured_at=1.0e9)
    plan = _plan([oom])
    assert plan.fits and plan.settings != chosen
    assert plan.settings.train_batch_size < chosen.train_batch_size or plan.settings.gradient_checkpointing
    assert plan.learned and "ran out of memory on cpu:Test CPU" in plan.learned[0]
    assert plan.to_dict()["learned"] == list(plan.learned)
    bigger_budget = replace(oom, budget_mib=100.0)  # it ran out of 100 MiB; this plan has 8 GiB
    assert _plan([bigger_budget]).settings == chosen


def test_heavier_or_equal():
    base = settings_key(TrainSettings(train_batch_size=2, resolution=(256, 256), network_dim=8).to_event())
    assert heavier_or_equal(base, base)
    assert heavier_or_equal({**base, "train_batch_size": 4}, base)
    assert heavier_or_equal({**base, "resolution": [512, 512]}, base)
    assert not heavier_or_equal({**base, "train_batch_size": 1}, base)
    assert not heavier_or_equal({**base, "gradient_checkpointing": True}, base)  # checkpointing added: try it
    assert heavier_or_equal(base, {**base, "gradient_checkpointing": True})
    assert not heavier_or_equal({**base, "mixed_precision": "bf16"}, base)


@pytest.mark.parametrize("argv, needle", [
    (["--sweep", "size=1,2"], "--sweep size=1,2: unknown setting 'size'"),
    (["--sweep", "batch"], "write KEY=V1,V2"),
    (["--sweep", "batch=0"], "not a positive whole number"),
    (["--sweep", "precision=fp8"], "precision 'fp8'"),
    (["--steps", "0"], "--steps 0"),
    (["--warmup", "1"], "--warmup 1: at least 2"),
    (["--config", "/nonexistent/config.toml"], "--config /nonexistent/config.toml: no such file"),
])
def test_bench_bad_options_are_one_line(argv, needle):
    done = subprocess.run([sys.executable, "-m", "autotune", "bench", "--model", "builtin:tiny-sd15", *argv],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in done.stderr


def _autotune(*argv: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *argv], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=timeout, check=False)


@pytest.mark.slow
def test_bench_then_plan_uses_the_measured_figure_then_a_run_is_stored_too(tmp_path):
    """The judged path: a real bench of the quickstart's plan, then `autotune plan` predicts from it (source
    "measured", the stored figure exactly), then a real `autotune run` of that plan stores its own measurement
    (how close the run came to the prediction is bench/learned_plan.py's table, not an assert)."""
    dataset = str(REPO / "examples" / "dataset")
    bench = _autotune("bench", dataset, "--model", "builtin:tiny-sd15", "--steps", "3", "--json")
    assert bench.returncode == 0, bench.stderr[-2000:]
    report = json.loads(bench.stdout)
    (point,) = report["points"]
    assert point["outcome"] == "done" and point["fastest"] and point["timed_steps"] == 3 == len(point["step_seconds"])
    assert point["it_per_s"] > 0 and point["images_per_s"] > 0 and point["memory"]["peak_rss_mib"] > 100
    (stored,) = load_measurements()
    assert stored.source == "bench" and stored.device == report["device"] and stored.device.startswith("cpu:")

    plan = json.loads(_autotune("plan", dataset, "--model", "builtin:tiny-sd15", "--json").stdout)
    assert plan["settings"] == point["settings"]  # the bench measured what the plan chooses
    assert plan["prediction"]["speed_source"] == "measured"
    assert plan["prediction"]["micro_steps_per_s"] == pytest.approx(stored.micro_steps_per_s, rel=1e-12)
    assert plan["prediction"]["seconds_per_step"] == pytest.approx(stored.seconds_per_step, rel=1e-12)
    text = _autotune("plan", dataset, "--model", "builtin:tiny-sd15").stdout
    assert "speed: measured (bench on cpu:" in " ".join(text.split())
    assert json.loads(_autotune("plan", dataset, "--model", "builtin:tiny-sd15", "--json",
                                "--no-learn").stdout)["prediction"]["speed_source"] == "model"

    run = _autotune("run", dataset, "--model", "builtin:tiny-sd15", "--steps", "8", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr[-2000:]
    (newest,) = load_measurements()
    if "this run's speed is not kept for future plans" in run.stdout:  # the other test worker took the CPU
        # its memory replaces the bench's, the bench's speed stays (test_report.py: no speed from a contended run)
        assert newest.source == "run" and (newest.seconds_per_step, newest.steps) == (stored.seconds_per_step,
                                                                                      stored.steps)
        return
    # the run measured the same key: its newer figure replaces the bench's
    assert newest.source == "run" and newest.key == stored.key and newest.seconds_per_step > 0
    assert newest.steps > stored.steps


@pytest.mark.slow
def test_bench_sweep_marks_the_fastest_that_fits_and_its_injected_oom_teaches_the_plan(tmp_path):
    """Four real runs: micro-batch 1 and 4 x fp32 and bf16 autocast (this CPU's engine path for bf16), with an
    injected OOM above one 256 px image per micro-batch; the OOM is stored and the next plan avoids it."""
    env = {"SD_COMPAT_INJECT_OOM": f"pixels_gt={256 * 256}"}
    bench = _autotune("bench", "--model", "builtin:tiny-sd15", "--steps", "2", "--warmup", "2", "--sweep", "batch=1,4",
                      "--sweep", "precision=no,bf16", "--json", "--keep", str(tmp_path / "b"), env=env)
    assert bench.returncode == 0, bench.stderr[-2000:]
    points = {p["label"]: p for p in json.loads(bench.stdout)["points"]}
    assert set(points) == {"batch=1 precision=no", "batch=1 precision=bf16", "batch=4 precision=no",
                           "batch=4 precision=bf16"}
    assert [p["outcome"] for label, p in points.items() if label.startswith("batch=4")] == ["oom", "oom"]
    fitting = [p for label, p in points.items() if label.startswith("batch=1")]
    assert all(p["outcome"] == "done" and p["settings"]["gradient_accumulation_steps"] == 4 for p in fitting)
    assert sum(p["fastest"] for p in points.values()) == 1 and any(p["fastest"] for p in fitting)
    bf16 = json.loads((tmp_path / "b" / "point01" / "events" / "done.json").read_text())
    assert bf16["settings"]["mixed_precision"] == "bf16" and bf16["resolved"]["weight_dtype"] == "bfloat16"
    assert {r.outcome for r in load_measurements()} == {"done", "oom"}
    finished = [line for line in bench.stderr.splitlines()
                if line.startswith("[") and ("it/s" in line or ": oom" in line)]
    assert len(finished) == 4, bench.stderr  # each point said as it finished, not only at the end
    plan = json.loads(_autotune("plan", str(tmp_path / "b" / "dataset"), "--model", "builtin:tiny-sd15",
                                "--json").stdout)
    chosen = plan["settings"]
    assert chosen["train_batch_size"] < 4 or chosen["gradient_checkpointing"]  # not what ran out of memory
    assert any("ran out of memory" in line and "bench" in line for line in plan["learned"])


@pytest.mark.long
def test_bench_piped_prints_the_whole_table_and_its_phase_line_adds_up_to_its_step_time(tmp_path):
    bench = _autotune("bench", "--model", "builtin:tiny-sd15", "--steps", "2", "--warmup", "2", "--no-store")
    assert bench.returncode == 0, bench.stderr[-2000:]
    header = next(line for line in bench.stdout.splitlines() if "point" in line and "outcome" in line)
    assert all(column in header for column in ("it/s", "images/s", "s/step", "peak MiB (RSS)"))
    row = next(line for line in bench.stdout.splitlines() if line.lstrip("│ ").startswith("* "))
    seconds = float(row.split("│")[5])
    phases = next(line for line in bench.stdout.splitlines() if " ms per step: " in line)
    total, parts = phases.split(" ms per step: ")
    assert float(total.split("of ")[-1]) == pytest.approx(1000 * seconds, abs=1)
    shares = [float(part.rsplit(" ", 1)[1]) for part in parts.split(", ")]
    assert sum(shares) == pytest.approx(1000 * seconds, rel=0.01)

