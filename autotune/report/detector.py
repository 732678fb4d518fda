"""The slow-run detector: what in the engine's ``monitor.jsonl`` explains a run slower than it should be.

Three patterns, each a :class:`Finding` with its fix:

- ``vram_spill``: the steps per second fell :data:`SPILL_SLOWDOWN`-fold or more from the run's own pace while
  a GPU's dedicated memory sat at its ceiling. That is the Windows driver's "CUDA sysmem fallback": instead
  of an out-of-memory error it moves allocations into shared system memory over PCIe, and training crawls.
- ``swap``: system RAM (almost) full while swap use grows: the OS pages the trainer (or its loader workers,
  or the latent cache) out to disk.
- ``throttle``: the GPU's clocks held down for thermal or power reasons (NVML's clock-event reasons) while it
  was busy, most of the time.

:func:`detect` judges a whole trace (the report); :class:`LiveDetector` tails the file while the watchdog
supervises and yields each kind once (``autotune run`` prints it as a warning line).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import threading

GIB = 2**30
SPILL_SLOWDOWN = 3.0  # it/s at most a third of the run's pace ...
SPILL_MEMORY_FRACTION = 0.95  # ... with dedicated memory at least this full
SPILL_WINDOWS = 2  # ... over this many consecutive windows (a validation pause is no spill)
RATE_WINDOW_S = 10.0
SWAP_GROWTH_BYTES = 256 * 2**20
RAM_NEAR_FULL_FRACTION = 0.05  # available under 5% of total (or under 512 MiB) is full
RAM_NEAR_FULL_BYTES = 512 * 2**20
THROTTLE_REASONS = ("sw_thermal", "hw_thermal", "hw_slowdown", "power_brake")
THROTTLE_SHARE = 0.5
THROTTLE_CLOCK_FRACTION = 0.8  # a power cap counts only when it holds the SM clock under 80% of its maximum
BUSY_PERCENT = 50


@dataclass(frozen=True)
class Finding:
    """One explained slowdown: ``kind`` (vram_spill | swap | throttle), the line to show, its fix."""

    kind: str
    message: str
    fix: str
    device: int | None = None

    def line(self) -> str:
        return f"{self.message}; {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "fix": self.fix, "device": self.device}


def attempts(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The trace cut at each engine process's header: (header, its samples) per attempt, in order."""
    out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for record in records:
        if record.get("kind") == "header":
            out.append((record, []))
        elif record.get("kind") == "sample" and out:
            out[-1][1].append(record)
    return out


def training_samples(samples: list[dict[str, Any]], max_steps: int | None) -> list[dict[str, Any]]:
    """The samples taken while steps ran: after the first step (setup, caching and the first step's warm-up
    come before) and before the last (the final save comes after)."""
    return [s for s in samples if (s.get("step") or 0) >= 1 and (max_steps is None or (s.get("step") or 0) < max_steps)]


def window_rates(samples: list[dict[str, Any]], window_s: float = RATE_WINDOW_S) -> list[tuple[int, int, float]]:
    """(first, last, steps per second) over consecutive windows of about ``window_s`` seconds."""
    windows: list[tuple[int, int, float]] = []
    begin = 0
    for end in range(1, len(samples)):
        span = samples[end]["t"] - samples[begin]["t"]
        if span >= window_s or end == len(samples) - 1 and span > 0 and not windows:
            windows.append((begin, end, (samples[end]["step"] - samples[begin]["step"]) / span))
            begin = end
    return windows


def detect(samples: list[dict[str, Any]], max_steps: int | None = None) -> list[Finding]:
    """Every pattern the samples of one attempt show (see the module docstring); a healthy run gives none."""
    during = training_samples(samples, max_steps)
    findings = [*_spill(during), *_swap(during or samples), *_throttle(during)]
    return findings


def _spill(samples: list[dict[str, Any]]) -> list[Finding]:
    windows = window_rates(samples)
    if len(windows) < SPILL_WINDOWS + 1:
        return []
    pace = _percentile([rate for _, _, rate in windows], 0.75)
    if pace <= 0:
        return []
    run = 0
    for first, last, rate in windows:
        full = _fullest_gpu(samples[first:last + 1])
        slow = rate <= pace / SPILL_SLOWDOWN and full is not None and full[1] >= SPILL_MEMORY_FRACTION * full[2]
        run = run + 1 if slow else 0
        if run >= SPILL_WINDOWS and full is not None:
            index, used, total = full
            fell = pace / rate if rate > 0 else float("inf")
            fell_text = f"{fell:.0f}x" if fell != float("inf") else "to zero"
            return [Finding(
                "vram_spill",
                f"it/s fell {fell_text} ({pace:.2f} -> {rate:.2f}) while dedicated VRAM sat at its ceiling "
                f"(GPU {index}: {used / GIB:.1f} of {total / GIB:.1f} GiB): the driver is spilling into shared system "
                "memory (Windows CUDA sysmem fallback)",
                "turn the fallback off (NVIDIA Control Panel > Manage 3D settings > CUDA - Sysmem Fallback Policy: "
                "Prefer No Sysmem Fallback) or lower batch / resolution", device=index)]
    return []


def _fullest_gpu(samples: list[dict[str, Any]]) -> tuple[int, float, float] | None:
    """(index, mean used, total) of the GPU whose memory was fullest over ``samples``, None without NVML."""
    best: tuple[int, float, float] | None = None
    by_index: dict[int, list[tuple[float, float]]] = {}
    for sample in samples:
        for gpu in sample.get("gpus") or []:
            if gpu.get("mem_used_bytes") is not None and gpu.get("mem_total_bytes"):
                by_index.setdefault(gpu["index"], []).append((gpu["mem_used_bytes"], gpu["mem_total_bytes"]))
    for index, figures in by_index.items():
        used = statistics.fmean(u for u, _ in figures)
        total = figures[0][1]
        if best is None or used / total > best[1] / best[2]:
            best = (index, used, total)
    return best


def _swap(samples: list[dict[str, Any]]) -> list[Finding]:
    host = [s["sys"] for s in samples if (s.get("sys") or {}).get("swap_used_bytes") is not None]
    if len(host) < 2:
        return []
    growth = host[-1]["swap_used_bytes"] - min(h["swap_used_bytes"] for h in host)
    low = [h for h in host if h.get("ram_available_bytes") is not None and h.get("ram_total_bytes")
           and h["ram_available_bytes"] <= max(RAM_NEAR_FULL_FRACTION * h["ram_total_bytes"], RAM_NEAR_FULL_BYTES)]
    if growth < SWAP_GROWTH_BYTES or len(low) < max(2, len(host) // 4):
        return []
    least = min(h["ram_available_bytes"] for h in low)
    return [Finding(
        "swap", f"system RAM full and swapping ({least / GIB:.2f} GiB available, swap grew by {growth / GIB:.1f} GiB)",
        "lower workers (max_data_loader_n_workers), or cache latents to disk (cache_latents_to_disk = true) "
        "instead of in memory")]


def _throttle(samples: list[dict[str, Any]]) -> list[Finding]:
    findings = []
    busy_by_gpu: dict[int, list[dict[str, Any]]] = {}
    for sample in samples:
        for gpu in sample.get("gpus") or []:
            if (gpu.get("util_percent") or 0) >= BUSY_PERCENT:
                busy_by_gpu.setdefault(gpu["index"], []).append(gpu)
    for index, busy in sorted(busy_by_gpu.items()):
        held = [g for g in busy if _held_down(g)]
        if len(busy) < 3 or len(held) < THROTTLE_SHARE * len(busy):
            continue
        reasons = sorted({r for g in held for r in g.get("throttle") or []})
        clocks = [g["sm_clock_mhz"] for g in held if g.get("sm_clock_mhz")]
        top = next((g["max_sm_clock_mhz"] for g in held if g.get("max_sm_clock_mhz")), None)
        clock = f", SM clock {statistics.fmean(clocks):.0f} of {top} MHz" if clocks and top else ""
        findings.append(Finding(
            "throttle", f"clocks throttled (thermal / power) on GPU {index}: {', '.join(reasons)} in "
            f"{100 * len(held) / len(busy):.0f}% of busy samples{clock}",
            "improve the card's cooling / airflow, check its power limit (nvidia-smi -q -d PERFORMANCE,POWER)",
            device=index))
    return findings


def _held_down(gpu: dict[str, Any]) -> bool:
    reasons = set(gpu.get("throttle") or [])
    if reasons & set(THROTTLE_REASONS):
        return True
    clock, top = gpu.get("sm_clock_mhz"), gpu.get("max_sm_clock_mhz")
    if not (clock and top):
        return False
    return "power_cap" in reasons and clock < THROTTLE_CLOCK_FRACTION * top


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class LiveDetector:
    """Tails a growing monitor file and reports each kind of finding once, for the current attempt."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._header: dict[str, Any] = {}
        self._samples: list[dict[str, Any]] = []
        self.reported: set[str] = set()

    def poll(self) -> list[Finding]:
        """Read the lines added since the last call; the findings not reported before."""
        for record in self._new_records():
            if record.get("kind") == "header":
                self._header, self._samples = record, []
            elif record.get("kind") == "sample":
                self._samples.append(record)
        new = [f for f in detect(self._samples, self._header.get("max_steps")) if f.kind not in self.reported]
        self.reported.update(f.kind for f in new)
        return new

    def _new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


def watch(path: Path, say: Callable[[str], None], stop: threading.Event, every_s: float = 5.0) -> None:
    """Poll ``path`` every ``every_s`` until ``stop`` (a threading.Event) is set; ``say`` each new finding."""
    detector = LiveDetector(path)
    while not stop.wait(every_s):
        for finding in detector.poll():
            say(f"warning: {finding.line()}")
