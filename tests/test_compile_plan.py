"""The planner's torch_compile decision: compiled blocks only where this device measured them paying for their
compile over the plan's steps; the compile time counted in the plan's time; `autotune bench --sweep compile=...`
measures both sides for real.

The planner tests feed the store's own records by hand (figures chosen to put the decision on either side); the
bench test compiles tiny-sd15's blocks for real with dynamo's ``aot_eager`` backend (inductor's CPU compile takes
minutes: bench/compile_blocks.py measures it).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_measure import DEVICE, REPO, _autotune, _done, _plan

from autotune.measure.learned import LearnedFigures
from autotune.measure.store import from_done_event, load_measurements
from autotune.planning.compile_choice import BENCH_HINT
from sd_scripts_compat.facts.families import get_family

STEPS = 200
DATASET = str(REPO / "examples" / "dataset")


def _compiled(settings, seconds_per_step: float, compile_seconds: float, backend: str = "aot_eager"):
    return replace(_done(replace(settings, torch_compile=True, dynamo_backend=backend), seconds_per_step),
                   compile_seconds=compile_seconds)


def _choice(plan, key: str):
    return next(c for c in plan.choices if c.key == key)


def test_without_a_compiled_measurement_the_plan_stays_eager_and_says_how_to_measure_one():
    plan = _plan(preferences=_steps())
    assert plan.settings.torch_compile is False and plan.prediction.compile_seconds == 0
    choice = _choice(plan, "torch_compile")
    assert choice.value is False and BENCH_HINT in choice.reason
    assert not any(c.key == "dynamo_backend" for c in plan.choices)


def test_compiled_blocks_are_planned_where_the_measured_saving_exceeds_the_compile_and_the_compile_is_timed():
    eager = _plan(preferences=_steps()).settings
    plan = _plan([_done(eager, 2.0), _compiled(eager, 1.0, compile_seconds=50.0)], preferences=_steps())
    assert plan.settings.torch_compile is True and plan.settings.dynamo_backend == "aot_eager"
    prediction = plan.prediction
    assert prediction.optimizer_steps == STEPS and prediction.seconds_per_step == pytest.approx(1.0)
    assert prediction.total_seconds == pytest.approx(STEPS * 1.0 + 50.0) and prediction.compile_seconds == 50.0
    assert prediction.speed_source == "measured" and "compiled (aot_eager)" in prediction.speed_basis
    reason = _choice(plan, "torch_compile").reason
    assert f"saves 200 s over {STEPS} steps, more than its 50 s compile" in reason, reason
    assert _choice(plan, "dynamo_backend").value == "aot_eager"
    assert plan.kohya_values()["torch_compile"] is True


@pytest.mark.parametrize(("compiled_step", "compile_seconds", "why"), [
    (1.0, 500.0, f"would save 200 s over {STEPS} steps, less than its compile"),
    (3.0, 1.0, f"would save 0 s over {STEPS} steps, less than its compile"),  # compiled is slower here
])
def test_a_compile_that_does_not_pay_for_itself_over_the_plan_stays_eager(compiled_step, compile_seconds, why):
    eager = _plan(preferences=_steps()).settings
    plan = _plan([_done(eager, 2.0), _compiled(eager, compiled_step, compile_seconds)], preferences=_steps())
    assert plan.settings.torch_compile is False
    assert plan.prediction.seconds_per_step == pytest.approx(2.0) and plan.prediction.compile_seconds == 0
    assert why in _choice(plan, "torch_compile").reason


def test_a_compiled_run_is_stored_under_a_compiled_key_with_its_compile_time_and_a_failed_compile_not_at_all():
    settings = _plan().settings.to_event()
    done = {"settings": {**settings, "torch_compile": True, "dynamo_backend": "inductor"}, "step_seconds": [0.5] * 4,
            "torch_compile": {"backend": "inductor", "blocks": 5, "graphs": 5, "seconds": 42.0, "failure": None}}
    record = from_done_event(done, device=DEVICE, family=get_family("tiny-sd15"), source="run")
    assert record.key["torch_compile"] is True and record.compile_seconds == 42.0
    failed = {**done, "torch_compile": {**done["torch_compile"], "failure": "down_blocks.0: BackendCompilerFailed"}}
    tiny = get_family("tiny-sd15")
    assert from_done_event(failed, device=DEVICE, family=tiny, source="run") is None  # it trained eager
    # the eager settings learn nothing from a compiled record: no exact match, and never scaled across
    learned = LearnedFigures([record], DEVICE, get_family("tiny-sd15"))
    assert learned.speed(settings, lambda values: 1.0).speed_source == "model"
    assert learned.compiled(settings) == record


def _steps():
    from autotune.planning.planner import Preferences

    return Preferences(steps=STEPS)


@pytest.mark.slow  # ~100 s: aot_eager compiles tiny-sd15's five blocks and their dynamic-size versions in ~60 s
def test_bench_measures_compiled_blocks_beside_eager_and_the_plan_decides_from_both():
    bench = _autotune("bench", DATASET, "--model", "builtin:tiny-sd15", "--steps", "2", "--warmup", "2", "--sweep",
                      "compile=off,aot_eager")
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert any(line.startswith("compile=aot_eager: ") and " blocks compiled (aot_eager, " in line
               for line in bench.stdout.splitlines()), bench.stdout
    records = {r.key["torch_compile"]: r for r in load_measurements()}
    assert set(records) == {False, True} and records[True].settings["dynamo_backend"] == "aot_eager"
    assert records[True].compile_seconds > 0 and records[False].compile_seconds is None
    plan = json.loads(_autotune("plan", DATASET, "--model", "builtin:tiny-sd15", "--steps", str(STEPS),
                                "--json").stdout)
    saved = STEPS * (records[False].seconds_per_step - records[True].seconds_per_step)
    assert plan["settings"]["torch_compile"] is (saved > records[True].compile_seconds)
    reason = next(c["reason"] for c in plan["choices"] if c["key"] == "torch_compile")
    assert f"{records[True].compile_seconds:.0f} s" in reason and "bench on cpu:" in reason, reason
