"""Measurements of this machine's runs and benches, kept per device so that plans learn from them.

One small JSON file (``measurements.json``) in the user cache folder (``platformdirs``; the
``AUTOTUNE_CACHE_DIR`` environment variable overrides it, for tests and for a shared cache). Each
record is one engine run that finished (its steady-state seconds per optimizer step and peak memory)
or ran out of memory, keyed by the device (a GPU's name, or ``cpu:<model name>``), the model family and
the settings that decide speed and memory (:data:`KEY_FIELDS`). A newer record of the same key
replaces the older one. Written atomically; a store that cannot be read is ignored with one warning
(a plan then uses the models alone), never fatal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.contract import Outcome

if TYPE_CHECKING:
    from collections.abc import Callable

    from autotune.hardware.probe import SystemProbe
    from sd_scripts_compat.facts.families import FamilySpec

SCHEMA_VERSION = 1
STORE_NAME = "measurements.json"
CACHE_ENV = "AUTOTUNE_CACHE_DIR"
MAX_RECORDS = 1000  # oldest dropped first; a record is ~1 KB
MAX_FIGURE = 2.0**40  # a figure above this (MiB, seconds) is no measurement: a store edited by hand or garbled
# TrainSettings fields that change a micro-step's time or peak memory (learning rates and clipping do not)
KEY_FIELDS = ("train_batch_size", "gradient_accumulation_steps", "resolution", "gradient_checkpointing",
              "optimizer_type", "network_dim", "network_train_unet_only", "mixed_precision", "fp8_base",
              "cache_latents", "cache_text_encoder_outputs", "xformers", "blocks_to_swap", "network_module",
              "network_args", "torch_compile")
# key fields a record stored before they existed is read with (its run trained a plain LoRA, eager)
KEY_DEFAULTS = {"network_module": "networks.lora", "network_args": [], "torch_compile": False}


def cache_dir() -> Path:
    """Where the store lives: ``$AUTOTUNE_CACHE_DIR``, else the platform's user cache folder."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # an environment installed before platformdirs became a dependency: XDG's default
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lora-autotune"
    return Path(user_cache_dir("lora-autotune", appauthor=False))


def store_path() -> Path:
    return cache_dir() / STORE_NAME


def settings_key(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The key fields of a ``TrainSettings.to_event()`` block, JSON-normalised (resolution as a list)."""
    key = {name: settings.get(name, KEY_DEFAULTS.get(name)) for name in KEY_FIELDS}
    key["network_args"] = list(key["network_args"] or [])
    if key["resolution"] is not None:
        key["resolution"] = [int(v) for v in key["resolution"]]
    return key


def device_key(probe: SystemProbe, *, cpu: bool = False) -> str:
    """The device a probe's run trains on: the first CUDA GPU's catalogue name (so ``--gpu NAME`` plans find its
    measurements), else its own name, else (or with ``cpu``) ``cpu:<model name>``."""
    gpu = next((g for g in getattr(probe, "gpus", ()) if getattr(g, "backend", "cuda") == "cuda"), None)
    if not cpu and getattr(probe, "accelerator", "cpu") == "cuda" and gpu is not None:
        return str(getattr(gpu, "catalog_name", None) or gpu.name)
    return f"cpu:{probe.cpu.model or probe.cpu.arch or 'unknown'}"


def emulated_device_key(probe: SystemProbe) -> str:
    """The device of a run on a card emulated on this CPU (``--emulate-card``). Its size is not part of it: the
    tensors counted do not depend on it (as a real card's figures do not on ``--vram``), and an OOM record keeps
    the budget it ran out of."""
    return f"emulated card on {device_key(probe, cpu=True)}"


@dataclass(frozen=True)
class Measurement:
    """One measured run. ``outcome``: ``Outcome.DONE`` (speed and memory measured) or ``Outcome.OOM``."""

    device: str
    family: str
    settings: dict[str, Any]  # TrainSettings.to_event() of the run (the key is read from it)
    outcome: str
    source: str  # "bench" | "run"
    seconds_per_step: float | None = None  # steady state, one optimizer step (all accumulation micro-steps)
    peak_memory_mib: float | None = None  # CUDA max reserved, or peak RSS on CPU
    memory: dict[str, float] = field(default_factory=dict)  # cuda_max_allocated_mib, cuda_max_reserved_mib, ...
    budget_mib: float | None = None  # oom: the memory it had to fit in (None: the whole device)
    steps: int = 0  # how many timed steps the figure is the mean of
    measured_at: float = 0.0  # unix time
    compile_seconds: float | None = None  # torch_compile: the seconds its blocks took to compile (a one-off cost)
    predicted_mib: float | None = None  # what the run's memory model predicted for these settings, beside the peak
    resident_mib: float | None = None  # what stayed on the device between steps (weights, LoRA, optimizer state)

    @property
    def key(self) -> dict[str, Any]:
        return settings_key(self.settings)

    @property
    def micro_steps_per_s(self) -> float | None:
        if not self.seconds_per_step:
            return None
        return max(1, int(self.settings.get("gradient_accumulation_steps") or 1)) / self.seconds_per_step

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "family": self.family, "settings": self.settings, "outcome": self.outcome,
                "source": self.source, "seconds_per_step": self.seconds_per_step,
                "peak_memory_mib": self.peak_memory_mib, "memory": self.memory, "budget_mib": self.budget_mib,
                "steps": self.steps, "measured_at": self.measured_at, "compile_seconds": self.compile_seconds,
                "predicted_mib": self.predicted_mib, "resident_mib": self.resident_mib}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Measurement:
        return cls(device=str(value["device"]), family=str(value["family"]), settings=dict(value["settings"]),
                   outcome=str(value["outcome"]), source=str(value.get("source", "run")),
                   seconds_per_step=measured_figure(value.get("seconds_per_step")),
                   peak_memory_mib=measured_figure(value.get("peak_memory_mib")), memory=_figures(value.get("memory")),
                   budget_mib=measured_figure(value.get("budget_mib")), steps=int(value.get("steps") or 0),
                   measured_at=float(value.get("measured_at") or 0.0),
                   compile_seconds=measured_figure(value.get("compile_seconds")),
                   predicted_mib=measured_figure(value.get("predicted_mib")),
                   resident_mib=measured_figure(value.get("resident_mib")))


def measured_figure(value: Any) -> float | None:
    """A figure as a float; None for what is no measurement (not a number, NaN, infinite, negative or huge)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) and 0.0 <= number <= MAX_FIGURE else None


def _figures(value: Any) -> dict[str, float]:
    """A ``memory`` block's figures that are measurements (``measured_figure``); the rest left out."""
    if not isinstance(value, Mapping):
        return {}
    return {str(k): n for k, v in value.items() if (n := measured_figure(v)) is not None}


def load_measurements(path: Path | None = None, warn: Callable[[str], None] | None = None) -> list[Measurement]:
    """Every record in the store; [] when it is missing, and [] with one warning when it is unreadable."""
    path = path or store_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as error:
        _warn(warn, f"{path}: cannot read the measurements ({error.strerror or error}); planning from the models")
        return []
    try:
        document = json.loads(text)
        if document.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema_version {document.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        return [Measurement.from_json(record) for record in document["records"]]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        _warn(warn, f"{path}: unreadable measurements ({str(error)[:120]}); ignored, planning from the models "
                    "(delete the file to start afresh)")
        return []


def _warn(warn: Callable[[str], None] | None, message: str) -> None:
    (warn or (lambda text: print(f"warning: {text}", file=sys.stderr)))(message)


def record_measurements(new: Iterable[Measurement], path: Path | None = None) -> Path:
    """Add ``new`` to the store (replacing records of the same device, family, key and outcome); atomic. A
    finished record without a speed (its run shared the CPU) keeps the speed of the record it replaces."""
    from dataclasses import replace

    from sd_scripts_compat.facts.atomic import write_json_atomic

    path = path or store_path()
    records = load_measurements(path)
    for item in new:
        item = item if item.measured_at else _stamped(item)
        same = [r for r in records if r.device == item.device and r.family == item.family and r.key == item.key
                and r.outcome == item.outcome]
        timed = next((r for r in reversed(same) if r.seconds_per_step), None)
        if item.outcome == Outcome.DONE and not item.seconds_per_step and timed is not None:
            item = replace(item, seconds_per_step=timed.seconds_per_step, steps=timed.steps)
        records = [r for r in records if r not in same]
        if item.outcome == Outcome.DONE:  # a run that now fits clears an older OOM of the same settings
            records = [r for r in records if not (r.outcome == Outcome.OOM and r.device == item.device
                                                  and r.family == item.family and r.key == item.key)]
        records.append(item)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"schema_version": SCHEMA_VERSION,
                             "records": [r.to_json() for r in records[-MAX_RECORDS:]]})
    return path


def _stamped(item: Measurement) -> Measurement:
    from dataclasses import replace

    return replace(item, measured_at=time.time())


def from_done_event(done: Mapping[str, Any], *, device: str, family: FamilySpec, source: str) -> Measurement | None:
    """A record from the engine's done.json (None without a steady-state timing: too few steps); its time is
    the median step (:func:`steady_seconds_per_step`). A ``torch_compile`` run is keyed as compiled and keeps its
    compile time; one whose compile failed is None (it trained eager under a compiled key)."""
    settings = done.get("settings")
    seconds = steady_seconds_per_step(done)
    compiled = done.get("torch_compile") if isinstance(done.get("torch_compile"), dict) else None
    if not isinstance(settings, dict) or seconds is None or (compiled is not None and compiled.get("failure")):
        return None
    return Measurement(device=device, family=family.name, settings=settings, outcome=Outcome.DONE, source=source,
                       seconds_per_step=seconds,
                       peak_memory_mib=measured_figure(done.get("peak_memory")), memory=_figures(done.get("memory")),
                       resident_mib=measured_figure(done.get("resident_memory")),
                       steps=len(done.get("step_seconds") or []),
                       compile_seconds=measured_figure(compiled.get("seconds")) if compiled is not None else None)


def steady_seconds_per_step(done: Mapping[str, Any]) -> float | None:
    """The median of done.json's timed steps (its mean without them): a load spike on a shared machine moves
    a short run's mean by tens of percent, its median hardly."""
    import statistics

    steps = [float(v) for v in done.get("step_seconds") or [] if measured_figure(v)]
    return statistics.median(steps) if steps else measured_figure(done.get("seconds_per_step"))


def from_oom_event(oom: Mapping[str, Any], *, device: str, family: FamilySpec, source: str,
                   budget_mib: float | None) -> Measurement | None:
    settings = oom.get("settings")
    if not isinstance(settings, dict):
        return None
    return Measurement(device=device, family=family.name, settings=settings, outcome=Outcome.OOM, source=source,
                       memory=_figures(oom.get("memory")), budget_mib=budget_mib)
