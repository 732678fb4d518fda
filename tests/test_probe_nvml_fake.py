"""The NVML path of the probe, through a stand-in ``pynvml`` module (this machine has no NVIDIA driver).

The stand-in reuses the real nvidia-ml-py error classes (``pynvml.NVMLError`` and its per-code subclasses), so the
probe's error handling meets the exceptions the real library raises; only the device answers are made up.
"""

from __future__ import annotations

import json
import os
import sys
import types
from types import SimpleNamespace

import pynvml as real_pynvml
import pytest

from autotune.hardware import probe as probe_module
from autotune.hardware.probe import SystemProbe, probe_system
from sd_scripts_compat.facts.errors import UserError

MIB = 1 << 20


def fake_device(name: str, total_mib: int, used_mib: int, cc: tuple[int, int], display: int = 0,
                compute: list[tuple[int, int | None]] = (), graphics: list[tuple[int, int | None]] = (),
                uuid: str = "GPU-00000000-0000-0000-0000-000000000000", pcie: tuple[int, int] = (4, 16),
                bus: str = "00000000:01:00.0", nvlink_to: tuple[str, ...] = (), nvlink_mbps: int | None = None) -> dict:
    return {"name": name, "total": total_mib * MIB, "used": used_mib * MIB, "cc": cc, "display": display,
            "compute": list(compute), "graphics": list(graphics), "uuid": uuid, "pcie": pcie, "bus": bus,
            "nvlink_to": list(nvlink_to), "nvlink_mbps": nvlink_mbps}


def make_fake_pynvml(devices: list[dict], init_error: int | None = None,
                     errors: dict[tuple[str, int | None], int] | None = None, process_names: dict | None = None,
                     calls: list[str] | None = None) -> types.ModuleType:
    """A module with pynvml's names; ``errors[(function, device_index)] = code`` makes that call raise."""
    errors = errors or {}
    process_names = process_names or {}
    calls = calls if calls is not None else []
    module = types.ModuleType("pynvml")
    module.NVMLError = real_pynvml.NVMLError

    def check(function: str, index: int | None = None) -> None:
        calls.append(function)
        code = errors.get((function, index))
        if code is not None:
            raise real_pynvml.NVMLError(code)

    def nvmlInit():
        calls.append("nvmlInit")
        if init_error is not None:
            raise real_pynvml.NVMLError(init_error)

    def device(handle: int) -> dict:
        return devices[handle]

    def per_device(function: str, answer):
        def call(handle):
            check(function, handle)
            return answer(device(handle))
        return call

    def processes(kind: str):
        def answer(dev):
            return [SimpleNamespace(pid=pid, usedGpuMemory=None if used is None else used * MIB)
                    for pid, used in dev[kind]]
        return answer

    def get_count():
        check("nvmlDeviceGetCount")
        return len(devices)

    def get_handle(index):
        check("nvmlDeviceGetHandleByIndex", index)
        return index

    def process_name(pid):
        check("nvmlSystemGetProcessName")
        if pid not in process_names:
            raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_FOUND)
        return process_names[pid]

    module.nvmlInit = nvmlInit
    module.nvmlShutdown = lambda: calls.append("nvmlShutdown")
    module.nvmlSystemGetDriverVersion = lambda: (check("nvmlSystemGetDriverVersion"), "550.54.15")[1]
    module.nvmlSystemGetCudaDriverVersion = lambda: (check("nvmlSystemGetCudaDriverVersion"), 12040)[1]
    module.nvmlSystemGetProcessName = process_name
    module.nvmlDeviceGetCount = get_count
    module.nvmlDeviceGetHandleByIndex = get_handle
    module.nvmlDeviceGetName = per_device("nvmlDeviceGetName", lambda d: d["name"])
    module.nvmlDeviceGetUUID = per_device("nvmlDeviceGetUUID", lambda d: d["uuid"])
    module.nvmlDeviceGetPciInfo = per_device("nvmlDeviceGetPciInfo",
                                             lambda d: SimpleNamespace(busId=d["bus"].encode()))
    module.nvmlDeviceGetCurrPcieLinkGeneration = per_device("nvmlDeviceGetCurrPcieLinkGeneration",
                                                            lambda d: d["pcie"][0])
    module.nvmlDeviceGetCurrPcieLinkWidth = per_device("nvmlDeviceGetCurrPcieLinkWidth", lambda d: d["pcie"][1])
    module.NVML_NVLINK_MAX_LINKS = 4

    def nvlink_state(handle, link):
        check("nvmlDeviceGetNvLinkState", handle)
        if not device(handle)["nvlink_to"]:  # a consumer card without NVLink, as the driver answers
            raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(link < len(device(handle)["nvlink_to"]))

    def nvlink_remote(handle, link):
        return SimpleNamespace(busId=device(handle)["nvlink_to"][link].encode())

    def topology(first, second):
        check("nvmlDeviceGetTopologyCommonAncestor", first)
        return 30  # both cards on the CPU's host bridge

    def field_values(handle, fields):  # NVML's common NVLink speed (MB/s per link), where the fake card has it
        check("nvmlDeviceGetFieldValues", handle)
        speed = device(handle)["nvlink_mbps"]
        if speed is None or fields != [module.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON]:
            raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=speed))]

    module.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = real_pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON
    module.nvmlDeviceGetFieldValues = field_values
    module.nvmlDeviceGetNvLinkState = nvlink_state
    module.nvmlDeviceGetNvLinkRemotePciInfo = nvlink_remote
    module.nvmlDeviceGetTopologyCommonAncestor = topology
    module.nvmlDeviceGetMemoryInfo = per_device(
        "nvmlDeviceGetMemoryInfo", lambda d: SimpleNamespace(total=d["total"], used=d["used"],
                                                             free=d["total"] - d["used"]))
    module.nvmlDeviceGetCudaComputeCapability = per_device("nvmlDeviceGetCudaComputeCapability", lambda d: d["cc"])
    module.nvmlDeviceGetDisplayActive = per_device("nvmlDeviceGetDisplayActive", lambda d: d["display"])
    module.nvmlDeviceGetComputeRunningProcesses = per_device("nvmlDeviceGetComputeRunningProcesses",
                                                             processes("compute"))
    module.nvmlDeviceGetGraphicsRunningProcesses = per_device("nvmlDeviceGetGraphicsRunningProcesses",
                                                              processes("graphics"))
    return module


@pytest.fixture
def install(monkeypatch):
    """Put a stand-in pynvml where ``import pynvml`` finds it (restored after the test)."""

    def put(module: types.ModuleType | None) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)

    return put


RTX_3060 = dict(name="NVIDIA GeForce RTX 3060", total_mib=12288, used_mib=1900, cc=(8, 6))


def test_fake_nvml_one_gpu_with_display_and_other_processes(install, tmp_path):
    own = os.getpid()
    device = fake_device(**RTX_3060, display=1, compute=[(4242, 1024), (own, 500)],
                         graphics=[(1111, 300), (4242, 1024), (9_000_002, None)])  # no such pid here
    calls: list[str] = []
    install(make_fake_pynvml([device], process_names={1111: b"/usr/lib/xorg/Xorg", 4242: "python"}, calls=calls))
    probe = probe_system(tmp_path)

    assert probe.cuda_gpu_found and probe.cuda_reason is None and probe.accelerator == "cuda"
    (gpu,) = probe.gpus
    assert gpu.name == "NVIDIA GeForce RTX 3060" and gpu.vendor == "nvidia" and gpu.backend == "cuda"
    assert gpu.vram_total_bytes == 12288 * MIB and gpu.vram_used_bytes == 1900 * MIB
    assert gpu.vram_free_bytes == (12288 - 1900) * MIB
    assert gpu.compute_capability == "8.6" and gpu.driver_version == "550.54.15" and gpu.cuda_driver_version == "12.4"
    assert gpu.pci_bus_id == "00000000:01:00.0" and gpu.uuid.startswith("GPU-")
    assert (gpu.fp16_tensor_cores, gpu.bf16, gpu.fp8, gpu.flash_sdpa) == (True, True, False, True)
    assert gpu.display_active is True
    # our own pid is left out; 4242 in both lists is one process; an unknown size stays unknown
    assert [(p.pid, p.name, p.used_vram_bytes, p.kind) for p in gpu.other_processes] == [
        (1111, "/usr/lib/xorg/Xorg", 300 * MIB, "graphics"),
        (4242, "python", 1024 * MIB, "compute+graphics"),
        (9_000_002, None, None, "graphics"),
    ]
    assert gpu.other_processes_vram_bytes == (300 + 1024) * MIB
    # rates NVML does not give come from the catalogue
    assert gpu.catalog_name == "RTX 3060 12GB" and gpu.fp16_tensor_tflops == 25.5
    assert gpu.memory_bandwidth_gbs == 360.0
    assert any("drives a display" in note for note in probe.notes)
    assert any("3 other process(es)" in note for note in probe.notes)
    # this venv's torch is a CPU build: the probe says so instead of importing it
    assert probe.torch_imported is False
    assert any("CPU build" in note for note in probe.notes)
    assert calls[0] == "nvmlInit" and calls[-1] == "nvmlShutdown"


def test_fake_nvml_two_gpus(install, tmp_path):
    devices = [
        fake_device("NVIDIA GeForce RTX 4090", 24564, 400, (8, 9), display=1, uuid="GPU-aaaa"),
        fake_device("NVIDIA GeForce RTX 3090", 24576, 10, (8, 6), uuid="GPU-bbbb"),
    ]
    install(make_fake_pynvml(devices))
    probe = probe_system(tmp_path)

    assert [gpu.index for gpu in probe.gpus] == [0, 1]
    first, second = probe.gpus
    assert (first.catalog_name, second.catalog_name) == ("RTX 4090", "RTX 3090")
    assert (first.fp8, second.fp8) == (True, False)
    assert (first.bf16, second.bf16) == (True, True)
    assert (first.display_active, second.display_active) == (True, False)
    assert second.other_processes == [] and second.other_processes_vram_bytes == 0
    assert first.bf16_tensor_tflops == 165.2 and second.bf16_tensor_tflops == 71.0


def test_fake_nvml_old_cards_flags_and_catalogue_miss(install, tmp_path):
    devices = [
        fake_device("NVIDIA GeForce GTX 1080", 8192, 0, (6, 1)),
        fake_device("Tesla T4", 15360, 0, (7, 5)),
        fake_device("NVIDIA GeForce RTX 3060 Laptop GPU", 6144, 0, (8, 6)),
        fake_device("NVIDIA GeForce RTX 3080", 12288, 0, (8, 6)),
    ]
    install(make_fake_pynvml(devices))
    probe = probe_system(tmp_path)
    pascal, turing, laptop, ampere_12gb = probe.gpus

    assert (pascal.fp16_tensor_cores, pascal.bf16, pascal.flash_sdpa) == (False, False, False)
    assert pascal.catalog_name == "GTX 1080" and pascal.fp16_tensor_tflops is None and pascal.fp32_tflops == 8.9
    assert (turing.fp16_tensor_cores, turing.bf16, turing.fp8) == (True, False, False)
    assert turing.catalog_name == "T4"
    # a laptop 3060 is a different card: no desktop rates are borrowed for it
    assert laptop.catalog_name is None and laptop.fp16_tensor_tflops is None and laptop.bf16 is True
    assert any("RTX 3060 Laptop GPU" in note and "not in the GPU catalogue" in note for note in probe.notes)
    # the same NVML name with 12 GiB is the 3080 12GB, not the 10GB card
    assert ampere_12gb.catalog_name == "RTX 3080 12GB"


@pytest.mark.parametrize("code, words", [
    (real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver is installed"),
    (real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
    (real_pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    (real_pynvml.NVML_ERROR_UNKNOWN, "NVMLError_Unknown"),
])
def test_fake_nvml_error_at_init_is_a_clean_result(install, tmp_path, code, words):
    install(make_fake_pynvml([fake_device(**RTX_3060)], init_error=code))
    probe = probe_system(tmp_path)
    assert probe.gpus == [] and not probe.cuda_gpu_found and probe.accelerator == "cpu"
    assert words in probe.cuda_reason
    assert type(real_pynvml.NVMLError(code)).__name__ in probe.cuda_reason


def test_fake_nvml_missing_module(install, tmp_path):
    install(None)  # sys.modules["pynvml"] = None makes ``import pynvml`` raise ImportError
    probe = probe_system(tmp_path)
    assert not probe.cuda_gpu_found and "nvidia-ml-py" in probe.cuda_reason


def test_fake_nvml_error_midway_keeps_the_readable_gpu(install, tmp_path):
    devices = [fake_device(**RTX_3060, uuid="GPU-a"), fake_device("NVIDIA GeForce RTX 4090", 24564, 0, (8, 9))]
    calls: list[str] = []
    errors = {("nvmlDeviceGetMemoryInfo", 1): real_pynvml.NVML_ERROR_GPU_IS_LOST,
              ("nvmlDeviceGetDisplayActive", 0): real_pynvml.NVML_ERROR_NOT_SUPPORTED,
              ("nvmlDeviceGetComputeRunningProcesses", 0): real_pynvml.NVML_ERROR_NO_PERMISSION,
              ("nvmlDeviceGetGraphicsRunningProcesses", 0): real_pynvml.NVML_ERROR_NO_PERMISSION}
    install(make_fake_pynvml(devices, errors=errors, calls=calls))
    probe = probe_system(tmp_path)

    (gpu,) = probe.gpus
    assert probe.cuda_gpu_found and gpu.name == "NVIDIA GeForce RTX 3060"
    assert gpu.display_active is None  # not supported: unknown, and no note for it
    assert gpu.other_processes is None and gpu.other_processes_vram_bytes is None
    assert any(note.startswith("skipped GPU 1") and "fallen off the bus" in note for note in probe.notes)
    assert any("compute processes" in note and "no permission" in note for note in probe.notes)
    assert not any("display state" in note for note in probe.notes)
    assert calls[-1] == "nvmlShutdown"


def test_fake_nvml_error_on_every_gpu_or_count(install, tmp_path):
    lost = real_pynvml.NVML_ERROR_GPU_IS_LOST
    install(make_fake_pynvml([fake_device(**RTX_3060)], errors={("nvmlDeviceGetName", 0): lost}))
    probe = probe_system(tmp_path)
    assert not probe.cuda_gpu_found and "could not read any of its 1 GPU(s)" in probe.cuda_reason

    calls: list[str] = []
    install(make_fake_pynvml([fake_device(**RTX_3060)], errors={("nvmlDeviceGetCount", None): 999}, calls=calls))
    probe = probe_system(tmp_path)
    assert not probe.cuda_gpu_found and probe.cuda_reason.startswith("NVML error while listing GPUs")
    assert calls[-1] == "nvmlShutdown"

    install(make_fake_pynvml([]))
    probe = probe_system(tmp_path)
    assert not probe.cuda_gpu_found and "reports no GPU" in probe.cuda_reason


def test_fake_nvml_cli_json_has_no_traceback(install, tmp_path, capsys):
    from autotune.cli import main

    install(make_fake_pynvml([], init_error=real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert main(["probe", "--json", "--output-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["cuda_gpu_found"] is False and "driver is not loaded" in data["cuda_reason"]
    assert "Traceback" not in err

    install(make_fake_pynvml([fake_device(**RTX_3060, display=1)]))
    assert main(["probe", "--output-dir", str(tmp_path)]) == 0
    out, _ = capsys.readouterr()
    assert "NVIDIA GeForce RTX 3060" in out and "RTX 3060 12GB" in out and "drives a display" in out


def test_fake_nvml_json_round_trip_with_gpus(install, tmp_path):
    devices = [fake_device(**RTX_3060, compute=[(77, 512)], graphics=[(9_000_078, None)]),
               fake_device("NVIDIA H100 80GB HBM3", 81559, 0, (9, 0))]
    install(make_fake_pynvml(devices, process_names={77: "trainer"}))
    probe = probe_system(tmp_path)
    text = probe.to_json()
    again = SystemProbe.from_json(text)
    assert again == probe and again.to_json() == text
    assert again.gpus[0].other_processes[0].name == "trainer"
    assert again.gpus[1].catalog_name == "H100 SXM" and isinstance(again.gpus[1].fp16_tensor_tflops, float)


def make_fake_torch(visible: list[tuple[str, str, tuple[int, int]]], available: bool = True) -> types.ModuleType:
    """A stand-in CUDA build of torch: ``visible`` = (uuid, name, cc) per device in torch's order."""
    torch = types.ModuleType("torch")
    torch.__version__ = "2.5.1+cu124"
    torch.version = SimpleNamespace(cuda="12.4", hip=None)
    torch.cuda = SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(visible),
        get_device_properties=lambda i: SimpleNamespace(uuid=visible[i][0], name=visible[i][1],
                                                        major=visible[i][2][0], minor=visible[i][2][1]),
    )
    return torch


def test_fake_nvml_fake_cuda_torch_crosscheck(install, monkeypatch, tmp_path):
    devices = [fake_device(**RTX_3060, uuid="GPU-1111-aaaa"),
               fake_device("NVIDIA GeForce RTX 4090", 24564, 0, (8, 9), uuid="GPU-2222-bbbb")]
    install(make_fake_pynvml(devices))
    monkeypatch.setattr(probe_module, "torch_build", lambda version: "cuda 12.4")
    # as with CUDA_VISIBLE_DEVICES=1: torch sees only the 4090, as cuda:0
    monkeypatch.setitem(sys.modules, "torch", make_fake_torch([("2222-bbbb", "NVIDIA GeForce RTX 4090", (8, 9))]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    probe = probe_system(tmp_path)

    assert probe.torch_imported is True and probe.libraries["torch"].build == "cuda 12.4"
    assert [gpu.torch_device for gpu in probe.gpus] == [None, "cuda:0"]
    assert any("GPU 0 (NVIDIA GeForce RTX 3060) is not visible to torch" in note for note in probe.notes)
    assert not any("CPU build" in note for note in probe.notes)

    monkeypatch.setitem(sys.modules, "torch", make_fake_torch([], available=False))
    probe = probe_system(tmp_path)
    assert any("torch.cuda.is_available() is False" in note for note in probe.notes)
    assert probe.cuda_gpu_found  # NVML's figures stand on their own

    probe = probe_system(tmp_path, use_torch=False)
    assert probe.torch_imported is False


def test_fake_nvml_from_json_rejects_damaged_documents(install, tmp_path):
    install(make_fake_pynvml([fake_device(**RTX_3060)]))
    data = json.loads(probe_system(tmp_path).to_json())
    del data["gpus"][0]["vram_total_bytes"]
    with pytest.raises(UserError, match=r"gpus\[0\].*missing \['vram_total_bytes'\]"):
        SystemProbe.from_json(json.dumps(data))
    data = json.loads(probe_system(tmp_path).to_json())
    data["gpus"][0]["vram_total_bytes"] = "12 GB"
    with pytest.raises(UserError, match="vram_total_bytes must be int"):
        SystemProbe.from_json(json.dumps(data))
    with pytest.raises(UserError, match="schema_version"):
        SystemProbe.from_json(json.dumps({**data, "schema_version": 99}))
    with pytest.raises(UserError, match="not valid JSON"):
        SystemProbe.from_json("{")


# ---------------------------------------------------------------- a trainer's GPU memory (hardware.gpu_usage)


def test_a_childs_gpu_memory_is_what_nvml_lists_for_its_process_group(install):
    """The user's sd-scripts / musubi-tuner report no CUDA peak: the watchdog samples what NVML lists for the
    child's process group (a real child and its real worker here; the card's answers are the stand-in's)."""
    import subprocess

    from autotune.hardware import gpu_usage
    from autotune.hardware.gpu_usage import GpuUsage, process_group

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                              "'-c', 'import time; time.sleep(60)']); print('ready', flush=True); time.sleep(60)"],
                             start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        members = process_group(child.pid)
        worker = next(iter(members - {child.pid}))
        cards = [fake_device(**RTX_3060, compute=[(child.pid, 3000), (os.getpid(), 700), (worker, 200)]),
                 fake_device(**RTX_3060, compute=[(worker, 100), (child.pid, None)])]
        install(make_fake_pynvml(cards))
        usage = GpuUsage()
        assert usage.start()
        assert usage.sample(child.pid) == pytest.approx(3300.0) and usage.peak == pytest.approx(3300.0)
        assert usage.sample(child.pid) is None  # at most once a second
        usage._last -= gpu_usage.SAMPLE_EVERY_S
        cards[0]["compute"] = [(child.pid, 1000)]
        assert usage.sample(child.pid) == pytest.approx(1100.0) and usage.peak == pytest.approx(3300.0)
        usage.close()
    finally:
        for pid in process_group(child.pid):
            os.kill(pid, 9)
        child.wait()


def test_no_nvml_means_no_sampled_figure(install):
    from autotune.hardware.gpu_usage import GpuUsage

    install(make_fake_pynvml([], init_error=real_pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    usage = GpuUsage()
    assert not usage.start() and usage.sample(os.getpid()) is None and usage.peak is None
    install(None)  # nvidia-ml-py not importable
    assert not GpuUsage().start()


def test_a_trainer_without_its_own_peak_steps_up_on_what_nvml_showed():
    from autotune.recovery.step_up import STEADY_STEPS, MemoryWatcher
    from sd_scripts_compat.facts.settings import TrainSettings

    asked: list[float] = []
    watcher = MemoryWatcher(TrainSettings(), lambda s, measured, progress, up: asked.append(measured), "device")
    watcher.see({"step": 1, "max_train_steps": 100}, 50.0, None)
    watcher.see({"step": 1 + STEADY_STEPS, "max_train_steps": 100}, 50.0, 6144.0)
    assert asked == [6144.0]  # not the host address space: the card's figure


def test_our_engines_peak_on_a_card_is_counted_with_its_cuda_context():
    """Our engine's progress peak on a GPU is CUDA's max reserved, which leaves the context out; the budget (the
    card less what others hold) and NVML's figure for a trainer that reports none count it. So the watcher adds the
    context the engine measured at start; an emulated card or host RAM has none to add, nor a figure that is no
    measurement."""
    from autotune.recovery.step_up import STEADY_STEPS, MemoryWatcher
    from sd_scripts_compat.facts.settings import TrainSettings

    def measured(kind: str, **progress: object) -> list[float]:
        asked: list[float] = []
        watcher = MemoryWatcher(TrainSettings(), lambda s, mib, event, up: asked.append(mib), kind)
        watcher.see({"step": 1 + STEADY_STEPS, "max_train_steps": 100, **progress}, 50.0, 9999.0)
        return asked

    assert measured("device", peak_memory_mib=6000.0, cuda_context_mib=520.0) == [6520.0]
    assert measured("device", peak_memory_mib=6000.0) == [6000.0]
    for bad in (float("nan"), -5.0, True, "520"):
        assert measured("device", peak_memory_mib=6000.0, cuda_context_mib=bad) == [6000.0]
    assert measured("emulated_card", peak_memory_mib=60.0, cuda_context_mib=520.0) == [60.0]
    assert measured("ram", peak_memory_mib=900.0) == [900.0]
    assert measured("device", peak_memory_mib=float("nan")) == [9999.0]  # then NVML's figure


def test_memory_another_process_took_since_the_start_is_not_stepped_into(install, tmp_path):
    """The card's usable memory changes during the run: a step up the planned budget admits is refused once another
    process has grown on the card (what the trainer holds plus what is free, now, is the budget then)."""
    from autotune.hardware.gpu_usage import GpuUsage
    from autotune.recovery.decisions import DecisionLog
    from autotune.recovery.ladder import LadderLimits
    from autotune.recovery.watchdog import Job, _memory_watcher, _Run
    from sd_scripts_compat.facts.settings import TrainSettings

    own = os.getpid()
    card = fake_device(name="NVIDIA GeForce RTX 4090", total_mib=24564, used_mib=6000, cc=(8, 9),
                       compute=[(own, 6000)])
    install(make_fake_pynvml([card]))
    settings = TrainSettings(train_batch_size=1, gradient_accumulation_steps=4)
    job = Job(config_path=tmp_path / "config.toml", output_dir=tmp_path, settings=settings,
              limits=LadderLimits(budget_mib=22000.0), predict=lambda s: 5000.0 * s.train_batch_size,
              images_per_s=lambda s: float(s.train_batch_size), echo=False)
    gpu = GpuUsage()
    assert gpu.start() and gpu.sample(own) == pytest.approx(6000.0)
    assert gpu.usable_now_mib() == pytest.approx(24564.0)  # what it holds + what is free

    def decide() -> object:
        run = _Run(job, DecisionLog(tmp_path, False), settings, [])
        watcher = _memory_watcher(run, gpu)
        assert watcher is not None
        return watcher.decide(settings, 6000.0, {}, True)

    assert decide() is not None  # 2 x 6000 MiB fits 90% of 22000 MiB
    card["used"] = card["total"] - 2000 * MIB  # another process took 16.5 GiB: 2000 MiB free beside our 6000
    assert gpu.usable_now_mib() == pytest.approx(8000.0)
    assert decide() is None


def test_the_links_between_cards_and_to_the_host_as_they_run(install, tmp_path, capsys):
    """Two RTX 3090 bridged by NVLink and a 4060 Ti in a x8 slot: each card's PCIe link (generation and lanes as
    they run, GB/s each way), how each pair is linked, in the text view and the JSON; a plan on this probe uses
    the probed link for the host transfers."""
    from autotune.hardware.probe import SystemProbe, render
    from autotune.launch.plan_options import targets_from_probe

    devices = [
        fake_device("NVIDIA GeForce RTX 3090", 24576, 10, (8, 6), uuid="GPU-a", bus="00000000:01:00.0",
                    nvlink_to=("00000000:02:00.0",)),
        fake_device("NVIDIA GeForce RTX 3090", 24576, 10, (8, 6), uuid="GPU-b", bus="00000000:02:00.0",
                    nvlink_to=("00000000:01:00.0",)),
        fake_device("NVIDIA GeForce RTX 4060 Ti", 16380, 10, (8, 9), uuid="GPU-c", bus="00000000:03:00.0",
                    pcie=(4, 8)),
    ]
    install(make_fake_pynvml(devices))
    probe = probe_system(tmp_path)
    first, _, third = probe.gpus
    assert (first.pcie_generation, first.pcie_width, first.pcie_gbps) == (4, 16, 31.5)
    assert third.pcie_gbps == 15.8
    assert [(p.gpu, p.link) for p in first.peers] == [(1, "NVLink, 1 link"), (2, "PCIe through the CPU's host bridge")]
    assert first.peers[0].nvlink_gbps is None  # the driver gave no link speed: the plan assumes PCIe
    assert [(p.gpu, p.link) for p in third.peers] == [(0, "PCIe through the CPU's host bridge"),
                                                      (1, "PCIe through the CPU's host bridge")]
    assert SystemProbe.from_json(probe.to_json()).gpus[0].peers == first.peers
    render(probe)
    shown = capsys.readouterr().out
    assert "gen 4 x8: 15.8 GB/s each way" in shown and "link to GPU 1" in shown and "NVLink" in shown
    targets = targets_from_probe(probe)[0]
    assert [t.spec.pcie_gbps for t in targets] == [31.5, 31.5, 15.8]


def _bridged_pairs(mbps: int | None = 14062) -> list[dict]:
    """Four RTX 3090s, 0-1 and 2-3 each bridged by NVLink (4 links; 14,062 MB/s each, as NVML reports an RTX 3090's
    bridge), the pairs reaching each other over PCIe."""
    buses = [f"00000000:0{i + 1}:00.0" for i in range(4)]
    return [fake_device("NVIDIA GeForce RTX 3090", 24576, 10, (8, 6), uuid=f"GPU-{i}", bus=buses[i],
                        nvlink_to=(buses[i ^ 1],) * 4, nvlink_mbps=mbps) for i in range(4)]


def test_nvlink_bridged_pairs_are_probed_with_their_speed_and_the_planner_gathers_over_them(install, tmp_path):
    """Two bridged pairs of RTX 3090: each pair's four links at NVML's speed (56.2 GB/s each way); the planning
    targets carry "blocks of 2 at 56.2 GB/s", so groups of two (hybrid_shard) gather over NVLink, while a shard
    across all four, or the optimizer state's broadcast to all four, crosses PCIe."""
    from dataclasses import replace

    from autotune.estimate.dit_memory import DitMemoryInputs
    from autotune.estimate.dit_speed import gather_seconds
    from autotune.hardware.gpu_links import collective_gbps
    from autotune.launch.plan_options import targets_from_probe

    install(make_fake_pynvml(_bridged_pairs()))
    probe = probe_system(tmp_path)
    assert [(p.gpu, p.link, p.nvlink_gbps) for p in probe.gpus[0].peers] == [
        (1, "NVLink, 4 links: 56.2 GB/s each way", 56.2), (2, "PCIe through the CPU's host bridge", None),
        (3, "PCIe through the CPU's host bridge", None)]
    spec = targets_from_probe(probe)[0][0].spec
    assert (spec.nvlink_group, spec.nvlink_gbps, spec.pcie_gbps) == (2, 56.2, 31.5)
    assert collective_gbps(spec, 2, 10.0) == 56.2 and collective_gbps(spec, 4, 10.0) == 31.5
    flux = DitMemoryInputs(family="flux-dev", resolution=512, gradient_checkpointing=True)
    groups, every = (gather_seconds(replace(flux, shard_ranks=n), spec) for n in (2, 4))
    pcie = gather_seconds(replace(flux, shard_ranks=2), replace(spec, nvlink_group=1, nvlink_gbps=None))
    assert groups == pytest.approx(pcie * 31.5 / 56.2) and every > pcie  # 3/4 of each block over PCIe


def test_nvlink_without_a_speed_from_the_driver_is_planned_as_pcie(install, tmp_path):
    from autotune.launch.plan_options import targets_from_probe

    install(make_fake_pynvml(_bridged_pairs(mbps=None)))
    spec = targets_from_probe(probe_system(tmp_path))[0][0].spec
    assert (spec.nvlink_group, spec.nvlink_gbps) == (1, None)


def test_a_plan_on_bridged_pairs_shards_within_each_pair_over_its_nvlink(install, tmp_path):
    """SD3.5 Large at 512 px on the probed pairs: within each pair over NVLink the gathers hide behind a short
    step (5.62 samples/s); the same cards without a link speed from the driver are planned over PCIe (4.21)."""
    from autotune.launch.plan_options import targets_from_probe
    from autotune.planning.planner import PlanRequest, nominal_dataset, plan_training
    from autotune.planning.request import Preferences

    speeds = {}
    for mbps in (14062, None):
        install(make_fake_pynvml(_bridged_pairs(mbps)))
        gpus = tuple(targets_from_probe(probe_system(tmp_path / str(mbps)))[0])
        plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:sd3.5-large", dataset=nominal_dataset(),
                                         gpus=gpus, cpu_physical_cores=16, preferences=Preferences(resolution=512)))
        assert (plan.settings.fsdp, plan.settings.fsdp_shard_size) == ("hybrid_shard", 2)
        speeds[mbps] = plan.prediction.samples_per_s
    assert speeds[14062] == pytest.approx(5.62, abs=0.01) and speeds[None] == pytest.approx(4.21, abs=0.01)
