"""What the logging of a mixture of experts costs the training thread at each snapshot: the
Reporter's scalars (mean/min/max over experts) and the histograms over experts written as one
event to a TensorBoard SummaryWriter, for shapes of real mixtures (no model, no SVD: random
values stand in for the metrics). Prints a table; median of --repeats.

Run: python benchmarks/expert_histograms.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import smoke

from spectral_callbacks import tensorboard_adapter as tb
from spectral_callbacks.monitor.options import DEFAULT_METRICS
from spectral_callbacks.monitor.reporting import Reporter
from spectral_callbacks.names import MatrixLabel

# (name, MoE layers, experts per layer); three expert roles each (gate, up, down)
MIXTURES = (("Mixtral 8x7B", 32, 8), ("Qwen3-MoE 30B-A3B", 48, 128), ("DeepSeek-V3", 58, 256))
ROLES = ("MLP_gate", "MLP_up", "MLP_down")


def measure(layers: int, experts: int, repeats: int) -> tuple[int, float, float]:
    targets = [
        MatrixLabel(f"{layer}.{role}.{expert}", layer, role, num_layers=layers, expert=expert)
        for layer in range(layers)
        for role in ROLES
        for expert in range(experts)
    ]
    metrics = [m for m in DEFAULT_METRICS if m != "compression"]
    reporter = Reporter(targets, DEFAULT_METRICS)
    rng = np.random.default_rng(0)
    scalar_s, histogram_s = [], []
    with tempfile.TemporaryDirectory() as logdir:
        writer = tb.LogdirWriter(logdir)
        for step in range(repeats + 1):
            values = {
                t.name: dict(zip(metrics, rng.uniform(1, 9, len(metrics)).tolist(), strict=True))
                for t in targets
            }
            start = time.perf_counter()
            scalars = reporter.scalars(step, values)
            tb.log_scalars([writer], scalars, step)
            middle = time.perf_counter()
            histograms = reporter.expert_values(values)
            tb.add_histograms([writer.experiment], histograms, step)
            end = time.perf_counter()
            if step:  # the first call imports and opens the file
                scalar_s.append(middle - start)
                histogram_s.append(end - middle)
        writer.finalize()
    return len(histograms), statistics.median(scalar_s), statistics.median(histogram_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = smoke.parse_args(parser, argv, repeats=1)
    mixtures = MIXTURES[:1] if args.smoke else MIXTURES
    print("| mixture | MoE layers x experts | histograms / snapshot | scalars ms | histograms ms |")
    print("|---|---|---|---|---|")
    for name, layers, experts in mixtures:
        count, scalar_s, histogram_s = measure(layers, experts, args.repeats)
        print(
            f"| {name} | {layers} x {experts} | {count} | {1000 * scalar_s:.0f} | "
            f"{1000 * histogram_s:.0f} |"
        )


if __name__ == "__main__":
    main()
