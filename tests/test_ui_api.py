"""``autotune ui``'s HTTP API against a real server: ``python -m autotune ui`` in a subprocess on a free port, spoken
to over HTTP. Every endpoint, bad input as one 4xx JSON line with nothing written, and the security rules: a token
off loopback, no cross-origin POSTs, no path outside the allowed folders (``..`` and symlinks included)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from email.message import Message
from pathlib import Path

import pytest
import toml

from autotune.recovery.engine import free_port

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples" / "dataset"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


class Server:
    """``autotune ui`` running in a subprocess; ``call`` speaks to it, ``url`` is what it printed."""

    def __init__(self, tmp: Path, *extra: str, host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        self.port, self.runs = free_port(), tmp / "runs"
        command = [sys.executable, "-m", "autotune", "ui", "--host", host, "--port", str(self.port),
                   "--runs", str(self.runs), "--allow-dir", str(ROOT / "examples"), "--allow-dir", str(tmp), *extra]
        started = time.monotonic()
        # the test's own measurement store (conftest sets it per test, after ENV was made): what another test's
        # server trained must not make this one's plans "measured"
        own = {**ENV, "AUTOTUNE_CACHE_DIR": os.environ["AUTOTUNE_CACHE_DIR"]}
        # stderr to a file, not a pipe: a pipe nobody reads until ``stop`` could fill and stall the server, and an
        # answer of 500 is reported with what the server wrote (``call``)
        self.stderr_path = tmp / f"ui-{self.port}.stderr"
        with self.stderr_path.open("w") as stderr:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=tmp,
                                            env=env or own)
        self.url = self.process.stdout.readline().strip()  # the line it prints once it listens
        self.token = self.url.split("?token=")[1].split()[0] if "?token=" in self.url else None
        self.start_seconds = time.monotonic() - started
        self.origin = f"http://127.0.0.1:{self.port}"

    def call(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
             headers: dict[str, str | None] | None = None) -> tuple[int, dict]:
        """One request as the app's own page sends it (a POST: its Origin, a JSON body); ``headers`` adds to or
        replaces those, a ``None`` value leaves that header out."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        sent = {"Origin": self.origin, "Content-Type": "application/json"} if method == "POST" else {}
        sent = {k: v for k, v in {**sent, **(headers or {})}.items() if v is not None}
        if method == "POST" and data is None:
            data = b"{}"
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            answer = error.read()
            if error.code >= 500:
                raise AssertionError(f"{method} {path}: {error.code} {answer[:200]!r}; the server's stderr ends:\n"
                                     f"{self.stderr_path.read_text()[-4000:]}") from None
            return error.code, json.loads(answer)

    def fetch(self, path: str) -> tuple[int, bytes, Message]:
        """A GET whose answer is not JSON (an image, a file): status, bytes, headers (case-insensitive)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=60) as response:
                return response.status, response.read(), response.headers
        except urllib.error.HTTPError as error:
            return error.code, error.read(), error.headers

    def stop(self) -> str:
        self.process.terminate()
        self.process.communicate(timeout=30)
        return self.stderr_path.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    running = Server(tmp)
    yield running
    assert "Traceback" not in running.stop()


def test_it_prints_its_url_and_answers_at_once(server):
    assert server.url == f"autotune ui: http://127.0.0.1:{server.port}/"
    assert server.start_seconds < 10  # measured by the closing note; CI machines vary
    status, health = server.call("GET", "/api/health")
    assert status == 200 and health["ok"] and health["runs_dir"] == str(server.runs)


def test_probe_doctor_and_plan_answer_with_the_clis_json(server):
    status, probe = server.call("GET", "/api/probe")
    assert status == 200 and "cpu" in probe and "gpus" in probe
    status, doctor = server.call("POST", "/api/doctor", {"dataset": str(DATASET)})
    assert status == 200 and doctor["format"] == "lora-autotune-doctor/1" and doctor["summary"]["images"] == 12
    cli = subprocess.run([sys.executable, "-m", "autotune", "doctor", str(DATASET), "--json"], capture_output=True,
                         text=True, env=ENV, cwd=ROOT, timeout=120)
    assert set(json.loads(cli.stdout)) == set(doctor)  # the same fields as the command's --json
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:tiny-sd15",
                                                     "rank": 8, "batch": 2})
    assert status == 200 and plan["fits"] and plan["settings"]["network_dim"] == 8
    assert plan["settings"]["train_batch_size"] == 2 and plan["family"] == "tiny-sd15"
    assert {"choices", "prediction", "dataset"} <= set(plan)
    config = toml.loads(plan["configs"]["config.toml"])  # what plan --out would write, for the page to show
    assert config["network_dim"] == 8 and config["train_batch_size"] == 2
    dataset = toml.loads(plan["configs"]["dataset.toml"])
    assert len(dataset["datasets"][0]["subsets"]) == 3


def test_a_musubi_family_shows_the_files_musubi_tuner_runs(server):
    """Every family the planner knows appears in the page without code of its own: Z-Image's plan carries
    musubi's dataset TOML, its --config_file and musubi_train.sh, as autotune plan --out writes them."""
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:z-image", "vram": 16})
    assert status == 200 and plan["fits"] and plan["family"] == "z-image"
    assert set(plan["configs"]) == {"config.toml", "dataset.toml", "musubi_train.sh"}
    assert toml.loads(plan["configs"]["config.toml"])["network_module"] == "networks.lora_zimage"
    assert "image_directory" in toml.loads(plan["configs"]["dataset.toml"])["datasets"][0]
    assert "zimage_train_network.py" in plan["configs"]["musubi_train.sh"]


def test_both_wan22_experts_are_one_more_key_of_the_plan_request(server):
    """The web app's plan takes --experts as any other option: Wan 2.2's plan trains both experts, its config
    carries the boundary and the script the second expert's file variable."""
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:wan2.2-t2v-a14b",
                                                     "vram": 24, "experts": "both"})
    assert status == 200 and plan["fits"] and plan["settings"]["high_noise_expert"]
    assert toml.loads(plan["configs"]["config.toml"])["timestep_boundary"] == 875
    assert '--dit_high_noise "$DIT_HIGH_NOISE"' in plan["configs"]["musubi_train.sh"]
    status, refused = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:z-image",
                                                        "vram": 24, "experts": "both"})
    assert status == 400 and "has one DiT" in refused["error"]


def test_a_pinned_value_that_does_not_fit_is_planned_down_and_said(server):
    """The page flags an edited value the plan could not keep: the plan says what fits instead."""
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:sdxl", "vram": 8,
                                                     "batch": 32, "resolution": 1024})
    assert status == 200 and plan["settings"]["train_batch_size"] < 32
    assert any("micro-batch 32" in line and "does not fit" in line for line in plan["fallbacks"])


def test_thumbnails_are_cropped_as_the_engine_crops(server):
    """320 x 192 and 288 x 224 at 256 px (tiny-sd15, bucket_no_upscale): buckets 320 x 192 and 256 x 192."""
    from io import BytesIO

    from PIL import Image

    for name, bucket in (("10_square shape/square_02.png", [320, 192]), ("10_square shape/square_03.jpg", [256, 192])):
        query = urllib.parse.urlencode({"dataset": str(DATASET), "file": name, "model": "builtin:tiny-sd15",
                                        "resolution": 256})
        status, png, headers = server.fetch(f"/api/thumbnail?{query}")
        crop = json.loads(headers["X-Autotune-Crop"])
        assert status == 200 and crop["bucket"] == bucket, crop
        image = Image.open(BytesIO(png))
        assert image.format == "PNG" and max(image.size) == 192
        assert abs(image.size[0] / image.size[1] - bucket[0] / bucket[1]) < 0.02
    for file, code in (("../../pyproject.toml", 403), ("10_square shape/missing.png", 404),
                       ("10_square shape/square_02.txt", 400)):
        query = urllib.parse.urlencode({"dataset": str(DATASET), "file": file})
        status, body, _ = server.fetch(f"/api/thumbnail?{query}")
        assert status == code and "\n" not in json.loads(body)["error"], (file, body)
    for query, said in ((f"dataset={DATASET}", "file: Field required"),
                        (f"dataset={DATASET}&file=x.png&resolution=big", "resolution: ")):
        status, body, _ = server.fetch(f"/api/thumbnail?{query}")
        assert status == 400 and json.loads(body)["error"].startswith(said), body


def test_folder_browser_lists_folders_and_model_files(server, tmp_path):
    status, roots = server.call("GET", "/api/browse")
    assert status == 200 and str(ROOT / "examples") in roots["folders"]
    status, listing = server.call("GET", f"/api/browse?path={ROOT / 'examples'}")
    assert status == 200 and listing["folders"] == ["dataset"] and listing["parent"] is None


@pytest.mark.parametrize(("method", "path", "body", "status", "said"), [
    ("POST", "/api/plan", {"dataset": "/etc", "model": "builtin:tiny-sd15"}, 403, "outside the folders"),
    ("POST", "/api/plan", {"dataset": str(DATASET), "model": "/etc/passwd"}, 403, "model /etc/passwd: outside"),
    ("POST", "/api/doctor", {"dataset": str(DATASET / ".." / ".." / ".." / "sd_scripts_compat")}, 403, "outside"),
    ("GET", "/api/browse?path=/", None, 403, "outside the folders"),
    ("POST", "/api/plan", {"dataset": str(DATASET), "model": str(ROOT / "examples" / "nope.safetensors")}, 400,
     "not found"),
    ("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:sdxl", "vram": 2}, 422, "needs"),
    ("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:tiny-sd15", "rank": "many"}, 400,
     "rank: Input should be a valid integer"),
    ("POST", "/api/plan", {"dataset": str(DATASET), "model": "builtin:tiny-sd15", "out": "x"}, 400,
     "plans without writing"),
    ("POST", "/api/plan", [1, 2], 400, "one JSON object"),
    ("GET", "/api/browse?path=" + str(ROOT / "examples" / "missing"), None, 404, "not a folder"),
    ("POST", "/api/presets/import", {"format": "a1111", "text": "{}"}, 400, "format: Input should be 'kohya_ss'"),
    ("POST", "/api/presets/import", {"format": "kohya_ss", "text": "{not json"}, 400,
     "text: not a kohya_ss preset (JSON: "),
    ("POST", "/api/presets/import", {"format": "kohya_ss", "text": "[1, 2]"}, 400, "one object of settings"),
    ("POST", "/api/presets/import", {"format": "sd-scripts", "text": "network_dim = = 4"}, 400,
     "text: not a sd-scripts preset (TOML: "),
    ("POST", "/api/presets/import", {"format": "kohya_ss", "text": "x" * (600 * 1024)}, 400,
     "text: String should have at most"),
    ("POST", "/api/presets/import", {"format": "kohya_ss", "text": "{}", "path": "/etc/passwd"}, 400,
     "path: Extra inputs are not permitted"),
])
def test_bad_input_is_one_json_line_and_writes_nothing(server, method, path, body, status, said):
    before = set(server.runs.parent.rglob("*"))
    got, answer = server.call(method, path, body)
    assert got == status and said in answer["error"] and "\n" not in answer["error"], answer
    assert set(server.runs.parent.rglob("*")) == before


def test_malformed_json_and_other_methods_are_refused(server):
    status, answer = server.call("POST", "/api/plan", raw=b"{bad")
    assert status == 400 and "not JSON" in answer["error"]
    status, answer = server.call("DELETE", "/api/health")
    assert status == 405


def test_cross_origin_post_is_refused_and_same_origin_is_not(server):
    body = {"dataset": str(DATASET)}
    status, answer = server.call("POST", "/api/doctor", body, headers={"Origin": "http://evil.example"})
    assert status == 403 and "cross-origin" in answer["error"]
    status, _ = server.call("POST", "/api/doctor", body, headers={"Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 200


def test_symlink_out_of_the_allowed_folders_is_refused(server, tmp_path):
    # tmp_path is not allowed (the server allows its own module folder): a link inside an allowed folder
    # pointing out is followed before the check
    allowed = server.runs.parent
    link = allowed / "escape"
    link.symlink_to("/etc")
    status, answer = server.call("GET", f"/api/browse?path={link}")
    assert status == 403 and "outside" in answer["error"]


def test_off_loopback_every_endpoint_needs_the_token(tmp_path):
    running = Server(tmp_path, host="0.0.0.0")
    try:
        assert running.token and f"?token={running.token}" in running.url
        run = {"dataset": str(DATASET), "model": "builtin:tiny-sd15"}
        for method, path, body in (("GET", "/api/health", None), ("GET", "/api/probe", None),
                                   ("GET", "/api/browse", None), ("POST", "/api/doctor", {"dataset": str(DATASET)}),
                                   ("POST", "/api/plan", run), ("GET", "/api/runs", None), ("POST", "/api/runs", run),
                                   ("GET", "/api/runs/x", None), ("GET", "/api/runs/x/events", None),
                                   ("POST", "/api/runs/x/stop", None), ("POST", "/api/runs/x/resume", None),
                                   ("GET", "/api/runs/x/report", None), ("GET", "/api/runs/x/lora", None),
                                   ("GET", "/api/runs/x/files/a.png", None), ("GET", "/", None),
                                   ("GET", "/static/app.js", None),
                                   ("GET", f"/api/thumbnail?dataset={DATASET}&file=x.png", None)):
            status, answer = running.call(method, path, body)
            assert status == 401 and "token" in answer["error"], (path, answer)
            status, _ = running.call(method, path, body, headers={"Authorization": "Bearer wrong"})
            assert status == 401
            status, _ = running.call(method, path, body, headers={"Cookie": "autotune_token=wrong"})
            assert status == 401
        assert not running.runs.exists()  # nothing was started or written
        # the page opened with its token: the cookie it gets back lets its script and style load
        status, page, headers = running.fetch(f"/?token={running.token}")
        cookie = headers["set-cookie"]
        assert status == 200 and b"app.js" in page and "HttpOnly" in cookie and "SameSite=strict" in cookie
        request = urllib.request.Request(f"http://127.0.0.1:{running.port}/static/app.js",
                                         headers={"Cookie": cookie.split(";")[0]})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        status, _ = running.call("GET", "/api/health", headers={"Authorization": f"Bearer {running.token}"})
        assert status == 200
        status, _ = running.call("GET", f"/api/health?token={running.token}")
        assert status == 200
    finally:
        running.stop()


def test_engines_are_fixed_by_the_server_not_the_page(server, tmp_path):
    status, health = server.call("GET", "/api/health")
    assert health["engines"] == ["autotune"]
    body = {"dataset": str(DATASET), "model": "builtin:tiny-sd15"}
    for extra, said in (({"engine": "sd-scripts"}, "offers autotune"), ({"python": "/bin/sh"}, "ui's --python")):
        status, answer = server.call("POST", "/api/runs", {**body, **extra})
        assert status == 400 and said in answer["error"], answer
    done = subprocess.run([sys.executable, "-m", "autotune", "ui", "--engine", f"sd-scripts={tmp_path}"],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not sd-scripts" in done.stderr


def test_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "autotune", "ui", "--port", str(port)], capture_output=True,
                              text=True, env=ENV, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "choose another --port" in done.stderr


def test_model_files_take_kohyas_option_names_and_the_allowed_folders(server):
    """``{"clip_g": FILE}`` is ``--clip_g FILE`` (kohya's spelling), and its path is checked like the others."""
    body = {"dataset": str(DATASET), "model": "builtin:tiny-sd3", "clip_g": "/etc/passwd"}
    status, answer = server.call("POST", "/api/plan", body)
    assert status == 403 and "clip_g /etc/passwd: outside" in answer["error"]
    status, answer = server.call("POST", "/api/plan", {**body, "clip_g": str(DATASET / "missing.safetensors")})
    assert status == 400 and "--clip_g" in answer["error"] and "no such file" in answer["error"]


def test_the_form_is_the_run_schema_and_the_users_settings_are_planned_as_theirs(server):
    """GET /api/options lists every key POST /api/runs validates, each in a --help group, with its kind and the
    sd-scripts key it sets; the GUI settings (scheduler, samples, saves, seed) plan as given with the reason "yours",
    a sample-prompts file outside the allowed folders is refused like any path, a value out of sd-scripts' range is
    one line."""
    from autotune.launch.plan_options import ADVANCED, MODEL, NETWORK, SAVING, SCHEDULE, TARGET
    from autotune.launch.plan_options import DATASET as DATA
    from autotune.ui.schemas import RUN_GROUP, command_schema

    fields = server.call("GET", "/api/options")[1]["fields"]
    by_key = {f["key"]: f for f in fields}
    run = command_schema("run")
    assert set(by_key) == set(run.actions) and {f["group"] for f in fields} == {
        MODEL, TARGET, DATA, NETWORK, SCHEDULE, SAVING, ADVANCED, RUN_GROUP}
    assert by_key["rank"]["config"] == "network_dim" and by_key["rank"]["kind"] == "integer"
    assert by_key["lr_scheduler"]["kind"] == "choice" and "cosine_with_restarts" in by_key["lr_scheduler"]["choices"]
    assert by_key["sample_prompts"]["kind"] == "path" and by_key["sample_at_first"]["kind"] == "flag"
    assert by_key["max_retries"]["plan"] is False and by_key["seed"]["plan"] is True
    prompts = DATASET.parent / "dataset" / "10_circle shape" / "circle_00.txt"  # any text file inside the roots
    body = {"dataset": str(DATASET), "model": "builtin:tiny-sd15", "lr_scheduler": "constant_with_warmup",
            "lr_warmup_steps": 0.1, "seed": 3, "noise_offset": 0.05, "sample_prompts": str(prompts),
            "sample_every_n_epochs": 1, "save_last_n_epochs": 2}
    status, plan = server.call("POST", "/api/plan", body)
    assert status == 200, plan
    chosen = {c["key"]: c for c in plan["choices"]}
    for key, value in body.items():
        if key not in ("dataset", "model"):
            assert chosen[key]["value"] == value and chosen[key]["reason"].startswith("yours"), chosen[key]
    assert chosen["lr_scheduler"]["reason"].startswith("yours (the plan's 'cosine'")
    assert 'lr_scheduler = "constant_with_warmup"' in plan["configs"]["config.toml"]
    status, answer = server.call("POST", "/api/plan", {**body, "sample_prompts": "/etc/hostname"})
    assert status == 403 and "outside" in answer["error"], answer
    status, answer = server.call("POST", "/api/plan", {**body, "save_last_n_epochs": 0})
    assert status == 400 and "save_last_n_epochs: must be 1 or more, got 0" in answer["error"], answer


def test_a_models_files_beside_it_are_offered_with_its_plan(server):
    """POST /api/plan of a FLUX.1 file names, under ``beside``, the clip_l / t5xxl / ae files its folder holds
    (told apart by their headers), for the page to fill in; with them given, nothing more is offered."""
    from sd_scripts_compat.models.flux_files import save_flux_files
    from sd_scripts_compat.runtimes import load_base_model

    files = save_flux_files(load_base_model("builtin:tiny-flux"), server.runs.parent / "flux")
    body = {"dataset": str(DATASET), "model": str(files["pretrained_model_name_or_path"])}
    status, plan = server.call("POST", "/api/plan", body)
    assert status == 200, plan
    assert plan["beside"] == {key: str(files[key]) for key in ("clip_l", "t5xxl", "ae")}
    assert "fill in clip_l, t5xxl, ae" in plan["start"]["autotune"]
    status, plan = server.call("POST", "/api/plan", {**body, **plan["beside"]})
    assert status == 200 and plan["beside"] == {} and plan["start"]["autotune"] is None, plan["start"]


def test_a_musubi_dits_files_beside_it_are_offered_too(server):
    """A Qwen-Image DiT (trained by musubi-tuner) with its VAE (ComfyUI's 3D layout) and Qwen2.5-VL text encoder
    beside it: both offered by their headers (small tensors under the names musubi-tuner's loaders read)."""
    import torch
    from safetensors.torch import save_file
    from test_musubi_detect import write_dit

    folder = server.runs.parent / "qwen"
    folder.mkdir()
    dit = write_dit(folder / "qwen_image_bf16.safetensors", "qwen-image")
    save_file({"decoder.head.2.weight": torch.zeros(2, 2)}, str(folder / "qwen_image_vae.safetensors"))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(folder / "qwen_2.5_vl_7b.safetensors"))
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": str(dit), "vram": 80})
    assert status == 200, plan
    assert plan["beside"] == {"vae": str(folder / "qwen_image_vae.safetensors"),
                              "text_encoder": str(folder / "qwen_2.5_vl_7b.safetensors")}, plan["beside"]
    status, plan = server.call("POST", "/api/plan", {"dataset": str(DATASET), "model": str(dit), "vram": 80,
                                                     "vae": str(folder / "qwen_2.5_vl_7b.safetensors")})
    from autotune.ui.api import wrong_files  # Start's reason when the engine trains the family (musubi-tuner)

    assert status == 200 and "holds a language model, not vae" in wrong_files(plan), plan["start"]


def test_a_trainers_checkout_is_picked_on_the_page_only_inside_the_allowed_folders(tmp_path):
    """POST /api/engines: a musubi-tuner checkout picked in the allowed folders is offered to the page's runs (the
    plan then names the engine's verdict instead of asking for one); a folder outside them, a folder that is not
    that trainer's checkout, our own engine, a Python named by the page and a cross-origin request are refused, one
    line each, and nothing is offered."""
    import shutil

    checkout = tmp_path / "musubi-tuner"
    shutil.copytree(ROOT / "tests" / "fixtures" / "fake_musubi_tuner", checkout)
    server = Server(tmp_path)
    try:
        body = {"dataset": str(DATASET), "model": "builtin:z-image", "vram": 16}
        status, plan = server.call("POST", "/api/plan", body)
        assert status == 200 and plan["engine_needed"] == {"name": "musubi-tuner",
                                                           "checkout": "your musubi-tuner checkout"}
        assert "--engine musubi-tuner=PATH" in plan["start"]["autotune"]
        refused = [
            ({"kind": "musubi-tuner", "path": str(ROOT / "sd_scripts_compat")}, {}, 403, "outside the folders"),
            ({"kind": "musubi-tuner", "path": str(tmp_path)}, {}, 400, "not a musubi-tuner checkout"),
            ({"kind": "musubi-tuner", "path": str(tmp_path / "nothing")}, {}, 404, "not a folder"),
            ({"kind": "autotune", "path": str(checkout)}, {}, 400, "choose one of sd-scripts, musubi-tuner"),
            ({"kind": "musubi-tuner", "path": str(checkout), "python": "/bin/sh"}, {}, 400, "python"),
            ({"kind": "musubi-tuner", "path": str(checkout)}, {"Origin": "http://evil.example"}, 403, "origin"),
        ]
        for request, headers, code, words in refused:
            status, answer = server.call("POST", "/api/engines", request, headers=headers)
            assert status == code and words in answer["error"].lower() and "\n" not in answer["error"], answer
        assert server.call("GET", "/api/health")[1]["engines"] == ["autotune"]
        status, added = server.call("POST", "/api/engines", {"kind": "musubi-tuner", "path": str(checkout)})
        assert status == 200 and added["engines"] == ["autotune", "musubi-tuner"]
        assert added["options"][:2] == ["--engine", f"musubi-tuner={checkout.resolve()}"]
        status, plan = server.call("POST", "/api/plan", body)
        assert status == 200 and plan["engine_needed"] is None and "musubi-tuner" in plan["start"]
        assert server.call("GET", "/api/health")[1]["engines"] == ["autotune", "musubi-tuner"]
    finally:
        assert "Traceback" not in server.stop()
