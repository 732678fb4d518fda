"""Hardware probe: what this machine can train with, read without needing a GPU.

``probe_system(output_dir)`` returns a ``SystemProbe``. NVIDIA GPUs are read through NVML (``pynvml`` from
nvidia-ml-py), which answers in milliseconds and creates no CUDA context. torch is imported only when its answer
adds something: a CUDA build with an NVIDIA GPU present (cross-check of what torch will see), a ROCm build, or
macOS (MPS). On a machine without a GPU nothing heavy is imported, so ``autotune probe`` answers fast. No driver,
no NVML, or any NVML error gives ``cuda_gpu_found = False`` with the reason, never a traceback. The rates NVML does
not give (tensor TFLOP/s, bandwidth) come from the GPU catalogue (``autotune/data/gpus.toml``).

JSON (``SystemProbe.to_json()``; ``SystemProbe.from_json()`` reads it back, equal field for field). Sizes are
bytes (int), rates TFLOP/s and GB/s (float); ``null`` means unknown, never a guess.

- ``schema_version`` int (1); ``accelerator`` "cuda" | "rocm" | "mps" | "cpu" (what training would run on);
  ``cuda_gpu_found`` bool; ``cuda_reason`` str | null (why no CUDA GPU was found); ``assumed_gpu`` str | null
  (the ``--gpu`` name when the GPU comes from the catalogue instead of this machine); ``torch_imported`` bool.
- ``gpus``: list of objects with ``index`` (NVML / torch index), ``backend`` ("cuda" | "rocm" | "mps"), ``vendor``
  ("nvidia" | "amd" | "apple"), ``name``, ``uuid``, ``pci_bus_id``, ``vram_total_bytes``, ``vram_free_bytes``,
  ``vram_used_bytes``, ``compute_capability`` ("8.6"), ``gfx_arch`` ("gfx1100"), ``driver_version``,
  ``cuda_driver_version`` ("12.4": the newest CUDA the driver runs), ``display_active`` (drives a display),
  ``other_processes`` (list of ``{pid, name, used_vram_bytes, kind}``, kind "compute" | "graphics" |
  "compute+graphics"; this process excluded; null when NVML could not list them), ``other_processes_vram_bytes``
  (sum of the known figures), ``fp16_tensor_cores`` (cc >= 7.0), ``bf16`` (cc >= 8.0: hardware, not torch's
  emulation), ``fp8`` (cc >= 8.9), ``flash_sdpa`` (cc >= 8.0), ``torch_device`` ("cuda:0" as torch numbers it;
  null when torch was not asked or does not see the card), ``catalog_name``, ``fp16_tensor_tflops``,
  ``bf16_tensor_tflops``, ``fp32_tflops``, ``memory_bandwidth_gbs``, ``catalog_source`` (from the catalogue),
  ``source`` ("nvml" | "torch" | "catalog": where the live fields came from).
- ``cpu``: ``model``, ``arch``, ``physical_cores``, ``logical_cores``, ``usable_cores`` (this process's affinity),
  ``avx512_bf16``, ``amx_bf16`` (x86 flags), ``bf16_native`` (bf16 matmuls in hardware: either flag, or Arm's
  ``bf16`` feature; null when the flags cannot be read): where true, bf16 autocast trains faster than fp32.
- ``memory``: ``ram_total_bytes``, ``ram_available_bytes``, ``swap_total_bytes``, ``swap_free_bytes``.
- ``disk``: ``path`` (the output folder asked about), ``checked_path`` (nearest existing folder),
  ``free_bytes``, ``total_bytes``.
- ``platform``: ``os`` ("Linux"), ``os_release``, ``os_description`` ("Ubuntu 24.04 LTS"), ``machine``,
  ``python_version``, ``python_implementation``, ``python_executable``.
- ``libraries``: object keyed torch, diffusers, transformers, accelerate, peft, xformers, bitsandbytes; each
  ``{installed, version, build}``; ``build`` for torch only: "cpu", "cuda 12.4", "rocm 6.2" or "macos", read from
  the package files without importing torch.
- ``notes``: list of one-line remarks (torch build vs GPU, display, other processes, catalogue misses, errors).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import platform
import shutil
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from sd_scripts_compat.facts.errors import UserError

SCHEMA_VERSION = 1
GIB = 1 << 30
LIBRARY_NAMES = ("torch", "diffusers", "transformers", "accelerate", "peft", "xformers", "bitsandbytes")

# NVML error codes (nvml.h) whose meaning we spell out; the rest print NVML's own text.
_NVML_NOT_SUPPORTED = 3
_NVML_REASONS = {
    9: "the NVIDIA kernel driver is not loaded",
    12: "the NVML library was not found: no NVIDIA driver is installed",
    4: "no permission to query the NVIDIA driver",
    18: "the NVML library and the kernel driver versions differ (reboot after a driver update)",
    15: "a GPU has fallen off the bus",
}


@dataclass
class GpuProcess:
    """Another process holding VRAM on a GPU."""

    pid: int
    name: str | None
    used_vram_bytes: int | None  # None where the driver does not say (Windows WDDM, some containers)
    kind: str  # "compute" | "graphics" | "compute+graphics"


@dataclass
class PeerLink:
    """How a GPU reaches another: "NVLink", or the PCIe path where theirs meet."""

    gpu: int
    link: str
    nvlink_gbps: float | None = None  # NVLink: GB/s each way over the active links between the two (NVML's speed)


@dataclass
class GpuInfo:
    """One GPU: live figures from NVML (or torch for ROCm/MPS), rates from the catalogue."""

    index: int
    backend: str
    vendor: str
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    vram_total_bytes: int | None = None
    vram_free_bytes: int | None = None
    vram_used_bytes: int | None = None
    compute_capability: str | None = None
    gfx_arch: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    display_active: bool | None = None
    other_processes: list[GpuProcess] | None = None
    other_processes_vram_bytes: int | None = None
    fp16_tensor_cores: bool | None = None
    bf16: bool | None = None
    fp8: bool | None = None
    flash_sdpa: bool | None = None
    torch_device: str | None = None
    catalog_name: str | None = None
    fp16_tensor_tflops: float | None = None
    bf16_tensor_tflops: float | None = None
    fp32_tflops: float | None = None
    memory_bandwidth_gbs: float | None = None
    catalog_source: str | None = None
    source: str = "nvml"
    pcie_generation: int | None = None  # the host link as it runs now (NVML's current generation and lanes)
    pcie_width: int | None = None
    pcie_gbps: float | None = None  # GB/s per direction that link carries
    peers: list[PeerLink] | None = None  # with several GPUs: how this one reaches each other


@dataclass
class CpuInfo:
    model: str | None
    arch: str
    physical_cores: int | None
    logical_cores: int | None
    usable_cores: int | None
    avx512_bf16: bool | None = None
    amx_bf16: bool | None = None
    bf16_native: bool | None = None  # either x86 flag, or Arm's bf16 feature: bf16 autocast pays off


@dataclass
class MemoryInfo:
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    swap_free_bytes: int


@dataclass
class DiskInfo:
    path: str
    checked_path: str
    free_bytes: int
    total_bytes: int


@dataclass
class PlatformInfo:
    os: str
    os_release: str
    os_description: str | None
    machine: str
    python_version: str
    python_implementation: str
    python_executable: str


@dataclass
class LibraryInfo:
    installed: bool
    version: str | None = None
    build: str | None = None


@dataclass
class SystemProbe:
    """Everything the planner needs to know about the machine. Field list: see the module docstring."""

    schema_version: int
    accelerator: str
    cuda_gpu_found: bool
    cuda_reason: str | None
    assumed_gpu: str | None
    torch_imported: bool
    gpus: list[GpuInfo]
    cpu: CpuInfo
    memory: MemoryInfo
    disk: DiskInfo
    platform: PlatformInfo
    libraries: dict[str, LibraryInfo]
    notes: list[str] = field(default_factory=list)

    def to_json(self, indent: int | None = 2) -> str:
        """The stable JSON object (see the module docstring)."""
        return json.dumps(dataclasses.asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> SystemProbe:
        """Read ``to_json()`` output back; a malformed document is a one-line ``UserError``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"probe JSON: not valid JSON ({error}); produce it with `autotune probe --json`") from None
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            found = data.get("schema_version") if isinstance(data, dict) else None
            raise UserError(f"probe JSON: schema_version {found!r}, expected {SCHEMA_VERSION}; re-run autotune probe")
        return _decode(cls, data, "probe")


def from_json(text: str) -> SystemProbe:
    """Module-level alias of ``SystemProbe.from_json``."""
    return SystemProbe.from_json(text)


def _decode(tp: typing.Any, value: typing.Any, where: str) -> typing.Any:
    """Rebuild a value of annotated type ``tp`` from ``json.loads`` output (dataclasses, lists, dicts, optionals).

    Hand-written because the schema is a handful of plain dataclasses; a validation library would be a new
    dependency for twenty lines.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return _decode(inner, value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"probe JSON: {where} must be an object")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in dataclasses.fields(tp)]
        missing = [name for name in names if name not in value]
        unknown = sorted(set(value) - set(names))
        if missing or unknown:
            raise UserError(f"probe JSON: {where}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}; "
                            "re-run autotune probe --json")
        return typing.cast(typing.Any, tp)(**{name: _decode(hints[name], value[name], f"{where}.{name}")
                                                 for name in names})
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"probe JSON: {where} must be a list")
        (inner,) = typing.get_args(tp)
        return [_decode(inner, item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"probe JSON: {where} must be an object")
        _, inner = typing.get_args(tp)
        return {key: _decode(inner, item, f"{where}.{key}") for key, item in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise UserError(f"probe JSON: {where} must be {tp.__name__}, got {value!r}")
    return value


# --- the probe -------------------------------------------------------------------------------------------------


def probe_system(output_dir: str | os.PathLike = ".", assume_gpu: str | None = None,
                 use_torch: bool = True) -> SystemProbe:
    """Probe this machine. ``assume_gpu`` replaces the live GPU probe by a catalogue card (``--gpu``);
    ``use_torch=False`` never imports torch (the NVML figures stand alone)."""
    notes: list[str] = []
    libraries = probe_libraries()
    torch_build = libraries["torch"].build if libraries["torch"].installed else None
    torch_imported = False
    if assume_gpu is not None:
        gpus = [gpu_from_catalog(assume_gpu)]
        reason = None
        notes.append(f"GPU assumed from the catalogue ({gpus[0].catalog_name}), not measured on this machine")
    else:
        gpus, reason = probe_nvml(notes)
        wants_torch = use_torch and torch_build is not None and (
            (gpus and torch_build.startswith("cuda")) or torch_build.startswith("rocm") or sys.platform == "darwin")
        if wants_torch:
            torch_imported = _torch_probe(gpus, notes)
        for gpu in gpus:
            _add_catalog_rates(gpu, notes)
    nvidia = [gpu for gpu in gpus if gpu.backend == "cuda"]
    accelerator = "cpu"
    for backend in ("cuda", "rocm", "mps"):
        if any(gpu.backend == backend for gpu in gpus):
            accelerator = backend
            break
    _library_notes(nvidia, libraries, notes, measured=assume_gpu is None)
    return SystemProbe(
        schema_version=SCHEMA_VERSION,
        accelerator=accelerator,
        cuda_gpu_found=bool(nvidia),
        cuda_reason=None if nvidia else (reason or "the assumed card is not an NVIDIA GPU"),
        assumed_gpu=assume_gpu,
        torch_imported=torch_imported,
        gpus=gpus,
        cpu=probe_cpu(),
        memory=probe_memory(),
        disk=probe_disk(output_dir),
        platform=probe_platform(),
        libraries=libraries,
        notes=notes,
    )


def capability_flags(compute_capability: str | None) -> dict[str, bool | None]:
    """Hardware features that follow from a CUDA compute capability; all None when it is unknown."""
    if compute_capability is None:
        return {"fp16_tensor_cores": None, "bf16": None, "fp8": None, "flash_sdpa": None}
    major, minor = (int(part) for part in compute_capability.split("."))
    cc = (major, minor)
    return {"fp16_tensor_cores": cc >= (7, 0), "bf16": cc >= (8, 0), "fp8": cc >= (8, 9), "flash_sdpa": cc >= (8, 0)}


def gpu_from_catalog(name: str) -> GpuInfo:
    """What the tools assume for a catalogue card that is not in this machine (``UserError`` if unknown)."""
    from autotune.hardware.gpu_catalog import lookup_gpu

    spec = lookup_gpu(name)
    gpu = GpuInfo(
        index=0,
        backend="cuda" if spec.vendor == "nvidia" else "rocm",
        vendor=spec.vendor,
        name=spec.name,
        vram_total_bytes=int(round(spec.vram_gb * GIB)),
        compute_capability=spec.compute_capability,
        gfx_arch=spec.gfx_arch,
        source="catalog",
    )
    if spec.vendor == "nvidia":
        for key, value in capability_flags(spec.compute_capability).items():
            setattr(gpu, key, value)
    else:
        gpu.bf16, gpu.fp8 = spec.bf16, spec.fp8
    _copy_rates(gpu, spec)
    return gpu


def _copy_rates(gpu: GpuInfo, spec: typing.Any) -> None:
    gpu.catalog_name = spec.name
    gpu.fp16_tensor_tflops = spec.fp16_tensor_tflops
    gpu.bf16_tensor_tflops = spec.bf16_tensor_tflops
    gpu.fp32_tflops = spec.fp32_tflops
    gpu.memory_bandwidth_gbs = spec.memory_bandwidth_gbs
    gpu.catalog_source = spec.source


def _add_catalog_rates(gpu: GpuInfo, notes: list[str]) -> None:
    """Fill the rates NVML does not give; an unknown card keeps them None and gets a note."""
    from autotune.hardware.gpu_catalog import close_matches, find_gpu, load_catalog

    catalog = load_catalog()
    vram = gpu.vram_total_bytes / GIB if gpu.vram_total_bytes else None
    spec = find_gpu(gpu.name, vram_gb=vram, catalog=catalog)
    if spec is None:
        hint = ", ".join(close_matches(gpu.name, catalog, limit=3)) or "none"
        notes.append(f"GPU {gpu.index} ({gpu.name}) is not in the GPU catalogue: its TFLOP/s and bandwidth are "
                     f"unknown (closest entries: {hint})")
        return
    _copy_rates(gpu, spec)
    if gpu.vendor == "nvidia" and spec.compute_capability != gpu.compute_capability:
        notes.append(f"GPU {gpu.index}: driver reports compute capability {gpu.compute_capability}, the catalogue "
                     f"entry {spec.name} says {spec.compute_capability}")
    if gpu.vendor != "nvidia":
        gpu.bf16 = spec.bf16 if gpu.bf16 is None else gpu.bf16
        gpu.fp8 = spec.fp8 if gpu.fp8 is None else gpu.fp8


# --- NVML --------------------------------------------------------------------------------------------------------


def _text(value: typing.Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_reason(error: BaseException) -> str:
    code = getattr(error, "value", None)
    meaning = _NVML_REASONS.get(code) if isinstance(code, int) else None
    detail = f"{type(error).__name__}: {error}"
    return f"{meaning} ({detail})" if meaning else detail


def probe_nvml(notes: list[str]) -> tuple[list[GpuInfo], str | None]:
    """All NVIDIA GPUs NVML sees, or ``([], reason)``. Never raises: any failure becomes the reason or a note."""
    try:
        import pynvml
    except ImportError as error:
        return [], f"nvidia-ml-py (pynvml) is not installed ({error}); pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [], _nvml_reason(error)
    except Exception as error:  # a broken driver install can fail in ctypes itself; the probe must still answer
        return [], f"NVML failed to start ({type(error).__name__}: {error})"
    try:
        return _read_nvml_devices(pynvml, notes)
    except pynvml.NVMLError as error:
        return [], f"NVML error while listing GPUs: {_nvml_reason(error)}"
    except Exception as error:  # same reason as above: report, don't crash
        return [], f"unexpected error while reading NVML ({type(error).__name__}: {error})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as error:  # shutting down after an error may fail too; nothing left to protect
            notes.append(f"nvmlShutdown failed ({type(error).__name__}: {error})")


def _read_nvml_devices(pynvml: types.ModuleType, notes: list[str]) -> tuple[list[GpuInfo], str | None]:
    driver = _text(pynvml.nvmlSystemGetDriverVersion())
    cuda_driver = _optional(pynvml, notes, "CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion)
    cuda_text = f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}" if isinstance(cuda_driver, int) else None
    count = pynvml.nvmlDeviceGetCount()
    gpus: list[GpuInfo] = []
    errors: list[str] = []
    for index in range(count):
        try:
            gpus.append(_read_nvml_device(pynvml, index, driver, cuda_text, notes))
        except pynvml.NVMLError as error:
            errors.append(f"GPU {index}: {_nvml_reason(error)}")
    for message in errors:
        notes.append(f"skipped {message}")
    _read_peer_links(pynvml, gpus, notes)
    if gpus:
        return gpus, None
    if errors:
        return [], f"NVML (driver {driver}) could not read any of its {count} GPU(s): " + "; ".join(errors)
    return [], f"NVML works (driver {driver}) but reports no GPU"


# PCIe GB/s per lane and direction, by generation (128b/130b encoding from gen 3)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# nvmlDeviceGetTopologyCommonAncestor's answers: how far apart two GPUs sit on the PCIe tree
_TOPOLOGY = {0: "the same board", 10: "one PCIe switch", 20: "several PCIe switches", 30: "the CPU's host bridge",
             40: "the CPU (across its PCIe host bridges)", 50: "two CPU sockets (across their interconnect)"}


def _read_pcie(pynvml: types.ModuleType, handle: typing.Any, label: str, notes: list[str],
               gpu: GpuInfo) -> None:
    """The host link as it runs (generation, lanes) and what it carries per direction."""
    generation = _optional(pynvml, notes, f"{label} PCIe generation", pynvml.nvmlDeviceGetCurrPcieLinkGeneration,
                           handle)
    width = _optional(pynvml, notes, f"{label} PCIe width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
    if isinstance(generation, int) and isinstance(width, int) and generation in PCIE_LANE_GBPS:
        gpu.pcie_generation, gpu.pcie_width = generation, width
        gpu.pcie_gbps = round(PCIE_LANE_GBPS[generation] * width, 1)


def _read_peer_links(pynvml: types.ModuleType, gpus: list[GpuInfo], notes: list[str]) -> None:
    """With several GPUs, how each pair is linked: NVLink where one of a card's active links ends at the other's
    PCI address, else where their PCIe paths meet (the data of sharded or data-parallel training crosses it)."""
    if len(gpus) < 2:
        return
    handles = {gpu.index: pynvml.nvmlDeviceGetHandleByIndex(gpu.index) for gpu in gpus}
    nvlinked = {gpu.index: _nvlink_peers(pynvml, handles[gpu.index], gpus) for gpu in gpus}
    for gpu in gpus:
        gpu.peers = []
        speed = _nvlink_link_gbps(pynvml, handles[gpu.index]) if nvlinked[gpu.index] else None
        for other in gpus:
            if other.index == gpu.index:
                continue
            links = nvlinked[gpu.index].get(other.index, 0)
            if links:
                rate = round(links * speed, 1) if speed else None
                gpu.peers.append(PeerLink(other.index, f"NVLink, {links} link{'s' if links > 1 else ''}"
                                          + (f": {rate:g} GB/s each way" if rate else ""), rate))
                continue
            level = _optional(pynvml, notes, f"GPU {gpu.index} to GPU {other.index} topology",
                              pynvml.nvmlDeviceGetTopologyCommonAncestor, handles[gpu.index], handles[other.index])
            link = f"PCIe through {_TOPOLOGY.get(level, 'an unknown path')}" if level is not None else "unknown"
            gpu.peers.append(PeerLink(other.index, link))


def _nvlink_peers(pynvml: types.ModuleType, handle: typing.Any, gpus: list[GpuInfo]) -> dict[int, int]:
    """The other GPUs this one's active NVLinks end at, with how many links reach each."""
    by_bus = {(g.pci_bus_id or "").lower(): g.index for g in gpus if g.pci_bus_id}
    peers: dict[int, int] = {}
    for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except pynvml.NVMLError:  # no NVLink on this card (consumer cards answer NOT_SUPPORTED), or no such link
            break
        index = by_bus.get(_text(remote.busId).lower())
        if index is not None:
            peers[index] = peers.get(index, 0) + 1
    return peers


def _nvlink_link_gbps(pynvml: types.ModuleType, handle: typing.Any) -> float | None:
    """GB/s each way one of this GPU's active NVLinks carries (NVML's common link speed, MB/s: 14,062 on an RTX
    3090's bridge, 25,781 on an A100); None where the driver does not say (the plan then assumes PCIe)."""
    field = getattr(pynvml, "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON", None)
    if field is None:
        return None
    try:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [field])[0]
    except pynvml.NVMLError:
        return None
    mbps = getattr(value.value, "uiVal", 0) if not getattr(value, "nvmlReturn", 0) else 0
    return mbps / 1000 if mbps else None


def _optional(pynvml: types.ModuleType, notes: list[str], what: str, call: typing.Callable, *args: typing.Any):
    """A field that may be missing on some cards or drivers: None, with a note unless it is plainly unsupported."""
    try:
        return call(*args)
    except pynvml.NVMLError as error:
        if getattr(error, "value", None) != _NVML_NOT_SUPPORTED:
            notes.append(f"{what}: {_nvml_reason(error)}")
        return None


def _read_nvml_device(pynvml: types.ModuleType, index: int, driver: str, cuda_driver: str | None,
                      notes: list[str]) -> GpuInfo:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(pynvml.nvmlDeviceGetName(handle))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    cc = f"{major}.{minor}"
    label = f"GPU {index} ({name})"
    uuid = _optional(pynvml, notes, f"{label} UUID", pynvml.nvmlDeviceGetUUID, handle)
    pci = _optional(pynvml, notes, f"{label} PCI info", pynvml.nvmlDeviceGetPciInfo, handle)
    display = _optional(pynvml, notes, f"{label} display state", pynvml.nvmlDeviceGetDisplayActive, handle)
    processes = _nvml_processes(pynvml, handle, label, notes)
    gpu = GpuInfo(
        index=index,
        backend="cuda",
        vendor="nvidia",
        name=name,
        uuid=_text(uuid) if uuid is not None else None,
        pci_bus_id=_text(pci.busId) if pci is not None else None,
        vram_total_bytes=int(memory.total),
        vram_free_bytes=int(memory.free),
        vram_used_bytes=int(memory.used),
        compute_capability=cc,
        driver_version=driver,
        cuda_driver_version=cuda_driver,
        display_active=None if display is None else bool(display),
        other_processes=processes,
        other_processes_vram_bytes=None if processes is None else sum(
            p.used_vram_bytes for p in processes if p.used_vram_bytes is not None),
        source="nvml",
    )
    for key, value in capability_flags(cc).items():
        setattr(gpu, key, value)
    _read_pcie(pynvml, handle, label, notes, gpu)
    if gpu.display_active:
        notes.append(f"{label} drives a display: the desktop holds part of its VRAM and may grow during training")
    if gpu.other_processes:
        used = gpu.other_processes_vram_bytes or 0
        notes.append(f"{label}: {len(gpu.other_processes)} other process(es) hold {used / GIB:.2f} GiB of VRAM")
    return gpu


def _nvml_processes(pynvml: types.ModuleType, handle: typing.Any, label: str,
                    notes: list[str]) -> list[GpuProcess] | None:
    """Compute and graphics processes other than this one, merged by pid."""
    own_pid = os.getpid()
    merged: dict[int, GpuProcess] = {}
    listed = False
    for kind, call in (("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
                       ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses)):
        entries = _optional(pynvml, notes, f"{label} {kind} processes", call, handle)
        if entries is None:
            continue
        listed = True
        for entry in entries:
            pid = int(entry.pid)
            if pid == own_pid:
                continue
            used = entry.usedGpuMemory
            used = None if used is None else int(used)
            if pid in merged:
                known = merged[pid]
                known.kind = "compute+graphics" if known.kind != kind else kind
                if used is not None:
                    known.used_vram_bytes = max(used, known.used_vram_bytes or 0)
                continue
            merged[pid] = GpuProcess(pid=pid, name=_process_name(pynvml, pid), used_vram_bytes=used, kind=kind)
    return sorted(merged.values(), key=lambda p: p.pid) if listed else None


def _process_name(pynvml: types.ModuleType, pid: int) -> str | None:
    try:
        return _text(pynvml.nvmlSystemGetProcessName(pid)) or None
    except pynvml.NVMLError:
        pass
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # the process may be gone, in another container, or not ours to inspect
        return None


# --- torch (only when it adds something) ---------------------------------------------------------------------------


def _torch_probe(gpus: list[GpuInfo], notes: list[str]) -> bool:
    """Cross-check NVML's GPUs with torch.cuda, or read ROCm / MPS devices; returns whether torch was imported."""
    try:
        import torch
    except Exception as error:  # a broken torch install must not break the probe
        notes.append(f"torch is installed but failed to import ({type(error).__name__}: {error})")
        return False
    try:
        if getattr(torch.version, "hip", None):
            gpus.extend(_torch_rocm_devices(torch, notes))
        elif getattr(torch.version, "cuda", None):
            _torch_cuda_crosscheck(torch, gpus, notes)
        elif sys.platform == "darwin":
            gpus.extend(_torch_mps_device(torch, notes))
    except Exception as error:  # torch's device queries can fail on odd drivers; NVML's figures still stand
        notes.append(f"torch device query failed ({type(error).__name__}: {error})")
    return True


def _torch_cuda_crosscheck(torch: typing.Any, gpus: list[GpuInfo], notes: list[str]) -> None:
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        notes.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use the GPU(s) NVML sees: "
                     "torch.cuda.is_available() is False (driver older than this CUDA build?"
                     + (f" CUDA_VISIBLE_DEVICES={visible!r}?" if visible is not None else "") + ")")
        return
    by_uuid = {gpu.uuid.removeprefix("GPU-").lower(): gpu for gpu in gpus if gpu.uuid}
    for torch_index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(torch_index)
        uuid = str(getattr(props, "uuid", "") or "").removeprefix("GPU-").lower()
        gpu = by_uuid.get(uuid)
        if gpu is None:
            same = [g for g in gpus if g.name == props.name and g.torch_device is None]
            gpu = same[0] if same else None
        if gpu is None:
            notes.append(f"torch sees cuda:{torch_index} ({props.name}) which NVML did not list")
            continue
        gpu.torch_device = f"cuda:{torch_index}"
        torch_cc = f"{props.major}.{props.minor}"
        if torch_cc != gpu.compute_capability:
            notes.append(f"GPU {gpu.index}: torch reports compute capability {torch_cc}, NVML {gpu.compute_capability}")
    for gpu in gpus:
        if gpu.torch_device is None:
            notes.append(f"GPU {gpu.index} ({gpu.name}) is not visible to torch "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def _torch_rocm_devices(torch: typing.Any, notes: list[str]) -> list[GpuInfo]:
    if not torch.cuda.is_available():
        notes.append(f"torch is a ROCm build (HIP {torch.version.hip}) but sees no AMD GPU")
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
        devices.append(GpuInfo(
            index=index, backend="rocm", vendor="amd", name=props.name, vram_total_bytes=int(total),
            vram_free_bytes=int(free), vram_used_bytes=int(total - free), gfx_arch=arch,
            driver_version=None, torch_device=f"cuda:{index}", source="torch",
        ))
    return devices


def _torch_mps_device(torch: typing.Any, notes: list[str]) -> list[GpuInfo]:
    if not torch.backends.mps.is_available():
        return []
    recommended = None
    if hasattr(torch, "mps") and hasattr(torch.mps, "recommended_max_memory"):
        recommended = int(torch.mps.recommended_max_memory())
        notes.append("Apple GPU: unified memory; its 'VRAM' is Metal's recommended working-set size")
    return [GpuInfo(index=0, backend="mps", vendor="apple", name=_cpu_model() or "Apple GPU",
                    vram_total_bytes=recommended, torch_device="mps", source="torch")]


# --- CPU, memory, disk, platform, libraries ---------------------------------------------------------------------


def probe_cpu() -> CpuInfo:
    import psutil

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    flags = _cpu_flags()
    avx512 = amx = native = None
    if flags is not None:
        avx512, amx = "avx512_bf16" in flags, "amx_bf16" in flags
        native = avx512 or amx or "bf16" in flags  # "bf16": Arm's FEAT_BF16 in /proc/cpuinfo's Features
    return CpuInfo(model=_cpu_model(), arch=platform.machine(), physical_cores=psutil.cpu_count(logical=False),
                   logical_cores=psutil.cpu_count(logical=True), usable_cores=usable, avx512_bf16=avx512,
                   amx_bf16=amx, bf16_native=native)


def _cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``); None where unreadable."""
    if cpuinfo is None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def _cpu_model() -> str | None:
    """The marketing name of the CPU; platform.processor() alone is often empty or an ID string."""
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
        except OSError:
            pass
    elif sys.platform == "darwin":
        import subprocess

        try:
            done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5, check=False)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    elif sys.platform == "win32":
        try:
            import winreg

            key = winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"HARDWARE\DESCRIPTION\System\CentralProcessor\0")
            return str(winreg.QueryValueEx(key, "ProcessorNameString")[0]).strip()
        except OSError:
            pass
    return platform.processor() or None


def probe_memory() -> MemoryInfo:
    import psutil

    ram = psutil.virtual_memory()
    swap = psutil.swap_memory()
    return MemoryInfo(ram_total_bytes=int(ram.total), ram_available_bytes=int(ram.available),
                      swap_total_bytes=int(swap.total), swap_free_bytes=int(swap.free))


def probe_disk(output_dir: str | os.PathLike) -> DiskInfo:
    """Free space where the output will go; a folder not made yet is measured at its nearest existing parent."""
    wanted = Path(output_dir).expanduser().absolute()
    checked = wanted
    while not checked.exists() and checked != checked.parent:
        checked = checked.parent
    usage = shutil.disk_usage(checked)
    return DiskInfo(path=str(wanted), checked_path=str(checked), free_bytes=int(usage.free),
                    total_bytes=int(usage.total))


def probe_platform() -> PlatformInfo:
    description = None
    if sys.platform.startswith("linux"):
        try:
            description = platform.freedesktop_os_release().get("PRETTY_NAME")
        except OSError:
            description = None
    elif sys.platform == "darwin":
        description = f"macOS {platform.mac_ver()[0]}"
    elif sys.platform == "win32":
        description = f"Windows {platform.version()}"
    return PlatformInfo(os=platform.system(), os_release=platform.release(), os_description=description,
                        machine=platform.machine(), python_version=platform.python_version(),
                        python_implementation=platform.python_implementation(), python_executable=sys.executable)


def probe_libraries() -> dict[str, LibraryInfo]:
    """Installed versions from package metadata: nothing is imported (torch alone costs seconds)."""
    from importlib import metadata

    libraries = {}
    for name in LIBRARY_NAMES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            libraries[name] = LibraryInfo(installed=False)
            continue
        build = torch_build(version) if name == "torch" else None
        libraries[name] = LibraryInfo(installed=True, version=version, build=build)
    return libraries


def torch_build(version: str) -> str:
    """"cpu", "cuda 12.4", "rocm 6.2" or "macos", from torch/version.py read as text (no import) and the suffix."""
    from importlib import metadata

    fields: dict[str, typing.Any] = {}
    try:
        path = Path(str(metadata.distribution("torch").locate_file("torch/version.py")))
        tree = ast.parse(path.read_text())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                fields[target.id] = value.value
    except (OSError, SyntaxError, metadata.PackageNotFoundError):
        fields = {}
    local = version.partition("+")[2]
    if fields.get("hip") or local.startswith("rocm"):
        return f"rocm {fields.get('hip') or local.removeprefix('rocm')}"
    if fields.get("cuda"):
        return f"cuda {fields['cuda']}"
    if local.startswith("cu") and local[2:].isdigit():
        digits = local[2:]
        return f"cuda {digits[:-1]}.{digits[-1]}"
    if sys.platform == "darwin":
        return "macos"
    return "cpu"


def _library_notes(nvidia: list[GpuInfo], libraries: dict[str, LibraryInfo], notes: list[str],
                   measured: bool) -> None:
    torch = libraries["torch"]
    if not torch.installed:
        notes.append("torch is not installed: pip install torch (a CUDA build for an NVIDIA GPU)")
    elif nvidia and measured and torch.build == "cpu":
        notes.append(f"torch {torch.version} is a CPU build: training would not use the GPU; install a CUDA build "
                     "of torch")
    if not nvidia and libraries["xformers"].installed:  # bitsandbytes has a CPU backend: its 8-bit optimizers train
        notes.append(f"xformers {libraries['xformers'].version} is installed but needs a CUDA GPU for its kernels")


# --- human view ---------------------------------------------------------------------------------------------------


def _gib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.2f} GiB"


def _flag(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _number(value: float | None, unit: str) -> str:
    return "unknown" if value is None else f"{value:g} {unit}"


def render(probe: SystemProbe, console: typing.Any = None) -> None:
    """Print the probe as rich tables (imported here: only the human view needs rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not probe.gpus:
        console.print(f"[bold yellow]no CUDA GPU found[/]: {probe.cuda_reason}")
    elif not probe.cuda_gpu_found:
        console.print(f"[yellow]no CUDA GPU found[/]: {probe.cuda_reason}")
    for gpu in probe.gpus:
        title = f"GPU {gpu.index}: {gpu.name}" + (" (assumed, from the catalogue)" if gpu.source == "catalog" else "")
        table = Table(title=title, show_header=False, title_justify="left")
        table.add_column("field", style="bold")
        table.add_column("value")
        rows = [
            ("backend", f"{gpu.backend} ({gpu.vendor})"),
            ("VRAM total / free / used", f"{_gib(gpu.vram_total_bytes)} / {_gib(gpu.vram_free_bytes)} / "
                                         f"{_gib(gpu.vram_used_bytes)}"),
            ("compute capability", gpu.compute_capability or (gpu.gfx_arch or "unknown")),
            ("fp16 tensor cores / bf16 / fp8", f"{_flag(gpu.fp16_tensor_cores)} / {_flag(gpu.bf16)} / "
                                               f"{_flag(gpu.fp8)}"),
            ("flash SDPA", _flag(gpu.flash_sdpa)),
        ]
        if gpu.source != "catalog":
            others = "unknown" if gpu.other_processes is None else (
                f"{len(gpu.other_processes)} holding {_gib(gpu.other_processes_vram_bytes)}")
            rows += [
                ("driver (CUDA)", f"{gpu.driver_version or 'unknown'} ({gpu.cuda_driver_version or 'unknown'})"),
                ("drives a display", _flag(gpu.display_active)),
                ("other processes", others),
                ("torch device", gpu.torch_device or "not checked"),
            ]
        if gpu.pcie_gbps is not None:
            rows.append(("PCIe link", f"gen {gpu.pcie_generation} x{gpu.pcie_width}: {gpu.pcie_gbps:g} GB/s each way"))
        for peer in gpu.peers or []:
            rows.append((f"link to GPU {peer.gpu}", peer.link))
        rows += [
            ("catalogue entry", gpu.catalog_name or "not in catalogue"),
            ("fp16 / bf16 tensor (dense)", f"{_number(gpu.fp16_tensor_tflops, 'TFLOP/s')} / "
                                           f"{_number(gpu.bf16_tensor_tflops, 'TFLOP/s')}"),
            ("fp32", _number(gpu.fp32_tflops, "TFLOP/s")),
            ("memory bandwidth", _number(gpu.memory_bandwidth_gbs, "GB/s")),
        ]
        if gpu.catalog_source:
            rows.append(("figures from", gpu.catalog_source))
        for name, value in rows:
            table.add_row(name, value)
        console.print(table)

    system = Table(title="System", show_header=False, title_justify="left")
    system.add_column("field", style="bold")
    system.add_column("value")
    cpu, mem, disk, plat = probe.cpu, probe.memory, probe.disk, probe.platform
    bf16 = {True: "; native bf16" + " (AMX)" * bool(cpu.amx_bf16), False: "; no native bf16", None: ""}
    system.add_row("CPU", f"{cpu.model or 'unknown'} ({cpu.arch}){bf16[cpu.bf16_native]}")
    system.add_row("cores physical / logical / usable",
                   f"{cpu.physical_cores or 'unknown'} / {cpu.logical_cores or 'unknown'} / "
                   f"{cpu.usable_cores or 'unknown'}")
    system.add_row("RAM total / available", f"{_gib(mem.ram_total_bytes)} / {_gib(mem.ram_available_bytes)}")
    system.add_row("swap total / free", f"{_gib(mem.swap_total_bytes)} / {_gib(mem.swap_free_bytes)}")
    system.add_row("disk free at output", f"{_gib(disk.free_bytes)} of {_gib(disk.total_bytes)} ({disk.checked_path})")
    system.add_row("OS", f"{plat.os_description or plat.os} ({plat.os} {plat.os_release}, {plat.machine})")
    system.add_row("Python", f"{plat.python_version} ({plat.python_implementation})")
    system.add_row("training would run on", probe.accelerator)
    console.print(system)

    libs = Table(title="Libraries", title_justify="left")
    libs.add_column("package", style="bold")
    libs.add_column("version")
    libs.add_column("build")
    for name, info in probe.libraries.items():
        libs.add_row(name, info.version if info.installed else "not installed", info.build or "")
    console.print(libs)
    for note in probe.notes:
        console.print(f"- {note}")
