"""The CUDA context as measured at a run's start (issue 49, item 2): the engine reads it once, the store keeps it
beside the run's other memory figures, and plans on that card use it in place of the model's constant.

No GPU here: the engine's reading runs against a FAKE NVML and CUDA (``_FakeNvml``, monkeypatched ``torch.cuda``
calls), named so; the store and the plan are the real ones."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from autotune.estimate.memory_model import DEFAULT_CUDA_CONTEXT_GIB
from autotune.measure.learned import measured_cuda_context
from autotune.measure.store import Measurement
from autotune.planning.planner import PlanRequest, gpu_from_vram, nominal_dataset, plan_training
from sd_scripts_compat.training.devices import cuda_context_mib

CARD = "cuda:Test GPU 12 GB"


class _FakeNvml:
    """A FAKE pynvml: one card, with this process and another listed by their driver-counted bytes."""

    def __init__(self, mine: int | None, fail: bool = False) -> None:
        self.mine, self.fail, self.asked = mine, fail, ""

    def nvmlInit(self) -> None:
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.asked = uuid
        return "card"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=9 * 2**30),
                SimpleNamespace(pid=os.getpid(), usedGpuMemory=self.mine)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """FAKE torch.cuda calls of a card whose allocator has reserved 64 MiB by the time the context is read."""
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="1234-abcd"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 64 * 2**20)


def test_the_context_is_this_process_on_the_card_less_what_the_allocator_reserved(fake_cuda):
    nvml = _FakeNvml(mine=(530 + 64) * 2**20)
    assert cuda_context_mib(torch.device("cuda", 0), nvml=nvml) == pytest.approx(530.0)
    assert nvml.asked == "GPU-1234-abcd"  # the card found by its UUID: CUDA_VISIBLE_DEVICES renumbers cards


@pytest.mark.parametrize("nvml", [_FakeNvml(mine=None), _FakeNvml(mine=1, fail=True)], ids=["hidden", "no_nvml"])
def test_no_figure_where_nvml_cannot_say(fake_cuda, nvml):
    assert cuda_context_mib(torch.device("cuda", 0), nvml=nvml) is None


def test_no_context_on_the_cpu():
    assert cuda_context_mib(torch.device("cpu")) is None


def _record(context: float | None, device: str = CARD, at: float = 1.0e9, family: str = "tiny-sd15") -> Measurement:
    memory = {"cuda_max_reserved_mib": 3000.0, **({"cuda_context_mib": context} if context is not None else {})}
    return Measurement(device=device, family=family, settings={}, outcome="oom", source="run", memory=memory,
                       measured_at=at)


def _plan(*records: Measurement):
    return plan_training(PlanRequest(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(),
                                     gpus=(gpu_from_vram(12),), cpu_physical_cores=2, cpu_memory_bytes=8 * 2**30,
                                     measurements=records, measured_device=CARD))


def test_a_plan_on_the_card_counts_the_measured_context_and_says_so():
    model = _plan()
    measured = _plan(_record(1100.0, family="sdxl"), _record(900.0, at=1.0e9 + 60))  # the newest, of any family
    model_context = dict(model.prediction.components)["cuda_context"]
    assert model_context == int(DEFAULT_CUDA_CONTEXT_GIB * 2**30)
    assert dict(measured.prediction.components)["cuda_context"] == 900 * 2**20
    assert measured.settings == model.settings  # a tiny model fits 12 GB either way: only the figure moves
    assert measured.prediction.peak_bytes - model.prediction.peak_bytes == 900 * 2**20 - model_context
    basis = measured.to_dict()["prediction"]["memory_basis"]
    assert basis.startswith("memory model; CUDA context 900 MiB as measured at the start of a tiny-sd15 run on " + CARD)


@pytest.mark.parametrize("bad", [math.nan, -200.0, 0.0, 40000.0, math.inf])
def test_a_context_that_is_no_measurement_or_another_cards_is_not_used(bad):
    model = _plan()
    assert _plan(_record(bad)).prediction.peak_bytes == model.prediction.peak_bytes
    assert _plan(_record(900.0, device="cuda:Another GPU")).prediction.peak_bytes == model.prediction.peak_bytes
    assert measured_cuda_context([_record(bad)], CARD) is None


def test_a_cpu_plan_has_no_context_whatever_the_store_says():
    cpu = "cpu:Test CPU"
    request = dict(dataset_dir=None, model="builtin:tiny-sd15", dataset=nominal_dataset(), cpu_physical_cores=2,
                   cpu_memory_bytes=8 * 2**30, measured_device=cpu)
    plain = plan_training(PlanRequest(**request))
    told = plan_training(PlanRequest(**request, measurements=(_record(900.0, device=cpu),)))
    assert told.prediction.peak_bytes == plain.prediction.peak_bytes
    assert "cuda_context" not in dict(told.prediction.components) or \
        dict(told.prediction.components)["cuda_context"] == 0


def test_the_store_keeps_the_engines_context_from_done_json():
    from autotune.measure.store import from_done_event
    from sd_scripts_compat.facts.families import get_family

    done = {"settings": {"train_batch_size": 1}, "step_seconds": [0.5, 0.5], "peak_memory": 4000.0,
            "memory": {"cuda_max_reserved_mib": 4000.0, "cuda_context_mib": 512.0, "peak_rss_mib": 3000.0}}
    record = from_done_event(done, device=CARD, family=get_family("tiny-sd15"), source="run")
    assert record is not None and record.memory["cuda_context_mib"] == 512.0
    found = measured_cuda_context([record], CARD)
    assert found is not None and found.mib == 512.0
