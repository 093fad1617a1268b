"""Headless Chromium (Debian's chromium and chromium-driver, installed by scripts/chromium.sh) driven by selenium.
Under CI=true a browser that cannot be installed fails the tests that need it, never skips them (tests.tiers.unavailable)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.tiers import unavailable

ROOT = Path(__file__).resolve().parents[2]
# The flags that work on these machines (shared notes: no background networking in a closed network).
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1300,1000")


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(browser, driver) paths, installed with apt where missing."""
    p = subprocess.run([str(ROOT / "scripts/chromium.sh")], capture_output=True, text=True, timeout=1800,
                       check=False)
    paths = p.stdout.split()
    if p.returncode != 0 or len(paths) != 2:
        unavailable("Chromium", f"scripts/chromium.sh failed ({p.returncode}): {p.stderr[-2000:]}")
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def browser(chromium):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium[0]
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
            opts.add_argument(flag)
        driver = webdriver.Chrome(options=opts, service=Service(chromium[1]))
        try:
            yield driver
        finally:
            driver.quit()
