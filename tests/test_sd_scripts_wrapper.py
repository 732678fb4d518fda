"""The watchdog on the user's own sd-scripts (``--engine sd-scripts=PATH``), against a FAKE sd-scripts.

sd-scripts itself cannot be fetched here, so every loop runs against tests/fixtures/fake_sd_scripts/ (a
stand-in with sd-scripts' command line, tqdm output, state folders and exit behaviour; see its docstring).
Children, files and signals are real. The fake "trains" one number from the samples each step draws, so
``expected_w`` checks the step count and the data position of every resume at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import toml

from autotune.layout import DECISIONS_LOG, SD_SCRIPTS_LEDGER
from autotune.recovery.external import DEFAULT_IT_PER_S, parse_bar, save_every_n_steps
from autotune.recovery.ladder import LadderLimits
from autotune.recovery.sd_scripts import OptionReader, check_import, find_install, locate, parse_engine, prepare
from autotune.recovery.watchdog import Job, supervise
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.families import get_family
from sd_scripts_compat.facts.settings import TrainSettings

FAKE = Path(__file__).parent / "fixtures" / "fake_sd_scripts"
FAKE_SCRIPTS = FAKE / "sd-scripts"
ROOT = Path(__file__).resolve().parents[1]
IMAGES, REPEATS = 3, 4  # K = 12 samples per epoch
STEPS, EFFECTIVE = 20, 4


def expected_w(steps: int, effective: int = EFFECTIVE, samples: int = IMAGES * REPEATS) -> float:
    """What the fake's number is after ``steps`` optimizer steps drawn in order from sample 0."""
    return sum(((j * effective + i) % samples % 7 + 1) / 8 for j in range(steps) for i in range(effective))


def read_fake_lora(path: str | Path) -> tuple[float, dict[str, str]]:
    """The fake's LoRA: a one-tensor safetensors file (read by hand: the fake writes it by hand too)."""
    raw = Path(path).read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    return struct.unpack("<d", raw[8 + size:16 + size])[0], header["__metadata__"]


def make_dataset(root: Path, pngs: bool = False) -> Path:
    folder = root / "data" / f"{REPEATS}_toy"
    folder.mkdir(parents=True)
    for i in range(IMAGES):
        if pngs:
            from PIL import Image

            Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(folder / f"img{i}.png")
            (folder / f"img{i}.caption").write_text("a toy")
        else:
            (folder / f"img{i}.png").write_bytes(b"not decoded by the fake")
    return folder.parent


def fake_env(tmp: Path, rules: str = "", **extra: str) -> dict[str, str]:
    return {**os.environ, "FAKE_SD_SCRIPTS": rules, "FAKE_SD_SCRIPTS_MARKS": str(tmp / "marks"),
            "HF_HUB_OFFLINE": "1", **extra}


def make_job(tmp: Path, rules: str, *, micro: int = 4, budget: float = 300.0, save_every_s: float = 3.0,
             config_extra: dict | None = None, env_extra: dict | None = None, **kw) -> Job:
    """A supervised run of the fake at micro-batch ``micro`` x accumulation (EFFECTIVE / micro), 20 steps."""
    data = make_dataset(tmp)
    (tmp / "model.safetensors").write_bytes(b"the fake only checks that it exists")
    out = tmp / "out"
    out.mkdir()
    config = out / "config.toml"
    config.write_text(toml.dumps({
        "pretrained_model_name_or_path": str(tmp / "model.safetensors"), "train_data_dir": str(data),
        "output_dir": str(out / "output"), "output_name": "lora", "max_train_steps": STEPS,
        "train_batch_size": micro, "gradient_accumulation_steps": EFFECTIVE // micro, "resolution": "64,64",
        "network_dim": 8, "optimizer_type": "AdamW", **(config_extra or {})}))
    env = fake_env(tmp, rules, **(env_extra or {}))
    engine = prepare(f"sd-scripts={FAKE}", None, family=get_family("tiny-sd15"), config=config, output_dir=out,
                     states_dir=out / "output", save_every_s=save_every_s, env=env)
    settings = TrainSettings(train_batch_size=micro, gradient_accumulation_steps=EFFECTIVE // micro,
                             resolution=(64, 64), network_dim=8)
    return Job(config_path=config, output_dir=out, settings=settings, limits=LadderLimits(budget_mib=budget),
               predict=lambda s: 100.0 * s.train_batch_size, env=env, echo=False, engine=engine,
               train_output_dir=out / "output", **kw)


def commands(job: Job) -> list[list[str]]:
    lines = [json.loads(x) for x in (job.output_dir / "logs/decisions.jsonl").read_text().splitlines()]
    return [x["argv"] for x in lines if x["event"] == "sd_scripts_command"]


@pytest.mark.parametrize("quiet", ["", ",quiet_saves"], ids=["save_announced", "save_not_announced"])
def test_fake_oom_on_stderr_steps_down_and_resumes_at_the_saved_step(tmp_path, quiet):
    job = make_job(tmp_path, "oom_at=7" + quiet)
    result = supervise(job)
    assert result.ok, result.message
    assert (result.final_settings.train_batch_size, result.final_settings.gradient_accumulation_steps) == (2, 2)
    retry = result.retries[0]
    assert retry["failure"] == "oom" and "CUDA out of memory" in retry["message"]
    assert (retry["step"], retry["resume_step"], retry["steps_lost"]) == (7, 6, 1)  # saves every 3 steps at 1 it/s
    w, meta = read_fake_lora(result.output_file)
    assert w == pytest.approx(expected_w(STEPS)) and meta["fake_true_steps"] == str(STEPS)
    first, second = commands(job)
    assert "--save_state" in first and first[first.index("--save_every_n_steps") + 1] == "3"
    assert "--autotune_events_dir" not in first and "--resume" not in first
    tail = second[second.index("--resume"):]
    assert tail == ["--resume", str(job.states_dir / "lora-step00000006-state"), "--initial_step", "6",
                    "--skip_until_initial_step"]
    attempt = toml.load(second[second.index("--config_file") + 1])
    assert (attempt["train_batch_size"], attempt["gradient_accumulation_steps"], attempt["max_train_steps"]) == \
        (2, 2, STEPS)
    log = (job.output_dir / DECISIONS_LOG).read_text()
    assert "saved every 3 step(s)" in log and "loses at most the 3 step(s) since the last save" in log
    assert "resume at step 6, 1 step(s) lost" in log


def test_fake_sigkill_resumes_from_the_last_whole_state(tmp_path):
    job = make_job(tmp_path, "kill_at=12,step_s=0.05", budget=1000.0, micro=2, save_every_s=2.0)
    result = supervise(job)
    assert result.ok, result.message
    retry = result.retries[0]
    assert retry["failure"] == "os_kill" and retry["step"] == 12
    assert retry["resume_step"] == 10 and retry["steps_lost"] == 2
    assert result.final_settings.train_batch_size == 1  # an OS kill is taken for an OOM: stepped down
    w, meta = read_fake_lora(result.output_file)
    assert w == pytest.approx(expected_w(STEPS)) and meta["ss_steps"] == str(STEPS)


def test_fake_stall_is_killed_and_retried_with_the_same_settings(tmp_path):
    job = make_job(tmp_path, "stall_at=4", budget=1000.0, save_every_s=1.0, stall_timeout_s=1.5)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["stall"]
    # the state of step 4 was written just before the hang, but no later step proved it whole
    assert result.retries[0]["resume_step"] == 3 and result.final_settings == job.settings
    assert read_fake_lora(result.output_file)[0] == pytest.approx(expected_w(STEPS))


def test_fake_counter_reset_after_resume_is_caught_and_compensated(tmp_path):
    """A version whose step counter restarts at 0 after a resume (names, train_state.json and the end
    condition all off): the first save gives it away, the attempt is relaunched from the same state with
    max_train_steps = target - 6, and training still ends at exactly step 20 with the right data."""
    job = make_job(tmp_path, "counter=reset,oom_at=7,step_s=0.1", save_every_s=0.5)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["oom", "continue"]
    assert result.retries[0]["resume_step"] == 6  # saved every step; step 7's state was not yet proven whole
    assert result.retries[1]["resume_step"] == 6 and "off by -6" in result.retries[1]["message"]
    third = commands(job)[2]
    assert third[third.index("--resume") + 1].endswith("lora-step00000006-state")
    assert third[third.index("--initial_step") + 1] == "6"
    assert toml.load(third[third.index("--config_file") + 1])["max_train_steps"] == STEPS - 6
    w, meta = read_fake_lora(result.output_file)
    assert meta["fake_true_steps"] == str(STEPS) and meta["ss_steps"] == str(STEPS - 6)  # its own count is off
    assert w == pytest.approx(expected_w(STEPS))
    ledger = json.loads((job.output_dir / SD_SCRIPTS_LEDGER).read_text())
    assert ledger["target_steps"] == STEPS and ledger["states"]["lora-state"]["step"] == STEPS


@pytest.mark.long
def test_measured_headroom_steps_the_users_sd_scripts_up_from_its_next_saved_state(tmp_path):
    """sd-scripts saves no state when stopped, so a step up waits for the next whole state, stops the trainer
    there and relaunches from it with the larger micro-batch (same effective batch); the run ends at exactly its
    step with the data of an uninterrupted one. The budget is pinned (an address space of 1 TiB, its peak sampled
    from /proc): what decides is the measured peak against it, not this machine's free memory. 80 steps of 0.15 s:
    the decision comes a few steps in, leaving ~10 s for a busy machine's supervisor to see a save after it."""
    steps = 80
    job = make_job(tmp_path, "step_s=0.15", micro=1, budget=2.0**20, save_every_s=0.5,
                   config_extra={"max_train_steps": steps}, budget_kind="address_space",
                   images_per_s=lambda s: float(s.train_batch_size))
    result = supervise(job)
    assert result.ok, result.message
    ups = [r for r in result.retries if r["failure"] == "step_up"]
    assert ups and ups[0]["changes"]["train_batch_size"] == [1, 2]
    assert ups[0]["changes"]["gradient_accumulation_steps"] == [4, 2]
    assert all(r["resume_step"] == r["step"] - r["steps_lost"] and r["steps_lost"] <= 1 for r in ups)
    final = result.final_settings
    assert final.train_batch_size * final.gradient_accumulation_steps == EFFECTIVE and final.train_batch_size > 1
    w, meta = read_fake_lora(result.output_file)
    assert meta["fake_true_steps"] == str(steps) and w == pytest.approx(expected_w(steps))
    second = commands(job)[1]
    assert second[second.index("--initial_step") + 1] == str(ups[0]["resume_step"])
    assert toml.load(second[second.index("--config_file") + 1])["train_batch_size"] == 2
    log = (job.output_dir / DECISIONS_LOG).read_text()
    assert "stopped sd-scripts after its state at step" in log and "measured peak" in log


def test_no_speed_model_keeps_the_users_sd_scripts_settings(tmp_path):
    job = make_job(tmp_path, "step_s=0.05", micro=1, budget=2.0**20, save_every_s=0.5, budget_kind="address_space")
    result = supervise(job)
    assert result.ok and result.retries == [] and result.final_settings == job.settings


def test_not_sd_scripts_and_missing_folders_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="not sd-scripts: no train_network.py"):
        locate(FAKE / "not_sd_scripts")
    with pytest.raises(UserError, match="no such folder"):
        locate(tmp_path / "nowhere")
    with pytest.raises(UserError, match="expected sd-scripts=PATH"):
        parse_engine("kohya=/x")


def test_layouts_say_what_was_found_and_pick_the_venv(tmp_path):
    assert locate(FAKE_SCRIPTS) == (FAKE_SCRIPTS, "an sd-scripts checkout")
    assert locate(FAKE)[1].startswith("the sd-scripts inside a kohya_ss")
    lora = tmp_path / "lora-scripts"
    (lora / "scripts").mkdir(parents=True)
    (lora / "scripts" / "stable").symlink_to(FAKE_SCRIPTS)
    venv = lora / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "python").chmod(0o755)
    install = find_install(lora, None)
    assert install.scripts_dir == lora / "scripts" / "stable" and "lora-scripts" in install.found_as
    assert install.python == str(venv / "python") and "venv" in install.python_origin
    assert find_install(FAKE_SCRIPTS, None).python == sys.executable
    with pytest.raises(UserError, match="--python /nope: not an executable"):
        find_install(lora, "/nope")


def test_import_error_shows_its_last_line():
    install = find_install(FAKE / "broken_import", None)
    with pytest.raises(UserError) as error:
        check_import(install)
    message = str(error.value)
    assert "No module named 'fake_sd_scripts_missing_dependency'" in message and "\n" not in message


def test_an_option_this_sd_scripts_lacks_is_refused_before_launch(tmp_path):
    with pytest.raises(UserError) as error:
        make_job(tmp_path, "", config_extra={"network_dropout": 0.1},
                 env_extra={"FAKE_SD_SCRIPTS_LACKS": "network_dropout"})
    assert "has no --network_dropout" in str(error.value) and "version 0.9.1" in str(error.value)
    assert not (tmp_path / "out" / "output").exists()  # nothing was launched
    (tmp_path / "b").mkdir()
    with pytest.raises(UserError, match="has no --skip_until_initial_step"):
        make_job(tmp_path / "b", "", env_extra={"FAKE_SD_SCRIPTS_LACKS": "skip_until_initial_step"})


def test_options_are_read_once_per_script_version(tmp_path):
    reader = OptionReader(fake_env(tmp_path))
    install = find_install(FAKE_SCRIPTS, None)
    first = reader.options(install, "train_network.py")
    assert reader.options(install, "train_network.py") is first
    assert {"save_every_n_steps", "skip_until_initial_step", "tokenizer_cache_dir"} <= first.names
    assert "cache_text_encoder_outputs" not in first.names  # SDXL-only: sdxl_train_network.py has it
    assert "cache_text_encoder_outputs" in reader.options(install, "sdxl_train_network.py").names


def test_parse_bar_reads_tqdm_as_sd_scripts_prints_it():
    bar = parse_bar("steps:  12%|█▏        | 12/100 [00:10<01:13,  1.19it/s, avr_loss=0.123]")
    assert bar is not None and bar.is_steps and (bar.n, bar.total, bar.it_per_s, bar.loss) == (12, 100, 1.19, 0.123)
    slow = parse_bar("\rsteps:  50%|█████     | 5/10 [00:25<00:25,  5.00s/it, avr_loss=nan]")
    assert slow is not None and slow.it_per_s == pytest.approx(0.2)
    start = parse_bar("steps:   0%|          | 0/40 [00:00<?, ?it/s]")
    assert start is not None and start.n == 0 and start.it_per_s is None
    caching = parse_bar("100%|██████████| 12/12 [00:01<00:00, 9.87it/s]")
    assert caching is not None and not caching.is_steps
    assert parse_bar("INFO     saving state at step 12") is None


def test_save_interval_follows_the_rate():
    assert save_every_n_steps(60, 2.5) == 150
    assert save_every_n_steps(60, None) == int(60 * DEFAULT_IT_PER_S)
    assert save_every_n_steps(60, 2.5, target_steps=40) == 40
    assert save_every_n_steps(0.1, 0.5) == 1


# ---------------------------------------------------------------- the command line


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "autotune", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def diffusers_folder(tmp: Path) -> Path:
    """A model the family detector reads (unet/config.json of tiny-sd15); the fake never loads it."""
    (tmp / "model" / "unet").mkdir(parents=True)
    (tmp / "model" / "unet" / "config.json").write_text(json.dumps(get_family("tiny-sd15").unet))
    return tmp / "model"


def test_cli_run_plans_then_supervises_the_fake_from_a_lora_scripts_folder(tmp_path):
    data = make_dataset(tmp_path, pngs=True)
    lora = tmp_path / "lora-scripts"
    (lora / "scripts").mkdir(parents=True)
    (lora / "scripts" / "stable").symlink_to(FAKE_SCRIPTS)
    out = tmp_path / "run"
    done = _cli("run", str(data), "--model", str(diffusers_folder(tmp_path)), "--engine", f"sd-scripts={lora}",
                "--out", str(out), "--save-state-every", "0.2", env=fake_env(tmp_path, "oom_at=5"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(the stable sd-scripts of a lora-scripts (SD-Trainer) folder)" in done.stdout
    assert f"python: {sys.executable}" in done.stdout and "sd-scripts version 0.9.1" in done.stdout
    shown = done.stdout + done.stderr  # decision lines go to stdout
    assert f"attempt 0: {sys.executable} {lora / 'scripts' / 'stable' / 'train_network.py'}" in shown
    retry = json.loads((out / "logs/retries.json").read_text())[0]
    assert retry["failure"] == "oom" and retry["step"] == 5 and retry["resume_step"] == 4
    w, meta = read_fake_lora(out / "data-tiny-sd15.safetensors")
    target = json.loads((out / SD_SCRIPTS_LEDGER).read_text())["target_steps"]
    assert meta["fake_true_steps"] == str(target) and target > 5
    assert (out / "state" / "sd_scripts_tokenizers" / "openai_clip-vit-large-patch14" / "vocab.json").is_file()


@pytest.mark.slow
def test_cli_run_plans_lumina_and_supervises_the_fakes_lumina_script(tmp_path):
    """A family our engine does not train (Lumina 2, told by its file's header) is planned for the card and run
    by sd-scripts' own script for it: the fake's lumina_train_network.py, which takes only that script's
    options, OOMs once at step 5 and is resumed at the saved step."""
    import torch
    from safetensors.torch import save_file

    data = make_dataset(tmp_path, pngs=True)
    model = tmp_path / "lumina_2.safetensors"  # the modules kohya's lumina_models.py names (header only matters)
    save_file({k: torch.zeros(1) for k in ["x_embedder.weight", "cap_embedder.1.weight",
                                          "noise_refiner.0.attention.qkv.weight",
                                          "context_refiner.0.attention.qkv.weight",
                                          *(f"layers.{i}.attention.qkv.weight" for i in range(26))]}, str(model))
    out = tmp_path / "run"
    command = ["run", str(data), "--model", str(model), "--vram", "12", "--engine", f"sd-scripts={FAKE_SCRIPTS}",
               "--out", str(out), "--save-state-every", "0.2"]
    missing = _cli(*command, env=fake_env(tmp_path), cwd=tmp_path)  # its Gemma2 and AE files, asked for by name
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0, missing.stderr
    assert "needs its gemma2 file" in missing.stderr and "--gemma2 FILE" in missing.stderr and not out.exists()
    parts = {name: tmp_path / f"{name}.safetensors" for name in ("gemma2", "ae")}  # the fake reads neither
    for path in parts.values():
        save_file({"x": torch.zeros(1)}, str(path))
    written = tmp_path / "written.txt"  # what the fake sd-scripts wrote, file by file
    done = _cli(*command, *(f"--{name}={path}" for name, path in parts.items()),
                env=fake_env(tmp_path, "oom_at=5", FAKE_WRITTEN_LOG=str(written)), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = done.stdout + done.stderr
    assert f"attempt 0: {sys.executable} {FAKE_SCRIPTS / 'lumina_train_network.py'}" in shown
    config = toml.loads((out / "config.toml").read_text())
    assert config["network_module"] == "networks.lora_lumina" and config["gemma2"] == str(parts["gemma2"])
    retry = json.loads((out / "logs/retries.json").read_text())[0]
    assert retry["failure"] == "oom" and retry["step"] == 5
    target = json.loads((out / SD_SCRIPTS_LEDGER).read_text())["target_steps"]
    final = out / "data-lumina2.safetensors"
    assert read_fake_lora(final)[1]["fake_true_steps"] == str(target)
    # sd-scripts' own LoRA, as its script wrote it: we supervise its run and rewrite nothing (Lumina 2,
    # HunyuanImage-2.1 and Anima alike: their LoRAs and metadata are sd-scripts' to the byte)
    wrote = dict(line.split() for line in written.read_text().splitlines())
    assert wrote[final.name] == hashlib.sha256(final.read_bytes()).hexdigest()


def test_cli_bad_engine_path_and_builtin_model_are_one_line(tmp_path):
    data = make_dataset(tmp_path, pngs=True)
    env = fake_env(tmp_path)
    bad = _cli("run", str(data), "--model", "builtin:tiny-sd15", "--engine", f"sd-scripts={FAKE / 'not_sd_scripts'}",
               "--out", str(tmp_path / "o"), env=env, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not sd-scripts" in bad.stderr
    builtin = _cli("run", str(data), "--model", "builtin:tiny-sd15", "--engine", f"sd-scripts={FAKE_SCRIPTS}",
                   "--out", str(tmp_path / "o"), env=env, cwd=tmp_path)
    assert builtin.returncode == 2 and "only autotune's engine can load" in builtin.stderr
    assert not (tmp_path / "o").exists()


def test_cli_train_runs_the_config_in_the_users_sd_scripts(tmp_path):
    data = make_dataset(tmp_path)
    config = tmp_path / "mine.toml"
    config.write_text(toml.dumps({"model_arguments": {"pretrained_model_name_or_path": str(diffusers_folder(tmp_path))},
                                  "train_data_dir": str(data), "output_dir": str(tmp_path / "loras"),
                                  "output_name": "mine", "max_train_steps": 3, "train_batch_size": 2}))
    env = {k: v for k, v in fake_env(tmp_path).items() if k != "HF_HUB_OFFLINE"}
    done = _cli("train", str(config), "--engine", f"sd-scripts={FAKE}", "--gradient_accumulation_steps", "2",
                env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"$ {sys.executable} {FAKE_SCRIPTS / 'train_network.py'} --config_file {config} " \
           "--gradient_accumulation_steps 2" in done.stdout
    w, meta = read_fake_lora(tmp_path / "loras" / "mine.safetensors")
    assert meta["ss_steps"] == "3" and w == pytest.approx(expected_w(3))
    lacking = _cli("train", str(config), "--engine", f"sd-scripts={FAKE}", "--no_such_flag", env=env, cwd=tmp_path)
    assert lacking.returncode == 2 and "has no --no_such_flag" in lacking.stderr


def test_sd3_tokenizer_cache_holds_clip_l_clip_g_and_t5(tmp_path):
    """sd3_train_network loads three tokenizers by hub name (library/strategy_sd3.py); the cache we hand it holds
    CLIP-L and CLIP-G from our shipped vocabulary and T5 from the tokenizer we were given, each readable by
    transformers as sd-scripts reads it (from_pretrained on the folder)."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    from autotune.recovery.sd_scripts import tokenizer_cache
    from sd_scripts_compat.models.t5_tokenizer import TINY_T5_TOKENIZER_DIR

    cache = tokenizer_cache(tmp_path, "sd3", ("<|endoftext|>", "!"), Path(TINY_T5_TOKENIZER_DIR))
    clip_g = CLIPTokenizer.from_pretrained(cache / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
    assert clip_g.pad_token == "!" and CLIPTokenizer.from_pretrained(cache / "openai_clip-vit-large-patch14")
    t5 = T5TokenizerFast.from_pretrained(cache / "google_t5-v1_1-xxl")
    assert t5("a toy").input_ids[-1] == t5.eos_token_id
    without = tokenizer_cache(tmp_path / "none", "sd3", ("<|endoftext|>", "!"))  # no T5 tokenizer: sd-scripts fetches
    assert not (without / "google_t5-v1_1-xxl").exists()


def test_a_schedule_drawn_over_max_train_steps_is_never_relaunched_with_another(tmp_path):
    """Relaunching with max_train_steps = target + offset changed the real sd-scripts' cosine schedule (48d368fa,
    by hand: 2.2e-05 instead of 6.7e-05 at step 13), so with such a schedule the counter is left off: every attempt
    keeps max_train_steps, and the steps past the target are said (this fake has no epoch bound: 6 past)."""
    job = make_job(tmp_path, "counter=reset,oom_at=7,step_s=0.1", save_every_s=0.5,
                   config_extra={"lr_scheduler": "cosine", "lr_warmup_steps": 2})
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["oom"]
    configs = [toml.load(argv[argv.index("--config_file") + 1]) for argv in commands(job)]
    assert len(configs) == 2 and all(c["max_train_steps"] == STEPS for c in configs)
    log = (job.output_dir / DECISIONS_LOG).read_text()
    assert "max_train_steps is kept, since the cosine learning-rate schedule is drawn over it" in log
    assert "trained 6 step(s) past the target 20" in log


@pytest.mark.parametrize(("config", "reads"), [
    ({}, False), ({"lr_scheduler": "constant"}, False), ({"lr_scheduler": "cosine"}, True),
    ({"lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 10}, False),
    ({"lr_scheduler": "constant_with_warmup", "lr_warmup_steps": 0.1}, True), ({"lr_scheduler": "linear"}, True)])
def test_which_schedules_sd_scripts_draws_over_max_train_steps(config, reads):
    from autotune.recovery.sd_scripts import schedule_reads_max_steps

    assert schedule_reads_max_steps(config) is reads


def test_fake_kohya_counter_after_resume_still_ends_at_the_target_with_the_right_data(tmp_path):
    """sd-scripts' own resume (its train_network.py read by hand, the fake's ``counter=kohya``): its counter
    restarts at the remainder within an epoch and its epoch count bounds the run. Its first save after the
    resume shows the offset; the run is relaunched, stops at its epoch bound short of the target, is continued
    from its end state (whose bar total can equal max_train_steps: still counted from the resume step) and ends
    at exactly step 20 with the data drawn in order, as sd-scripts itself did by hand (SD3, 400 steps).
    With gradient accumulation above 1 its skip mixes micro-batches and optimizer steps (``initial_step *=
    gradient_accumulation_steps`` then divided by optimizer steps per epoch): it resumes at another data position,
    which the fake reproduces and no wrapper argument can correct."""
    job = make_job(tmp_path, "counter=kohya,stall_at=8,step_s=0.1", save_every_s=0.5, stall_timeout_s=1.5)
    result = supervise(job)  # a stall retries the same settings: accumulation stays 1 (see the note below)
    assert result.ok, result.message
    assert result.retries[0]["failure"] == "stall" and result.retries[0]["resume_step"] == 7
    # relaunched to stop at 20, it stops at its epoch bound (15, epochs of 3 steps); continued from there its
    # counter starts at 0 and it cannot be told to stop at 20 (max_train_steps must exceed the start step), so it
    # ends with its last epoch at 21: one step past, said in the log, every step's data in order
    assert [r["failure"] for r in result.retries] == ["stall", "continue", "continue"]
    w, meta = read_fake_lora(result.output_file)
    assert meta["fake_true_steps"] == str(STEPS + 1) and w == pytest.approx(expected_w(STEPS + 1))
    assert "trained 1 step(s) past the target 20" in (job.output_dir / DECISIONS_LOG).read_text()
    ledger = json.loads((job.output_dir / SD_SCRIPTS_LEDGER).read_text())
    assert ledger["target_steps"] == STEPS and ledger["states"]["lora-state"]["step"] == STEPS + 1


def test_a_run_of_the_users_sd_scripts_is_planned_for_the_one_process_it_trains_in(tmp_path):
    """The watchdog runs the user's sd-scripts in one process: a run planned for two cards (``--gpus 2``) would
    write what one process does not train (the effective batch of two, DeepSpeed's split state, our engine's
    sharding keys). Planned for one card: config.toml carries none of them, and the fake trains to its end."""
    data = make_dataset(tmp_path, pngs=True)
    out = tmp_path / "run"
    done = _cli("run", str(data), "--model", str(diffusers_folder(tmp_path)), "--engine", f"sd-scripts={FAKE_SCRIPTS}",
                "--gpu", "RTX 3060", "--gpus", "2", "--optimizer", "AdamW", "--rank", "64", "--out", str(out),
                env=fake_env(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    config = toml.loads((out / "config.toml").read_text())
    assert not {"fsdp", "shard_optimizer_state", "deepspeed", "ddp_gradient_as_bucket_view"} & set(config)
    plan = json.loads((out / "autotune_plan.json").read_text())
    assert {c["key"]: c["value"] for c in plan["choices"]}.get("num_processes", 1) == 1
