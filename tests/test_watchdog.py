"""Watchdog against a fake engine child (real subprocesses, real files, real signals).

The fake follows the engine's child-process contract (tests/fixtures/fake_engine.py) and trains a
single number whose final value depends only on the optimizer steps taken, so "nothing lost" is
checkable exactly. Real-engine end-to-end runs are in test_run_e2e.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import toml
from fixtures.fake_engine import fake_memory_mib, fake_settings
from safetensors import safe_open

from autotune.layout import DECISIONS_JSONL, DECISIONS_LOG
from autotune.recovery.engine import CompatEngine
from autotune.recovery.ladder import LadderLimits
from autotune.recovery.watchdog import Job, clean_partial_files, supervise
from sd_scripts_compat.facts.contract import newest_state

FAKE = Path(__file__).parent / "fixtures" / "fake_engine.py"
STEPS = 20


def expected_w(steps: int) -> float:
    return sum(0.5 ** (s % 7) for s in range(steps))


def make_job(tmp_path: Path, rules: str, *, batch: int = 8, budget: float = 250.0, **kw) -> Job:
    out = tmp_path / "out"
    out.mkdir()
    config = out / "config.toml"
    config.write_text(toml.dumps({
        "output_dir": str(out), "output_name": "lora", "max_train_steps": STEPS,
        "train_batch_size": batch, "gradient_accumulation_steps": 1, "resolution": "64,64",
        "optimizer_type": "AdamW", "network_dim": 8,
    }))
    settings = fake_settings(toml.loads(config.read_text()))
    env = {"PATH": "/usr/bin:/bin", "FAKE_ENGINE": rules}
    if "PYTHONPATH" in os.environ:  # a checkout that is not the installed one: the fake imports the contract
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    engine = CompatEngine(entry=[str(FAKE)], save_state_every_s=kw.pop("save_state_every_s", 30.0))
    return Job(config_path=config, output_dir=out, settings=settings, limits=LadderLimits(budget_mib=budget),
               predict=fake_memory_mib, env=env, echo=False, engine=engine, **kw)


def final_weights(path: str) -> tuple[float, dict[str, str]]:
    with safe_open(path, "np") as handle:
        return float(handle.get_tensor("w")[0]), handle.metadata()


def test_fake_engine_oom_steps_down_keeps_effective_batch(tmp_path):
    job = make_job(tmp_path, "oom_batch_gt=2")
    result = supervise(job)
    assert result.ok, result.message
    assert (result.final_settings.train_batch_size, result.final_settings.gradient_accumulation_steps) == (2, 4)
    w, meta = final_weights(result.output_file)
    assert w == pytest.approx(expected_w(STEPS))
    assert meta["ss_steps"] == str(STEPS)
    retries = json.loads(meta["ss_autotune_retries"])
    assert len(retries) == 1 and retries[0]["failure"] == "oom"
    assert retries[0]["changes"]["train_batch_size"] == [8, 2]
    assert "effective batch" in retries[0]["reason"]
    final = toml.load(job.output_dir / "config.final.toml")
    assert (final["train_batch_size"], final["gradient_accumulation_steps"]) == (2, 4)
    lines = [json.loads(x) for x in (job.output_dir / DECISIONS_JSONL).read_text().splitlines()]
    assert [x["event"] for x in lines][-1] == "done"
    assert "oom" in (job.output_dir / DECISIONS_LOG).read_text()


def test_fake_engine_oom_mid_run_resumes_at_exact_step(tmp_path):
    job = make_job(tmp_path, "oom_at=7", batch=2, budget=1000.0)
    result = supervise(job)
    assert result.ok, result.message
    assert (result.final_settings.train_batch_size, result.final_settings.gradient_accumulation_steps) == (1, 2)
    assert result.retries[0]["step"] == 7 and result.retries[0]["resume_step"] == 7
    assert result.retries[0]["steps_lost"] == 0
    assert final_weights(result.output_file)[0] == pytest.approx(expected_w(STEPS))


def test_fake_engine_sigkill_resumes_from_last_state(tmp_path):
    job = make_job(tmp_path, "kill_at=12,step_s=0.03", batch=2, budget=1000.0, save_state_every_s=0.1)
    result = supervise(job)
    assert result.ok, result.message
    record = result.retries[0]
    assert record["failure"] == "os_kill" and 0 < record["resume_step"] <= 12
    assert record["steps_lost"] == 12 - record["resume_step"]
    assert result.final_settings.train_batch_size == 1  # treated as an OOM: stepped down
    assert final_weights(result.output_file)[0] == pytest.approx(expected_w(STEPS))
    leftovers = [p.name for p in job.output_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_fake_engine_stall_is_killed_and_retried(tmp_path):
    job = make_job(tmp_path, "stall_at=4", batch=1, budget=1000.0, stall_timeout_s=1.0, save_state_every_s=0.05)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["stall"]
    assert result.final_settings == job.settings
    assert final_weights(result.output_file)[0] == pytest.approx(expected_w(STEPS))


def test_a_long_load_is_not_a_stall_but_a_frozen_step_is(tmp_path):
    """Loading 48 MiB may take the base limit plus 3 s (at the slow-disk floor of 16 MiB/s): a 2.5 s silent load
    with a 1 s base passes; the frozen step afterwards is killed after about 1 s (the training limit: ten usual
    steps, at least the base when that is under a minute) and resumed, with nothing lost."""
    job = make_job(tmp_path, f"load_s=2.5,load_bytes={48 * 2**20},stall_at=6", batch=1, budget=1000.0,
                   stall_timeout_s=1.0, save_state_every_s=0.05)
    result = supervise(job)
    assert result.ok, result.message
    assert [r["failure"] for r in result.retries] == ["stall"]  # the frozen step only, not the load
    assert "no progress while training for 1 s" in result.retries[0]["message"], result.retries[0]
    assert final_weights(result.output_file)[0] == pytest.approx(expected_w(STEPS))


def test_fake_engine_user_error_stops_with_its_message(tmp_path):
    result = supervise(make_job(tmp_path, "user_error"))
    assert not result.ok and result.outcome == "user_error"
    assert "lerning_rate" in result.message and result.retries == []


def test_fake_engine_disk_full_is_final_and_never_retried_as_an_oom(tmp_path):
    result = supervise(make_job(tmp_path, "disk_full_at=3", batch=2, budget=1000.0, max_retries=5))
    assert not result.ok and result.outcome == "disk_full"
    assert result.retries == [] and len(result.attempts) == 1  # a smaller batch needs no less disk
    assert "disk full while saving" in result.message and "needs about 1.2 MiB" in result.message
    log = (tmp_path / "out" / DECISIONS_JSONL).read_text()
    assert '"event": "disk_full"' in log


def test_sigterm_to_the_supervisor_is_forwarded_to_the_child_and_ends_as_interrupted(tmp_path):
    """A real SIGTERM to this process while the child runs: the watchdog's handler sends it to the child's
    process group and waits; the attempt is "interrupted" (not a crash, not retried), and our own previous
    SIGTERM handler is back afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers can only be installed in the main thread; the SIGTERM would end this process")

    def send_sigterm_soon(_pid: int) -> None:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

    before = signal.getsignal(signal.SIGTERM)
    job = make_job(tmp_path, "step_s=0.2", batch=1, budget=1000.0, on_child_start=send_sigterm_soon)
    result = supervise(job)
    assert result.outcome == "interrupted" and result.retries == [] and len(result.attempts) == 1
    assert result.attempts[0].stop_signal == signal.SIGTERM and result.attempts[0].returncode == -signal.SIGTERM
    assert "SIGTERM" in result.message
    assert signal.getsignal(signal.SIGTERM) == before


def test_fake_engine_nothing_fits_says_what_is_needed(tmp_path):
    result = supervise(make_job(tmp_path, "oom_batch_gt=0", budget=50.0))
    assert result.outcome == "exhausted"
    assert "micro-batch 1" in result.message and "needs about" in result.message
    assert "GiB" in result.message


def test_fake_engine_retries_are_bounded(tmp_path):
    result = supervise(make_job(tmp_path, "oom_batch_gt=0", budget=1000.0, max_retries=2))
    assert result.outcome in ("retries_exhausted", "exhausted")
    assert len(result.retries) <= 2
    assert len(result.attempts) == len(result.retries) + 1


def test_fake_engine_uncaught_oom_is_retried_but_a_bug_stops(tmp_path):
    result = supervise(make_job(tmp_path, "crash=oom", batch=2, budget=1000.0))
    assert result.ok, result.message
    assert result.retries[0]["failure"] == "oom" and "can't allocate" in result.retries[0]["message"]
    (tmp_path / "b").mkdir()
    bug = supervise(make_job(tmp_path / "b", "crash=bug", batch=2, budget=1000.0))
    assert bug.outcome == "crash" and "a bug in the engine" in bug.message and bug.retries == []


def test_clean_partial_files_restores_and_removes(tmp_path):
    (tmp_path / ".lora.safetensors.abc.tmp").write_bytes(b"half")
    (tmp_path / ".lora-step00000004-state.xyz").mkdir()
    orphan = tmp_path / "lora-step00000002-state.old"
    orphan.mkdir()
    (orphan / "train_state.json").write_text(json.dumps({"counters": {"global_step": 2}}))
    removed = clean_partial_files(tmp_path)
    assert sorted(removed) == [".lora-step00000004-state.xyz", ".lora.safetensors.abc.tmp"]
    assert newest_state(tmp_path) == (tmp_path / "lora-step00000002-state", 2)
