"""A progress bar for a long step of a command (the doctor's image checks), on stderr and only on a terminal.

Piped or captured output (``--json``, tests, the web app) gets nothing: the bar would be noise in a file.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

UPDATES = 200  # redraws over the whole step at most: telling rich of each of 100,000 images costs seconds


@contextlib.contextmanager
def stderr_progress(what: str) -> Iterator[Callable[[int, int], None] | None]:
    """``progress(done, total)`` drawing a transient bar on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(f"[dim]{what}[/dim]", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def progress(done: int, total: int) -> None:
            if done == total or done % max(1, total // UPDATES) == 0:
                bar.update(task, completed=done, total=total)

        yield progress
