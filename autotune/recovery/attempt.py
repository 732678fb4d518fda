"""One attempt: spawn the engine as a child, pump its output, watch it, and report what happened as facts.

The runner judges nothing: it returns an :class:`AttemptResult` whose ``outcome`` comes from the contract's pure
:func:`sd_scripts_compat.facts.contract.classify` over the :class:`~sd_scripts_compat.facts.contract.ExitFacts` it saw
(the exit code, a stall kill, a forwarded stop signal, the end of stderr, the event files). What to do next
is the supervisor's (``recovery.watchdog``), and how a trainer is launched is its engine's (``recovery.engine``):
the split accelerate's ``utils/memory.py`` keeps between "is this an OOM", "what next" and "run".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from autotune.recovery.stall import describe, stall_limit
from sd_scripts_compat.facts.contract import (
    COMM,
    DIVERGED,
    DONE,
    OOM,
    PHASE,
    PROGRESS,
    ExitFacts,
    Outcome,
    classify,
    clear_events,
    event_path,
    read_event,
)

if TYPE_CHECKING:
    from types import FrameType
    from typing import IO

    import psutil

    from autotune.hardware.gpu_usage import GpuUsage

ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class AttemptResult:
    """How one child process ended: its outcome (``classify``) and the facts behind it."""

    outcome: Outcome
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
    yielded: bool = False  # we asked it to stop at a step boundary (a step up), not the user
    peak_gpu_mib: float | None = None  # sampled through NVML (a trainer that reports no CUDA peak of its own)

    @classmethod
    def from_facts(cls, facts: ExitFacts, *, seconds: float, peak_rss_mib: float | None,
                   peak_vm_mib: float | None, yielded: bool = False,
                   peak_gpu_mib: float | None = None) -> AttemptResult:
        outcome, message = classify(facts)
        if yielded and outcome is Outcome.INTERRUPTED and facts.stop_signal is None:
            outcome, message = Outcome.STEP_UP, "stopped at a step boundary as the supervisor asked; state saved"
        events = facts.events
        return cls(outcome=outcome, returncode=facts.returncode, message=message,
                   oom_event=events.get(OOM) if outcome is Outcome.OOM else None,
                   done_event=events.get(DONE) if outcome is Outcome.DONE else None,
                   diverged_event=events.get(DIVERGED) if outcome is Outcome.DIVERGED else None,
                   last_progress=events.get(PROGRESS), seconds=seconds, stop_signal=facts.stop_signal,
                   peak_rss_mib=peak_rss_mib, peak_vm_mib=peak_vm_mib, yielded=yielded, peak_gpu_mib=peak_gpu_mib)


def address_space_limit(limit_mib: float) -> Callable[[], None]:
    """A ``preexec_fn`` that caps the child's address space, so an oversized allocation fails inside
    torch (``DefaultCPUAllocator: can't allocate memory``) instead of summoning the OS OOM killer."""
    import resource

    limit = int(limit_mib * 2**20)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


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
_ENGINE_ERROR_LINE = re.compile(r"^(sdxl_|flux_)?train_network: ")


def _segments(stream: IO[bytes]) -> Iterator[bytes]:
    """A child's output cut after each ``\n`` and also after each ``\r``: a progress bar (tqdm, as
    sd-scripts prints it) redraws itself with ``\r`` and writes no ``\n`` until it closes."""
    pending = b""
    read = getattr(stream, "read1", stream.read)  # a buffered pipe's read1: what has arrived, not a full 64 KiB
    while chunk := read(65536):
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


def _pump(stream: IO[bytes], sinks: list[TextIO], tail: deque[str] | None, lock: threading.Lock,
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


def _in_child(preexec_fn: Callable[[], None] | None, supervisor: int) -> Callable[[], None]:
    """What the child runs before exec: it dies with its supervisor, then the caller's own setup."""
    def setup() -> None:
        _die_with(supervisor)
        if preexec_fn is not None:
            preexec_fn()

    return setup


def _die_with(supervisor: int) -> None:
    """Linux: the kernel sends the child SIGTERM when its supervisor dies, however it dies (SIGKILL, a closed
    terminal), so no trainer outlives ``autotune run``; SIGTERM lets it save its state first. Elsewhere there is
    no such call (Windows would need a job object): the child is then stopped only through us."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != supervisor:  # it died between the fork and the call above
        os.kill(os.getpid(), signal.SIGTERM)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def _signal_group(proc: subprocess.Popen[bytes], sig: int, known: Iterable[psutil.Process] = ()) -> None:
    """``sig`` to the child's process group and to every process it started in a session of its own (torch's
    launcher, ``accelerate launch``, starts each rank so: the group alone misses them), as found now and as
    ``known`` from earlier looks (a rank whose launcher is gone is no longer found under it)."""
    import psutil

    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for child in {p.pid: p for p in [*known, *descendants(proc.pid)]}.values():
        with contextlib.suppress(psutil.Error):
            child.send_signal(sig)  # psutil checks it is still the same process (a reused pid is left alone)


def descendants(pid: int) -> list[psutil.Process]:
    """Every process under ``pid`` now (none when it is gone)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def end_orphans(known: Iterable[psutil.Process]) -> int:
    """SIGKILL every process in ``known`` still running after the child ended: a rank that outlived its launcher
    (one hung in a collective, killed with the launcher before the launcher could kill it) would hold its card's
    memory against the next attempt. How many there were."""
    import psutil

    ended = 0
    for child in known:
        with contextlib.suppress(psutil.Error):
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                child.kill()
                ended += 1
    return ended


@contextlib.contextmanager
def _forwarding_stop_signals(proc: subprocess.Popen[bytes], received: list[int],
                             continued: list[float]) -> Iterator[None]:
    """While the child runs, SIGINT (Ctrl-C) and SIGTERM (``kill``, ``docker stop``, a scheduler) sent to us go
    to the child: the engine stops at the next step boundary, saves its state, ends its DataLoader workers and
    exits; we wait for it. Sent to the engine's process only: a worker killed by SIGTERM would fail the step in
    flight. Installed even when the signal was inherited as ignored (a background job), so ``kill -INT`` works.

    Ctrl-Z (SIGTSTP) stops the child's whole group (it has its own session, so the terminal's signal never
    reaches it), then us; ``fg`` (SIGCONT) continues us, and we continue the group and note the time in
    ``continued`` (the stall clock restarts there: a suspended run is not a stalled one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(number: int, _frame: FrameType | None) -> None:
        received.append(number)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(number)

    def suspend(_number: int, _frame: FrameType | None) -> None:
        _signal_group(proc, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # we stop here; SIGCONT (fg, bg, kill -CONT) carries on below
        _signal_group(proc, signal.SIGCONT)
        continued.append(time.monotonic())

    previous = {number: signal.signal(number, forward) for number in (signal.SIGINT, signal.SIGTERM)}
    if hasattr(signal, "SIGTSTP"):
        previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, suspend)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@dataclass
class _Watch:
    """What the watch loop saw of a running child."""

    peak_rss: float | None = None
    peak_vm: float | None = None
    peak_gpu: float | None = None
    stalled_after_s: float | None = None
    stalled_in: str | None = None
    yielded: bool = False  # on_progress asked for a stop at the step boundary
    tree: dict[int, psutil.Process] = field(default_factory=dict)  # every process seen under the child


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
    on_progress: Callable[[dict[str, Any], float | None, float | None], bool] | None = None,
    gpu_usage: GpuUsage | None = None,
) -> AttemptResult:
    """Run one child to its end, streaming its output to the screen and ``log_path``.

    The child gets its own process group so a stall kill also reaches any workers it started, and
    Ctrl-C (SIGINT) or SIGTERM reaches it only through us (forwarded as it came, so it saves state and exits
    130 / 143; after ``stop_grace_s`` without an exit its group is killed).
    A stall is no change in ``progress.json`` or ``phase.json`` for longer than the engine's phase allows
    (``recovery.stall``: ``stall_timeout_s`` scaled to the phase's work; counted from launch until the first
    file). ``on_line`` sees every line of both streams (an engine adapter turns another trainer's output
    into progress events with it: ``autotune.recovery.sd_scripts``). ``on_progress(progress, peak_vm_mib,
    peak_gpu_mib)`` sees each new progress event; True asks the child to stop at its step boundary (SIGTERM: it
    saves its state). ``gpu_usage`` samples the child's GPU memory through NVML (``hardware.gpu_usage``).
    """
    events_dir.mkdir(parents=True, exist_ok=True)
    clear_events(events_dir)
    started = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    stops: list[int] = []  # the stop signals we received (and forwarded)
    continued: list[float] = []  # when a Ctrl-Z suspension ended
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_in_child(preexec_fn, os.getpid()))
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
        with _forwarding_stop_signals(proc, stops, continued):
            watch = _watch(proc, events_dir, stops, continued, stall_timeout_s=stall_timeout_s,
                           poll_s=poll_s, kill_grace_s=kill_grace_s, stop_grace_s=stop_grace_s,
                           on_progress=on_progress, gpu_usage=gpu_usage)
        for pump in pumps:
            pump.join(5)
    events = {kind: read_event(events_dir, kind) for kind in (PROGRESS, OOM, DIVERGED, DONE, COMM)}
    facts = ExitFacts(returncode=proc.returncode, stalled_after_s=watch.stalled_after_s, stalled_in=watch.stalled_in,
                      stop_signal=stops[0] if stops else None, stderr_tail=tuple(err_tail), events=events)
    return AttemptResult.from_facts(facts, seconds=time.monotonic() - started, peak_rss_mib=watch.peak_rss,
                                    peak_vm_mib=watch.peak_vm, yielded=watch.yielded, peak_gpu_mib=watch.peak_gpu)


def _watch(proc: subprocess.Popen[bytes], events_dir: Path, stops: list[int], continued: list[float], *,
           stall_timeout_s: float, poll_s: float, kill_grace_s: float, stop_grace_s: float,
           on_progress: Callable[[dict[str, Any], float | None, float | None], bool] | None = None,
           gpu_usage: GpuUsage | None = None) -> _Watch:
    """Poll the child until it exits: sample its memory, kill it on a stall, give a forwarded stop its grace.
    The stall clock restarts when ``progress.json`` or ``phase.json`` changes and when a Ctrl-Z suspension
    ends (``continued``); its limit follows the phase (``recovery.stall``)."""
    seen = _Watch()
    watched = (event_path(events_dir, PROGRESS), event_path(events_dir, PHASE))
    last_change = time.monotonic()
    last_mtimes: tuple[int | None, ...] = (None, None)
    limit = stall_timeout_s
    stop_deadline: float | None = None
    while proc.poll() is None:
        time.sleep(poll_s)
        for child in descendants(proc.pid):
            seen.tree.setdefault(child.pid, child)
        rss, vm = proc_memory_mib(proc.pid)
        seen.peak_rss = max(filter(None, (seen.peak_rss, rss)), default=None)
        seen.peak_vm = max(filter(None, (seen.peak_vm, vm)), default=None)
        if gpu_usage is not None:
            gpu_usage.sample(proc.pid)  # the child leads its own process group
            seen.peak_gpu = gpu_usage.peak
        if stops or seen.yielded:  # the engine is saving its state: no stall detection now, only a last deadline
            stop_deadline = stop_deadline or time.monotonic() + stop_grace_s
            if time.monotonic() > stop_deadline:
                _signal_group(proc, signal.SIGKILL, seen.tree.values())
            continue
        mtimes = tuple(_mtime(path) for path in watched)
        if continued and continued[-1] > last_change:
            last_change = continued[-1]
        if mtimes != last_mtimes:
            last_mtimes, last_change = mtimes, time.monotonic()
            phase, progress = read_event(events_dir, PHASE), read_event(events_dir, PROGRESS)
            limit = stall_limit(phase, progress, stall_timeout_s)
            if progress and on_progress is not None and on_progress(progress, seen.peak_vm, seen.peak_gpu):
                seen.yielded = True
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)  # the engine's process only: its workers end with it
        elif time.monotonic() - last_change > limit and seen.stalled_after_s is None:
            seen.stalled_after_s, seen.stalled_in = limit, describe(read_event(events_dir, PHASE))
            _signal_group(proc, signal.SIGTERM, seen.tree.values())
            try:
                proc.wait(kill_grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL, seen.tree.values())
    proc.wait()
    end_orphans(seen.tree.values())
    return seen


def terminate_group(pid: int | None) -> None:
    """SIGTERM to a child's process group (a wrapped trainer stopped on purpose: at a wrong counter, at its
    target); one already gone is no error."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
