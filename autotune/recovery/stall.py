"""When a silent engine has stalled: a limit per phase, scaled to the phase's work (what the engine said in
``phase.json`` and ``progress.json``, see ``sd_scripts_compat.facts.contract``).

- before the engine names a phase (Python starting, torch importing) and in phases with items (caching, whose
  clock restarts with each image) or without (compiling a block for ``torch_compile``, validating, saving,
  sampling): the base limit (``--stall-timeout``);
- loading: the base plus the time to read its bytes at :data:`SLOW_DISK_BYTES_PER_S` (a 24 GB file on a network
  mount is not a stall at 20 minutes);
- training, once a step time is known: :data:`STEP_FACTOR` times the usual step (``1 / it_per_s``), at least
  :data:`TRAINING_FLOOR_S` (progress is written every few seconds) and never above the base when steps are quick.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SLOW_DISK_BYTES_PER_S = 16 * 2**20
STEP_FACTOR = 10.0
TRAINING_FLOOR_S = 60.0
TEST_TRAINING_FLOOR_ENV = "SD_COMPAT_TEST_TRAINING_FLOOR_S"  # test hook: a shorter floor (stall tests in seconds)


def training_floor_s() -> float:
    return float(os.environ.get(TEST_TRAINING_FLOOR_ENV) or TRAINING_FLOOR_S)


def stall_limit(phase: Mapping[str, Any] | None, progress: Mapping[str, Any] | None, base_s: float) -> float:
    """Seconds without a change of ``phase.json`` or ``progress.json`` after which the engine is stalled."""
    name = (phase or {}).get("phase")
    if name == "loading":
        size = (phase or {}).get("bytes")
        return base_s + (float(size) / SLOW_DISK_BYTES_PER_S if isinstance(size, (int, float)) and size > 0 else 0.0)
    if name == "training":
        rate = (progress or {}).get("it_per_s")
        if isinstance(rate, (int, float)) and rate > 0:
            return max(STEP_FACTOR / rate, min(base_s, training_floor_s()))
    return base_s


def describe(phase: Mapping[str, Any] | None) -> str | None:
    """The phase as the stall message says it: "loading (4.2 GiB)", "caching (12 of 40)", "training"."""
    if not phase or not isinstance(phase.get("phase"), str):
        return None
    name, done, total, size = phase["phase"], phase.get("done"), phase.get("total"), phase.get("bytes")
    if name == "loading" and isinstance(size, (int, float)) and size > 0:
        return f"loading ({size / 2**30:.1f} GiB)"
    if isinstance(total, int) and isinstance(done, int) and total > 0:
        return f"{name} ({done} of {total})"
    return name
