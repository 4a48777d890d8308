"""Top-k singular values of a weight matrix, fast: randomized subspace iteration or an exact method.

``randomized_svd`` is the one entry point. It accepts ``(m, n)`` or batched ``(B, m, n)`` inputs of
any float dtype (bf16/fp16/fp32 are computed in float32, float64 in float64) and returns the top-k
singular values plus a right subspace that warm-starts the next call on a slightly changed matrix.

The randomized path is the range finder with subspace (power) iteration of Halko, Martinsson &
Tropp 2011, "Finding structure with randomness", Algorithm 4.4, finished by a Rayleigh-Ritz step on
W itself. The power iteration applies ``W^T W`` either as two skinny products with W or, when the
smaller side is short enough that forming the Gram matrix once is cheaper than the products, as one
product with the explicit Gram matrix. Either way the final singular values come from ``W V`` (not
from the Gram matrix), so they carry W's own rounding, not its square.

The exact paths are ``eigvalsh`` of the smaller Gram matrix in float64 (exact for sigma_1 and every
singular value above ``sqrt(eps64) * sigma_1``) and ``svdvals`` of the tall orientation (LAPACK is
several times slower on the wide one). Which path runs is decided by shape with a flop count
(``_choose_method``), never by timing at run time, so the choice is deterministic.

Every path returns the same top-k: an exact path truncates its full spectrum to k, and singular
values below ``max(m, n) * eps * sigma_1`` (``eps`` of the compute dtype, the rank tolerance of
``torch.linalg.matrix_rank``) are reported as exactly 0, so a rank-deficient matrix reads the same
whichever method ran.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_K",
    "DEFAULT_N_ITER",
    "DEFAULT_N_ITER_WARM",
    "DEFAULT_N_OVERSAMPLES",
    "METHODS",
    "TopSVD",
    "randomized_svd",
]

# Why these defaults (measured by benchmarks/svd_accuracy.py, table in docs/metrics.md):
# k = 32 ranks span 1.5 decades of log i, enough for a stable power-law fit, while the cost of every
# product with W stays linear in k + n_oversamples.
DEFAULT_K = 32
# 32 extra columns: the Ritz values of the top 32 converge at the rate of sigma_64 / sigma_32, not
# sigma_33 / sigma_32, which is what makes a flat (freshly initialized) spectrum converge at all.
DEFAULT_N_OVERSAMPLES = 32
# Power iterations of a cold start: the flat Gaussian case needs ~8 to bring sigma_1 within 0.5 %.
DEFAULT_N_ITER = 8
# A warm start from the previous snapshot's subspace is already close; a few iterations polish it.
DEFAULT_N_ITER_WARM = 3

METHODS = ("auto", "randomized", "gram", "svdvals")


class TopSVD(NamedTuple):
    """Top-k singular values and the right subspace that found them.

    Attributes:
        S: ``(..., k)`` singular values in descending order, float32 (float64 for float64 input).
        V: ``(..., n, l)`` orthonormal approximate right singular vectors, ``l = k + n_oversamples``
            (clamped to ``min(m, n)``), ordered like ``S``; pass it back as ``init=`` to warm-start
            the next call on a slightly changed matrix. ``None`` when an exact method ran.
    """

    S: Tensor
    V: Tensor | None


def randomized_svd(
    W: Tensor,
    k: int = DEFAULT_K,
    *,
    n_oversamples: int = DEFAULT_N_OVERSAMPLES,
    n_iter: int | None = None,
    generator: torch.Generator | None = None,
    init: Tensor | None = None,
    method: str = "auto",
) -> TopSVD:
    r"""Top-k singular values of ``W`` (or of each matrix of a batch).

    The randomized path (Halko, Martinsson & Tropp 2011, Algorithm 4.4) builds an orthonormal basis
    :math:`V` of :math:`(W^\top W)^q \Omega` with a Gaussian :math:`\Omega \in \mathbb{R}^{n \times l}`,
    :math:`l = k + p`, re-orthonormalizing after every product, then reads the singular values off
    the small matrix :math:`W V`:

    .. math::

        \sigma_i(W V) \le \sigma_i(W), \qquad
        \sigma_i(W V) \to \sigma_i(W) \text{ at the rate } (\sigma_{l+1} / \sigma_i)^{2q+1}.

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` matrix of any float dtype; views (``W.T``, slices) are fine.
        k: how many singular values to return (default 32); clamped to ``min(m, n)``.
        n_oversamples: extra subspace columns ``p`` (default 32). More columns cost linearly more
            and converge faster on flat spectra.
        n_iter: power iterations ``q``. Default ``None``: 8 for a cold start, 3 with ``init``. More
            iterations cost one product with ``W^T W`` each and buy accuracy.
        generator: random generator for the Gaussian start (default: torch's global one).
        init: ``(n, j)`` or ``(B, n, j)`` start subspace, normally ``.V`` of the previous call on
            the same matrix; columns beyond ``l`` are dropped, missing ones drawn at random.
        method: ``"auto"`` (default; chosen by shape, see the module docstring), ``"randomized"``,
            ``"gram"`` (exact: float64 ``eigvalsh`` of the smaller Gram matrix) or ``"svdvals"``
            (exact: ``torch.linalg.svdvals`` of the tall orientation).

    Returns:
        ``TopSVD(S, V)``. A matrix with a NaN or Inf entry gets ``S`` all NaN (the rest of the batch
        is unaffected); a zero matrix gets ``S`` all 0.

    Raises:
        TypeError: ``W`` or ``init`` is not a floating-point tensor.
        ValueError: ``W`` is not 2-D or 3-D or has an empty side, ``k``/``n_oversamples``/
            ``n_iter`` are out of range, ``method`` is unknown, or ``init`` does not fit ``W``.

    Example::

        >>> W = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))
        >>> randomized_svd(W, 2).S
        tensor([4., 3.])
        >>> randomized_svd(torch.stack([W, 2 * W]), 1).S
        tensor([[4.],
                [8.]])
    """
    _check_matrix(W, "W")
    _check_int(k, "k", minimum=1)
    _check_int(n_oversamples, "n_oversamples", minimum=0)
    if n_iter is not None:
        _check_int(n_iter, "n_iter", minimum=0)
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}")
    m, n = W.shape[-2:]
    if init is not None:
        _check_init(init, W)

    compute_dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    A = W.to(compute_dtype)
    # A non-finite entry would make LAPACK fail for the whole batch: zero those matrices, run, and
    # report their spectrum as NaN.
    finite = torch.isfinite(A).flatten(-2).all(-1)  # (...,)
    all_finite = bool(finite.all())
    if not all_finite:
        A = torch.where(finite[..., None, None], A, torch.zeros((), dtype=compute_dtype))

    k = min(k, m, n)
    width = min(k + n_oversamples, m, n)
    if n_iter is None:
        n_iter = DEFAULT_N_ITER if init is None else DEFAULT_N_ITER_WARM
    chosen = _choose_method(m, n, width, n_iter, compute_dtype) if method == "auto" else method

    if chosen == "randomized":
        S, V = _randomized(A, width, n_iter, generator, init)
    elif chosen == "gram":
        S, V = _gram_eigvalsh(A), None
    else:
        S, V = _svdvals_tall(A), None
    S = S[..., :k]

    # Values below the rank tolerance are rounding noise whose size depends on the method; report
    # them as 0 so every method gives the same answer for a rank-deficient matrix.
    tol = max(m, n) * torch.finfo(compute_dtype).eps * S[..., :1]
    S = torch.where(tol < S, S, torch.zeros((), dtype=S.dtype))
    if not all_finite:
        S = torch.where(finite[..., None], S, torch.full((), float("nan"), dtype=S.dtype))
    return TopSVD(S, V)


# Relative cost of one flop in each kind of kernel, calibrated on a 2-thread CPU (fp32): a large
# square matmul (Gram) runs near peak; skinny products and QR of tall-skinny blocks run slower;
# eigvalsh/svdvals are memory bound (tridiagonal/bidiagonal reduction).
_COST_GEMM = 1.0
_COST_SKINNY = 1.5
_COST_QR = 6.0
_COST_EIGH = 40.0
_COST_SVD = 30.0
# Exact is preferred when the subspace would cover this much of the smaller side anyway.
_EXACT_FRACTION = 0.5


def _choose_method(m: int, n: int, width: int, n_iter: int, dtype: torch.dtype) -> str:
    """The cheapest method for an ``m x n`` matrix by a flop count (deterministic, no timing)."""
    small, large = min(m, n), max(m, n)
    if width >= _EXACT_FRACTION * small:
        return "svdvals" if dtype == torch.float64 else "gram"
    randomized = min(_randomized_costs(m, n, width, n_iter))
    gram_exact = 2 * _COST_GEMM * small * small * large * 2 + _COST_EIGH * small**3  # float64: x2
    return "randomized" if randomized <= gram_exact else "gram"


def _randomized_costs(m: int, n: int, width: int, n_iter: int) -> tuple[float, float]:
    """Cost of the randomized path with products by W, and with an explicit Gram matrix."""
    small, large = min(m, n), max(m, n)
    qr = _COST_QR * (large + small) * width * width
    by_products = (2 * n_iter + 1) * (2 * _COST_SKINNY * m * n * width) + n_iter * qr
    by_gram = (
        _COST_GEMM * small * small * large  # Gram (symmetric: half the flops of a general product)
        + n_iter * (2 * _COST_SKINNY * small * small * width + _COST_QR * small * width * width)
        + 2 * _COST_SKINNY * m * n * width  # the final W V
    )
    return by_products, by_gram


def _randomized(
    A: Tensor, width: int, n_iter: int, generator: torch.Generator | None, init: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Subspace iteration (HMT 2011 Alg. 4.4) + Rayleigh-Ritz on ``A V``; returns (S, V)."""
    m, n = A.shape[-2:]
    V = _start_subspace(A, width, generator, init)  # (..., n, l)
    by_products, by_gram = _randomized_costs(m, n, width, n_iter)
    if by_gram < by_products and n <= m:
        G = A.mT @ A  # (..., n, n)
        for _ in range(n_iter):  # HMT 2011 Alg. 4.4, the product W^T W applied through its Gram
            V = _orthonormalize(G @ V)
    elif by_gram < by_products:
        # Wide: iterate on the left side, where the Gram matrix is small, then map back.
        G = A @ A.mT  # (..., m, m)
        U = _orthonormalize(A @ V)  # (..., m, l)
        for _ in range(n_iter):
            U = _orthonormalize(G @ U)
        # Rayleigh-Ritz on A^T U: its singular values are those of U^T A, its left vectors live in
        # the right space of A.
        Vz, S, _ = torch.linalg.svd(A.mT @ U, full_matrices=False)  # (..., n, l), (..., l)
        return S, Vz
    else:
        for _ in range(n_iter):  # HMT 2011 Alg. 4.4: Q = orth(A V), V = orth(A^T Q), q times
            V = _orthonormalize(A.mT @ _orthonormalize(A @ V))
    # Rayleigh-Ritz on A V: singular values of the (m, l) matrix, rotated right vectors.
    _, S, Vh = torch.linalg.svd(A @ V, full_matrices=False)  # (..., l), (..., l, l)
    return S, V @ Vh.mT


def _start_subspace(
    A: Tensor, width: int, generator: torch.Generator | None, init: Tensor | None
) -> Tensor:
    """Orthonormal ``(..., n, l)`` start: ``init`` (trimmed or topped up at random) or Gaussian."""
    n = A.shape[-1]
    batch = A.shape[:-2]
    if init is None:
        omega = torch.randn((*batch, n, width), dtype=A.dtype, device=A.device, generator=generator)
        return _orthonormalize(omega)
    start = init.to(dtype=A.dtype, device=A.device).expand(*batch, *init.shape[-2:])[..., :width]
    missing = width - start.shape[-1]
    if missing > 0:
        extra = torch.randn(
            (*batch, n, missing), dtype=A.dtype, device=A.device, generator=generator
        )
        start = torch.cat([start, extra], dim=-1)
    # A stale subspace may have lost rank (NaN from a skipped matrix, zero columns): replace by
    # random columns where it is not finite.
    start = torch.where(torch.isfinite(start), start, torch.zeros((), dtype=A.dtype))
    return _orthonormalize(start)


def _orthonormalize(X: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``X`` (reduced Householder QR)."""
    return torch.linalg.qr(X).Q


def _gram_eigvalsh(A: Tensor) -> Tensor:
    """All singular values, descending, from float64 ``eigvalsh`` of the smaller Gram matrix."""
    A64 = A.to(torch.float64)
    m, n = A.shape[-2:]
    G = A64.mT @ A64 if n <= m else A64 @ A64.mT  # (..., min, min)
    eigenvalues = torch.linalg.eigvalsh(G).flip(-1).clamp_min(0)
    return eigenvalues.sqrt().to(A.dtype)


def _svdvals_tall(A: Tensor) -> Tensor:
    """All singular values, descending, from ``svdvals`` of the tall orientation."""
    m, n = A.shape[-2:]
    return torch.linalg.svdvals(A if m >= n else A.mT)


def _check_matrix(W: object, name: str) -> None:
    if not isinstance(W, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(W).__name__}")
    if not W.is_floating_point():
        raise TypeError(
            f"`{name}` must have a floating-point dtype, got {W.dtype}; convert it with "
            f"`{name}.float()`"
        )
    if W.ndim not in (2, 3):
        raise ValueError(
            f"`{name}` must be a 2-D (m, n) matrix or a 3-D (B, m, n) batch, got shape "
            f"{tuple(W.shape)}; reshape it, e.g. `{name}.flatten(1)` for a conv kernel"
        )
    if W.numel() == 0:
        raise ValueError(f"`{name}` must have no empty dimension, got shape {tuple(W.shape)}")


def _check_int(value: object, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")


def _check_init(init: object, W: Tensor) -> None:
    if not isinstance(init, Tensor) or not init.is_floating_point():
        raise TypeError(f"`init` must be a floating-point torch.Tensor, got {init!r:.60}")
    n = W.shape[-1]
    batch = tuple(W.shape[:-2])
    ok = init.ndim in (2, 3) and init.shape[-2] == n and init.shape[-1] >= 1
    ok = ok and (init.ndim == 2 or tuple(init.shape[:-2]) == batch)
    if not ok:
        raise ValueError(
            f"`init` must have shape (n, j) or {(*batch, n, 'j')} to fit `W` of shape "
            f"{tuple(W.shape)}, got {tuple(init.shape)}; pass `.V` of the previous call on a "
            "matrix of the same shape, or None"
        )
