"""Where the SPECTRAL tab's time goes when it opens the long run: TensorBoard's data provider
(each call and its points) against the tab's own work (frames, views, downsampling, JSON).

Serves ``--logdir`` (a parent of run ``d24`` written by ``benchmarks/tensorboard_tab.py`` or
``benchmarks/long_run.py``) in this process, with TensorBoard's own app and loader, and sends the
requests of the opening tab through it twice (cold, then warm) with the parts timed:

* ``provider`` - ``read_scalars`` / ``read_last_scalars`` of TensorBoard's data provider: for the
  Rust data server the gRPC call and TensorBoard's conversion of each point into a
  ``ScalarDatum``, for the Python loader the multiplexer's conversion of each event;
* ``frame`` - the tab's DataFrame of the series a view needs (``ScalarSource._frame``);
* ``downsample`` - ``keep_extremes``; ``json`` - encoding the answer;
* ``views`` - the rest of the request: the views' pandas work (and an import on first use).

    python benchmarks/tensorboard_tab_profile.py --logdir /tmp/long --loader rust
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from long_run import write_long_run  # noqa: E402
from tensorboard_tab import PROBE, holds_whole_run, open_requests  # noqa: E402

PARTS = ("provider", "frame", "downsample", "json", "views")


class Clock:
    """Seconds spent in each timed part since the last :meth:`reset`, and the provider calls."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: list[str] = []

    def timed(self, part: str, function: Callable, label: Callable | None = None) -> Callable:
        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - begin
                if label is not None:
                    self.calls.append(label(*args, **kwargs))

        return wrapper


class TimedProvider:
    """TensorBoard's data provider with its scalar reads timed (everything else passed on)."""

    def __init__(self, inner: object, clock: Clock) -> None:
        self._inner = inner
        for name in ("read_scalars", "read_last_scalars"):
            label = lambda *a, _name=name, run_tag_filter=None, **k: (  # noqa: E731
                f"{_name}({len(run_tag_filter.tags) if run_tag_filter else 'all'} tags)"
            )
            setattr(self, name, clock.timed("provider", getattr(inner, name), label))

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def serve(logdir: Path, load_fast: str, clock: Clock) -> Callable[[str, dict], bytes]:
    """TensorBoard's WSGI app over ``logdir`` with the tab's parts timed by ``clock``."""
    from tensorboard import default, program
    from tensorboard.backend import application
    from werkzeug import test, wrappers

    from spectral_callbacks.tensorboard_plugin import plugin, source, views

    others = [p for p in default.get_plugins() if getattr(p, "plugin_name", None) != "spectral"]
    server = program.TensorBoard(plugins=[*others, plugin.SpectralPlugin])
    server.configure(argv=["tensorboard", f"--logdir={logdir}", f"--load_fast={load_fast}"])
    provider, multiplexer = server._make_data_provider()  # what server.main() would build
    source.ScalarSource._frame = clock.timed("frame", source.ScalarSource._frame)
    views.keep_extremes = clock.timed("downsample", views.keep_extremes)
    plugin.json.dumps = clock.timed("json", json.dumps)  # the json module's: all JSON here
    app = application.TensorBoardWSGIApp(
        server.flags,
        server.plugin_loaders,
        TimedProvider(provider, clock),
        server.assets_zip_provider,
        multiplexer,
    )
    client = test.Client(app, wrappers.Response)

    def get(route: str, params: dict) -> bytes:
        response = client.get(f"/data/plugin/spectral/{route}?{urlencode(params, doseq=True)}")
        if response.status_code != 200:
            raise RuntimeError(f"{route}: {response.get_data(as_text=True)[:300]}")
        return response.get_data()

    return get


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, help="a parent of run d24 (--smoke: a tiny one)")
    parser.add_argument("--loader", choices=["python", "rust"], default="rust")
    parser.add_argument("--steps", type=int, default=10_000, help="of the run d24")
    parser.add_argument("--layers", type=int, default=24, help="of the run d24")
    args = smoke.parse_args(parser, argv, steps=100, layers=2)
    if args.logdir is None:
        if not args.smoke:
            parser.error("--logdir is required (a parent of run d24), or --smoke")
        args.logdir = Path(tempfile.mkdtemp(prefix="spectral-tab-smoke-"))
        write_long_run(args.logdir / "d24", steps=args.steps, layers=args.layers, every=10)
    clock = Clock()
    get = serve(args.logdir, "true" if args.loader == "rust" else "false", clock)
    begin = time.perf_counter()
    while not holds_whole_run(json.loads(get(*PROBE)), args.layers, args.steps):
        time.sleep(0.5)
    print(f"ingest {time.perf_counter() - begin:.1f} s ({args.loader} loader)")
    print("\n| request | round | total ms | " + " | ".join(f"{p} ms" for p in PARTS) + " | calls |")
    print("|---|---|---:|" + "---:|" * len(PARTS) + "---|")
    for round_ in ("cold", "warm"):
        totals = defaultdict(float)
        for route, params in open_requests("d24"):
            clock.reset()
            had_torch = "torch" in sys.modules
            begin = time.perf_counter()
            get(route, params)
            total = time.perf_counter() - begin
            timed = sum(clock.seconds[p] for p in PARTS if p != "views")
            clock.seconds["views"] = total - timed
            totals["total"] += total
            for part in PARTS:
                totals[part] += clock.seconds[part]
            calls = ", ".join(clock.calls)
            if "torch" in sys.modules and not had_torch:
                calls += " (imported torch)"
            cells = " | ".join(f"{clock.seconds[p] * 1000:.0f}" for p in PARTS)
            print(f"| {route} | {round_} | {total * 1000:.0f} | {cells} | {calls} |")
        cells = " | ".join(f"**{totals[p] * 1000:.0f}**" for p in PARTS)
        print(f"| **open** | {round_} | **{totals['total'] * 1000:.0f}** | {cells} | |")


if __name__ == "__main__":
    main()
