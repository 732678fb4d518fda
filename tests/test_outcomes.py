"""The watchdog in parts: the contract's pure ``classify`` (facts -> Outcome), and the supervisor driving a
trainer it has never heard of through the one engine protocol (real subprocesses, real files)."""

from __future__ import annotations

import ast
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from autotune.recovery.attempt import AttemptResult
from autotune.recovery.engine import AttemptFiles
from autotune.recovery.ladder import LadderLimits
from autotune.recovery.watchdog import Job, supervise
from sd_scripts_compat.facts.contract import (
    BAD_DATA_EXIT_CODE,
    DISK_FULL_EXIT_CODE,
    DIVERGED,
    DIVERGED_EXIT_CODE,
    OOM,
    OOM_EXIT_CODE,
    PROGRESS,
    USER_ERROR_EXIT_CODE,
    ExitFacts,
    Outcome,
    classify,
)
from sd_scripts_compat.facts.settings import TrainSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("facts", "outcome", "words"), [
    (ExitFacts(0), Outcome.DONE, "finished"),
    (ExitFacts(OOM_EXIT_CODE, events={OOM: {"message": "CUDA out of memory. Tried 2 GiB"}}), Outcome.OOM,
     "Tried 2 GiB"),
    (ExitFacts(OOM_EXIT_CODE), Outcome.OOM, "out of memory"),
    (ExitFacts(DIVERGED_EXIT_CODE, events={DIVERGED: {"reason": "loss is nan at step 5"}}), Outcome.DIVERGED,
     "loss is nan"),
    (ExitFacts(-signal.SIGKILL), Outcome.OS_KILL, "SIGKILL"),
    (ExitFacts(USER_ERROR_EXIT_CODE, stderr_tail=("train_network: error: x.toml: bad key",)), Outcome.USER_ERROR,
     "bad key"),
    (ExitFacts(DISK_FULL_EXIT_CODE, stderr_tail=("out/: disk full",)), Outcome.DISK_FULL, "disk full"),
    (ExitFacts(BAD_DATA_EXIT_CODE, stderr_tail=("m.safetensors: ... hold NaN or Inf",)), Outcome.BAD_DATA, "NaN"),
    (ExitFacts(143), Outcome.INTERRUPTED, "exit code 143"),
    (ExitFacts(1, stop_signal=signal.SIGINT), Outcome.INTERRUPTED, "SIGINT"),
    (ExitFacts(-signal.SIGTERM, stalled_after_s=5.0, events={PROGRESS: {"step": 7}}), Outcome.STALL,
     "last step 7"),
    (ExitFacts(1, stderr_tail=("caching latents", "RuntimeError: CUDA error: out of memory")), Outcome.OOM,
     "CUDA error"),
    (ExitFacts(1, stderr_tail=("ValueError: a bug",)), Outcome.CRASH, "exit code 1): ValueError: a bug"),
    (ExitFacts(-11), Outcome.CRASH, "signal 11"),
])
def test_classify_reads_the_facts_alone(facts: ExitFacts, outcome: Outcome, words: str) -> None:
    got, message = classify(facts)
    assert got is outcome and words in message


def test_outcomes_read_and_write_as_their_plain_words() -> None:
    assert json.dumps({"failure": Outcome.OS_KILL}) == '{"failure": "os_kill"}'
    assert f"{Outcome.OOM}" == str(Outcome.OOM) == "oom" and Outcome("stall") is Outcome.STALL
    assert {o for o in Outcome if o.final} == {Outcome.DONE, Outcome.USER_ERROR, Outcome.DISK_FULL,
                                              Outcome.BAD_DATA, Outcome.INTERRUPTED, Outcome.CRASH}


CHILD = """
import sys, time
for step in range(1, 4):
    print(f"STEP {step}", flush=True)
    time.sleep(0.05)
open(sys.argv[1], "w").write("weights")
"""


class EchoEngine:
    """A trainer that follows none of our contract: it prints its steps and writes one file. Its adapter makes
    the progress events from the output and says where the result is: the whole of what a new engine adds."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.pids: list[int] = []

    def attempt_argv(self, attempt: int, files: AttemptFiles, state: tuple[Path, int] | None, log: object) -> list[str]:
        return [sys.executable, "-c", CHILD, str(self.out / "lora.bin")]

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None:
        return None

    def line_handler(self, events_dir: Path) -> Callable[[str], None]:
        from sd_scripts_compat.facts.contract import write_event

        def feed(line: str) -> None:
            self.lines.append(line)
            if line.startswith("STEP "):
                write_event(events_dir, PROGRESS, {"step": int(line.split()[1])})
        return feed

    def child_started(self, pid: int) -> None:
        self.pids.append(pid)

    def finish(self, result: AttemptResult, log: object) -> AttemptResult:
        from dataclasses import replace

        return replace(result, done_event={"output_file": str(self.out / "lora.bin"), "steps": 3})


def test_the_supervisor_runs_an_engine_it_has_never_heard_of(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.toml").write_text('output_dir = "x"\n')
    engine = EchoEngine(out)
    job = Job(config_path=out / "config.toml", output_dir=out, settings=TrainSettings(),
              limits=LadderLimits(budget_mib=1e6), predict=lambda s: 1.0, engine=engine, echo=False,
              stall_timeout_s=30)
    result = supervise(job)
    assert result.ok and result.outcome is Outcome.DONE and result.output_file == str(out / "lora.bin")
    assert engine.lines == ["STEP 1", "STEP 2", "STEP 3"] and len(engine.pids) == 1
    assert (out / "lora.bin").read_text() == "weights"


def test_the_supervisor_names_no_engine() -> None:
    """``supervise`` and its helpers never ask which trainer runs: no engine module is imported, no class named."""
    source = (ROOT / "autotune" / "recovery" / "watchdog.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "autotune.recovery.sd_scripts" not in imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not names & {"SdScriptsEngine", "isinstance_engine"}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "isinstance" and isinstance(node.args[1], ast.Name) and "Engine" in node.args[1].id]
    assert not calls


# ---- several processes: a failed collective, the launcher's account, any process's oom.json -----------------

@pytest.mark.parametrize(("message", "kind"), [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[127.0.0.1]:22449. This is typically caused by a remote worker crashing.", "peer"),  # gloo, as seen here
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
     "Timeout(ms)=600000) ran for 600018 milliseconds before timing out.", "timeout"),  # NCCL's watchdog
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
     "operation to complete", "timeout"),
    ("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", None),
])
def test_a_failed_collective_is_told_from_other_errors(message, kind):
    from sd_scripts_compat.facts.contract import collective_failure

    assert collective_failure(RuntimeError(message)) == kind


def test_several_processes_outcomes_come_from_the_events_and_the_launchers_summary():
    from sd_scripts_compat.facts.contract import COMM, COMM_TIMEOUT_FIX, OOM, ExitFacts, Outcome, classify

    oom = classify(ExitFacts(returncode=1, events={OOM: {"message": "CUDA out of memory", "rank": 1}}))
    assert oom == (Outcome.OOM, "CUDA out of memory")
    timeout = classify(ExitFacts(returncode=1, events={COMM: {"message": "Watchdog caught collective operation "
                                                                      "timeout", "rank": 0}}))
    assert timeout[0] is Outcome.COMM_TIMEOUT and COMM_TIMEOUT_FIX in timeout[1]
    assert Outcome.COMM_TIMEOUT.same_settings and not Outcome.COMM_TIMEOUT.final
    summary = ("Root Cause (first observed failure):", "[0]:", "  time      : 2026-12-07_10:46:38",
               "  rank      : 1 (local_rank: 1)", "  exitcode  : -9 (pid: 17119)  (SIGKILL)")
    killed = classify(ExitFacts(returncode=1, stderr_tail=summary))
    assert killed[0] is Outcome.OS_KILL and "process 1 of the run" in killed[1]
    crashed = classify(ExitFacts(returncode=1, stderr_tail=(*summary[:4], "  exitcode  : 1 (pid: 17119)")))
    assert crashed[0] is Outcome.CRASH


def test_a_timed_out_collective_written_by_a_child_is_read_back_as_its_outcome(tmp_path: Path) -> None:
    """The engine's process that saw a collective time out writes comm.json and exits 89 (``finish_collective``);
    the attempt reads it back from the events folder (a child process here, the event written by the engine's own
    ``write_event``): the outcome is comm_timeout with its fix, and a next attempt starts without it."""
    from autotune.recovery.attempt import run_attempt
    from sd_scripts_compat.facts.contract import COLLECTIVE_EXIT_CODE, COMM, COMM_TIMEOUT_FIX, event_path

    events = tmp_path / "events"
    child = ("import sys; from sd_scripts_compat.facts.contract import COMM, write_event; "
             f"write_event({str(events)!r}, COMM, {{'step': 3, 'rank': 0, 'message': 'Timed out waiting 60000ms "
             f"for recv operation to complete'}}); sys.exit({COLLECTIVE_EXIT_CODE})")
    result = run_attempt([sys.executable, "-c", child], env=dict(os.environ), events_dir=events,
                         log_path=tmp_path / "log.txt", stall_timeout_s=300, echo=False)
    assert result.outcome is Outcome.COMM_TIMEOUT, result
    assert "Timed out waiting 60000ms" in result.message and COMM_TIMEOUT_FIX in result.message
    run_attempt([sys.executable, "-c", "pass"], env=dict(os.environ), events_dir=events,
                log_path=tmp_path / "log.txt", stall_timeout_s=300, echo=False)
    assert not event_path(events, COMM).exists()  # cleared before the next child starts
