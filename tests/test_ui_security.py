"""``autotune ui`` as an attacker meets it: a real server on loopback, spoken to over raw HTTP with the headers a
hostile page (or a DNS-rebound one) can make a browser send. Nothing may run, nothing outside the allowed folders
may be read, every refusal is a 4xx JSON line and the server's log holds no traceback. A bounded random-JSON fuzz
over every endpoint ends the file."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading

import pytest
from test_ui_api import DATASET, ROOT, Server

from sd_scripts_compat.facts.contract import SCHEMA_VERSION

RUN = {"dataset": str(DATASET), "model": "builtin:tiny-sd15", "steps": 1}


def raw_request(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict]:
    """One request over a plain socket, headers exactly as given (``Host`` included): the body is sent from a
    thread while the answer is read, so a server that refuses before reading it answers all the same."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if "Content-Length" not in headers and "Transfer-Encoding" not in headers:
        head += f"Content-Length: {len(body)}\r\n"
    head += "Connection: close\r\n\r\n"

    def send() -> None:
        try:
            sock.sendall(head.encode("latin-1") + body)
        except OSError:
            pass  # the server answered and closed before taking it all

    sender = threading.Thread(target=send)
    sender.start()
    response = http.client.HTTPResponse(sock, method=method)
    response.begin()
    try:
        data = response.read()
    except (http.client.IncompleteRead, ConnectionResetError) as error:
        # a server that refuses a body it did not read closes with that body unread: the kernel resets the
        # connection, and the answer's own body may be lost after its status line (a busy machine's race)
        data = getattr(error, "partial", b"")
    sender.join()
    sock.close()
    try:
        return response.status, json.loads(data) if data else {}
    except ValueError:
        return response.status, {"error": data.decode(errors="replace")}  # the HTTP layer's own refusal


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui-attack")
    running = Server(tmp)
    yield running
    log = running.stop()
    assert "Traceback" not in log and "Internal Server Error" not in log, log[-3000:]


def own(server: Server, **extra: str) -> dict[str, str]:
    return {"Host": f"127.0.0.1:{server.port}", **extra}


def nothing_ran(server: Server) -> None:
    assert not server.runs.exists() or not any(server.runs.iterdir()), list(server.runs.iterdir())


def test_a_rebound_name_is_not_this_server(server):
    """DNS rebinding: the page's own name, now pointing at 127.0.0.1, with a matching Origin."""
    evil = f"evil.example:{server.port}"
    for method, path in (("GET", "/api/health"), ("GET", "/"), ("GET", "/api/runs"), ("GET", "/static/app.js")):
        status, answer = raw_request(server.port, method, path, {"Host": evil})
        assert status == 421 and "not this server" in answer["error"], (path, answer)
    body = json.dumps(RUN).encode()
    for headers in ({"Host": evil, "Origin": f"http://{evil}"}, {"Host": evil},
                    {"Host": "evil.example", "Origin": "http://evil.example"},
                    {"Host": f"127.0.0.1.evil.example:{server.port}", "Origin": f"http://127.0.0.1:{server.port}"}):
        status, answer = raw_request(server.port, "POST", "/api/runs", {**headers, "Content-Type":
                                                                          "application/json"}, body)
        assert status == 421, (headers, answer)
    status, _ = raw_request(server.port, "GET", "/api/health", {"Host": f"localhost:{server.port}"})
    assert status == 200  # the loopback names a loopback server answers to
    status, _ = raw_request(server.port, "GET", "/api/health", {})  # no Host at all
    assert 400 <= status < 500
    nothing_ran(server)


@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain", "Sec-Fetch-Site": "cross-site", "Referer": "http://evil.example/"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
    {"Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"},
    {"Content-Type": "application/json", "Sec-Fetch-Site": "same-site"},
    {"Content-Type": "application/json", "Origin": "null"},
    {"Content-Type": "application/json", "Origin": "http://evil.example"},
    {"Content-Type": "application/json", "Origin": "https://127.0.0.1:1"},
    {"Content-Type": "application/json"},  # no Origin, no Sec-Fetch-Site: not the app's page
])
def test_cross_site_posts_are_refused_before_anything_runs(server, headers):
    for path in ("/api/runs", "/api/doctor", "/api/plan", "/api/runs/x/stop"):
        status, answer = raw_request(server.port, "POST", path, own(server, **headers), json.dumps(RUN).encode())
        assert status == 403 and "\n" not in answer["error"], (path, headers, answer)
    nothing_ran(server)


def test_the_apps_own_origin_must_still_send_json(server):
    for kind in ("text/plain", "application/x-www-form-urlencoded", "", "application/jsonx"):
        status, answer = raw_request(server.port, "POST", "/api/doctor", own(server, **{
            "Origin": server.origin, "Content-Type": kind}), json.dumps({"dataset": str(DATASET)}).encode())
        assert status == 415 and "application/json" in answer["error"], (kind, answer)
    page = own(server, **{"Sec-Fetch-Site": "same-origin", "Content-Type": "application/json; charset=utf-8"})
    status, _ = raw_request(server.port, "POST", "/api/doctor", page, json.dumps({"dataset": str(DATASET)}).encode())
    assert status == 200  # the page's own fetch, as Chromium sends it without Origin


@pytest.mark.parametrize(("key", "value"), [
    ("engin", "sd-scripts"), ("pytho", "/bin/sh"), ("python", "/bin/sh"), ("engine", "sd-scripts=/tmp"),
    ("model=/etc/hostname", True), ("conf", "/etc/hostname"), ("--model", "/etc/hostname"), ("m", "/etc/hostname"),
    ("dataset-config", "/etc/hostname"), ("out", "/tmp/x"), ("resume", True), ("json", True), ("help", True),
    ("Model", "/etc/hostname"), ("model ", "/etc/hostname"), ("", "x"), ("__class__", {}),
])
def test_body_keys_are_exact_option_names_never_argv(server, key, value):
    status, answer = server.call("POST", "/api/runs", {**RUN, key: value})
    assert status == 400 and "\n" not in answer["error"], (key, answer)
    assert "hostname" not in answer["error"] or "outside" not in answer["error"]
    nothing_ran(server)


def test_path_fields_take_one_string_inside_the_allowed_folders(server):
    from autotune.ui.schemas import command_schema

    keys = command_schema("run").path_keys()
    assert {"dataset", "model", "config", "dataset_config", "clip_l", "t5xxl"} <= set(keys)
    for key in keys:
        for value in (["/etc/hostname"], {"path": "/etc/hostname"}, 5, True, None):
            status, answer = server.call("POST", "/api/runs", {**RUN, key: value})
            assert status == 400 and answer["error"].startswith(f"{key}:"), (key, value, answer)
        status, answer = server.call("POST", "/api/runs", {**RUN, key: "/etc/hostname"})
        assert status == 403 and "outside" in answer["error"], (key, answer)
        status, answer = server.call("POST", "/api/runs", {**RUN, key: str(DATASET / ".." / ".." / ".." / "etc")})
        assert status == 403, (key, answer)
    for model in ("builtin:../../../../../../etc/hostname", "builtin:/etc/hostname"):
        status, answer = server.call("POST", "/api/plan", {**RUN, "model": model})
        assert status in (400, 403) and "hostname" not in answer["error"].split(":")[-1], answer  # a "builtin:"
        # that names no built-in model is a path like any other: inside the allowed folders, and not there
    nothing_ran(server)


@pytest.mark.parametrize(("body", "said"), [
    ({**RUN, "rank": 10**400}, "rank: "), ({**RUN, "rank": -1}, "rank: "), ({**RUN, "rank": 2.5}, "rank: "),
    ({**RUN, "rank": True}, "rank: "), ({**RUN, "vram": [1] * 100}, "vram: "), ({**RUN, "lr": "1e-4"}, "lr: "),
    ({**RUN, "gpu": "x" * 5000}, "gpu"), ({**RUN, "gpu": "RTX\x004090"}, "gpu"),
    ({**RUN, "optimizer": "rm -rf /"}, "optimizer: "), ({**RUN, "name": "..\\x"}, "name: "),
    ({**RUN, "name": "a" * 300}, "name: "), ({**RUN, "name": "a\x00b"}, "name: "), ({**RUN, "name": ".."}, "name: "),
    ({**RUN, "name": "a/b"}, "name: "), ({**RUN, "name": ".hidden"}, "name: "), ({**RUN, "name": ""}, "name: "),
    ([RUN], "one JSON object"), ("x", "one JSON object"), (None, "one JSON object"),
])
def test_wrong_types_ranges_and_names_are_400(server, body, said):
    status, answer = server.call("POST", "/api/runs", raw=json.dumps(body).encode())
    assert status == 400 and said in answer["error"] and "\n" not in answer["error"], answer
    assert len(answer["error"]) < 2000
    nothing_ran(server)


def test_huge_deep_and_odd_bodies_are_refused_with_4xx(server):
    headers = own(server, Origin=server.origin, **{"Content-Type": "application/json"})
    big = b'{"gpu": "' + b"x" * (50 << 20) + b'"}'
    status, answer = raw_request(server.port, "POST", "/api/plan", {**headers, "Content-Length": str(len(big))})
    assert status == 413, answer  # refused on its Content-Length, before a byte of it (none sent: no reset race)
    status, answer = raw_request(server.port, "POST", "/api/plan", headers, big)
    assert status == 413, answer
    chunked = {**headers, "Transfer-Encoding": "chunked"}  # no Content-Length: the stream is counted
    piece = b"x" * (1 << 20)
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(3)) + b"0\r\n\r\n"
    status, answer = raw_request(server.port, "POST", "/api/plan", chunked, body)
    assert status == 413, answer
    for raw, code in ((b"[" * 200_000 + b"]" * 200_000, 400), (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400),
                      (b'{"rank": NaN}', 400), (b'{"rank": Infinity}', 400), (b"\xff\xfe", 400), (b"", 400),
                      (b'{"dataset": "' + str(DATASET).encode() + b'", "dataset": 1}', 400)):
        status, answer = raw_request(server.port, "POST", "/api/plan", headers, raw)
        assert status == code and "\n" not in answer["error"], (raw[:40], answer)
    status, _ = raw_request(server.port, "POST", "/api/plan", {**headers, "Content-Length": "-5"}, b"")
    assert status == 400  # uvicorn's own refusal of a broken request, one line in its log
    nothing_ran(server)


def test_run_names_and_unknown_runs_in_urls(server):
    for name in ("a" * 300, "..", "%2e%2e", "a%00b", "..%5cx", ".autotune-ui", "x"):
        for method, suffix in (("GET", ""), ("GET", "/report"), ("GET", "/lora"), ("GET", "/events"),
                               ("POST", "/stop"), ("POST", "/resume"), ("GET", "/files/a.png")):
            status, answer = server.call(method, f"/api/runs/{name}{suffix}")
            assert status == 404 and "\n" not in answer["error"], (name, suffix, answer)


def test_every_response_carries_the_security_headers(server):
    for path in ("/", "/static/app.js", "/api/health", "/api/runs/nope", "/nope"):
        status, _, headers = server.fetch(path)
        csp = headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp, path
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "DENY", path
    status, _, headers = server.fetch("/")
    assert status == 200 and "<script>" not in (ROOT / "autotune" / "ui" / "static" / "index.html").read_text()


def test_lower_case_bearer_and_the_token_rules_off_loopback(tmp_path):
    running = Server(tmp_path, host="0.0.0.0")
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            status, _ = running.call("GET", "/api/health", headers={"Authorization": f"{scheme} {running.token}"})
            assert status == 200, scheme
        status, _ = running.call("GET", "/api/health", headers={"Authorization": f"Basic {running.token}"})
        assert status == 401
        # a script with the token in its header needs no Origin (no cross-site page can add that header)
        status, answer = running.call("POST", "/api/doctor", {"dataset": str(DATASET)}, headers={
            "Origin": None, "Authorization": f"bearer {running.token}"})
        assert status == 200, answer
        status, _ = running.call("POST", "/api/doctor", {"dataset": str(DATASET)}, headers={
            "Origin": "http://evil.example", "Authorization": f"Bearer {running.token}"})
        assert status == 403  # a page that somehow has the token still cannot post from elsewhere
    finally:
        assert "Traceback" not in running.stop()


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_malformed_run_folder_is_one_unreadable_run(tmp_path):
    """Each file the server reads from a run folder, holding the wrong JSON type: that run is unreadable with one
    line; the list, the queue and the good run beside it go on."""
    runs = tmp_path / "runs"
    bad = {"progress-list": ("logs/events/progress.json", "[]"), "progress-type": ("logs/events/progress.json",
           '{"step": "many"}'), "decisions-str": ("logs/decisions.jsonl", '"x"\n'),
           "decisions-noevent": ("logs/decisions.jsonl", '{"text": 1}\n'),
           "decisions-deep": ("logs/decisions.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
           "plan-number": ("autotune_plan.json", "5"), "plan-prediction": ("autotune_plan.json", '{"prediction": 3}')}
    for name, (file, text) in bad.items():
        write(runs / name / "config.toml", "")
        write(runs / name / file, text)
    write(runs / "good" / "config.toml", "")
    write(runs / "good" / "logs" / "decisions.jsonl", '{"event": "done", "text": "finished"}\n')
    write(runs / "recorded" / "config.toml", "")
    write(runs / ".autotune-ui" / "recorded.json", '["not", "a", "record"]')
    write(runs / ".autotune-ui" / "queue.json", '[{"id": 5}, "x", {"id": "../up", "argv": []}]')
    write(runs / "bad name!" / "config.toml", "")
    write(runs / "elsewhere" / "config.toml", "")  # a done.json naming a file outside the allowed folders
    write(runs / "elsewhere" / "logs" / "decisions.jsonl", '{"event": "done", "text": "finished"}\n')
    write(runs / "elsewhere" / "logs" / "events" / "done.json", json.dumps({
        "event": "done", "schema": SCHEMA_VERSION, "output_file": "/etc/hostname"}))
    running = Server(tmp_path)
    try:
        status, listing = running.call("GET", "/api/runs")
        assert status == 200 and listing["queue"] == [], listing
        states = {run["id"]: run for run in listing["runs"]}
        assert set(states) == {*bad, "good", "recorded", "elsewhere"}, states  # "bad name!" is no run name: left out
        assert states["good"]["state"] == "done" and states["good"]["message"] == "finished"
        for name in [*bad, "recorded"]:
            assert states[name]["state"] == "unreadable" and "\n" not in states[name]["message"], states[name]
        status, answer = running.call("POST", "/api/runs/progress-list/resume")
        assert status == 409 and "unreadable" in answer["error"]
        status, events = running.call("GET", "/api/runs/decisions-str")
        assert status == 200 and "decisions.jsonl" in events["message"]
        status, answer = running.call("GET", "/api/runs/elsewhere/lora")
        assert status == 404 and "outside the folders" in answer["error"], answer  # not read, not served
        _, stream, _ = running.fetch("/api/runs/decisions-str/events")  # the stream ends at once
        assert b"event: end" in stream and b"unreadable" in stream
    finally:
        log = running.stop()
    assert "Traceback" not in log, log[-3000:]


def random_json(rng: random.Random, depth: int = 0) -> object:
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 7, 2**31, 2**63, 10**30, -(10**20)])
    if kind == "float":
        return rng.choice([0.5, -1e-9, 1e308, 3.0, 1e-4])
    if kind == "str":
        return rng.choice(["", "x", "../..", "/etc/hostname", "builtin:tiny-sd15", "builtin:nope", "\u2603",
                           "a\x00b", "1e-4", "768,768", "AdamW", "--model", "x" * 5000, str(DATASET)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "rank", "model"]): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def random_body(rng: random.Random, keys: list[str]) -> object:
    """A body of the endpoint's own keys (and a few foreign ones) with random values; sometimes no object at all.
    ``dataset`` stays outside the allowed folders for runs, so no fuzzed run can start (a real run per body would
    take the whole test's time); plan and doctor bodies get the real dataset half the time and go all the way."""
    if rng.random() < 0.1:
        return random_json(rng)
    body = {key: random_json(rng) for key in rng.sample(keys, rng.randint(0, min(6, len(keys))))}
    if rng.random() < 0.5:
        body["dataset"] = str(DATASET)
        body.setdefault("model", "builtin:tiny-sd15")
    if rng.random() < 0.1:
        body[rng.choice(["engin", "x", "model=/etc/hostname", "conf"])] = random_json(rng)
    return body


def test_random_json_over_every_endpoint_never_500s(server):
    from autotune.ui.schemas import command_schema

    rng = random.Random(47)
    keys = {command: list(command_schema(command).model.model_fields) for command in ("doctor", "plan", "run")}
    seen: dict[int, int] = {}
    for _ in range(240):
        command = rng.choice(["doctor", "plan", "run", "stop", "resume"])
        body = random_body(rng, keys.get(command, ["a"]))
        if command == "run" and isinstance(body, dict):
            body["dataset"] = "/etc"
        path = {"doctor": "/api/doctor", "plan": "/api/plan", "run": "/api/runs"}.get(command,
                                                                                        f"/api/runs/x/{command}")
        status, answer = server.call("POST", path, raw=json.dumps(body).encode())
        seen[status] = seen.get(status, 0) + 1
        assert status < 500 and (status == 200 or "\n" not in answer["error"]), (body, answer)
    for _ in range(60):
        query = "&".join(f"{rng.choice(['path', 'dataset', 'file', 'model', 'resolution'])}="
                         f"{rng.choice(['', '..', '/etc', str(DATASET), 'x.png', '%00', '99999999999'])}"
                         for _ in range(rng.randint(0, 4)))
        status, _, _ = server.fetch(f"/api/{rng.choice(['browse', 'thumbnail'])}?{query}")
        assert status < 500, query
    # some bodies went all the way (how many follows the schemas' key lists: a new option moves the sequence)
    assert seen.get(200, 0) >= 3 and sum(v for k, v in seen.items() if 400 <= k < 500) > 100, seen
    nothing_ran(server)


def test_a_started_run_is_its_validated_values_never_a_command_line(tmp_path, monkeypatch, capsys):
    """The server records the validated values; the run's process (start_run) validates them again and hands
    ``autotune run``'s own function the namespace its parser would make: a value that looks like an option stays
    a value, and the engine and Python are only the server's own."""
    import autotune.launch.run
    from autotune.ui import start_run
    from autotune.ui.runs import EngineChoice, Record

    seen = {}
    monkeypatch.setattr(autotune.launch.run, "start_run", lambda args: seen.setdefault("args", args) and 0)
    values = {"dataset": "--out=/tmp/x", "model": "--engine=sd-scripts=/tmp", "gpu": ["-x"], "rank": 8, "lr": 1e-4}
    record = tmp_path / "r.json"
    record.write_text(Record(values=values).model_dump_json())
    assert start_run.main([str(record), str(tmp_path / "out")]) == 0
    args = seen.pop("args")
    assert (args.dataset, args.model, args.gpu, args.rank, args.lr) == ("--out=/tmp/x", "--engine=sd-scripts=/tmp",
                                                                        ["-x"], 8, 1e-4)
    assert args.out == str(tmp_path / "out") and args.resume is False and args.engine is None and args.python is None
    assert args.command == "run" and args.max_retries == 5  # the parser's defaults for what the page left out
    record.write_text(Record(values=values, engine=EngineChoice(name="sd-scripts", engine="sd-scripts=/s",
                                                                python="/s/venv/bin/python")).model_dump_json())
    assert start_run.main([str(record), str(tmp_path / "out"), "--resume"]) == 0
    args = seen.pop("args")
    assert (args.engine, args.python, args.resume) == ("sd-scripts=/s", "/s/venv/bin/python", True)
    for tampered in ({**values, "python": "/bin/sh"}, {**values, "engin": "x"}, {**values, "rank": "8"}):
        record.write_text(json.dumps({"values": tampered}))
        assert start_run.main([str(record), str(tmp_path / "out")]) == 2 and not seen
        assert capsys.readouterr().err.count("\n") == 1
