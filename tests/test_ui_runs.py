"""Runs through ``autotune ui``'s API against a real server and real training (builtin:tiny-sd15 on
examples/dataset): a queue of two with the first one's live events and report, and a server killed and restarted
while a run trains (the run goes on, the new server finds it). Stop and resume to the planned step are driven in
the browser (tests/test_ui_browser.py)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from test_ui_api import DATASET, Server

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


@pytest.mark.slow
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
        assert any(d.get("event") == "start" for n, d in events if n == "decision")
        progress = [d for n, d in events if n == "progress"]  # every report from the first step: whole curves
        assert progress[0]["step"] == 1 and progress[-1]["step"] == 8, progress
        assert all(p["lr"] >= 0 and p["peak_memory_mib"] > 0 and p["loss"] is not None for p in progress)
        assert progress[0]["lr"] > progress[-1]["lr"]  # the schedule's curve (cosine, to 0 at the end)
        late = events_of(server, "a")  # a page opened after the run still gets its whole history
        assert [d for n, d in late if n == "progress"] == progress
        info = wait_for(server, "a", ("done",))
        assert info["step"] == info["max_train_steps"] == 8 and info["engine"] == "autotune"
        assert info["planned"]["usable_bytes"] > info["planned"]["peak_bytes"] > 0
        status, lora = server.call("GET", "/api/runs/a/lora")  # autotune inspect's view, and the file to download
        assert status == 200 and lora["ranks"] == {"4": lora["modules"]["total"]}, lora
        status, data, _ = server.fetch(lora["download"])
        assert status == 200 and data == Path(lora["file"]).read_bytes() and Path(lora["file"]).name == "a.safetensors"
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


def sampled_run(tmp: Path) -> dict:
    """A small run of its own (4 images of 64 px, 4 steps) whose kohya config samples an image every 2 steps."""
    import toml
    from fixtures.engine_runs import toy_dataset

    data = toy_dataset(tmp / "toy", images=4, repeats=1)
    (tmp / "prompts.txt").write_text("a toy --w 64 --h 64 --s 2 --d 1\n", encoding="utf-8")
    config = tmp / "sampled.toml"
    config.write_text(toml.dumps({"max_train_steps": 4, "resolution": "64,64", "network_dim": 4,
                                  "learning_rate": 1e-4, "max_data_loader_n_workers": 0, "caption_extension": ".txt",
                                  "output_name": "lora", "sample_prompts": str(tmp / "prompts.txt"),
                                  "sample_every_n_steps": 2}))
    return {"dataset": str(data), "model": "builtin:tiny-sd15", "config": str(config), "name": "sampled"}


@pytest.mark.slow
def test_runs_and_the_queue_outlive_the_server_and_a_new_server_serves_them(tmp_path):
    """The server is killed while one run trains and another waits: the run goes on, the new server finds it,
    then starts the queued one from the queue file; that one's samples arrive as events and are served."""
    first = Server(tmp_path)
    first.call("POST", "/api/runs", {**RUN, "steps": 24, "name": "outlives"})
    status, queued = first.call("POST", "/api/runs", sampled_run(tmp_path))
    assert status == 201 and queued["state"] == "queued", queued
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (first.call("GET", "/api/runs/outlives")[1]["step"] or 0):
        time.sleep(0.3)
    first.process.send_signal(signal.SIGKILL)  # the server dies; the run it started does not
    first.process.wait(timeout=30)
    second = Server(tmp_path)
    try:
        assert second.call("GET", "/api/runs/outlives")[1]["state"] == "running"
        assert second.call("GET", "/api/runs")[1]["queue"] == ["sampled"]
        done = wait_for(second, "outlives", ("done",), timeout=600)
        assert done["step"] == 24
        events = events_of(second, "sampled")  # started by the new server once the first was done
        assert events[-1] == ("end", {"state": "done"}), events[-3:]
        samples = [data["file"] for name, data in events if name == "sample"]
        assert len(samples) == 2 and all(f.startswith("sample/lora_step") for f in samples), samples
        status, png, headers = second.fetch(f"/api/runs/sampled/files/{samples[0]}")
        assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n" and headers["content-type"] == "image/png"
        status, _, _ = second.fetch("/api/runs/sampled/files/../outlives/config.toml")
        assert status == 404
    finally:
        second.stop()


def test_a_run_as_users_watch_it_console_list_row_report_config_and_logs(tmp_path):
    """A short run (4 steps): its console arrives as ``log`` events as a terminal shows it (the progress bar's
    carriage-return redraws as one line), the runs list gives its family, duration and LoRA size with links to the
    report page (served sandboxed, no script) and the config that trained (as text); TensorBoard's folder and
    command; a page or script dropped into the run folder is not served."""
    from fixtures.engine_runs import toy_dataset

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a toy --w 64 --h 64 --s 2 --d 1\n", encoding="utf-8")
    body = {"dataset": str(toy_dataset(tmp_path / "toy", images=4, repeats=1)), "model": "builtin:tiny-sd15",
            "steps": 4, "rank": 4, "resolution": 64, "name": "watched", "output_name": "lora",
            # the settings a GUI user sets by hand (issue 51 item 1), as the page's form sends them
            "sample_prompts": str(prompts), "sample_every_n_steps": 2, "save_every_n_steps": 2,
            "lr_scheduler": "constant", "seed": 7}
    server = Server(tmp_path)
    try:
        status, answer = server.call("POST", "/api/runs", body)
        assert status == 201, answer
        events = events_of(server, "watched")
        assert events[-1] == ("end", {"state": "done"}), events[-3:]
        samples = [data["file"] for name, data in events if name == "sample"]
        assert len(samples) == 2 and all(f.startswith("sample/lora_step") for f in samples), samples
        config = (server.runs / "watched" / "config.toml").read_text()
        for line in ('lr_scheduler = "constant"', "seed = 7", "sample_every_n_steps = 2", "save_every_n_steps = 2",
                     f"sample_prompts = {json.dumps(str(prompts))}"):
            assert line in config, line
        assert "# yours (the plan's 'cosine'" in config and "lora-step00000002.safetensors" in {
            p.name for p in (server.runs / "watched").iterdir()}
        logs = [data for name, data in events if name == "log"]
        lines = [line for data in logs for line in data["lines"]]
        assert any(line.startswith("done: 4 steps") for line in lines), lines[-5:]
        bar = [line for line in lines if line.startswith("steps: 100%")]
        assert bar and all("\r" not in line and "]steps:" not in line for line in lines), bar  # one redraw per line
        row = next(r for r in server.call("GET", "/api/runs")[1]["runs"] if r["id"] == "watched")
        lora = server.runs / "watched" / "lora.safetensors"
        assert row["family"] == "tiny-sd15" and row["state"] == "done" and row["step"] == 4, row
        assert row["lora_bytes"] == lora.stat().st_size and row["duration_s"] >= 0, row
        assert row["tensorboard"]["logdir"] == str((server.runs / "watched" / "logs").resolve())
        assert row["tensorboard"]["command"].startswith("tensorboard --logdir ")
        status, page, headers = server.fetch(row["links"]["report"])
        assert status == 200 and b"Run report" in page and headers["content-type"].startswith("text/html")
        policy = headers["content-security-policy"]
        assert "sandbox" in policy and "script" not in policy and b"<script" not in page, policy
        status, config, headers = server.fetch(row["links"]["config"])
        assert status == 200 and b"network_dim = 4" in config and headers["content-type"].startswith("text/plain")
        assert b'lr_scheduler = "constant"' in config  # what trained: the user's settings through the engine
        for planted in ("evil.html", "evil.svg", "evil.js"):  # same origin as the page: never served
            (server.runs / "watched" / planted).write_text("<script>alert(1)</script>")
            status, body, _ = server.fetch(f"/api/runs/watched/files/{planted}")
            assert status == 404 and b"is not served" in body, body
        status, answer = server.call("GET", "/api/runs/nope/report")
        assert status == 404
    finally:
        server.stop()


def test_a_console_log_read_as_a_terminal_shows_it(tmp_path):
    """``ConsoleTail``: ended lines once each, the progress bar's redraws as its current text, a long log from
    its last 64 KiB (the partial line there dropped), a log started again read from its start."""
    from autotune.ui.events import LOG_TAIL_BYTES, ConsoleTail

    path = tmp_path / "console.log"
    path.write_bytes(b"x" * (LOG_TAIL_BYTES + 10) + b" cut\nfirst\n")
    tail = ConsoleTail(path)

    def add(data: bytes) -> tuple[list[str], str]:
        with open(path, "ab") as file:
            file.write(data)
        tail.poll()
        return tail.lines, tail.current

    assert add(b"") == (["first"], "")
    assert add(b"\rsteps 1/3") == ([], "steps 1/3")
    assert add(b"\rsteps 2/3\rsteps 3/3") == ([], "steps 3/3")
    assert add(b"\ndone\n") == (["steps 3/3", "done"], "")
    assert not tail.poll()  # nothing new
    path.write_bytes(b"again\n")  # shorter than what was read: a new log
    assert add(b"") == (["again"], "")


def test_a_sample_or_lora_being_written_is_not_listed(tmp_path):
    """A sample PNG or a LoRA caught before its rename into place (``atomic_path``'s hidden temp name keeps the
    image's suffix) is neither sent as a sample event nor taken as the run's LoRA: CI once saw the temp name of
    a sample arrive as a third sample. The real temp names, made by the writer itself and held open."""
    from autotune.report.load import run_lora
    from autotune.ui.events import run_events
    from sd_scripts_compat.facts.atomic import atomic_path

    class Done:
        runs_dir = tmp_path

        def state(self, run_id: str) -> tuple[str, str | None]:
            return ("done", None)

        def console_log(self, run_id: str) -> Path | None:
            return None

    run = tmp_path / "r"
    (run / "sample").mkdir(parents=True)
    (run / "sample" / "lora_step00000002_00.png").write_bytes(b"\x89PNG")
    (run / "lora.safetensors").write_bytes(b"whole")
    with atomic_path(run / "sample" / "lora_step00000004_00.png", suffix=".png") as sample_tmp, \
            atomic_path(run / "lora-step00000004.safetensors", suffix=".safetensors") as lora_tmp:
        sample_tmp.write_bytes(b"\x89PNG half")
        lora_tmp.write_bytes(b"half")
        samples = [json.loads(event.split("data: ", 1)[1])["file"] for event in run_events(Done(), "r")
                   if event.startswith("event: sample")]
        assert samples == ["sample/lora_step00000002_00.png"]
        assert run_lora(run) == run / "lora.safetensors"


def test_a_run_refused_by_the_cli_is_refused_here_first(tmp_path):
    server = Server(tmp_path)
    try:
        for body, said in (({**RUN, "out": "x"}, "names each run's folder"),
                           ({**RUN, "engine": "sd-scripts=/x"}, "this server offers autotune"),
                           ({**RUN, "name": "../up"}, "a folder name")):
            status, answer = server.call("POST", "/api/runs", body)
            assert status == 400 and said in answer["error"], answer
        assert not server.runs.exists() or not any(server.runs.iterdir())
        status, answer = server.call("GET", "/api/runs/nope")
        assert status == 404
        status, answer = server.call("GET", "/api/runs/nope/lora")
        assert status == 404
        # what only planning finds is the run's own one line, as the CLI prints it
        status, _ = server.call("POST", "/api/runs", {**RUN, "steps": 0, "name": "zero"})
        assert status == 201
        failed = wait_for(server, "zero", ("failed",))
        assert "--steps 0: must be 1 or more" in failed["message"], failed
    finally:
        server.stop()


def test_each_run_from_the_page_names_its_lora_after_its_own_folder(tmp_path):
    """Two runs of one dataset: folders <dataset>-<family> and ...-2, and the LoRA of each named after its folder, so
    the files can meet in one loras folder (issue 51: LoRA names collided across runs); a name the user gives wins.
    (The runs themselves end at planning, --steps 0: the names are in what the server queued.)"""
    server = Server(tmp_path)
    try:
        ids = [server.call("POST", "/api/runs", {**RUN, "steps": 0})[1]["id"] for _ in range(2)]
        status, mine = server.call("POST", "/api/runs", {**RUN, "steps": 0, "output_name": "my_style"})
        assert status == 201, mine
        assert ids == ["dataset-tiny-sd15", "dataset-tiny-sd15-2"], ids
        queued = {run_id: json.loads((server.runs / ".autotune-ui" / f"{run_id}.json").read_text())["values"]
                  for run_id in [*ids, mine["id"]]}
        assert [queued[run_id]["output_name"] for run_id in ids] == ids
        assert queued[mine["id"]]["output_name"] == "my_style"
        status, answer = server.call("POST", "/api/runs", {**RUN, "output_name": "../up"})
        assert status == 400 and "output_name" in answer["error"], answer
    finally:
        server.stop()


def test_the_users_sd_scripts_runs_from_the_page_when_the_server_offers_it(tmp_path):
    """``autotune ui --engine sd-scripts=PATH``: the page may choose it; the run is ``autotune run --engine ...``
    under the same watchdog. Against the FAKE sd-scripts of the wrapper tests (sd-scripts cannot be fetched in
    CI), which OOMs once at step 5: stepped down, resumed, done at the planned step."""
    from test_sd_scripts_wrapper import FAKE_SCRIPTS, diffusers_folder, fake_env, make_dataset, read_fake_lora

    data, model = make_dataset(tmp_path, pngs=True), diffusers_folder(tmp_path)
    env = {**fake_env(tmp_path, "oom_at=5"), "HF_HUB_OFFLINE": "1"}
    server = Server(tmp_path, "--engine", f"sd-scripts={FAKE_SCRIPTS}", env=env)
    try:
        assert server.call("GET", "/api/health")[1]["engines"] == ["autotune", "sd-scripts"]
        body = {"dataset": str(data), "model": "builtin:tiny-sd15", "engine": "sd-scripts"}
        status, answer = server.call("POST", "/api/runs", body)  # sd-scripts cannot load a built-in: refused first
        assert status == 400 and "only autotune's engine can load" in answer["error"], answer
        status, run = server.call("POST", "/api/runs", {**body, "model": str(model), "save_state_every": 0.2,
                                                        "name": "kohya"})
        assert status == 201, run
        info = wait_for(server, "kohya", ("done", "failed"), timeout=300)
        assert info["state"] == "done" and info["engine"] == "sd-scripts", info
        retry = json.loads((server.runs / "kohya" / "logs" / "retries.json").read_text())[0]
        assert retry["failure"] == "oom" and retry["step"] == 5
        _, meta = read_fake_lora(server.runs / "kohya" / "kohya.safetensors")  # named after its run
        assert meta["fake_true_steps"] == str(info["max_train_steps"]) == str(info["step"])
    finally:
        server.stop()


def test_the_users_musubi_tuner_runs_from_the_page_when_the_server_offers_it(tmp_path):
    """``autotune ui --engine musubi-tuner=PATH``: a Qwen-Image run from the page is ``autotune run --engine
    musubi-tuner=...`` under the same watchdog, against the FAKE musubi-tuner (tests/fixtures/fake_musubi_tuner),
    which OOMs once at step 5: stepped down (more blocks swapped), resumed, done at the target step."""
    from safetensors import safe_open
    from test_musubi_run import FAKE, _inputs

    data, model = _inputs(tmp_path)
    files = dict(zip(model[::2], model[1::2], strict=True))
    env = {"FAKE_MUSUBI": "oom_at=5", "FAKE_MUSUBI_MARKS": str(tmp_path / "marks"), "HF_HUB_OFFLINE": "1"}
    server = Server(tmp_path, "--engine", f"musubi-tuner={FAKE}", env=env)
    try:
        assert server.call("GET", "/api/health")[1]["engines"] == ["autotune", "musubi-tuner"]
        body = {"dataset": str(data), "model": "builtin:tiny-sd15", "engine": "musubi-tuner"}
        status, answer = server.call("POST", "/api/runs", body)  # not a musubi family: refused before any folder
        assert status == 400 and "not trained by musubi-tuner" in answer["error"], answer
        body = {"dataset": str(data), "model": files["--model"], "vae": files["--vae"],
                "text_encoder": files["--text_encoder"], "vram": 24, "batch": 1, "accum": 1, "epochs": 6,
                "save_state_every": 0.2, "engine": "musubi-tuner", "name": "qwen"}
        status, run = server.call("POST", "/api/runs", body)
        assert status == 201, run
        info = wait_for(server, "qwen", ("done", "failed"), timeout=300)
        assert info["state"] == "done" and info["engine"] == "musubi-tuner", info
        retry = json.loads((server.runs / "qwen" / "logs" / "retries.json").read_text())[0]
        assert retry["failure"] == "oom" and retry["step"] == 4
        (final,) = [p for p in (server.runs / "qwen").glob("*.safetensors") if "-from" not in p.name]
        with safe_open(str(final), framework="pt") as handle:
            assert handle.metadata()["fake_updates"] == handle.metadata()["ss_steps"] == str(info["step"]) == "24"
    finally:
        server.stop()
