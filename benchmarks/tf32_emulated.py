"""How TF32 products change randomized_svd's accuracy, with TF32 emulated on the CPU.

Every float32 matrix product rounds its operands to TF32 (10 mantissa bits), as cuBLAS does with
TF32 on (``tests/device_checks.py``); ``precision.matmul`` is told TF32 is on. Columns, the max
relative error of sigma_1..sigma_k against float64 ``svdvals``, one row per seed:

* float32: no TF32 at all (the reference accuracy);
* every product split: what the code does (3xTF32 for every float32 product of the SVD);
* only W split: the Krylov bookkeeping (projections, combinations) left in TF32;
* no split: TF32 everywhere.

Run::

    python benchmarks/tf32_emulated.py            # 1024 x 768, sigma_i = i^-0.5, k = 32, 5 seeds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import smoke  # noqa: E402

import spectral_callbacks.functional.krylov as krylov  # noqa: E402
import spectral_callbacks.functional.precision as precision  # noqa: E402
from spectral_callbacks.functional import randomized_svd  # noqa: E402


def decaying(m: int, n: int, a: float, seed: int) -> torch.Tensor:
    """``U diag(i^-a) V^T`` in float64 with random orthonormal U, V."""
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    return (U * torch.arange(1, r + 1, dtype=torch.float64).pow(-a)) @ V.mT


def worst_error(W: torch.Tensor, k: int, variant: str) -> float:
    from device_checks import _TF32Products

    exact = torch.linalg.svdvals(W.double())[:k]
    saved = precision.tf32_in_use, krylov.precision
    try:
        if variant == "float32":
            top = randomized_svd(W, k, method="randomized", n_iter=6)
        else:
            split = variant != "no split"
            precision.tf32_in_use = lambda X: split and X.dtype == torch.float32
            if variant == "only W split":  # the Krylov iteration's own products unsplit
                krylov.precision = SimpleNamespace(  # type: ignore[assignment]
                    matmul=lambda A, B: A @ B,
                    accumulate=lambda out, A, B, alpha, in_place: (
                        out.add_ if in_place else out.add
                    )(A @ B, alpha=alpha),
                )
            with _TF32Products():
                top = randomized_svd(W, k, method="randomized", n_iter=6)
    finally:
        precision.tf32_in_use, krylov.precision = saved
    return float(((top.S.double() - exact) / exact).abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(1024, 768))
    parser.add_argument("--decay", type=float, default=0.5)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=5)
    args = smoke.parse_args(parser, argv, shape=(128, 96), k=8, seeds=1)
    variants = ["float32", "every product split", "only W split", "no split"]
    print(f"{args.shape[0]}x{args.shape[1]}, sigma_i = i^-{args.decay}, top {args.k}, n_iter 6")
    print("| seed | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for seed in range(args.seeds):
        W = decaying(*args.shape, args.decay, seed).float()
        cells = [f"{worst_error(W, args.k, variant):.1e}" for variant in variants]
        print(f"| {seed} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
