"""The first snapshots of a run, method calibration included, against the best exact method.

The callback's compute (``SpectrumCompute``, ``method="auto"``) times the randomized and the exact
Gram path against each other at a shape group's first cold and first warm snapshot (docs/metrics.md,
"Never slower than the best exact method"); that calibration is paid by the first two snapshots of
every run. For each model (shapes from its config, random weights moved like training,
``model_snapshot.py``'s stacks) a fresh ``SpectrumCompute`` is given the snapshots of one run in
order, every shape group of a snapshot in turn, as the engine hands them over:

* ``first``: snapshot 0 (cold; calibrates the cold calls);
* ``first warm``: snapshot 1 (warm-started from snapshot 0; calibrates the warm calls);
* ``steady``: the mean of snapshots 2 and 3 (warm, nothing calibrated);
* ``best exact``: per shape the fastest of ``svdvals(W)``, ``svdvals(W.T)`` and ``eigvalsh`` of
  the smaller Gram matrix (chosen on the group's first matrix), run on every matrix of snapshot 1.

A round is one run (a fresh compute) followed by the exact method; rounds are repeated in this
process and the medians printed with the ratios to the best exact time (the targets: ``first`` at
most 1.2, ``first warm`` at most 0.3). The first round also pays the process's own first calls
(thread pools, kernels), which a training run pays before its first snapshot; it is printed
apart. ``runs per matrix`` counts the matrices each calibration ran its candidates on.

Models: ``gpt2`` (GPT-2 small, 12 x 768: Q K V O 768x768, MLP 3072x768 and 768x3072) and
``qwen2-10x896`` (10 layers of Qwen2-0.5B's widths: Q O 896x896, K V 128x896 (GQA, 2 KV heads of
64), gate and up 4864x896, down 896x4864); ``toy`` (2 x 256) for a smoke test.

Run: ``.venv/bin/python benchmarks/first_snapshot.py --models gpt2 qwen2-10x896 --rounds 3``
(1 thread; about a minute a round on an idle core); ``--clock cpu`` times this thread's CPU
seconds instead of wall time (on a shared, loaded machine the wall time also counts the time other
processes held the core); ``--smoke``: the toy model, one round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import spectral_callbacks.functional.svd as svd_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_snapshot  # noqa: E402
import smoke  # noqa: E402
from model_snapshot import (  # noqa: E402
    CLOCKS,
    Group,
    add_snapshot_arguments,
    exact_candidates,
    merged,
    model_groups,
    movement,
    seconds,
)

from spectral_callbacks.monitor.engines.compute import SpectrumCompute  # noqa: E402
from spectral_callbacks.monitor.snapshot import ShapeGroup  # noqa: E402

MODELS = ("toy", "gpt2", "qwen2-10x896")
#: Snapshots of a run: the first, the first warm, then the steady state (their mean).
SNAPSHOTS = 4
TARGETS = {"first": 1.2, "first warm": 0.3}
COLUMNS = ("first", "first warm", "steady", "best exact")


def groups_of(name: str) -> list[Group]:
    """The watched shape groups of ``name``, batched by shape as the callback does."""
    if name != "qwen2-10x896":
        return merged(model_groups(name))
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=10,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    return merged(
        [
            Group("Q", (d, d), layers, 0),
            Group("O", (d, d), layers, layers),
            Group("K V", (kv, d), 2 * layers, 0),
            Group("gate up", (ffn, d), 2 * layers, 0),
            Group("down", (d, ffn), layers, layers),
        ]
    )


def run_of(
    group: Group, layers: int, trained: float, update: float, g: torch.Generator
) -> list[torch.Tensor]:
    """``SNAPSHOTS`` snapshots of a group's stack: GPT-2's init moved by ``trained`` (relative
    Frobenius), then by ``update`` per snapshot, the gradient directions rotating slowly."""
    m, n = group.shape
    std = torch.full((group.count, 1, 1), 0.02)
    std[group.count - group.residual :] /= (2 * layers) ** 0.5
    W = torch.randn(group.count, m, n, generator=g) * std
    norm = std * (m * n) ** 0.5  # (B, 1, 1)
    U = torch.randn(group.count, m, 4, generator=g)
    V = torch.randn(group.count, n, 4, generator=g)
    W += movement(W.shape, (U, V), trained * norm, g)
    snapshots = [W]
    for _ in range(SNAPSHOTS - 1):
        U = U + 0.5 * torch.randn(U.shape, generator=g)
        V = V + 0.5 * torch.randn(V.shape, generator=g)
        snapshots.append(snapshots[-1] + movement(W.shape, (U, V), update * norm, g))
    return snapshots


class CountingCompute(SpectrumCompute):
    """The callback's compute, counting the matrices each calibration ran its candidates on (the
    batch of every ``_top_svd`` call made while the calibration timed a candidate)."""

    def __init__(self) -> None:
        super().__init__()
        self.calibrated: list[int] = []  # one entry per timed candidate run: matrices it took
        measure = self.calibration.measure

        def counting(run: Callable[[str], object], method: str) -> tuple[float, object]:
            original = svd_module._top_svd

            def top_svd(A: torch.Tensor, *args: object, **kwargs: object) -> object:
                self.calibrated.append(A[..., 0, 0].numel())
                return original(A, *args, **kwargs)

            svd_module._top_svd = top_svd
            try:
                return measure(run, method)
            finally:
                svd_module._top_svd = original

        self.calibration.measure = counting


def one_round(
    runs: list[tuple[ShapeGroup, list[torch.Tensor]]],
    best: dict[str, Callable[[torch.Tensor], object]],
) -> tuple[dict[str, float], CountingCompute]:
    """One run of a fresh compute over the snapshots, then the best exact method."""
    compute = CountingCompute()
    per_snapshot = []
    for index in range(SNAPSHOTS):
        took = 0.0
        for group, stack in runs:
            took += seconds(lambda g=group, W=stack[index]: compute(g, W))
        per_snapshot.append(took)
    exact = sum(
        seconds(lambda g=group, s=stack: [best[g.key](W) for W in s[1]]) for group, stack in runs
    )
    times = {
        "first": per_snapshot[0],
        "first warm": per_snapshot[1],
        "steady": statistics.mean(per_snapshot[2:]),
        "best exact": exact,
    }
    return times, compute


def fastest_exact(stack: torch.Tensor) -> Callable[[torch.Tensor], object]:
    """The fastest exact method on the stack's first matrix (best of 2 runs each)."""
    candidates = exact_candidates(stack)
    took = {
        name: min(seconds(lambda f=fn: f(stack[0])) for _ in range(2))
        for name, fn in candidates.items()
    }
    return candidates[min(took, key=took.__getitem__)]


def run_model(name: str, args: argparse.Namespace, g: torch.Generator) -> list[str]:
    groups = groups_of(name)
    layers = max(group.residual for group in groups)
    runs = [
        (
            ShapeGroup(f"{group.shape[0]}x{group.shape[1]}/float32/cpu", ()),
            run_of(group, layers, args.trained, args.update, g),
        )
        for group in groups
    ]
    best = {group.key: fastest_exact(stack[1]) for group, stack in runs}
    rounds = []
    for index in range(args.rounds):
        times, compute = one_round(runs, best)
        rounds.append(times)
        ratios = ", ".join(f"{c} {times[c] / times['best exact']:.2f}" for c in COLUMNS[:3])
        chosen = sorted(set(compute.calibration.chosen.values()))
        print(
            f"  {name} round {index + 1}: "
            + ", ".join(f"{c} {times[c]:.3f} s" for c in COLUMNS)
            + f"; ratios {ratios}; chosen {'/'.join(chosen)}; candidate runs on "
            f"{compute.calibrated} matrices",
            flush=True,
        )
    median = {c: statistics.median(r[c] for r in rounds) for c in COLUMNS}
    ratio = {c: statistics.median(r[c] / r["best exact"] for r in rounds) for c in COLUMNS[:3]}
    count = sum(group.count for group in groups)
    shape = f"{len(groups)} groups, {count} matrices"
    cells = [f"{median[c]:.4g}" for c in COLUMNS]
    verdicts = [
        f"{ratio[c]:.2f}" + ("" if ratio[c] <= TARGETS.get(c, float("inf")) else " **over**")
        for c in COLUMNS[:3]
    ]
    return [f"| {name} ({shape}) | {args.rounds} | " + " | ".join(cells + verdicts) + " |"]


HEADER = (
    "| model | rounds | first s | first warm s | steady s | best exact s "
    "| first / exact | first warm / exact | steady / exact |"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["gpt2", "qwen2-10x896"])
    parser.add_argument("--rounds", type=int, default=3, help="runs per model (median)")
    add_snapshot_arguments(parser)
    args = smoke.parse_args(parser, argv, models=["toy"], rounds=1)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    model_snapshot.clock = CLOCKS[args.clock]  # what model_snapshot.seconds reads
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    print(
        f"threads={args.threads}, clock={args.clock}, rounds={args.rounds} (median), trained {args.trained}, update "
        f"{args.update} per snapshot (relative Frobenius)",
        flush=True,
    )
    rows = []
    for name in args.models:
        rows += run_model(name, args, g)
    table = [HEADER, "|" + "---|" * (HEADER.count("|") - 1), *rows]
    print("\n".join(table))
    return table


if __name__ == "__main__":
    main()
