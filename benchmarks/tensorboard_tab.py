"""How fast the SPECTRAL tab opens a long run: a 10,000-step, 24-layer run of ~1 M points.

Writes the synthetic run of ``benchmarks/long_run.py`` (or reuses ``--logdir``), then, for each of
TensorBoard's two loaders (``--load_fast=false``: the Python multiplexer; ``true``: the Rust data
server, what ``tensorboard`` uses by default where it is installed), starts a real server on
loopback with the tab and measures:

* ``ingest s`` - until TensorBoard holds the whole run (its own loading, before any plugin can
  answer; the tab cannot make it faster);
* per request the tab makes when it opens (``runs``, then the five views of one run with their
  default controls; the baseline difference needs a second run): ``cold`` - the first time,
  nothing cached (opening the run), ``warm`` - again with unchanged data (every poll of the open
  tab), in ms over HTTP; ``open`` sums them;
* with ``--browser`` (Debian's chromium + chromium-driver, selenium): headless Chromium's seconds
  from opening ``/#spectral`` to TensorBoard's page having made the tab's frame, and to every
  view drawn (``--rounds`` opens: the first on a fresh server, cold, the others warm), and
  TensorBoard's own page alone (a one-snapshot run).

    python benchmarks/tensorboard_tab.py --browser
    python benchmarks/tensorboard_tab.py --logdir /tmp/long   # a parent of a run d24 written before
    python benchmarks/tensorboard_tab.py --logdir /tmp/long --loader rust   # one loader only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402

VIEWS = ("wave", "byRole", "byLayer", "depth", "bars")
# A series no view opens, whose last point in every layer says the server holds the whole run.
PROBE = "by_layer", {"run": "d24", "metric": "alpha_r2", "role": "MLP_down", "max_points": 4}


def open_requests(run: str) -> list[tuple[str, dict]]:
    """The requests the tab sends when it opens on ``run`` with its default controls."""
    return [
        ("runs", {}),
        ("wave", {"run": run, "metric": "compression", "role": "Q"}),
        ("by_role", {"run": run, "metric": "stable_rank", "layer": 0}),
        ("by_layer", {"run": run, "metric": "stable_rank", "role": "Q"}),
        ("depth", {"run": run, "metric": "alpha", "role": "Q"}),
        ("bars", {"run": run, "metric": "compression"}),
    ]


def holds_whole_run(answer: dict, layers: int, steps: int) -> bool:
    """Whether the ``PROBE`` answer has the last snapshot (every 10 steps, as long_run.py writes
    them) of a ``steps``-step run in each of its ``layers`` layers."""
    series, last = answer["series"], (steps - 1) // 10 * 10
    return len(series) == layers and all(line["steps"][-1] == last for line in series)


def ingested(url: str, layers: int, steps: int, timeout: float = 1800) -> None:
    """Wait until the server at ``url`` holds the whole run (at most ``timeout`` seconds)."""
    from urllib.parse import urlencode

    from browser import get_json

    route, params = PROBE
    deadline = time.monotonic() + timeout
    while not holds_whole_run(
        get_json(f"{url}data/plugin/spectral/{route}?{urlencode(params)}", timeout=120),
        layers,
        steps,
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not hold all of {layers} x {steps} in {timeout} s")
        time.sleep(0.5)


def timed_requests(url: str) -> dict[str, tuple[float, int]]:
    """Milliseconds and bytes of each request of the opening tab, in the page's order."""
    from urllib.parse import urlencode
    from urllib.request import urlopen

    out = {}
    for name, params in open_requests("d24"):
        begin = time.perf_counter()
        with urlopen(f"{url}data/plugin/spectral/{name}?{urlencode(params)}", timeout=120) as r:
            size = len(r.read())
        out[name] = ((time.perf_counter() - begin) * 1000, size)
    return out


def browser_open(driver: object, url: str, views: tuple[str, ...] = VIEWS) -> tuple[float, float]:
    """Seconds until TensorBoard's page has made the tab's frame, and until ``views`` are drawn."""
    from browser import open_tab, wait_for_points

    begin = time.perf_counter()
    open_tab(driver, url)  # TensorBoard's page is up and the tab's frame is there
    framed = time.perf_counter() - begin
    if views:
        wait_for_points(driver, views, timeout=120)
    return framed, time.perf_counter() - begin


def measure(
    logdir: Path, load_fast: str, rounds: int, browser: bool, layers: int, steps: int
) -> dict:
    """Ingest seconds, cold and warm request times, and browser opens of one loader.

    With ``browser``, the first open is on a server of its own that nothing has asked yet (cold),
    the others after the timed requests (warm).
    """
    from browser import chromium, tensorboard

    flags = [f"--load_fast={load_fast}"]
    result: dict = {"opens": []}
    if browser:
        with tensorboard(logdir, flags=flags, timeout=600) as url, chromium() as driver:
            ingested(url, layers, steps)
            result["opens"].append(browser_open(driver, url))
    start = time.perf_counter()
    with tensorboard(logdir, flags=flags, timeout=600) as url:
        ingested(url, layers, steps)
        result["ingest"] = time.perf_counter() - start
        result["cold"] = timed_requests(url)
        warm = [timed_requests(url) for _ in range(rounds)]
        result["warm"] = {name: statistics.median(w[name][0] for w in warm) for name in warm[0]}
        for _ in range(rounds - 1 if browser else 0):
            with chromium() as driver:
                result["opens"].append(browser_open(driver, url))
    return result


def page_alone(rounds: int) -> list[float]:
    """Seconds until TensorBoard's page has made the tab's frame for a run of one snapshot of
    one layer: TensorBoard's own page load on this machine, with nearly nothing for the tab."""
    from browser import chromium, tensorboard
    from long_run import write_long_run

    logdir = Path(tempfile.mkdtemp(prefix="spectral-tab-tiny-"))
    write_long_run(logdir / "tiny", steps=1, layers=1, every=1)
    with tensorboard(logdir, flags=["--load_fast=true"]) as url:
        opens = []
        for _ in range(rounds):
            with chromium() as driver:
                opens.append(browser_open(driver, url, views=())[0])
    return opens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, help="a parent of run d24 written by long_run.py")
    parser.add_argument("--rounds", type=int, default=3, help="warm repeats and browser opens")
    parser.add_argument("--browser", action="store_true", help="also time a real browser")
    parser.add_argument(
        "--loader",
        choices=["both", "python", "rust"],
        default="both",
        help="measure one loader only (the Python loader's ingest of the run takes minutes)",
    )
    parser.add_argument(
        "--steps", type=int, default=10_000, help="of the run d24 (written or read)"
    )
    parser.add_argument("--layers", type=int, default=24, help="of the run d24 (written or read)")
    args = smoke.parse_args(parser, argv, rounds=1, loader="rust", steps=100, layers=2)
    logdir = args.logdir
    if logdir is None or not (logdir / "d24").exists():
        from long_run import write_long_run

        logdir = logdir or Path(tempfile.mkdtemp(prefix="spectral-tab-"))
        begin = time.perf_counter()
        points = write_long_run(logdir / "d24", steps=args.steps, layers=args.layers, every=10)
        print(f"wrote {points:,} points to {logdir / 'd24'} in {time.perf_counter() - begin:.0f} s")

    loaders = {"false": "Python loader", "true": "Rust data server"}
    if args.loader != "both":
        loaders = {k: v for k, v in loaders.items() if (k == "true") == (args.loader == "rust")}
    results = {}
    for load_fast, name in loaders.items():
        try:
            results[name] = measure(
                logdir, load_fast, args.rounds, args.browser, args.layers, args.steps
            )
        except RuntimeError as error:  # e.g. no data server binary on this platform
            print(f"{name}: not measured ({str(error).splitlines()[0][:120]})")
    names = list(results)
    print(
        "\n| request | " + " | ".join(f"{n}: cold ms | warm ms" for n in names) + " | response KB |"
    )
    print("|---|" + "---:|---:|" * len(names) + "---:|")
    for request, _ in open_requests("d24"):
        cells = " | ".join(
            f"{results[n]['cold'][request][0]:.0f} | {results[n]['warm'][request]:.0f}"
            for n in names
        )
        size = results[names[0]]["cold"][request][1] / 1024
        print(f"| {request} | {cells} | {size:.1f} |")
    cells = " | ".join(
        f"**{sum(c for c, _ in results[n]['cold'].values()):.0f}** | "
        f"**{sum(results[n]['warm'].values()):.0f}**"
        for n in names
    )
    print(f"| **open** | {cells} | |")
    print(
        "\n| loader | ingest s | browser s: TensorBoard page + tab frame / all views drawn "
        "(cold, then warm rounds) |"
    )
    print("|---|---:|---|")
    for n in names:
        opens = results[n]["opens"]
        shown = (
            ", ".join(f"{a:.2f} / {b:.2f}" for a, b in opens) if opens else "(run with --browser)"
        )
        print(f"| {n} | {results[n]['ingest']:.1f} | {shown} |")
    if args.browser:
        shown = ", ".join(f"{seconds:.2f}" for seconds in page_alone(args.rounds))
        print(f"\nTensorBoard's own page (a one-snapshot run), until the tab's frame: {shown} s")


if __name__ == "__main__":
    main()
