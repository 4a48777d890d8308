"""The performance table: single shapes (stateless calls) and whole stacks (the callback's snapshots)
against the best exact method, in one process, one thread.

Per shape, ``stateless_vs_exact.shape_row``: a stateless ``spectral_metrics``/``randomized_svd`` call
against the fastest of ``svdvals(W)``, ``svdvals(W.T)`` and ``eigvalsh`` of the smaller Gram matrix,
with the error against float64.

Per stack (``first_snapshot.py``'s stacks: GPT-2 small 12 x 768 with Q K V O 768x768, MLP 3072x768
and 768x3072; 10 x 896 of Qwen2-0.5B's widths with Q O 896x896, K V 128x896, gate/up 4864x896,
down 896x4864), the callback's compute (``SpectrumCompute``, ``method="auto"``) given a run's
snapshots in order:

* ``exact``: the best exact method per shape group, on every matrix of the last snapshot;
* ``ours cold``: the first snapshot, its method calibration included;
* ``ours warm``: the steady warm snapshot (the last, warm-started from the one before; fastest of
  ``--repeats``, each from the same subspace);
* ``floor``: the GEMMs of one Krylov block on every matrix, ``W @ Omega`` as
  ``(Omega^T W^T)^T`` and ``W^T @ Y`` as ``(Y^T W)^T`` (the snapshot's own products), block size
  k + n_oversamples = 40 (what a warm snapshot cannot do without);
* the errors of sigma_1 and stable rank, cold and warm, against float64 ``svdvals`` (worst over
  ``--check`` matrices per group).

Between the two, ``stateless_vs_exact.analyze_row``: ``analyze_model`` of a GPT-2 small (12 x 768,
``--analyze-layers``) against the best exact method per shape group on every matrix.

Run: ``PYTHONPATH=. python benchmarks/performance_table.py`` (about ten minutes on an idle core);
``--smoke``: toy sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
import stateless_vs_exact  # noqa: E402
from first_snapshot import SNAPSHOTS, groups_of, run_of  # noqa: E402
from model_snapshot import exact_candidates  # noqa: E402

from spectral_callbacks.monitor.engines.compute import SpectrumCompute  # noqa: E402
from spectral_callbacks.monitor.snapshot import ShapeGroup  # noqa: E402

BLOCK = 40  # k + n_oversamples of the defaults


def seconds(fn: object) -> float:
    start = time.thread_time()
    fn()  # type: ignore[operator]
    return time.thread_time() - start


def errors(W: torch.Tensor, metrics: dict, count: int) -> tuple[float, float]:
    """Worst relative error of sigma_1 and stable rank over ``count`` matrices of a group."""
    worst_sigma = worst_rank = 0.0
    for i in range(0, len(W), max(1, len(W) // count)):
        exact = torch.linalg.svdvals(W[i].double())
        rank = float((exact**2).sum() / exact[0] ** 2)
        worst_sigma = max(
            worst_sigma, abs(float(metrics["spectral_norm"][i]) / float(exact[0]) - 1)
        )
        worst_rank = max(worst_rank, abs(float(metrics["stable_rank"][i]) / rank - 1))
    return worst_sigma, worst_rank


def stack_row(name: str, args: argparse.Namespace, g: torch.Generator) -> str:
    groups = groups_of(name)
    layers = max(group.residual for group in groups)
    runs = [
        (
            ShapeGroup(f"{group.shape[0]}x{group.shape[1]}/float32/cpu", ()),
            run_of(group, layers, 0.3, 0.05, g),
        )
        for group in groups
    ]
    compute = SpectrumCompute()
    cold = sum(seconds(lambda k=key, s=stack: compute(k, s[0])) for key, stack in runs)
    cold_metrics = [compute.__class__()(key, stack[0]) for key, stack in runs]
    for index in range(1, SNAPSHOTS - 1):
        for key, stack in runs:
            compute(key, stack[index])
    kept = dict(compute._subspaces)

    def warm() -> list[dict]:
        compute._subspaces = dict(kept)  # every round warm-starts from the same subspace
        return [compute(key, stack[-1]) for key, stack in runs]

    blocks = [torch.randn(s[-1].shape[0], s[-1].shape[-1], BLOCK, generator=g) for _, s in runs]

    def floor() -> None:
        for (_, stack), X in zip(runs, blocks, strict=True):
            Y = (X.mT @ stack[-1].mT).mT  # as the snapshot's first product is made
            _ = (Y.mT @ stack[-1]).mT

    best = []
    for _, stack in runs:
        candidates = exact_candidates(stack[-1])
        took = {
            c: min(seconds(lambda f=f, W=stack[-1][0]: f(W)) for _ in range(2))
            for c, f in candidates.items()
        }
        best.append(candidates[min(took, key=took.__getitem__)])

    def exact() -> None:
        for (_, stack), method in zip(runs, best, strict=True):
            for W in stack[-1]:
                method(W)

    times: dict[str, list[float]] = {"exact": [], "warm": [], "floor": []}
    for _ in range(args.repeats):
        for column, fn in (("exact", exact), ("warm", warm), ("floor", floor)):
            times[column].append(seconds(fn))
    t = {column: min(values) for column, values in times.items()}
    warm_metrics = warm()
    err_cold = [errors(s[0], m, args.check) for (_, s), m in zip(runs, cold_metrics, strict=True)]
    err_warm = [errors(s[-1], m, args.check) for (_, s), m in zip(runs, warm_metrics, strict=True)]
    count = sum(len(stack[0]) for _, stack in runs)
    mark = "" if t["exact"] / t["warm"] >= 10 else " **under 10**"
    return (
        f"| {name} ({count} matrices) | {t['exact']:.3f} | {cold:.3f} | {t['warm']:.3f} "
        f"| {t['exact'] / cold:.2f} | {t['exact'] / t['warm']:.2f}{mark} | {t['floor']:.3f} "
        f"| {t['exact'] / t['floor']:.2f} "
        f"| {max(e[0] for e in err_cold):.1e} / {max(e[0] for e in err_warm):.1e} "
        f"| {max(e[1] for e in err_cold):.1e} / {max(e[1] for e in err_warm):.1e} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stacks", nargs="*", default=["gpt2", "qwen2-10x896"])
    parser.add_argument(
        "--shapes", type=stateless_vs_exact.parse_shapes, default=stateless_vs_exact.SHAPES
    )
    parser.add_argument("--spectra", default=",".join(stateless_vs_exact.SPECTRA))
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the fastest counts")
    parser.add_argument("--check", type=int, default=4, help="matrices per group checked")
    parser.add_argument(
        "--analyze-layers",
        type=int,
        default=12,
        help="the analyze_model row's GPT-2 depth (0: no row)",
    )
    parser.add_argument("--analyze-width", type=int, default=768)
    args = smoke.parse_args(
        parser,
        argv,
        stacks=["toy"],
        shapes=[(64, 64), (128, 64)],
        repeats=1,
        analyze_layers=1,
        analyze_width=64,
    )
    torch.set_num_threads(1)
    stateless_vs_exact.CLOCK[0] = time.thread_time
    shape_args = argparse.Namespace(
        repeats=args.repeats, svdvals_max=2048 * 2048, check_max=4096 * 4096
    )
    g = torch.Generator().manual_seed(0)
    print(f"CPU, 1 thread, thread CPU time, load average {os.getloadavg()[0]:.1f} at the start\n")
    print("Single shapes, stateless calls (ms):\n")
    worst = stateless_vs_exact.print_shape_table(args.shapes, args.spectra, shape_args, g)
    print(f"\nworst stateless speedup {worst:.2f}")
    if args.analyze_layers:
        analyze_args = argparse.Namespace(
            layers=args.analyze_layers,
            width=args.analyze_width,
            repeats=args.repeats,
            svdvals_max=2048 * 2048,
        )
        print(stateless_vs_exact.analyze_row(analyze_args), flush=True)
    print("\nWhole stacks, the callback's snapshots (s):\n")
    print(
        "| stack | best exact s | ours cold s | ours warm s | exact/cold | exact/warm | floor s "
        "| exact/floor | err sigma_1 cold / warm | err stable rank cold / warm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.stacks:
        print(stack_row(name, args, g), flush=True)


if __name__ == "__main__":
    main()
