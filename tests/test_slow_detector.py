"""The slow-run detector on stand-in monitor traces (no GPU or swapping machine here): a VRAM spill, a
swapping host and throttled clocks are found; a healthy trace gives nothing. The file-tailing detector
reads a really written, growing file."""

from __future__ import annotations

import json
import threading

from autotune.report.detector import LiveDetector, attempts, detect, watch
from sd_scripts_compat.facts.atomic import AppendOnlyFile

GIB = 2**30


def gpu(used_gib: float, *, util: int = 98, clock: int = 2520, throttle: tuple[str, ...] = ()) -> dict:
    return {"index": 0, "util_percent": util, "mem_used_bytes": int(used_gib * GIB), "mem_total_bytes": 24 * GIB,
            "sm_clock_mhz": clock, "max_sm_clock_mhz": 2520, "throttle": list(throttle)}


def host(available_gib: float = 20.0, swap_gib: float = 0.0) -> dict:
    return {"ram_available_bytes": int(available_gib * GIB), "ram_total_bytes": 32 * GIB,
            "swap_used_bytes": int(swap_gib * GIB), "swap_total_bytes": 8 * GIB}


def trace(seconds: int, rate_at, gpu_at, host_at=lambda t: host()) -> list[dict]:
    samples, step = [], 1.0
    for t in range(seconds):
        samples.append({"schema": 1, "kind": "sample", "t": 1000.0 + t, "step": int(step), "gpus": [gpu_at(t)],
                        "proc": {"cpu_percent": 100.0, "rss_bytes": 3 * GIB}, "sys": host_at(t)})
        step += rate_at(t)
    return samples


def test_it_per_s_falling_10x_with_vram_at_the_ceiling_is_a_spill_fake_trace():
    samples = trace(90, lambda t: 4.0 if t < 40 else 0.4, lambda t: gpu(18.0 if t < 40 else 23.9))
    findings = detect(samples, max_steps=10_000)
    assert [f.kind for f in findings] == ["vram_spill"]
    line = findings[0].line()
    assert "fell 10x" in line and "sysmem fallback" in line and "lower batch / resolution" in line
    assert "GPU 0: 23.9 of 24.0 GiB" in line


def test_a_slowdown_with_memory_to_spare_is_no_spill_and_a_full_card_at_pace_is_none_fake_trace():
    slow_not_full = trace(90, lambda t: 4.0 if t < 40 else 0.4, lambda t: gpu(12.0))
    full_at_pace = trace(90, lambda t: 4.0, lambda t: gpu(23.9))
    assert detect(slow_not_full) == [] and detect(full_at_pace) == []


def test_swap_growing_with_ram_available_near_zero_is_the_swap_warning_fake_trace():
    samples = trace(60, lambda t: 2.0, lambda t: gpu(10.0),
                    lambda t: host(available_gib=0.1 if t > 10 else 6.0, swap_gib=0.05 * t))
    findings = detect(samples)
    assert [f.kind for f in findings] == ["swap"]
    assert "system RAM full and swapping" in findings[0].message
    assert "lower workers" in findings[0].fix and "cache_latents_to_disk" in findings[0].fix


def test_thermal_throttling_while_busy_is_found_and_an_ordinary_power_cap_at_full_clock_is_not_fake_nvml():
    hot = trace(30, lambda t: 2.0, lambda t: gpu(10.0, clock=1500, throttle=("sw_thermal",)))
    assert [f.kind for f in detect(hot)] == ["throttle"]
    assert "clocks throttled (thermal / power)" in detect(hot)[0].message and "1500 of 2520" in detect(hot)[0].message
    capped_at_speed = trace(30, lambda t: 2.0, lambda t: gpu(10.0, clock=2400, throttle=("power_cap",)))
    assert detect(capped_at_speed) == []


def test_a_healthy_trace_and_a_cpu_trace_without_gpus_give_no_warning_fake_trace():
    healthy = trace(120, lambda t: 3.0 + 0.3 * (t % 3), lambda t: gpu(18.0 + (t % 2)))
    assert detect(healthy, max_steps=10_000) == []
    cpu = [{**s, "gpus": []} for s in healthy]
    assert detect(cpu) == []


def test_live_detector_tails_the_growing_file_reports_once_and_restarts_at_a_header_fake_trace(tmp_path):
    path = tmp_path / "monitor.jsonl"
    writer = AppendOnlyFile(path)
    writer.write_line(json.dumps({"schema": 1, "kind": "header", "pid": 1, "max_steps": 100_000}))
    samples = trace(90, lambda t: 4.0 if t < 40 else 0.4, lambda t: gpu(18.0 if t < 40 else 23.9))
    live = LiveDetector(path)
    for sample in samples[:40]:
        writer.write_line(json.dumps(sample))
    assert live.poll() == []
    for sample in samples[40:]:
        writer.write_line(json.dumps(sample))
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"schema": 1, "kind": "sa')  # a line in the middle of its write waits
    assert [f.kind for f in live.poll()] == ["vram_spill"]
    assert live.poll() == []  # said once
    writer.close()
    assert len(attempts([json.loads(line) for line in path.read_text().splitlines()[:-1]])) == 1


def test_watch_says_each_finding_as_a_warning_line_fake_trace(tmp_path):
    path = tmp_path / "monitor.jsonl"
    lines = [json.dumps({"schema": 1, "kind": "header", "pid": 1, "max_steps": None})]
    lines += [json.dumps(s) for s in trace(60, lambda t: 2.0, lambda t: gpu(10.0),
                                           lambda t: host(available_gib=0.1, swap_gib=0.05 * t))]
    path.write_text("\n".join(lines) + "\n")
    said: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(target=watch, args=(path, said.append, stop, 0.01))
    thread.start()
    for _ in range(200):
        if said:
            break
        stop.wait(0.01)
    stop.set()
    thread.join(5)
    assert said and said[0].startswith("warning: system RAM full and swapping")
