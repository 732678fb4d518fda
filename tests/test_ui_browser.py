"""The web app's pages in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
Selenium; ``.ci/run`` installs them): the whole new-training flow on ``examples/dataset`` with ``builtin:tiny-sd15``.
Pick the folder in the folder browser, check and plan, change a value and see it predicted again, start, watch
progress arrive, stop, resume, finish, read the report, and find the run on the runs page. A screenshot of each
page goes to ``$AUTOTUNE_UI_SCREENSHOTS`` (default: the test's own folder)."""

from __future__ import annotations

import json
import os
import shutil
from functools import partial
from pathlib import Path

import pytest
from test_ui_api import ROOT, Server

pytestmark = [pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")]


def typed(browser, field: str, value: str) -> None:
    """Select a field's text, type another and leave the field: one change event, as a user makes it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    element = browser.find_element(By.ID, field)
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(value, Keys.TAB)


def text_of(browser, css: str) -> str:
    from selenium.webdriver.common.by import By

    return browser.find_element(By.CSS_SELECTOR, css).text


def stop_resume_and_finish(browser, wait) -> None:
    """Stop a training run from its page (it becomes interrupted), Resume it, and wait until it is done and its LoRA
    is shown."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen

    browser.find_element(By.ID, "stop").click()
    wait.until(lambda b: text_of(b, "#run-state") == "interrupted")
    browser.find_element(By.ID, "resume").click()
    wait.until(lambda b: text_of(b, "#run-state") == "done")
    wait.until(seen.presence_of_element_located((By.ID, "lora-table")))


def waiting(browser, seconds: float):
    """A wait that reads an element again when the page replaced it mid-read (plans and run pages re-render)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1600",
                 "--host-resolver-rules=MAP evil.test 127.0.0.1"):  # a DNS-rebound name, for the attack test
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


@pytest.mark.slow
def test_new_training_flow_from_folder_to_report(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as seen

    shots = Path(os.environ.get("AUTOTUNE_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    server = Server(tmp_path)

    # the pages replace what they show (a re-predicted plan, a re-rendered run): an element read mid-swap is retried
    wait = waiting(browser, 300)

    text = partial(text_of, browser)

    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        browser.find_element(By.ID, "browse").click()  # the allowed roots, then down to the dataset
        wait.until(seen.element_to_be_clickable((By.XPATH, f"//li[text()='\U0001F4C1 {ROOT / 'examples'}']"))).click()
        wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "li[data-folder='dataset']"))).click()
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#browser[data-path$='/dataset']")))
        browser.find_element(By.ID, "use-folder").click()
        assert browser.find_element(By.ID, "in-dataset").get_attribute("value") == str(ROOT / "examples" / "dataset")
        browser.find_element(By.ID, "check").click()
        wait.until(seen.presence_of_element_located((By.ID, "plan-table")))
        assert "12 images" in text("#doctor-summary") and text("#buckets")
        assert text("#plan-sources") == "memory: model; speed: model"  # a fresh store: nothing measured here yet
        # each problem image as the engine crops it to its bucket (examples/dataset has small ones)
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#problems img.thumb") and all(
            b.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", img)
            for img in b.find_elements(By.CSS_SELECTOR, "#problems img.thumb")))
        first_plan = text("#plan-message")
        browser.save_screenshot(str(shots / "1-new-training.png"))

        def edit(key: str, value: str) -> None:  # select the value, type another, leave the field: one change
            field = browser.find_element(By.CSS_SELECTOR, f"input[data-key='{key}']")
            field.send_keys(Keys.CONTROL, "a")
            field.send_keys(value, Keys.TAB)

        edit("network_dim", "4")
        wait.until(lambda b: "rank 4" in text("#plan-message"))  # the new plan is in: its table is the new one
        edit("train_batch_size", "100000")  # cannot fit any machine: flagged, with the split that fits
        wait.until(lambda b: "100000 does not fit" in text("[data-flag='train_batch_size']"))
        assert "does not fit" in text("#fallbacks")
        browser.save_screenshot(str(shots / "2-plan-flagged.png"))
        edit("train_batch_size", "1")  # a second value, predicted again (the peak falls with the batch)
        wait.until(lambda b: "micro-batch 1 x" in text("#plan-message"))  # not the 1024 x ... of the last plan
        assert text("#plan-message") != first_plan and not browser.find_elements(By.CSS_SELECTOR, ".flag")
        browser.find_element(By.ID, "show-configs").click()  # the configs sd-scripts reads, shown and downloadable
        assert "network_dim = 4" in text("pre[data-config='config.toml']")
        link = browser.find_element(By.CSS_SELECTOR, "a[data-file='dataset.toml']")
        assert link.get_attribute("href").startswith("blob:") and link.get_attribute("download") == "dataset.toml"
        browser.save_screenshot(str(shots / "2-plan-changed.png"))

        browser.find_element(By.ID, "start").click()
        wait.until(lambda b: "#/run/" in b.current_url)
        wait.until(lambda b: text("#run-state") in ("running", "stepping down") and "step" in text("#run-status")
                   and not text("#run-status").startswith(text("#run-state") + " step -"))
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#decisions li[data-event='start']")))
        browser.save_screenshot(str(shots / "3-run-training.png"))
        stop_resume_and_finish(browser, wait)
        assert text("#bottleneck") and browser.find_element(By.CSS_SELECTOR, "#loss-curve svg")
        assert browser.find_element(By.CSS_SELECTOR, "#lr-curve svg") and "peak so far" in text("#memory")
        # each chart's axes: the steps along x, the value's range and unit along y
        assert browser.find_element(By.CSS_SELECTOR, "#loss-curve text[data-axis='x']").text == "optimizer step"
        assert int(browser.find_element(By.CSS_SELECTOR, "#loss-curve text[data-axis='x-max']").text) > 1
        assert "(MiB)" in text("#memory-curve") and "(it/s)" in text("#speed-curve")
        run_id = browser.current_url.rsplit("#/run/", 1)[1]
        info = server.call("GET", f"/api/runs/{run_id}")[1]
        assert info["step"] == info["max_train_steps"] > 0  # stopped, resumed, ended at the planned step
        assert "rank(s)" in text("#lora-table") and "4 (" in text("#lora-table")
        href = browser.find_element(By.ID, "lora-download").get_attribute("href")
        status, data, _ = server.fetch(href.split(str(server.port), 1)[1])
        assert status == 200 and data[:8] and href.endswith(".safetensors")
        wait.until(lambda b: "done: " in text("#log"))  # the run's console, as a terminal shows it
        assert "\r" not in browser.find_element(By.ID, "log").get_attribute("textContent")
        assert text("#tensorboard").startswith("TensorBoard logs: ") and "tensorboard --logdir" in text("#tensorboard")
        browser.save_screenshot(str(shots / "4-run-report.png"))

        browser.find_element(By.ID, "nav-runs").click()
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#runs tr[data-run]")))
        assert "done" in text("#runs tr[data-run] .state")
        assert text("#runs tr[data-run] .family") == "tiny-sd15" and text("#runs tr[data-run] .size").endswith("KiB")
        assert text("#runs tr[data-run] .step") == f"{info['step']} / {info['step']}"
        assert text("#runs tr[data-run] .duration").endswith(" s")
        report = browser.find_element(By.CSS_SELECTOR, "#runs tr[data-run] a[data-link='report']")
        status, page, _ = server.fetch(report.get_attribute("href").split(str(server.port), 1)[1])
        assert status == 200 and b"Run report" in page
        browser.save_screenshot(str(shots / "5-runs.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()


def test_off_loopback_the_page_opened_with_its_token_loads_and_answers(tmp_path, browser):
    """Bound to 0.0.0.0, the printed URL (with ?token=) opens a working page: its script and style come with the
    cookie the first answer set, its API calls with the token; the same page without the token gets nothing."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(tmp_path, host="0.0.0.0")
    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        assert "token" in browser.find_element(By.TAG_NAME, "body").text  # the 401 line, not the page
        browser.get(f"http://127.0.0.1:{server.port}/?token={server.token}")
        WebDriverWait(browser, 60).until(seen.element_to_be_clickable((By.ID, "browse"))).click()
        WebDriverWait(browser, 60).until(seen.presence_of_element_located((By.CSS_SELECTOR, "#browser li")))
        assert browser.find_element(By.ID, "error").text == ""
    finally:
        server.stop()


ATTACK = """<!doctype html><title>attacker</title><body>
<form id="plain" method="POST" action="APP/api/runs" enctype="text/plain">
  <input name='{"dataset": "DATASET", "model": "builtin:tiny-sd15", "x": "' value='"}'></form>
<form id="urlencoded" method="POST" action="APP/api/runs"><input name="dataset" value="DATASET"></form>
<script>
const body = JSON.stringify({dataset: "DATASET", model: "builtin:tiny-sd15", steps: 1});
async function attempt(name, go) {
  try { window.results[name] = await go(); } catch (error) { window.results[name] = "blocked: " + error.name; }
}
window.results = {};
(async () => {
  await attempt("no-cors text/plain POST", async () => (await fetch("APP/api/runs", {method: "POST", mode: "no-cors",
    headers: {"Content-Type": "text/plain"}, body})).type);
  await attempt("JSON POST", async () => (await fetch("APP/api/runs", {method: "POST",
    headers: {"Content-Type": "application/json"}, body})).status);
  await attempt("read the runs", async () => await (await fetch("APP/api/runs")).text());
  await attempt("read the folders", async () => await (await fetch("APP/api/browse")).text());
  document.title = "tried";
})();
</script>"""


def serve_attacker(page: str) -> tuple[object, int]:
    """The attacker's site: a second local origin serving one page."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page.encode())

        def log_message(self, *args: object) -> None:
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    return site, site.server_address[1]


def test_a_page_on_another_origin_or_a_rebound_name_gets_nothing_through(tmp_path, browser):
    """What any site the user visits can do from the browser: ``fetch`` (no-cors text/plain, JSON, reads) and
    forms (text/plain, urlencoded) aimed at the app, and the app opened under a rebound name (Chromium's resolver
    maps evil.test to 127.0.0.1, as a DNS-rebinding attacker's name would): nothing starts, nothing is read."""
    from selenium.webdriver.support.ui import WebDriverWait

    server = Server(tmp_path)
    app = f"http://127.0.0.1:{server.port}"
    site, port = serve_attacker(ATTACK.replace("APP", app).replace("DATASET", str(ROOT / "examples" / "dataset")))
    try:
        browser.get(f"http://localhost:{port}/")
        WebDriverWait(browser, 60).until(lambda b: b.title == "tried")
        results = browser.execute_script("return window.results")
        # sent; its answer is unseen (opaque) or withheld (the app's Cross-Origin-Resource-Policy): the server refused
        assert results["no-cors text/plain POST"] in ("opaque", "blocked: TypeError"), results
        assert results["JSON POST"].startswith("blocked") and results["read the runs"].startswith("blocked")
        assert results["read the folders"].startswith("blocked"), results
        for form in ("plain", "urlencoded"):
            browser.get(f"http://localhost:{port}/")
            browser.execute_script(f"document.getElementById('{form}').submit()")
            WebDriverWait(browser, 60).until(lambda b: b.current_url.startswith(app))
            WebDriverWait(browser, 60).until(lambda b: "refused" in b.page_source or "must come from" in b.page_source)
        rebound = f"http://evil.test:{server.port}"
        browser.get(rebound + "/")
        assert "not this server" in browser.page_source and "New training" not in browser.page_source
        status = browser.execute_async_script(
            "const done = arguments[1]; fetch('/api/runs', {method: 'POST', headers: {'Content-Type': "
            "'application/json'}, body: JSON.stringify({dataset: arguments[0], model: 'builtin:tiny-sd15'})})"
            ".then(r => done(r.status), e => done(String(e)))", str(ROOT / "examples" / "dataset"))
        assert status == 421
        assert server.call("GET", "/api/runs")[1] == {"runs": [], "queue": []}
        assert not server.runs.exists() or not any(server.runs.iterdir())
    finally:
        site.shutdown()
        assert "Traceback" not in server.stop()


def test_a_failed_run_says_why_and_offers_only_what_the_server_does(tmp_path, browser):
    """A run that failed before training (``--steps 0``, found by planning): its page shows the one line it failed
    with, Stop is disabled (nothing runs) and Resume enabled; the runs page says why in its row."""
    from selenium.webdriver.common.by import By
    from test_ui_runs import RUN, wait_for

    server = Server(tmp_path)
    try:
        status, _ = server.call("POST", "/api/runs", {**RUN, "steps": 0, "name": "zero"})
        assert status == 201
        wait_for(server, "zero", ("failed",))
        browser.get(f"http://127.0.0.1:{server.port}/#/run/zero")
        # the run page re-renders as it polls: an element read mid-swap is read again
        wait = waiting(browser, 60)
        wait.until(lambda b: "--steps 0: must be 1 or more" in b.find_element(By.ID, "run-message").text)
        wait.until(lambda b: b.find_element(By.ID, "run-state").text == "failed"
                   and not b.find_element(By.ID, "stop").is_enabled() and b.find_element(By.ID, "resume").is_enabled())
        shots = Path(os.environ.get("AUTOTUNE_UI_SCREENSHOTS") or tmp_path)
        browser.save_screenshot(str(shots / "failed-run.png"))
        browser.find_element(By.ID, "nav-runs").click()
        wait.until(lambda b: "--steps 0" in b.find_element(By.CSS_SELECTOR, "#runs tr[data-run='zero'] .why").text)
        browser.save_screenshot(str(shots / "failed-run-in-the-list.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()


def test_a_models_files_are_fields_and_start_waits_for_them_with_the_reason(tmp_path, browser):
    """A FLUX.1 file (its real header, sparse data) needs CLIP-L, T5-XXL and the AE beside it: the plan shows one field
    per file, Start stays disabled with the reason until they are filled (one picked in the folder browser; a T5 file
    given as the AE named as what it holds), and a second "Check and plan" keeps them.
    A Qwen-Image DiT (trained by musubi-tuner, which this server does not offer) cannot start, with the line autotune
    run gives."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from test_flux_plan import _sparse_flux_file
    from test_musubi_detect import write_dit

    from sd_scripts_compat.models.flux_files import save_flux_files
    from sd_scripts_compat.runtimes import load_base_model

    model = _sparse_flux_file(tmp_path / "flux1-dev.safetensors")
    parts = save_flux_files(load_base_model("builtin:tiny-flux"), tmp_path / "parts")  # headers of the real kinds
    files = {key: parts[key] for key in ("clip_l", "t5xxl", "ae")}
    server = Server(tmp_path)
    # each plan replaces the plan box: an element read mid-swap is read again
    wait = waiting(browser, 120)

    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        typed(browser, "in-dataset", str(ROOT / "examples" / "dataset"))
        typed(browser, "in-model", str(model))
        typed(browser, "in-vram", "24")
        browser.find_element(By.ID, "check").click()
        wait.until(seen.presence_of_element_located((By.ID, "model-files")))
        assert not browser.find_element(By.ID, "start").is_enabled()
        assert "fill in clip_l, t5xxl, ae" in browser.find_element(By.ID, "start-why").text
        for key, path in files.items():  # each filled field plans again: the reason shrinks to what is left
            wait.until(seen.presence_of_element_located((By.ID, f"in-file-{key}")))
            if key == "clip_l":  # picked in the folder browser, which opens in the model's folder
                browser.find_element(By.ID, "browse-clip_l").click()
                wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "#pick-clip_l li[data-folder='parts']")))\
                    .click()
                wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR,
                                                         "#pick-clip_l li[data-file='clip_l.safetensors']"))).click()
            elif key == "ae":  # first a file of the wrong kind: Start says which, and what it holds
                typed(browser, "in-file-ae", str(files["t5xxl"]))
                wait.until(lambda b: "holds a T5 encoder, not ae" in b.find_element(By.ID, "start-why").text)
                assert not browser.find_element(By.ID, "start").is_enabled()
                typed(browser, "in-file-ae", str(path))
            else:
                typed(browser, f"in-file-{key}", str(path))
            wait.until(lambda b, key=key: key not in b.find_element(By.ID, "start-why").text)
        wait.until(lambda b: b.find_element(By.ID, "start").is_enabled())
        assert browser.find_element(By.ID, "start-why").text == ""
        browser.find_element(By.ID, "check").click()  # checked again: the files stay
        wait.until(seen.presence_of_element_located((By.ID, "in-file-ae")))
        wait.until(lambda b: b.find_element(By.ID, "in-file-ae").get_attribute("value") == str(files["ae"]))
        assert browser.find_element(By.ID, "start").is_enabled()
        browser.save_screenshot(str(tmp_path / "model-files.png"))

        qwen = write_dit(tmp_path / "qwen_image_bf16.safetensors", "qwen-image")
        typed(browser, "in-model", str(qwen))  # another model: FLUX's files are not sent with it
        browser.find_element(By.ID, "check").click()
        wait.until(lambda b: "musubi-tuner" in b.find_element(By.ID, "start-why").text)
        assert not browser.find_element(By.ID, "start").is_enabled()
        assert "--engine musubi-tuner=PATH" in browser.find_element(By.ID, "start-why").text
        # the user's musubi-tuner checkout, picked in the allowed folders: offered to this run, Start's reason
        # is then the files musubi-tuner needs
        shutil.copytree(ROOT / "tests" / "fixtures" / "fake_musubi_tuner", tmp_path / "musubi-tuner")
        browser.find_element(By.ID, "choose-checkout").click()
        wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, f"#checkout-browser li[data-folder='{tmp_path}']")))\
            .click()
        wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR,
                                                 "#checkout-browser li[data-folder='musubi-tuner']"))).click()
        wait.until(seen.element_to_be_clickable((By.ID, "use-checkout"))).click()
        wait.until(lambda b: "--engine musubi-tuner=PATH" not in b.find_element(By.ID, "start-why").text)
        wait.until(seen.presence_of_element_located((By.ID, "in-engine")))
        assert browser.find_element(By.ID, "in-engine").get_attribute("value") == "musubi-tuner"
        assert not browser.find_elements(By.ID, "checkout")
        browser.save_screenshot(str(tmp_path / "checkout-chosen.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()


def test_every_setting_is_in_the_page_grouped_and_what_the_user_set_stays_marked_as_theirs(tmp_path, browser):
    """The new-training form is made from the run endpoint's schema (GET /api/options): every option in the group
    --help lists it in, with the value the plan chose and its reason. A GUI user sets a LyCORIS algorithm, sample
    prompts with their rhythm and a save rhythm: each is planned again, marked as theirs, kept through another Check
    and plan, and written to the config sd-scripts reads."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import Select

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a circle shape --w 256 --h 256\n", encoding="utf-8")
    server = Server(tmp_path)
    wait = waiting(browser, 120)

    def row(key: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, f"tr[data-row='{key}']").text

    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        typed(browser, "in-dataset", str(ROOT / "examples" / "dataset"))
        browser.find_element(By.ID, "check").click()
        wait.until(seen.presence_of_element_located((By.ID, "settings")))
        fields = server.call("GET", "/api/options")[1]["fields"]
        shown = {e.get_attribute("data-option") for e in browser.find_elements(By.CSS_SELECTOR, "[data-option]")}
        top = {"dataset", "model", "vram", "gpu", "goal", "priority"}
        assert shown == {f["key"] for f in fields if f["key"] not in top and not (
            f["group"] == "model and its files" and f["kind"] == "path")}
        groups = [e.get_attribute("data-group") for e in browser.find_elements(By.CSS_SELECTOR, "#settings fieldset")]
        assert groups[:7] == ["model and its files", "target machine", "dataset", "network", "optimizer and schedule",
                              "saving and samples", "advanced"], groups
        scheduler = Select(browser.find_element(By.ID, "set-lr_scheduler"))
        assert scheduler.first_selected_option.text == "cosine" and "decays to zero" in row("lr_scheduler")
        assert browser.find_element(By.ID, "set-rank").get_attribute("value") == "32"  # the plan's rank, its reason
        Select(browser.find_element(By.ID, "set-network")).select_by_visible_text("loha")
        wait.until(lambda b: "yours" in row("network"))
        typed(browser, "set-sample_prompts", str(prompts))
        wait.until(lambda b: "yours" in row("sample_prompts"))
        typed(browser, "set-sample_every_n_steps", "10")
        wait.until(lambda b: "yours" in row("sample_every_n_steps"))
        typed(browser, "set-save_every_n_epochs", "2")
        wait.until(lambda b: "yours" in row("save_every_n_epochs") and "the plan's" in row("save_every_n_epochs"))
        before = browser.find_element(By.ID, "settings")
        browser.find_element(By.ID, "check").click()  # checked again: every edit stays, still marked
        wait.until(seen.staleness_of(before))  # the new plan's form is in
        wait.until(seen.presence_of_element_located((By.ID, "set-save_every_n_epochs")))
        for key, value in (("sample_prompts", str(prompts)), ("sample_every_n_steps", "10"),
                           ("save_every_n_epochs", "2")):
            wait.until(lambda b, key=key, value=value: b.find_element(By.ID, f"set-{key}").get_attribute("value")
                       == value and "yours" in row(key))
        assert Select(browser.find_element(By.ID, "set-network")).first_selected_option.text == "loha"
        browser.save_screenshot(str(tmp_path / "settings.png"))
        browser.find_element(By.ID, "show-configs").click()
        config = browser.find_element(By.CSS_SELECTOR, "pre[data-config='config.toml']").text
        for line in ('network_module = "lycoris.kohya"', '"algo=loha"', "save_every_n_epochs = 2",
                     "sample_every_n_steps = 10", f'sample_prompts = "{prompts}"'):
            assert line in config, line
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()


@pytest.mark.slow
def test_a_gui_users_walk_with_a_flux_like_model_from_its_files_to_the_report(tmp_path, browser):
    """Issue 51's judged walk, on tiny-flux's four files as sd-scripts takes them (random weights): the model picked
    in the folder browser, its clip_l, t5xxl and ae found beside it; a LyCORIS algorithm refused for FLUX with the
    reason above the plan (and changed back); sample prompts, a save rhythm, steps and resolution set, kept through
    Check and plan; Start, the console and the first sample on the run page, Stop, Resume, the LoRA and the report
    page. Screenshots go to ``$AUTOTUNE_UI_SCREENSHOTS`` (default: the test's folder)."""
    from fixtures.engine_runs import toy_dataset
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import Select

    from sd_scripts_compat.models.flux_files import save_flux_files
    from sd_scripts_compat.runtimes import load_base_model

    shots = Path(os.environ.get("AUTOTUNE_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    files = save_flux_files(load_base_model("builtin:tiny-flux"), tmp_path / "models")
    data = toy_dataset(tmp_path / "toy", images=4, repeats=1)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a toy --w 64 --h 64 --s 2 --d 1\n", encoding="utf-8")
    server = Server(tmp_path)
    wait = waiting(browser, 300)

    text = partial(text_of, browser)

    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        browser.find_element(By.ID, "browse").click()  # the model, picked among the allowed folders
        wait.until(seen.element_to_be_clickable((By.XPATH, f"//li[text()='\U0001F4C1 {tmp_path}']"))).click()
        wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "li[data-folder='models']"))).click()
        wait.until(seen.element_to_be_clickable((By.CSS_SELECTOR, "li[data-file='flux1.safetensors']"))).click()
        wait.until(lambda b: b.find_element(By.ID, "in-model").get_attribute("value") == str(files[
            "pretrained_model_name_or_path"]))
        typed(browser, "in-dataset", str(data))
        browser.find_element(By.ID, "check").click()
        for key in ("clip_l", "t5xxl", "ae"):  # found beside the model by their headers, and said so
            wait.until(lambda b, key=key: b.find_element(By.ID, f"in-file-{key}").get_attribute("value")
                       == str(files[key]) and "found beside the model" in text("#model-files [data-beside='yes']"))
        wait.until(lambda b: b.find_element(By.ID, "start").is_enabled())
        assert len(browser.find_elements(By.CSS_SELECTOR, "#model-files [data-beside='yes']")) == 3
        browser.save_screenshot(str(shots / "walk-1-files-beside-the-model.png"))
        Select(browser.find_element(By.ID, "set-network")).select_by_visible_text("loha")
        wait.until(lambda b: "LyCORIS cannot train tiny-flux" in text("#plan-refused"))
        assert not browser.find_element(By.ID, "start").is_enabled()
        browser.execute_script("document.getElementById('plan-refused').scrollIntoView()")
        browser.save_screenshot(str(shots / "walk-2-lycoris-refused-for-flux.png"))
        Select(browser.find_element(By.ID, "set-network")).select_by_visible_text("lora")
        wait.until(lambda b: not b.find_elements(By.ID, "plan-refused") and b.find_element(By.ID, "start").is_enabled())
        for key, value in (("sample_prompts", str(prompts)), ("sample_every_n_steps", "10"),
                           ("save_every_n_steps", "20"), ("steps", "40"), ("resolution", "64")):
            typed(browser, f"set-{key}", value)
            wait.until(lambda b, key=key: "yours" in text(f"tr[data-row='{key}']"))
        before = browser.find_element(By.ID, "settings")
        browser.find_element(By.ID, "check").click()  # checked again: the edits and the files stay
        wait.until(seen.staleness_of(before))
        wait.until(lambda b: b.find_element(By.ID, "set-sample_every_n_steps").get_attribute("value") == "10"
                   and b.find_element(By.ID, "in-file-ae").get_attribute("value") == str(files["ae"]))
        assert "micro-batch" in text("#plan-message") and "64 px" in text("#plan-message")
        browser.save_screenshot(str(shots / "walk-3-settings-kept.png"))

        browser.find_element(By.ID, "start").click()
        wait.until(lambda b: "#/run/" in b.current_url)
        wait.until(lambda b: "steps:" in b.find_element(By.ID, "log").get_attribute("textContent"))
        wait.until(lambda b: any(b.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", i)
                                 for i in b.find_elements(By.CSS_SELECTOR, "#samples img")))
        wait.until(lambda b: "predicted" in text("#memory"))  # the plan, written as the run started, is read
        browser.save_screenshot(str(shots / "walk-4-training-log-and-first-sample.png"))
        stop_resume_and_finish(browser, wait)
        run_id = browser.current_url.rsplit("#/run/", 1)[1]
        info = server.call("GET", f"/api/runs/{run_id}")[1]
        assert info["step"] == info["max_train_steps"] == 40 and info["family"] == "tiny-flux", info
        assert "tiny-flux" in text("#lora-table")
        browser.save_screenshot(str(shots / "walk-5-done.png"))
        report = browser.find_element(By.CSS_SELECTOR, "#run-links a[data-link='report']").get_attribute("href")
        browser.get(report)
        assert "Run report" in browser.page_source
        browser.save_screenshot(str(shots / "walk-6-report.png"))
    finally:
        server.stop()


def test_presets_import_a_kohya_ss_gui_file_save_load_and_export(tmp_path, browser):
    """A kohya_ss GUI preset (loha-sd15.json, as the GUI ships it) imported on the page: every key listed as taken,
    planned for the card, not honoured or empty; the plan takes its settings (LoHa, rank 32, accumulation 4, min-SNR
    10), marked as the user's; saved under a name in this browser, changed, loaded back; the plan offered as a
    kohya_ss GUI preset beside the sd-scripts configs."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import Select

    preset = ROOT / "tests" / "fixtures" / "kohya_ss_presets" / "loha-sd15.json"
    server = Server(tmp_path)
    wait = waiting(browser, 120)

    def value(key: str) -> str:
        return browser.find_element(By.ID, f"set-{key}").get_attribute("value")

    try:
        browser.get(f"http://127.0.0.1:{server.port}/")
        typed(browser, "in-dataset", str(ROOT / "examples" / "dataset"))
        browser.find_element(By.ID, "check").click()
        wait.until(seen.presence_of_element_located((By.ID, "settings")))
        browser.find_element(By.ID, "preset-file").send_keys(str(preset))
        wait.until(seen.presence_of_element_located((By.ID, "preset-report")))
        report = browser.find_element(By.ID, "preset-report").text
        assert "LoRA_type (as network)" in report and "mixed_precision (the file's bf16)" in report
        assert "multires_noise_iterations: noise_offset_type Multires" in report, report
        wait.until(lambda b: Select(b.find_element(By.ID, "set-network")).first_selected_option.text == "loha"
                   and value("rank") == "32" and value("accum") == "4" and value("min_snr_gamma") == "10")
        assert "yours" in browser.find_element(By.CSS_SELECTOR, "tr[data-row='rank']").text
        browser.save_screenshot(str(tmp_path / "preset-imported.png"))
        typed(browser, "preset-name", "my loha")
        browser.find_element(By.ID, "preset-save").click()
        typed(browser, "set-rank", "8")
        wait.until(lambda b: "rank 8" in b.find_element(By.ID, "plan-message").text)
        Select(browser.find_element(By.ID, "preset-names")).select_by_visible_text("my loha")
        browser.find_element(By.ID, "preset-load").click()
        wait.until(lambda b: "rank 32" in b.find_element(By.ID, "plan-message").text and value("rank") == "32")
        browser.find_element(By.ID, "show-configs").click()
        config = browser.find_element(By.CSS_SELECTOR, "pre[data-config='config.toml']").text
        assert 'network_module = "lycoris.kohya"' in config and '"conv_dim=8"' in config
        assert "min_snr_gamma = 10" in config and "network_dim = 32" in config
        exported = json.loads(browser.find_element(By.CSS_SELECTOR, "pre[data-config='kohya_ss_gui.json']").text)
        assert exported["LoRA_type"] == "LyCORIS/LoHa" and exported["network_dim"] == 32 and exported["conv_dim"] == 8
        link = browser.find_element(By.CSS_SELECTOR, "a[data-file='kohya_ss_gui.json']")
        assert link.get_attribute("download") == "kohya_ss_gui.json"
        browser.get(f"http://127.0.0.1:{server.port}/")  # saved in this browser: there after a reload
        wait.until(lambda b: "my loha" in b.find_element(By.ID, "preset-names").text)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        server.stop()
