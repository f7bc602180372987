"""Screenshots of the daemon's own pages, taken in a headless Chromium (Debian's chromium and
chromium-driver) against `kvledger demo`: the live ledger page at / and the cache lab at /lab.

    python dashboards/render_page_previews.py [--seconds 20] [--out docs/previews]

Writes ledger-page.png and lab-page.png (docs/dashboards.md shows them); `make previews` runs it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))  # the process and browser harness shared with the test suite

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from harness.browser import chromium, screenshot_full_page  # noqa: E402
from harness.kvledger_daemon import run_demo  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the demo runs before the ledger shot")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "previews")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvledger-page-previews-") as tmp, \
            run_demo(Path(tmp) / "demo") as demo, chromium(width=1280, height=900) as driver:
        print(f"letting the demo run {args.seconds:.0f}s ...", flush=True)
        time.sleep(args.seconds)
        driver.get(demo.url + "/")
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "ledger").get_attribute("data-taken-at"))
        path = args.out / "ledger-page.png"
        screenshot_full_page(driver, path)
        print(f"wrote {path}")

        driver.set_window_size(1280, 900)
        driver.get(demo.url + "/lab?capacity=3&working_set=4")
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "step").is_enabled())
        driver.find_element(By.ID, "prediction").send_keys("12")
        step = driver.find_element(By.ID, "step")
        for _ in range(16):
            step.click()
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "requests").text == "16")
        path = args.out / "lab-page.png"
        screenshot_full_page(driver, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
