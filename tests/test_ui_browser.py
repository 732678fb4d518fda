"""The web app's pages in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by
Selenium; ``.ci/run`` installs them): the whole new-training flow on ``examples/dataset`` with ``builtin:tiny-sd15``.
Pick the folder in the folder browser, check and plan, change a value and see it predicted again, start, watch
progress arrive, stop, resume, finish, read the report, and find the run on the runs page. A screenshot of each
page goes to ``$AUTOTUNE_UI_SCREENSHOTS`` (default: the test's own folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_ui_api import ROOT, Server

pytestmark = [pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")]


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1600"):
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
    from selenium.webdriver.support.ui import WebDriverWait

    shots = Path(os.environ.get("AUTOTUNE_UI_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    server = Server(tmp_path)
    from selenium.common.exceptions import StaleElementReferenceException

    # the pages replace what they show (a re-predicted plan, a re-rendered run): an element read mid-swap is retried
    wait = WebDriverWait(browser, 300, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))

    def text(css: str) -> str:
        return browser.find_element(By.CSS_SELECTOR, css).text

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
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: text("#run-state") == "interrupted")
        browser.find_element(By.ID, "resume").click()
        wait.until(lambda b: text("#run-state") == "done")
        wait.until(seen.presence_of_element_located((By.ID, "lora-table")))
        assert text("#bottleneck") and browser.find_element(By.CSS_SELECTOR, "#loss-curve svg")
        assert browser.find_element(By.CSS_SELECTOR, "#lr-curve svg") and "peak so far" in text("#memory")
        run_id = browser.current_url.rsplit("#/run/", 1)[1]
        info = server.call("GET", f"/api/runs/{run_id}")[1]
        assert info["step"] == info["max_train_steps"] > 0  # stopped, resumed, ended at the planned step
        assert "rank(s)" in text("#lora-table") and "4 (" in text("#lora-table")
        href = browser.find_element(By.ID, "lora-download").get_attribute("href")
        status, data, _ = server.fetch(href.split(str(server.port), 1)[1])
        assert status == 200 and data[:8] and href.endswith(".safetensors")
        browser.save_screenshot(str(shots / "4-run-report.png"))

        browser.find_element(By.ID, "nav-runs").click()
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, "#runs tr[data-run]")))
        assert "done" in text("#runs tr[data-run] .state")
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
