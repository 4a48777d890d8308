"""What ``circuits=True`` adds to a snapshot: the per-head QK/OV circuits beside the spectra.

A 12-layer x 768 GPT (the example GPT's MHA, 12 heads of 64: GPT-2 small's shapes) is watched by
two trackers in one process, ``circuits=False`` and ``circuits=True``, snapshotting inline at
every step (``synchronous=True``, so the compute runs on this thread and its time is the
snapshot's), alternating step by step so other work on the machine slows both alike. Between
steps every weight moves by a small random step (a warm start faces real movement).

Columns (milliseconds per snapshot, the median over the warm snapshots; the first, which calibrates
the SVD method, is shown apart):

* ``main ms``: the copy on the training thread (``spectral_monitor/main_thread_ms``): the heads
  read the snapshot's copies of Q/K/V/O (watched here as dense matrices), no second copy;
* ``compute ms``: the spectra (and circuits) (``spectral_monitor/svd_ms``);
* ``snapshot ms``: both; ``snapshot cpu ms``: this thread's CPU time of the snapshot's
  ``tracker.step`` (on a loaded machine the wall times also count other processes' turns); the
  ratios: on / off.

Also the circuits alone, timed directly: the copy they take where Q/K/V/O are not watched
(``HeadCircuit.stack_batch``) and their compute (``CircuitBatch.exact_metrics``), for the 144 heads.

Run: ``python benchmarks/circuits_cost.py`` (about a minute on one idle core); ``--smoke``: 2 layers
x 64, 4 heads, in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402
from spectral_callbacks.targets.circuits import HeadCircuit, find_circuits  # noqa: E402


class Recorder:
    """A writer keeping what each step logged."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--snapshots", type=int, default=6, help="per variant, the first included")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = smoke.parse_args(parser, argv, layers=2, width=64, heads=4, snapshots=3)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=64, attention="mha"
    )
    model = GPT(config)
    writers = {"off": Recorder(), "on": Recorder()}
    trackers = {
        name: SpectralTracker(
            model,
            writers=[writer],
            circuits=name == "on",
            synchronous=True,
            figures=False,
            every_n_steps=1,
            log_spaced_until=0,
            alerts=None,
            start_step=0,
        )
        for name, writer in writers.items()
    }
    cpu: dict[str, list[float]] = {name: [] for name in trackers}
    for step in range(1, args.snapshots):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter), alpha=1e-3)
        for name, tracker in trackers.items():
            start = time.thread_time()  # inline: the whole snapshot runs on this thread
            tracker.step(step)
            cpu[name].append(time.thread_time() - start)
    for tracker in trackers.values():
        tracker.close()

    def per_snapshot(name: str, tag: str) -> list[float]:
        logged = writers[name].logged
        return [logged[step][f"spectral_monitor/{tag}"] for step in sorted(logged)]

    print(
        f"{args.layers} layers x {args.width}, {args.heads} heads; {args.snapshots} snapshots "
        f"each, inline, {args.threads} thread(s)"
    )
    print(
        "| circuits | first main ms | first compute ms | main ms | compute ms | snapshot ms "
        "| snapshot cpu ms |"
    )
    print("|---|---|---|---|---|---|---|")
    total, cpu_ms = {}, {}
    for name in writers:
        main_ms, svd_ms = per_snapshot(name, "main_thread_ms"), per_snapshot(name, "svd_ms")
        warm_main, warm_svd = statistics.median(main_ms[1:]), statistics.median(svd_ms[1:])
        total[name] = warm_main + warm_svd
        cpu_ms[name] = 1000 * statistics.median(cpu[name])
        print(
            f"| {name} | {main_ms[0]:.1f} | {svd_ms[0]:.1f} | {warm_main:.1f} | {warm_svd:.1f} | "
            f"{total[name]:.1f} | {cpu_ms[name]:.1f} |"
        )
    print(
        f"warm snapshot ratio on / off: wall {total['on'] / total['off']:.3f}, "
        f"cpu {cpu_ms['on'] / cpu_ms['off']:.3f}"
    )

    heads = find_circuits(model, find_targets(model))
    copies, computes = [], []
    for _ in range(3):
        start = time.thread_time()
        batch = HeadCircuit.stack_batch(heads)
        copies.append(time.thread_time() - start)
        start = time.thread_time()
        batch.exact_metrics()
        computes.append(time.thread_time() - start)
    print(
        f"circuits alone, {len(heads)} heads: copy {1000 * min(copies):.1f} ms, "
        f"compute {1000 * min(computes):.1f} ms (CPU time, best of 3)"
    )


if __name__ == "__main__":
    main()
