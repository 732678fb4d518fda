"""Deterministic fault injection, so the OOM and stability ladders are testable on a CPU.

``SD_COMPAT_INJECT_OOM`` (see :class:`OomInjector`), ``SD_COMPAT_INJECT_NAN`` (see :class:`NanInjector`),
``SD_COMPAT_INJECT_FREEZE`` and ``SD_COMPAT_INJECT_KILL`` (see :class:`StepFault`) hold comma-separated rules;
tests and benches set them on the engine's environment, the watchdog never does. The run reads them once into a
:class:`FaultPlan`, which wraps the training objective when there is anything to inject: the training loop has no
fault code of its own.
A *real* divergence needs no injector: a learning rate far too
high for the tiny model (``learning_rate = 2.0`` with AdamW on ``builtin:tiny-sd15``) makes its loss turn
NaN within a few dozen steps by itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from sd_scripts_compat.runtimes import Objective

INJECT_ENV = "SD_COMPAT_INJECT_OOM"
NAN_ENV = "SD_COMPAT_INJECT_NAN"
FREEZE_ENV = "SD_COMPAT_INJECT_FREEZE"
KILL_ENV = "SD_COMPAT_INJECT_KILL"


def _marker_fires(marker_dir: Path | None, name: str) -> bool:
    """True the first time only: a marker file in ``marker_dir`` remembers it, even across restarts."""
    marker = marker_dir / name if marker_dir else None
    if marker is not None and marker.exists():
        return False
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return True


@dataclass(frozen=True)
class OomInjector:
    """Raises a real ``torch.OutOfMemoryError`` on demand, so the OOM ladder is testable on CPU.

    ``SD_COMPAT_INJECT_OOM`` holds comma-separated rules:
      ``step=N``           raise once when global step N is about to run (a marker file in
                           ``marker_dir`` makes it fire once, even across restarts);
      ``pixels_gt=P``      raise whenever micro-batch x height x width (in pixels) exceeds P;
      ``bare_step=N``      raise a bare ``MemoryError()`` (no message, as a failed host allocation can) once at N;
      ``rank=R``           only in the process of rank R (``RANK``, as the launcher sets it) of a several-process run.
    """

    steps: frozenset[int]
    pixels_gt: int | None
    marker_dir: Path | None
    bare_steps: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, marker_dir: Path | None, environ: dict[str, str] | None = None) -> OomInjector | None:
        spec = (environ if environ is not None else os.environ).get(INJECT_ENV, "").strip()
        if not spec:
            return None
        steps: set[int] = set()
        bare: set[int] = set()
        pixels_gt = None
        for rule in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = rule.partition("=")
            if key == "rank" and value.isdigit():
                if (environ if environ is not None else os.environ).get("RANK", "0") != value:
                    return None  # another process's fault
            elif key == "step" and value.isdigit():
                steps.add(int(value))
            elif key == "bare_step" and value.isdigit():
                bare.add(int(value))
            elif key == "pixels_gt" and value.isdigit():
                pixels_gt = int(value)
            else:
                raise ValueError(f"{INJECT_ENV}: cannot read rule {rule!r} (use step=N, bare_step=N, pixels_gt=P or "
                                 "rank=R)")
        return cls(frozenset(steps), pixels_gt, marker_dir, frozenset(bare))

    def check(self, step: int, batch_size: int, height: int, width: int) -> None:
        import torch

        pixels = batch_size * height * width
        if self.pixels_gt is not None and pixels > self.pixels_gt:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {INJECT_ENV}: {batch_size}x{height}x{width} = {pixels} px "
                f"> {self.pixels_gt})"
            )
        if step in self.steps and _marker_fires(self.marker_dir, f"injected-oom-step{step}"):
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {INJECT_ENV} at step {step})")
        if step in self.bare_steps and _marker_fires(self.marker_dir, f"injected-bare-oom-step{step}"):
            raise MemoryError()


@dataclass(frozen=True)
class NanInjector:
    """Makes the training loss NaN on demand, so the divergence detection and rollback are testable.

    ``SD_COMPAT_INJECT_NAN`` holds comma-separated ``step=N`` rules: the loss of the first micro-batch
    of optimizer step N (0-based: the step that runs when N steps are done, as for the OOM injector)
    becomes NaN, once (a marker file in ``marker_dir``), so its gradients are NaN too.
    """

    steps: frozenset[int]
    marker_dir: Path | None

    @classmethod
    def from_env(cls, marker_dir: Path | None, environ: dict[str, str] | None = None) -> NanInjector | None:
        steps = _step_rules(NAN_ENV, environ)
        return None if steps is None else cls(steps, marker_dir)

    def poison(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, or NaN times it when step ``step`` is to be poisoned (the first time only)."""
        if step in self.steps and _marker_fires(self.marker_dir, f"injected-nan-step{step}"):
            return loss * float("nan")
        return loss


def _step_rules(env: str, environ: dict[str, str] | None) -> frozenset[int] | None:
    spec = (environ if environ is not None else os.environ).get(env, "").strip()
    if not spec:
        return None
    steps: set[int] = set()
    rank = (environ if environ is not None else os.environ).get("RANK", "0")
    for rule in filter(None, (part.strip() for part in spec.split(","))):
        key, _, value = rule.partition("=")
        if key == "rank" and value.isdigit():
            if value != rank:
                return None  # another process's fault
            continue
        if key != "step" or not value.isdigit():
            raise ValueError(f"{env}: cannot read rule {rule!r} (use step=N, rank=R)")
        steps.add(int(value))
    return frozenset(steps)


@dataclass(frozen=True)
class StepFault:
    """A fault that strikes as optimizer step N begins, once (a marker file in ``marker_dir``, so the resumed run
    goes on): ``freeze`` sleeps an hour, as a hung driver or a deadlocked loader does (``SD_COMPAT_INJECT_FREEZE``:
    the stall detector's tests); ``kill`` sends its own process SIGKILL, as the OS's OOM killer or a crashed card
    would (``SD_COMPAT_INJECT_KILL``). Comma-separated ``step=N`` rules, and ``rank=R`` for one process of several."""

    kind: str  # "freeze" | "kill"
    steps: frozenset[int]
    marker_dir: Path | None

    @classmethod
    def from_env(cls, kind: str, marker_dir: Path | None, environ: dict[str, str] | None = None) -> StepFault | None:
        steps = _step_rules(FREEZE_ENV if kind == "freeze" else KILL_ENV, environ)
        return None if steps is None else cls(kind, steps, marker_dir)

    def check(self, step: int) -> None:
        import signal
        import time

        if step in self.steps and _marker_fires(self.marker_dir, f"injected-{self.kind}-step{step}"):
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)


@dataclass(frozen=True)
class FaultPlan:
    """Every fault a run injects, read once from its environment. :meth:`from_env` gives None when there is
    nothing to inject; otherwise the plan wraps the training objective (:meth:`wrap`), so the training loop
    itself never checks for faults."""

    oom: OomInjector | None = None
    nan: NanInjector | None = None
    freeze: StepFault | None = None
    kill: StepFault | None = None

    @classmethod
    def from_env(cls, marker_dir: Path | None, environ: dict[str, str] | None = None) -> FaultPlan | None:
        oom, nan = OomInjector.from_env(marker_dir, environ), NanInjector.from_env(marker_dir, environ)
        freeze = StepFault.from_env("freeze", marker_dir, environ)
        kill = StepFault.from_env("kill", marker_dir, environ)
        return cls(oom, nan, freeze, kill) if oom or nan or freeze or kill else None

    def wrap(self, objective: Objective, step: Callable[[], int], vae_scale: int) -> FaultyObjective:
        return FaultyObjective(objective, self, step, vae_scale)


class FaultyObjective:
    """A training objective with the plan's faults: an OOM raised as a micro-batch's forward starts, a NaN loss
    after that forward. Validation's ``fixed_forward`` passes untouched; everything else is the objective's."""

    def __init__(self, inner: Objective, plan: FaultPlan, step: Callable[[], int], vae_scale: int) -> None:
        self.inner, self.plan, self.step, self.vae_scale = inner, plan, step, vae_scale
        self._poison_step: int | None = None  # the step of the training forward whose loss comes next

    def forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                added: dict[str, Any] | None, generator: torch.Generator) -> tuple[torch.Tensor, tuple[Any, ...]]:
        step = self.step()
        if self.plan.freeze is not None:
            self.plan.freeze.check(step)
        if self.plan.kill is not None:
            self.plan.kill.check(step)
        if self.plan.oom is not None:
            self.plan.oom.check(step, latents.shape[0], latents.shape[2] * self.vae_scale,
                                latents.shape[3] * self.vae_scale)
        self._poison_step = step
        return self.inner.forward(denoiser, latents, hidden, added, generator)

    def fixed_forward(self, denoiser: torch.nn.Module, latents: torch.Tensor, hidden: torch.Tensor,
                      added: dict[str, Any] | None, timestep: int,
                      noise: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        self._poison_step = None
        return self.inner.fixed_forward(denoiser, latents, hidden, added, timestep, noise)

    def loss(self, prediction: torch.Tensor, state: tuple[Any, ...], loss_weights: torch.Tensor) -> torch.Tensor:
        loss = self.inner.loss(prediction, state, loss_weights)
        step, self._poison_step = self._poison_step, None
        return self.plan.nan.poison(step, loss) if step is not None and self.plan.nan is not None else loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
