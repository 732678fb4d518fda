"""The FLUX.1 engine end to end: real runs of ``python -m sd_scripts_compat.flux_train_network`` on
``builtin:tiny-flux`` and ``builtin:tiny-chroma`` (``model_type = "chroma"``: T5 only, the modulation
approximator, no modulation LoRA) with random weights over ``examples/dataset`` at 64 px, on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import toml
import torch
from fixtures.engine_runs import run_engine, toy_dataset

from sd_scripts_compat.network.lora_file import read_lora_file

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}  # threads: conftest (one per xdist worker)


def base_config(tmp_path: Path, **overrides) -> dict:
    values = {
        "pretrained_model_name_or_path": "builtin:tiny-flux", "train_data_dir": str(DATASET),
        "output_dir": str(tmp_path / "out"), "output_name": "flux", "resolution": "64,64",
        "caption_extension": ".txt", "train_batch_size": 2, "max_train_steps": 6, "network_dim": 4,
        "network_alpha": 4, "learning_rate": 1e-3, "seed": 3, "max_data_loader_n_workers": 0,
        "network_train_unet_only": True, "t5xxl_max_token_length": 16, "model_prediction_type": "raw",
        "timestep_sampling": "shift", "discrete_flow_shift": 3.0, "guidance_scale": 1.0,
    }
    values.update(overrides)
    return values


# what a Chroma config changes (sd-scripts' docs: model_type chroma, guidance 0, the T5 mask, sigmoid timesteps)
CHROMA = {"pretrained_model_name_or_path": "builtin:tiny-chroma", "model_type": "chroma", "guidance_scale": 0.0,
          "apply_t5_attn_mask": True, "timestep_sampling": "sigmoid"}
FAMILIES = {"tiny-flux": {}, "tiny-chroma": CHROMA}


def run_flux(tmp_path: Path, values: dict, *extra: str, name: str = "config.toml",
             check: bool = True) -> subprocess.CompletedProcess:
    return run_engine("flux_train_network", tmp_path, values, *extra, name=name, check=check)


@pytest.mark.parametrize("family", ["tiny-flux", pytest.param("tiny-chroma", marks=pytest.mark.slow)])
def test_tiny_flux_learns_and_writes_a_kohya_lora(tmp_path, family):
    events = tmp_path / "events"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle shape --w 64 --h 64 --s 2 --d 1 --g 3.5\n")
    sampling = {} if family == "tiny-chroma" else {"sample_prompts": str(prompts), "sample_every_n_steps": 24}
    values = base_config(tmp_path, train_batch_size=4, max_train_steps=24, network_dim=8, network_alpha=8,
                         learning_rate=1e-2, cache_latents=True, cache_text_encoder_outputs=True,
                         validation_split=0.25, validate_every_n_steps=12, gradient_checkpointing=True,
                         **sampling, **FAMILIES[family])
    result = run_flux(tmp_path, values, "--autotune_events_dir", str(events))
    done = json.loads((events / "done.json").read_text())
    losses = [loss for _, loss in done["validation_loss"]]
    assert [step for step, _ in done["validation_loss"]] == [0, 12, 24]
    # held-out loss at fixed timesteps and noise: the LoRA learnt the data
    assert losses[-1] < 0.9 * losses[0], losses
    state, metadata = read_lora_file(tmp_path / "out" / "flux.safetensors")
    assert state and all(k.startswith("lora_unet_") for k in state)
    assert metadata["ss_timestep_sampling"] == values["timestep_sampling"]
    assert metadata["ss_model_prediction_type"] == "raw"
    assert metadata["ss_guidance_scale"] == str(values["guidance_scale"])
    assert done["settings"]["blocks_to_swap"] == 0 and "done: 24 steps" in result.stdout
    if family == "tiny-flux":
        assert (tmp_path / "out" / "sample" / "flux_step00000024_00.png").stat().st_size > 0
        return
    # Chroma as sd-scripts writes it: its own base model and architecture, and no modulation Linears
    assert metadata["ss_base_model_version"] == "chroma" and metadata["ss_model_type"] == "chroma"
    assert metadata["modelspec.architecture"] == "chroma/lora"
    modules = {k.split(".")[0] for k in state}
    assert len(modules) == 8 * 2 + 2 * 2 and not any("_mod" in m or "modulation" in m for m in modules)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_resume_half_way_and_block_swap_are_bit_identical_to_a_straight_run(tmp_path, family):
    """6 steps straight; 3, stop, resume 3; and 6 with blocks swapped: the same LoRA bit for bit."""
    values = base_config(tmp_path, **{**FAMILIES[family], "save_every_n_steps": 3, "save_state": True,
                                      "timestep_sampling": "sigma", "model_prediction_type": "sigma_scaled",
                                      "apply_t5_attn_mask": True})
    run_flux(tmp_path, values)
    straight = read_lora_file(tmp_path / "out" / "flux.safetensors")[0]
    half = tmp_path / "out" / "flux-step00000003-state"
    resumed_values = dict(values, output_dir=str(tmp_path / "resumed"), save_state=False)
    result = run_flux(tmp_path, resumed_values, "--resume", str(half), name="resumed.toml")
    assert "at step 3" in result.stdout
    swapped_values = dict(values, output_dir=str(tmp_path / "swapped"), save_state=False, blocks_to_swap=1)
    run_flux(tmp_path, swapped_values, name="swapped.toml")
    for other in ("resumed", "swapped"):
        tensors = read_lora_file(tmp_path / other / "flux.safetensors")[0]
        assert tensors.keys() == straight.keys()
        assert all(torch.equal(straight[k], tensors[k]) for k in straight), other
    assert any(v.abs().sum() > 0 for k, v in straight.items() if "lora_up" in k)


@pytest.mark.slow
def test_injected_oom_writes_oom_json_with_exit_87(tmp_path):
    events = tmp_path / "events"
    values = base_config(tmp_path, blocks_to_swap=1, fp8_base=True)  # fp8 weights stored, computed in fp32
    env = {**ENV, "SD_COMPAT_INJECT_OOM": "step=2"}
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps(values), encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "sd_scripts_compat.flux_train_network", "--config_file",
                             str(config), "--autotune_events_dir", str(events)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 87, result.stderr[-2000:]
    oom = json.loads((events / "oom.json").read_text())
    assert oom["step"] == 2 and oom["settings"]["blocks_to_swap"] == 1 and oom["state_dir"]
    assert oom["settings"]["fp8_base"] is True
    assert oom["resolved"]["weight_dtype"] == "float32"


@pytest.mark.parametrize(("changes", "said"), [
    ({"model_type": "chroma"}, "apply_t5_attn_mask = true"),  # Chroma's rules, before anything loads
    ({**CHROMA, "guidance_scale": 3.5}, "set guidance_scale = 0.0"),
    ({**CHROMA, "sample_prompts": "p.txt"}, "remove sample_prompts"),
    ({**CHROMA, "model_type": "flux", "guidance_scale": 1.0}, "set model_type = 'chroma'"),  # model and type disagree
    ({**CHROMA, "pretrained_model_name_or_path": "builtin:tiny-flux"}, "set model_type = 'flux'"),
    ({**CHROMA, "pretrained_model_name_or_path": "builtin:chroma"}, "give the real model file"),
    ({"pretrained_model_name_or_path": "builtin:tiny-sd15"}, "train_network"),
])
def test_bad_flux_input_is_one_line(tmp_path, changes, said):
    result = run_flux(tmp_path, base_config(tmp_path, **changes), check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert said in result.stderr and not (tmp_path / "out").exists()


def test_text_cache_file_keeps_the_t5_mask(tmp_path):
    from sd_scripts_compat.caching.text_cache import _save_text
    from sd_scripts_compat.dataset.cache_entries import TextEntry, read_text_file

    entry = TextEntry(torch.randn(16, 32), torch.randn(32), torch.tensor([1] * 5 + [0] * 11))
    path = tmp_path / "a.png.te.safetensors"
    _save_text(path, entry, {"format": "test"})
    back = read_text_file(path)
    assert torch.equal(back.attention_mask, entry.attention_mask) and torch.equal(back.pooled, entry.pooled)


def test_autotune_train_routes_a_flux_config_to_the_flux_engine(tmp_path):
    """``autotune train config.toml`` picks the entry point from the model's family (kohya_script)."""
    config = tmp_path / "config.toml"
    config.write_text(toml.dumps(base_config(tmp_path, max_train_steps=2, train_batch_size=1)), encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "autotune", "train", str(config)], capture_output=True, text=True,
                            cwd=ROOT, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    _, metadata = read_lora_file(tmp_path / "out" / "flux.safetensors")
    assert metadata["ss_base_model_version"] == "flux1" and metadata["ss_steps"] == "2"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "version", "architecture"), [("tiny-flux", "flux1", "flux-1-dev/lora"),
                                                                  ("tiny-chroma", "chroma", "chroma/lora")])
def test_autotune_run_plans_and_trains_tiny_flux_with_its_engine(tmp_path, family, version, architecture):
    """``autotune run`` on a FLUX model: the planner's FLUX config is read with the FLUX script's rules and
    trained by flux_train_network under the watchdog, ending in a kohya FLUX LoRA and the run's report."""
    data = toy_dataset(tmp_path)
    out = tmp_path / "run"
    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", f"builtin:{family}",
               "--out", str(out), "--epochs", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "flux_train_network" in result.stdout and "bottleneck:" in result.stdout
    lora = next(p for p in out.glob("*.safetensors") if "-0" not in p.name)
    _, metadata = read_lora_file(lora)
    assert metadata["ss_base_model_version"] == version and metadata["modelspec.architecture"] == architecture
