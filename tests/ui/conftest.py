"""The dashboard in a real browser: Debian's headless chromium, driven through its own chromedriver by selenium,
against the real API on loopback. Nothing is downloaded: selenium is given the driver and the browser, so its
manager never runs; the browser starts with a fresh profile of its own and its network services off.

Screenshots go to $TUNEWRIGHT_TEST_ARTIFACTS (else a pytest temporary folder; the run's summary names them);
with UPDATE_SCREENSHOTS=1 the two the README shows are also written to docs/."""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ROOT = Path(__file__).resolve().parents[2]
LAPTOP, PHONE = (1280, 860), (390, 844)
TOKEN_KEY = "tunewright.token"
_written: list[Path] = []


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("TUNEWRIGHT_TEST_ARTIFACTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("ui-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def pytest_terminal_summary(terminalreporter):
    if _written:
        terminalreporter.section("dashboard screenshots")
        for path in _written:
            terminalreporter.write_line(str(path))


class Browser:
    """A headless chromium tab and what the tests do with it."""

    def __init__(self, driver, downloads: Path, artifacts: Path):
        self.driver, self.downloads, self.artifacts = driver, downloads, artifacts

    def viewport(self, size: tuple[int, int], *, mobile: bool = False) -> None:
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": mobile})

    def color_scheme(self, scheme: str) -> None:
        self.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {
            "features": [{"name": "prefers-color-scheme", "value": scheme}]})

    def open(self, url: str, token: str, route: str = "/jobs") -> None:
        """The link `make demo` prints: the token in the fragment (never sent to the server), then `route`."""
        self.driver.get(f"{url}/ui/#token={token}&to={route}")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, condition, timeout: float = 30, what: str = ""):
        """`condition()` until it is truthy (then its value); fails naming `what` and the page's text."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.js("return document.body.innerText")[:3000]
                pytest.fail(f"timed out waiting for {what or condition}; the page says:\n{text}")
            time.sleep(0.1)

    def attribute(self, selector: str, name: str) -> str | None:
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
                       selector, name)

    def text(self, selector: str) -> str:
        return self.js("const e = document.querySelector(arguments[0]); return e ? e.innerText : '';", selector)

    def console_errors(self) -> list[str]:
        """What the page logged as errors: a script error, or anything the Content-Security-Policy refused (a
        request the API answered with an error status is the page's business, and shown on it)."""
        return [entry["message"] for entry in self.driver.get_log("browser")
                if entry["level"] == "SEVERE" and "Failed to load resource" not in entry["message"]]

    def screenshot(self, name: str, *, full_page: bool = False, docs: str | None = None) -> Path:
        """The viewport (or the whole page) as PNG in the artifacts; `docs`: also docs/<docs> when
        UPDATE_SCREENSHOTS=1 (the README's pictures)."""
        options = {"format": "png"}
        if full_page:
            width, height = self.js("return [document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            options |= {"captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}}
        png = base64.b64decode(self.driver.execute_cdp_cmd("Page.captureScreenshot", options)["data"])
        path = self.artifacts / name
        path.write_bytes(png)
        _written.append(path)
        if docs and os.environ.get("UPDATE_SCREENSHOTS") == "1":
            (ROOT / "docs").mkdir(exist_ok=True)
            shutil.copyfile(path, ROOT / "docs" / docs)
            _written.append(ROOT / "docs" / docs)
        return path


@pytest.fixture(scope="session")
def chromium() -> None:
    if CHROMIUM.exists() and CHROMEDRIVER.exists():
        return
    reason = f"Debian's chromium and chromium-driver are not installed ({CHROMIUM}, {CHROMEDRIVER})"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: .ci/run must install them (apt-get install chromium chromium-driver)")
    pytest.skip(f"{reason}: apt-get install chromium chromium-driver")


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory, artifacts):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-extensions", "--disable-default-apps", "--lang=en-US",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
                 f"--window-size={LAPTOP[0]},{LAPTOP[1]}"):
        options.add_argument(flag)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    tab = Browser(driver, downloads, artifacts)
    tab.viewport(LAPTOP)
    yield tab
    driver.quit()


def token_of(client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


def series_points(browser: Browser, chart_id: str) -> dict[str, int]:
    """What a chart holds, per series, as the page set it from the uPlot instance's own data."""
    return json.loads(browser.attribute(f"#{chart_id}", "data-series-points") or "{}")
