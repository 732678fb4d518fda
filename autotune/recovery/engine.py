"""The one protocol every trainer under the watchdog implements, and our own engine as its first implementation.

The supervisor (``recovery.watchdog.supervise``) never asks which trainer it runs: it asks the job's
:class:`Engine` for the command line of an attempt, the newest state to resume from, a reader of the child's
output (a trainer that does not write our events gets them made from its output), and the last word on an
attempt's result. Our engine (:class:`CompatEngine`) follows the contract of ``sd_scripts_compat.facts.contract``
itself, so its hooks are thin; the user's sd-scripts is ``recovery.sd_scripts.SdScriptsEngine``. A new trainer
(musubi-tuner: ``recovery.musubi.MusubiEngine``) is one more class beside them, and no watchdog code changes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sd_scripts_compat.facts.contract import (
    EVENTS_DIR_FLAG,
    RETRY_LOG_FLAG,
    SAVE_STATE_EVERY_FLAG,
    STATE_DIR_FLAG,
    newest_state,
)

if TYPE_CHECKING:
    from autotune.recovery.attempt import AttemptResult
    from autotune.recovery.decisions import DecisionLog
    from sd_scripts_compat.facts.settings import TrainSettings


@dataclass(frozen=True)
class AttemptFiles:
    """What the supervisor prepared for one attempt: the configs to train with and where events go."""

    config: Path
    dataset: Path | None
    events_dir: Path
    retry_log: Path
    states_dir: Path  # where the trainer keeps (and the supervisor looks for) its states
    settings: TrainSettings | None = None  # this attempt's settings (an engine with its own file format writes them)


class Engine(Protocol):
    """A trainer the watchdog can supervise."""

    def attempt_argv(self, attempt: int, files: AttemptFiles, state: tuple[Path, int] | None,
                     log: DecisionLog) -> list[str]:
        """The child's command line for attempt ``attempt`` (resuming from ``state``: folder and step)."""
        ...

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None:
        """The newest state an attempt can resume from, with its step."""
        ...

    def line_handler(self, events_dir: Path) -> Callable[[str], None] | None:
        """What reads every line the child prints (None: nothing needs to)."""
        ...

    def child_started(self, pid: int) -> None: ...

    def stop_for_step_up(self) -> bool:
        """The watchdog wants the attempt to end for a step up: True when the engine ends it itself once the trainer
        has saved its next state (a trainer that saves none when stopped); False when SIGTERM is its step boundary
        (it saves its state on it)."""
        ...

    def changes_in_process(self, changes: Mapping[str, Any]) -> bool:
        """Whether the running trainer makes these setting changes itself at its next step boundary, without a
        restart (the watchdog then writes them into ``control.json``)."""
        ...

    def finish(self, result: AttemptResult, log: DecisionLog) -> AttemptResult:
        """The engine's last word on an attempt (a wrapper may turn a crash into "continue", say)."""
        ...


def free_port() -> int:
    """A TCP port free on this machine now, for a launch's rendezvous (the OS picks it)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class CompatEngine:
    """lora-autotune's own engine (``python -m sd_scripts_compat.<script>``): it writes the contract's events,
    saves state on a clock and resumes at the exact step by itself."""

    entry: list[str] = field(default_factory=lambda: ["-m", "sd_scripts_compat.train_network"])
    python: str = sys.executable
    extra_args: list[str] = field(default_factory=list)
    save_state_every_s: float = 30.0
    processes: int = 1  # several: launched through accelerate (one per GPU; on a CPU, gloo processes)

    @classmethod
    def for_module(cls, module: str, **kwargs: object) -> CompatEngine:
        """The engine entry point of a family (``FamilySpec.engine_module``)."""
        return cls(entry=["-m", module], **kwargs)  # type: ignore[arg-type]

    def attempt_argv(self, attempt: int, files: AttemptFiles, state: tuple[Path, int] | None,
                     log: DecisionLog) -> list[str]:
        argv = [self.python, *self.launcher(), *self.entry, "--config_file", str(files.config)]
        if files.dataset is not None:
            argv += ["--dataset_config", str(files.dataset)]
        argv += [*self.extra_args, EVENTS_DIR_FLAG, str(files.events_dir), SAVE_STATE_EVERY_FLAG,
                 f"{self.save_state_every_s:g}", RETRY_LOG_FLAG, str(files.retry_log),
                 STATE_DIR_FLAG, str(files.states_dir)]
        if state is not None:
            argv += ["--resume", str(state[0])]
        return argv

    def launcher(self) -> list[str]:
        """accelerate's launcher for several processes (it starts them, gives them their process group and stops
        the rest when one ends; the one that ran out of memory writes oom.json); nothing for one."""
        if self.processes < 2:
            return []
        return ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(self.processes),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", str(free_port())]  # not accelerate's fixed 29500: two runs at once

    def newest_state(self, states_dir: Path) -> tuple[Path, int] | None:
        return newest_state(states_dir)

    def line_handler(self, events_dir: Path) -> Callable[[str], None] | None:
        return None

    def child_started(self, pid: int) -> None:
        return None

    def stop_for_step_up(self) -> bool:
        return False  # SIGTERM: it saves its state at the step boundary and exits

    def changes_in_process(self, changes: Mapping[str, Any]) -> bool:
        from sd_scripts_compat.training.live_changes import IN_PROCESS

        return bool(changes) and set(changes) <= set(IN_PROCESS)

    def finish(self, result: AttemptResult, log: DecisionLog) -> AttemptResult:
        return result
