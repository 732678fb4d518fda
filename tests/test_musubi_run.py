"""``autotune run --engine musubi-tuner=PATH`` against a stand-in musubi-tuner (tests/fixtures/fake_musubi_tuner, a
FAKE with musubi's command lines, output and state folders; see its fake.py): caching, then training under the
watchdog through an OOM mid-run, a SIGKILL and a stall, each resumed although musubi restarts its step count at 0;
the final LoRA holds exactly the target's updates and the learning-rate schedule of an uninterrupted run. What cannot
exist here is musubi-tuner's real model (tens of GB of weights) and a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image
from safetensors import safe_open

from autotune.layout import DECISIONS_JSONL
from autotune.recovery.external import remaining_divisor
from autotune.recovery.musubi import true_step
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import OOM_POLICY, Limits, rungs

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fixtures" / "fake_musubi_tuner"
sys.path.insert(0, str(ROOT / "tests"))


def _inputs(tmp_path: Path) -> tuple[Path, list[str]]:
    from test_musubi_detect import write_dit

    data = tmp_path / "data" / "1_thing"
    data.mkdir(parents=True)
    for i in range(4):
        Image.new("RGB", (64, 64), (40 * i, 0, 0)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text("a photo of a thing")
    (tmp_path / "vae.safetensors").write_bytes(b"vae")
    (tmp_path / "te.safetensors").write_bytes(b"text encoder")
    dit = write_dit(tmp_path / "qwen_image_bf16.safetensors", "qwen-image")
    return data.parent, ["--model", str(dit), "--vae", str(tmp_path / "vae.safetensors"), "--text_encoder",
                         str(tmp_path / "te.safetensors"), "--vram", "24"]


def _run(tmp_path: Path, argv: list[str], rules: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAKE_MUSUBI": rules, "FAKE_MUSUBI_MARKS": str(tmp_path / "marks")}
    return subprocess.run([sys.executable, "-m", "autotune", "run", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _expected_lrs(config: Path, steps: int) -> list[float]:
    """The fake's (musubi's) schedule at every step of an uninterrupted run of ``steps``."""
    import toml

    values = toml.load(config)
    base, warmup = float(values["learning_rate"]), int(values.get("lr_warmup_steps") or 0)
    out = []
    for step in range(steps):
        if step < warmup:
            out.append(base * (step + 1) / warmup)
        elif values.get("lr_scheduler", "constant") == "constant":
            out.append(base)
        else:
            out.append(base * max(0.0, 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))))
    return out


@pytest.mark.slow
def test_oom_sigkill_and_stall_each_resume_and_the_lora_ends_at_the_target(tmp_path: Path) -> None:
    data, model = _inputs(tmp_path)
    out = tmp_path / "run"
    done = _run(tmp_path, [str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--batch", "1", "--accum", "1",
                           "--epochs", "6", "--out", str(out), "--stall-timeout", "4", "--max-retries", "8",
                           "--save-state-every", "0.2"],
                rules="oom_at=5,kill_at=11,stall_at=17,step_s=0.05")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (final,) = [p for p in out.glob("*.safetensors") if "-from" not in p.name]
    with safe_open(str(final), framework="pt") as handle:
        metadata = handle.metadata()
    target = json.loads((out / "state" / "musubi.json").read_text())["target_steps"]
    assert target == 24
    assert metadata["ss_steps"] == "24" and metadata["fake_updates"] == "24"  # true steps, not musubi's own count
    lrs = json.loads(metadata["fake_lrs"])
    assert lrs == pytest.approx(_expected_lrs(out / "config.toml", 24))  # the schedule of one uninterrupted run
    decisions = [json.loads(line) for line in (out / DECISIONS_JSONL).read_text().splitlines()]
    events = [d["event"] for d in decisions]
    assert {"oom", "os_kill", "stall"} <= set(events), events
    resumes = [d for d in decisions if d["event"] == "resume"]
    assert len(resumes) == 3 and len({d["step"] for d in resumes}) == 3  # each from a later state than the last
    assert all("blocks_to_swap" in d["text"] for d in decisions if d["event"] in ("oom", "os_kill"))  # swap more
    commands = [d["argv"] for d in decisions if d["event"] == "musubi_command"]
    assert all("--max_train_steps" in c and c[c.index("--max_train_steps") + 1] == "24" for c in commands[1:])
    assert any(d["event"] == "musubi_stop" for d in decisions)


def test_resumed_saves_fall_on_the_target_and_state_names_carry_the_true_step() -> None:
    assert remaining_divisor(13, 5) == 1 and remaining_divisor(12, 5) == 4 and remaining_divisor(3, 10) == 3
    assert true_step("lora-from00000040-step00000010-state") == 50
    assert true_step("lora-step00000010-state") is None


def test_clips_get_shorter_after_resolution_and_before_rank() -> None:
    clip = TrainSettings(resolution=(480, 480), frames=33, network_dim=16, blocks_to_swap=39)
    moves = {name: [c.settings for c in candidates] for name, _, candidates in rungs(clip, OOM_POLICY, Limits())}
    assert [s.frames for s in moves["frames"]] == [29, 25, 21, 17, 13, 9, 5]
    order = list(OOM_POLICY.rungs)
    assert order.index("resolution") < order.index("frames") < order.index("rank_min")
    assert moves["frames"] and not rungs(TrainSettings(), OOM_POLICY, Limits())[order.index("frames")][2]


@pytest.mark.long
def test_refusals_are_one_line(tmp_path: Path) -> None:
    data, model = _inputs(tmp_path)
    cases = [
        ([str(data), *model, "--engine", f"musubi-tuner={tmp_path}"], "not a musubi-tuner checkout"),
        ([str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--config", str(tmp_path / "c.toml")], "--config"),
        ([str(data), "--model", "builtin:qwen-image", "--engine", f"musubi-tuner={FAKE}"], "DiT file"),
        ([str(data), "--model", "builtin:tiny-sd15", "--engine", f"musubi-tuner={FAKE}"], "not trained by musubi"),
        ([str(data), *model], "--engine musubi-tuner=PATH"),
    ]
    for argv, said in cases:
        done = _run(tmp_path, [*argv, "--out", str(tmp_path / "never")], timeout=120)
        assert done.returncode != 0 and said in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_an_ended_run_continues_with_resume_at_its_true_step(tmp_path: Path) -> None:
    """A run that gave up (a stall, no retries left) continues with ``autotune run --resume``: from its newest whole
    state, to the target, with the schedule of an uninterrupted run; the report reads its end."""
    data, model = _inputs(tmp_path)
    out = tmp_path / "run"
    argv = [str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--batch", "1", "--accum", "1", "--epochs", "6",
            "--out", str(out), "--stall-timeout", "3", "--save-state-every", "0.2"]
    first = _run(tmp_path, [*argv, "--max-retries", "0"], rules="stall_at=13,step_s=0.05")
    assert first.returncode == 1 and "giving up" in first.stderr, first.stderr[-2000:]
    again = _run(tmp_path, [*argv, "--resume"], rules="step_s=0.05")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = [json.loads(line) for line in (out / DECISIONS_JSONL).read_text().splitlines()
               if json.loads(line)["event"] == "resume"]
    assert len(resumed) == 1 and 0 < resumed[0]["step"] <= 12
    (final,) = [p for p in out.glob("*.safetensors") if "-from" not in p.name]
    with safe_open(str(final), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["ss_steps"] == metadata["fake_updates"] == "24"
    assert json.loads(metadata["fake_lrs"]) == pytest.approx(_expected_lrs(out / "config.toml", 24))
    report = subprocess.run([sys.executable, "-m", "autotune", "report", str(out), "--json"], capture_output=True,
                            text=True, timeout=120, check=True)
    assert json.loads(report.stdout)["outcome"] == "done"


@pytest.mark.long
def test_measured_headroom_steps_musubi_up_from_its_next_saved_state(tmp_path: Path) -> None:
    """musubi-tuner saves no state when stopped: a step up waits for its next whole state, stops it there and
    relaunches from it with the next rung up (here checkpointing off: the CPU speed model's first paying move),
    ending at the target with the updates and the learning-rate schedule of an uninterrupted run; --no-step-up keeps
    the plan's settings. The budget is pinned (1 TiB of address space, the peak sampled from /proc)."""
    data, model = _inputs(tmp_path)
    # 60 steps of 0.1 s: the decision comes a few steps in, leaving ~5 s for a busy machine's supervisor
    argv = [str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--epochs", "60", "--save-state-every", "0.3",
            "--memory-limit", str(2**20)]
    out = tmp_path / "run"
    done = _run(tmp_path, [*argv, "--out", str(out)], rules="step_s=0.1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    decisions = [json.loads(line) for line in (out / DECISIONS_JSONL).read_text().splitlines()]
    ups = [d for d in decisions if d["event"] == "step_up"]
    assert ups and "stopped musubi-tuner after its state at step" in ups[0]["text"]
    assert "measured peak" in ups[0]["text"]
    resumes = [d for d in decisions if d["event"] == "resume"]
    assert len(resumes) == len(ups)
    (final,) = [p for p in out.glob("*.safetensors") if "-from" not in p.name]
    with safe_open(str(final), framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["ss_steps"] == metadata["fake_updates"] == "60"
    assert json.loads(metadata["fake_lrs"]) == pytest.approx(_expected_lrs(out / "config.toml", 60))
    kept = tmp_path / "kept"
    done = _run(tmp_path, [*argv, "--out", str(kept), "--no-step-up"], rules="step_s=0.05")
    assert done.returncode == 0 and "step_up" not in (kept / DECISIONS_JSONL).read_text()


def test_a_stepped_down_attempt_writes_musubi_keys_only(tmp_path: Path) -> None:
    """The ladder's settings become musubi's files: swap and rank in the config (musubi's names, none it lacks),
    resolution and frames in every [[datasets]], the plan's relative folders made absolute, epoch keys dropped."""
    import toml

    from autotune.planning.planner import PlanRequest, gpu_from_vram, plan_training
    from autotune.planning.toml_writer import write_plan_files
    from autotune.recovery.musubi import write_attempt_files

    plan = plan_training(PlanRequest(dataset_dir=None, model="builtin:wan2.1-t2v-1.3b", gpus=(gpu_from_vram(16),),
                                     cpu_physical_cores=8))
    write_plan_files(plan, tmp_path)
    base = replace(plan.settings, frames=33)
    lower = replace(base, blocks_to_swap=base.blocks_to_swap + 4, resolution=(512, 512), frames=17, network_dim=8,
                    train_batch_size=1)
    config, dataset = write_attempt_files(tmp_path / "config.toml", tmp_path / "dataset.toml", lower, base,
                                          tmp_path / "state", 3, ("max_train_epochs",), "wan_train_network.py")
    values, data = toml.load(config), toml.load(dataset)
    assert values["blocks_to_swap"] == lower.blocks_to_swap and values["network_dim"] == 8
    assert "resolution" not in values and "train_batch_size" not in values and "max_train_epochs" not in values
    assert values["dataset_config"] == str(dataset)
    for entry in data["datasets"]:
        assert entry["resolution"] == [512, 512] and entry["target_frames"] == [17]
        assert Path(entry["cache_directory"]).is_absolute()
    # a step up to no swapped blocks removes the key rather than leave the job's count (musubi writes it only when
    # blocks are swapped)
    swapped = replace(base, blocks_to_swap=2)
    (tmp_path / "swapped.toml").write_text(toml.dumps({**toml.load(tmp_path / "config.toml"), "blocks_to_swap": 2}))
    config, _ = write_attempt_files(tmp_path / "swapped.toml", tmp_path / "dataset.toml",
                                    replace(swapped, blocks_to_swap=0), swapped, tmp_path / "state", 4, (),
                                    "wan_train_network.py")
    assert "blocks_to_swap" not in toml.load(config)


def test_resuming_another_engines_run_with_musubi_is_one_line(tmp_path: Path) -> None:
    data, model = _inputs(tmp_path)
    out = tmp_path / "run"
    (out / "state").mkdir(parents=True)
    (out / "state" / "autotune_run.json").write_text(json.dumps({"settings": {}, "retries": []}))
    (out / "config.toml").write_text("network_dim = 4\n")
    done = _run(tmp_path, [str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--out", str(out), "--resume"])
    assert done.returncode != 0 and "not a musubi-tuner run" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_without_the_save_log_line_states_and_the_stop_still_follow_the_steps(tmp_path: Path) -> None:
    """A musubi whose log hides "saving state at step N": a folder counts as whole once a later step shows, and the
    resumed attempt still ends with the LoRA saved at the target step (one step past it at most, then stopped)."""
    data, model = _inputs(tmp_path)
    out = tmp_path / "run"
    done = _run(tmp_path, [str(data), *model, "--engine", f"musubi-tuner={FAKE}", "--batch", "1", "--accum", "1",
                           "--epochs", "6", "--out", str(out), "--save-state-every", "0.2"],
                rules="kill_at=9,quiet_saves,step_s=0.05")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (final,) = [p for p in out.glob("*.safetensors") if "-from" not in p.name]
    with safe_open(str(final), framework="pt") as handle:
        assert handle.metadata()["ss_steps"] == handle.metadata()["fake_updates"] == "24"


def _musubi_hashes(tensors: dict, metadata: dict[str, str]) -> tuple[str, str]:
    """musubi-tuner's precalculate_safetensors_hashes, written out here from its model_utils (30c658c): the sha256
    of the tensor data, and of the 64 KiB at 1 MiB, of a buffer holding the tensors and the ss_* keys only."""
    import hashlib

    from safetensors.torch import save

    buffer = save(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header = int.from_bytes(buffer[:8], "little")
    return (hashlib.sha256(buffer[8 + header:]).hexdigest(),
            hashlib.sha256(buffer[0x100000:0x110000]).hexdigest()[:8])


def test_a_resumed_attempts_lora_is_relabelled_as_one_run_would_have_written_it(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from autotune.recovery.musubi import relabel_steps

    tensors = {"lora_unet_x.lora_down.weight": torch.arange(600 * 600, dtype=torch.float32).reshape(600, 600)}
    written = {"ss_steps": "12", "ss_output_name": "lora-from00000012", "modelspec.title": "lora-from00000012",
               "ss_network_dim": "4"}
    written["sshs_model_hash"], written["sshs_legacy_hash"] = _musubi_hashes(tensors, written)
    source = tmp_path / "lora-from00000012-step00000012.safetensors"
    save_file(tensors, str(source), metadata=written)
    relabel_steps(source, tmp_path / "lora.safetensors", 24)
    with safe_open(str(tmp_path / "lora.safetensors"), framework="pt") as handle:
        metadata = handle.metadata()
        assert torch.equal(handle.get_tensor("lora_unet_x.lora_down.weight"), tensors["lora_unet_x.lora_down.weight"])
    assert (metadata["ss_steps"], metadata["ss_output_name"], metadata["modelspec.title"]) == ("24", "lora", "lora")
    assert (metadata["sshs_model_hash"], metadata["sshs_legacy_hash"]) == _musubi_hashes(tensors, metadata)
    assert metadata["sshs_legacy_hash"] != written["sshs_legacy_hash"]  # the ss_* keys changed, so did that hash
    written["modelspec.title"] = "my title"  # a title the user gave (metadata_title) stays
    save_file(tensors, str(source), metadata=written)
    relabel_steps(source, tmp_path / "lora.safetensors", 24)
    with safe_open(str(tmp_path / "lora.safetensors"), framework="pt") as handle:
        assert handle.metadata()["modelspec.title"] == "my title"
