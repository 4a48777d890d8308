"""Whole-model snapshot cost: every watched matrix of a transformer, cold and warm, against exact.

For each model (shapes from its Hugging Face config, random weights; nothing is downloaded) the
watched matrices are built as one stack per shape group, exactly as the callback batches them:

* ``gpt2``: GPT-2 small (12 x 768): Q, K, V, O 768x768, MLP_up 3072x768, MLP_down 768x3072;
* ``gpt2-medium``: GPT-2 medium (24 x 1024);
* ``tinyllama``: TinyLlama-1.1B shapes (22 x 2048, GQA with 4 KV heads of 64, gated MLP of 5632):
  Q, O 2048x2048, K, V 256x2048, gate and up 5632x2048, down 2048x5632;
* ``gpt-4x128``: the 4 x 128 GPT that benchmarks/overhead.py trains (Q, K, V, O 128x128, MLP_up
  512x128, MLP_down 128x512): what one snapshot of that run costs the worker;
* ``toy``: a 2 x 256 GPT-2 for a smoke test in seconds.

Weights start as GPT-2's init (normal, std 0.02; output projections scaled by 1/sqrt(2 L)) and are
then moved like a few dozen steps of training (synthetic, sized by ``--trained``): a coherent
low-rank part (what gradients add: spectral outliers) plus a random-walk part (Adam's noisy
steps), half of the Frobenius norm each. The next snapshot adds a further ``--update`` of the same
kind with the low-rank directions rotated, so a warm start faces real movement.

Columns, all timed in this process with the same threads (default 1), rounds interleaved:

* ``cold``: ``frobenius_norm_sq`` + ``randomized_svd`` (defaults) + ``metrics_from_spectrum`` per
  group, no ``init`` (the first snapshot);
* ``warm``: the same on the next snapshot with ``init`` = the previous call's ``V``;
* ``best exact``: per shape the fastest of ``svdvals(W)``, ``svdvals(W.T)`` and ``eigvalsh`` of
  the smaller Gram matrix (chosen on the first matrix of the group), run on every matrix;
* ``svd_lowrank``: ``torch.svd_lowrank(W, q=k + 8, niter=2)`` on each group;
* ``WeightWatcher``: ``analyze()`` on the same matrices as ``nn.Linear`` layers, only when
  ``weightwatcher`` is importable (it is never a dependency);
* ``floor flops``: the flops of the products ``randomized_svd`` made in the warm call, at the
  skinny-GEMM rate measured in this run; ``floor bytes``: one pass over the weights at the read
  bandwidth measured in this run.

Accuracy: for ``--check`` matrices per group, the stable rank and alpha of cold and warm against
float64 ``torch.linalg.svdvals``.

Run: ``.venv/bin/python benchmarks/model_snapshot.py --models gpt2 --repeats 3`` (about a minute
per round on an idle core); ``--models tinyllama --repeats 1`` takes ~10 GB and many minutes;
``--clock cpu`` times this thread's CPU seconds instead of wall time (on a shared, loaded machine
the wall time also counts the time other processes held the core); ``--smoke`` runs the toy model
once.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import smoke
import torch

import spectral_callbacks.functional.svd as svd_module
from spectral_callbacks.functional import (
    DEFAULT_K,
    frobenius_norm_sq,
    metrics_from_spectrum,
    powerlaw_alpha,
    randomized_svd,
)

MODELS = ("toy", "gpt-4x128", "gpt2", "gpt2-medium", "tinyllama")


@dataclass
class Group:
    """One shape group of a model: ``count`` matrices of ``shape``, the last ``residual`` of them
    output projections (GPT-2 scales their init by 1/sqrt(2 L))."""

    roles: str
    shape: tuple[int, int]
    count: int
    residual: int


def model_groups(name: str) -> list[Group]:
    """The watched shape groups of a model, from its transformers config."""
    from transformers import GPT2Config, LlamaConfig

    if name in ("toy", "gpt-4x128", "gpt2", "gpt2-medium"):
        config = {
            "toy": GPT2Config(n_embd=256, n_layer=2, n_head=4),
            "gpt-4x128": GPT2Config(n_embd=128, n_layer=4, n_head=4),
            "gpt2": GPT2Config(),
            "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
        }[name]
        d, layers = config.n_embd, config.n_layer
        inner = config.n_inner or 4 * d
        return [
            Group("Q K V", (d, d), 3 * layers, 0),
            Group("O", (d, d), layers, layers),
            Group("MLP_up", (inner, d), layers, 0),
            Group("MLP_down", (d, inner), layers, layers),
        ]
    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    return [
        Group("Q", (d, d), layers, 0),
        Group("O", (d, d), layers, layers),
        Group("K V", (kv, d), 2 * layers, 0),
        Group("gate up", (ffn, d), 2 * layers, 0),
        Group("down", (d, ffn), layers, layers),
    ]


def merged(groups: list[Group]) -> list[Group]:
    """Groups of equal shape computed as one batch, as the callback does (Q K V and O)."""
    out: dict[tuple[int, int], Group] = {}
    for group in groups:
        if group.shape in out:
            first = out[group.shape]
            out[group.shape] = Group(
                f"{first.roles} {group.roles}",
                group.shape,
                first.count + group.count,
                first.residual + group.residual,
            )
        else:
            out[group.shape] = group
    return list(out.values())


def movement(
    shape: tuple[int, ...],
    directions: tuple[torch.Tensor, torch.Tensor],
    size: torch.Tensor,
    g: torch.Generator,
) -> torch.Tensor:
    """A training-like update of Frobenius norm ``size`` (B, 1, 1) per matrix: half the sign pattern of a
    rank-4 gradient (coherent, as Adam's normalized steps), half random-walk noise."""
    U, V = directions
    coherent = torch.sign(U @ V.mT)  # (B, m, n)
    noise = torch.randn(shape, generator=g)
    per_matrix = (-2, -1)
    coherent *= (size / 2**0.5) / torch.linalg.vector_norm(coherent, dim=per_matrix, keepdim=True)
    noise *= (size / 2**0.5) / torch.linalg.vector_norm(noise, dim=per_matrix, keepdim=True)
    return coherent + noise


def build_snapshots(
    group: Group, layers: int, trained: float, update: float, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, next) snapshots of a group's stack: init, trained, then one more interval."""
    m, n = group.shape
    std = torch.full((group.count, 1, 1), 0.02)
    std[group.count - group.residual :] /= (2 * layers) ** 0.5
    W = torch.randn(group.count, m, n, generator=g) * std
    norm = std * (m * n) ** 0.5  # (B, 1, 1): movement relative to each matrix's init norm
    U = torch.randn(group.count, m, 4, generator=g)
    V = torch.randn(group.count, n, 4, generator=g)
    W += movement(W.shape, (U, V), trained * norm, g)
    # The next interval's gradient directions: rotated, not new.
    U2 = U + 0.5 * torch.randn(U.shape, generator=g)
    V2 = V + 0.5 * torch.randn(V.shape, generator=g)
    return W, W + movement(W.shape, (U2, V2), update * norm, g)


def snapshot_metrics(
    W: torch.Tensor, init: torch.Tensor | None
) -> tuple[dict, torch.Tensor | None]:
    """What the callback's default compute does for one group."""
    frobenius_sq = frobenius_norm_sq(W)
    top = randomized_svd(W, DEFAULT_K, init=init)
    return metrics_from_spectrum(top.S, frobenius_sq), top.V


def exact_candidates(W: torch.Tensor) -> dict[str, Callable[[torch.Tensor], object]]:
    def gram(A: torch.Tensor) -> object:
        small = A.mT if A.shape[0] >= A.shape[1] else A  # (min, max)
        return torch.linalg.eigvalsh(small @ small.mT)

    return {
        "eigvalsh(gram)": gram,
        "svdvals(W)": torch.linalg.svdvals,
        "svdvals(W.T)": lambda A: torch.linalg.svdvals(A.T),
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def seconds(fn: Callable[[], object]) -> float:
    start = clock()
    fn()
    return clock() - start


def count_flops(fn: Callable[[], object]) -> float:
    """Flops of every product ``randomized_svd`` made (through its ``_matmul``) while ``fn`` ran."""
    total = 0.0
    original = svd_module._matmul

    def counting(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        nonlocal total
        out = original(A, B)
        total += 2.0 * out.numel() * A.shape[-1]
        return out

    svd_module._matmul = counting
    try:
        fn()
    finally:
        svd_module._matmul = original
    return total


def measure_rates(W: torch.Tensor, g: torch.Generator) -> tuple[float, float]:
    """(skinny GEMM flop/s on this stack with a 40-column block, read bytes/s of the stack)."""
    X = torch.randn(W.shape[-1], DEFAULT_K + 8, generator=g)
    probe = W[: min(len(W), 8)]
    probe @ X
    gemm = min(seconds(lambda: probe @ X) for _ in range(3))
    W.sum()
    read = min(seconds(lambda: W.sum()) for _ in range(3))
    return 2.0 * probe.numel() * X.shape[-1] / gemm, W.numel() * W.element_size() / read


def weightwatcher_seconds(stacks: list[torch.Tensor]) -> float | None:
    if importlib.util.find_spec("weightwatcher") is None:
        return None
    import weightwatcher

    layers = []
    for stack in stacks:
        for W in stack:
            layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
            layer.weight.data = W.clone()
            layers.append(layer)
    model = torch.nn.Sequential(*layers)
    return seconds(lambda: weightwatcher.WeightWatcher(model=model).analyze())


def accuracy(W: torch.Tensor, metrics: dict, count: int) -> tuple[float, float]:
    """Worst |stable rank error| in % and |alpha error| over the first ``count`` matrices."""
    worst_sr = worst_alpha = 0.0
    for i in range(min(count, len(W))):
        singular = torch.linalg.svdvals(W[i].double())
        exact_sr = float((singular**2).sum() / singular[0] ** 2)
        exact_alpha = float(powerlaw_alpha(singular[:DEFAULT_K])[0])
        worst_sr = max(worst_sr, abs(100 * (float(metrics["stable_rank"][i]) / exact_sr - 1)))
        worst_alpha = max(worst_alpha, abs(float(metrics["alpha"][i]) - exact_alpha))
    return worst_sr, worst_alpha


def run_group(
    name: str, group: Group, layers: int, args: argparse.Namespace, g: torch.Generator
) -> dict:
    """Times and checks one shape group; returns its numbers (and its next snapshot)."""
    first, nxt = build_snapshots(group, layers, args.trained, args.update, g)
    cold_metrics, V = snapshot_metrics(first, None)
    warm_metrics, _ = snapshot_metrics(nxt, V)
    out: dict = {"moved": float((nxt - first).norm() / first.norm()), "next": nxt}
    out["cold_err"] = accuracy(first, cold_metrics, args.check)
    out["warm_err"] = accuracy(nxt, warm_metrics, args.check)
    candidates = exact_candidates(nxt)

    def time_exact(c: str) -> float:
        return min(seconds(lambda: candidates[c](nxt[0])) for _ in range(2))

    best = min(candidates, key=time_exact)
    columns: dict[str, Callable[[], object]] = {
        "cold": lambda: snapshot_metrics(first, None),
        "warm": lambda: snapshot_metrics(nxt, V),
        "exact": lambda: [candidates[best](W) for W in nxt],
        "lowrank": lambda: torch.svd_lowrank(nxt, q=DEFAULT_K + 8, niter=2),
    }
    # Interleaved rounds: the same background load on every column.
    out["times"] = {c: [] for c in columns}
    for _ in range(args.repeats):
        for c, fn in columns.items():
            out["times"][c].append(seconds(fn))
    out["flops_cold"] = count_flops(columns["cold"])
    out["flops_warm"] = count_flops(columns["warm"])
    gemm_rate, bandwidth = measure_rates(nxt, g)
    out["gemm_s"] = out["flops_warm"] / gemm_rate
    out["bytes_s"] = nxt.numel() * nxt.element_size() / bandwidth
    print(
        f"  {name} {group.roles} {group.count} x {group.shape[0]}x{group.shape[1]}: best exact "
        f"{best}, moved {100 * out['moved']:.1f} % between snapshots, warm "
        f"{out['flops_warm'] / nxt.numel():.0f} flops/entry (cold "
        f"{out['flops_cold'] / nxt.numel():.0f}), GEMM {gemm_rate / 1e9:.0f} GFLOP/s, read "
        f"{bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    return out


def run_model(name: str, args: argparse.Namespace, g: torch.Generator) -> list[str]:
    groups = merged(model_groups(name))
    layers = max(group.residual for group in model_groups(name))
    totals: dict[str, list[float]] = {
        c: [0.0] * args.repeats for c in ("cold", "warm", "exact", "lowrank")
    }
    floors = {"gemm_s": 0.0, "bytes_s": 0.0}
    worst = {"cold": [0.0, 0.0], "warm": [0.0, 0.0]}
    stacks_for_ww = []
    for group in groups:
        result = run_group(name, group, layers, args, g)
        for c, times in result["times"].items():
            totals[c] = [total + t for total, t in zip(totals[c], times, strict=True)]
        for key in floors:
            floors[key] += result[key]
        for label in worst:
            sr, alpha = result[f"{label}_err"]
            worst[label] = [max(worst[label][0], sr), max(worst[label][1], alpha)]
        if args.weightwatcher:
            stacks_for_ww.append(result["next"])
        del result
    ww = weightwatcher_seconds(stacks_for_ww) if args.weightwatcher else None
    med = {c: statistics.median(t) for c, t in totals.items()}
    spread = {c: (min(t), max(t)) for c, t in totals.items()}
    count = sum(group.count for group in groups)
    ww_cell = "not installed" if ww is None else f"{ww:.1f} s"
    if not args.weightwatcher:
        ww_cell = "not run"
    rows = [
        f"| {name} | {count} in {len(groups)} | {med['cold']:.3g} | {med['warm']:.3g} | "
        f"{med['exact']:.3g} | {med['lowrank']:.3g} | {ww_cell} | {floors['gemm_s']:.3g} | "
        f"{floors['bytes_s']:.3f} | {med['exact'] / med['cold']:.2f}x | "
        f"{med['exact'] / med['warm']:.2f}x | "
        f"{worst['cold'][0]:.2f} / {worst['warm'][0]:.2f} | "
        f"{worst['cold'][1]:.3f} / {worst['warm'][1]:.3f} |"
    ]
    if args.repeats > 1:
        ratios_cold = [e / c for e, c in zip(totals["exact"], totals["cold"], strict=True)]
        ratios_warm = [e / w for e, w in zip(totals["exact"], totals["warm"], strict=True)]
        rows.append(
            f"  {name} spread over {args.repeats} rounds: exact/cold {min(ratios_cold):.2f}-"
            f"{max(ratios_cold):.2f}x, exact/warm {min(ratios_warm):.2f}-{max(ratios_warm):.2f}x; "
            f"seconds min-max: cold {spread['cold'][0]:.3g}-{spread['cold'][1]:.3g}, warm "
            f"{spread['warm'][0]:.3g}-{spread['warm'][1]:.3g}, exact {spread['exact'][0]:.3g}-"
            f"{spread['exact'][1]:.3g}"
        )
    return rows


HEADER = (
    "| model | matrices in groups | ours cold s | ours warm s | best exact s | svd_lowrank s "
    "| WeightWatcher | floor flops s | floor bytes s | exact/cold | exact/warm "
    "| worst sr err % cold / warm | worst alpha err cold / warm |"
)


def add_snapshot_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run of synthetic snapshots (threads, movement, seed, clock), shared with
    ``first_snapshot.py``."""
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--trained", type=float, default=0.3, help="movement from init, relative Frobenius"
    )
    parser.add_argument(
        "--update", type=float, default=0.05, help="movement between snapshots, relative Frobenius"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall time, or this thread's CPU time (less sensitive to a loaded machine)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["gpt2"])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument(
        "--check", type=int, default=2, help="matrices per group checked against float64"
    )
    add_snapshot_arguments(parser)
    parser.add_argument(
        "--weightwatcher",
        action="store_true",
        help="also time WeightWatcher analyze() if installed",
    )
    args = smoke.parse_args(parser, argv, models=["toy"], repeats=1)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    global clock
    args = parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    print(
        f"threads={args.threads}, clock={args.clock}, repeats={args.repeats} (median), "
        f"k={DEFAULT_K}, trained "
        f"{args.trained}, update {args.update} (relative Frobenius)"
    )
    rows = []
    for name in args.models:
        rows += run_model(name, args, g)
    table = [
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *[r for r in rows if r.startswith("|")],
    ]
    print("\n".join(table))
    for row in rows:
        if not row.startswith("|"):
            print(row)
    return table


if __name__ == "__main__":
    main()
