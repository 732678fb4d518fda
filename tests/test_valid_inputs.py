"""Valid input that sd-scripts and lycoris accept, accepted here too (issue 47's "valid input refused"), and the
writers that may replace their own files doing so. Each case really trains the tiny model or really runs the
command, in a process of its own, and checks what it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import toml
from test_hostile_inputs import ENV, TINY, config, dataset, lora_like, run_folder, sd3_lora, text_file


def python(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=600)


def trains(tmp_path: Path, **overrides: object) -> tuple[subprocess.CompletedProcess, Path]:
    done = python("sd_scripts_compat.train_network", "--config_file", str(config(tmp_path, **overrides)),
                  cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return done, tmp_path / "out"


def metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        return file.metadata() or {}


def keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        return list(file.keys())


def test_a_lower_case_optimizer_name_trains_as_sd_scripts_does(tmp_path):
    _, out = trains(tmp_path, optimizer_type="adamw8bit")
    assert "AdamW8bit" in metadata(out / "lora.safetensors")["ss_optimizer"]
    done = python("autotune", "plan", str(dataset(tmp_path)), "--model", TINY, "--optimizer", "adamw8bit", "--vram",
                  "8", "--out", str(tmp_path / "plan"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert toml.loads((tmp_path / "plan" / "config.toml").read_text())["optimizer_type"] == "AdamW8bit"


@pytest.mark.long
def test_warmup_with_the_constant_scheduler_is_a_warning_as_in_sd_scripts(tmp_path):
    done, out = trains(tmp_path, lr_scheduler="constant", lr_warmup_steps=5)
    assert (out / "lora.safetensors").is_file() and "constant_with_warmup" in done.stderr


@pytest.mark.long
def test_conv_dim_zero_trains_no_convolutions(tmp_path):
    _, out = trains(tmp_path, network_args=["conv_dim=0"])
    names = keys(out / "lora.safetensors")
    assert names and not any("conv" in name and "lora_down" in name and "resnets" in name for name in names)
    _, plain = trains(tmp_path / "plain")
    assert sorted(names) == sorted(keys(plain / "lora.safetensors"))  # the same modules as without conv_dim


@pytest.mark.long
@pytest.mark.parametrize("kind", ["toml", "json"])
def test_sample_prompts_from_toml_and_json_files_as_sd_scripts_reads_them(tmp_path, kind):
    if kind == "toml":
        prompts = text_file(tmp_path / "p.toml", '[prompt]\nwidth = 64\nheight = 64\nsample_steps = 2\n'
                                                 '[[prompt.subset]]\nprompt = "a toy"\n[[prompt.subset]]\n'
                                                 'prompt = "a cat"\nseed = 3\nscale = 5.0\n')
    else:
        prompts = text_file(tmp_path / "p.json", json.dumps([
            {"prompt": "a toy", "width": 64, "height": 64, "sample_steps": 2},
            "a cat --w 64 --h 64 --s 2 --d 3"]))
    _, out = trains(tmp_path, sample_prompts=str(prompts), sample_every_n_steps=1, max_train_steps=1)
    samples = sorted((out / "sample").glob("*.png"))
    assert len(samples) == 2, samples


@pytest.mark.parametrize(("text", "said"), [
    ('[prompt]\nwidth = 64\n', "[[prompt.subset]]"), ('[prompt]\n[[prompt.subset]]\nprompt = "x"\nwidth = "big"\n',
                                                       "width"),
    ('[prompt]\n[[prompt.subset]]\nprompt = "x"\nwidht = 64\n', "widht"), ("not toml [", "not a valid toml"),
    ('[prompt]\n[[prompt.subset]]\nprompt = "x"\nwidth = 100000\n', "--w 100000"),
])
def test_a_bad_toml_prompt_file_is_one_line(tmp_path, text, said):
    prompts = text_file(tmp_path / "p.toml", text)
    done = python("sd_scripts_compat.train_network", "--config_file", str(config(
        tmp_path, sample_prompts=str(prompts), sample_every_n_steps=1)), cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.long
def test_writers_replace_what_they_wrote_and_nothing_else(tmp_path):
    """report --html, plan --out and inspect --diffusers-out run twice onto their own output: both times fine."""
    run = run_folder(tmp_path)
    page = tmp_path / "report.html"
    for _ in range(2):
        done = python("autotune", "report", str(run), "--html", str(page), cwd=tmp_path)
        assert done.returncode == 0 and page.read_text().startswith("<!doctype html>"), done.stderr
    plan_out = tmp_path / "planned"
    for _ in range(2):
        done = python("autotune", "plan", str(dataset(tmp_path)), "--model", TINY, "--vram", "8", "--out",
                      str(plan_out), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    lora, copy = sd3_lora(tmp_path), tmp_path / "copy.safetensors"
    for _ in range(2):
        done = python("autotune", "inspect", str(lora), "--diffusers-out", str(copy), cwd=tmp_path)
        assert done.returncode == 0 and copy.is_file(), done.stderr
    before = lora_like(tmp_path / "theirs.safetensors").read_bytes()
    done = python("autotune", "inspect", str(lora), "--diffusers-out", str(tmp_path / "theirs.safetensors"),
                  cwd=tmp_path)
    assert done.returncode == 2 and (tmp_path / "theirs.safetensors").read_bytes() == before
