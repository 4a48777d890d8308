"""Accuracy and speed of the default spectral metrics against float64 SVD and the best exact method.

For every shape of docs/metrics.md (One matrix: accuracy and speed) and every spectrum (Gaussian = flat, and sigma_i = i^(-a) for
a in {0.2, 0.5, 1.0}, built as U diag(s) V^T with random orthogonal U, V), prints:

* ``sr err %``: relative error of ``stable_rank`` against float64 ``torch.linalg.svdvals`` of W;
* ``alpha err``: ``alpha`` minus the truth (the constructed a; for Gaussian, minus the alpha of the
  float64 spectrum over the same window);
* ``method``: what ``method="auto"`` chose for the shape;
* ``ours ms`` (median of ``--repeats`` calls of ``spectral_metrics(W)`` with defaults) against
  ``best exact ms``, the fastest of ``svdvals(W)``, ``svdvals(W.T)`` and ``eigvalsh`` of the smaller
  Gram matrix (float32, like W), timed side by side in this process with the same threads;
* ``speedup`` = best exact / ours.

A second table shows warm starts: W plus 1 % relative Gaussian noise, started from the subspace
of W (the stopping rule then ends after the first block or two).

Run: ``.venv/bin/python benchmarks/svd_accuracy.py`` (a few minutes; ``--quick`` skips 4096x4096;
``--compare`` prints only the sigma_1 error of torch.svd_lowrank and subspace iteration beside ours).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import smoke
import torch

from spectral_callbacks.functional import powerlaw_alpha, randomized_svd, spectral_metrics
from spectral_callbacks.functional.method_choice import bf16_tiles, choose_method
from spectral_callbacks.functional.svd import DEFAULT_K, DEFAULT_N_OVERSAMPLES, default_n_iter

SHAPES = [(768, 768), (2304, 768), (3072, 768), (1024, 4096), (4096, 4096)]
SPECTRA = ["gaussian", 0.2, 0.5, 1.0]


def random_orthogonal(size: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """``(size, cols)`` orthonormal columns, Haar-distributed (QR of a Gaussian, sign-fixed)."""
    q, r = torch.linalg.qr(torch.randn(size, cols, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def build(
    shape: tuple[int, int], spectrum: str | float, generator: torch.Generator
) -> torch.Tensor:
    m, n = shape
    if spectrum == "gaussian":
        return torch.randn(m, n, generator=generator) / n**0.5
    r = min(m, n)
    s = torch.arange(1, r + 1, dtype=torch.float64).pow(-float(spectrum))
    U = random_orthogonal(m, r, generator)
    V = random_orthogonal(n, r, generator)
    return ((U * s) @ V.T).float()


def time_side_by_side(W: torch.Tensor, repeats: int) -> tuple[float, float, str]:
    """Median ms of the defaults and of the best exact method, timed in interleaved rounds.

    Interleaving puts the same background load (the machine is shared) on every contender.
    """
    small = W.T if W.shape[0] >= W.shape[1] else W  # (min, max): the Gram matrix is small @ small.T
    contenders: dict[str, Callable[[], object]] = {
        "ours": lambda: spectral_metrics(W),
        "eigvalsh(gram)": lambda: torch.linalg.eigvalsh(small @ small.T),
        "svdvals(W)": lambda: torch.linalg.svdvals(W),
        "svdvals(W.T)": lambda: torch.linalg.svdvals(W.T),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(repeats):
        for name, fn in contenders.items():
            # svdvals of a 4096x4096 takes tens of seconds: one round shows it loses.
            if round_ > 0 and name.startswith("svdvals") and W.numel() > 8_000_000:
                continue
            start = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - start))
    medians = {name: statistics.median(t) for name, t in times.items()}
    ours = medians.pop("ours")
    best = min(medians, key=medians.__getitem__)
    return ours, medians[best], best


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"512x128,1536x512"`` -> ``[(512, 128), (1536, 512)]`` (an ``argparse`` type)."""
    try:
        shapes = [tuple(int(side) for side in shape.split("x")) for shape in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated MxN, e.g. 512x128, got {text!r}"
        )
    return shapes  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="skip 4096x4096")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="e.g. 512x128,768x768")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare", action="store_true", help="only the sigma_1 error of other randomized methods"
    )
    args = smoke.parse_args(parser, argv, repeats=1, shapes=[(256, 128)])
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    shapes = [s for s in args.shapes if not ((args.quick or args.compare) and s == (4096, 4096))]
    if args.compare:
        compare_methods(shapes, generator)
        return

    header = (
        f"| {'shape':>9} | {'spectrum':>8} | {'sr err %':>8} | {'alpha err':>9} | {'method':>10} "
        f"| {'ours ms':>8} | {'best exact ms':>13} | {'best exact':>14} | {'speedup':>7} |"
    )
    print(f"threads={args.threads}, repeats={args.repeats} (median), k={DEFAULT_K}")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    warm_rows = []
    for shape in shapes:
        exact_ms, exact_name, ours = None, None, 0.0
        for spectrum in SPECTRA:
            W = build(shape, spectrum, generator)
            s64 = torch.linalg.svdvals(W.double())
            truth_sr = (W.double().square().sum() / s64[0] ** 2).item()
            out = spectral_metrics(W)
            sr_err = 100 * (out["stable_rank"].item() / truth_sr - 1)
            if spectrum == "gaussian":
                truth_alpha = powerlaw_alpha(s64[:DEFAULT_K])[0].item()
            else:
                truth_alpha = float(spectrum)
            alpha_err = out["alpha"].item() - truth_alpha
            if exact_ms is None:  # no method's cost depends on the spectrum: time once per shape
                ours, exact_ms, exact_name = time_side_by_side(W, args.repeats)
            width = min(DEFAULT_K + DEFAULT_N_OVERSAMPLES, *shape)
            method = choose_method(
                *shape, width, default_n_iter(*shape), torch.float32, "cpu", bf16_tiles(W.device)
            )
            print(
                f"| {shape[0]:>4}x{shape[1]:<4} | {spectrum!s:>8} | {sr_err:>+8.3f} | "
                f"{alpha_err:>+9.4f} | {method:>10} | {ours:>8.1f} | {exact_ms:>13.1f} | "
                f"{exact_name:>14} | {exact_ms / ours:>6.1f}x |",
                flush=True,
            )
            if spectrum in ("gaussian", 0.5):
                warm_rows.append(warm_start_row(W, s64, shape, spectrum, args.repeats))

    print("\nWarm start: W' = W + 1 % relative noise, init = V of the cold call on W")
    print(
        "| shape     | spectrum | cold sigma_1 err % | warm sigma_1 err % | warm alpha - cold "
        "| cold ms | warm ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in warm_rows:
        print(row)


def compare_methods(shapes: list[tuple[int, int]], generator: torch.Generator) -> None:
    """sigma_1 error on Gaussian matrices: torch.svd_lowrank vs subspace iteration vs block Krylov."""
    print("sigma_1 relative error % on Gaussian (flat) matrices, median of 3 draws")
    print(
        "| shape | svd_lowrank q=2 | subspace (HMT 4.4) b=40 q=6 | block Krylov b=40 q=6 (default) |"
    )
    print("|---|---|---|---|")
    for shape in shapes:
        errors: dict[str, list[float]] = {"lowrank": [], "subspace": [], "randomized": []}
        for _ in range(3):
            W = build(shape, "gaussian", generator)
            sigma_1 = torch.linalg.svdvals(W.double())[0].item()
            _, S, _ = torch.svd_lowrank(W, q=DEFAULT_K + DEFAULT_N_OVERSAMPLES, niter=2)
            errors["lowrank"].append(S[0].item() / sigma_1 - 1)
            for method in ("subspace", "randomized"):
                top = randomized_svd(W, method=method, generator=generator)
                errors[method].append(top.S[0].item() / sigma_1 - 1)
        cells = [f"{100 * statistics.median(e):+.3f}" for e in errors.values()]
        print(f"| {shape[0]}x{shape[1]} | " + " | ".join(cells) + " |", flush=True)


def warm_start_row(
    W: torch.Tensor, s64: torch.Tensor, shape: tuple[int, int], spectrum: object, repeats: int
) -> str:
    noise = torch.randn_like(W)
    W2 = W + 0.01 * noise * (W.norm() / noise.norm())
    s2 = torch.linalg.svdvals(W2.double())
    previous = randomized_svd(W, method="randomized")
    cold = randomized_svd(W2, method="randomized")
    warm = randomized_svd(W2, method="randomized", init=previous.V)
    cold_err = 100 * (cold.S[0].item() / s2[0].item() - 1)
    warm_err = 100 * (warm.S[0].item() / s2[0].item() - 1)
    alpha_diff = powerlaw_alpha(warm.S)[0].item() - powerlaw_alpha(cold.S)[0].item()
    cold_ms = median_ms(lambda: randomized_svd(W2, method="randomized"), repeats)
    warm_ms = median_ms(lambda: randomized_svd(W2, method="randomized", init=previous.V), repeats)
    return (
        f"| {shape[0]}x{shape[1]} | {spectrum} | {cold_err:+.3f} | {warm_err:+.3f} | "
        f"{alpha_diff:+.4f} | {cold_ms:.1f} | {warm_ms:.1f} |"
    )


if __name__ == "__main__":
    main()
