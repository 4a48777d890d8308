"""The default top-k SVD, calibrated on this machine, against the best exact method, per shape.

For every shape of ``svd_accuracy.py`` plus tall, wide and square ones from 128 to 4096, on a flat
(Gaussian) and a power-law (sigma_i = i^-0.5) spectrum: a :class:`MethodCalibration` is given the
first (cold) call and the first warm one, which time the randomized and the exact Gram path
against each other for each kind of call; then, over ``--repeats`` snapshots of the slowly moving
matrix, interleaved in this process with the same threads, the median ms per snapshot of

* ``default``: ``randomized_svd(W, init=..., calibration=...)`` (k = 32) as the monitor's compute
  runs it (warm-started from the last subspace it returned);
* ``model``: ``randomized_svd(W)`` cold, the flop count's choice alone (the prior);
* ``best exact``: the fastest of ``svdvals(W)``, ``svdvals(W.T)`` and ``eigvalsh`` of the smaller
  Gram matrix (float32, like W);

and ``ratio`` = default / best exact (the target: at most 1.05 at every shape).

Run: ``.venv/bin/python benchmarks/method_calibration.py`` (1 thread, median of 5; ``--quick``
leaves out 4096 x 4096, whose svdvals take minutes on one thread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from svd_accuracy import SHAPES, build, parse_shapes  # noqa: E402

from spectral_callbacks.functional import randomized_svd  # noqa: E402
from spectral_callbacks.functional.calibration import MethodCalibration  # noqa: E402

NEW_SHAPES = [
    (128, 128),
    (512, 128),
    (128, 512),
    (512, 512),
    (1536, 512),
    (512, 1536),
    (1024, 1024),
    (4096, 1024),
    (1024, 256),
    (2048, 2048),
    (4096, 512),
    (512, 4096),
]
SPECTRA = ["gaussian", 0.5]
TARGET = 1.05


def exact_contenders() -> dict[str, Callable[[torch.Tensor], object]]:
    def gram(W: torch.Tensor) -> torch.Tensor:
        small = W.mT if W.shape[-2] >= W.shape[-1] else W  # (min, max): the Gram matrix is small
        return torch.linalg.eigvalsh(small @ small.mT)

    return {
        "eigvalsh(gram)": gram,
        "svdvals(W)": torch.linalg.svdvals,
        "svdvals(W.T)": lambda W: torch.linalg.svdvals(W.mT),
    }


def measure(W: torch.Tensor, repeats: int) -> dict[str, object]:
    """One row: the calibration's choices, and the median ms of each contender per snapshot.

    The default is called as the monitor's compute calls it: a cold first call, then each later
    snapshot of the slowly moving matrix warm-started from the last subspace it returned
    (``SpectrumCompute`` keeps the last one). The matrix moves by about 1e-2 of its size between
    snapshots, as a training step moves a weight; every contender sees the same matrices.
    """
    calibration = MethodCalibration()
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(W.shape, generator=generator) * (1e-2 / max(W.shape[-2:]) ** 0.5)
    snapshots = [W + t * noise for t in range(repeats + 2)]
    subspace = None

    def default(snapshot: torch.Tensor) -> None:
        nonlocal subspace
        top = randomized_svd(snapshot, init=subspace, calibration=calibration)
        subspace = top.V if top.V is not None else subspace

    default(snapshots[0])  # the cold first snapshot calibrates the cold calls,
    default(snapshots[1])  # the first warm one the warm calls
    contenders = {
        "default": default,
        "model": lambda snapshot: randomized_svd(snapshot),
        **{name: fn for name, fn in exact_contenders().items()},
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders.items())
    for round_, snapshot in enumerate(snapshots[2:]):
        # Each contender in each place of the order in turn: whatever one call leaves behind
        # (the allocator's cache, the CPU's caches) falls on every contender alike.
        shift = round_ % len(order)
        for name, fn in order[shift:] + order[:shift]:
            # svdvals of a 4096 x 4096 takes minutes on one thread: one round shows it loses.
            if times[name] and name.startswith("svdvals") and W.numel() > 8_000_000:
                continue
            snapshot.sum()  # in cache for every contender alike, not only for those after the first
            start = time.perf_counter()
            fn(snapshot)
            times[name].append(1e3 * (time.perf_counter() - start))
    medians = {name: statistics.median(t) for name, t in times.items()}
    best_name = min(exact_contenders(), key=lambda name: medians[name])
    chosen = {warm: method for (*_, warm), method in calibration.chosen.items()}
    timed = {warm: seconds for (*_, warm), seconds in calibration.seconds.items()}
    return {
        "chosen": f"{chosen[False]} / {chosen.get(True, '-')}",
        "calibrated ms": {m: 1e3 * s for m, s in timed[False].items()},
        "default": medians["default"],
        "model": medians["model"],
        "best": medians[best_name],
        "best name": best_name,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="leave out 4096 x 4096")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="matrices per call, as a shape group of the monitor's snapshot (e.g. 16: 4 layers x Q, K, V, O)",
    )
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        help="comma-separated MxN, e.g. 512x128,1536x512 (default: all)",
    )
    args = smoke.parse_args(parser, argv, repeats=1, shapes=[(128, 64)])
    torch.set_num_threads(args.threads)
    if args.shapes:
        shapes = args.shapes
    else:
        shapes = list(dict.fromkeys([*SHAPES, *NEW_SHAPES]))
        shapes = [shape for shape in shapes if not (args.quick and shape == (4096, 4096))]
    generator = torch.Generator().manual_seed(0)
    print(
        f"CPU, {torch.get_num_threads()} thread(s), median of {args.repeats}, k = 32, float32, "
        f"{args.batch} matrix(es) per call, snapshots warm-started as the monitor runs them\n"
    )
    print(
        "| shape | spectrum | cold calibrated: randomized / gram ms | chosen cold / warm "
        "| default ms | model ms "
        "| best exact ms | best exact | ratio | model ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for shape in shapes:
        for spectrum in SPECTRA:
            W = torch.stack([build(shape, spectrum, generator) for _ in range(args.batch)])
            W = W[0] if args.batch == 1 else W
            row = measure(W, args.repeats)
            ratio = row["default"] / row["best"]  # type: ignore[operator]
            worst = max(worst, ratio)
            timed = row["calibrated ms"]
            assert isinstance(timed, dict)
            name = "flat" if spectrum == "gaussian" else f"i^-{spectrum}"
            print(
                f"| {shape[0]}x{shape[1]} | {name} | {timed['randomized']:.1f} / {timed['gram']:.1f} "
                f"| {row['chosen']} | {row['default']:.1f} | {row['model']:.1f} | {row['best']:.1f} "
                f"| {row['best name']} | {ratio:.2f}{' **over**' if ratio > TARGET else ''} "
                f"| {row['model'] / row['best']:.2f} |",  # type: ignore[operator]
                flush=True,
            )
    print(f"\nworst ratio {worst:.2f} (target <= {TARGET})")


if __name__ == "__main__":
    main()
