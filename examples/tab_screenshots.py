"""Screenshots of the SPECTRAL tab's views for docs/images, taken with headless Chromium.

Serves ``--logdir`` with TensorBoard and the tab on loopback, opens it at 1400 x 900, sets the
difference view to ``--baseline`` against ``--x``, and saves the top of the page and each view:

    python examples/attention_variants.py --logdir runs/variants --variants mha gqa mla --steps 200
    python examples/tab_screenshots.py --logdir runs/variants --baseline mha --x train/tokens

Needs Debian's chromium and chromium-driver and selenium (see tests/browser.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from browser import chromium, missing_browser, open_tab, tensorboard, wait_for_points  # noqa: E402

VIEWS = {
    "wave": "spectral_wave.png",
    "byRole": "spectral_by_role.png",
    "byLayer": "spectral_by_layer.png",
    "depth": "spectral_depth.png",
    "bars": "spectral_bars.png",
    "diff": "spectral_diff.png",
}


def choose(driver: object, view: str, label: str, value: str) -> None:
    """Pick ``value`` in the drop-down labelled ``label`` of ``view``."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for wrap in driver.find_elements(
        By.CSS_SELECTOR, f'section[data-view="{view}"] .controls label'
    ):  # type: ignore[attr-defined]
        if wrap.text.split("\n")[0].strip().startswith(label):
            Select(wrap.find_element(By.TAG_NAME, "select")).select_by_value(value)
            return
    raise ValueError(f"no control {label!r} in view {view!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, required=True)
    parser.add_argument("--baseline", help="the difference view's baseline run")
    parser.add_argument("--x", default="step", help="the difference view's x axis")
    parser.add_argument("--output", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    if missing_browser():
        sys.exit(f"tab_screenshots: {missing_browser()}")
    args.output.mkdir(parents=True, exist_ok=True)
    with tensorboard(args.logdir) as url, chromium(1400, 900) as driver:

        def prepare() -> None:
            open_tab(driver, url)
            wait_for_points(driver, list(VIEWS), timeout=120)
            if args.baseline:
                choose(driver, "diff", "baseline", args.baseline)
            choose(driver, "diff", "x", args.x)
            time.sleep(2)  # the redraw after the choice
            driver.execute_script("window.scrollTo(0, 0)")  # type: ignore[attr-defined]

        prepare()
        driver.switch_to.default_content()  # type: ignore[attr-defined]
        driver.save_screenshot(str(args.output / "spectral_tab.png"))  # type: ignore[attr-defined]
        driver.set_window_size(1400, 1700)  # type: ignore[attr-defined]  # tall views whole
        prepare()
        from selenium.webdriver.common.by import By

        for view, name in VIEWS.items():
            panel = driver.find_element(By.CSS_SELECTOR, f'section[data-view="{view}"]')  # type: ignore[attr-defined]
            # Clear of the sticky run selector at the top of the frame.
            driver.execute_script(  # type: ignore[attr-defined]
                "window.scrollTo(0, arguments[0].offsetTop - "
                "document.querySelector('header').offsetHeight - 8)",
                panel,
            )
            panel.screenshot(str(args.output / name))
            print(f"wrote {args.output / name}")
    print(f"wrote {args.output / 'spectral_tab.png'}")


if __name__ == "__main__":
    main()
