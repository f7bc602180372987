"""A real headless Chromium driven through its WebDriver (selenium), for the page tests and
the page previews.

Chromium and chromedriver come from Debian's packages ``chromium`` and ``chromium-driver``
(`make system-deps`); both are taken from PATH by name, so selenium never looks for or
downloads a browser or a driver of its own.

    with chromium() as driver:
        driver.get(url)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from harness.process import ProcessError, require_binary


def _binary(*names: str) -> str:
    """The first of ``names`` on PATH (Debian calls the browser ``chromium``)."""
    for name in names[:-1]:
        try:
            return require_binary(name)
        except ProcessError:
            continue
    return require_binary(names[-1])


@contextmanager
def chromium(width: int = 1280, height: int = 900, log_dir: Path | None = None) -> Iterator[webdriver.Chrome]:
    """A headless Chromium (a fresh profile) and its driver; quit on exit."""
    options = webdriver.ChromeOptions()
    options.binary_location = _binary("chromium", "chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-extensions", "--no-first-run", "--hide-scrollbars", "--force-device-scale-factor=1",
                "--lang=en-US", f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    log_path = str(log_dir / "chromedriver.log") if log_dir is not None else None
    service = Service(executable_path=require_binary("chromedriver"), log_output=log_path)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """The page's console messages of level SEVERE since the last call (JavaScript errors,
    failed loads, Content-Security-Policy refusals)."""
    return [entry["message"] for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def screenshot_full_page(driver: webdriver.Chrome, path: Path, width: int = 1280, max_height: int = 6000) -> None:
    """Resize the window to the page's height (plus the window's own frame) and save a PNG of all of it."""
    height, frame = driver.execute_script(
        "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]")
    driver.set_window_size(width, min(max_height, int(height) + int(frame)))
    driver.save_screenshot(str(path))
