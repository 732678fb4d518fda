"""Runs through ``autotune ui``'s API against a real server and real training (builtin:tiny-sd15 on
examples/dataset): a queue of two with the first one's live events and report, and a server killed and restarted
while a run trains (the run goes on, the new server finds it). Stop and resume to the planned step are driven in
the browser (tests/test_ui_browser.py)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
from test_ui_api import DATASET, Server

pytestmark = pytest.mark.slow

RUN = {"dataset": str(DATASET), "model": "builtin:tiny-sd15", "rank": 4, "batch": 1, "save_state_every": 1}


def wait_for(server: Server, run_id: str, states: tuple[str, ...], timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, info = server.call("GET", f"/api/runs/{run_id}")
        assert status == 200, info
        if info["state"] in states:
            return info
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} never reached {states}: {info}")


def events_of(server: Server, run_id: str) -> list[tuple[str, dict]]:
    """The whole event stream of a run (it ends when the run is final)."""
    url = f"http://127.0.0.1:{server.port}/api/runs/{run_id}/events"
    out, name = [], None
    with urllib.request.urlopen(url, timeout=300) as stream:
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def test_two_runs_queue_and_train_one_after_the_other_with_events_and_report(tmp_path):
    server = Server(tmp_path)
    try:
        server.call("POST", "/api/runs", {**RUN, "steps": 8, "name": "a"})
        status, second = server.call("POST", "/api/runs", {**RUN, "steps": 6, "name": "b"})
        assert status == 201 and second["state"] == "queued"
        assert server.call("GET", "/api/runs")[1]["queue"] == ["b"]
        events = events_of(server, "a")  # the whole stream of the first run, which ends with it
        names = [name for name, _ in events]
        assert names[-1] == "end" and events[-1][1]["state"] == "done", events[-3:]
        assert "progress" in names and any(d.get("event") == "start" for n, d in events if n == "decision")
        info = wait_for(server, "a", ("done",))
        assert info["step"] == info["max_train_steps"] == 8
        status, report = server.call("GET", "/api/runs/a/report")
        assert status == 200 and report["steps"] == 8 and report["outcome"] == "done", report
        status, answer = server.call("POST", "/api/runs/a/resume")
        assert status == 409 and "only an interrupted or failed run resumes" in answer["error"]
        wait_for(server, "b", ("done",))
        a_done = [json.loads(x) for x in (server.runs / "a" / "logs" / "decisions.jsonl").read_text().splitlines()]
        b_start = [json.loads(x) for x in (server.runs / "b" / "logs" / "decisions.jsonl").read_text().splitlines()]
        assert a_done[-1]["event"] == "done" and b_start[0]["time"] >= a_done[-1]["time"]
    finally:
        server.stop()


def test_runs_outlive_the_server_and_a_new_server_finds_them(tmp_path):
    first = Server(tmp_path)
    first.call("POST", "/api/runs", {**RUN, "steps": 24, "name": "outlives"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (first.call("GET", "/api/runs/outlives")[1]["step"] or 0):
        time.sleep(0.3)
    first.process.send_signal(signal.SIGKILL)  # the server dies; the run it started does not
    first.process.wait(timeout=30)
    second = Server(tmp_path)
    try:
        info = second.call("GET", "/api/runs/outlives")[1]
        assert info["state"] == "running", info
        done = wait_for(second, "outlives", ("done",), timeout=600)
        assert done["step"] == 24
    finally:
        second.stop()


def test_a_run_refused_by_the_cli_is_refused_here_first(tmp_path):
    server = Server(tmp_path)
    try:
        for body, said in (({**RUN, "out": "x"}, "names each run's folder"),
                           ({**RUN, "engine": "sd-scripts=/x"}, "autotune's engine"),
                           ({**RUN, "name": "../up"}, "a folder name")):
            status, answer = server.call("POST", "/api/runs", body)
            assert status == 400 and said in answer["error"], answer
        assert not server.runs.exists() or not any(server.runs.iterdir())
        status, answer = server.call("GET", "/api/runs/nope")
        assert status == 404
        # what only planning finds is the run's own one line, as the CLI prints it
        status, _ = server.call("POST", "/api/runs", {**RUN, "steps": 0, "name": "zero"})
        assert status == 201
        failed = wait_for(server, "zero", ("failed",))
        assert "--steps 0: must be 1 or more" in failed["message"], failed
    finally:
        server.stop()
