"""The SPECTRAL tab in a real browser: headless Chromium on the installed package's `tensorboard`.

The package is pip-installed into a temporary directory (so the ``tensorboard_plugins`` entry
point and the static files come from the package as users get it), TensorBoard's own command
serves two real training runs on 127.0.0.1, and Chromium opens the tab. Skipped, with the reason,
where Debian's chromium/chromium-driver or selenium are missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import (
    chromium,
    get_json,
    installed_copy,
    missing_browser,
    open_tab,
    tensorboard,
    wait_for_points,
)
from cli_runs import training_runs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser())),
]

VIEWS = ("wave", "byRole", "byLayer", "depth", "bars", "diff")
TENSORBOARD = Path(sys.executable).with_name("tensorboard")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return installed_copy(Path(__file__).parents[1], tmp_path_factory.mktemp("installed"))


@pytest.fixture
def logdir(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """The two real runs ``a`` and ``b`` of cli_runs.py, copied so a live run can join them."""
    shutil.copytree(training_runs(tmp_path_factory) / "tb", tmp_path / "tb")
    return tmp_path


def severe(driver: object) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]  # type: ignore[attr-defined]


def test_tab_shows_every_view_with_data_and_no_console_error(
    installed: dict[str, str], logdir: Path
) -> None:
    with (
        tensorboard(logdir / "tb", command=[str(TENSORBOARD)], env=installed, cwd=logdir) as url,
        chromium() as driver,
    ):
        listing = get_json(url + "data/plugins_listing")
        assert listing["spectral"]["tab_name"] == "SPECTRAL" and listing["spectral"]["enabled"]
        open_tab(driver, url)
        # Until the counts checked below are complete: TensorBoard may still be loading the runs
        # when the page first draws (the tab polls and catches up).
        complete = {"wave": 2 * 3 * 12, "byRole": 2 * 6 * 12, "bars": 2 * 3 * 6}
        points = wait_for_points(
            driver, VIEWS, timeout=60, more_than={v: n - 1 for v, n in complete.items()}
        )
        from selenium.webdriver.common.by import By

        def inside(view: str, css: str) -> list:
            return driver.find_elements(By.CSS_SELECTOR, f'section[data-view="{view}"] {css}')

        assert len(inside("wave", "canvas.heatmap")) == 2  # a heatmap per run
        assert points["wave"] == 2 * 3 * 12  # 2 runs x 3 layers x 12 snapshots
        for view in ("byRole", "byLayer", "depth", "diff"):
            lines = inside(view, "svg path.line")
            assert lines and all(line.get_attribute("d").startswith("M") for line in lines)
        assert points["byRole"] == 2 * 6 * 12  # layer 0: 2 runs x 6 roles x 12 snapshots
        assert len(inside("bars", "rect.bar")) == points["bars"] == 2 * 3 * 6
        assert [e.text for e in inside("byRole", ".legend-item")][:6] == [
            "Q",
            "K",
            "V",
            "O",
            "MLP↑",
            "MLP↓",
        ]
        messages = driver.find_elements(By.CSS_SELECTOR, "section.panel .message")
        assert len(messages) == len(VIEWS) and all(not e.text for e in messages)
        assert severe(driver) == []


def test_tab_gains_points_while_a_run_is_written(installed: dict[str, str], logdir: Path) -> None:
    script = Path(__file__).with_name("live_training.py")
    trainer = subprocess.Popen(
        [sys.executable, str(script), str(logdir), "live", "--steps", "400", "--pause", "0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        flags = ["--reload_interval=1"]
        with (
            tensorboard(
                logdir / "tb", command=[str(TENSORBOARD)], env=installed, flags=flags
            ) as url,
            chromium() as driver,
        ):
            runs = []
            for _ in range(240):  # the live run appears once its first snapshot is written
                runs = [r["run"] for r in get_json(url + "data/plugin/spectral/runs")["runs"]]
                if "live" in runs or trainer.poll() is not None:
                    break
                subprocess.run(["sleep", "0.25"], check=True)
            assert "live" in runs, trainer.stderr.read().decode()[-2000:] if trainer.stderr else ""
            open_tab(driver, url)
            before = wait_for_points(driver, ("byRole", "wave"), timeout=60)
            assert trainer.poll() is None, "the training run ended before the page was open"
            wait_for_points(driver, ("byRole", "wave"), timeout=10, more_than=before)
            assert severe(driver) == []
    finally:
        trainer.kill()
        trainer.wait(timeout=30)
