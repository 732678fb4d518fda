"""``autotune wizard``: the real questionary prompts driven through prompt_toolkit's pipe input, the real
command in a pseudo-terminal (pexpect), and the override logic on its own.

Files the wizard writes are parsed back (toml, and the engine's own reader). Only the NVIDIA driver is
faked, in the tests named ``fake_nvml``: a saved probe with two GPUs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import toml

from autotune.cli import build_parser
from autotune.planning.planner import (
    GIB,
    GOAL_PROFILES,
    PlanRequest,
    gpu_from_spec,
    learning_rate,
    plan_training,
    scan_dataset,
)
from autotune.wizard import organise
from autotune.wizard.overrides import Overrides, evaluate, settings_from_values
from sd_scripts_compat.config.resolved_run import settings_from_files
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "dataset"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120", "LINES": "50"}
DOWN, ENTER, CLEAR, CTRL_C = "\x1b[B", "\r", "\x15", "\x03"  # arrow down, return, Ctrl-U (clear line), Ctrl-C


# ------------------------------------------------------------------------------------------ helpers


def card(name: str):
    from autotune.hardware.gpu_catalog import lookup_gpu

    return gpu_from_spec(lookup_gpu(name))


def request_for(model: str, gpu: str | None, dataset: Path = EXAMPLES) -> PlanRequest:
    return PlanRequest(dataset_dir=str(dataset), model=model, gpus=(card(gpu),) if gpu else (),
                       dataset=scan_dataset(dataset), cpu_physical_cores=2, cpu_memory_bytes=16 * GIB)


def drive(argv: list[str], keys: str) -> tuple[int, str]:
    """Run the wizard in this process with ``keys`` typed at its questionary prompts; returns the exit code
    and what it printed. The pipe is closed after the keys, so a prompt left unanswered fails (EOFError)
    instead of waiting."""
    from prompt_toolkit.application import create_app_session
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput
    from rich.console import Console

    from autotune.wizard.flow import run_wizard

    args = build_parser("wizard").parse_args(["wizard", *argv])
    shown = io.StringIO()
    console = Console(file=shown, width=120, color_system=None, force_terminal=False)
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        pipe.send_text(keys)
        pipe.close()
        try:
            code = run_wizard(args, console=console)
        finally:
            print(shown.getvalue())  # in the test log when an assert fails
    return code, shown.getvalue()


def make_flat_folder(folder: Path, count: int = 3, captions: int = 2) -> list[str]:
    from PIL import Image

    folder.mkdir(parents=True)
    for i in range(count):
        Image.new("RGB", (64, 48), (40 * i, 90, 200)).save(folder / f"img_{i}.png")
        if i < captions:
            (folder / f"img_{i}.txt").write_text(f"a photo number {i}", encoding="utf-8")
    return sorted(p.name for p in folder.iterdir())


def wizard_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autotune", "wizard", *args], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=cwd, stdin=subprocess.DEVNULL, check=False)


# ------------------------------------------------------------------------------------------ overrides


@pytest.mark.parametrize("model,gpu", [("builtin:sd15", "RTX 3060"), ("builtin:sdxl", "RTX 4090"),
                                       ("builtin:tiny-sd15", None)])
def test_no_override_predicts_what_the_planner_predicted(model, gpu):
    request = request_for(model, gpu)
    base = plan_training(request)
    result = evaluate(request, base, Overrides())
    assert result.plan is base and result.fits
    p = base.prediction
    assert (result.fit.peak_bytes, result.fit.required_bytes, result.fit.optimizer_steps) == \
        (p.peak_bytes, p.required_bytes, p.optimizer_steps)
    assert result.fit.it_per_s == pytest.approx(p.it_per_s)
    assert result.fit.total_seconds == pytest.approx(p.total_seconds)


def test_batch_override_that_does_not_fit_is_flagged_with_what_would():
    request = request_for("builtin:sd15", "RTX 3060")
    base = plan_training(request)
    result = evaluate(request, base, Overrides(train_batch_size=16))
    assert not result.fits and result.fit.required_bytes > result.fit.usable_bytes
    labels = [s.label for s in result.suggestions]
    assert labels and labels[0] == "gradient checkpointing on"
    for suggestion in result.suggestions:  # every suggestion really fits once applied
        applied = evaluate(request, base, suggestion.overrides)
        assert applied.fits and applied.fit.peak_bytes == suggestion.fit.peak_bytes


def test_batch_override_sets_everything_that_follows_and_the_engine_reads_it_back(tmp_path):
    from autotune.planning.toml_writer import write_plan_files

    request = dataclasses.replace(request_for("builtin:sd15", "RTX 4090"), output_dir=str(tmp_path))
    base = plan_training(request)
    result = evaluate(request, base, Overrides(train_batch_size=2, gradient_accumulation_steps=4))
    assert result.fits
    values = result.plan.kohya_values()
    steps = result.fit.optimizer_steps
    assert (values["train_batch_size"], values["gradient_accumulation_steps"]) == (2, 4)
    assert values["unet_lr"] == learning_rate(GOAL_PROFILES["character"], 8)
    assert values["lr_warmup_steps"] == round(0.05 * steps)
    assert steps == values["max_train_epochs"] * -(-120 // 8)  # 120 image-views per epoch, effective batch 8
    assert result.plan.prediction.optimizer_steps == steps
    config, dataset = write_plan_files(result.plan, tmp_path, "kohya")
    assert toml.loads(dataset.read_text())["datasets"][0]["batch_size"] == 2  # dataset.toml's batch wins in kohya
    resolved = settings_from_files(config, dataset, sdxl=False)
    assert resolved.settings.train_batch_size == 2 and resolved.settings.gradient_accumulation_steps == 4


def test_rank_the_planner_cannot_keep_suggests_the_planners_fit():
    request = request_for("builtin:sdxl", "RTX 3060")
    base = plan_training(request)
    result = evaluate(request, base, Overrides(network_dim=512))
    assert not result.fits and result.settings.network_dim == 512
    first = result.suggestions[0]
    assert first.label.startswith("the planner's fit") and first.overrides.network_dim == 128
    assert evaluate(request, base, first.overrides).fits


def test_precision_override_changes_config_and_launch_command():
    request = request_for("builtin:sd15", "RTX 3060")
    base = plan_training(request)
    assert base.kohya_values()["mixed_precision"] == "bf16"
    result = evaluate(request, base, Overrides(mixed_precision="fp16"))
    assert result.fits and result.plan.kohya_values()["mixed_precision"] == "fp16"
    words = list(result.plan.launch_command)
    assert words[words.index("--mixed_precision") + 1] == "fp16"
    old_card = evaluate(request_for("builtin:sd15", "RTX 2080 Ti"), plan_training(request_for("builtin:sd15",
                                                                                             "RTX 2080 Ti")),
                        Overrides(mixed_precision="bf16"))
    assert any("bf16 needs compute capability 8.0" in note for note in old_card.notes)


def test_settings_from_values_reads_a_plan():
    values = plan_training(request_for("builtin:sdxl", "RTX 3060")).kohya_values()
    settings = settings_from_values(values)
    assert settings.resolution == (1024, 1024) and settings.network_train_unet_only
    assert settings.cache_text_encoder_outputs == bool(values.get("cache_text_encoder_outputs"))


# ------------------------------------------------------------------------------------------ organise


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_flat_folder_becomes_n_name_without_moving_anything(tmp_path, mode):
    flat = tmp_path / "photos"
    before = make_flat_folder(flat)
    layout = organise.plan_layout(flat, organise.default_target(flat), repeats=5, trigger="my char", mode=mode)
    assert not layout.target.exists()  # planned, not written
    summary = layout.summary(scan_dataset(flat))
    subset = organise.create(layout)
    assert subset == tmp_path / "photos-kohya" / "5_my char"
    assert sorted(p.name for p in flat.iterdir()) == before  # the originals stay
    made = sorted(subset.iterdir())
    assert [p.name for p in made] == before
    assert all(p.is_symlink() == (mode == "link") for p in made)
    assert (subset / "img_0.txt").read_text() == "a photo number 0"
    scanned = scan_dataset(layout.target)  # the folder made is what the plan was told it would be
    assert scanned.subsets[0].num_repeats == summary.subsets[0].num_repeats == 5
    assert scanned.subsets[0].class_tokens == summary.subsets[0].class_tokens == "my char"
    assert scanned.num_images == summary.num_images == 3
    assert not list(tmp_path.glob(".photos-kohya.partial-*"))


def test_organise_refuses_an_existing_folder(tmp_path):
    flat = tmp_path / "photos"
    make_flat_folder(flat)
    (tmp_path / "taken").mkdir()
    assert "exists already" in organise.target_problem(str(tmp_path / "taken"))
    with pytest.raises(UserError, match="exists already"):
        organise.plan_layout(flat, tmp_path / "taken", 10, "x", "copy")


# ------------------------------------------------------------------------------------------ pipe input


def test_pipe_every_prompt_answered_files_parse_back(tmp_path):
    from autotune.wizard.steps import dataset_problem, model_problem

    out = tmp_path / "out"
    keys = (DOWN + ENTER  # base model: builtin:tiny-sd15 (second option)
            + "/no/such/folder" + ENTER  # rejected under the prompt ...
            + CLEAR + str(EXAMPLES) + ENTER  # ... then the real folder
            + DOWN + ENTER  # goal: style
            + DOWN + ENTER  # priority: quality (one below the default, balanced)
            + CLEAR + "shapes" + ENTER  # output name
            + CLEAR + str(out) + ENTER  # output folder
            + DOWN + ENTER  # layout: lora-scripts
            + ENTER  # plan: accept
            + "n")  # start training now? no
    code, shown = drive(["--cpu"], keys)
    assert code == 0
    assert dataset_problem("/no/such/folder") == "/no/such/folder is not a folder"
    assert "not found" in model_problem("/no/such/model.safetensors")
    config = toml.loads((out / "config.toml").read_text())
    assert config["model_arguments"]["pretrained_model_name_or_path"] == "builtin:tiny-sd15"
    assert config["saving_arguments"]["output_name"] == "shapes"
    assert config["additional_network_arguments"]["network_dim"] == GOAL_PROFILES["style"].rank
    assert config["optimizer_arguments"]["optimizer_type"] == "AdamW"  # priority quality
    dataset = toml.loads((out / "dataset.toml").read_text())
    assert sorted(Path(s["image_dir"]).name for s in dataset["datasets"][0]["subsets"]) == \
        ["10_circle shape", "10_square shape", "10_triangle shape"]
    resolved = settings_from_files(out / "config.toml", out / "dataset.toml", sdxl=False)
    assert resolved.settings.network_dim == GOAL_PROFILES["style"].rank
    for text in ("Model family tiny-sd15", "10_circle shape", "120 image-views per epoch", "Plan: tiny-sd15 on CPU",
                 "peak", "it/s", "./scripts/stable/train_network.py", "autotune run"):
        assert text in shown


def test_pipe_override_that_no_longer_fits_is_flagged_then_fixed(tmp_path):
    out = tmp_path / "out"
    keys = (CLEAR + str(EXAMPLES) + ENTER + ENTER + ENTER + ENTER + CLEAR + str(out) + ENTER + ENTER
            + DOWN + ENTER  # plan: change a value
            + ENTER  # which: micro-batch
            + CLEAR + "16" + ENTER  # 16 does not fit a 12 GB card at 512 px without checkpointing
            + ENTER  # next: the first suggestion (its default)
            + ENTER)  # accept
    code, shown = drive(["--gpu", "RTX 3060", "--model", "builtin:sd15"], keys)
    assert code == 0
    assert "✗ does not fit" in shown and "would fit: gradient checkpointing on" in shown
    config = toml.loads((out / "config.toml").read_text())
    assert config["train_batch_size"] == 16 and config["gradient_checkpointing"] is True
    assert toml.loads((out / "dataset.toml").read_text())["datasets"][0]["batch_size"] == 16
    assert "configs are for another machine" in shown and "Start training now" not in shown


def test_pipe_flat_folder_turned_into_n_name(tmp_path):
    flat, out = tmp_path / "my photos", tmp_path / "out"
    before = make_flat_folder(flat)
    keys = (DOWN + ENTER + CLEAR + str(flat) + ENTER
            + ENTER  # make the N_name structure? yes
            + CLEAR + "5" + ENTER  # repeats
            + CLEAR + "zkchar" + ENTER  # trigger
            + DOWN + ENTER  # copy
            + ENTER  # new folder: the default, next to the flat one
            + ENTER + ENTER + ENTER + CLEAR + str(out) + ENTER + ENTER + ENTER + "n")
    code, shown = drive(["--cpu"], keys)
    assert code == 0
    subset = tmp_path / "my photos-kohya" / "5_zkchar"
    assert sorted(p.name for p in subset.iterdir()) == before and not any(p.is_symlink() for p in subset.iterdir())
    assert sorted(p.name for p in flat.iterdir()) == before
    (entry,) = toml.loads((out / "dataset.toml").read_text())["datasets"][0]["subsets"]
    assert entry == {"image_dir": str(subset), "num_repeats": 5, "class_tokens": "zkchar"}
    assert "The images sit directly in" in shown and "Will copy 5 files" in shown


def test_pipe_ctrl_c_at_the_plan_writes_nothing(tmp_path):
    flat, out = tmp_path / "flat", tmp_path / "out"
    make_flat_folder(flat)
    keys = (DOWN + ENTER + CLEAR + str(flat) + ENTER + ENTER + ENTER + ENTER + ENTER + ENTER
            + ENTER + ENTER + CLEAR + str(out) + ENTER + ENTER + CTRL_C)
    with pytest.raises(KeyboardInterrupt):
        drive(["--cpu"], keys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flat"]  # no out/, no flat-kohya/


def test_pipe_every_question_has_a_flag(tmp_path):
    flat, out = tmp_path / "flat", tmp_path / "out"
    make_flat_folder(flat)
    code, shown = drive([str(flat), "--cpu", "--model", "builtin:tiny-sd15", "--organise", "copy", "--repeats", "3",
                         "--trigger", "tk", "--organise-into", str(tmp_path / "kohya"), "--goal", "concept",
                         "--priority", "speed", "--output-name", "flagged", "--out", str(out), "--format", "kohya",
                         "--rank", "8", "--epochs", "2", "--batch-size", "2", "--no-gradient-checkpointing",
                         "--accept", "--no-start"], keys="")  # no keys: any question asked would fail (EOF)
    assert code == 0
    config = toml.loads((out / "config.toml").read_text())
    assert (config["network_dim"], config["max_train_epochs"], config["train_batch_size"]) == (8, 2, 2)
    assert config["output_name"] == "flagged" and config["gradient_checkpointing"] is False
    assert (tmp_path / "kohya" / "3_tk" / "img_0.png").is_file()
    assert "(from --goal)" in shown and "Plan accepted (--accept)" in shown and "* your value" in shown


def test_the_wizard_takes_plan_and_runs_flag_names_and_every_optimizer(tmp_path):
    """`--batch` / `--accum` as `autotune plan` and `run` spell them (the old `--batch-size` / `--grad-accum` still
    work), and `--optimizer` takes every optimizer they do, not three."""
    out = tmp_path / "out"
    code, _ = drive([str(EXAMPLES), "--cpu", "--model", "builtin:tiny-sd15", "--out", str(out), "--batch", "2",
                     "--accum", "3", "--optimizer", "lion", "--accept", "--no-start", "--yes"], keys="")
    assert code == 0
    config = toml.loads((out / "config.toml").read_text())
    assert (config["train_batch_size"], config["gradient_accumulation_steps"], config["optimizer_type"]) == (2, 3,
                                                                                                              "Lion")


def test_pipe_fake_nvml_two_gpus_pick_which(tmp_path):
    from autotune.hardware.probe import GpuInfo, probe_system

    probe = probe_system(tmp_path, use_torch=False)
    fake = [GpuInfo(index=i, backend="cuda", vendor="nvidia", name=name, vram_total_bytes=size * GIB,
                    vram_free_bytes=size * GIB, vram_used_bytes=0, compute_capability=cc, bf16=True, fp8=fp8)
            for i, (name, size, cc, fp8) in enumerate([("NVIDIA GeForce RTX 3060", 12, "8.6", False),
                                                        ("NVIDIA GeForce RTX 4090", 24, "8.9", True)])]
    saved = tmp_path / "probe.json"
    saved.write_text(dataclasses.replace(probe, gpus=fake, accelerator="cuda", cuda_gpu_found=True).to_json())
    out = tmp_path / "out"
    keys = (ENTER  # which GPU: the default is the one with the most free memory (the 4090)
            + CLEAR + str(EXAMPLES) + ENTER + ENTER + ENTER + ENTER + CLEAR + str(out) + ENTER + ENTER + ENTER)
    code, shown = drive(["--probe", str(saved), "--model", "builtin:sdxl"], keys)
    assert code == 0
    assert "GPU 0  NVIDIA GeForce RTX 3060: 12.0 GiB free of 12.0 GiB; bf16 yes, fp8 no" in shown
    assert "Plan: sdxl on NVIDIA GeForce RTX 4090" in shown
    assert "NVIDIA GeForce RTX 4090" in (out / "config.toml").read_text()


# ------------------------------------------------------------------------------------------ the command


def test_no_terminal_says_use_plan_and_exits_2(tmp_path):
    done = wizard_cli(str(EXAMPLES), "--model", "builtin:tiny-sd15", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("autotune wizard: error: no terminal") and "autotune plan" in line and "--yes" in line
    assert list(tmp_path.iterdir()) == []


def test_yes_takes_every_default(tmp_path):
    done = wizard_cli(str(EXAMPLES), "--model", "builtin:tiny-sd15", "--cpu", "--yes", "--no-start", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "(default, --yes)" in done.stdout and "Plan accepted (--yes)" in done.stdout
    out = tmp_path / "output" / "dataset-tiny-sd15"
    config = toml.loads((out / "config.toml").read_text())
    assert config["output_dir"] == str(out) and config["dataset_config"] == str(out / "dataset.toml")
    assert config["logging_dir"] == str(out / "logs")
    assert settings_from_files(out / "config.toml", out / "dataset.toml", sdxl=False).settings.network_dim == 32


@pytest.mark.parametrize("native", [True, False])
def test_cpu_plans_follow_the_probed_cpus_bf16_as_autotune_plan_does(tmp_path, native):
    """A saved probe (this machine's, its CPU's bf16 flag set either way): the wizard's CPU plan trains in bf16
    where the CPU computes it natively, in fp32 elsewhere."""
    from autotune.hardware.probe import probe_system

    probe = probe_system(tmp_path, use_torch=False)
    saved = tmp_path / "probe.json"
    saved.write_text(dataclasses.replace(probe, cpu=dataclasses.replace(probe.cpu, bf16_native=native)).to_json())
    out = tmp_path / "out"
    done = wizard_cli(str(EXAMPLES), "--model", "builtin:tiny-sd15", "--probe", str(saved), "--cpu", "--yes",
                      "--no-start", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert toml.loads((out / "config.toml").read_text())["mixed_precision"] == ("bf16" if native else "no")
    screen = " ".join(done.stdout.replace("│", " ").split())  # bf16 here said one way (it said ~1.8x and slower)
    said, never = ("2.62x the fp32 FLOP rate", "slower than fp32") if native else ("3.6x slower than fp32", "FLOP rate")
    assert said in screen and never not in screen, screen[-3000:]


def test_yes_with_a_value_that_does_not_fit_is_one_line_and_writes_nothing(tmp_path):
    done = wizard_cli(str(EXAMPLES), "--model", "builtin:sdxl", "--gpu", "RTX 3060", "--rank", "512", "--yes",
                      "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "rank 512: does not fit" in line and "would fit: the planner's fit: rank 256" in line
    assert not (tmp_path / "out").exists()


def test_yes_needs_model_and_dataset(tmp_path):
    done = wizard_cli("--yes", "--cpu", cwd=tmp_path)
    assert done.returncode == 2 and "--model" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    done = wizard_cli("--yes", "--cpu", "--model", "builtin:tiny-sd15", cwd=tmp_path)
    assert done.returncode == 2 and "DATASET" in done.stderr


@pytest.mark.slow
def test_pickle_checkpoint_is_asked_about_before_loading(tmp_path):
    import torch

    from sd_scripts_compat.models.checkpoint import SD1_TE_PREFIX, UNET_PREFIX

    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": {UNET_PREFIX + "x": torch.zeros(1), SD1_TE_PREFIX + "y": torch.zeros(1)}}, ckpt)
    refused = wizard_cli(str(EXAMPLES), "--model", str(ckpt), "--cpu", "--yes", "--no-start", cwd=tmp_path)
    assert refused.returncode == 2 and "--allow-pickle" in refused.stderr
    assert not (tmp_path / "output").exists()
    done = wizard_cli(str(EXAMPLES), "--model", str(ckpt), "--cpu", "--yes", "--no-start", "--allow-pickle",
                      "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Model family sd15" in done.stdout
    config = toml.loads((tmp_path / "out" / "config.toml").read_text())
    assert config["allow_pickle"] is True and config["pretrained_model_name_or_path"] == str(ckpt)


# ------------------------------------------------------------------------------------------ pseudo-terminal


def spawn(args: list[str], cwd: Path):
    import pexpect

    return pexpect.spawn(sys.executable, ["-m", "autotune", "wizard", *args], env=ENV, cwd=str(cwd),
                         dimensions=(50, 120), encoding="utf-8", timeout=120)


def test_pty_ctrl_c_exits_130_and_writes_nothing(tmp_path):
    import pexpect

    child = spawn(["--cpu"], tmp_path)
    child.expect("Base model")
    child.send(DOWN + ENTER)
    child.expect("Dataset folder")
    child.send(CTRL_C)
    child.expect("interrupted")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_pty_whole_flow_ends_in_a_finished_training(tmp_path):
    import pexpect

    data = tmp_path / "dataset"
    shutil.copytree(EXAMPLES, data)  # training caches latents next to the images
    out = tmp_path / "out"
    child = spawn(["--cpu"], tmp_path)
    child.expect("Base model")
    child.send(DOWN + ENTER)
    child.expect("Dataset folder")
    child.send("/no/such/folder" + ENTER)
    child.expect("is not a folder")  # shown under the prompt; the prompt stays
    child.send(CLEAR + str(data) + ENTER)
    child.expect("120 image-views per epoch")
    for prompt in ("Goal", "Priority", "Output name"):
        child.expect(prompt)
        child.send(ENTER)
    child.expect("Output folder")
    child.send(CLEAR + str(out) + ENTER)
    child.expect("Config layout")
    child.send(ENTER)
    child.expect("Next")
    child.send(DOWN + ENTER)  # change a value
    child.expect("Which value")
    child.send(ENTER)  # micro-batch
    child.expect(r"micro-batch \(now \d+\)")  # the plan's own (4 on this CPU: the overhead is shared by a batch)
    child.send(CLEAR + "2" + ENTER)
    child.expect("your value: predicted peak")
    child.expect("Next")
    child.send(ENTER)  # accept
    child.expect("Start training now")
    child.send("y")
    child.expect("LoRA: ", timeout=600)
    child.expect(pexpect.EOF, timeout=60)
    child.close()
    assert child.exitstatus == 0
    config = toml.loads((out / "config.toml").read_text())
    assert config["train_batch_size"] == 2
    # one layout (autotune.layout): the LoRA beside the configs, states and logs in their folders, nothing else
    (lora,) = [p for p in out.glob("*.safetensors") if "-0" not in p.name]
    assert (out / "state" / "autotune_run.json").is_file() and (out / "logs" / "train.log").is_file()
    assert (out / "autotune_report.html").is_file() and not (out / "run").exists() and not (out / "output").exists()
    for command, target, said in (("report", out, "bottleneck: "), ("report", out / "logs" / "train.log", "bottleneck"),
                                  ("inspect", out, "tiny-sd15 ("), ("inspect", lora, "tiny-sd15 (")):
        shown = subprocess.run([sys.executable, "-m", "autotune", command, str(target)], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and said in shown.stdout, (command, target, shown.stderr[-2000:])


def test_doctor_errors_are_shown_and_no_training_is_offered(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(EXAMPLES, data)
    (data / "10_circle shape" / "circle_00.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    code, shown = drive([str(data), "--cpu", "--model", "builtin:tiny-sd15", "--out", str(out), "--yes"], keys="")
    assert code == 0
    assert "doctor:" in shown and "circle_00.png" in shown and "Not offering to train here" in shown
    assert (out / "config.toml").is_file() and not (out / "run").exists()


def test_the_wizard_predicts_from_this_machines_measured_runs_as_autotune_plan_does(tmp_path):
    """One learning store for plan, run and the wizard: a measured record of the plan's own settings on this CPU
    makes the wizard's speed line the measured one, and it says so."""
    from autotune.hardware.probe import probe_system
    from autotune.measure.store import device_key, from_done_event, record_measurements

    planned = subprocess.run([sys.executable, "-m", "autotune", "plan", str(EXAMPLES), "--model", "builtin:tiny-sd15",
                              "--json", "--no-learn"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    settings = json.loads(planned.stdout)["settings"]
    device = device_key(probe_system(tmp_path, use_torch=False), cpu=True)
    record = from_done_event({"settings": settings, "step_seconds": [0.5] * 8}, device=device,
                             family=get_family("tiny-sd15"),
                             source="bench")
    record_measurements([record])
    done = subprocess.run([sys.executable, "-m", "autotune", "wizard", str(EXAMPLES), "--model", "builtin:tiny-sd15",
                           "--cpu", "--yes", "--no-start"], capture_output=True, text=True, timeout=300,
                          env={**ENV, "AUTOTUNE_CACHE_DIR": os.environ["AUTOTUNE_CACHE_DIR"]}, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)  # this test's store, not the one ENV was copied with
    assert done.returncode == 0, done.stderr
    speed = next(line for line in done.stdout.splitlines() if line.strip().startswith("speed "))
    assert "predicted from:" in speed and "speed model" not in speed, speed
    assert f"{1 / (0.5 * settings['gradient_accumulation_steps']):.3g} it/s" in speed, speed


def test_a_musubi_family_on_this_machine_is_offered_the_supervised_musubi_run(tmp_path):
    """A Qwen-Image DiT file on this machine's card: after writing musubi's files the wizard offers
    ``autotune run ... --engine musubi-tuner=PATH`` (the run the CLI and the web app start), naming the model files
    to add. The offer itself, with a recording console (this machine has no GPU to be "this machine's")."""
    import argparse
    import io
    import sys

    from rich.console import Console

    from autotune.wizard import steps
    from autotune.wizard.ask import Asker
    from autotune.wizard.flow import offer_training

    sys.path.insert(0, str(REPO / "tests"))
    from test_musubi_detect import write_dit

    dit = write_dit(tmp_path / "qwen_image_bf16.safetensors", "qwen-image")
    screen = io.StringIO()
    asker = Asker(Console(file=screen, width=400), assume_yes=True)
    hardware = steps.Hardware(gpus=("RTX 4090",), cpu_cores=8, ram_bytes=None, summary="", local=True, cuda_index=0)
    data = steps.DatasetChoice(folder=EXAMPLES, summary=None)
    out = tmp_path / "out"
    output = steps.OutputChoice(goal="character", priority="balanced", name="x", folder=out, fmt="kohya")
    code = offer_training(asker, argparse.Namespace(start=False), hardware,
                          steps.ModelChoice(model=str(dit), family=get_family("qwen-image")), data, output,
                          out / "config.toml", out / "dataset.toml")
    shown = screen.getvalue()
    assert code == 0
    line = next(line for line in shown.splitlines() if "--engine musubi-tuner=PATH" in line)
    assert f"autotune run {EXAMPLES} --model {dit} --family qwen-image --out {out}" in line
    assert line.strip().startswith("CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 autotune run")
    assert "--vae FILE and --text_encoder FILE" in shown
