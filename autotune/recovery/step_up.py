"""Stepping up into measured headroom: the OOM ladder's moves taken back, one at a time, where the run's own
measured peak says they fit and the speed model says they pay.

After the first steady steps of an attempt (the first one, and each after a step down or up) the watchdog asks
:func:`next_step_up` once, with the peak the attempt measured. The moves, in the planner's order of what it gave
up to fit: a larger micro-batch with the same effective batch (fewer accumulation steps), gradient checkpointing
off, fewer swapped blocks, 16-bit base weights instead of fp8. A move is taken when

- the memory model, tied to this machine by measured / predicted of the running settings, predicts it within
  :data:`HEADROOM` of the budget (the planner's own margin is in the model's figure on a GPU);
- the speed model predicts at least :data:`MIN_GAIN` more images per second;
- no setting at least as heavy ran out of memory in this run (``tried``): a rung that failed is never retried;
- it changes no setting the user pinned (``fixed``: ``--batch`` / ``--accum`` keep the micro-batch as given).

What is learned (effective batch, learning rates, resolution, rank) never changes, so the run resumes at the
same step from the state it saves at the step boundary; a change the engine makes in the process (ours:
checkpointing, ``sd_scripts_compat.training.live_changes``) needs no restart at all.

The same check steps down before an OOM it can see coming (:func:`next_move`): the peak measured so far is carried
by the memory model from the largest micro-batch trained so far to the largest the data has (buckets differ in
size, and the largest may come late); where that is over the budget, the ladder's next rung is taken at the next
step boundary instead of an out-of-memory error later. :class:`MemoryWatcher` is the attempt's side: it sees the
progress events and says when to stop for a step up or down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.measure.learned import heavier_or_equal, mib
from autotune.measure.store import measured_figure, settings_key
from autotune.recovery.ladder import Decision, LadderLimits, next_settings
from sd_scripts_compat.facts.settings import TrainSettings

HEADROOM = 0.9  # a step up must be predicted within this share of the budget
MIN_GAIN = 1.10  # ... and at least 10% more images per second
STEADY_STEPS = 3  # steps an attempt trains before its peak is read (allocator, caches, the first step's extras)


@dataclass(frozen=True)
class StepUp:
    """The next settings up, what changed and why (with the measured figures behind it)."""

    settings: TrainSettings
    changes: dict[str, tuple[Any, Any]]
    reason: str
    predicted_mib: float
    scale: float  # measured / predicted of the running settings


@dataclass(frozen=True)
class StepDown:
    """A step down taken at a step boundary, before the out-of-memory error the measured peak foresees."""

    decision: Decision  # the ladder's next rung, from the projected peak
    reason: str


def at_size(settings: TrainSettings, size: Any) -> TrainSettings:
    """``settings`` at a progress event's batch size (``{"micro_batch", "width", "height"}``); as they are without
    a usable one."""
    if not isinstance(size, dict):
        return settings
    batch, width, height = (size.get(key) for key in ("micro_batch", "width", "height"))
    if not (isinstance(batch, int) and isinstance(width, int) and isinstance(height, int)
            and min(batch, width, height) > 0):
        return settings
    return replace(settings, train_batch_size=batch, resolution=(width, height))


def projected_mib(settings: TrainSettings, measured_mib: float, predict: Callable[[TrainSettings], float],
                  progress: dict[str, Any]) -> float:
    """The measured peak carried by the memory model from the largest micro-batch trained so far to the largest
    the data has (the engine's ``largest_batch`` and ``largest_bucket``); as measured without them."""
    seen = predict(at_size(settings, progress.get("largest_batch")))
    largest = predict(at_size(settings, progress.get("largest_bucket")))
    return measured_mib * largest / seen if seen > 0 and largest > seen else measured_mib


def _sizes(progress: dict[str, Any]) -> str:
    def one(size: Any) -> str:
        return f"{size['micro_batch']} x {size['width']}x{size['height']} px" if isinstance(size, dict) else "?"

    return (f"the largest micro-batch so far ({one(progress.get('largest_batch'))}); the data's largest is "
            f"{one(progress.get('largest_bucket'))}")


def next_move(current: TrainSettings, *, limits: LadderLimits, budget_mib: float, measured_mib: float,
              progress: dict[str, Any], predict: Callable[[TrainSettings], float],
              images_per_s: Callable[[TrainSettings], float], tried: Sequence[TrainSettings] = (),
              fixed: frozenset[str] = frozenset(), up: bool = True) -> StepUp | StepDown | None:
    """A step down where the projected peak is over the budget, else (``up``: after the steady steps) a step up
    where one fits and pays (:func:`next_step_up`), else None."""
    projected = projected_mib(current, measured_mib, predict, progress)
    carried = "" if projected == measured_mib else (
        f"measured {mib(measured_mib)} MiB at {_sizes(progress)}, where the model carries it to {mib(projected)} MiB; ")
    if projected > budget_mib:
        step = next_settings(current, replace(limits, budget_mib=budget_mib), predict, projected, [*tried, current])
        if not isinstance(step, Decision):
            return None  # nothing left below: let it run, it may fit yet
        return StepDown(step, f"step down before running out of memory: {carried or f'measured {mib(projected)} MiB; '}"
                              f"over the {mib(budget_mib)} MiB budget; {step.reason}")
    if not up:
        return None
    taken = next_step_up(current, budget_mib=budget_mib, measured_mib=projected, predict=predict,
                         images_per_s=images_per_s, tried=tried, fixed=fixed)
    return replace(taken, reason=taken.reason.replace("measured peak", f"{carried}measured peak", 1)) if taken else None


def _moves(s: TrainSettings) -> list[tuple[str, TrainSettings]]:
    """One move up per rung, in the planner's order (what it gives up first is taken back first)."""
    moves = []
    if s.gradient_accumulation_steps % 2 == 0:
        moves.append(("micro-batch", replace(s, train_batch_size=s.train_batch_size * 2,
                                             gradient_accumulation_steps=s.gradient_accumulation_steps // 2)))
    if s.gradient_checkpointing:
        moves.append(("gradient checkpointing off", replace(s, gradient_checkpointing=False,
                                                            cpu_offload_checkpointing=False)))
    if s.blocks_to_swap > 0:
        moves.append(("fewer swapped blocks", replace(s, blocks_to_swap=s.blocks_to_swap // 2)))
    if s.fp8_base:
        moves.append(("16-bit base weights", replace(s, fp8_base=False)))
    return moves


def _oomed(candidate: TrainSettings, tried: Sequence[TrainSettings]) -> bool:
    key = settings_key(candidate.to_event())
    return any(candidate == t or heavier_or_equal(key, settings_key(t.to_event())) for t in tried)


def next_step_up(current: TrainSettings, *, budget_mib: float, measured_mib: float,
                 predict: Callable[[TrainSettings], float], images_per_s: Callable[[TrainSettings], float],
                 tried: Sequence[TrainSettings] = (), fixed: frozenset[str] = frozenset()) -> StepUp | None:
    """The first move up that fits, pays, never ran out of memory here and leaves ``fixed`` fields alone; None
    when there is none."""
    predicted_now = predict(current)
    if predicted_now <= 0 or measured_mib <= 0 or budget_mib <= 0:
        return None
    scale = measured_mib / predicted_now
    speed_now = images_per_s(current)
    for title, candidate in _moves(current):
        if fixed & candidate.changed_from(current).keys():
            continue
        needed = predict(candidate) * scale
        gain = images_per_s(candidate) / speed_now if speed_now > 0 else 0.0
        if needed > HEADROOM * budget_mib or gain < MIN_GAIN or _oomed(candidate, tried):
            continue
        changes = candidate.changed_from(current)
        what = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())
        reason = (f"step up ({title}: {what}): measured peak {mib(measured_mib)} MiB of {mib(budget_mib)} MiB; the "
                  f"model x{scale:.3g} (measured / predicted) puts it at {mib(needed)} MiB, and the speed model "
                  f"at {gain:.2f}x the images per second")
        return StepUp(candidate, changes, reason, needed, scale)
    return None


@dataclass
class MemoryWatcher:
    """One attempt's step-down / step-up check (:meth:`see`). The watchdog makes its decision: a change the engine
    makes in the process, else a stop at the step boundary and a resume with the decision's settings."""

    settings: TrainSettings
    # (running settings, measured MiB, the progress event, whether a step up may be taken) -> the move
    decide: Callable[[TrainSettings, float, dict[str, Any], bool], StepUp | StepDown | None]
    budget_kind: str  # "device" | "ram" | "emulated_card": the progress event's peak; "address_space": sampled
    first_step: int | None = None
    asked: bool = False
    decision: StepUp | StepDown | None = None

    def see(self, progress: dict[str, Any], peak_vm_mib: float | None, peak_gpu_mib: float | None = None) -> bool:
        """True when the attempt should stop at its next step boundary for a step up or down. A step down is
        looked for at every progress event (a peak measured early is a floor: if even it, carried to the data's
        largest batch, is over the budget, the OOM is coming); a step up once, after the steady steps, not near
        the end (a restart would not pay)."""
        step, total = progress.get("step"), progress.get("max_train_steps")
        if self.decision is not None or not isinstance(step, int):
            return False
        if self.first_step is None:
            self.first_step = step
        steady = step >= self.first_step + STEADY_STEPS
        up = steady and not self.asked and not (isinstance(total, int) and total - step <= STEADY_STEPS)
        self.asked = self.asked or steady
        measured = self._measured(progress, peak_vm_mib, peak_gpu_mib)
        if measured is None:
            return False
        self.decision = self.decide(self.settings, measured, progress, up)
        return self.decision is not None

    def _measured(self, progress: dict[str, Any], peak_vm_mib: float | None, peak_gpu_mib: float | None
                  ) -> float | None:
        """The sampled address space under an address-space budget, else the trainer's own peak (its progress
        events; on a card with the CUDA context it measured at start added, since CUDA's max reserved leaves out
        what the card holds for the context, which NVML's figure and the budget count), else what NVML showed of
        its process on the card (a trainer that reports none)."""
        measured = measured_figure(peak_vm_mib if self.budget_kind == "address_space"
                                   else progress.get("peak_memory_mib")) or None  # 0 is no measurement
        if self.budget_kind != "device":
            return measured
        if measured is None:
            return measured_figure(peak_gpu_mib) or None
        return measured + (measured_figure(progress.get("cuda_context_mib")) or 0.0)
