"""SIGINT and SIGTERM as one clean stop: the run ends at an optimizer-step boundary with its state saved.

Ctrl-C sends SIGINT; schedulers, ``docker stop`` and ``kill`` send SIGTERM; the watchdog forwards either to
the engine's process group. Python's own SIGINT handling is not enough: it raises ``KeyboardInterrupt``
wherever the interpreter happens to be (half-way through ``optimizer.step()``, say, so the saved state would
not resume exactly), it knows nothing of SIGTERM, and a process started from a background job inherits
SIGINT as *ignored*, so Python installs no handler at all. :class:`StopSignals` installs its own handlers for
both signals for the length of a run:

- before the training loop (loading, caching) a signal stops at once: nothing is trained, nothing to save;
- in the loop it only records the request; the loop stops after the optimizer step in progress (never in the
  middle of gradient accumulation), saves the state and exits with :data:`INTERRUPTED_EXIT_CODE` (SIGINT) or
  :data:`TERMINATED_EXIT_CODE` (SIGTERM); a second signal changes nothing (the watchdog escalates with SIGKILL
  if the save never ends).

With several processes (``accelerate launch``) the ranks agree on the step to stop at (one all-reduce of the
flag per step), or one would wait for the others forever. DataLoader workers ignore SIGINT (a terminal's
Ctrl-C reaches them too); a SIGTERM sent to the whole process group (``kill -TERM -PGID``) ends them at once,
so with ``max_data_loader_n_workers > 0`` send it to the engine's process (as the watchdog and ``docker stop``
do), or the step in flight fails for want of its batch.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sd_scripts_compat.facts.contract import INTERRUPTED_EXIT_CODE, TERMINATED_EXIT_CODE

if TYPE_CHECKING:
    from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _orphaned_output_to_devnull() -> None:
    """A supervisor that died (its death is what sent this signal: autotune's attempt runner asks the kernel for
    it) took the read ends of our stdout and stderr pipes with it, and the next print would raise BrokenPipeError
    before the state is saved. A pipe without a reader polls as POLLERR; such a stream is pointed at /dev/null,
    so the run still saves its state and ends cleanly."""
    for fd in (1, 2):
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            poller = select.poll()
            poller.register(fd, select.POLLERR)
            if not any(event & select.POLLERR for _, event in poller.poll(0)):
                continue
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, AttributeError):  # no poll() (Windows): nothing to do
            continue


@dataclass
class StopSignals:
    """The stop request of one run: which signal came (None: none yet) and whether the loop has begun."""

    received: int | None = None
    in_loop: bool = False
    _previous: dict[int, Any] = field(default_factory=dict)

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[StopSignals]:
        """Handlers for SIGINT and SIGTERM while the block runs (the previous ones come back after it).
        Outside the main thread, where Python allows no handlers, nothing is installed."""
        stops = cls()
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            for stop in STOP_SIGNALS:
                stops._previous[stop] = signal.signal(stop, stops._handle)
        try:
            yield stops
        finally:
            for number, handler in stops._previous.items():
                signal.signal(number, handler)

    def _handle(self, number: int, _frame: FrameType | None) -> None:
        if self.received is None:
            self.received = number
        _orphaned_output_to_devnull()
        if not self.in_loop:
            raise KeyboardInterrupt  # loading or caching: nothing to save, stop now

    @property
    def requested(self) -> bool:
        return self.received is not None

    def agreed(self, world: int) -> bool:
        """Whether to stop after this step; with several processes, whether any of them was asked to."""
        if world <= 1:
            return self.requested
        from sd_scripts_compat.training.devices import any_process

        agreed = any_process(self.requested)
        if agreed and self.received is None:
            self.received = signal.SIGINT  # another rank got it; the exit code follows the main one's in practice
        return agreed

    @property
    def exit_code(self) -> int:
        return TERMINATED_EXIT_CODE if self.received == signal.SIGTERM else INTERRUPTED_EXIT_CODE

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "interrupt"
