"""LyCORIS through lycoris-lora's kohya entry point (``network_module = "lycoris.kohya"``), as sd-scripts
trains it: tiny models really train (LoCon, LoHa, LoKr), the files carry the names lycoris writes for
sd-scripts' own models, and the package missing is one line naming the extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sd_scripts_compat.config.network_args import MISSING_LYCORIS, parse_network_args
from sd_scripts_compat.config.training_config import load_training_config
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.models.build import build_modules
from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.network.lycoris import create_lycoris_network
from tests.test_train_engine import base_config, run_engine, write_config

# the tensors each algorithm writes per module (lycoris-lora's names)
SUFFIXES = {"locon": {"lora_down.weight", "lora_up.weight", "alpha"},
            "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
            "lokr": {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}}


def lycoris_network(family: str, algo: str, **entries: str):
    bundle = build_modules(get_family(family), device="meta")
    args = parse_network_args({"algo": algo, **entries}, "lycoris.kohya")
    network = create_lycoris_network(bundle, network_dim=16, network_alpha=8, dropout=None, args=args)
    network.apply_to()
    return network


@pytest.mark.parametrize("algo", [pytest.param("locon", marks=pytest.mark.slow), "loha",
                                  pytest.param("lokr", marks=pytest.mark.slow)])
@pytest.mark.long
def test_tiny_sd15_trains_each_algorithm_with_a_falling_held_out_loss(tmp_path, algo):
    events = tmp_path / "events"
    values = base_config(tmp_path, network_module="lycoris.kohya", network_args=[f"algo={algo}", "factor=4"],
                         train_batch_size=4, max_train_steps=24, learning_rate=1e-2 if algo != "lokr" else 3e-2,
                         cache_latents=True, validation_split=0.25, validate_every_n_steps=12,
                         network_train_unet_only=True)
    run_engine(write_config(tmp_path / "config.toml", values), events=events)
    losses = [loss for _, loss in json.loads((events / "done.json").read_text())["validation_loss"]]
    assert losses[-1] == min(losses) and losses[-1] < 0.97 * losses[0], losses
    path = tmp_path / "out" / "lora.safetensors"
    weights, metadata = read_lora_file(path, lycoris=True)
    assert {key.split(".", 1)[1] for key in weights} <= SUFFIXES[algo]
    assert metadata["ss_network_module"] == "lycoris.kohya"
    # sd-scripts adds its network_dropout as "dropout" (its LyCORIS workaround) to the entries it writes
    assert json.loads(metadata["ss_network_args"]) == {"algo": algo, "factor": "4", "dropout": None}
    assert all(key.startswith("lora_unet_") for key in weights)
    moved = [key for key, value in weights.items() if not key.endswith("alpha") and value.abs().sum() > 0]
    assert moved


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_names_are_kohyas_on_the_full_size_models(family):
    keys = lycoris_network(family, "lokr").kohya_state_dict()
    names = {key.split(".", 1)[0] for key in keys}
    if family == "sd15":  # diffusers names, as sd-scripts' SD 1.x UNet has them; transformers-4 CLIP names
        assert "lora_unet_down_blocks_0_resnets_0_conv1" in names and "lora_unet_conv_in" in names
        assert "lora_te_text_model_encoder_layers_11_mlp_fc2" in names
    else:  # SGM names; SDXL's SGM UNet has no conv_in / time_embedding for lycoris to pick by name
        assert "lora_unet_input_blocks_1_0_in_layers_2" in names
        assert not any("down_blocks" in n or "conv_in" in n or "time_embedding" in n for n in names)
        assert "lora_te2_text_model_encoder_layers_31_self_attn_q_proj" in names


def test_resume_state_round_trips_through_kohya_names():
    first, second = lycoris_network("sd15", "loha"), lycoris_network("sd15", "loha")
    with torch.no_grad():
        for param in first.inner.parameters():
            param.normal_()
    second.load_kohya_state_dict(first.kohya_state_dict())
    assert all(torch.equal(a, b) for a, b in zip(first.inner.state_dict().values(),
                                                 second.inner.state_dict().values()))
    with pytest.raises(UserError, match="do not match"):
        lycoris_network("sd15", "locon").load_kohya_state_dict(first.kohya_state_dict())


def test_refusals_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="algo 'lokrr' is unknown; did you mean 'lokr'"):
        parse_network_args({"algo": "lokrr"}, "lycoris.kohya")
    config = tmp_path / "config.toml"
    config.write_text('network_module = "lycoris.kohya"\n', encoding="utf-8")
    with pytest.raises(UserError, match="cannot train FLUX here"):
        load_training_config(["--config_file", str(config)], script="flux_train_network")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lycoris" else real(name, *a))
    with pytest.raises(UserError) as error:
        load_training_config(["--config_file", str(config)], script="train_network")
    assert str(error.value).endswith(MISSING_LYCORIS) and 'pip install -e ".[lycoris]"' in str(error.value)


# ---- against lycoris in sd-scripts itself (LORA_AUTOTUNE_SD_SCRIPTS, its venv with lycoris-lora) ----------

_NAMES_IN_SD_SCRIPTS = r"""
import lycoris.kohya
network = lycoris.kohya.create_network(1.0, 16, 8, None, te, unet, algo=sys.argv[3])
network.apply_to(te, unet, True, True)
print(json.dumps({k: list(v.shape) for k, v in network.state_dict().items()}))
"""


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
@pytest.mark.parametrize("algo", ["locon", "loha", "lokr"])
def test_keys_and_shapes_equal_lycoris_in_sd_scripts(family, algo):
    from tests.fixtures.local import SD_SCRIPTS_MODELS, sd_scripts

    checkout, python = sd_scripts()
    if python is None:
        pytest.skip("needs LORA_AUTOTUNE_SD_SCRIPTS (+ _PYTHON): a local sd-scripts checkout, lycoris-lora in its venv")
    result = subprocess.run([str(python), "-c", SD_SCRIPTS_MODELS + _NAMES_IN_SD_SCRIPTS, str(checkout), family, algo],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    ours = {k: list(v.shape) for k, v in lycoris_network(family, algo).kohya_state_dict().items()}
    assert sorted(set(ours) ^ set(theirs))[:5] == []
    assert ours == theirs


def test_engine_names_the_extra_when_lycoris_is_missing(tmp_path):
    """A real engine process in which the package cannot be found: one line, before anything loads."""
    config = write_config(tmp_path / "config.toml", base_config(tmp_path, network_module="lycoris.kohya",
                                                                 network_args=["algo=loha"]))
    hide = ("import importlib.util, runpy, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'lycoris' else real(n, *a); "
            "sys.argv = ['train_network', '--config_file', sys.argv[1]]; "
            "runpy.run_module('sd_scripts_compat.train_network', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide, str(config)], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and MISSING_LYCORIS in result.stderr


# ---- the planner ------------------------------------------------------------------------------------------

def _plan_json(*extra: str) -> dict:
    """``autotune plan ... --json`` in this process (the lycoris package and the meta SDXL are imported once for
    the four plans; the command line itself is tested in a subprocess below)."""
    import contextlib
    import io

    from autotune.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["plan", str(Path(__file__).parents[1] / "examples" / "dataset"), "--model", "builtin:sdxl",
                       "--gpu", "RTX 3060", "--rank", "16", "--json", *extra])
    assert status == 0
    return json.loads(printed.getvalue())


@pytest.mark.long
def test_planner_counts_lycoris_parameters_with_the_package():
    def lora_bytes(plan: dict) -> int:
        return plan["prediction"]["components"]["lora_params"]

    locon, loha = _plan_json("--network", "locon"), _plan_json("--network", "loha")
    lokr, lokr8 = _plan_json("--network", "lokr"), _plan_json("--network", "lokr", "--network-arg", "factor=8")
    assert lora_bytes(loha) == 2 * lora_bytes(locon)  # LoHa: two rank-r factor pairs per module
    assert lora_bytes(lokr) < lora_bytes(lokr8) < lora_bytes(locon)  # LoKr's size follows its factor
    values = {c["key"]: c["value"] for c in lokr8["choices"]}
    assert values["network_module"] == "lycoris.kohya" and values["network_args"] == ["algo=lokr", "factor=8"]
    assert lokr8["settings"]["network_args"] == ["algo=lokr", "factor=8"]


def test_planner_refuses_lycoris_for_flux_and_bad_entries_in_one_line():
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    for extra, said in ((["--model", "builtin:tiny-flux", "--network", "loha"], "cannot train tiny-flux"),
                        (["--model", "builtin:tiny-sd15", "--network", "lokr", "--network-arg", "factor"],
                         "key=value"),
                        (["--model", "builtin:tiny-sd15", "--network-arg", "conv_dims=4"], "conv_dims")):
        done = subprocess.run([sys.executable, "-m", "autotune", "plan", str(Path(__file__).parents[1] / "examples" /
                                                                              "dataset"), *extra],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 2 and said in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr


@pytest.mark.slow
def test_autotune_run_plans_and_trains_a_loha(tmp_path):
    from tests.test_run_e2e import make_dataset

    data = make_dataset(tmp_path)
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15",
                           "--network", "loha", "--epochs", "1", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    written = next((tmp_path / "run").glob("*.safetensors"))
    weights, metadata = read_lora_file(written, lycoris=True)
    assert any(key.endswith(".hada_w1_a") for key in weights) and metadata["ss_network_module"] == "lycoris.kohya"
