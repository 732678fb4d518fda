"""The phase timer: sampled steps scaled to the run, events always timed, phases summing to the wall time.

A stand-in clock (a counter the test advances) makes the arithmetic exact; the engine's own numbers are
checked on real runs in tests/test_report.py."""

from __future__ import annotations

import pytest

from sd_scripts_compat.training.phase_timer import PHASES, PhaseTimer, tensorboard_scalars


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run_steps(timer: PhaseTimer, clock: Clock, steps: int, *, data: float, forward: float, backward: float,
              optimizer: float, bookkeeping: float) -> None:
    loader = [object()] * steps
    for _ in timer.batches(_slow(loader, clock, data)):
        with timer.phase("forward"):
            clock.advance(forward)
        with timer.phase("backward"):
            clock.advance(backward)
        with timer.phase("optimizer"):
            clock.advance(optimizer)
        clock.advance(bookkeeping)
        timer.step_done()


def _slow(items: list[object], clock: Clock, seconds: float):
    for item in items:
        clock.advance(seconds)
        yield item


def test_every_step_sampled_on_cpu_and_the_phases_add_up_to_the_wall_time():
    clock = Clock()
    timer = PhaseTimer("cpu", clock=clock, elapsed_before=1.0)
    clock.advance(2.0)  # model loading
    with timer.event("caching"):
        clock.advance(0.5)
    timer.start_loop()
    run_steps(timer, clock, 10, data=0.3, forward=0.2, backward=0.4, optimizer=0.05, bookkeeping=0.05)
    with timer.event("validation"):
        clock.advance(0.7)
    timer.end_loop()
    with timer.event("save"):
        clock.advance(0.25)
    summary = timer.summary()
    seconds = summary["seconds"]
    assert set(seconds) == set(PHASES)
    assert summary["wall_seconds"] == pytest.approx(1.0 + 2.0 + 0.5 + 10.0 + 0.7 + 0.25)
    assert sum(seconds.values()) == pytest.approx(summary["wall_seconds"])
    assert seconds["setup"] == pytest.approx(3.0) and seconds["caching"] == pytest.approx(0.5)
    assert seconds["data"] == pytest.approx(3.0) and seconds["backward"] == pytest.approx(4.0)
    assert seconds["validation"] == pytest.approx(0.7) and seconds["save"] == pytest.approx(0.25)
    assert seconds["other"] == pytest.approx(0.5)  # the bookkeeping between phases
    assert summary["sampled_steps"] == 10 == summary["steps"] and summary["method"] == "perf_counter"
    assert summary["sampled_ms_per_step"]["forward"] == pytest.approx(200.0)
    assert summary["step_seconds"] == pytest.approx(10.0)
    assert tensorboard_scalars(summary)["phases/data"] == pytest.approx(3.0 / summary["wall_seconds"])


def test_on_cuda_one_step_in_ten_is_synchronized_and_timed_and_scaled_to_all_steps():
    clock, syncs = Clock(), []
    timer = PhaseTimer("cuda", clock=clock, sync=lambda: syncs.append(clock.now))
    timer.start_loop()
    run_steps(timer, clock, 31, data=0.1, forward=0.3, backward=0.5, optimizer=0.1, bookkeeping=0.0)
    timer.end_loop()
    summary = timer.summary()
    # the first step is warm-up; steps 1, 11, 21 are sampled
    assert summary["sampled_steps"] == 3 and summary["sample_every"] == 10
    assert summary["method"] == "cuda_synchronize"
    assert summary["seconds"]["backward"] == pytest.approx(31 * 0.5)
    assert sum(summary["seconds"].values()) == pytest.approx(summary["wall_seconds"])
    # synchronizations only at the sampled steps: 2 per phase (4 phases + the iterator) + the step's ends
    assert 0 < len(syncs) <= 3 * (2 * 5 + 2) + 2


def test_an_event_inside_a_sampled_step_is_not_counted_in_that_step():
    clock = Clock()
    timer = PhaseTimer("cpu", clock=clock)
    timer.start_loop()
    for _ in timer.batches([1, 2]):
        with timer.phase("forward"):
            clock.advance(1.0)
        with timer.event("sample"):
            clock.advance(5.0)
        timer.step_done()
    timer.end_loop()
    summary = timer.summary()
    assert summary["seconds"]["sample"] == pytest.approx(10.0)
    assert summary["seconds"]["forward"] == pytest.approx(2.0)
    assert summary["sampled_ms_per_step"]["step"] == pytest.approx(1000.0)
    assert summary["seconds"]["other"] == pytest.approx(0.0)


def test_a_run_that_ends_before_its_loop_puts_everything_in_setup_and_other():
    clock = Clock()
    timer = PhaseTimer("cpu", clock=clock)
    clock.advance(3.0)
    summary = timer.summary()
    assert summary["sampled_steps"] == 0 and summary["seconds"]["other"] == pytest.approx(3.0)
    assert all(summary["sampled_ms_per_step"][name] is None for name in ("data", "forward"))
