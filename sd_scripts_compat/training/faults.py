"""Deterministic fault injection, so the OOM ladder is testable on a CPU that never runs out of memory.

``SD_COMPAT_INJECT_OOM`` holds comma-separated rules (see :class:`OomInjector`); tests and benches set
it on the engine's environment, the watchdog never does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

INJECT_ENV = "SD_COMPAT_INJECT_OOM"


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
        if step in self.steps:
            marker = self.marker_dir / f"injected-oom-step{step}" if self.marker_dir else None
            if marker is not None and marker.exists():
                return
            if marker is not None:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by {INJECT_ENV} at step {step})")
