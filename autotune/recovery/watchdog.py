"""Run the training engine as a child process and recover from out-of-memory, divergence, kills and stalls.

The engine is a separate process on purpose: after a CUDA OOM the allocator can be fragmented and
the OS OOM killer leaves nothing to catch, so the only reliable recovery is a fresh process that
resumes from the newest saved state. The watchdog talks to the engine only through the contract in
``sd_scripts_compat.contract``: exit codes, ``progress.json`` / ``oom.json`` / ``diverged.json`` /
``done.json`` in an events folder, kohya-named state folders, and the engine extension flags.

An OOM steps down on the memory ladder (``recovery.ladder``); a diverged run (a non-finite or exploding
loss) is rolled back to its newest state, which the engine saves only from finite weights, and steps
through the stability ladder (``recovery.stability``). Both are logged in the same decision log and
retry log (``ss_autotune_retries`` in the final LoRA; config.final.toml holds the changed keys).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from autotune.recovery.ladder import Decision, Exhausted, LadderLimits, next_settings
from autotune.recovery.stability import (
    RESTART,
    RUNGS,
    StabilityDecision,
    StabilityLimits,
    Unstable,
    next_stable_settings,
)
from sd_scripts_compat.atomic import write_json_atomic
from sd_scripts_compat.config.kohya_toml import read_toml, set_config_values, set_dataset_values, write_toml
from sd_scripts_compat.config.settings import TrainSettings
from sd_scripts_compat.contract import (
    DISK_FULL_EXIT_CODE,
    DIVERGED,
    DIVERGED_EXIT_CODE,
    DONE,
    EVENTS_DIR_FLAG,
    OOM,
    OOM_EXIT_CODE,
    PROGRESS,
    RETRY_LOG_FLAG,
    SAVE_STATE_EVERY_FLAG,
    STOPPED_EXIT_CODES,
    USER_ERROR_EXIT_CODE,
    clear_events,
    event_path,
    looks_like_oom,
    newest_state,
    read_event,
)

ALLOC_CONF = "expandable_segments:True"
DECISIONS_JSONL = "autotune_decisions.jsonl"
DECISIONS_LOG = "autotune_decisions.log"
RETRY_LOG = "autotune_retries.json"
CHILD_LOG = "autotune_train.log"
EVENTS_DIR = "autotune_events"
RUN_STATE = "autotune_run.json"  # the supervisor's own state: current settings and retries, for --resume


@dataclass(frozen=True)
class AttemptResult:
    """How one child process ended."""

    outcome: str  # done | oom | diverged | os_kill | stall | user_error | disk_full | interrupted | crash
    returncode: int | None
    message: str
    oom_event: dict[str, Any] | None = None
    done_event: dict[str, Any] | None = None
    diverged_event: dict[str, Any] | None = None
    last_progress: dict[str, Any] | None = None
    seconds: float = 0.0
    stop_signal: int | None = None  # SIGINT / SIGTERM that we received and forwarded (outcome "interrupted")
    peak_rss_mib: float | None = None  # sampled from /proc while it ran (Linux); what an OS kill leaves us
    peak_vm_mib: float | None = None  # peak address space: the figure RLIMIT_AS caps


def child_env(base: dict[str, str], cuda: bool) -> dict[str, str]:
    """The child's environment: on CUDA, expandable segments (less fragmentation after a step-down).

    Both names are set because torch renamed the variable (PYTORCH_ALLOC_CONF) and still reads the old one.
    """
    env = dict(base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cuda:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
        env["PYTORCH_ALLOC_CONF"] = ALLOC_CONF
    return env


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON event file, or None when absent or unreadable (events are written atomically, so rare)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# The engine's own one-line reports ("train_network: error: ...", "train_network: SIGINT: stopped at step ..."):
# logged, but not shown, because the supervisor reports the attempt's outcome itself (``autotune run: error:
# ...``, or how to continue with ``autotune run --resume``) and the user should read it once.
_ENGINE_ERROR_LINE = re.compile(r"^(sdxl_)?train_network: ")


def _segments(stream: Any) -> Iterator[bytes]:
    """A child's output cut after each ``\n`` and also after each ``\r``: a progress bar (tqdm, as
    sd-scripts prints it) redraws itself with ``\r`` and writes no ``\n`` until it closes."""
    pending = b""
    while chunk := stream.read1(65536):
        pending += chunk
        while (cut := _first_break(pending)) >= 0:
            yield pending[: cut + 1]
            pending = pending[cut + 1:]
    if pending:
        yield pending


def _first_break(data: bytes) -> int:
    ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
    if not ends:
        return -1
    cut = min(ends)
    return cut + 1 if data[cut:cut + 2] == b"\r\n" else cut


def _pump(stream: Any, sinks: list[TextIO], tail: deque[str] | None, lock: threading.Lock,
          on_line: Callable[[str], None] | None = None) -> None:
    """Copy ``stream`` to ``sinks`` (the log first, then the screen) line by line."""
    for raw in _segments(stream):
        line = raw.decode("utf-8", errors="replace")
        redraw = line.endswith("\r")  # a progress-bar redraw: shown live, logged as a line, kept out of the tail
        held_back = tail is not None and bool(_ENGINE_ERROR_LINE.match(line))
        with lock:
            for index, sink in enumerate(sinks[:1] if held_back else sinks):
                sink.write(line[:-1] + "\n" if redraw and index == 0 else line)
                sink.flush()
        if tail is not None and line.strip() and not redraw:
            tail.append(line.rstrip("\r\n"))
        if on_line is not None:
            on_line(line.rstrip("\r\n"))
    stream.close()


def proc_memory_mib(pid: int) -> tuple[float | None, float | None]:
    """(peak RSS, peak address space) of a live process in MiB from /proc, or (None, None) elsewhere."""
    rss = vm = None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmPeak:"):
                    vm = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss, vm


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def _forwarding_stop_signals(proc: subprocess.Popen[bytes], received: list[int]) -> Any:
    """While the child runs, SIGINT (Ctrl-C) and SIGTERM (``kill``, ``docker stop``, a scheduler) sent to us go
    to the child: the engine stops at the next step boundary, saves its state, ends its DataLoader workers and
    exits; we wait for it. Sent to the engine's process only: a worker killed by SIGTERM would fail the step in
    flight. Installed even when the signal was inherited as ignored (a background job), so ``kill -INT`` works."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(number: int, _frame: Any) -> None:
        received.append(number)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(number)

    previous = {number: signal.signal(number, forward) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_attempt(
    argv: list[str],
    *,
    env: dict[str, str],
    events_dir: Path,
    log_path: Path,
    stall_timeout_s: float,
    echo: bool = True,
    preexec_fn: Callable[[], None] | None = None,
    poll_s: float = 0.25,
    kill_grace_s: float = 10.0,
    stop_grace_s: float = 120.0,
    on_start: Callable[[int], None] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> AttemptResult:
    """Run one child to its end, streaming its output to the screen and ``log_path``.

    The child gets its own process group so a stall kill also reaches any workers it started, and
    Ctrl-C (SIGINT) or SIGTERM reaches it only through us (forwarded as it came, so it saves state and exits
    130 / 143; after ``stop_grace_s`` without an exit its group is killed).
    A stall is no change in ``progress.json`` for ``stall_timeout_s`` (counted from launch until
    the first progress file). ``on_line`` sees every line of both streams (an engine adapter turns
    another trainer's output into progress events with it: ``autotune.recovery.sd_scripts``).
    """
    events_dir.mkdir(parents=True, exist_ok=True)
    clear_events(events_dir)
    progress_path = event_path(events_dir, PROGRESS)
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=preexec_fn)
        lock = threading.Lock()
        err_tail: deque[str] = deque(maxlen=40)
        out_sinks: list[TextIO] = [log, sys.stdout] if echo else [log]
        err_sinks: list[TextIO] = [log, sys.stderr] if echo else [log]
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, out_sinks, None, lock, on_line), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, err_sinks, err_tail, lock, on_line), daemon=True)]
        for pump in pumps:
            pump.start()
        if on_start is not None:
            on_start(proc.pid)
        last_change, last_mtime = time.monotonic(), None
        killed_for: str | None = None
        peak_rss = peak_vm = None
        stops: list[int] = []  # the stop signals we received (and forwarded)
        stop_deadline: float | None = None
        with _forwarding_stop_signals(proc, stops):
            while proc.poll() is None:
                time.sleep(poll_s)
                rss, vm = proc_memory_mib(proc.pid)
                peak_rss = max(filter(None, (peak_rss, rss)), default=None)
                peak_vm = max(filter(None, (peak_vm, vm)), default=None)
                if stops:  # the engine is saving its state: no stall detection now, only a last deadline
                    stop_deadline = stop_deadline or time.monotonic() + stop_grace_s
                    if time.monotonic() > stop_deadline:
                        _signal_group(proc, signal.SIGKILL)
                    continue
                try:
                    mtime = progress_path.stat().st_mtime_ns
                except FileNotFoundError:
                    mtime = None
                if mtime != last_mtime:
                    last_mtime, last_change = mtime, time.monotonic()
                elif time.monotonic() - last_change > stall_timeout_s and killed_for is None:
                    killed_for = "stall"
                    _signal_group(proc, signal.SIGTERM)
                    try:
                        proc.wait(kill_grace_s)
                    except subprocess.TimeoutExpired:
                        _signal_group(proc, signal.SIGKILL)
            proc.wait()
        if stops and killed_for is None:
            killed_for = "interrupted"
        for pump in pumps:
            pump.join(5)
    seconds = time.monotonic() - started
    rc = proc.returncode
    progress = read_event(events_dir, PROGRESS)
    tail_line = err_tail[-1] if err_tail else ""
    common = {"returncode": rc, "last_progress": progress, "seconds": seconds, "peak_rss_mib": peak_rss,
              "peak_vm_mib": peak_vm}
    if killed_for == "stall":
        step = progress.get("step") if progress else None
        return AttemptResult("stall", message=f"no progress for {stall_timeout_s:g} s (last step {step}); killed",
                             **common)
    if killed_for == "interrupted" or rc in STOPPED_EXIT_CODES:
        how = signal.Signals(stops[0]).name if stops else f"exit code {rc}"
        return AttemptResult("interrupted", message=f"interrupted ({how}); state saved by the engine",
                             stop_signal=stops[0] if stops else None, **common)
    if rc == 0:
        return AttemptResult("done", message="finished", done_event=read_event(events_dir, DONE), **common)
    if rc == OOM_EXIT_CODE:
        event = read_event(events_dir, OOM)
        message = (event or {}).get("message") or "out of memory"
        return AttemptResult("oom", message=str(message), oom_event=event, **common)
    if rc == DIVERGED_EXIT_CODE:
        event = read_event(events_dir, DIVERGED)
        message = (event or {}).get("reason") or "training diverged"
        return AttemptResult("diverged", message=f"training diverged: {message}", diverged_event=event, **common)
    if rc == -signal.SIGKILL:
        return AttemptResult("os_kill", message="killed by SIGKILL (the OS out-of-memory killer, most likely)",
                             **common)
    if rc == USER_ERROR_EXIT_CODE:
        return AttemptResult("user_error", message=tail_line or "the engine rejected its input", **common)
    if rc == DISK_FULL_EXIT_CODE:  # final: a smaller batch needs no less disk
        return AttemptResult("disk_full", message=tail_line or "disk full", **common)
    oom_line = next((line for line in reversed(err_tail) if looks_like_oom(line)), None)
    if oom_line is not None:  # an OOM outside the engine's training-step handler (loading, caching)
        return AttemptResult("oom", message=oom_line, **common)
    detail = f"signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
    return AttemptResult("crash", message=f"training crashed ({detail}): {tail_line}", **common)


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


def override_config(src: Path, dst: Path, settings: TrainSettings, header: str = "",
                    base: TrainSettings | None = None) -> None:
    """Write ``src`` with the settings' values set wherever kohya reads them, to ``dst``.

    Only keys that differ from ``base`` (the settings ``src`` describes) are written, so a config
    does not grow keys (and the engine's "ignored option" warnings) it never had.
    """
    values = settings.config_values()
    if base is not None:
        before = base.config_values()
        values = {k: v for k, v in values.items() if before.get(k) != v}
    write_toml(dst, set_config_values(read_toml(src), values), header)


def override_dataset_config(src: Path, dst: Path, settings: TrainSettings, header: str = "",
                            base: TrainSettings | None = None) -> None:
    """Dataset configs win over the main config in kohya, so batch size, resolution and bucket limits
    that changed are set on every [[datasets]] block too."""
    values = settings.dataset_values()
    if base is not None:
        before = base.dataset_values()
        values = {k: v for k, v in values.items() if before.get(k) != v}
    write_toml(dst, set_dataset_values(read_toml(src, "dataset config"), values), header)


# ---------------------------------------------------------------- the supervisor


class EngineHooks(Protocol):
    """What the supervisor asks of a trainer that does not follow our contract itself (the user's
    sd-scripts: ``autotune.recovery.sd_scripts.SdScriptsEngine``). Our engine needs none of it."""

    def attempt_argv(self, attempt: int, config: Path, dataset: Path | None, state: tuple[Path, int] | None,
                     log: DecisionLog) -> list[str]: ...

    def line_handler(self, events_dir: Path) -> Callable[[str], None]: ...

    def child_started(self, pid: int) -> None: ...

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None: ...

    def finish(self, result: AttemptResult, log: DecisionLog) -> AttemptResult: ...


@dataclass
class Job:
    """One training run to supervise. ``config_path`` (and ``dataset_config_path``) are kohya TOMLs."""

    config_path: Path
    output_dir: Path
    settings: TrainSettings
    limits: LadderLimits
    predict: Callable[[TrainSettings], float]
    dataset_config_path: Path | None = None
    entry: list[str] = field(default_factory=lambda: ["-m", "sd_scripts_compat.train_network"])
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cuda: bool = False
    max_retries: int = 5
    stall_timeout_s: float = 600.0
    save_state_every_s: float = 30.0
    resume: bool = False
    preexec_fn: Callable[[], None] | None = None
    python: str = sys.executable
    echo: bool = True
    prior_retries: list[dict[str, Any]] = field(default_factory=list)  # from an interrupted run (--resume)
    train_output_dir: Path | None = None  # the engine's output_dir (LoRA, states); default: output_dir
    extra_state: dict[str, Any] = field(default_factory=dict)  # kept in autotune_run.json for --resume
    budget_kind: str = "device"  # what limits.budget_mib measures: device | address_space | ram
    stability: StabilityLimits = field(default_factory=StabilityLimits)
    on_child_start: Callable[[int], None] | None = None  # called with each child's pid (tests, benches)
    engine: EngineHooks | None = None  # another trainer under the watchdog (sd-scripts); None: our engine

    def child_started(self, pid: int) -> None:
        for hook in (self.engine.child_started if self.engine else None, self.on_child_start):
            if hook is not None:
                hook(pid)

    @property
    def states_dir(self) -> Path:
        return self.train_output_dir or self.output_dir


@dataclass
class RunResult:
    ok: bool
    outcome: str
    message: str
    output_file: str | None
    final_settings: TrainSettings
    retries: list[dict[str, Any]]
    attempts: list[AttemptResult]


class DecisionLog:
    """Every decision, as JSON lines (for tools) and text (for people), in the output folder and on screen."""

    def __init__(self, output_dir: Path, echo: bool) -> None:
        self.jsonl = output_dir / DECISIONS_JSONL
        self.text = output_dir / DECISIONS_LOG
        self.echo = echo

    def write(self, event: str, text: str, *, show: bool = True, **data: Any) -> None:
        """Record a decision; ``show=False`` keeps it off the screen (a final error the caller reports)."""
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event, "text": text, **data}
        with open(self.jsonl, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
        with open(self.text, "a", encoding="utf-8") as handle:
            handle.write(f"{record['time']} {event}: {text}\n")
        if self.echo and show:  # on stdout with the progress: stderr holds only errors
            print(f"[autotune] {text}", flush=True)


def _attempt_configs(job: Job, attempt: int, settings: TrainSettings) -> tuple[Path, Path | None]:
    if settings == job.settings:
        return job.config_path, job.dataset_config_path
    config = job.output_dir / f"config.attempt{attempt}.toml"
    header = f"# attempt {attempt} after a step-down (out of memory or instability): {settings.describe()}\n"
    override_config(job.config_path, config, settings, header, base=job.settings)
    dataset = None
    if job.dataset_config_path is not None:
        dataset = job.output_dir / f"dataset.attempt{attempt}.toml"
        override_dataset_config(job.dataset_config_path, dataset, settings, header, base=job.settings)
    return config, dataset


def measured_mib(result: AttemptResult, budget_kind: str) -> float | None:
    """The memory the failed attempt was seen to use, in the budget's own unit.

    "device": the engine's CUDA peak (else its peak RSS); "address_space": the peak address space
    sampled from /proc (what RLIMIT_AS caps); "ram": peak resident memory.
    """
    memory = (result.oom_event or {}).get("memory") or {}
    if budget_kind == "address_space":
        return result.peak_vm_mib
    keys = ("cuda_max_reserved_mib", "cuda_max_allocated_mib") if budget_kind == "device" else ()
    for key in (*keys, "peak_rss_mib"):
        if isinstance(memory.get(key), (int, float)) and memory[key] > 0:
            return float(memory[key])
    return result.peak_rss_mib


def supervise(job: Job) -> RunResult:
    """Run ``job`` to the end: retry on OOM / divergence / OS kill / stall with stepped-down settings, from
    the newest state.

    Stops on done, a user error (exit 2), a full disk (28), an interrupt (130 / 143), a crash, when a ladder
    is exhausted, or after ``max_retries`` retries.
    """
    job.output_dir.mkdir(parents=True, exist_ok=True)
    log = DecisionLog(job.output_dir, job.echo)
    events_dir = job.output_dir / EVENTS_DIR
    retry_log_path = job.output_dir / RETRY_LOG
    retries: list[dict[str, Any]] = list(job.prior_retries)
    attempts: list[AttemptResult] = []
    settings = job.settings
    tried: list[TrainSettings] = []
    resume_ok = job.resume
    attempt = len(retries)
    log.write("start", f"training with {settings.describe()}", settings=settings.to_event())
    while True:
        removed = clean_partial_files(job.output_dir) + clean_partial_files(job.states_dir)
        if removed:
            log.write("cleanup", f"removed half-written files of a killed run: {', '.join(removed)}")
        config, dataset = _attempt_configs(job, attempt, settings)
        find_state = job.engine.newest_state if job.engine else newest_state
        state = find_state(job.states_dir) if resume_ok else None
        write_json_atomic(retry_log_path, retries)
        write_json_atomic(job.output_dir / RUN_STATE, {
            **job.extra_state, "settings": settings.to_event(), "attempt": attempt, "retries": retries,
            "config": str(job.config_path)})
        if job.engine is not None:
            argv = job.engine.attempt_argv(attempt, config, dataset, state, log)
        else:
            argv = [job.python, *job.entry, "--config_file", str(config)]
            if dataset is not None:
                argv += ["--dataset_config", str(dataset)]
            argv += list(job.extra_args)
            argv += [EVENTS_DIR_FLAG, str(events_dir), SAVE_STATE_EVERY_FLAG, f"{job.save_state_every_s:g}",
                     RETRY_LOG_FLAG, str(retry_log_path)]
            if state is not None:
                argv += ["--resume", str(state[0])]
        if state is not None:
            log.write("resume", f"attempt {attempt}: resuming from {state[0].name} at step {state[1]}",
                      state=str(state[0]), step=state[1])
        env = child_env(job.env, job.cuda)
        result = run_attempt(argv, env=env, events_dir=events_dir, log_path=job.output_dir / CHILD_LOG,
                             stall_timeout_s=job.stall_timeout_s, echo=job.echo, preexec_fn=job.preexec_fn,
                             on_start=job.child_started,
                             on_line=job.engine.line_handler(events_dir) if job.engine else None)
        if job.engine is not None:
            result = job.engine.finish(result, log)
        attempts.append(result)
        if result.outcome == "done":
            output = (result.done_event or {}).get("output_file")
            _write_final_configs(job, settings)
            log.write("done", f"finished after {len(retries)} retr{'y' if len(retries) == 1 else 'ies'}; "
                      f"LoRA: {output}; final settings in config.final.toml", output_file=output,
                      settings=settings.to_event())
            clean_partial_files(job.output_dir)
            clean_partial_files(job.states_dir)
            return RunResult(True, "done", "finished", output, settings, retries, attempts)
        if result.outcome in ("user_error", "disk_full", "interrupted", "crash"):
            # a final error is shown once, by the caller (`autotune run: error: ...`), not here as well
            log.write(result.outcome, result.message, returncode=result.returncode,
                      show=result.outcome == "interrupted")
            return RunResult(False, result.outcome, result.message, None, settings, retries, attempts)
        # oom, diverged, os_kill, stall: recoverable
        failed_step = _failed_step(result)
        if len(retries) >= job.max_retries:
            message = (f"giving up after {len(retries)} retries ({result.outcome} at step {failed_step}); "
                       f"last settings: {settings.describe()}; see {job.output_dir / DECISIONS_LOG}")
            log.write("give_up", message)
            return RunResult(False, "retries_exhausted", message, None, settings, retries, attempts)
        decision: Decision | Exhausted | StabilityDecision | Unstable | None = None
        if result.outcome in ("stall", "continue"):  # continue: the engine stopped short of the last step
            new_settings, compatible = settings, True
            reason = "stalled: retrying the same settings from the last state" if result.outcome == "stall" \
                else result.message
        elif result.outcome == "diverged":
            decision = _after_divergence(job, result, settings, retries)
            if isinstance(decision, Unstable):
                message = decision.message()
                log.write("unstable", message, settings=decision.settings.to_event(), tried=list(decision.tried))
                return RunResult(False, "unstable", message, None, settings, retries, attempts)
            new_settings, reason, compatible = decision.settings, decision.reason, decision.resume_compatible
        else:
            failed = settings
            if result.oom_event and isinstance(result.oom_event.get("settings"), dict):
                failed = TrainSettings.from_event(result.oom_event["settings"])
            tried.append(failed)
            decision = next_settings(failed, job.limits, job.predict, measured_mib(result, job.budget_kind),
                                      tried)
            if isinstance(decision, Exhausted):
                message = decision.message()
                log.write("exhausted", message, floor=decision.floor.to_event(), needed_mib=decision.needed_mib)
                return RunResult(False, "exhausted", message, None, settings, retries, attempts)
            new_settings, reason, compatible = decision.settings, decision.reason, decision.resume_compatible
        state_after = find_state(job.states_dir)
        resume_step = state_after[1] if (state_after and compatible) else 0
        lost = max(0, failed_step - resume_step) if failed_step is not None else None
        record = _retry_record(attempt, result, decision, reason, failed_step, resume_step, lost)
        retries.append(record)
        restart = "" if compatible else " (the saved state does not fit the new network/optimizer: restarting)"
        if isinstance(decision, StabilityDecision) and decision.rung == RESTART:
            restart = " (restarting from step 0: the saved state is set aside)"
        log.write(result.outcome, f"attempt {attempt} failed: {result.outcome} at step {failed_step} "
                  f"({result.message[:200]}); next: {new_settings.describe()} because {reason}; "
                  f"resume at step {resume_step}, {lost} step(s) lost{restart}", **record)
        if not compatible:
            _retire_states(job.states_dir)
        settings = new_settings
        resume_ok = True  # states the new settings cannot load were retired above
        attempt += 1


def _after_divergence(job: Job, result: AttemptResult, settings: TrainSettings,
                      retries: list[dict[str, Any]]) -> StabilityDecision | Unstable:
    """The stability ladder's answer to a diverged attempt (rungs already used come from the retry log)."""
    event = result.diverged_event or {}
    failed = settings
    if isinstance(event.get("settings"), dict):
        failed = TrainSettings.from_event(event["settings"])
    step = _failed_step(result)
    previous = retries[-1] if retries and retries[-1].get("failure") == "diverged" else None
    if previous and previous.get("resume_step") and step is not None and step <= (previous.get("step") or 0):
        # Resumed under safer settings, it diverged again before passing the step where the last attempt did:
        # the state's weights are finite but already damaged (a rate too high grows them until they overflow).
        return StabilityDecision(settings=failed, changes={}, rung=RESTART, resume_compatible=False, reason=(
            f"the state at step {previous['resume_step']} diverged again at step {step} under safer settings, so "
            "its weights are already damaged: the same settings again from step 0"))
    used = [r["rung"] for r in retries if r.get("failure") == "diverged" and r.get("rung") in RUNGS]
    max_steps = event.get("max_train_steps") or (result.last_progress or {}).get("max_train_steps")
    return next_stable_settings(failed, job.stability, used=used, diverged_step=step,
                                max_train_steps=max_steps if isinstance(max_steps, int) else None,
                                last_reason=str(event.get("reason") or result.message))


def _retry_record(attempt: int, result: AttemptResult, decision: Any, reason: str, failed_step: int | None,
                  resume_step: int, lost: int | None) -> dict[str, Any]:
    """One entry of the retry log (and of ``ss_autotune_retries``): what failed, what changed, why."""
    oom = isinstance(decision, Decision)
    record: dict[str, Any] = {
        "attempt": attempt,
        "failure": result.outcome,
        "step": failed_step,
        "message": result.message[:300],
        "memory": (result.oom_event or {}).get("memory") or {"peak_rss_mib": result.peak_rss_mib,
                                                              "peak_vm_mib": result.peak_vm_mib},
        "changes": {k: list(v) for k, v in (decision.changes.items()
                                             if isinstance(decision, (Decision, StabilityDecision)) else [])},
        "reason": reason,
        "predicted_mib": round(decision.predicted_mib, 1) if oom else None,
        "scale": round(decision.scale, 3) if oom else None,
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
              f"{'' if settings == job.settings else ' after a step-down: out of memory or instability'}): "
              f"{settings.describe()}\n")
    override_config(job.config_path, job.output_dir / "config.final.toml", settings, header, base=job.settings)
    if job.dataset_config_path is not None:
        override_dataset_config(job.dataset_config_path, job.output_dir / "dataset.final.toml", settings, header,
                                base=job.settings)
