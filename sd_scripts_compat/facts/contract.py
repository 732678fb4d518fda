"""The contract between the watchdog (``autotune run``) and a training engine, imported by both.

The watchdog runs the engine only as a child process, so everything they share is here: the exit
codes, the event files the engine writes into ``--autotune_events_dir`` (small JSON documents with a
versioned schema), the engine extension flags, how the newest saved state is found, and which error
messages mean "out of memory". An engine that follows this module (ours, or a wrapper around the
user's sd-scripts) can be supervised.

Events (each written atomically, so a reader never sees half a file):
- ``progress.json``: ``step, epoch, max_train_steps, time, it_per_s, loss``, and from our engine ``lr``,
  ``peak_memory_mib`` (CUDA's max reserved, which leaves the CUDA context out), ``resident_memory_mib`` and on a
  GPU ``cuda_context_mib`` (the context as measured at start, where NVML said), rewritten every few seconds; the
  watchdog's stall detector watches its modification time.
  Each one is also appended as a line to ``progress.jsonl`` (kept across a run's attempts, like ``monitor.jsonl``):
  the curves of the web app's run page.
- ``phase.json``: ``phase`` (one of :data:`ENGINE_PHASES`), ``done`` and ``total`` (items of the phase, when
  counted), ``bytes`` (what a loading phase reads), ``time``; rewritten when a phase begins and as it advances
  (at most every second). The stall detector's limit depends on the phase (``autotune.recovery.stall``).
- ``oom.json``: ``step, epoch, message, memory`` (MiB figures), ``state_dir``, ``settings`` (a
  ``TrainSettings.to_event()`` block: what the run really used) and ``resolved`` (per-dataset values,
  text-encoder caching, weight dtype).
- ``diverged.json``: ``step`` (0-based index of the first bad step), ``tripped_at_step`` (where a rule fired),
  ``detected_at_step`` (steps done when the engine saw it and stopped), ``epoch``, ``max_train_steps``, ``kind``
  (``nonfinite_loss``, ``nonfinite_grad``, ``nonfinite_weights`` or ``divergence``), ``reason`` (one line),
  ``baseline_loss``, ``loss_history`` (``[step, loss, grad_norm]`` of the last steps, non-finite values as
  null), ``settings`` and ``resolved``. The engine exits with :data:`DIVERGED_EXIT_CODE`; it saved nothing
  after the bad step, so the newest state holds finite weights.
- ``done.json``: ``output_file, steps, seconds, seconds_per_step, step_seconds, peak_memory,
  validation_loss, settings, resolved, phases`` (where the time went: seconds per phase, setup, caching,
  data, to_device, vae_encode, forward, backward, optimizer, validation, save, sample and other, summing to
  ``phases.wall_seconds``; see ``training.phase_timer``) and ``torch_compile`` (null, or the backend, blocks,
  graphs, compile ``seconds`` and a ``failure``), ``channels_last`` (whether the conv UNet's weights were stored
  channels_last: ``training.devices.channels_last_pays``). ``step_seconds``: one per optimizer step after the first two,
  leaving out the steps during which a block compiled.
- ``monitor.jsonl`` (not an event: a log of whole JSON lines, appended every ``--autotune_monitor_seconds``,
  default 2, 0 = off): the step with GPU utilisation, memory, clocks, power and throttle reasons (NVML) and the
  process CPU % / RSS, system RAM available and swap (psutil); see ``training.monitor``. It is kept across the
  attempts of a run (a header line starts each engine process).
Every event carries ``schema`` (:data:`SCHEMA_VERSION`) and ``event`` (its kind).

Exit codes: :data:`DONE_EXIT_CODE` 0; :data:`USER_ERROR_EXIT_CODE` 2 (bad input, one line on stderr, final);
:data:`OOM_EXIT_CODE` 87 (retried with smaller settings); :data:`INTERRUPTED_EXIT_CODE` 130 (SIGINT) and
:data:`TERMINATED_EXIT_CODE` 143 (SIGTERM: schedulers, ``docker stop``), both a clean stop with the state saved
(the watchdog reports either as "interrupted"); :data:`DISK_FULL_EXIT_CODE` 28 (``ENOSPC``'s number: a save
found no space; one line on stderr names the folder and the space needed, the previous file or state is
intact; final, never retried: a smaller batch needs no less disk); :data:`BAD_DATA_EXIT_CODE` 65 (sysexits'
``EX_DATAERR``: NaN or Inf found in the base model's weights or the LoRA to start from, before training; one
line names the file and the tensor; final: no learning rate fixes a broken file).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from sd_scripts_compat.facts.atomic import write_json_atomic
from sd_scripts_compat.facts.errors import UserError

SCHEMA_VERSION = 1

# exit codes
DONE_EXIT_CODE = 0
USER_ERROR_EXIT_CODE = 2  # bad input: one line on stderr
OOM_EXIT_CODE = 87  # out of memory; oom.json says where and with which settings
INTERRUPTED_EXIT_CODE = 130  # SIGINT: state saved
DIVERGED_EXIT_CODE = 88  # non-finite or diverging loss; diverged.json says where, nothing bad was saved
TERMINATED_EXIT_CODE = 143  # SIGTERM (128 + 15): state saved, as for SIGINT
DISK_FULL_EXIT_CODE = 28  # no space left for a save (errno ENOSPC is 28); the previous save is intact
BAD_DATA_EXIT_CODE = 65  # NaN / Inf in an input file's weights (EX_DATAERR): not a divergence, never retried
COLLECTIVE_EXIT_CODE = 89  # several processes: a collective failed (another process ended, or a timeout; comm.json)
STOPPED_EXIT_CODES = (INTERRUPTED_EXIT_CODE, TERMINATED_EXIT_CODE)

# event files
PROGRESS = "progress"
OOM = "oom"
DONE = "done"
DIVERGED = "diverged"
PHASE = "phase"
COMM = "comm"  # several processes: a collective timed out (its message, the rank that saw it)
EVENT_KINDS = (PROGRESS, OOM, DONE, DIVERGED, PHASE, COMM)
ENGINE_PHASES = ("loading", "caching", "training", "compiling", "validating", "saving", "sampling")

# the engine's extension flags (command line only; never written into kohya configs)
EVENTS_DIR_FLAG = "--autotune_events_dir"
SAVE_STATE_EVERY_FLAG = "--save_state_every_seconds"
RETRY_LOG_FLAG = "--autotune_retry_log"
STATE_DIR_FLAG = "--autotune_state_dir"  # state folders go here instead of output_dir
MONITOR_FILE = "monitor.jsonl"  # in the events folder, beside the events
PROGRESS_LOG = "progress.jsonl"  # every progress event, one line each, beside the events
CONTROL_FILE = "control.json"  # in the events folder: the supervisor's change to make in the process

STATE_FILE = "train_state.json"  # inside each state folder (ours and kohya's)


def event_path(events_dir: str | Path, kind: str) -> Path:
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}; one of {', '.join(EVENT_KINDS)}")
    return Path(events_dir) / f"{kind}.json"


def write_event(events_dir: str | Path, kind: str, payload: dict[str, Any]) -> Path:
    """Write one event atomically, stamped with its kind and the schema version."""
    path = event_path(events_dir, kind)
    event = {**payload, "schema": SCHEMA_VERSION, "event": kind}
    write_json_atomic(path, event)
    if kind == PROGRESS:  # whole lines under one write: a reader sees a line complete or not at all
        with open(Path(events_dir) / PROGRESS_LOG, "a", encoding="utf-8") as log:
            log.write(json.dumps(event, separators=(",", ":")) + "\n")
    return path


def read_event(events_dir: str | Path, kind: str) -> dict[str, Any] | None:
    """An event, or None when absent, unreadable, or of another schema version than ours."""
    try:
        data = json.loads(event_path(events_dir, kind).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        return None
    return data


def clear_events(events_dir: str | Path) -> None:
    """Remove the previous attempt's events before a child starts."""
    for kind in EVENT_KINDS:
        event_path(events_dir, kind).unlink(missing_ok=True)


def state_step(folder: Path) -> int | None:
    """The optimizer step a state folder resumes at (our format, or kohya's keys), None if unreadable."""
    try:
        data = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    counters = data.get("counters") or {}
    for value in (counters.get("global_step"), data.get("global_step"), data.get("current_step")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def newest_state(output_dir: Path) -> tuple[Path, int] | None:
    """The ``*-state`` folder with the highest step in ``output_dir`` (newest wins a tie), or None.

    The one way a state to resume from is found, by the watchdog and by ``autotune run --resume``.
    """
    best: tuple[int, int, Path] | None = None
    if not output_dir.is_dir():
        return None
    for folder in output_dir.iterdir():
        if not folder.is_dir() or folder.name.startswith(".") or not folder.name.endswith("-state"):
            continue
        step = state_step(folder)
        if step is None:
            continue
        key = (step, folder.stat().st_mtime_ns, folder)
        if best is None or key[:2] > best[:2]:
            best = key
    return (best[2], best[0]) if best else None


class Outcome(str, Enum):
    """How an attempt (one engine process) or a whole supervised run ended: one vocabulary for the watchdog, the
    bench, the measurement store and the report. A ``str`` so that JSON files and logs hold the plain word."""

    DONE = "done"  # finished; done.json says where the LoRA is
    OOM = "oom"  # out of memory: step down (recovery.ladder) and resume
    OS_KILL = "os_kill"  # SIGKILL, most likely the OS out-of-memory killer: stepped down like an OOM
    DIVERGED = "diverged"  # non-finite or exploding loss: roll back (recovery.stability)
    STALL = "stall"  # no progress for too long: killed, resumed with the same settings
    COMM_TIMEOUT = "comm_timeout"  # several processes: a collective (NCCL / gloo) timed out: resumed as a stall
    CONTINUE = "continue"  # the engine stopped short of its last step (an adapter's relaunch): resume as it is
    STEP_UP = "step_up"  # stopped at a step boundary because the supervisor asked: resume with larger settings
    STEP_DOWN = "step_down"  # ... asked because the measured peak foresees an OOM: resume with smaller settings
    USER_ERROR = "user_error"  # bad input, one line: final
    DISK_FULL = "disk_full"  # no space for a save: final (a smaller batch needs no less disk)
    BAD_DATA = "bad_data"  # NaN / Inf in the base model or the LoRA to start from: final, not a divergence
    INTERRUPTED = "interrupted"  # SIGINT / SIGTERM, state saved: final
    CRASH = "crash"  # anything else: final
    # a supervised run only
    RETRIES_EXHAUSTED = "retries_exhausted"
    EXHAUSTED = "exhausted"  # the OOM ladder has nothing left that fits
    UNSTABLE = "unstable"  # the stability ladder has nothing left

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def final(self) -> bool:
        """An attempt that ended this way is not retried."""
        return self in (Outcome.DONE, Outcome.USER_ERROR, Outcome.DISK_FULL, Outcome.BAD_DATA, Outcome.INTERRUPTED,
                        Outcome.CRASH)

    @property
    def same_settings(self) -> bool:
        """Retried from the newest state with the settings that ran (nothing about them was at fault)."""
        return self in (Outcome.STALL, Outcome.COMM_TIMEOUT, Outcome.CONTINUE, Outcome.STEP_UP)


@dataclass(frozen=True)
class ExitFacts:
    """What an attempt runner saw of one child, without judgement: its exit, what the runner did to it, the end
    of its stderr and the events it left (``oom``, ``diverged``, ``done``, ``progress``: the parsed files)."""

    returncode: int | None
    stalled_after_s: float | None = None  # the runner killed it after this long without progress
    stalled_in: str | None = None  # the phase it was in then (phase.json), when it said
    stop_signal: int | None = None  # a SIGINT / SIGTERM the runner received and forwarded
    stderr_tail: tuple[str, ...] = ()
    events: Mapping[str, dict[str, Any] | None] = field(default_factory=dict)


def classify(facts: ExitFacts) -> tuple[Outcome, str]:
    """The outcome of one attempt and its one-line message, from its facts alone (pure: no files, no clock)."""
    rc, events = facts.returncode, facts.events
    tail = facts.stderr_tail[-1] if facts.stderr_tail else ""
    if facts.stalled_after_s is not None:
        step = (events.get(PROGRESS) or {}).get("step")
        where = f" while {facts.stalled_in}" if facts.stalled_in else ""
        return Outcome.STALL, f"no progress{where} for {facts.stalled_after_s:.0f} s (last step {step}); killed"
    if facts.stop_signal is not None or rc in STOPPED_EXIT_CODES:
        how = signal.Signals(facts.stop_signal).name if facts.stop_signal else f"exit code {rc}"
        return Outcome.INTERRUPTED, f"interrupted ({how}); state saved by the engine"
    if rc == DONE_EXIT_CODE:
        return Outcome.DONE, "finished"
    if rc == BAD_DATA_EXIT_CODE:
        return Outcome.BAD_DATA, tail or "NaN or Inf in an input file's weights"
    if rc == OOM_EXIT_CODE or events.get(OOM) is not None:  # several processes: the launcher's exit is its own
        return Outcome.OOM, str((events.get(OOM) or {}).get("message") or "out of memory")
    if events.get(COMM) is not None:
        return Outcome.COMM_TIMEOUT, (f"{(events.get(COMM) or {}).get('message')}: {COMM_TIMEOUT_FIX}")
    if rc == DIVERGED_EXIT_CODE:
        reason = (events.get(DIVERGED) or {}).get("reason") or "training diverged"
        return Outcome.DIVERGED, f"training diverged: {reason}"
    if rc == -signal.SIGKILL:
        return Outcome.OS_KILL, "killed by SIGKILL (the OS out-of-memory killer, most likely)"
    root = _LAUNCHER_ROOT_CAUSE.search("\n".join(facts.stderr_tail))
    if root is not None and int(root["exitcode"]) == -signal.SIGKILL:  # several processes: the launcher's account
        return Outcome.OS_KILL, (f"process {root['rank']} of the run killed by SIGKILL (the OS out-of-memory killer, "
                                 "most likely); the launcher stopped the others")
    if rc == USER_ERROR_EXIT_CODE:
        return Outcome.USER_ERROR, tail or "the engine rejected its input"
    if rc == DISK_FULL_EXIT_CODE:
        return Outcome.DISK_FULL, tail or "disk full"
    oom_line = next((line for line in reversed(facts.stderr_tail) if looks_like_oom(line)), None)
    if oom_line is not None:  # an OOM outside the engine's training-step handler (loading, caching)
        return Outcome.OOM, oom_line
    detail = f"signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
    return Outcome.CRASH, f"training crashed ({detail}): {tail}"


# torch.distributed.elastic's summary (accelerate launch, torchrun): the process that failed first
_LAUNCHER_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>\d+).*?"
                                  r"exitcode\s*:\s*(?P<exitcode>-?\d+)", re.DOTALL)

COMM_TIMEOUT_FIX = ("a process stopped answering the others (a hung card or driver, or a process starved of CPU); "
                    "resumed from the last state with the same settings; if it repeats, on consumer cards without "
                    "peer-to-peer set NCCL_P2P_DISABLE=1, or train with fewer processes; where one process works "
                    "alone for long (caching a large dataset, saving, sampling), raise ddp_timeout (minutes)")


def collective_failure(error: BaseException) -> str | None:
    """``"peer"`` when a collective failed because another process of the run ended (its own event says why),
    ``"timeout"`` when it timed out (NCCL's watchdog, gloo's timeout), else None."""
    text = str(error)
    if _PEER_GONE.search(text):
        return "peer"
    if isinstance(error, RuntimeError) and _COLLECTIVE_TIMEOUT.search(text):  # NCCL's DistBackendError is one
        return "timeout"
    return None


_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash|"
                        r"NCCL communicator was aborted|ProcessGroup.*(?:aborted|shut down)", re.IGNORECASE)
_COLLECTIVE_TIMEOUT = re.compile(r"(?:Watchdog caught collective operation timeout|Timed out waiting|"
                                 r"\[Gloo\].*timed out|ProcessGroup\w*.*timed? ?out|Socket Timeout)", re.IGNORECASE)


def looks_like_oom(line: str) -> bool:
    """True when a line of an engine's stderr reports an out-of-memory condition."""
    return bool(_OOM_PATTERNS.search(line))


# Messages that are an out-of-memory condition in other clothes (CUDA, cuBLAS, cuDNN, CPU, ROCm, MPS).
_OOM_PATTERNS = re.compile(
    r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_NOT_SUPPORTED|CUDNN_STATUS_ALLOC_FAILED"
    r"|DefaultCPUAllocator: can't allocate memory|HIP error: out of memory|hipErrorOutOfMemory"
    r"|MPS backend out of memory|Invalid buffer size"
    r"|could not create a primitive|std::bad_alloc",  # oneDNN / C++ allocations failing under a memory limit
    re.IGNORECASE,
)


class DiskFullError(UserError):
    """A write found no space left (or the quota used up): one line naming the folder and the space needed."""

    exit_code = DISK_FULL_EXIT_CODE


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# safetensors (Rust) reports a full disk in its own error type, with the OS error in the message
_DISK_FULL_TEXT = re.compile(r"No space left on device|StorageFull|Disk quota exceeded|QuotaExceeded", re.IGNORECASE)


def is_disk_full_error(error: BaseException) -> bool:
    """True for an OSError with ENOSPC / EDQUOT, and for a library error whose message says so (safetensors)."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in _DISK_FULL_ERRNOS
    return not isinstance(error, UserError) and bool(_DISK_FULL_TEXT.search(str(error)))


def free_bytes(folder: Path) -> int | None:
    """Free space for an unprivileged writer in ``folder`` (or its nearest existing parent), None if unknown."""
    import shutil

    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 / 10 else f"{num_bytes / 1024:.0f} KiB"


@contextlib.contextmanager
def disk_full_guard(folder: str | os.PathLike[str], needed_bytes: int | None, what: str) -> Iterator[None]:
    """Turn a full disk while writing ``what`` into ``folder`` into a :class:`DiskFullError` (one line, naming
    the folder, the space needed and what is free); any other error passes through unchanged.

    ``needed_bytes`` is the caller's estimate (a tensor file: the tensors' byte size); atomic writes leave the
    previous file in place, so the message can say no earlier save was lost.
    """
    try:
        yield
    except Exception as error:  # noqa: BLE001 - only a full disk is translated; everything else re-raises
        if not is_disk_full_error(error):
            raise
        place = Path(folder)
        free = free_bytes(place)
        need = f"needs about {_mib(needed_bytes)}" if needed_bytes else "needs more space"
        have = f", {_mib(free)} free" if free is not None else ""
        raise DiskFullError(f"{place}: disk full while saving {what} ({need}{have}); any earlier save is intact; "
                            "free some space there or choose another output_dir") from None


_SIZE = r"([0-9.]+) (B|KiB|MiB|GiB|TiB)"
_TRIED = re.compile(rf"Tried to allocate {_SIZE}")
_ALLOCATED = re.compile(rf"(?:Of the allocated memory {_SIZE} is allocated by PyTorch|{_SIZE} already allocated)")
_UNITS = {"B": 2**-20, "KiB": 2**-10, "MiB": 1.0, "GiB": 2**10, "TiB": 2**20}


def oom_point_mib(message: str | None) -> float | None:
    """Where a CUDA out-of-memory error struck, MiB: what PyTorch had allocated plus what it tried to allocate, read
    from the allocator's message (both its wordings: "Of the allocated memory X is allocated by PyTorch" since
    torch 2.1, "X already allocated" before). At least this much was needed; None for any other message."""
    tried, allocated = _TRIED.search(message or ""), _ALLOCATED.search(message or "")
    if tried is None or allocated is None:
        return None
    size, unit = (allocated.group(1), allocated.group(2)) if allocated.group(1) else allocated.group(3, 4)
    return float(tried.group(1)) * _UNITS[tried.group(2)] + float(size) * _UNITS[unit]


def error_summary(error: BaseException, limit: int = 500) -> str:
    """The first line of an error's message, or its type's name when the message is empty (a bare
    ``MemoryError()`` has none): never fails, whatever the error holds."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:limit]


def is_oom_error(error: BaseException) -> bool:
    """True for torch.OutOfMemoryError and for RuntimeErrors whose message is an OOM in disguise."""
    try:
        import torch

        if isinstance(error, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError) or bool(_OOM_PATTERNS.search(str(error)))
    )


def memory_figures() -> dict[str, float]:
    """What memory the process used, in MiB: CUDA peaks when on a GPU, else resident set size."""
    import torch

    figures: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        figures["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        figures["cuda_max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
        free, total = torch.cuda.mem_get_info()
        figures["cuda_free_mib"] = free / 2**20
        figures["cuda_total_mib"] = total / 2**20
    figures["peak_rss_mib"] = peak_rss_mib()
    return figures


def peak_rss_mib() -> float:
    """This program's peak resident memory, MiB: Linux's VmHWM (the high-water mark of the memory this program
    mapped, new at exec), else ``ru_maxrss``, which on Linux carries a forking parent's peak through exec (a
    bench that built a 6 GB model read 6550 MiB in every child it started)."""
    import resource

    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
