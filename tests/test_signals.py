"""Crash safety and signals on real tiny runs (builtin:tiny-sd15, 64 px, CPU): real SIGINT / SIGTERM / SIGKILL,
a real read-only bind mount and a real full tmpfs (both need root and mount; skipped where they cannot be made).

- three interruptions in a row (SIGINT to the process group, a DataLoader worker included; SIGTERM; SIGINT to
  a child that started with SIGINT ignored, as a background job does), each resumed: the final LoRA equals a
  straight run's bit for bit, with the right step and epoch counts (sd-scripts miscounts after several
  resumes: its issues 1999, 2171, 2248);
- a SIGKILL in the middle of writing the LoRA and in the middle of writing the state (the atomic-write test
  hook holds the write open): the previous file and state are whole and loadable, and the run resumes;
- `autotune run` stopped with SIGTERM forwards it, waits for the saved state, and resumes with --resume;
- a read-only dataset trains with its caches under the output folder; a full disk is one line, exit 28.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import toml
import torch
from fixtures.engine_runs import toy_dataset
from PIL import Image

from sd_scripts_compat.network.lora_file import read_lora_file
from sd_scripts_compat.training.train_state import load_train_state

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
STEPS = 40  # 2 optimizer steps per epoch: 20 epochs, so stops land in many epochs and mid-epoch


def make_dataset(root: Path, images: int = 4) -> Path:
    return toy_dataset(root, images=images, repeats=1)


def write_config(path: Path, data: Path, out: Path, **overrides: object) -> Path:
    values: dict[str, object] = {
        "pretrained_model_name_or_path": "builtin:tiny-sd15", "train_data_dir": str(data), "output_dir": str(out),
        "output_name": "lora", "resolution": "64,64", "caption_extension": ".txt", "train_batch_size": 2,
        "max_train_steps": STEPS, "network_dim": 4, "network_alpha": 4, "learning_rate": 1e-3, "seed": 5,
        "max_data_loader_n_workers": 0, "cache_latents": True, "shuffle_caption": True, "flip_aug": True,
        "network_dropout": 0.1, "save_state_on_train_end": True,
    }
    values.update(overrides)
    path.write_text(toml.dumps(values), encoding="utf-8")
    return path


def engine_command(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sd_scripts_compat.train_network", "--config_file", str(config), *extra]


def wait_for(condition, timeout: float = 300.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stopped_step(stderr: str) -> int:
    line = next(line for line in stderr.splitlines() if "stopped at step" in line)
    return int(line.split("stopped at step ")[1].split(";")[0])


def interrupt(config: Path, events: Path, number: int, *, resume: Path | None, group: bool = False,
              sigint_ignored: bool = False) -> tuple[int, str]:
    """Start the engine, wait for its first progress report, send ``number``; return (exit code, stderr)."""
    shutil.rmtree(events, ignore_errors=True)
    extra = ["--autotune_events_dir", str(events)] + (["--resume", str(resume)] if resume else [])

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a background job inherits

    child = subprocess.Popen(engine_command(config, *extra), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=group,
                             preexec_fn=ignore_sigint if sigint_ignored else None)
    wait_for(lambda: (events / "progress.json").exists() or child.poll() is not None, what="progress.json")
    if group:
        os.killpg(child.pid, number)  # as a terminal's Ctrl-C does: the DataLoader workers get it too
    else:
        child.send_signal(number)
    _, stderr = child.communicate(timeout=300)
    return child.returncode, stderr


@pytest.mark.slow
def test_three_interruptions_resumed_end_with_the_straight_runs_lora_steps_and_epoch(tmp_path):
    data = make_dataset(tmp_path)
    straight = write_config(tmp_path / "straight.toml", data, tmp_path / "straight")
    done = subprocess.run(engine_command(straight), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    out, events = tmp_path / "out", tmp_path / "events"
    config = write_config(tmp_path / "config.toml", data, out, max_data_loader_n_workers=1,
                          persistent_data_loader_workers=True)
    state = out / "lora-state"
    # Ctrl-C in a terminal (the whole group: the DataLoader worker too), `docker stop` / the watchdog (SIGTERM
    # to the engine), and `kill -INT` to a child that inherited SIGINT as ignored (a background job)
    stops = [(signal.SIGINT, 130, {"group": True}), (signal.SIGTERM, 143, {}),
             (signal.SIGINT, 130, {"sigint_ignored": True})]
    steps: list[int] = []
    for number, code, how in stops:
        rc, stderr = interrupt(config, events, number, resume=state if steps else None, **how)
        assert rc == code, stderr[-3000:]
        assert "Traceback" not in stderr and f"train_network: {signal.Signals(number).name}: stopped at step" in stderr
        step = stopped_step(stderr)
        saved = json.loads((state / "train_state.json").read_text())
        assert saved["counters"]["global_step"] == step and saved["current_epoch"] == (step + 1) // 2
        assert step > (steps[-1] if steps else 0)
        steps.append(step)
        assert not (out / "lora.safetensors").exists()  # no final LoRA from an interrupted run
    assert steps[-1] < STEPS, f"the run ended before the third stop ({steps}); make STEPS larger"

    final = subprocess.run(engine_command(config, "--resume", str(state)), cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    a, meta = read_lora_file(tmp_path / "straight" / "lora.safetensors")
    b, resumed_meta = read_lora_file(out / "lora.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), steps
    assert resumed_meta["ss_steps"] == meta["ss_steps"] == str(STEPS)
    assert resumed_meta["ss_epoch"] == meta["ss_epoch"] == str(STEPS // 2)
    end = load_train_state(state).counters  # 19 whole epochs and the 2 batches of the 20th, as sd-scripts counts
    assert (end.global_step, end.epoch, end.step_in_epoch, end.epochs_begun) == (STEPS, STEPS // 2 - 1, 2, STEPS // 2)
    assert json.loads((state / "train_state.json").read_text())["current_epoch"] == STEPS // 2


def hidden_temp(folder: Path, name: str) -> list[Path]:
    """The temp file or folder an atomic write of ``name`` holds open (``.name.XXXX``)."""
    return [p for p in folder.iterdir() if p.name.startswith(f".{name}.")] if folder.is_dir() else []


def kill_inside_save(command: list[str], pattern: str, folder: Path, name: str) -> None:
    """Run ``command`` with the save-pause test hook on ``pattern``; SIGKILL it while ``name`` is half-saved."""
    env = {**ENV, "SD_COMPAT_TEST_SAVE_PAUSE": f"{pattern}:120"}
    child = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_for(lambda: hidden_temp(folder, name) or child.poll() is not None, what=f"the save of {name}")
        assert child.poll() is None, child.stderr.read()[-3000:] if child.stderr else ""
        temp = hidden_temp(folder, name)[0]
        assert temp.is_dir() or temp.stat().st_size > 0  # the content is written, the rename not yet done
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_sigkill_while_saving_leaves_the_previous_lora_and_state_whole(tmp_path):
    from autotune.recovery.watchdog import clean_partial_files

    data, out = make_dataset(tmp_path, images=2), tmp_path / "out"
    first = write_config(tmp_path / "first.toml", data, out, max_train_steps=4)
    done = subprocess.run(engine_command(first), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    state, lora = out / "lora-state", out / "lora.safetensors"
    longer = write_config(tmp_path / "longer.toml", data, out, max_train_steps=8)

    # killed while writing the final LoRA of steps 5-8: the step-4 LoRA is still there, whole
    kill_inside_save(engine_command(longer, "--resume", str(state)), "lora.safetensors", out, "lora.safetensors")
    assert read_lora_file(lora)[1]["ss_steps"] == "4"
    # killed while writing a rolling state (every step): the step-4 state folder is whole and loads
    kill_inside_save(engine_command(longer, "--resume", str(state), "--save_state_every_seconds", "0.001"),
                     "lora-state", out, "lora-state")
    assert load_train_state(state).counters.global_step == 4
    assert read_lora_file(lora)[1]["ss_steps"] == "4"

    removed = clean_partial_files(out)  # what the watchdog does before the next attempt
    assert len(removed) == 2 and not [p for p in out.iterdir() if p.name.startswith(".")]
    resumed = subprocess.run(engine_command(longer, "--resume", str(state)), cwd=REPO, env=ENV,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_lora_file(lora)[1]["ss_steps"] == "8" and load_train_state(state).counters.global_step == 8


@pytest.mark.long
def test_autotune_run_forwards_sigterm_waits_for_the_state_and_resumes(tmp_path):
    data, out = make_dataset(tmp_path), tmp_path / "run"
    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15", "--out", str(out),
               "--epochs", "20", "--save-state-every", "3600"]
    child = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    wait_for(lambda: (out / "logs/events" / "progress.json").exists() or child.poll() is not None,
             what="progress.json")
    child.send_signal(signal.SIGTERM)  # to `autotune run` only, as a scheduler does; it forwards it
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 143, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--resume" in lines[0] and "Traceback" not in stdout + stderr, stderr[-3000:]
    state = next((out / "state").glob("*-state"))
    stopped = load_train_state(state).counters.global_step
    assert stopped > 0

    said = shlex.split(lines[0].split("continue with: ", 1)[1])  # the command it prints is the one that works
    assert said[:2] == ["autotune", "run"] and said[-2:] == ["--resume", str(out)], said
    again = subprocess.run([sys.executable, "-m", *said], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    lora = next(p for p in out.glob("*.safetensors") if "-0" not in p.name)
    assert f"resumed from {state} at step {stopped}" in again.stdout
    assert int(read_lora_file(lora)[1]["ss_steps"]) == 20  # 20 epochs of 1 step (4 images, batch 1 x 4)


@contextlib.contextmanager
def mounted(*args: str, target: Path) -> Iterator[None]:
    """``mount ARGS TARGET`` for the block, or a skip where this machine does not allow it (not root, a jail)."""
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount")
    made = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"mount not allowed here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def read_only(source: Path, target: Path) -> contextlib.AbstractContextManager[None]:
    """A real read-only view of ``source`` at ``target`` (a bind mount remounted ro: root cannot write it)."""

    @contextlib.contextmanager
    def bind() -> Iterator[None]:
        with mounted("--bind", str(source), target=target):
            remount = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True,
                                     text=True, check=False)
            if remount.returncode != 0:
                pytest.skip(f"read-only remount not allowed: {remount.stderr.strip()}")
            yield

    return bind()


@pytest.mark.slow
def test_read_only_dataset_trains_with_its_caches_under_the_output_folder(tmp_path):
    """The default plan caches latents beside the images; a read-only dataset puts them in <output>/.cache."""
    source = make_dataset(tmp_path / "src", images=2)
    view = tmp_path / "ro"
    with read_only(source, view):
        with pytest.raises(OSError):
            (view / "1_toy" / "probe").write_text("x")  # really read-only, even for root
        before = sorted(p.name for p in (source / "1_toy").iterdir())
        out = tmp_path / "run"
        done = subprocess.run([sys.executable, "-m", "autotune", "run", str(view), "--model", "builtin:tiny-sd15",
                               "--out", str(out), "--epochs", "1"], cwd=tmp_path, env=ENV, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(p.name for p in (source / "1_toy").iterdir()) == before
        caches = {p: p.stat().st_mtime_ns for p in (out / ".cache" / "latents").rglob("*.safetensors")}
        assert sorted(p.name.split(".")[0] for p in caches) == ["img0", "img1"]
        assert (out / "config.toml").read_text().count("cache_latents_to_disk = true") == 1
        again = subprocess.run(engine_command(out / "config.toml", "--max_train_steps", "1", "--output_name",
                                              "again"), cwd=REPO, env=ENV, capture_output=True, text=True,
                               timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert {p: p.stat().st_mtime_ns for p in caches} == caches  # reused, not rewritten


@pytest.mark.slow
def test_full_disk_while_saving_is_one_line_exit_28_and_the_state_stays(tmp_path):
    """A real 3 MiB tmpfs as the output folder: the first run fits, then a filler leaves too little room for the
    next save. One line naming the folder and the space needed, exit 28, the old state and LoRA whole."""
    data, out = make_dataset(tmp_path, images=2), tmp_path / "out"
    with mounted("-t", "tmpfs", "-o", "size=3m", "tmpfs", target=out):
        first = write_config(tmp_path / "first.toml", data, out, max_train_steps=2)
        done = subprocess.run(engine_command(first), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        with open(out / "filler", "wb") as handle:  # fill the disk to the last block
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
        with contextlib.suppress(OSError):  # and the last bytes
            with open(out / "filler2", "wb") as handle:
                while True:
                    handle.write(b"\0")
                    handle.flush()
        longer = write_config(tmp_path / "longer.toml", data, out, max_train_steps=4)
        full = subprocess.run(engine_command(longer, "--resume", str(out / "lora-state")), cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=600)
        assert full.returncode == 28, full.stderr[-3000:]
        lines = [line for line in full.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert lines[0].startswith("train_network: error: ") and str(out) in lines[0]
        assert "disk full" in lines[0] and "needs about" in lines[0]
        assert read_lora_file(out / "lora.safetensors")[1]["ss_steps"] == "2"
        assert load_train_state(out / "lora-state").counters.global_step == 2
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind

        # the same through `autotune run --config` (its output_dir on the full disk): one line, exit 28, no retry
        run = subprocess.run([sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15",
                              "--config", str(longer), "--out", str(tmp_path / "run")], cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 28, run.stderr[-3000:]
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:]
        assert lines[0].startswith("autotune run: error: ") and str(out) in lines[0] and "disk full" in lines[0]
        assert "out of memory" not in run.stdout and "attempt 0 failed" not in run.stdout  # not retried
        assert load_train_state(out / "lora-state").counters.global_step == 2


@pytest.mark.slow
def test_one_run_per_out_no_orphan_trainer_and_resume_waits_for_it(tmp_path):
    """The output folder is locked by the run that uses it (flock: it dies with the run): a second `autotune run`
    into it gets one line with the first's PID and changes nothing there. SIGKILL of the supervisor leaves no
    trainer behind: the kernel sends it SIGTERM (it saves its state and ends); while it is still alive (held
    stopped here) `--resume` refuses naming it, and afterwards resumes."""
    data, out = make_dataset(tmp_path), tmp_path / "run"
    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15", "--out", str(out),
               "--config", str(long_config(tmp_path, steps=300)), "--save-state-every", "3600"]
    first = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        wait_for(lambda: (out / "logs/events" / "progress.json").exists() or first.poll() is not None,
                 what="progress.json")
        before = sorted(p.name for p in out.iterdir())
        second = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and f"another autotune run (PID {first.pid})" in lines[0], second.stderr
        assert sorted(p.name for p in out.iterdir()) == before
        trainer = trainers_of(out)[0]
        os.kill(trainer, signal.SIGSTOP)  # held alive: the parent-death SIGTERM stays pending
    finally:
        first.kill()  # SIGKILL: no clean-up of ours runs
        first.wait(timeout=60)
    refused = subprocess.run([*command, "--resume"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode == 2 and f"trainer (PID {trainer}) is still running" in refused.stderr, refused.stderr
    os.kill(trainer, signal.SIGCONT)
    started = time.monotonic()
    wait_for(lambda: not trainers_of(out), timeout=60, what="the trainer to end with its supervisor")
    print(f"trainer ended {time.monotonic() - started:.1f} s after it could act on SIGTERM")
    assert list((out / "state").glob("*-state")), "it saved its state on the way out"
    resumed = subprocess.run([*command, "--resume"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert int(read_lora_file(out / "long.safetensors")[1]["ss_steps"]) == 300


def trainers_of(out: Path) -> list[int]:
    """PIDs of live engine processes whose command line names ``out`` (the trainer of that run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ")[-1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(str(out).encode() in arg for arg in argv) and b"sd_scripts_compat" in b" ".join(argv):
            found.append(int(entry.name))
    return found


def process_state(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().split(") ")[-1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
def test_ctrl_z_stops_the_whole_run_and_fg_carries_on_at_the_same_step(tmp_path):
    """SIGTSTP (Ctrl-Z) to `autotune run` stops the trainer too (it has its own session, so the terminal's signal
    never reaches it); SIGCONT (fg) continues both, and the run ends as if never stopped."""
    data, out = make_dataset(tmp_path), tmp_path / "run"
    command = [sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15", "--out", str(out),
               "--config", str(long_config(tmp_path, steps=40)), "--save-state-every", "3600"]
    run = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    progress = out / "logs/events" / "progress.json"
    wait_for(lambda: progress.exists() or run.poll() is not None, what="progress.json")
    trainer = trainers_of(out)[0]
    run.send_signal(signal.SIGTSTP)
    wait_for(lambda: process_state(trainer) == "T" and process_state(run.pid) == "T", timeout=10,
             what="the trainer and its supervisor to stop")
    held = progress.read_bytes()
    time.sleep(2)
    assert progress.read_bytes() == held and process_state(trainer) == "T"
    run.send_signal(signal.SIGCONT)
    _, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-3000:]
    lora = next(p for p in out.glob("*.safetensors") if "-0" not in p.name and "-step" not in p.name)
    assert int(read_lora_file(lora)[1]["ss_steps"]) == 40


def long_config(root: Path, steps: int) -> Path:
    """A tiny-sd15 config of ``steps`` steps (a plan would cap a tiny CPU run at a few dozen)."""
    path = root / "long.toml"
    path.write_text(toml.dumps({"max_train_steps": steps, "resolution": "64,64", "network_dim": 4,
                                "optimizer_type": "AdamW", "learning_rate": 1e-4, "max_data_loader_n_workers": 0,
                                "caption_extension": ".txt", "output_name": "long"}))
    return path


@pytest.mark.slow
def test_resume_refuses_changed_inputs_and_continues_when_told(tmp_path):
    """A run records what it started from; --resume after a new image, another model or another rank refuses
    with one line listing what changed; --resume-changed continues and the run records the changes."""
    data, out, config = make_dataset(tmp_path), tmp_path / "run", long_config(tmp_path, steps=300)

    def command(model: str = "builtin:tiny-sd15", *extra: str) -> list[str]:
        return [sys.executable, "-m", "autotune", "run", str(data), "--model", model, "--out", str(out), "--config",
                str(config), "--save-state-every", "3600", *extra]

    first = subprocess.Popen(command(), cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    wait_for(lambda: (out / "logs/events" / "progress.json").exists() or first.poll() is not None,
             what="progress.json")
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=300)
    assert first.returncode == 143
    Image.new("RGB", (64, 64)).save(data / "1_toy" / "new.png")
    (data / "1_toy" / "new.txt").write_text("toy, new", encoding="utf-8")
    for argv, said in ((command("builtin:tiny-sd15", "--resume"), "the dataset (8 files"),
                       (command("builtin:tiny-sdxl", "--resume"), "the model (builtin:tiny-sd15 -> builtin:tiny-sdxl)"),
                       (command("builtin:tiny-sd15", "--resume", "--rank", "8"), "--rank (None -> 8)")):
        refused = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and len(lines) == 1 and said in lines[0], refused.stderr[-2000:]
        assert "--resume-changed" in lines[0]
    by_file = [word for word in command("builtin:tiny-sd15") if word not in ("--out", str(out))]
    resumed = subprocess.run([*by_file, "--resume", str(out / "logs" / "train.log"), "--resume-changed"],
                             cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming although changed since the run started: the dataset" in resumed.stdout
    assert "resumed although its inputs changed (--resume-changed): the dataset" in resumed.stdout  # the report
    state = json.loads((out / "state/autotune_run.json").read_text())
    assert state["resumed_changed"] and state["resumed_changed"][0].startswith("the dataset")


@pytest.mark.parametrize("phase", [pytest.param("loading", marks=pytest.mark.slow),
                                   pytest.param("caching", marks=pytest.mark.slow), "training"])
@pytest.mark.long
def test_sigkill_of_the_supervisor_leaves_no_trainer_in_any_phase(tmp_path, phase):
    """`autotune run` killed with SIGKILL (no clean-up of ours runs) while its trainer loads the model (held by the
    slow-loader test hook), writes a latent cache file (held by the atomic-write test hook) or trains: the kernel
    tells the trainer (PR_SET_PDEATHSIG), and no trainer is left 5 s later; nothing half-written stays in the
    dataset."""
    data, out = make_dataset(tmp_path), tmp_path / "run"
    config = tmp_path / "phase.toml"
    config.write_text(toml.dumps({"max_train_steps": 300, "resolution": "64,64", "network_dim": 4,
                                  "max_data_loader_n_workers": 0, "caption_extension": ".txt",
                                  "cache_latents_to_disk": True, "output_name": "lora"}))
    hooks = {"loading": {"SD_COMPAT_TEST_LOAD_DELAY": "120"},
             "caching": {"SD_COMPAT_TEST_SAVE_PAUSE": "*.latents.safetensors:120"}, "training": {}}[phase]
    run = subprocess.Popen([sys.executable, "-m", "autotune", "run", str(data), "--model", "builtin:tiny-sd15",
                            "--out", str(out), "--config", str(config), "--save-state-every", "3600"],
                           cwd=tmp_path, env={**ENV, **hooks}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    said = out / "logs/events" / "phase.json"
    wait_for(lambda: said.exists() and json.loads(said.read_text() or "{}").get("phase") == phase
             and (phase != "caching" or [p for p in (data / "1_toy").iterdir() if p.name.startswith(".")])
             or run.poll() is not None,
             what=f"the trainer to be {phase}")
    assert run.poll() is None and trainers_of(out)
    run.kill()
    run.wait(timeout=60)
    started = time.monotonic()
    wait_for(lambda: not trainers_of(out), timeout=5, what="the trainer to end with its supervisor")
    print(f"{phase}: trainer gone {time.monotonic() - started:.1f} s after its supervisor")
    assert not [p for p in (data / "1_toy").iterdir() if p.name.startswith(".")]
