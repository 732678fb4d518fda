"""Where a run's time goes, on every run, without slowing it: per-phase seconds for done.json.

Only sampled optimizer steps are timed phase by phase (every step on CPU, where ``perf_counter`` around a
phase is exact and free; every :data:`CUDA_SAMPLE_EVERY`-th step on CUDA, where each phase boundary of a
sampled step needs a ``torch.cuda.synchronize`` and the other steps keep their asynchronous overlap). The
fractions measured at the sampled steps are scaled to the run's measured step time, and the rare, long
events (validation, saves, samples) plus setup and caching are timed every time, so the phases add up to
the wall time exactly: what no phase covers (bookkeeping between phases) is the phase ``other``.

The ``phases`` block of done.json (:meth:`PhaseTimer.summary`), ``schema`` :data:`PHASES_SCHEMA`:
``wall_seconds`` (from the engine's setup to the end of the final save), ``step_seconds`` (the loop's time
less its events: what the step phases share, the rest of it being bookkeeping), ``seconds`` (one entry per
name of :data:`PHASES`, summing to ``wall_seconds``), ``fractions`` (the same over the wall), ``sampled_steps``,
``steps``, ``sample_every``, ``method`` (``perf_counter`` or ``cuda_synchronize``) and ``sampled_ms_per_step``
(the mean of each step phase over the sampled steps, unscaled).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PHASES_SCHEMA = 1
STEP_PHASES = ("data", "to_device", "vae_encode", "forward", "backward", "optimizer")
EVENT_PHASES = ("setup", "caching", "validation", "save", "sample")
PHASES = (*EVENT_PHASES[:2], *STEP_PHASES, *EVENT_PHASES[2:], "other")
CUDA_SAMPLE_EVERY = 10  # a synchronize per phase boundary on one step in ten
CUDA_WARMUP_STEPS = 1  # the first CUDA step (allocator growth, cuDNN autotuning) is not a fair sample


class PhaseTimer:
    """Times the phases of sampled steps and every event; :meth:`summary` scales them to the run.

    The loop calls :meth:`batches` (data wait: the loader's ``next()``), :meth:`phase` around each step phase,
    :meth:`event` around validation / saves / samples, and :meth:`step_done` after each optimizer step.
    """

    def __init__(self, device_type: str, *, every: int | None = None, elapsed_before: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
                 on_event: Callable[[str, bool], None] | None = None) -> None:
        cuda = device_type == "cuda"
        self.every = every or (CUDA_SAMPLE_EVERY if cuda else 1)
        self.warmup = CUDA_WARMUP_STEPS if cuda else 0
        self.method = "cuda_synchronize" if cuda else "perf_counter"
        self._clock = clock
        self._on_event = on_event  # told (name, True) when an event begins and (name, False) when it ends
        self._sync = sync if sync is not None else (_cuda_sync if cuda else _no_sync)
        self.started = clock() - elapsed_before  # setup began that long ago (the process's start of setup)
        self.events: dict[str, float] = dict.fromkeys(EVENT_PHASES, 0.0)
        self.sampled: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        self.sampled_wall = 0.0
        self.sampled_steps = 0
        self.steps = 0
        self.loop_started: float | None = None
        self.loop_events = 0.0  # event seconds inside the loop (between loop_started and loop_ended)
        self.loop_ended: float | None = None
        self._step_started = 0.0
        self._step_events = 0.0
        self._in_loop = False

    @property
    def sampling(self) -> bool:
        """True while the current step is one of the timed ones."""
        return self._in_loop and self.steps >= self.warmup and (self.steps - self.warmup) % self.every == 0

    def start_loop(self) -> None:
        """The loop begins: what came since construction and was no event is setup."""
        now = self._clock()
        self.events["setup"] += now - self.started - sum(self.events.values())
        self.loop_started = now
        self._in_loop = True
        self._begin_step()

    def end_loop(self) -> None:
        if self._in_loop:
            self.loop_ended = self._clock()
            self._in_loop = False

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches; at sampled steps the wait for each (and for the iterator) is the ``data`` phase."""
        with self.phase("data"):
            iterator = iter(loader)
        while True:
            with self.phase("data"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A step phase: timed (between device synchronizations on CUDA) only when the step is sampled."""
        if not self.sampling:
            yield
            return
        self._sync()
        begun = self._clock()
        try:
            yield
        finally:
            self._sync()
            self.sampled[name] += self._clock() - begun

    @contextlib.contextmanager
    def event(self, name: str) -> Iterator[None]:
        """A rare, long phase (validation, a save, samples, setup's caching): always timed; its queued device
        work is drained first so it is not counted here."""
        self._sync()
        begun = self._clock()
        if self._on_event is not None:
            self._on_event(name, True)
        try:
            yield
        finally:
            self._sync()
            if self._on_event is not None:
                self._on_event(name, False)
            spent = self._clock() - begun
            self.events[name] += spent
            if self._in_loop:
                self.loop_events += spent
                self._step_events += spent

    def step_done(self) -> None:
        """One optimizer step ended (after its bookkeeping): close a sampled step, open the next."""
        if self.sampling:
            self._sync()
            self.sampled_wall += self._clock() - self._step_started - self._step_events
            self.sampled_steps += 1
        self.steps += 1
        self._begin_step()

    def _begin_step(self) -> None:
        self._step_events = 0.0
        if self.sampling:
            self._sync()
        self._step_started = self._clock()

    def summary(self, ended: float | None = None) -> dict[str, Any]:
        """The ``phases`` block: seconds per phase summing to the wall time (see the module docstring)."""
        ended = self._clock() if ended is None else ended
        wall = max(ended - self.started, 0.0)
        seconds = dict.fromkeys(PHASES, 0.0)
        seconds.update(self.events)
        step_time = 0.0
        if self.loop_started is not None:
            loop_end = self.loop_ended if self.loop_ended is not None else ended
            step_time = max(loop_end - self.loop_started - self.loop_events, 0.0)
            if self.sampled_wall > 0:
                for name in STEP_PHASES:
                    seconds[name] = step_time * min(self.sampled[name] / self.sampled_wall, 1.0)
        seconds["other"] = max(wall - sum(v for k, v in seconds.items() if k != "other"), 0.0)
        per_step = {name: 1000 * self.sampled[name] / self.sampled_steps if self.sampled_steps else None
                    for name in STEP_PHASES}
        per_step["step"] = 1000 * self.sampled_wall / self.sampled_steps if self.sampled_steps else None
        return {"schema": PHASES_SCHEMA, "wall_seconds": wall, "step_seconds": step_time, "seconds": seconds,
                "fractions": {k: v / wall if wall else 0.0 for k, v in seconds.items()},
                "sampled_steps": self.sampled_steps, "steps": self.steps, "sample_every": self.every,
                "method": self.method, "sampled_ms_per_step": per_step}


def tensorboard_scalars(summary: dict[str, Any]) -> dict[str, float]:
    """The phase fractions as tracker scalars (``phases/<name>``), for accelerate's ``log``."""
    return {f"phases/{name}": float(value) for name, value in summary["fractions"].items()}


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def _no_sync() -> None:
    return None
