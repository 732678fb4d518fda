"""The engine's background sampler: NVML through a stand-in (no driver here), psutil for real, the file
really written and re-read."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

from sd_scripts_compat.facts.atomic import AppendOnlyFile
from sd_scripts_compat.training.monitor import (
    MONITOR_FILE,
    Monitor,
    NvmlSource,
    PsutilSource,
    read_monitor,
    start_monitor,
    visible_gpu_indices,
)

GIB = 2**30


class FakeNvml:
    """The few pynvml calls the sampler makes, for two 24 GB cards; card 1 is power-capped and hot."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
    nvmlClocksEventReasonSwPowerCap = 0x4
    nvmlClocksEventReasonHwSlowdown = 0x8
    nvmlClocksEventReasonSwThermalSlowdown = 0x20
    nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80

    def __init__(self) -> None:
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=24 * GIB, used=(10 + 13 * handle) * GIB, free=(14 - 13 * handle) * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=97 - 60 * handle, memory=40)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return 0x4 | 0x20 | 0x1 if handle == 1 else 0x0

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 450_000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return 450_000

    def nvmlDeviceGetClockInfo(self, handle: int, kind: int) -> int:
        return (2520 - 900 * handle) if kind == self.NVML_CLOCK_SM else 10501

    def nvmlDeviceGetMaxClockInfo(self, handle: int, kind: int) -> int:
        return 2520

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        raise RuntimeError("NVMLError_NotSupported")  # a figure the card does not give is null


def test_nvml_source_samples_every_visible_gpu_with_throttle_names_fake_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    source = NvmlSource.open(FakeNvml())
    assert source is not None
    first, second = source.sample()
    assert first["util_percent"] == 97 and first["mem_used_bytes"] == 10 * GIB and first["throttle"] == []
    assert first["power_w"] == 450.0 and first["temp_c"] is None and first["max_sm_clock_mhz"] == 2520
    assert second["throttle"] == ["power_cap", "sw_thermal"] and second["sm_clock_mhz"] == 1620
    assert [gpu["name"] for gpu in source.describe()] == ["NVIDIA GeForce RTX 4090"] * 2


def test_nvml_source_follows_cuda_visible_devices_fake_nvml(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    source = NvmlSource.open(FakeNvml())
    assert [gpu["index"] for gpu in source.sample()] == [1]
    assert visible_gpu_indices(4, "GPU-1234abcd") == [0, 1, 2, 3]  # a UUID: all of them
    assert visible_gpu_indices(2, "0,5") == [0]


def test_without_a_driver_nvml_is_simply_absent():
    class NoDriver:
        def nvmlInit(self) -> None:
            raise RuntimeError("NVMLError_LibraryNotFound")

    assert NvmlSource.open(NoDriver()) is None
    assert NvmlSource.open() is None  # this machine: pynvml is installed, no driver


def test_monitor_writes_a_header_and_samples_with_the_step_and_real_psutil_figures_fake_nvml(tmp_path):
    path = tmp_path / "events" / MONITOR_FILE
    step = {"n": 0}
    monitor = Monitor(path, 0.05, lambda: step["n"], gpus=NvmlSource.open(FakeNvml()), host=PsutilSource())
    monitor.start()
    for n in range(1, 6):
        step["n"] = n
        time.sleep(0.04)
    monitor.stop()
    records = read_monitor(path)
    header, samples = records[0], records[1:]
    assert header["kind"] == "header" and header["pid"] == os.getpid() and len(header["gpus"]) == 2
    assert len(samples) >= 3 and all(s["kind"] == "sample" for s in samples)
    assert samples[-1]["step"] == 5  # the last sample is taken at stop
    steps = [s["step"] for s in samples]
    assert steps == sorted(steps)
    host = samples[-1]
    import psutil

    assert host["proc"]["rss_bytes"] > 10 * 2**20
    assert abs(host["proc"]["rss_bytes"] - psutil.Process().memory_info().rss) < 200 * 2**20
    assert host["sys"]["ram_total_bytes"] == psutil.virtual_memory().total >= host["sys"]["ram_available_bytes"]
    assert host["sys"]["swap_used_bytes"] >= 0 and len(host["gpus"]) == 2


def test_a_torn_last_line_and_other_schemas_are_skipped_and_attempts_append(tmp_path):
    path = tmp_path / MONITOR_FILE
    first = AppendOnlyFile(path)
    first.write_line(json.dumps({"schema": 1, "kind": "header", "pid": 1}))
    first.write_line(json.dumps({"schema": 99, "kind": "sample"}))
    first.close()
    second = AppendOnlyFile(path)
    second.write_line(json.dumps({"schema": 1, "kind": "header", "pid": 2}))
    second.close()
    with open(path, "a", encoding="utf-8") as handle:
        handle.write('{"schema": 1, "kind": "sam')  # killed in the middle of a write
    assert [r["pid"] for r in read_monitor(path)] == [1, 2]
    assert read_monitor(tmp_path / "missing.jsonl") == []


def test_monitor_off_writes_nothing_and_costs_no_thread(tmp_path):
    for events, interval, enabled in ((tmp_path / "a", 0.0, True), (None, 2.0, True), (tmp_path / "b", 2.0, False)):
        with start_monitor(events, interval, lambda: 0, enabled=enabled) as monitor:
            assert monitor is None
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
