"""The real probe on this machine, checked against psutil, os and the NVML library itself."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import psutil
import pytest

from autotune.hardware.probe import SystemProbe, capability_flags, probe_system, render, torch_build

GIB = 1 << 30


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> SystemProbe:
    return probe_system(tmp_path_factory.mktemp("out"))


def test_cpu_matches_psutil_and_os(live):
    assert live.cpu.logical_cores == psutil.cpu_count(logical=True) == os.cpu_count()
    assert live.cpu.physical_cores == psutil.cpu_count(logical=False)
    if hasattr(os, "sched_getaffinity"):
        assert live.cpu.usable_cores == len(os.sched_getaffinity(0))
    assert live.cpu.arch and live.cpu.model


def test_memory_matches_psutil_and_meminfo(live):
    ram = psutil.virtual_memory()
    assert live.memory.ram_total_bytes == ram.total
    # available moves as other processes run: within 1 GiB of a fresh reading
    assert abs(live.memory.ram_available_bytes - ram.available) < GIB
    assert 0 < live.memory.ram_available_bytes <= live.memory.ram_total_bytes
    assert live.memory.swap_total_bytes == psutil.swap_memory().total
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        mem_total = int(fields["MemTotal"].split()[0]) * 1024
        assert abs(live.memory.ram_total_bytes - mem_total) <= 0.01 * mem_total


def test_disk_free_matches_statvfs(live):
    checked = live.disk.checked_path
    assert live.disk.path == checked and os.path.isdir(checked)
    if hasattr(os, "statvfs"):
        stat = os.statvfs(checked)
        free = stat.f_bavail * stat.f_frsize
        assert abs(live.disk.free_bytes - free) < GIB // 4  # others write to this disk meanwhile
        assert live.disk.total_bytes == stat.f_blocks * stat.f_frsize


def test_disk_for_a_folder_not_made_yet(tmp_path):
    probe = probe_system(tmp_path / "runs" / "lora-1")
    assert probe.disk.path == str(tmp_path / "runs" / "lora-1")
    assert probe.disk.checked_path == str(tmp_path)
    assert abs(probe.disk.free_bytes - shutil.disk_usage(tmp_path).free) < GIB // 4


def test_gpu_answer_matches_nvml_itself(live):
    """Whatever NVML says on this machine, the probe reports it: here, the library is missing."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        assert live.gpus == [] and live.cuda_gpu_found is False and live.accelerator in ("cpu", "rocm", "mps")
        assert type(error).__name__ in live.cuda_reason
        return
    try:
        count = pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    assert len([gpu for gpu in live.gpus if gpu.backend == "cuda"]) == count


def test_libraries_from_metadata(live):
    for name, info in live.libraries.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            assert info == type(info)(installed=False)
            continue
        assert info.installed and info.version == version
    torch = live.libraries["torch"]
    if torch.installed and torch.version.endswith("+cpu"):
        assert torch.build == "cpu"


def test_torch_build_from_version_suffix():
    # this venv's torch/version.py names no CUDA/HIP, so the suffix decides
    assert torch_build("2.5.1+cu121") == "cuda 12.1"
    assert torch_build("2.6.0+cu126") == "cuda 12.6"
    assert torch_build("2.5.1+rocm6.2") == "rocm 6.2"
    assert torch_build("2.13.0+cpu") == ("macos" if sys.platform == "darwin" else "cpu")


def test_platform(live):
    import platform

    assert live.platform.os == platform.system()
    assert live.platform.python_version == platform.python_version()
    assert live.platform.python_executable == sys.executable


def test_json_round_trip_is_exact(live):
    text = live.to_json()
    again = SystemProbe.from_json(text)
    assert again == live
    assert again.to_json() == text
    assert json.loads(text)["schema_version"] == 1


def test_capability_flags():
    assert capability_flags("6.1") == {"fp16_tensor_cores": False, "bf16": False, "fp8": False, "flash_sdpa": False}
    assert capability_flags("7.0")["fp16_tensor_cores"] and not capability_flags("7.5")["bf16"]
    assert capability_flags("8.0") == {"fp16_tensor_cores": True, "bf16": True, "fp8": False, "flash_sdpa": True}
    assert capability_flags("8.9")["fp8"] and capability_flags("12.0")["fp8"]
    assert set(capability_flags(None).values()) == {None}


def test_assumed_gpu_from_catalogue(tmp_path):
    probe = probe_system(tmp_path, assume_gpu="RTX 3060")
    (gpu,) = probe.gpus
    assert probe.assumed_gpu == "RTX 3060" and gpu.source == "catalog" and gpu.catalog_name == "RTX 3060 12GB"
    assert gpu.vram_total_bytes == 12 * GIB and gpu.vram_free_bytes is None
    assert (gpu.compute_capability, gpu.bf16, gpu.fp8) == ("8.6", True, False)
    assert probe.cuda_gpu_found and probe.accelerator == "cuda"
    amd = probe_system(tmp_path, assume_gpu="7900 XTX")
    assert amd.accelerator == "rocm" and not amd.cuda_gpu_found and amd.gpus[0].gfx_arch == "gfx1100"
    assert amd.gpus[0].compute_capability is None and amd.gpus[0].fp16_tensor_cores is None


def test_human_view(live):
    from rich.console import Console

    buffer = io.StringIO()
    render(live, Console(file=buffer, width=140))
    text = buffer.getvalue()
    assert "System" in text and "Libraries" in text and "torch" in text
    if not live.cuda_gpu_found:
        assert "no CUDA GPU found" in text


def test_probe_imports_nothing_heavy_without_a_gpu(tmp_path):
    code = ("import json, sys; from autotune.hardware.probe import probe_system; p = probe_system(sys.argv[1]); "
            "heavy = ('torch', 'diffusers', 'transformers', 'rich'); "
            "print(json.dumps({'gpu': p.cuda_gpu_found, 'build': p.libraries['torch'].build, "
            "'mods': sorted(m for m in heavy if m in sys.modules)}))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads(done.stdout)
    if not result["gpu"] and not str(result["build"]).startswith("rocm") and sys.platform != "darwin":
        assert result["mods"] == []


def test_cpu_bf16_flags_from_cpuinfo_text():
    """x86 ``flags`` (avx512_bf16, amx_bf16) and Arm ``Features`` (bf16) both count as native bf16."""
    from autotune.hardware.probe import _cpu_flags

    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
    amx = "flags\t\t: avx512f amx_bf16 amx_tile\n"
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"
    old = "flags\t\t: fpu sse2 avx2 fma\n"
    assert "avx512_bf16" in _cpu_flags(x86) and "amx_bf16" in _cpu_flags(amx) and "bf16" in _cpu_flags(arm)
    assert not {"avx512_bf16", "amx_bf16", "bf16"} & _cpu_flags(old)
    assert _cpu_flags("model name : something\n") is None


def test_probe_reports_this_cpus_bf16(live):
    cpu = live.cpu
    if sys.platform.startswith("linux"):
        flags = Path("/proc/cpuinfo").read_text().split()
        assert cpu.avx512_bf16 == ("avx512_bf16" in flags) and cpu.amx_bf16 == ("amx_bf16" in flags)
        assert cpu.bf16_native == (cpu.avx512_bf16 or cpu.amx_bf16 or "bf16" in flags)


def test_without_a_gpu_only_xformers_is_said_to_need_cuda():
    """bitsandbytes has a CPU backend (its AdamW8bit steps here, with 8-bit state; test_train_engine trains with
    it); the probe said it needed a CUDA GPU. xformers does."""
    import torch
    from bitsandbytes.optim import AdamW8bit

    from autotune.hardware.probe import LIBRARY_NAMES, LibraryInfo, _library_notes

    weight = torch.nn.Parameter(torch.ones(64, 64))
    optimizer = AdamW8bit([weight], lr=1e-2)
    (weight ** 2).sum().backward()
    optimizer.step()
    assert optimizer.state[weight]["state1"].dtype == torch.uint8 and weight.detach().max() < 1.0

    libraries = {name: LibraryInfo(installed=True, version="1.0", build="cpu" if name == "torch" else None)
                 for name in LIBRARY_NAMES}
    notes: list[str] = []
    _library_notes([], libraries, notes, measured=True)
    assert notes == ["xformers 1.0 is installed but needs a CUDA GPU for its kernels"]
