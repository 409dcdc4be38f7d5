"""Screenshots of every workbench page into docs/ (docs/workbench_<page>.png), for the README.

Run once after a change to the pages (not a test: it asserts nothing), from the repository root:

    .venv/bin/python tools/screenshots.py

It serves the app with `hap ui` on a free port of 127.0.0.1, opens it in Debian's headless Chromium through
Playwright (as tests/app/test_browser.py does), waits for each page of the default model and cluster to finish
drawing and saves a full-page screenshot.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"
PAGES = ["Plan", "Model", "Cluster", "Theory", "Search", "Timeline", "Runs", "Compare", "Export"]
WAIT_MS = 180_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port: int) -> subprocess.Popen:
    """`hap ui` on `port`, answering once Streamlit's health endpoint does."""
    proc = subprocess.Popen([sys.executable, "-m", "runner.hap", "ui", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise TimeoutError("the workbench did not answer within 120 s")


def settle(page) -> None:
    """Wait until the script run is over and the charts have drawn."""
    page.wait_for_timeout(500)
    page.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=WAIT_MS)
    page.wait_for_timeout(1500)


def main() -> None:
    port = free_port()
    proc = serve(port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(WAIT_MS)
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_text("Predicted iteration").first.wait_for()
            for title in PAGES:
                page.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
                page.get_by_role("heading", name=title, exact=True).first.wait_for()
                settle(page)
                out = DOCS / f"workbench_{title.lower()}.png"
                page.screenshot(path=str(out), full_page=True)
                print(f"{out.relative_to(ROOT)}")
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
