"""Which way ``randomized_svd`` computes a batch's top-k singular values: a calibrated flop count.

The method (randomized block Krylov, or an exact one) and, on the randomized path, the way W^T W
is applied (products with W, an explicit Gram matrix, or W rounded to bfloat16) are chosen by
these counts, deterministically. Costs are in flops of a large float32 matmul on the CPU they were
calibrated on; on other shapes and machines the count is only the prior of ``calibration.py``,
which times the methods where the callback runs.
"""

from __future__ import annotations

import functools

import torch

# Relative cost of one flop in each kind of kernel, in units of a large float32 matmul, calibrated on
# an x86 CPU (torch 2.13, MKL, 1-2 threads): a big square product (the Gram matrix) runs near peak,
# skinny products and tall-skinny QR slower. Float64 costs twice float32.
_COST_GEMM = 1.0
_COST_SKINNY = 2.3
_COST_QR = 7.5
# eigvalsh of a d x d matrix (tridiagonal reduction, memory bound) costs about
# _COST_EIGH d^3 + _COST_EIGH_SQUARE d^2: measured (1 thread, float32, thread CPU time against a
# 2048^3 GEMM) 9.9 d^3 at d = 256, 8.9 at 512, 6.1 at 768, 4.7 at 2048; a 128 x 128 Gram path
# about 0.5 ms. A cube alone priced a 512-side Gram path at twice its time, so the cold randomized
# path was chosen where the exact one was faster (1536 x 512: 24 ms against 21).
_COST_EIGH = 4.5
_COST_EIGH_SQUARE = 1400.0
# The stopping rule: an eigh of the Rayleigh quotient on the whole Krylov basis of s = (depth + 1) b
# columns per test (eigh with vectors: ~19 s^3 for s = 200-360), tested at the expected depth; a
# warm start (depth 1) passes there, a cold one usually needs one more test. Fitted with the flop
# counts above on cold calls of 16 shapes from 256^2 to 2048^2 (flat and sigma_i = i^-0.5, one
# thread: 37 s^3 for both tests; benchmarks/stateless_vs_exact.py prints the model's ratio beside
# the measured one): without it the cold path was priced at about half its time.
_COST_RAYLEIGH_RITZ = 18.5
# On a CPU with AMX tiles: a skinny product on bfloat16 operands (float32 accumulation) runs at
# about 3x the float32 rate, and rounding W to bfloat16 into fresh memory costs about as much as
# 190 float32 GEMM flops per entry (35 ms for 48 x 768 x 768, page faults included).
_COST_SKINNY_BF16 = 0.73
_COST_ROUND = 190.0
# The exact Gram path in float64 against float32 (the units above: measured 0.52-0.78 of float64's
# time for batches of 128 to 512 sides).
_COST_FLOAT64 = 2.0
# Exact is preferred when the block would cover this much of the smaller side anyway.
_EXACT_FRACTION = 0.5
# What one call of the randomized path costs beyond the exact one whatever the batch (Python and
# small kernels, ~1.5 ms on the CPU above): a batch of a few small matrices cannot make it back
# (measured, CPU ms: 4 x 512x128 warm 6.2 against exact 2.6 in float32; 16 x 128x128 warm 8.3
# against 8.6; 16 x 512x128 warm 12.3 against 9.9).
_COST_CALL = 2.0e8


@functools.lru_cache(maxsize=4096)  # bounded: a stateless caller may bring ever new shapes
def choose_method(
    m: int,
    n: int,
    width: int,
    n_iter: int,
    dtype: torch.dtype,
    device_type: str = "cpu",
    rounded: bool = False,
    batch: int = 1,
    first_test: int | None = None,
) -> str:
    """The cheapest method for a batch of ``m x n`` matrices by a flop count (deterministic, no
    timing; each answer is kept: the count costs about a 64 x 64 matrix's Gram product in
    Python, and the same few shapes come back at every call).

    The randomized path is priced at the expected depth ``n_iter`` by the cheaper way to apply
    W^T W there, with its stopping rule (and, with ``first_test``, a cold call's earlier test).
    The way a cold call takes is compared at its first test instead (:func:`route_depth`); on
    the shapes where that differs, measured at a flat matrix's full depth, it was no slower than
    the way priced here (see there), so the count fitted to the cheaper way stays the estimate.
    On an accelerator the float64 Gram path is never chosen: many GPUs run float64 at a small
    fraction of their float32 rate, and a float32 Gram matrix would square W's rounding.
    """
    small = min(m, n)
    if width >= _EXACT_FRACTION * small:
        return "svdvals" if dtype == torch.float64 or device_type != "cpu" else "gram"
    if device_type != "cpu":
        return "randomized"
    randomized = min(randomized_costs(m, n, width, n_iter, krylov=True, rounded=rounded).values())
    randomized += stopping_rule_cost(width, n_iter, first_test)
    return (
        "randomized"
        if batch * randomized + _COST_CALL <= batch * exact_cost(m, n, dtype)
        else "gram"
    )


def exact_cost(m: int, n: int, dtype: torch.dtype) -> float:
    """Cost of the exact Gram path on one ``m x n`` matrix: the product and eigvalsh in float64
    for float64 input, else (on the CPU, where this is reached) in float32 with float64 only
    where that cannot read the top k."""
    small, large = min(m, n), max(m, n)
    precision = _COST_FLOAT64 if dtype == torch.float64 else 1.0
    eigvalsh = _COST_EIGH * small**3 + _COST_EIGH_SQUARE * small**2
    return precision * (2 * _COST_GEMM * small * small * large + eigvalsh)


def stopping_rule_cost(width: int, n_iter: int, first_test: int | None = None) -> float:
    """Cost of the stopping rule's Rayleigh-Ritz on the basis of an expected depth ``n_iter``
    (``(n_iter + 1) width`` columns): a cold start's dominant term beside its products; plus,
    with ``first_test`` below ``n_iter``, the test there (what a flat spectrum pays for a cold
    call's early test)."""
    tests = 1 if n_iter <= 1 else 2
    cost = tests * _COST_RAYLEIGH_RITZ * ((n_iter + 1) * width) ** 3
    if first_test is not None and first_test < n_iter:
        cost += _COST_RAYLEIGH_RITZ * ((first_test + 1) * width) ** 3
    return cost


def route_depth(n_iter: int, first_test: int | None) -> int:
    """The depth at which the ways to apply W^T W (:func:`randomized_costs`) are compared:
    ``n_iter``, or ``first_test`` where the stopping rule may end the call that early (a cold
    call). A Gram matrix (or a rounded W) is made once, up front, and pays off only over the
    steps that follow, which a low-rank matrix never takes; by products a flat matrix, which
    goes to ``n_iter``, was no slower either. Measured cold, 1 thread, thread CPU ms, by
    products against by the Gram matrix: 3072 x 768 flat 62 against 67, sigma_i = 1/i 29
    against 55; 768 x 3072 flat 69 against 81, 1/i 38 against 56.

    >>> route_depth(5, 2), route_depth(1, None), route_depth(1, 2)
    (2, 1, 1)
    """
    return n_iter if first_test is None else min(n_iter, first_test)


def randomized_costs(
    m: int, n: int, width: int, n_iter: int, *, krylov: bool, rounded: bool = False
) -> dict[str, float]:
    """Cost of each way to apply W^T W: ``"products"`` with W, ``"gram"`` with an explicit Gram
    matrix, and (when ``rounded``) ``"rounded"``: products with W rounded to bfloat16."""
    small, large = min(m, n), max(m, n)
    applications = n_iter + 1  # each block Q_j is multiplied by W^T W once
    # Orthogonalization in the iterated space: two QRs per step, plus (Krylov) two projections
    # against the growing basis.
    blocks = n_iter * (n_iter + 1) / 2 if krylov else 0
    ortho = small * width * width * (_COST_QR * 8 * n_iter + _COST_SKINNY * 8 * blocks)
    # By products: W Q_j and W^T (W Q_j) per block; W V is a combination of the W Q_j already made.
    by_products = applications * 4 * _COST_SKINNY * m * n * width + ortho
    gram = 2 * _COST_GEMM * small * small * large
    final = 2 * _COST_SKINNY * m * n * width  # W V, to read the values off W itself
    by_gram = gram + applications * 2 * _COST_SKINNY * small * small * width + final + ortho
    costs = {"products": by_products, "gram": by_gram}
    if rounded:
        rounding = _COST_ROUND * m * n
        products = applications * 4 * _COST_SKINNY_BF16 * m * n * width
        costs["rounded"] = rounding + products + final + ortho
    return costs


@functools.cache
def bf16_tiles(device: torch.device) -> bool:
    """Whether ``device`` is a CPU that multiplies bfloat16 in matrix tiles (Intel AMX), several
    times its float32 rate; elsewhere bfloat16 products would be no faster, or emulated."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return device.type == "cpu" and is_amx is not None and bool(is_amx())
