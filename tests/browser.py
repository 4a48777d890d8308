"""A real TensorBoard server on loopback and a headless Chromium to look at it.

Used by the browser test of the SPECTRAL tab, by ``benchmarks/tensorboard_tab.py`` and to take
the screenshots of docs/images. Chromium is Debian's (``apt-get install chromium
chromium-driver``), driven by Selenium through ``/usr/bin/chromedriver``; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def missing_browser() -> str | None:
    """Why a browser test cannot run here, or ``None`` when it can."""
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return (
            f"needs Debian's Chromium ({CHROMIUM}, {CHROMEDRIVER}): "
            "apt-get install -y chromium chromium-driver"
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "needs selenium: pip install selenium (in the dev extras)"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextmanager
def tensorboard(
    logdir: Path,
    *,
    command: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    flags: Sequence[str] = (),
    timeout: float = 60.0,
) -> Iterator[str]:
    """A TensorBoard server on 127.0.0.1 serving ``logdir``; yields its URL, stopped on exit.

    ``command`` defaults to ``python -m spectral_callbacks.tensorboard_plugin`` (TensorBoard with
    the tab added); pass ``["tensorboard"]`` to run the installed command. Waits (at most
    ``timeout`` s) until the SPECTRAL routes answer.

    Raises:
        RuntimeError: the server exited or did not answer in time (its output is in the message).
    """
    port = free_port()
    argv = [
        *(command or [sys.executable, "-m", "spectral_callbacks.tensorboard_plugin"]),
        f"--logdir={logdir}",
        "--host=127.0.0.1",
        f"--port={port}",
        *flags,
    ]
    url = f"http://127.0.0.1:{port}/"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    get_json(url + "data/plugin/spectral/runs", timeout=2)
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        output = log.read().decode(errors="replace")[-3000:]
                        raise RuntimeError(f"TensorBoard did not serve {url}: {output}") from None
                    time.sleep(0.25)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@contextmanager
def chromium(width: int = 1400, height: int = 900) -> Iterator[object]:
    """A headless Chromium WebDriver with a throw-away profile, console logs kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# The points each view of the tab has drawn (the `data-points` its JavaScript sets), by view.
POINTS_SCRIPT = """
const out = {};
for (const panel of document.querySelectorAll('section.panel')) {
  out[panel.dataset.view] = +(panel.dataset.points || 0);
}
return out;
"""


def open_tab(driver: object, url: str, timeout: float = 60.0) -> None:
    """Open the SPECTRAL tab at ``url`` and switch into its iframe (TensorBoard's plugin frame)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "#spectral")  # type: ignore[attr-defined]
    WebDriverWait(driver, timeout).until(
        expected_conditions.frame_to_be_available_and_switch_to_it((By.CSS_SELECTOR, "iframe"))
    )


def wait_for_points(
    driver: object, views: Sequence[str], timeout: float, more_than: dict[str, int] | None = None
) -> dict[str, int]:
    """Poll the tab until every view in ``views`` drew more points than ``more_than`` (default 0).

    Returns the points by view; raises ``TimeoutError`` with the last counts when time runs out.
    """
    more_than = more_than or {}
    deadline = time.monotonic() + timeout
    while True:
        points = driver.execute_script(POINTS_SCRIPT)  # type: ignore[attr-defined]
        if all(points.get(view, 0) > more_than.get(view, 0) for view in views):
            return points
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout} s the views drew {points}, needed > {more_than}")
        time.sleep(0.2)


def installed_copy(source: Path, target: Path) -> dict[str, str]:
    """``pip install`` the package at ``source`` into ``target`` (a copy: the source tree stays
    clean), as a user installs it; returns an environment whose Python sees that copy first."""
    build = target / "source"
    shutil.copytree(
        source,
        build,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", "*_cache", "runs"
        ),
    )
    site = target / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(build),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONWARNINGS": "ignore"}
