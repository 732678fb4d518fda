"""`autotune plan` as a user runs it: a subprocess on a real dataset folder, files written and re-read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import toml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "dataset"


def make_dataset(root: Path) -> Path:
    sub = root / "8_sks cat"
    sub.mkdir(parents=True)
    for i in range(6):
        (sub / f"{i}.png").write_bytes(b"")
        (sub / f"{i}.txt").write_text("sks cat", encoding="utf-8")
    return root


def autotune(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def dataset_dir(tmp_path: Path) -> Path:
    return EXAMPLES if EXAMPLES.is_dir() else make_dataset(tmp_path / "dataset")


def test_plan_json_writes_both_files(tmp_path):
    out = tmp_path / "plan"
    done = autotune("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sdxl", "--gpu", "RTX 3060",
                    "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["fits"] and plan["family"] == "sdxl" and plan["num_processes"] == 1
    assert plan["prediction"]["peak_bytes"] <= plan["prediction"]["usable_bytes"]
    assert sorted(Path(p).name for p in plan["written"]) == ["config.toml", "dataset.toml"]
    config = toml.load(out / "config.toml")
    assert config["resolution"] == "1024,1024" and config["mixed_precision"] == "bf16"
    assert config["dataset_config"] == str((out / "dataset.toml").resolve())
    values = {c["key"]: c["value"] for c in plan["choices"] if c["kohya"]}
    assert values == config
    assert toml.load(out / "dataset.toml")["datasets"][0]["batch_size"] == config["train_batch_size"]


def test_plan_table_and_lora_scripts_format(tmp_path):
    out = tmp_path / "ls"
    done = autotune("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sd15", "--gpu", "GTX 1080",
                    "--gpu", "GTX 1080", "--goal", "style", "--priority", "quality", "--format", "lora-scripts",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    for word in ("setting", "reason", "train_batch_size", "predicted peak VRAM", "it/s", "--num_processes 2"):
        assert word in done.stdout, word
    config = toml.load(out / "config.toml")
    assert "training_arguments" in config and config["training_arguments"]["mixed_precision"] == "fp16"


def test_plan_without_gpu_flags_probes_this_machine(tmp_path):
    """This machine has no GPU: the probe says so and the plan is a CPU plan, bf16 autocast where the probe
    found native bf16 (avx512_bf16 / AMX), else fp32."""
    done = autotune("plan", str(make_dataset(tmp_path / "d")), "--model", "builtin:sd15", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    if plan["device"] == "CPU":
        from autotune.hardware.probe import probe_cpu

        assert plan["settings"]["mixed_precision"] == ("bf16" if probe_cpu().bf16_native else "no")
        assert "no GPU" in plan["probe_summary"]
        assert plan["prediction"]["speed_source"] == "model"  # this test's own, empty measurement store
    assert plan["written"] == []


def test_plan_user_errors_are_one_line(tmp_path):
    data = str(make_dataset(tmp_path / "d"))
    cases = [
        (["--model", "builtin:sdxl", "--vram", "1.5"], "nothing fits"),
        (["--model", "builtin:sdxl", "--gpu", "RTX 9999 Hyper"], "unknown GPU"),
        (["--model", "builtin:nope", "--vram", "8"], "unknown built-in"),
        (["--model", "builtin:sd15", "--vram", "8", "--out", str(Path(data) / "8_sks cat" / "0.png" / "x")],
         "--out"),
    ]
    for args, words in cases:
        done = autotune("plan", data, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
        assert "Traceback" not in done.stderr
    missing = autotune("plan", str(tmp_path / "none"), "--model", "builtin:sd15", "--vram", "8")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_fake_probe_two_gpus_held_memory_and_display(monkeypatch, tmp_path):
    """No NVIDIA driver here: a probe answer for two cards (one driving a display) stands in for NVML."""
    import argparse

    from autotune.hardware import probe as probe_module
    from autotune.launch import plan_options as plan_command
    from autotune.planning.planner import GIB, plan_training

    real_probe = probe_module.probe_system

    def fake_probe(output_dir=".", assume_gpu=None, use_torch=True):
        first = real_probe(output_dir, assume_gpu="RTX 3060", use_torch=False)
        second = real_probe(output_dir, assume_gpu="RTX 3090", use_torch=False)
        first.gpus[0].vram_used_bytes = int(1.5 * GIB)
        first.gpus[0].display_active = True
        second.gpus[0].index = 1
        first.gpus.append(second.gpus[0])
        return first

    monkeypatch.setattr(probe_module, "probe_system", fake_probe)
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    args = parser.parse_args([str(make_dataset(tmp_path / "d")), "--model", "builtin:sdxl"])
    request = plan_command.build_request(args)
    assert [g.source for g in request.gpus] == ["probe", "probe"]
    assert request.gpus[0].held_bytes == int(1.5 * GIB) and "display active" in request.probe_summary
    plan = plan_training(request)
    assert plan.fits and plan.num_processes == 2
    assert plan.prediction.usable_bytes == 12 * GIB - int(1.5 * GIB)  # the smaller, busier card decides
    assert plan.prediction.required_bytes <= plan.prediction.usable_bytes


PINS = {"--batch": "2", "--accum": "3", "--lr": "2e-4", "--rank": "16", "--alpha": "8", "--steps": "500",
        "--optimizer": "Lion", "--resolution": "512"}
KOHYA_NAMES = {"--batch": "--train_batch_size", "--accum": "--gradient_accumulation_steps", "--lr": "--learning_rate",
               "--rank": "--network_dim", "--alpha": "--network_alpha", "--steps": "--max_train_steps",
               "--optimizer": "--optimizer_type", "--resolution": "--resolution"}


def test_plan_keeps_what_is_pinned_under_our_names_and_sd_scripts_names_alike(tmp_path):
    """--batch / --accum / --lr / --rank / --alpha / --steps / --optimizer (any the engine trains) / --resolution,
    or sd-scripts' flag names for them (and kohya's 512,512): the same config, every pinned value in it."""
    configs = []
    for name, names in (("ours", {k: k for k in PINS}), ("kohya", KOHYA_NAMES)):
        out = tmp_path / name
        values = [item for key, value in PINS.items()
                  for item in (names[key], "512,512" if name == "kohya" and key == "--resolution" else value)]
        done = autotune("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sd15", "--vram", "12", "--out",
                        str(out), *values)
        assert done.returncode == 0, done.stderr
        configs.append({k: v for k, v in toml.load(out / "config.toml").items() if not str(v).startswith(str(out))})
    assert configs[0] == configs[1]
    config = configs[0]
    assert (config["train_batch_size"], config["gradient_accumulation_steps"]) == (2, 3)
    assert (config["unet_lr"], config["network_dim"], config["network_alpha"]) == (2e-4, 16, 8.0)
    assert config["max_train_steps"] == 500 and "max_train_epochs" not in config
    assert config["optimizer_type"] == "Lion" and config["resolution"] == "512,512"


def test_a_pinned_batch_that_cannot_fit_is_stepped_down_with_the_reason(tmp_path):
    done = autotune("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sdxl", "--vram", "8", "--batch", "16",
                    "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["settings"]["train_batch_size"] < 16
    assert any(line.startswith("your micro-batch 16 x 1 does not fit (needs ") for line in plan["fallbacks"])


def test_pins_that_contradict_are_one_line(tmp_path):
    for args, said in ((["--steps", "100", "--epochs", "2"], "give one of them"),
                       (["--resolution", "768,512"], "square buckets"),
                       (["--optimizer", "SGD"], "--optimizer"), (["--lr", "0"], "--lr 0"),
                       (["--accum", "0"], "--accum 0")):
        done = autotune("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sd15", "--vram", "12", *args)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], (args, done.stderr)


def test_strict_refuses_a_pin_that_forces_another_setting_down_in_one_line(tmp_path):
    argv = ("plan", str(dataset_dir(tmp_path)), "--model", "builtin:sdxl", "--vram", "8", "--batch", "4")
    said = autotune(*argv)
    assert said.returncode == 0 and "your pin: your micro-batch 4 x 1 forces rank 32 -> 8" in " ".join(
        said.stdout.split())
    refused = autotune(*argv, "--strict")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "--strict: your micro-batch 4 x 1 forces" in refused.stderr
