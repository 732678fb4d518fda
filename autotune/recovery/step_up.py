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
same step from the state it saves at the step boundary. :class:`UpWatcher` is the attempt's side: it sees the
progress events and says when to stop for the step up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autotune.measure.learned import heavier_or_equal
from autotune.measure.store import settings_key
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
        reason = (f"step up ({title}: {what}): measured peak {measured_mib:.0f} MiB of {budget_mib:.0f} MiB; the "
                  f"model x{scale:.3g} (measured / predicted) puts it at {needed:.0f} MiB, and the speed model "
                  f"at {gain:.2f}x the images per second")
        return StepUp(candidate, changes, reason, needed, scale)
    return None


@dataclass
class UpWatcher:
    """One attempt's step-up check: after :data:`STEADY_STEPS` steps it asks once; a step up asks the attempt
    to stop at the step boundary (the watchdog then resumes with ``decision.settings``)."""

    settings: TrainSettings
    decide: Callable[[TrainSettings, float], StepUp | None]  # (running settings, measured MiB) -> the step up
    budget_kind: str  # "device" | "ram": the progress event's peak; "address_space": the sampled peak
    first_step: int | None = None
    asked: bool = False
    decision: StepUp | None = None

    def see(self, progress: dict[str, Any], peak_vm_mib: float | None, peak_gpu_mib: float | None = None) -> bool:
        """True when the attempt should stop at its next step boundary for a step up. The measured peak: the
        sampled address space under an address-space budget, else the trainer's own (its progress events), else
        what NVML showed of its process on the card (a trainer that reports none)."""
        step, total = progress.get("step"), progress.get("max_train_steps")
        if self.asked or not isinstance(step, int):
            return False
        if self.first_step is None:
            self.first_step = step
        if step < self.first_step + STEADY_STEPS:
            return False
        self.asked = True
        if isinstance(total, int) and total - step <= STEADY_STEPS:
            return False  # too close to the end for a restart to pay
        measured = peak_vm_mib if self.budget_kind == "address_space" else progress.get("peak_memory_mib")
        if measured is None and self.budget_kind == "device":
            measured = peak_gpu_mib
        if not isinstance(measured, (int, float)) or measured <= 0:
            return False
        self.decision = self.decide(self.settings, float(measured))
        return self.decision is not None
