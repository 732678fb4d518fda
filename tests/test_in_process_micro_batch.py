"""The micro-batch changed in the process (issue 49: "micro-batch by re-bucketing"): the supervisor's
``control.json`` asks for 2 x 2 where the run trains 1 x 4; from the next step boundary the engine cuts the data
into batches of 2 from the same position, without a restart, and ends with the LoRA of a run stopped there and
resumed with 2 x 2 (the restart a step up made before). Real runs of our engine on tiny-sd15; no timing decides
anything: the request is in place before the run starts, so it is taken at the first step's boundary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fixtures.engine_runs import run_engine

from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.training.live_changes import ControlFile, takes

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def _values(tmp: Path, name: str, **extra) -> dict:
    return {"pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(ROOT / "examples" / "dataset"),
            "output_dir": str(tmp / name), "output_name": "lora", "resolution": "64,64", "caption_extension": ".txt",
            "train_batch_size": 1, "gradient_accumulation_steps": 4, "max_train_steps": STEPS, "network_dim": 4,
            "network_alpha": 4, "learning_rate": 1e-3, "seed": 5, "max_data_loader_n_workers": 0,
            "mixed_precision": "no", "lr_scheduler": "cosine", **extra}


@pytest.mark.slow  # CI's long runs cover the in-process step up through the watchdog (test_step_up.py)
def test_a_micro_batch_changed_in_the_process_trains_as_the_restart_would(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    (events / "control.json").write_text(json.dumps({"id": 1, "train_batch_size": 2,
                                                      "gradient_accumulation_steps": 2}), encoding="utf-8")
    live = run_engine("train_network", tmp_path, _values(tmp_path, "live"), "--autotune_events_dir", str(events),
                      name="live.toml")
    assert "resumed" not in live.stdout
    done = json.loads((events / "done.json").read_text(encoding="utf-8"))
    assert done["steps"] == STEPS and done["settings"]["train_batch_size"] == 2
    assert done["settings"]["gradient_accumulation_steps"] == 2
    # the restart it replaces: one step at 1 x 4, its state, then 2 x 2 from there
    run_engine("train_network", tmp_path, _values(tmp_path, "first", save_every_n_steps=1, save_state=True),
               name="first.toml")
    resumed = run_engine("train_network", tmp_path, _values(tmp_path, "resumed", train_batch_size=2,
                                                            gradient_accumulation_steps=2),
                         "--resume", str(tmp_path / "first" / "lora-step00000001-state"), name="resumed.toml")
    assert "at step 1" in resumed.stdout
    one, meta = read_lora_file(tmp_path / "live" / "lora.safetensors")
    two = read_lora_file(tmp_path / "resumed" / "lora.safetensors")[0]
    assert list(one) == list(two) and all((one[k] == two[k]).all() for k in one)
    assert meta["ss_batch_size_per_device"] == "2" and meta["ss_gradient_accumulation_steps"] == "2"
    assert meta["ss_total_batch_size"] == "4" and meta["ss_steps"] == str(STEPS)
    alone = read_lora_file(tmp_path / "first" / "lora.safetensors")[0]  # 1 x 4 all the way: other batches
    assert any(not (alone[k] == one[k]).all() for k in one)


def test_a_micro_batch_that_would_change_the_effective_batch_is_not_taken(tmp_path):
    """The engine keeps the effective batch: 2 x 1 asked of a 1 x 4 run is left, and the run trains 1 x 4."""
    events = tmp_path / "events"
    events.mkdir()
    (events / "control.json").write_text(json.dumps({"id": 1, "train_batch_size": 2,
                                                      "gradient_accumulation_steps": 1}), encoding="utf-8")
    run_engine("train_network", tmp_path, _values(tmp_path, "out", max_train_steps=2), "--autotune_events_dir",
               str(events))
    done = json.loads((events / "done.json").read_text(encoding="utf-8"))
    assert done["settings"]["train_batch_size"] == 1 and done["settings"]["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize(("request_", "taken"), [
    ({"train_batch_size": 2, "gradient_accumulation_steps": 2}, True),
    ({"train_batch_size": 2}, False),  # the sizes together
    ({"train_batch_size": 0, "gradient_accumulation_steps": 4}, False),
    ({"train_batch_size": True, "gradient_accumulation_steps": 2}, False),
    ({"train_batch_size": 2.0, "gradient_accumulation_steps": 2}, False),
    ({"gradient_checkpointing": False, "train_batch_size": 4, "gradient_accumulation_steps": 1}, True),
    ({"network_dim": 8}, False), ({}, False)])
def test_what_the_process_takes(tmp_path, request_, taken):
    assert takes(request_) is taken
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"id": 1, **request_}), encoding="utf-8")
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    assert (ControlFile(path).poll() is not None) is taken
