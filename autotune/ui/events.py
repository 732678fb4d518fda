"""A run's live events as server-sent events: what the run's files say, as they change.

Polled from the folder twice a second (the run is another process; its files are the only channel, and the same
ones the report reads): ``progress`` (the engine's progress.json: step, it/s, loss, the learning rate when it
reports one), ``decision`` (each new line of logs/decisions.jsonl: step-downs, rollbacks, resumes, each with its
reason), ``sample`` (each new image under sample/), ``state`` (queued, running, ... done). The stream ends with
``end`` once the run is in a final state and everything was sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from autotune.layout import DECISIONS_JSONL, EVENTS_DIR

POLL_S = 0.5
FINAL = ("done", "failed", "interrupted")
MAX_SECONDS = 24 * 3600.0  # a stream a browser left open ends after a day; the page reconnects


def _event(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, default=str)}\n\n"


def run_events(store: Any, run_id: str) -> Iterator[str]:
    folder = store.runs_dir / run_id
    sent_lines, sent_samples, last_progress, last_state = 0, set(), None, None
    began = time.monotonic()
    while time.monotonic() - began < MAX_SECONDS:
        state = store.state(run_id)
        if state != last_state:
            yield _event("state", {"state": state[0], "message": state[1]})
            last_state = state
        progress_file = folder / EVENTS_DIR / "progress.json"
        try:
            progress = progress_file.read_text(encoding="utf-8")
        except OSError:
            progress = None
        if progress and progress != last_progress:
            try:
                yield _event("progress", json.loads(progress))
            except ValueError:
                pass  # caught mid-write: the next poll has it
            last_progress = progress
        decisions = folder / DECISIONS_JSONL
        if decisions.is_file():
            lines = decisions.read_text(encoding="utf-8", errors="replace").splitlines()
            for line in lines[sent_lines:]:
                try:
                    yield _event("decision", json.loads(line))
                except ValueError:
                    break  # a line being written: again next poll
                sent_lines += 1
        samples = folder / "sample"
        if samples.is_dir():
            for image in sorted(samples.glob("*.png")):
                if image.name not in sent_samples:
                    sent_samples.add(image.name)
                    yield _event("sample", {"file": f"sample/{image.name}"})
        if state[0] in FINAL:
            yield _event("end", {"state": state[0]})
            return
        time.sleep(POLL_S)
