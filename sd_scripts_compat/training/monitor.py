"""A background sampler of the machine while the engine trains: ``monitor.jsonl`` in the events folder.

Every ``interval_s`` (default :data:`DEFAULT_INTERVAL_S`) a daemon thread appends one JSON line: the
training step, per GPU (through NVML, when nvidia-ml-py and a driver are there) utilisation, memory
used / total, SM and memory clocks against the SM clock's maximum, power against its limit, temperature
and the clock-event (throttle) reasons; for the process (psutil) CPU % and resident memory; for the system
its CPU use and load average (so a report can tell other work on the machine from the trainer's own idling),
RAM available / total and swap used / total. The loop pays nothing: the thread reads the step counter
through a callable and does its own I/O (NVML and psutil calls release the GIL for their system calls).
Off when ``--autotune_monitor_seconds 0`` or without an events folder.

Format (``schema`` :data:`MONITOR_SCHEMA`): a ``{"kind": "header", ...}`` line per engine process (``pid``,
``interval_s``, ``started``, ``gpus``: name and total memory per sampled GPU, ``ram_total_bytes``,
``max_steps``: the run's last step, ``cpu_count``: logical CPUs, ``threads``: torch's intra-op threads), then
``{"kind": "sample", "t": unix time, "step": n, "gpus": [{"index", "util_percent", "mem_util_percent",
"mem_used_bytes", "mem_total_bytes", "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "power_w",
"power_limit_w", "temp_c", "throttle": [reason names]}], "proc": {"cpu_percent", "rss_bytes"}, "sys":
{"cpu_percent" (all CPUs, 0-100), "load_1m", "ram_available_bytes", "ram_total_bytes", "swap_used_bytes",
"swap_total_bytes"}}`` lines. A value NVML or
psutil cannot give is null. Lines are appended whole (one ``write`` on an ``O_APPEND`` file), several
attempts of one run follow each other in one file, and a reader skips a line that is not JSON (a kill in
the middle of a write). :func:`read_monitor` is the reader.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sd_scripts_compat.facts.atomic import AppendOnlyFile
from sd_scripts_compat.facts.contract import MONITOR_FILE

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["MONITOR_FILE", "Monitor", "NvmlSource", "PsutilSource", "read_monitor", "start_monitor"]
MONITOR_SCHEMA = 1
DEFAULT_INTERVAL_S = 2.0

# NVML's clock-event reasons worth naming (the library's constants; idle and app-clock settings are normal)
_THROTTLE_NAMES = {
    "SwPowerCap": "power_cap", "HwSlowdown": "hw_slowdown", "SwThermalSlowdown": "sw_thermal",
    "HwThermalSlowdown": "hw_thermal", "HwPowerBrakeSlowdown": "power_brake",
}

T = TypeVar("T")


class NvmlSource:
    """The GPUs through NVML; :meth:`open` returns None where NVML cannot start (no driver, no library)."""

    def __init__(self, nvml: ModuleType, handles: list[tuple[int, Any]]) -> None:
        self.nvml = nvml
        self.handles = handles
        self.reason_bits = {name: getattr(nvml, f"nvmlClocksEventReason{key}", None) or
                            getattr(nvml, f"nvmlClocksThrottleReason{key}", 0)
                            for key, name in _THROTTLE_NAMES.items()}

    @classmethod
    def open(cls, nvml: ModuleType | None = None) -> NvmlSource | None:
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
            nvml.nvmlInit()
            indices = visible_gpu_indices(nvml.nvmlDeviceGetCount(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            return cls(nvml, [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in indices])
        except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound / DriverNotLoaded: no GPUs
            return None

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": i, "name": _call(self.nvml.nvmlDeviceGetName, h),
                 "mem_total_bytes": getattr(_call(self.nvml.nvmlDeviceGetMemoryInfo, h), "total", None)}
                for i, h in self.handles]

    def sample(self) -> list[dict[str, Any]]:
        return [self._sample_one(i, h) for i, h in self.handles]

    def _sample_one(self, index: int, handle: object) -> dict[str, Any]:
        nvml = self.nvml
        util = _call(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = _call(nvml.nvmlDeviceGetMemoryInfo, handle)
        reasons_of = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        reasons = _call(reasons_of, handle) or 0
        power = _call(nvml.nvmlDeviceGetPowerUsage, handle)
        limit = _call(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        return {
            "index": index, "util_percent": getattr(util, "gpu", None),
            "mem_util_percent": getattr(util, "memory", None),
            "mem_used_bytes": getattr(memory, "used", None), "mem_total_bytes": getattr(memory, "total", None),
            "sm_clock_mhz": _call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
            "max_sm_clock_mhz": _call(nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": _call(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
            "power_w": power / 1000 if power is not None else None,
            "power_limit_w": limit / 1000 if limit is not None else None,
            "temp_c": _call(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
            "throttle": [name for name, bit in self.reason_bits.items() if bit and reasons & bit],
        }


class PsutilSource:
    """This process's CPU % and resident memory, the system's available RAM and swap (psutil)."""

    def __init__(self, psutil: ModuleType | None = None, pid: int | None = None) -> None:
        if psutil is None:
            import psutil as psutil_module

            psutil = psutil_module
        self.psutil = psutil
        self.process = psutil.Process(pid)
        self.process.cpu_percent(None)  # the first call starts the interval; it returns 0.0
        psutil.cpu_percent(None)  # the same for the whole machine

    def sample(self) -> tuple[dict[str, Any], dict[str, Any]]:
        memory, swap = self.psutil.virtual_memory(), self.psutil.swap_memory()
        proc = {"cpu_percent": _call(self.process.cpu_percent, None),
                "rss_bytes": getattr(_call(self.process.memory_info), "rss", None)}
        load = _call(os.getloadavg) if hasattr(os, "getloadavg") else None
        system = {"cpu_percent": _call(self.psutil.cpu_percent, None), "load_1m": load[0] if load else None,
                  "ram_available_bytes": memory.available, "ram_total_bytes": memory.total,
                  "swap_used_bytes": swap.used, "swap_total_bytes": swap.total}
        return proc, system


class Monitor:
    """The sampler thread: a header line, a sample at once, then one every ``interval_s``, a last one at stop."""

    def __init__(self, path: Path, interval_s: float, step: Callable[[], int], *, gpus: NvmlSource | None,
                 host: PsutilSource | None, max_steps: int | None = None) -> None:
        self.path, self.interval_s, self.step, self.max_steps = path, interval_s, step, max_steps
        self.gpus, self.host = gpus, host
        self._stop = threading.Event()
        self._file = AppendOnlyFile(path)
        self._thread = threading.Thread(target=self._run, name="autotune-monitor", daemon=True)

    def start(self) -> None:
        ram_total = self.host.psutil.virtual_memory().total if self.host else None
        self._file.write_line(json.dumps({
            "schema": MONITOR_SCHEMA, "kind": "header", "pid": os.getpid(), "interval_s": self.interval_s,
            "started": time.time(), "gpus": self.gpus.describe() if self.gpus else [],
            "ram_total_bytes": ram_total, "max_steps": self.max_steps, "cpu_count": os.cpu_count(),
            "threads": _torch_threads()}))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + 5)
        self._file.close()

    def sample(self) -> dict[str, Any]:
        proc, system = self.host.sample() if self.host else ({}, {})
        return {"schema": MONITOR_SCHEMA, "kind": "sample", "t": time.time(), "step": self.step(),
                "gpus": self.gpus.sample() if self.gpus else [], "proc": proc, "sys": system}

    def _run(self) -> None:
        while True:
            try:
                self._file.write_line(json.dumps(self.sample()))
            except Exception:  # noqa: BLE001 - a failed sample (a full disk, a driver hiccup) never stops training
                pass
            if self._stop.wait(self.interval_s):
                with contextlib.suppress(Exception):
                    self._file.write_line(json.dumps(self.sample()))  # the last sample: the run's end
                return


def _torch_threads() -> int | None:
    """torch's intra-op threads in this process (the engine has torch loaded; None where it has not)."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


@contextlib.contextmanager
def start_monitor(events_dir: str | os.PathLike[str] | None, interval_s: float | None, step: Callable[[], int],
                  *, enabled: bool = True, max_steps: int | None = None) -> Iterator[Monitor | None]:
    """The sampler for the ``with`` block, or None (off: no events folder, interval 0, not the main process)."""
    interval = DEFAULT_INTERVAL_S if interval_s is None else interval_s
    if not events_dir or not enabled or interval <= 0:
        yield None
        return
    Path(events_dir).mkdir(parents=True, exist_ok=True)
    monitor = Monitor(Path(events_dir) / MONITOR_FILE, interval, step, gpus=NvmlSource.open(), host=_psutil_source(),
                      max_steps=max_steps)
    monitor.start()
    try:
        yield monitor
    finally:
        monitor.stop()


def read_monitor(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The header and sample records of a monitor file, in order; unreadable lines and other schemas skipped."""
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("schema") == MONITOR_SCHEMA:
            records.append(record)
    return records


def visible_gpu_indices(count: int, cuda_visible: str | None) -> list[int]:
    """The NVML indices this process's CUDA sees: ``CUDA_VISIBLE_DEVICES`` as numbers (UUIDs and MIG names
    cannot be mapped without more NVML calls: then all GPUs)."""
    if not cuda_visible:
        return list(range(count))
    try:
        wanted = [int(part) for part in cuda_visible.split(",") if part.strip()]
    except ValueError:
        return list(range(count))
    return [i for i in wanted if 0 <= i < count]


def _psutil_source() -> PsutilSource | None:
    try:
        return PsutilSource()
    except Exception:  # noqa: BLE001 - psutil missing or refused (a sandbox): samples without host figures
        return None


def _call(function: Callable[..., Any], *args: object) -> T | None:
    """One NVML / psutil query; None where the card or the OS does not support it."""
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: that figure is unknown
        return None
