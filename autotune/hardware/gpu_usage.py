"""The GPU memory a trainer process uses, as the driver counts it (NVML), for trainers that do not report it.

Our engine reports its CUDA peak in its progress events; the user's sd-scripts and musubi-tuner print none, so the
watchdog samples what NVML lists for the child's process group (``nvmlDeviceGetComputeRunningProcesses``: the
process's whole footprint on the card, CUDA context and the caching allocator's reserve included) on every card,
at most once a second. The peak of those samples is what a step up compares with the card's usable memory, and
:meth:`GpuUsage.usable_now_mib` (what the group holds plus what is free, now) lowers that usable memory when another
process has grown on the card since the plan was made.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

SAMPLE_EVERY_S = 1.0


def process_group(pgid: int) -> set[int]:
    """The live processes of process group ``pgid`` (the child and the workers it started), from /proc."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid):
            members.add(int(entry.name))
    return members


class GpuUsage:
    """Samples the GPU memory of one process group through NVML; ``peak`` stays None where NVML cannot answer (no
    driver, no nvidia-ml-py, a container that hides other processes' memory)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._last = 0.0
        self._pgid: int | None = None
        self.peak: float | None = None

    def start(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # no driver, no library: this run has no sampled GPU figure, and says nothing more
            return False
        self._nvml = pynvml
        return True

    def sample(self, pgid: int) -> float | None:
        """The group's MiB on all cards now (None: nothing listed); the peak is kept. At most once a second."""
        if self._nvml is None or time.monotonic() - self._last < SAMPLE_EVERY_S:
            return None
        self._last, self._pgid = time.monotonic(), pgid
        try:
            used = sum(self._group_bytes(handle, process_group(pgid) or {pgid}) for handle in self._handles)
        except self._nvml.NVMLError:
            return None
        if not used:
            return None
        mib = used / 2**20
        self.peak = max(self.peak or 0.0, mib)
        return mib

    def _group_bytes(self, handle: Any, members: set[int]) -> int:
        return sum(p.usedGpuMemory for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                   if p.pid in members and isinstance(p.usedGpuMemory, int))

    def usable_now_mib(self) -> float | None:
        """On each card the sampled group uses: what it holds plus what is free now; the least of them (None:
        nothing sampled yet, or NVML cannot say). Another process that grew since the start lowers it."""
        if self._nvml is None or self._pgid is None:
            return None
        members = process_group(self._pgid) or {self._pgid}
        usable = []
        try:
            for handle in self._handles:
                held = self._group_bytes(handle, members)
                if held:
                    usable.append(held + self._nvml.nvmlDeviceGetMemoryInfo(handle).free)
        except self._nvml.NVMLError:
            return None
        return min(usable) / 2**20 if usable else None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down a driver that went away: nothing left to protect
                pass
            self._nvml = None
