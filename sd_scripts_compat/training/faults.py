"""Deterministic fault injection, so the OOM and stability ladders are testable on a CPU.

``SD_COMPAT_INJECT_OOM`` (see :class:`OomInjector`) and ``SD_COMPAT_INJECT_NAN`` (see
:class:`NanInjector`) hold comma-separated rules; tests and benches set them on the engine's
environment, the watchdog never does. A *real* divergence needs no injector: a learning rate far too
high for the tiny model (``learning_rate = 2.0`` with AdamW on ``builtin:tiny-sd15``) makes its loss turn
NaN within a few dozen steps by itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INJECT_ENV = "SD_COMPAT_INJECT_OOM"
NAN_ENV = "SD_COMPAT_INJECT_NAN"


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
      ``pixels_gt=P``      raise whenever micro-batch x height x width (in pixels) exceeds P.
    """

    steps: frozenset[int]
    pixels_gt: int | None
    marker_dir: Path | None

    @classmethod
    def from_env(cls, marker_dir: Path | None, environ: dict[str, str] | None = None) -> OomInjector | None:
        spec = (environ if environ is not None else os.environ).get(INJECT_ENV, "").strip()
        if not spec:
            return None
        steps: set[int] = set()
        pixels_gt = None
        for rule in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = rule.partition("=")
            if key == "step" and value.isdigit():
                steps.add(int(value))
            elif key == "pixels_gt" and value.isdigit():
                pixels_gt = int(value)
            else:
                raise ValueError(f"{INJECT_ENV}: cannot read rule {rule!r} (use step=N or pixels_gt=P)")
        return cls(frozenset(steps), pixels_gt, marker_dir)

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
        spec = (environ if environ is not None else os.environ).get(NAN_ENV, "").strip()
        if not spec:
            return None
        steps: set[int] = set()
        for rule in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = rule.partition("=")
            if key != "step" or not value.isdigit():
                raise ValueError(f"{NAN_ENV}: cannot read rule {rule!r} (use step=N)")
            steps.add(int(value))
        return cls(frozenset(steps), marker_dir)

    def poison(self, step: int, loss: Any) -> Any:
        """``loss``, or NaN times it when step ``step`` is to be poisoned (the first time only)."""
        if step in self.steps and _marker_fires(self.marker_dir, f"injected-nan-step{step}"):
            return loss * float("nan")
        return loss
