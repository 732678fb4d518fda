"""Memory learned per device and family: a measured setting uses its measured peak, a nearby one the memory
model's prediction times measured / predicted of its nearest measured neighbour, never lowered on the word of a
lighter run; hostile store records (NaN, negative, huge, another machine's) teach nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.measure.learned import LearnedFigures, ModelPeak
from autotune.measure.store import Measurement, load_measurements, settings_key, store_path
from autotune.planning.planner import PlanRequest, nominal_dataset, plan_training
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.facts.settings import TrainSettings

REPO = Path(__file__).resolve().parent.parent
DEVICE = "cpu:Test CPU"
TINY = get_family("tiny-sd15")


def _request(records=()) -> PlanRequest:
    return PlanRequest(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(), cpu_physical_cores=2,
                       cpu_memory_bytes=8 * 2**30, measurements=tuple(records), measured_device=DEVICE)


def _done(settings: TrainSettings, peak_mib: float | None, device: str = DEVICE,
          resident_mib: float | None = None) -> Measurement:
    return Measurement(device=device, family="tiny-sd15", settings=settings.to_event(), outcome="done",
                       source="run", seconds_per_step=1.0, peak_memory_mib=peak_mib, steps=4, measured_at=1.0e9,
                       resident_mib=resident_mib)


def _model_mib(values: dict) -> ModelPeak:
    """A stand-in memory model: 1000 MiB per sample of the micro-batch, no resident part said."""
    return ModelPeak(1000.0 * values["train_batch_size"])


def _model_parts(values: dict) -> ModelPeak:
    """A stand-in memory model with its parts: 500 MiB resident (weights, LoRA, state), 1000 MiB of activations
    per sample."""
    return ModelPeak(500.0 + 1000.0 * values["train_batch_size"], resident=500.0)


BASE = replace(plan_training(_request()).settings, gradient_accumulation_steps=1)


def _at(batch: int) -> TrainSettings:
    return replace(BASE, train_batch_size=batch)


def _learned(*records: Measurement) -> LearnedFigures:
    return LearnedFigures(records, DEVICE, TINY)


def test_a_measured_setting_uses_its_peak_and_a_nearby_one_is_scaled_by_its_neighbour():
    exact = _learned(_done(_at(2), 2600.0)).memory(_at(2).to_event(), _model_mib)
    assert (exact.peak_mib, exact.source, exact.factor) == (2600.0, "measured", pytest.approx(1.3))
    scaled = _learned(_done(_at(2), 2600.0)).memory(_at(4).to_event(), _model_mib)
    assert scaled.source == "measured-scaled" and scaled.factor == pytest.approx(1.3)
    assert scaled.peak_mib == pytest.approx(4000.0 * 1.3)
    assert "measured 2600 MiB / model 2000 MiB = x1.3" in scaled.basis
    # the nearest neighbour answers: batch 3's run, not batch 1's
    two = _learned(_done(_at(1), 1500.0), _done(_at(3), 3300.0)).memory(_at(4).to_event(), _model_mib)
    assert two.factor == pytest.approx(1.1)


def test_a_lighter_run_never_lowers_a_heavier_settings_prediction_but_a_heavier_run_does():
    lighter = _learned(_done(_at(1), 800.0)).memory(_at(4).to_event(), _model_mib)
    assert lighter.factor == 1.0 and lighter.peak_mib == pytest.approx(4000.0)
    assert "not lowered" in lighter.basis
    heavier = _learned(_done(_at(8), 6400.0)).memory(_at(4).to_event(), _model_mib)
    assert heavier.factor == pytest.approx(0.8) and heavier.peak_mib == pytest.approx(3200.0)


def test_a_run_that_read_its_resident_memory_corrects_each_part_by_its_own_ratio():
    """Micro-batch 1 measured its resident part as predicted (500 MiB) and its activations at twice the model's:
    micro-batch 4 is predicted with the activations alone doubled (500 + 2 x 4000), where one ratio for the whole
    peak (2500 / 1500) would say 7500 MiB, 12% short."""
    record = _done(_at(1), 2500.0, resident_mib=500.0)
    parts = _learned(record).memory(_at(4).to_event(), _model_parts)
    assert parts.source == "measured-scaled" and parts.peak_mib == pytest.approx(8500.0)
    assert parts.factor == pytest.approx(8500.0 / 4500.0)
    assert ("resident measured 500 MiB / model 500 MiB = x1, the rest of the peak measured 2000 MiB / model "
            "1000 MiB = x2") in parts.basis
    whole = _learned(replace(record, resident_mib=None)).memory(_at(4).to_event(), _model_parts)
    assert whole.peak_mib == pytest.approx(4500.0 * 2500.0 / 1500.0) and "resident" not in whole.basis


def test_a_lighter_runs_part_below_the_model_does_not_lower_that_part():
    """Micro-batch 1 measured its resident part at half the model's and its activations at 1.5 times: for micro-batch
    4 the resident part is kept at the model's (a lighter run), the activations raised."""
    parts = _learned(_done(_at(1), 1750.0, resident_mib=250.0)).memory(_at(4).to_event(), _model_parts)
    assert parts.peak_mib == pytest.approx(500.0 + 1.5 * 4000.0) and "not lowered" in parts.basis
    heavier = _learned(_done(_at(8), 250.0 + 0.5 * 8000.0, resident_mib=250.0)).memory(_at(4).to_event(),
                                                                                       _model_parts)
    assert heavier.peak_mib == pytest.approx(250.0 + 0.5 * 4000.0) and "not lowered" not in heavier.basis


@pytest.mark.parametrize(("peak", "resident"), [(2500.0, 0.0), (2500.0, 2500.0), (2500.0, 3000.0)])
def test_a_resident_figure_that_splits_nothing_falls_back_to_one_ratio(peak, resident):
    memory = _learned(_done(_at(1), peak, resident_mib=resident)).memory(_at(4).to_event(), _model_parts)
    assert memory.peak_mib == pytest.approx(4500.0 * peak / 1500.0) and "resident" not in memory.basis


def test_a_measured_peak_on_a_gpu_gets_the_cuda_context_back():
    """CUDA's max reserved, the figure a run stores, leaves the CUDA context out; the plan checks the card against
    the peak with it, so the measured setting's peak is the reserved figure plus the context (the model's here,
    none measured), not the reserved figure alone (which was a context too optimistic)."""
    from autotune.estimate.memory_model import DEFAULT_CUDA_CONTEXT_GIB
    from autotune.planning.request import gpu_from_vram

    card = "cuda:NVIDIA Test GPU"

    def on_card(*records: Measurement):
        return plan_training(PlanRequest(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(),
                                         gpus=(gpu_from_vram(12),), cpu_physical_cores=2,
                                         cpu_memory_bytes=8 * 2**30, measurements=records, measured_device=card))

    model = on_card()
    measured = on_card(_done(model.settings, 1800.0, device=card))
    assert measured.settings == model.settings and measured.prediction.memory_source == "measured"
    assert measured.prediction.peak_bytes == int(1800.0 * 2**20) + int(DEFAULT_CUDA_CONTEXT_GIB * 2**30)


@pytest.mark.parametrize("figure", [math.nan, -512.0, math.inf, 1e300, "2600", True])
def test_a_record_whose_peak_is_no_measurement_teaches_nothing(tmp_path, monkeypatch, figure):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    record = _done(_at(2), 2600.0).to_json()
    record["peak_memory_mib"] = record["resident_mib"] = figure
    record["memory"] = {"cuda_max_reserved_mib": figure, "peak_rss_mib": 100.0}
    store_path().write_text(json.dumps({"schema_version": 1, "records": [record]}), encoding="utf-8")
    (loaded,) = load_measurements()
    assert loaded.peak_memory_mib is None and loaded.memory == {"peak_rss_mib": 100.0}
    assert loaded.resident_mib is None
    memory = _learned(loaded).memory(_at(2).to_event(), _model_mib)
    assert (memory.peak_mib, memory.source) == (None, "model")


def test_the_plan_says_where_its_memory_figure_comes_from_and_another_machines_records_do_not_count():
    model = plan_training(_request())
    assert model.prediction.memory_source == "model" and model.prediction.memory_factor == 1.0
    chosen = model.settings
    measured_mib = 1.5 * model.prediction.peak_bytes / 2**20
    exact = plan_training(_request([_done(chosen, measured_mib)]))
    assert exact.settings == chosen and exact.prediction.memory_source == "measured"
    assert exact.prediction.peak_bytes == int(measured_mib * 2**20)
    assert exact.prediction.memory_factor == pytest.approx(1.5, rel=1e-3)
    other_rank = plan_training(_request([_done(chosen.with_rank(chosen.network_dim * 2, 4.0), 10 * measured_mib)]))
    out = other_rank.to_dict()["prediction"]
    assert out["memory_source"] == "measured-scaled" and out["memory_factor"] > 1.0
    assert "model" in out["memory_basis"] and "run on cpu:Test CPU" in out["memory_basis"]
    elsewhere = plan_training(_request([_done(chosen, measured_mib, device="cpu:Another CPU")]))
    assert elsewhere.prediction.memory_source == "model"
    assert elsewhere.prediction.peak_bytes == model.prediction.peak_bytes


def _autotune(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=900)


@pytest.mark.long
def test_a_run_stores_its_peak_beside_the_prediction_and_the_next_plan_uses_it(tmp_path):
    """A real run of the quickstart's plan on this CPU stores its measured peak and the memory model's
    prediction; `autotune plan` for this machine then predicts that peak (source "measured") and a larger
    micro-batch from it (source "measured-scaled")."""
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    dataset = str(REPO / "examples" / "dataset")
    run = _autotune("run", dataset, "--model", "builtin:tiny-sd15", "--steps", "6", "--out", str(tmp_path / "run"),
                    env=env)
    assert run.returncode == 0, run.stderr[-2000:]  # (beside other work it keeps its memory, not its speed)
    stored = json.loads((tmp_path / "cache" / "measurements.json").read_text(encoding="utf-8"))["records"]
    (record,) = stored
    assert record["peak_memory_mib"] > 100 and record["predicted_mib"] > 0
    plan = json.loads(_autotune("plan", dataset, "--model", "builtin:tiny-sd15", "--json", env=env).stdout)
    assert settings_key(plan["settings"]) == settings_key(record["settings"])  # (--steps moved the warmup)
    assert plan["prediction"]["memory_source"] == "measured"
    assert plan["prediction"]["peak_bytes"] == int(record["peak_memory_mib"] * 2**20)
    batch = plan["settings"]["train_batch_size"] * 2
    bigger = json.loads(_autotune("plan", dataset, "--model", "builtin:tiny-sd15", "--json", "--batch", str(batch),
                                  env=env).stdout)
    assert bigger["prediction"]["memory_source"] == "measured-scaled"
    assert bigger["prediction"]["peak_bytes"] > plan["prediction"]["peak_bytes"]
    text = " ".join(_autotune("plan", dataset, "--model", "builtin:tiny-sd15", env=env).stdout.split())
    assert "memory: measured (run on cpu:" in text
