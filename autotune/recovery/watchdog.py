"""Supervise a training engine as a child process and recover from out-of-memory, divergence, kills and stalls.

The engine is a separate process on purpose: after a CUDA OOM the allocator can be fragmented and
the OS OOM killer leaves nothing to catch, so the only reliable recovery is a fresh process that
resumes from the newest saved state. Three parts, each with one concern:

- ``recovery.attempt`` runs one child (spawn, pump its output, watch for stalls, forward Ctrl-C) and returns
  the facts, classified by the contract's pure ``classify`` into an :class:`~sd_scripts_compat.facts.contract.Outcome`;
- ``recovery.engine``: the one protocol every trainer implements (our engine, the user's sd-scripts, ...);
- this module decides by outcome: an OOM steps down on the memory ladder (``recovery.ladder``); a diverged run
  (a non-finite or exploding loss) is rolled back to its newest state, which the engine saves only from finite
  weights, and steps through the stability ladder (``recovery.stability``); a stall or a short stop resumes as
  it was; after an attempt's first steady steps, measured headroom steps up (``recovery.step_up``: the engine
  makes the change in the process where it can, else the attempt stops at a step boundary and the next resumes
  with larger settings), and a peak that will not fit the data's largest batch steps down the same way; the rest
  is final. Every decision goes to
  the same decision log and retry log (``ss_autotune_retries``
  in the final LoRA; config.final.toml holds the changed keys).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.hardware.gpu_usage import GpuUsage
from autotune.layout import (
    CHILD_LOG,
    DECISIONS_LOG,
    EVENTS_DIR,
    FINAL_CONFIG,
    FINAL_DATASET_CONFIG,
    RETRY_LOG,
    RUN_STATE,
    STATE_DIR,
    TRAINER_PID,
)
from autotune.measure.store import measured_figure
from autotune.recovery.attempt import AttemptResult, child_env, run_attempt
from autotune.recovery.decisions import DecisionLog
from autotune.recovery.engine import AttemptFiles, CompatEngine, Engine
from autotune.recovery.ladder import Decision, Exhausted, LadderLimits, next_settings
from autotune.recovery.stability import (
    RESTART,
    RUNGS,
    StabilityDecision,
    StabilityLimits,
    Unstable,
    next_stable_settings,
)
from autotune.recovery.step_up import MemoryWatcher, StepDown, StepUp, next_move
from sd_scripts_compat.facts.atomic import write_json_atomic
from sd_scripts_compat.facts.contract import CONTROL_FILE, Outcome
from sd_scripts_compat.facts.errors import UserError
from sd_scripts_compat.facts.settings import TrainSettings
from sd_scripts_compat.facts.settings_space import write_config, write_dataset_config

if TYPE_CHECKING:
    from autotune.recovery.stability import StabilityDecision

# ---------------------------------------------------------------- state folders and configs


def clean_partial_files(output_dir: Path) -> list[str]:
    """Remove what a killed child left half-written: hidden temp files/folders of atomic writes.

    A state folder caught between its two renames (only ``X-state.old`` left) is put back instead.
    """
    removed: list[str] = []
    if not output_dir.is_dir():
        return removed
    for entry in sorted(output_dir.iterdir()):
        name = entry.name
        if name.endswith("-state.old") and entry.is_dir():
            target = entry.with_name(name[: -len(".old")])
            if target.exists():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(name)
            else:
                os.replace(entry, target)
            continue
        if name.startswith(".") and (".tmp" in name or "-state." in name or name.endswith(".part")):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(name)
    return removed


# ---------------------------------------------------------------- the supervisor


@dataclass
class Job:
    """One training run to supervise. ``config_path`` (and ``dataset_config_path``) are kohya TOMLs; ``engine``
    is the trainer (default: ours, ``sd_scripts_compat.train_network``)."""

    config_path: Path
    output_dir: Path
    settings: TrainSettings
    limits: LadderLimits
    predict: Callable[[TrainSettings], float]
    dataset_config_path: Path | None = None
    engine: Engine = field(default_factory=CompatEngine)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cuda: bool = False
    max_retries: int = 5
    stall_timeout_s: float = 600.0
    resume: bool = False
    preexec_fn: Callable[[], None] | None = None
    echo: bool = True
    prior_retries: list[dict[str, Any]] = field(default_factory=list)  # from an interrupted run (--resume)
    train_output_dir: Path | None = None  # the engine's output_dir (the LoRA); default: output_dir
    states_at: Path | None = None  # where the engine keeps its states; default: the engine's output_dir
    extra_state: dict[str, Any] = field(default_factory=dict)  # kept in autotune_run.json for --resume
    budget_kind: str = "device"  # what limits.budget_mib measures: device | address_space | ram | emulated_card
    stability: StabilityLimits = field(default_factory=StabilityLimits)
    on_child_start: Callable[[int], None] | None = None  # called with each child's pid (tests, benches)
    images_per_s: Callable[[TrainSettings], float] | None = None  # the speed model; None: no stepping up
    fixed: frozenset[str] = frozenset()  # TrainSettings fields the user pinned: a step up leaves them as given
    sample_gpu: bool = False  # NVML on the card: the child's GPU memory (a trainer reporting no CUDA peak of its
    # own) and what is free now (a step up never takes memory another process took since the start)

    @property
    def states_dir(self) -> Path:
        return self.states_at or self.train_output_dir or self.output_dir

    def child_started(self, pid: int) -> None:
        (self.output_dir / TRAINER_PID).write_text(str(pid), encoding="ascii")  # --resume checks it has ended
        self.engine.child_started(pid)
        if self.on_child_start is not None:
            self.on_child_start(pid)


@dataclass
class RunResult:
    ok: bool
    outcome: Outcome
    message: str
    output_file: str | None
    final_settings: TrainSettings
    retries: list[dict[str, Any]]
    attempts: list[AttemptResult]


@dataclass
class _Run:
    """The supervisor's running record: the settings now, what was tried, every attempt and retry."""

    job: Job
    log: DecisionLog
    settings: TrainSettings
    retries: list[dict[str, Any]]
    attempts: list[AttemptResult] = field(default_factory=list)
    tried: list[TrainSettings] = field(default_factory=list)  # settings that ran out of memory
    resume_ok: bool = False
    move: StepUp | StepDown | None = None  # what the last attempt stopped for

    def result(self, ok: bool, outcome: Outcome, message: str, output: str | None = None) -> RunResult:
        return RunResult(ok, outcome, message, output, self.settings, self.retries, self.attempts)


@dataclass(frozen=True)
class _Next:
    """What follows a failed attempt: the next settings, why, and whether the newest state still loads."""

    settings: TrainSettings
    reason: str
    resume_compatible: bool = True
    decision: Decision | StabilityDecision | StepUp | None = None  # (a step down ahead of an OOM: its Decision)


def _attempt_configs(job: Job, attempt: int, settings: TrainSettings) -> tuple[Path, Path | None]:
    if settings == job.settings:
        return job.config_path, job.dataset_config_path
    config = job.output_dir / STATE_DIR / f"config.attempt{attempt}.toml"
    header = f"# attempt {attempt} after a step down (out of memory, instability) or up: {settings.describe()}\n"
    write_config(job.config_path, config, settings, header, base=job.settings,
                 keys=job.limits.keys)
    dataset = None
    if job.dataset_config_path is not None:
        dataset = job.output_dir / STATE_DIR / f"dataset.attempt{attempt}.toml"
        write_dataset_config(job.dataset_config_path, dataset, settings, header, base=job.settings)
    return config, dataset


def measured_mib(result: AttemptResult, budget_kind: str) -> float | None:
    """The memory the failed attempt was seen to use, in the budget's own unit.

    "device": the engine's CUDA peak or the allocator's OOM point, whichever is more, with the CUDA context it
    measured at start (both leave it out; the card's budget holds it) (else its peak RSS);
    "address_space": the peak address space sampled from /proc (what RLIMIT_AS caps); "ram": peak resident
    memory; "emulated_card": the card's count at the op that ran out of it.
    """
    memory = (result.oom_event or {}).get("memory") or {}
    if budget_kind == "address_space":
        return result.peak_vm_mib
    if budget_kind == "emulated_card":
        peak = memory.get("emulated_card_peak_mib")
        return float(peak) if isinstance(peak, (int, float)) and peak > 0 else None
    if budget_kind == "device":  # the reserved peak, or where the allocator says it struck if that is more
        figures = [float(v) for v in (memory.get("cuda_max_reserved_mib"), memory.get("oom_point_mib"))
                   if isinstance(v, (int, float)) and v > 0]
        if figures:
            return max(figures) + (measured_figure(memory.get("cuda_context_mib")) or 0.0)
    keys = ("cuda_max_allocated_mib",) if budget_kind == "device" else ()
    for key in (*keys, "peak_rss_mib"):
        if isinstance(memory.get(key), (int, float)) and memory[key] > 0:
            return float(memory[key])
    if budget_kind == "device" and result.peak_gpu_mib:
        return result.peak_gpu_mib  # what NVML showed of a trainer that reports no CUDA peak
    return result.peak_rss_mib


def supervise(job: Job) -> RunResult:
    """Run ``job`` to the end: retry on OOM / divergence / OS kill / stall with stepped-down settings, from
    the newest state.

    Stops on done, a user error (exit 2), a full disk (28), an interrupt (130 / 143), a crash, when a ladder
    is exhausted, or after ``max_retries`` retries.
    """
    for folder in (job.output_dir / STATE_DIR, (job.output_dir / DECISIONS_LOG).parent):
        folder.mkdir(parents=True, exist_ok=True)
    run = _Run(job, DecisionLog(job.output_dir, job.echo), job.settings, list(job.prior_retries),
               resume_ok=job.resume)
    attempt = len(run.retries)
    run.log.write("start", f"training with {run.settings.describe()}", settings=run.settings.to_event())
    while True:
        result = _attempt(run, attempt)
        run.attempts.append(result)
        if result.outcome is Outcome.DONE:
            return _finished(run, result)
        if result.outcome is Outcome.STEP_UP and run.move is not None:
            _retry(run, attempt, *_moved(run, result), _failed_step(result))
            attempt += 1
            continue
        if result.outcome.final:
            # a final error is shown once, by the caller (`autotune run: error: ...`), not here as well
            run.log.write(result.outcome, result.message, returncode=result.returncode,
                          show=result.outcome is Outcome.INTERRUPTED)
            return run.result(False, result.outcome, result.message)
        failed_step = _failed_step(result)
        if _failures(run) >= job.max_retries:
            message = (f"giving up after {_failures(run)} retries ({result.outcome} at step {failed_step}); "
                       f"last settings: {run.settings.describe()}; see {job.output_dir / DECISIONS_LOG}")
            run.log.write("give_up", message)
            return run.result(False, Outcome.RETRIES_EXHAUSTED, message)
        step = _decide(run, result)
        if isinstance(step, RunResult):
            return step
        _retry(run, attempt, result, step, failed_step)
        attempt += 1


def _moved(run: _Run, result: AttemptResult) -> tuple[AttemptResult, _Next]:
    """An attempt stopped for the watcher's move: a step up, or a step down before the OOM it foresaw (that
    attempt's outcome is then ``STEP_DOWN``, and its settings are never stepped up to again)."""
    move = run.move
    if isinstance(move, StepDown):
        run.tried.append(run.settings)
        decision = move.decision
        return replace(result, outcome=Outcome.STEP_DOWN), _Next(decision.settings, move.reason,
                                                                 decision.resume_compatible, decision)
    assert move is not None
    return result, _Next(move.settings, move.reason, decision=move)


def _attempt(run: _Run, attempt: int) -> AttemptResult:
    """Prepare and run one attempt: clean what a killed child left, write its configs, find its state."""
    job, log = run.job, run.log
    removed = clean_partial_files(job.output_dir) + clean_partial_files(job.states_dir)
    if removed:
        log.write("cleanup", f"removed half-written files of a killed run: {', '.join(removed)}")
    config, dataset = _attempt_configs(job, attempt, run.settings)
    state = job.engine.newest_state(job.states_dir) if run.resume_ok else None
    files = AttemptFiles(config, dataset, job.output_dir / EVENTS_DIR, job.output_dir / RETRY_LOG, job.states_dir,
                         run.settings)
    write_json_atomic(files.retry_log, run.retries)
    write_json_atomic(job.output_dir / RUN_STATE, {
        **job.extra_state, "settings": run.settings.to_event(), "attempt": attempt, "retries": run.retries,
        "config": str(job.config_path)})
    argv = job.engine.attempt_argv(attempt, files, state, log)
    if state is not None:
        log.write("resume", f"attempt {attempt}: resuming from {state[0].name} at step {state[1]}",
                  state=str(state[0]), step=state[1])
    gpu = GpuUsage() if job.sample_gpu else None
    if gpu is not None and not gpu.start():
        gpu = None
    (files.events_dir / CONTROL_FILE).unlink(missing_ok=True)  # a change asked of an earlier attempt is not this one's
    watcher = _memory_watcher(run, gpu)
    moves = _Moves(run, attempt, files, watcher, gpu) if watcher is not None else None
    try:
        result = run_attempt(argv, env=child_env(job.env, job.cuda), events_dir=files.events_dir,
                             log_path=job.output_dir / CHILD_LOG, stall_timeout_s=job.stall_timeout_s, echo=job.echo,
                             preexec_fn=job.preexec_fn, on_start=job.child_started,
                             on_line=job.engine.line_handler(files.events_dir),
                             on_progress=moves.see if moves is not None else None, gpu_usage=gpu)
    finally:
        if gpu is not None:
            gpu.close()
    run.move = moves.ended() if moves is not None else None
    return job.engine.finish(result, log)


@dataclass
class _Moves:
    """An attempt's step ups and downs: one the engine makes in the process (gradient checkpointing, for our
    engine: ``control.json``, applied at its next step boundary, the run going on), or one the attempt stops for
    (SIGTERM at the step boundary of a trainer that saves its state on it; an engine that stops its trainer itself
    after the next saved state says so), resumed by the watchdog with the new settings."""

    run: _Run
    attempt: int
    files: AttemptFiles
    watcher: MemoryWatcher
    gpu: GpuUsage | None
    pending: tuple[int, StepUp] | None = None  # asked of the engine in the process, not yet applied
    stop_for: StepUp | StepDown | None = None

    def see(self, progress: dict[str, Any], peak_vm: float | None, peak_gpu: float | None) -> bool:
        """The attempt runner's progress hook: True to stop the attempt at its step boundary."""
        if self.pending is not None:
            if progress.get("control") != self.pending[0]:
                return False  # not applied yet: nothing of the new settings is measured
            self._applied(self.pending[1])
        if not self.watcher.see(progress, peak_vm, peak_gpu):
            return False
        move = self.watcher.decision
        if isinstance(move, StepUp) and self.run.job.engine.changes_in_process(move.changes):
            self._ask(move, progress)
            return False
        self.stop_for = move
        return not self.run.job.engine.stop_for_step_up()

    def _ask(self, move: StepUp, progress: dict[str, Any]) -> None:
        run, step = self.run, progress.get("step")
        ident = len(run.retries) + 1
        record: dict[str, Any] = {
            "attempt": self.attempt, "failure": Outcome.STEP_UP, "in_process": True, "step": step,
            "message": "changed in the process at a step boundary", "memory": {},
            "changes": {k: list(v) for k, v in move.changes.items()}, "reason": move.reason,
            "predicted_mib": round(move.predicted_mib, 1), "scale": round(move.scale, 3), "resume_step": step,
            "steps_lost": 0, "seconds_in_attempt": None}
        run.retries.append(record)
        write_json_atomic(self.files.retry_log, run.retries)  # the engine writes it into the LoRA's metadata
        write_json_atomic(self.files.events_dir / CONTROL_FILE,
                          {"id": ident, **{key: new for key, (_, new) in move.changes.items()}})
        self.pending = (ident, move)
        run.log.write(Outcome.STEP_UP, f"attempt {self.attempt}: step up in the process at step {step} (no "
                      f"restart): {move.settings.describe()} because {move.reason}", **record)

    def _applied(self, move: StepUp) -> None:
        """The engine trains with the new settings from here: they are the run's, measured afresh."""
        self.pending, self.run.settings = None, move.settings
        watcher = _memory_watcher(self.run, self.gpu)
        assert watcher is not None  # a watcher made one before
        self.watcher = watcher

    def ended(self) -> StepUp | StepDown | None:
        """What the attempt stopped for; a change asked of the engine and never applied is taken back."""
        if self.pending is not None:
            self.run.retries.pop()  # the record _ask added last: nothing was asked since
            self.run.log.write("note", "the step up asked in the process was not applied before the attempt ended")
        return self.stop_for


def _failures(run: _Run) -> int:
    """The retries that count against ``--max-retries``: every one but a step up or a step down ahead of an OOM."""
    return sum(r.get("failure") not in (Outcome.STEP_UP, Outcome.STEP_DOWN) for r in run.retries)


def _memory_watcher(run: _Run, gpu: GpuUsage | None = None) -> MemoryWatcher | None:
    """The attempt's step-up and step-down check (None: ``--no-step-up``, or no speed model for this engine). With
    ``gpu`` (NVML on this card) the budget is also at most what the trainer holds plus what is free now: memory
    another process took since the start is not stepped into."""
    job = run.job
    images_per_s = job.images_per_s
    if images_per_s is None:
        return None

    def decide(settings: TrainSettings, measured: float, progress: dict[str, Any],
               up: bool) -> StepUp | StepDown | None:
        live = gpu.usable_now_mib() if gpu is not None else None
        budget = min(job.limits.budget_mib, live) if live is not None else job.limits.budget_mib
        try:
            return next_move(settings, limits=job.limits, budget_mib=budget, measured_mib=measured,
                             progress=progress, predict=job.predict, images_per_s=images_per_s, tried=run.tried,
                             fixed=job.fixed, up=up)
        except UserError:  # settings the memory model does not cover (a size below its floor): no move, the run goes on
            return None

    return MemoryWatcher(run.settings, decide, job.budget_kind)


def _finished(run: _Run, result: AttemptResult) -> RunResult:
    job = run.job
    output = (result.done_event or {}).get("output_file")
    _write_final_configs(job, run.settings)
    retries = _failures(run)
    ups = sum(r.get("failure") == Outcome.STEP_UP for r in run.retries)
    downs = sum(r.get("failure") == Outcome.STEP_DOWN for r in run.retries)
    stepped = (f" and {ups} step{'' if ups == 1 else 's'} up" if ups else "") + (
        f" and {downs} step{'' if downs == 1 else 's'} down ahead of an OOM" if downs else "")
    run.log.write("done", f"finished after {retries} retr{'y' if retries == 1 else 'ies'}{stepped}; LoRA: {output}; "
                  "final settings in config.final.toml", output_file=output, settings=run.settings.to_event())
    clean_partial_files(job.output_dir)
    clean_partial_files(job.states_dir)
    return run.result(True, Outcome.DONE, "finished", output)


def _decide(run: _Run, result: AttemptResult) -> _Next | RunResult:
    """By outcome: the same settings again (stall, a short stop), the stability ladder (diverged) or the memory
    ladder (OOM, OS kill); a ladder with nothing left ends the run."""
    job, settings = run.job, run.settings
    if result.outcome.same_settings:
        return _Next(settings, "stalled: retrying the same settings from the last state"
                     if result.outcome is Outcome.STALL else result.message)
    if result.outcome is Outcome.DIVERGED:
        stable = _after_divergence(job, result, settings, run.retries)
        if isinstance(stable, Unstable):
            message = stable.message()
            run.log.write("unstable", message, settings=stable.settings.to_event(), tried=list(stable.tried))
            return run.result(False, Outcome.UNSTABLE, message)
        return _Next(stable.settings, stable.reason, stable.resume_compatible, stable)
    failed = settings
    if result.oom_event and isinstance(result.oom_event.get("settings"), dict):
        failed = TrainSettings.from_event(result.oom_event["settings"])
    run.tried.append(failed)
    step = next_settings(failed, job.limits, job.predict, measured_mib(result, job.budget_kind), run.tried)
    if isinstance(step, Exhausted):
        message = step.message()
        run.log.write("exhausted", message, floor=step.floor.to_event(), needed_mib=step.needed_mib)
        return run.result(False, Outcome.EXHAUSTED, message)
    return _Next(step.settings, step.reason, step.resume_compatible, step)


def _retry(run: _Run, attempt: int, result: AttemptResult, step: _Next, failed_step: int | None) -> None:
    """Log the retry, set aside states the new settings cannot load, and move to the new settings."""
    job = run.job
    state_after = job.engine.newest_state(job.states_dir)
    resume_step = state_after[1] if (state_after and step.resume_compatible) else 0
    lost = max(0, failed_step - resume_step) if failed_step is not None else None
    record = _retry_record(attempt, result, step.decision, step.reason, failed_step, resume_step, lost)
    run.retries.append(record)
    restart = "" if step.resume_compatible else " (the saved state does not fit the new network/optimizer: restarting)"
    if isinstance(step.decision, StabilityDecision) and step.decision.rung == RESTART:
        restart = " (restarting from step 0: the saved state is set aside)"
    ended = {Outcome.STEP_UP: "stopped for a step up", Outcome.STEP_DOWN: "stopped for a step down before an OOM"
             }.get(result.outcome, f"failed: {result.outcome}")
    run.log.write(result.outcome, f"attempt {attempt} {ended} at step {failed_step} "
                  f"({result.message[:200]}); next: {step.settings.describe()} because {step.reason}; "
                  f"resume at step {resume_step}, {lost} step(s) lost{restart}", **record)
    if not step.resume_compatible:
        _retire_states(job.states_dir)
    run.settings = step.settings
    run.resume_ok = True  # states the new settings cannot load were retired above


def _after_divergence(job: Job, result: AttemptResult, settings: TrainSettings,
                      retries: list[dict[str, Any]]) -> StabilityDecision | Unstable:
    """The stability ladder's answer to a diverged attempt (rungs already used come from the retry log)."""
    event = result.diverged_event or {}
    failed = settings
    if isinstance(event.get("settings"), dict):
        failed = TrainSettings.from_event(event["settings"])
    step = _failed_step(result)
    previous = retries[-1] if retries and retries[-1].get("failure") == Outcome.DIVERGED else None
    if previous and previous.get("resume_step") and step is not None and step <= (previous.get("step") or 0):
        # Resumed under safer settings, it diverged again before passing the step where the last attempt did:
        # the state's weights are finite but already damaged (a rate too high grows them until they overflow).
        return StabilityDecision(settings=failed, changes={}, rung=RESTART, resume_compatible=False, reason=(
            f"the state at step {previous['resume_step']} diverged again at step {step} under safer settings, so "
            "its weights are already damaged: the same settings again from step 0"))
    used = [r["rung"] for r in retries if r.get("failure") == Outcome.DIVERGED and r.get("rung") in RUNGS]
    max_steps = event.get("max_train_steps") or (result.last_progress or {}).get("max_train_steps")
    return next_stable_settings(failed, job.stability, used=used, diverged_step=step,
                                max_train_steps=max_steps if isinstance(max_steps, int) else None,
                                last_reason=str(event.get("reason") or result.message))


def _retry_record(attempt: int, result: AttemptResult, decision: Decision | StabilityDecision | StepUp | None,
                  reason: str,
                  failed_step: int | None, resume_step: int, lost: int | None) -> dict[str, Any]:
    """One entry of the retry log (and of ``ss_autotune_retries``): what failed, what changed, why."""
    record: dict[str, Any] = {
        "attempt": attempt,
        "failure": result.outcome,
        "step": failed_step,
        "message": result.message[:300],
        "memory": (result.oom_event or {}).get("memory") or {"peak_rss_mib": result.peak_rss_mib,
                                                              "peak_vm_mib": result.peak_vm_mib},
        "changes": {k: list(v) for k, v in (decision.changes.items() if decision is not None else [])},
        "reason": reason,
        "predicted_mib": round(decision.predicted_mib, 1) if isinstance(decision, (Decision, StepUp)) else None,
        "scale": round(decision.scale, 3) if isinstance(decision, (Decision, StepUp)) else None,
        "resume_step": resume_step,
        "steps_lost": lost,
        "seconds_in_attempt": round(result.seconds, 2),
    }
    if isinstance(decision, StabilityDecision):
        event = result.diverged_event or {}
        record["rung"] = decision.rung
        record["detection"] = {key: event.get(key) for key in ("kind", "tripped_at_step", "detected_at_step")}
    return record


def _failed_step(result: AttemptResult) -> int | None:
    for source in (result.diverged_event, result.oom_event, result.last_progress):
        if source and isinstance(source.get("step"), int):
            return source["step"]
    return None


def _retire_states(output_dir: Path) -> None:
    """Move unusable states aside (kept for the user, invisible to the resume search)."""
    for folder in output_dir.glob("*-state"):
        if folder.is_dir():
            os.replace(folder, folder.with_name(folder.name + ".retired"))


def _write_final_configs(job: Job, settings: TrainSettings) -> None:
    header = ("# settings that finally worked (written by autotune run"
              f"{'' if settings == job.settings else ' after a step down or up: see logs/decisions.log'}): "
              f"{settings.describe()}\n")
    write_config(job.config_path, job.output_dir / FINAL_CONFIG, settings, header, base=job.settings,
                 keys=job.limits.keys)
    if job.dataset_config_path is not None:
        write_dataset_config(job.dataset_config_path, job.output_dir / FINAL_DATASET_CONFIG, settings, header,
                                base=job.settings)
