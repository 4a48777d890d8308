"""The SPECTRAL tab in a real browser: headless Chromium on the installed package's `tensorboard`.

The package is pip-installed into a temporary directory (so the ``tensorboard_plugins`` entry
point and the static files come from the package as users get it), TensorBoard's own command
serves two real training runs on 127.0.0.1, and Chromium opens the tab. Skipped, with the reason,
where Debian's chromium/chromium-driver or selenium are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
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
from tab_runs import several_models

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser())),
]

VIEWS = ("wave", "byRole", "byLayer", "depth", "bars", "diff")
TENSORBOARD = Path(sys.executable).with_name("tensorboard")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return installed_copy(Path(__file__).parents[2], tmp_path_factory.mktemp("installed"))


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
        # + alerts and heads (these runs have no per-head circuits: the heads view says so in a
        # note, not in its message line)
        assert len(messages) == len(VIEWS) + 2 and all(not e.text for e in messages)
        assert [e.text for e in inside("alerts", "h3")] == [
            "a · no alerts up to step 30",
            "b · no alerts up to step 30",
        ]
        assert severe(driver) == []


def test_tab_gains_points_while_a_run_is_written(installed: dict[str, str], logdir: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "live_training.py"
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


def _write_run(path: Path, roles: tuple[str, ...], layers: int, steps: list[int]) -> None:
    """Spectral scalars of another model, written as the callback names them."""
    from torch.utils.tensorboard import SummaryWriter

    from spectral_callbacks.names import scalar_tag

    writer = SummaryWriter(str(path))
    for step in steps:
        for layer in range(layers):
            for i, role in enumerate(roles):
                value = 30.0 - step / 10 + i + layer
                writer.add_scalar(scalar_tag("stable_rank", layer, role), value, step)
                writer.add_scalar(scalar_tag("compression", layer, role), step / 10, step)
                writer.add_scalar(scalar_tag("alpha", layer, role), 0.2 + 0.01 * layer, step)
    writer.close()


ROLE_SWATCHES = """
const out = {};
for (const item of document.querySelectorAll(
    `section[data-view="${arguments[0]}"] .legend-item`)) {
  const swatch = item.querySelector('i');  // a filled swatch: a role (runs are dashed lines)
  if (swatch) out[item.textContent] = getComputedStyle(swatch).backgroundColor;
}
return out;
"""


def test_several_runs_of_different_models_keep_each_roles_colour(
    installed: dict[str, str], logdir: Path
) -> None:
    # "0-mlp-only" (no attention roles) is ticked first; before, the roles took colours in the
    # order first seen, so the others' Q was drawn in MLP_up's colour
    _write_run(logdir / "tb" / "0-mlp-only", ("MLP_up", "MLP_down"), 2, [0, 10, 20, 30])
    # a model at rest, as `analyze` writes it: one point per chart, drawn as markers
    _write_run(logdir / "tb" / "1-analyzed", ("Q", "K", "V", "O", "MLP_up", "MLP_down"), 4, [0])
    with (
        tensorboard(logdir / "tb", command=[str(TENSORBOARD)], env=installed, cwd=logdir) as url,
        chromium() as driver,
    ):
        open_tab(driver, url)
        wait_for_points(driver, ("byRole", "bars"), timeout=60, more_than={"byRole": 2 * 6 * 12})
        swatches = driver.execute_script(ROLE_SWATCHES, "byRole")  # type: ignore[attr-defined]
        assert swatches["Q"] == "rgb(31, 119, 180)" and swatches["MLP↑"] == "rgb(148, 103, 189)"
        assert swatches["MLP↓"] == "rgb(140, 86, 75)", swatches  # tab10 C0, C4, C5 as in the CLI
        glyphs = ["Q", "K", "V", "O", "MLP↑", "MLP↓"]
        from selenium.webdriver.common.by import By

        items = driver.find_elements(By.CSS_SELECTOR, 'section[data-view="byRole"] .legend-item')
        assert [e.text for e in items if e.text in glyphs] == glyphs  # chart order
        bars = driver.execute_script(ROLE_SWATCHES, "bars")  # type: ignore[attr-defined]
        assert bars == {role: swatches[role] for role in ("Q", "K", "V", "O", "MLP↑", "MLP↓")}
        from selenium.webdriver.common.by import By

        # the one-point run: a marker per role at layer 0 in the metric-vs-step view, and the
        # one-layer-per-line view shows its four layers as markers too
        markers = driver.find_elements(By.CSS_SELECTOR, 'section[data-view="byRole"] circle.marker')
        assert len(markers) == 6, len(markers)
        wait_for_points(driver, ("byLayer",), timeout=30)
        by_layer = driver.find_elements(
            By.CSS_SELECTOR, 'section[data-view="byLayer"] circle.marker'
        )
        assert len(by_layer) == 4, len(by_layer)
        # the diff view's baseline is a run that has the metric (the first ticked run has no loss),
        # so no request fails and no message stands under the chart
        diff = driver.find_element(By.CSS_SELECTOR, 'section[data-view="diff"]')
        assert diff.find_elements(By.CSS_SELECTOR, "svg path.line")
        assert diff.find_element(By.CSS_SELECTOR, ".message").text == ""
        assert "`" not in driver.find_element(By.TAG_NAME, "body").text  # no literal backticks
        assert severe(driver) == []  # no 400 from any poll


def test_an_empty_logdir_sends_no_failing_request_and_a_new_run_clears_the_page(
    installed: dict[str, str], tmp_path: Path
) -> None:
    # before: every view asked for data with no run, got a 400 on every poll, and after a run
    # appeared "pass at least one run" stayed under a valid chart
    (tmp_path / "tb").mkdir()
    flags = ["--reload_interval=1"]
    with (
        tensorboard(tmp_path / "tb", command=[str(TENSORBOARD)], env=installed, flags=flags) as url,
        chromium() as driver,
    ):
        open_tab(driver, url)
        from selenium.webdriver.common.by import By

        subprocess.run(["sleep", "3"], check=True)  # a few polls of the empty logdir
        status = driver.find_element(By.ID, "status").text
        assert "no run with spectral scalars" in status, status
        assert severe(driver) == []
        _write_run(tmp_path / "tb" / "late", ("Q", "K", "MLP_up", "MLP_down"), 2, [0, 5, 10])
        wait_for_points(driver, ("byRole", "byLayer", "bars"), timeout=60)
        messages = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "section.panel .message")]
        # one run: only the difference view says what it needs
        assert [m for m in messages if m] == [
            "tick at least two runs: the baseline and one to compare"
        ], messages
        status = driver.find_element(By.ID, "status").text
        assert status.startswith("1 of 1 run · updated"), status  # not "1 of 1 runs"
        assert severe(driver) == []


# Every select of the tab and whether it shows one of its options (a blank select has none).
BLANK_SELECTS = """
return [...document.querySelectorAll('section.panel select')]
  .filter((s) => s.selectedIndex < 0)
  .map((s) => s.closest('section').dataset.view + ' ' + s.parentElement.firstChild.textContent.trim());
"""


# Legend label -> the dash pattern of its swatch, for the entries drawn as a dashed line.
DASH_SWATCHES = """
const out = {};
for (const item of document.querySelectorAll(
    `section[data-view="${arguments[0]}"] .legend-item`)) {
  const line = item.querySelector('svg.swatch line');
  if (line) out[item.textContent] = line.getAttribute('stroke-dasharray');
}
return out;
"""
TEXTS = "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent);"
# Each panel's blank height below its last child, the panels (not spanning the page) alone in
# their row of the grid, and where the bar panels end against the room their panel gives them.
LAYOUT = """
const out = {blank: {}, alone: [], bar_tops: []};
const panels = [...document.querySelectorAll('section.panel')];
for (const panel of panels) {
  const box = panel.getBoundingClientRect();
  const bottom = Math.max(...[...panel.children].map((c) => c.getBoundingClientRect().bottom));
  out.blank[panel.dataset.view] = Math.round(box.bottom - bottom);
  const row = panels.filter((p) => Math.abs(p.getBoundingClientRect().top - box.top) < 1);
  if (!panel.classList.contains('wide') && row.length === 1) out.alone.push(panel.dataset.view);
}
const bars = document.querySelector('section[data-view="bars"] .plots');
const svgs = [...bars.querySelectorAll('svg.chart')].map((s) => s.getBoundingClientRect());
out.bars_room = bars.getBoundingClientRect().right;
out.bars_right = Math.max(...svgs.map((r) => r.right));
out.bar_tops = [...bars.querySelectorAll('.cell')].map((c) => Math.round(c.getBoundingClientRect().top));
return out;
"""
# Per canvas of a view: whether its top row and its right column carry ink (drawing cut off there).
CANVAS_EDGES = """
const inked = (g, x, y, w, h) => g.getImageData(x, y, w, h).data.some((v, i) => i % 4 === 3 && v > 0);
return [...document.querySelectorAll(`section[data-view="${arguments[0]}"] canvas`)].map((c) => {
  const g = c.getContext('2d');
  return [inked(g, 0, 0, c.width, 1), inked(g, c.width - 1, 0, 1, c.height)];
});
"""


def _until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Wait until ``condition()`` holds (the page redraws on its next poll); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the page did not get there in time"
        time.sleep(0.2)


def _shoot(driver: object, name: str) -> None:
    """With SPECTRAL_TAB_SHOTS set, a screenshot of each view into that directory (to look at)."""
    folder = os.environ.get("SPECTRAL_TAB_SHOTS")
    if not folder:
        return
    from selenium.webdriver.common.by import By

    Path(folder).mkdir(parents=True, exist_ok=True)
    size = driver.get_window_size()  # type: ignore[attr-defined]
    driver.set_window_size(size["width"], 3200)  # type: ignore[attr-defined]  # whole panels
    driver.execute_script("document.querySelector('header').style.position = 'static'")  # type: ignore[attr-defined]
    time.sleep(0.5)
    for panel in driver.find_elements(By.CSS_SELECTOR, "section.panel"):  # type: ignore[attr-defined]
        panel.screenshot(str(Path(folder) / f"{name}_{panel.get_attribute('data-view')}.png"))
    driver.execute_script("document.querySelector('header').style.position = ''")  # type: ignore[attr-defined]
    driver.set_window_size(size["width"], size["height"])  # type: ignore[attr-defined]


def test_runs_of_different_models_ticked_together(
    installed: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A decoder-only fit, a T5 (encoder and decoder stacks), a Mixtral (experts), analyze's one
    snapshot and a run with alerts, ticked together, then the one-snapshot run alone."""
    logdir, raised = several_models(tmp_path_factory)
    from selenium.webdriver.common.by import By

    with (
        tensorboard(logdir, command=[str(TENSORBOARD)], env=installed) as url,
        chromium(1400, 1000) as driver,
    ):
        open_tab(driver, url)
        wait_for_points(driver, ("byRole", "depth"), timeout=60)
        tick = "document.querySelector(`#run-selector input[value='${arguments[0]}']`).click()"
        driver.execute_script(tick, "5-alerts")  # in one go: the list is redrawn after a click
        wait_for_points(driver, ("byRole", "byLayer", "depth", "bars", "alerts"), timeout=60)

        def inside(view: str, css: str) -> list:
            return driver.find_elements(By.CSS_SELECTOR, f'section[data-view="{view}"] {css}')

        def texts(view: str, css: str) -> list[str]:  # in one go: a redraw replaces elements
            return driver.execute_script(TEXTS, f'section[data-view="{view}"] {css}')

        # one curve per run and stack (before: T5's five blocks were one curve, depths 0-1 twice)
        _until(lambda: len(texts("depth", ".legend-item")) == 6)  # the fifth run drawn too
        labels = [e.text for e in inside("depth", ".legend-item")]
        assert [label.split(" (")[0] for label in labels] == [
            "1-gpt2", "2-t5 · enc", "2-t5 · dec", "3-mixtral", "4-analyzed", "5-alerts"
        ], labels  # fmt: skip
        dashes = {e.get_attribute("stroke-dasharray") for e in inside("depth", "svg path.line")}
        assert "7 3" in dashes  # the decoder's fixed line style, and its legend swatch
        swatches = driver.execute_script(DASH_SWATCHES, "depth")
        assert swatches["2-t5 · dec (step 6)"] == "7 3" and "2-t5 · enc (step 6)" not in swatches
        # the views of one layer or role pick a stack; nothing stands blank
        stack = inside("byRole", "select")[1]
        assert [o.text for o in stack.find_elements(By.TAG_NAME, "option")] == ["enc", "dec"]
        assert driver.execute_script(BLANK_SELECTS) == []
        # experts: a band around the mean in the line views, a whisker on the bars
        assert inside("byRole", "path.band") and inside("bars", "line.whisker")
        from selenium.webdriver.support.ui import Select

        Select(inside("depth", "select")[1]).select_by_value("MLP_up")  # the depth view's role
        _until(lambda: texts("depth", "path.band"))  # Mixtral's band over its experts
        # the alerts view: the alerts run's two rows, the others' states
        rows = [e.text for e in inside("alerts", "tr.alert")]
        assert len(rows) == len(raised) == 2, rows
        assert rows[0].startswith("3 sigma_growth linear2.weight 0")  # newest first
        headings = [e.text for e in inside("alerts", "h3")]
        assert "5-alerts · 2 alerts (sigma_growth 2)" in headings
        assert "1-gpt2 · no alerts up to step 6" in headings
        assert "4-analyzed · alerts off (no spectral_alerts counts)" in headings
        # five ticked: the fifth has no heatmap and no bar panel, and the page says so (before:
        # left out silently)
        for view, what in (("wave", "a heatmap per run"), ("bars", "a bar panel per run")):
            _until(lambda view=view: any("not drawn here" in t for t in texts(view, ".note")))
            (left,) = [t for t in texts(view, ".note") if "not drawn here" in t]
            assert left.startswith(f"1 ticked run not drawn here ({what}, 4 at most): 5-alerts")
        assert len(texts("wave", ".plot")) == 4  # the first four ticked
        # the legend in the bars' order, the command line's (before: the first run's six roles,
        # then the others alphabetically: K_cross before Q_cross)
        legend = [t for t in texts("bars", ".legend-item") if t]
        assert legend == [
            "Q", "K", "V", "O", "Q_cross", "K_cross", "V_cross", "O_cross", "Router", "MLP_gate",
            "MLP↑", "MLP↓",
        ], legend  # fmt: skip
        # no panel stands beside a taller one with an empty area below its chart, none alone in
        # its row, and the bar panels fill their panel's width (before: the bars of three runs
        # stood ~1,000 px tall in one column of the grid, the depth chart beside them ~600 px
        # short of its panel's bottom; the diff view alone in its row)
        layout = driver.execute_script(LAYOUT)
        assert all(blank < 100 for blank in layout["blank"].values()), layout
        assert layout["alone"] == [], layout
        assert layout["bars_right"] > layout["bars_room"] - 60, layout
        assert len({top for top in layout["bar_tops"]}) == 2, layout  # 4 panels: 2 rows of 2
        # the colour bar's label stays inside its canvas (before: a 2-layer stack's 46 px bar
        # cut "frobenius_norm" off at the top of the canvas)
        Select(inside("wave", "select")[0]).select_by_value("frobenius_norm")
        _until(lambda: inside("wave", "select")[0].get_attribute("value") == "frobenius_norm")
        Select(inside("wave", "select")[2]).select_by_value("enc")  # the T5's 2-layer encoder
        _until(lambda: texts("wave", "h3")[1:2] == ["2-t5 · enc"])
        _until(lambda: len(texts("wave", "canvas")) == 4)
        edges = driver.execute_script(CANVAS_EDGES, "wave")
        assert edges and not any(top or right for top, right in edges), edges
        _shoot(driver, "several")
        Select(inside("wave", "select")[0]).select_by_value("compression")
        Select(inside("wave", "select")[2]).select_by_value("dec")
        # the one-snapshot run alone: markers, filled selects, and the wave says why it is empty
        for run in ("1-gpt2", "2-t5", "3-mixtral", "5-alerts"):
            driver.execute_script(tick, run)
        why = (
            "no compression of Q in 4-analyzed: one snapshot (step 0), nothing to compress against"
        )
        _until(lambda: texts("wave", ".plot") == [why])
        _until(lambda: len(texts("byLayer", "circle.marker")) == 3)  # Q of its 3 layers
        assert len(texts("byRole", "circle.marker")) == 6  # Q K V O MLP↑ MLP↓ of layer 0
        assert driver.execute_script(BLANK_SELECTS) == []  # before: wave and bars stood blank
        _until(lambda: texts("bars", ".plot") == [why.replace(" of Q", "")])
        _shoot(driver, "analyzed")
        # unticking the last ticked run leaves none ticked (before: the first four were ticked
        # again at the next poll)
        driver.execute_script(tick, "4-analyzed")
        _until(lambda: texts("wave", ".message") == ["tick a run above"])
        time.sleep(4)  # past the next poll (every 3 s)
        checked = "return [...document.querySelectorAll('#run-selector input')].filter((i) => i.checked).length"
        assert driver.execute_script(checked) == 0
        assert texts("wave", ".message") == ["tick a run above"]
        assert severe(driver) == []


def test_the_heads_view_draws_a_heatmap_per_run_and_a_line_per_head(
    installed: dict[str, str], tmp_path: Path
) -> None:
    import torch
    from gpt import GPT, GPTConfig

    from spectral_callbacks.monitor.tracker import SpectralTracker

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=16, attention="gqa")
    )
    tracker = SpectralTracker(
        model, logdir=tmp_path / "tb" / "gqa", circuits=True, synchronous=True, figures=False
    )
    tracker.begin(0)
    for step in range(1, 4):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=1e-2)
        tracker.step(step)
    tracker.close()
    with (
        tensorboard(
            tmp_path / "tb", command=[str(TENSORBOARD)], env=installed, cwd=tmp_path
        ) as url,
        chromium() as driver,
    ):
        open_tab(driver, url)
        # 3 layers x 4 heads in the heatmap + 4 heads x 4 snapshots of layer 0's lines
        points = wait_for_points(driver, ["heads"], timeout=60, more_than={"heads": 3 * 4 + 16 - 1})
        from selenium.webdriver.common.by import By

        assert points["heads"] == 3 * 4 + 4 * 4
        view = 'section[data-view="heads"]'
        assert len(driver.find_elements(By.CSS_SELECTOR, f"{view} canvas.heatmap")) == 1
        assert len(driver.find_elements(By.CSS_SELECTOR, f"{view} svg path.line")) == 4
        assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, f"{view} .legend-item")] == [
            "H0",
            "H1",
            "H2",
            "H3",
        ]
        assert severe(driver) == []
        _shoot(driver, "heads")
        # a circuit metric in "Metric vs step": one line per layer, the heads' mean, in a band
        # over the heads (before: one zig-zag line through every head and the mean in turn)
        from selenium.webdriver.support.ui import Select

        by_role = 'section[data-view="byRole"]'
        Select(driver.find_elements(By.CSS_SELECTOR, f"{by_role} select")[0]).select_by_value(
            "qk_spectral_norm"
        )
        wait_for_points(driver, ["byRole"], timeout=30)
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and "qk_spectral_norm"
            not in driver.find_element(By.CSS_SELECTOR, f"{by_role} svg").text
        ):
            time.sleep(0.2)
        assert len(driver.find_elements(By.CSS_SELECTOR, f"{by_role} svg path.line")) == 1
        assert len(driver.find_elements(By.CSS_SELECTOR, f"{by_role} svg path.band")) == 1
        assert int(driver.find_element(By.CSS_SELECTOR, by_role).get_attribute("data-points")) == 4
        notes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, f"{by_role} .note")]
        assert notes == [
            "a layer’s heads: the line is their mean, the band their min … max over the heads"
        ]
        assert severe(driver) == []
