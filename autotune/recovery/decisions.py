"""The decision log: every decision the supervisor and the engines make, as JSON lines (for tools and the web app)
and text (for people) in the run's folder, and on screen. Its own module so that the engines and the supervisor
both write to it without importing each other."""

from __future__ import annotations

import json
import time
from pathlib import Path

from autotune.layout import DECISIONS_JSONL, DECISIONS_LOG


class DecisionLog:
    """Every decision, as JSON lines (for tools) and text (for people), in the output folder and on screen."""

    def __init__(self, output_dir: Path, echo: bool) -> None:
        self.jsonl = output_dir / DECISIONS_JSONL
        self.text = output_dir / DECISIONS_LOG
        self.echo = echo

    def write(self, event: str, text: str, *, show: bool = True, **data: object) -> None:
        """Record a decision; ``show=False`` keeps it off the screen (a final error the caller reports)."""
        record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event, "text": text, **data}
        with open(self.jsonl, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
        with open(self.text, "a", encoding="utf-8") as handle:
            handle.write(f"{record['time']} {event}: {text}\n")
        if self.echo and show:  # on stdout with the progress: stderr holds only errors
            print(f"[autotune] {text}", flush=True)


def last_decision(output_dir: Path) -> dict[str, object] | None:
    """The newest whole decision in ``output_dir``'s log (a line being written, or damaged, is passed over); None
    without a log."""
    try:
        lines = (output_dir / DECISIONS_JSONL).read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return record
    return None
