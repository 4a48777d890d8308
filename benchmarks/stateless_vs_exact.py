"""The stateless calls (no warm start, no calibration) against the best exact method, per shape.

What a user of the functional API, or ``spectral-callbacks analyze`` on a pretrained model, waits
for: ``spectral_metrics(W)`` and ``randomized_svd(W)`` called once on a matrix they have never
seen, the method picked by the flop count of ``functional/method_choice.py`` alone (nothing is
timed at run time). Per shape and spectrum, timed side by side in this process with the same
threads, the contenders interleaved and each one's fastest run kept (a shared machine preempts
single runs):

* ``best exact``: the fastest of ``eigvalsh`` of the smaller Gram matrix (float32, like W),
  ``svdvals(W)`` and ``svdvals(W.T)`` (the values only, no metric); ``svdvals`` is left out above
  ``--svdvals-max`` entries, where it loses by minutes on one thread;
* ``metrics``: ``spectral_metrics(W)`` (k = 32: the SVD, exact ``||W||_F^2``, every metric);
  ``svd``: ``randomized_svd(W)`` alone; ``speedup`` = best exact / ours (target >= 0.95, and >= 2
  on large low-rank matrices);
* ``floor``: the bare float32 Gram ``eigvalsh`` (nothing checked), its top 32 as singular
  values, and the metrics on them (``frobenius_norm_sq`` + ``metrics_from_spectrum``), timed as
  one call in the same rounds as the rest (timed alone, in a loop, the metrics' small kernels stay
  in cache and cost about half as much as after a decomposition); above 4M entries ``best exact``
  plus the metrics timed alone. Where per-call costs dominate (the smallest shapes) no choice of
  method can beat it; ``of floor`` = floor / ours;
* ``chosen``: the method the flop count picks; ``model exact/rand``: the flop count's exact /
  randomized cost ratio of a cold call, beside the ``measured`` ratio of the best exact time to
  ``randomized_svd(W, method="randomized")``'s (below 1: exact is faster; ``-`` where the block
  covers most of the matrix and the exact path is taken without a count);
* ``err sigma_1``, ``err sr``: the relative errors of ``spectral_metrics``' ``spectral_norm``
  and ``stable_rank`` against float64 (``svdvals`` of the float64 matrix; for ``lowrank``, the
  known spectrum of its factors).

Spectra: ``flat`` (Gaussian entries: the hard case for a randomized method) and ``lowrank``
(rank 256, sigma_i = 1 / i: a matrix whose energy sits in a few directions, where the
randomized path has room). With ``--analyze``, one more row: ``analyze_model`` of a GPT-2 small
(12 x 768, random init, ``transformers``' ``GPT2LMHeadModel``) against the best exact method run
on every matrix, each shape group batched as ``analyze_model`` batches it.

Times are this thread's CPU time with one thread (a loaded machine's wall time also counts the
time other processes held the core), wall time with several.

Run: ``.venv/bin/python benchmarks/stateless_vs_exact.py --analyze`` (1 thread; ``--threads 0``:
torch's default; ``--shapes 64x64,1536x512`` for some shapes).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from svd_accuracy import parse_shapes  # noqa: E402

from spectral_callbacks.functional import (  # noqa: E402
    frobenius_norm_sq,
    metrics_from_spectrum,
    randomized_svd,
    spectral_metrics,
)
from spectral_callbacks.functional.method_choice import (  # noqa: E402
    choose_method,
    exact_cost,
    randomized_costs,
    stopping_rule_cost,
)
from spectral_callbacks.functional.svd import _first_test, _sizes  # noqa: E402

SHAPES = [
    (64, 64),
    (128, 64),
    (128, 128),
    (256, 256),
    (512, 512),
    (768, 768),
    (1536, 512),
    (512, 1536),
    (768, 3072),
    (3072, 768),
    (1024, 1024),
    (2048, 2048),
    (3584, 3584),
    (8192, 8192),
]
SPECTRA = ("flat", "lowrank")
LOW_RANK = 256
TARGET = 0.95


def build(shape: tuple[int, int], spectrum: str, g: torch.Generator) -> tuple[torch.Tensor, object]:
    """``(W, truth)``: float32 W and what its float64 reference is computed from."""
    m, n = shape
    if spectrum == "flat":
        W = torch.randn(m, n, generator=g) / n**0.5
        return W, None
    r = min(LOW_RANK, m, n)
    A = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q
    B = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    sigma = 1.0 / torch.arange(1, r + 1, dtype=torch.float64)
    return ((A * sigma) @ B.T).float(), sigma


def reference(W: torch.Tensor, truth: object) -> tuple[float, float]:
    """float64 ``(sigma_1, stable rank)`` of the float32 matrix ``W``."""
    W64 = W.double()
    frobenius_sq = float(W64.square().sum())
    if isinstance(truth, torch.Tensor):  # the factors' spectrum; W's rounding moves it by ~1e-7
        sigma_1 = float(truth[0])
    else:
        sigma_1 = float(torch.linalg.svdvals(W64)[0])
    return sigma_1, frobenius_sq / sigma_1**2


def exact_contenders(W: torch.Tensor, svdvals_max: int) -> dict[str, Callable[[], object]]:
    small = W.mT if W.shape[-2] >= W.shape[-1] else W  # (min, max): the Gram matrix is small
    contenders: dict[str, Callable[[], object]] = {
        "eigvalsh(gram)": lambda: torch.linalg.eigvalsh(small @ small.mT)
    }
    if W.numel() <= svdvals_max:
        contenders["svdvals(W)"] = lambda: torch.linalg.svdvals(W)
        contenders["svdvals(W.T)"] = lambda: torch.linalg.svdvals(W.mT)
    return contenders


#: The clock: this thread's CPU time with one thread (on a shared, loaded machine wall time
#: also counts the time other processes held the core), wall time with several.
CLOCK: list[Callable[[], float]] = [time.thread_time]


def fastest(contenders: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each contender's fastest of ``repeats`` runs (ms), in rotating order per round."""
    best = {name: math.inf for name in contenders}
    order = list(contenders)
    clock = CLOCK[0]
    for round_ in range(repeats):
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            start = clock()
            contenders[name]()
            best[name] = min(best[name], 1e3 * (clock() - start))
    return best


#: Up to this many entries the floor is timed as one call in the same rounds as the others.
FLOOR_IN_ROUNDS = 4_000_000


def exact_then_metrics(W: torch.Tensor) -> dict[str, torch.Tensor]:
    """The floor of a stateless ``spectral_metrics`` call: the bare float32 Gram ``eigvalsh``
    (nothing checked), its top 32 as singular values, then the metrics on them."""
    small = W.mT if W.shape[-2] >= W.shape[-1] else W  # (min, max)
    top = torch.linalg.eigvalsh(small @ small.mT).flip(-1)[..., :32].clamp_min(0).sqrt()
    return metrics_from_spectrum(top, frobenius_norm_sq(W))


def model_ratio(m: int, n: int) -> float:
    """The flop count's exact / randomized cost of one cold call at a flat spectrum's depth
    (below 1: exact is cheaper)."""
    _, width, depth = _sizes(m, n, 32, 8, None, False)
    randomized = min(randomized_costs(m, n, width, depth, krylov=True).values())
    tests = stopping_rule_cost(width, depth, _first_test(None, False))
    return exact_cost(m, n, torch.float32) / (randomized + tests)


def repeats_for(W: torch.Tensor, repeats: int) -> int:
    """Fewer rounds for the large shapes, whose exact paths take seconds to minutes."""
    return (
        repeats if W.numel() <= 4_000_000 else max(1, min(repeats, 2 if W.numel() <= 16e6 else 1))
    )


def shape_row(
    shape: tuple[int, int], spectrum: str, args: argparse.Namespace, g: torch.Generator
) -> tuple[str, float]:
    m, n = shape
    W, truth = build(shape, spectrum, g)
    _, width, depth = _sizes(m, n, 32, 8, None, False)
    chosen = choose_method(m, n, width, depth, torch.float32, first_test=_first_test(None, False))
    exact = exact_contenders(W, args.svdvals_max)
    ours: dict[str, Callable[[], object]] = {
        "metrics": lambda: spectral_metrics(W),
        "svd": lambda: randomized_svd(W),
    }
    # The randomized path forced: the measured side of the model's ratio.
    paths: dict[str, Callable[[], object]] = {}
    if min(m, n) > 2 * width:  # else the block covers most of the matrix: exact, no choice
        paths = {"randomized": lambda: randomized_svd(W, method="randomized")}
    floor = {"floor": lambda: exact_then_metrics(W)} if W.numel() <= FLOOR_IN_ROUNDS else {}
    times = fastest({**exact, **ours, **paths, **floor}, repeats_for(W, args.repeats))
    best_name = min(exact, key=times.__getitem__)
    if not floor:  # the metrics alone beside a call of seconds: their share is below 0.1 %
        top = torch.linalg.eigvalsh(W.mT @ W if m >= n else W @ W.mT)
        top = top.flip(-1)[:32].clamp_min(0).sqrt()
        metric_cost = fastest(
            {"metrics": lambda: metrics_from_spectrum(top, frobenius_norm_sq(W))},
            repeats_for(W, args.repeats),
        )["metrics"]
        times["floor"] = times[best_name] + metric_cost
    out = spectral_metrics(W)
    sigma_1, stable_rank = reference(W, truth) if W.numel() <= args.check_max else (None, None)
    errors = "- | -"
    if sigma_1 is not None and stable_rank is not None:
        errors = (
            f"{abs(float(out['spectral_norm']) / sigma_1 - 1):.1e} "
            f"| {abs(float(out['stable_rank']) / stable_rank - 1):.1e}"
        )
    best = times[best_name]
    speedup = best / times["metrics"]
    measured = f"{best / times['randomized']:.2f}" if paths else "-"
    model = f"{model_ratio(m, n):.2f}" if paths else "-"
    mark = " **under**" if speedup < TARGET else ""
    line = (
        f"| {m}x{n} | {spectrum} | {best:.2f} | {best_name} | {times['floor']:.2f} "
        f"| {times['metrics']:.2f} | {speedup:.2f}{mark} | {times['floor'] / times['metrics']:.2f} "
        f"| {times['svd']:.2f} "
        f"| {best / times['svd']:.2f} | {chosen} | {model} | {measured} "
        f"| {errors} |"
    )
    return line, speedup


def analyze_row(args: argparse.Namespace) -> str:
    """``analyze_model`` of a GPT-2 small against the best exact method on every matrix."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    from spectral_callbacks.offline.analysis import analyze_model
    from spectral_callbacks.targets import find_targets

    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    snapshot = take_snapshot(group_by_shape(find_targets(model)), step=0)
    stacks = [stack.float() for stack in snapshot.tensors.values()]
    assert all(isinstance(stack, torch.Tensor) for stack in stacks), "GPT-2: dense matrices only"
    # The best exact method per shape group, chosen on the group's first matrix, then run on
    # every matrix as one batched call.
    exact_per_group = []
    for stack in stacks:
        contenders = exact_contenders(stack[0], args.svdvals_max)
        times = fastest(contenders, 2)
        best = min(contenders, key=times.__getitem__)
        exact_per_group.append(
            {
                "eigvalsh(gram)": lambda S=stack: torch.linalg.eigvalsh(
                    S.mT @ S if S.shape[-2] >= S.shape[-1] else S @ S.mT
                ),
                "svdvals(W)": lambda S=stack: torch.linalg.svdvals(S),
                "svdvals(W.T)": lambda S=stack: torch.linalg.svdvals(S.mT),
            }[best]
        )
    contenders: dict[str, Callable[[], object]] = {
        "exact": lambda: [run() for run in exact_per_group],
        "analyze": lambda: analyze_model(model),
    }
    times = fastest(contenders, args.repeats)
    count = sum(len(stack) for stack in stacks)
    shapes = ", ".join(f"{len(s)} x {s.shape[-2]}x{s.shape[-1]}" for s in stacks)
    speedup = times["exact"] / times["analyze"]
    return (
        f"\nanalyze_model, GPT-2 {args.layers} x {args.width} ({count} matrices: {shapes}): "
        f"best exact {times['exact']:.1f} ms, analyze {times['analyze']:.1f} ms, speedup "
        f"{speedup:.2f}{' **under**' if speedup < TARGET else ''}"
    )


def print_shape_table(
    shapes: list[tuple[int, int]], spectra: str, args: argparse.Namespace, g: torch.Generator
) -> float:
    """Print one row per shape of ``shapes`` and spectrum of ``spectra`` (comma-separated);
    the worst speedup."""
    print(
        "| shape | spectrum | best exact ms | best exact | floor ms | metrics ms | speedup "
        "| of floor | svd ms | svd speedup | chosen | model exact/rand | measured exact/rand "
        "| err sigma_1 | err stable rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = math.inf
    for shape in shapes:
        for spectrum in spectra.split(","):
            line, speedup = shape_row(shape, spectrum, args, g)
            worst = min(worst, speedup)
            print(line, flush=True)
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES)
    parser.add_argument("--spectra", default=",".join(SPECTRA))
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="0: torch's default")
    parser.add_argument("--svdvals-max", type=int, default=2048 * 2048)
    parser.add_argument(
        "--check-max", type=int, default=4096 * 4096, help="largest W checked against float64"
    )
    parser.add_argument("--analyze", action="store_true", help="add the analyze_model row")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    args = smoke.parse_args(
        parser, argv, shapes=[(64, 64), (128, 64)], repeats=1, analyze=True, layers=1, width=64
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    CLOCK[0] = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    clock = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    g = torch.Generator().manual_seed(0)
    print(
        f"CPU, {torch.get_num_threads()} thread(s), {clock}, fastest of {args.repeats} rounds "
        "(fewer above 4M entries), float32, k = 32, stateless calls\n"
    )
    worst = print_shape_table(args.shapes, args.spectra, args, g)
    print(f"\nworst speedup {worst:.2f} (target >= {TARGET})")
    if args.analyze:
        print(analyze_row(args), flush=True)


if __name__ == "__main__":
    main()
