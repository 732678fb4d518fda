"""Whether a plan compiles the denoiser's blocks (``torch_compile``): only where this device has measured a
compiled run of the plan's settings, and the time it saves over the plan's steps exceeds the compile time.

Compiling is a one-off cost paid back per step only where the compiled step is faster. On this project's 2-core
CPU, inductor's tiny-sd15 stepped no faster at 256 px after a 151 s compile, and 0.59x eager's time at 128 px after
196 s (paid back after ~6,000 steps); on GPUs it is the known lever.
No model predicts either figure for a device it has not seen, so a plan without a measurement stays eager and says
how to measure one; the compile time is part of the plan's time prediction when it compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sd_scripts_compat.facts.settings import TrainSettings

if TYPE_CHECKING:
    from autotune.measure.learned import LearnedFigures

BENCH_HINT = "autotune bench --sweep compile=off,on"


@dataclass(frozen=True)
class CompileDecision:
    """``on``: compile with ``backend``; then the step takes ``seconds_per_step`` after ``compile_seconds``."""

    on: bool
    reason: str
    backend: str = "inductor"
    seconds_per_step: float | None = None
    compile_seconds: float = 0.0
    basis: str = ""  # which measurement, when (the prediction's speed_basis when on)


def decide_compile(learned: LearnedFigures | None, settings: TrainSettings, eager_seconds_per_step: float, steps: int,
                   usable_mib: float | None) -> CompileDecision:
    """``learned``: this device's :class:`~autotune.measure.learned.LearnedFigures` (None: no measurements);
    ``eager_seconds_per_step``: the plan's predicted optimizer step; ``usable_mib``: the GPU memory a run may use
    (None on a CPU, where the peak is not checked against a measured compiled run)."""
    from autotune.measure.learned import when_measured

    record = learned.compiled(settings.to_event()) if learned else None
    if learned is None or record is None or not record.seconds_per_step:
        return CompileDecision(False, f"eager: no compiled run of these settings measured here ({BENCH_HINT} "
                                      "measures one; plans compile where it saves more than its compile time)")
    backend = str(record.settings.get("dynamo_backend") or "inductor")
    compiled, cost = record.seconds_per_step, record.compile_seconds or 0.0
    basis = (f"{record.source} on {learned.device}, {when_measured(record)}: compiled ({backend}) "
             f"{compiled:.4g} s per step against {eager_seconds_per_step:.4g} eager, {cost:.0f} s to compile")
    saved = steps * (eager_seconds_per_step - compiled)
    reserved = record.memory.get("cuda_max_reserved_mib")
    if usable_mib is not None and reserved is not None and reserved > usable_mib:
        return CompileDecision(False, f"eager: compiled, it needed {reserved:.0f} MiB of {usable_mib:.0f} usable "
                                      f"({basis})")
    if saved <= cost:
        return CompileDecision(False, f"eager: compiling would save {max(saved, 0.0):.0f} s over {steps} steps, "
                                      f"less than its compile ({basis})")
    return CompileDecision(True, f"saves {saved:.0f} s over {steps} steps, more than its {cost:.0f} s compile "
                                 f"({basis})", backend=backend, seconds_per_step=compiled, compile_seconds=cost,
                           basis=basis)
