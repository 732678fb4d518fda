"""Plan texts say what is so for their device: every family's plan rendered for a CPU and for three cards (issue 51,
item 4). One key is chosen once (a Qwen-Image plan named sdpa twice); a CPU plan speaks of its RAM, not VRAM, keeps
no CUDA context in its figure and, where nothing fits, does not tell the user to buy a card first; a card's plan
speaks of VRAM per device."""

from __future__ import annotations

import pytest

from autotune.planning.planner import PlanRequest, Preferences, gpu_from_vram, plan_training
from autotune.planning.toml_writer import header_lines
from sd_scripts_compat.facts.families import family_names, get_family

GIB = 2**30
DEVICES = (None, 8, 16, 24)  # None: planned for this machine's CPU with 16 GB of RAM


def _plan(family: str, vram: int | None):  # noqa: ANN202
    return plan_training(PlanRequest(dataset_dir=None, model=f"./models/{family}.safetensors",
                                     family=get_family(family), gpus=(gpu_from_vram(vram),) if vram else (),
                                     cpu_physical_cores=8, cpu_memory_bytes=16 * GIB, preferences=Preferences()))


@pytest.mark.parametrize("family", family_names())
def test_every_familys_plan_states_each_key_once_and_its_devices_memory(family: str, capsys, monkeypatch) -> None:
    from autotune.launch.plan_options import render

    monkeypatch.setenv("COLUMNS", "200")
    for vram in DEVICES:
        plan = _plan(family, vram)
        if not plan.fits:
            assert ("use a card" in plan.message) == bool(vram), (family, vram, plan.message)
            continue
        keys = [c.key for c in plan.choices]
        assert len(keys) == len(set(keys)), (family, vram, sorted(k for k in keys if keys.count(k) > 1))
        render(plan)
        text = "\n".join([*header_lines(plan, "config.toml"), capsys.readouterr().out])
        components = dict(plan.prediction.components)
        if vram is None:
            assert plan.device == "CPU" and "VRAM" not in text and "one per GPU" not in text, family
            assert "predicted peak memory (RAM)" in text and not components.get("cuda_context"), family
        else:
            assert "predicted peak VRAM per device" in text and components["cuda_context"] > 0, (family, vram)
