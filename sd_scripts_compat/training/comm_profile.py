"""How long a several-process run's collectives take: one optimizer step profiled, once per run.

A sharded step gathers every block's weights (FSDP2) and every step averages the LoRA's gradients; no phase timer
sees that time, since it runs inside the forward, the backward and the optimizer phase. ``torch.profiler`` does:
one whole optimizer step (its micro-batches and the optimizer step) after the timing warm-up is profiled, and the
collectives' own time summed. On a GPU that is the device time of NCCL's kernels (on their own stream: they overlap
the compute, so it bounds the time they cost); on a CPU, gloo's, which runs each collective on its own thread while
the step waits for it. One profiled step costs its profiler overhead once; the other steps run as before.
"""

from __future__ import annotations

from typing import Any

COMM_PROFILE_SCHEMA = 1


class CommProfile:
    """Profiles the optimizer step that begins ``after`` steps into the loop, on each process of a run with
    several; :attr:`seconds` is its collectives' time (None until then, and for one process)."""

    def __init__(self, world: int, device_type: str, after: int) -> None:
        self.enabled = world > 1
        self.cuda = device_type == "cuda"
        self.after = after
        self.first_step: int | None = None
        self.profiled_step: int | None = None
        self.seconds: float | None = None
        self._profiler: Any = None

    def begin(self, step: int) -> None:
        """Called before each micro-batch (``step``: the optimizer steps done): starts the profiler at the first
        micro-batch of the chosen step."""
        if not self.enabled or self._profiler is not None or self.profiled_step is not None:
            return
        if self.first_step is None:
            self.first_step = step
        if step - self.first_step < self.after:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        self._profiler = profile(activities=activities)
        self._profiler.start()
        self.profiled_step = step

    def end(self) -> None:
        """Called after each optimizer step: stops the profiler after the chosen one and sums its collectives."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.seconds = collective_seconds(profiler.events(), cuda=self.cuda)

    def summary(self) -> dict[str, Any] | None:
        """done.json's ``communication`` of this process (None when nothing was profiled)."""
        if self.seconds is None:
            return None
        return {"schema": COMM_PROFILE_SCHEMA, "step": self.profiled_step, "seconds": self.seconds,
                "method": "nccl_kernels" if self.cuda else "gloo_threads"}


def collective_seconds(events: Any, *, cuda: bool) -> float:
    """Seconds of the collectives among a profile's events: NCCL's kernels (the profiler's device events whose
    name says nccl: ``ncclDevKernel_AllGather_RING_LL``, ...), or gloo's operations on the host
    (``gloo:all_gather``, ``gloo:all_reduce``, ...)."""
    from torch.autograd import DeviceType

    total_us = 0.0
    for event in events:
        if cuda:
            counted = event.device_type == DeviceType.CUDA and "nccl" in event.name.lower()
        else:
            counted = event.device_type == DeviceType.CPU and event.name.startswith("gloo:")
        if counted:
            total_us += event.time_range.elapsed_us()
    return total_us / 1e6
