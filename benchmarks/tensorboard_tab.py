"""How fast the SPECTRAL tab opens a long run: a 10,000-step, 24-layer run of ~1 M points.

Writes the synthetic run of ``benchmarks/long_run.py`` (or reuses ``--logdir``), then measures:

1. **Routes** - the requests the tab makes when it opens (``runs``, then the five views of one
   run; the baseline difference needs a second run), answered by TensorBoard's own WSGI app over
   its multiplexer data provider, with TensorBoard's default sampling (1,000 points per series,
   which this run fits exactly). ``cold``: a fresh plugin, nothing cached (the first open);
   ``warm``: the same requests again with unchanged data (every poll of the open tab). Medians
   of ``--rounds`` rounds, in one process.
2. **Browser** (with ``--browser``, needs Debian's chromium + chromium-driver and selenium): a
   real ``tensorboard`` server on loopback (``--load_fast=false``: the Python loader; ``true``:
   TensorBoard's Rust data server), the time it takes to ingest the run, then headless Chromium's
   time from opening ``/#spectral`` to every view drawn (TensorBoard's own page load included).

    python benchmarks/tensorboard_tab.py                     # routes only
    python benchmarks/tensorboard_tab.py --browser --rounds 3
    python benchmarks/tensorboard_tab.py --logdir /tmp/long  # a run written before
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
from long_run import write_long_run  # noqa: E402

VIEWS = ("wave", "byRole", "byLayer", "depth", "bars")


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


def route_times(logdir: Path, run: str, rounds: int) -> tuple[float, int, dict[str, list]]:
    """TensorBoard's ingest seconds, points held, and per route [cold ms], [warm ms], bytes."""
    from tensorboard.backend import application
    from tensorboard.backend.event_processing import (
        data_ingester,
        data_provider,
        plugin_event_multiplexer,
    )
    from tensorboard.context import RequestContext
    from tensorboard.plugins import base_plugin
    from werkzeug import test as werkzeug_test
    from werkzeug import wrappers

    from spectral_callbacks.tensorboard_plugin.plugin import SpectralPlugin

    start = time.perf_counter()
    multiplexer = plugin_event_multiplexer.EventMultiplexer(
        size_guidance=data_ingester.DEFAULT_SIZE_GUIDANCE,
        tensor_size_guidance=data_ingester.DEFAULT_TENSOR_SIZE_GUIDANCE,
    )
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    ingest = time.perf_counter() - start
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    held = sum(
        len(series)
        for tags in provider.read_scalars(
            RequestContext(), experiment_id="", plugin_name="scalars", downsample=10**7
        ).values()
        for series in tags.values()
    )
    results: dict[str, list] = {name: [[], [], 0] for name, _ in open_requests(run)}
    for _ in range(rounds):
        context = base_plugin.TBContext(logdir=str(logdir), data_provider=provider)
        client = werkzeug_test.Client(
            application.TensorBoardWSGI([SpectralPlugin(context)]), wrappers.Response
        )
        for phase in (0, 1):  # cold, then warm
            for name, params in open_requests(run):
                begin = time.perf_counter()
                response = client.get(f"/data/plugin/spectral/{name}", query_string=params)
                took = time.perf_counter() - begin
                assert response.status_code == 200, response.get_data(as_text=True)
                results[name][phase].append(took * 1000)
                results[name][2] = len(response.get_data())
    return ingest, held, results


def browser_times(logdir: Path, load_fast: str, rounds: int) -> tuple[float, list[float]]:
    """Seconds until a real server holds the whole run, and seconds per page open to all drawn."""
    from browser import chromium, get_json, open_tab, tensorboard, wait_for_points

    start = time.perf_counter()
    with tensorboard(logdir, flags=[f"--load_fast={load_fast}"], timeout=600) as url:
        probe = url + "data/plugin/spectral/by_layer?run=d24&role=MLP_down&max_points=4"
        while True:  # ingested when the deepest layer's last snapshot is there
            series = get_json(probe, timeout=60)["series"]
            if len(series) == 24 and all(line["steps"][-1] == 9_990 for line in series):
                break
            time.sleep(0.5)
        ingest = time.perf_counter() - start
        opens = []
        for _ in range(rounds):
            with chromium() as driver:
                begin = time.perf_counter()
                open_tab(driver, url)
                wait_for_points(driver, VIEWS, timeout=120)
                opens.append(time.perf_counter() - begin)
    return ingest, opens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, help="a parent of run d24 written by long_run.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--browser", action="store_true", help="also time a real browser")
    args = parser.parse_args()
    logdir = args.logdir
    if logdir is None or not (logdir / "d24").exists():
        logdir = logdir or Path(tempfile.mkdtemp(prefix="spectral-tab-"))
        begin = time.perf_counter()
        points = write_long_run(logdir / "d24", steps=10_000, layers=24, every=10)
        print(f"wrote {points:,} points to {logdir / 'd24'} in {time.perf_counter() - begin:.0f} s")

    ingest, held, results = route_times(logdir, "d24", args.rounds)
    print(f"\nTensorBoard (Python loader) ingested the run in {ingest:.1f} s, {held:,} points held")
    print(f"\n| request   | cold ms (fresh plugin) | warm ms (poll) | response KB |  ({args.rounds} rounds, medians)")
    print("|-----------|-----------------------:|---------------:|------------:|")
    for name, (cold, warm, size) in results.items():
        print(
            f"| {name:9} | {statistics.median(cold):22.0f} | {statistics.median(warm):14.1f}"
            f" | {size / 1024:11.1f} |"
        )
    cold_total = statistics.median([sum(r) for r in zip(*(v[0] for v in results.values()))])
    warm_total = statistics.median([sum(r) for r in zip(*(v[1] for v in results.values()))])
    print(f"| **open**  | {cold_total:22.0f} | {warm_total:14.1f} |             |")

    if args.browser:
        print("\n| server loader          | ingest s | tab open to all views drawn, s (each round) |")
        print("|------------------------|---------:|---------------------------------------------|")
        for load_fast, name in (("false", "Python (multiplexer)"), ("true", "Rust data server")):
            try:
                ingest, opens = browser_times(logdir, load_fast, args.rounds)
            except RuntimeError as error:
                print(f"| {name:22} | n/a      | {str(error).splitlines()[0][:60]} |")
                continue
            rounds = ", ".join(f"{t:.2f}" for t in opens)
            print(f"| {name:22} | {ingest:8.1f} | median {statistics.median(opens):.2f} ({rounds}) |")


if __name__ == "__main__":
    main()
