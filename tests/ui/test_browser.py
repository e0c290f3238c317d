"""The /ui pages in a real browser (headless Chromium via selenium) against the real
stack: Redis, a Celery worker, uvicorn with keys, local storage.

Log in, see the submit form repeat the API's error, submit a MAEC job, watch it reach
``succeeded``, download a file and check its sha256, see another key's job refused,
filter the list, cancel a job. A screenshot of each view is saved (PNG) under
``$MAEC_UI_SCREENSHOTS`` when set (``MAEC_UI_SCREENSHOTS=docs/screenshots`` refreshes the
ones docs/client.md shows), else under the test's temporary directory.

Skipped only when Debian's ``chromium`` / ``chromedriver`` are not installed
(``scripts/setup.sh`` installs them).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.conftest import StackFactory, TinyModels
from tests.stack import API_KEYS, Stack, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                       reason="chromium and chromedriver are not installed (scripts/setup.sh "
                              "installs Debian's chromium and chromium-driver)"),
]
JOB_TIMEOUT = 180


@pytest.fixture(scope="module")
def stack(make_module_stack: StackFactory, tiny_models: TinyModels) -> Stack:
    return make_module_stack(storage="local", workers=1, local_roots=[tiny_models.root])


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("MAEC_UI_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser(downloads: Path) -> Iterator[WebDriver]:
    assert CHROMIUM is not None and DRIVER is not None
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-sync"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {
        "download.default_directory": str(downloads), "download.prompt_for_download": False,
    })
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior",
                           {"behavior": "allow", "downloadPath": str(downloads)})
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, timeout: float = 30) -> WebDriverWait[WebDriver]:
    # The job page reloads itself when the job ends: an element read during the reload
    # is stale or briefly absent; the condition is then simply tried again.
    return WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException))


@contextlib.contextmanager
def _through_reload() -> Iterator[None]:
    """Chromium reports a node removed by the reload between the find and the read as
    a generic inspector error, not as a stale element: raised as one, so the waits
    above try again."""
    try:
        yield
    except WebDriverException as exc:
        if "does not belong to the document" in (exc.msg or ""):
            raise StaleElementReferenceException(exc.msg) from exc
        raise


def _text(driver: WebDriver, element_id: str) -> str:
    with _through_reload():
        return str(driver.find_element(By.ID, element_id).text)


def _recipe(models: TinyModels, donor: Path | None = None) -> str:
    return (f"merge_method: maec\nbase_model: {models.base}\nlanguage_base: {models.lang}\n"
            f"abilities:\n  - model: {donor or models.donor}\n"
            "parameters:\n  key_ratio: 0.25\n")


def _fill(driver: WebDriver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def _log_in(browser: WebDriver, stack: Stack, shots: Path) -> None:
    browser.get(stack.base_url + "/ui/jobs")
    _wait(browser).until(lambda d: d.current_url.endswith("/ui/login"))
    browser.save_screenshot(str(shots / "ui-login.png"))
    _fill(browser, "api_key", "not-a-key")
    browser.find_element(By.ID, "login").click()
    _wait(browser).until(lambda d: "Unknown API key" in _text(d, "login-error"))
    _fill(browser, "api_key", API_KEYS["alice"])
    browser.find_element(By.ID, "login").click()
    _wait(browser).until(lambda d: _text(d, "owner") == "alice")
    # The session cookie is not readable by the page's scripts (HttpOnly).
    assert "maec_ui" not in browser.execute_script("return document.cookie")


def _submit(browser: WebDriver, stack: Stack, recipe: str, name: str) -> str:
    browser.get(stack.base_url + "/ui/jobs/new")
    _fill(browser, "name", name)
    _fill(browser, "recipe", recipe)
    browser.find_element(By.ID, "submit").click()
    _wait(browser).until(lambda d: "/ui/jobs/j_" in d.current_url)
    return str(browser.current_url.rsplit("/", 1)[-1])


def _show_api_error(browser: WebDriver, stack: Stack, models: TinyModels,
                    shots: Path) -> None:
    """The form shows, inline, the code and message ``POST /v1/jobs`` answers."""
    bad = _recipe(models, donor=Path("/etc"))
    browser.get(stack.base_url + "/ui/jobs/new")
    _fill(browser, "name", "typo in the donor")
    _fill(browser, "recipe", bad)
    browser.find_element(By.ID, "submit").click()
    error = _wait(browser).until(lambda d: d.find_element(By.ID, "submit-error"))
    import yaml

    with stack.client() as c:
        rest = c.post("/v1/jobs", json={"recipe": yaml.safe_load(bad)}).json()
    assert _text(browser, "submit-error-message") == rest["message"]
    assert rest["code"] in error.text
    assert (browser.find_element(By.ID, "recipe").get_attribute("value") or "").strip() == \
        bad.strip()
    browser.save_screenshot(str(shots / "ui-submit.png"))


def _watch_until_done(browser: WebDriver) -> None:
    """The page's script follows the job and reloads the page once it has ended."""
    seen: set[str] = set()

    def ended(d: WebDriver) -> bool:
        seen.add(_text(d, "status"))
        with _through_reload():
            return d.find_element(By.ID, "live").get_attribute("data-terminal") == "true"

    _wait(browser, JOB_TIMEOUT).until(ended)
    assert _text(browser, "status") == "succeeded", (seen, browser.page_source[-3000:])
    assert browser.find_element(By.ID, "progress").get_attribute("value") == "1"
    _wait(browser).until(lambda d: d.find_element(By.ID, "files"))


def _download(browser: WebDriver, downloads: Path, stack: Stack, job_id: str) -> None:
    link = next(a for a in browser.find_elements(By.CSS_SELECTOR, "a.file")
                if a.text.endswith(".safetensors"))
    name, shown = link.text, link.get_attribute("data-sha256")
    link.click()
    target = downloads / name

    def done() -> bool:
        return target.is_file() and not any(downloads.glob("*.crdownload"))

    wait_for(done, 60, f"download of {name}", interval=0.2)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    with stack.client() as c:
        published = {f["path"]: f for f in c.get(f"/v1/jobs/{job_id}").json()["result"]["files"]}
    assert digest == shown == published[name]["sha256"]
    assert target.stat().st_size == published[name]["size"]


def _other_keys_job_refused(browser: WebDriver, stack: Stack, models: TinyModels) -> str:
    bobs = stack.submit({"recipe": {"merge_method": "linear", "models": [
        {"model": str(models.donor), "parameters": {"weight": 1.0}},
        {"model": str(models.lang), "parameters": {"weight": 1.0}}]}}, key="bob")["id"]
    stack.wait(bobs, key="bob", timeout=JOB_TIMEOUT)
    for path in (f"/ui/jobs/{bobs}", f"/ui/jobs/{bobs}/files/manifest.json"):
        browser.get(stack.base_url + path)
        assert "job_not_found" in _text(browser, "error"), path
    browser.get(stack.base_url + "/ui/jobs")
    assert bobs not in browser.page_source
    return str(bobs)


def _cancel(browser: WebDriver, stack: Stack, models: TinyModels) -> str:
    # No worker: the job stays queued until the button is pressed.
    stack.stop_worker(0)
    job_id = _submit(browser, stack, _recipe(models, donor=models.donor2), "cancel me")
    _wait(browser).until(lambda d: _text(d, "status") == "queued")
    browser.find_element(By.ID, "cancel").click()
    _wait(browser).until(lambda d: _text(d, "status") == "cancelled")
    assert not browser.find_elements(By.ID, "cancel")
    return job_id


def _list(browser: WebDriver, stack: Stack, done: str, cancelled: str, shots: Path) -> None:
    browser.get(stack.base_url + "/ui/jobs")
    rows = {r.get_attribute("data-job"): r.text
            for r in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")}
    assert "succeeded" in rows[done] and "maec" in rows[done] and "donor" in rows[done]
    assert "cancelled" in rows[cancelled]
    browser.save_screenshot(str(shots / "ui-jobs.png"))
    Select(browser.find_element(By.ID, "status")).select_by_value("cancelled")
    _wait(browser).until(lambda d: "status=cancelled" in d.current_url)

    def listed(d: WebDriver) -> set[str | None]:
        return {r.get_attribute("data-job")
                for r in d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")}

    _wait(browser).until(lambda d: listed(d) == {cancelled})


def test_browser_login_submit_watch_download_isolation_cancel(
    browser: WebDriver, stack: Stack, tiny_models: TinyModels, downloads: Path,
    shots: Path,
) -> None:
    _log_in(browser, stack, shots)
    _show_api_error(browser, stack, tiny_models, shots)
    job_id = _submit(browser, stack, _recipe(tiny_models), "maec from the browser")
    _watch_until_done(browser)
    # The whole page: the files table and the recipe sit below the fold.
    _full_page(browser, shots / "ui-job.png")
    _download(browser, downloads, stack, job_id)
    _other_keys_job_refused(browser, stack, tiny_models)
    cancelled = _cancel(browser, stack, tiny_models)
    _list(browser, stack, job_id, cancelled, shots)
    for name in ("ui-login.png", "ui-submit.png", "ui-job.png", "ui-jobs.png"):
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def _full_page(browser: WebDriver, path: Path) -> None:
    metrics = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics["cssContentSize"]
    shot = browser.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                 "scale": 1}})
    path.write_bytes(base64.b64decode(shot["data"]))
