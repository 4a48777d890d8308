"""A synthetic long run for the SPECTRAL tab: the real logged names, study-like curves, ~1 M points.

Writes what ``SpectralMonitor`` would log for a ``--layers``-layer transformer snapshotted every
``--every`` steps up to ``--steps`` (default 24 layers, 10,000 steps, every 10: 1,000 snapshots of
24 x 6 roles x 7 metrics = 1,008 series, plus the means over layers, the health scalars, loss and
tokens: ~1.06 M points), through the package's own writer path (``tensorboard_adapter.log_scalars`` on a
``TensorBoardLogger``: one event per snapshot). The curves look like the study's: stable rank
collapsing from ~200 in a wave that reaches deeper layers later, MLP roles compressing less, alpha
an inverted U over depth, loss falling; values are not a real training run.

    python benchmarks/long_run.py /tmp/long --steps 10000 --layers 24 --every 10
    tensorboard --logdir /tmp/long          # then the SPECTRAL tab
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import smoke
from lightning.fabric.loggers import TensorBoardLogger

from spectral_callbacks.monitor.reporting import num_layers_scalar
from spectral_callbacks.names import ROLES, monitor_tag, scalar_tag
from spectral_callbacks.tensorboard_adapter import log_scalars

# Final compression per role, as in the study: Q/K strongest, MLP least.
FINAL_COMPRESSION = {"Q": 0.88, "K": 0.86, "V": 0.78, "O": 0.74, "MLP_up": 0.55, "MLP_down": 0.62}


def snapshot(step: int, layers: int, rng: np.random.Generator) -> dict[str, float]:
    """The scalars of one snapshot at ``step``: every metric of every (layer, role) and the means."""
    scalars: dict[str, float] = {}
    for role in ROLES:
        per_metric: dict[str, list[float]] = {}  # the spectra's metrics: no ESD, update, circuits
        for layer in range(layers):
            depth = layer / max(1, layers - 1)
            onset = 300 + 2_500 * depth  # the compression wave: deeper layers collapse later
            progress = 1 - math.exp(-max(0.0, step - onset * 0.2) / onset)
            kept = 1 - FINAL_COMPRESSION[role] * progress
            stable_rank = 200 * kept * (1 + 0.01 * rng.normal())
            spectral_norm = 3 + 12 * (1 - kept) + 0.05 * rng.normal()
            values = {
                "stable_rank": stable_rank,
                "alpha": 0.1 + (0.5 * 4 * depth * (1 - depth) + 0.05) * progress,
                "alpha_r2": 0.9 + 0.09 * progress,
                "spectral_norm": spectral_norm,
                "frobenius_norm": spectral_norm * math.sqrt(stable_rank),
                "energy_rank_90": 600 * kept,
                "compression": 100 * (1 - stable_rank / 200),
            }
            for metric, value in values.items():
                scalars[scalar_tag(metric, layer, role, layers)] = value
                per_metric.setdefault(metric, []).append(value)
        for metric, values_of_layers in per_metric.items():
            scalars[scalar_tag(metric, None, role)] = float(np.mean(values_of_layers))
    scalars[monitor_tag("svd_ms")] = 40 + rng.normal()
    scalars[monitor_tag("main_thread_ms")] = 2 + 0.1 * rng.normal()
    scalars["train/loss"] = 2 + 8 * math.exp(-step / 1_500) + 0.02 * rng.normal()
    scalars["train/tokens"] = float((step + 1) * 8 * 1024)
    return scalars


def write_long_run(logdir: Path, *, steps: int, layers: int, every: int, seed: int = 0) -> int:
    """Write the run into ``logdir`` (its own directory); returns the number of scalar points."""
    rng = np.random.default_rng(seed)
    logger = TensorBoardLogger(str(logdir.parent), name=logdir.name, version="")
    log_scalars([logger], num_layers_scalar(layers), 0)
    points = 1
    for step in range(0, steps, every):
        scalars = snapshot(step, layers, rng)
        log_scalars([logger], scalars, step)
        points += len(scalars)
    logger.finalize("success")
    return points


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "logdir",
        type=Path,
        nargs="?",
        help="the run's directory (created); --smoke: a temporary one",
    )
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--every", type=int, default=10, help="steps between snapshots")
    args = smoke.parse_args(parser, argv, steps=50, layers=2)
    if args.logdir is None and not args.smoke:
        parser.error("the run's directory is required (or --smoke)")
    with tempfile.TemporaryDirectory() as scratch:
        logdir = args.logdir or Path(scratch) / "d2"
        start = time.perf_counter()
        points = write_long_run(logdir, steps=args.steps, layers=args.layers, every=args.every)
        took = time.perf_counter() - start
    print(f"wrote {points:,} scalar points to {logdir} in {took:.1f} s")


if __name__ == "__main__":
    main()
