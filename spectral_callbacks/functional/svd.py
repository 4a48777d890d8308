"""Top-k singular values of a weight matrix, fast: randomized block Krylov or an exact method.

``randomized_svd`` is the one entry point. It accepts ``(m, n)`` or batched ``(B, m, n)`` inputs of
any float dtype (bf16/fp16/fp32 are computed in float32, float64 in float64) and returns the top-k
singular values plus a right subspace that warm-starts the next call on a slightly changed matrix.

The randomized path is the randomized block Krylov method of Musco & Musco 2015 ("Randomized block
Krylov methods for stronger and faster approximate singular value decomposition", Algorithm 2): the
range finder of Halko, Martinsson & Tropp 2011 (Algorithm 4.4, subspace iteration) keeps only the
last block ``(W^T W)^q Omega``; block Krylov keeps every block ``Omega, (W^T W) Omega, ...`` and so
converges at the square root of the spectral gap. On a flat (freshly initialized) spectrum that
difference is what brings sigma_1 within 0.5 % at a third of the cost (benchmarks/svd_accuracy.py).
``W^T W`` is applied either as two skinny products with W or, when the smaller side is short enough
that forming the Gram matrix once is cheaper, as one product with the explicit Gram matrix. Either
way the singular values are read off ``W V`` (Rayleigh-Ritz on W itself, not on the Gram matrix),
so they carry W's own rounding, not its square.

The exact paths are ``eigvalsh`` of the smaller Gram matrix in float64 (exact for sigma_1 and every
singular value above ``sqrt(eps64) * sigma_1``) and ``svdvals`` of the tall orientation (LAPACK is
several times slower on the wide one). Which path runs is decided by shape with a calibrated flop
count (``_choose_method``), never by timing at run time, so the choice is deterministic.

Every path returns the same top-k: an exact path truncates its full spectrum to k, and singular
values below ``max(m, n) * eps * sigma_1`` (``eps`` of the compute dtype, the rank tolerance of
``torch.linalg.matrix_rank``) are reported as exactly 0, so a rank-deficient matrix reads the same
whichever method ran.
"""

from __future__ import annotations

from collections.abc import Callable
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
    "gram_singular_values",
    "randomized_svd",
]

# Why these defaults (measured by benchmarks/svd_accuracy.py, table in docs/metrics.md):
# k = 32 ranks span 1.5 decades of log i, enough for a stable power-law fit, while the cost of every
# product with W stays linear in the block size k + n_oversamples.
DEFAULT_K = 32
# A few extra columns: the Krylov space (block size x (n_iter + 1) columns) already oversamples.
DEFAULT_N_OVERSAMPLES = 8
# Krylov depth of a cold start, by the smaller side: the top gaps of a flat (Gaussian) spectrum
# shrink like n^(-2/3), so larger matrices need more. Measured worst sigma_1 miss on Gaussians:
# depth 5 up to a side of 1024, -0.15 % (depth 4: -0.8 %); depth 6 at 2048, ~-0.1 %; at 4096
# depth 6 missed by 0.3 %, depth 8 by 0.02 %. Stable rank's error is about twice sigma_1's.
DEFAULT_N_ITER = 6
DEFAULT_N_ITER_SMALL = 5
DEFAULT_N_ITER_LARGE = 8
_SMALL_SIDE = 1024
_LARGE_SIDE = 2048
# A warm start from the previous snapshot's subspace is already close; two blocks polish it.
DEFAULT_N_ITER_WARM = 2


def default_n_iter(m: int, n: int) -> int:
    """Krylov depth of a cold start on an ``m x n`` matrix (see the measurements above).

    >>> default_n_iter(3072, 768), default_n_iter(2048, 2048), default_n_iter(4096, 4096)
    (5, 6, 8)
    """
    small = min(m, n)
    if small <= _SMALL_SIDE:
        return DEFAULT_N_ITER_SMALL
    return DEFAULT_N_ITER if small <= _LARGE_SIDE else DEFAULT_N_ITER_LARGE


METHODS = ("auto", "randomized", "subspace", "gram", "svdvals")


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

    The randomized path (Musco & Musco 2015, Algorithm 2) builds an orthonormal basis :math:`Q` of
    the block Krylov space of :math:`W^\top W` from a Gaussian start
    :math:`\Omega \in \mathbb{R}^{n \times b}`, :math:`b = k + p`, keeps the top-b Ritz vectors
    :math:`V` and reads the singular values off the small matrix :math:`W V`:

    .. math::

        \mathcal{K} = [\Omega,\ (W^\top W)\,\Omega,\ \dots,\ (W^\top W)^q\,\Omega], \qquad
        \sigma_i(W V) \le \sigma_i(W).

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` matrix of any float dtype; views (``W.T``, slices) are fine.
        k: how many singular values to return (default 32); clamped to ``min(m, n)``.
        n_oversamples: extra block columns ``p`` (default 8); the block size is ``b = k + p``.
            More columns cost linearly more and converge faster on flat spectra.
        n_iter: Krylov depth ``q`` (power iterations for ``method="subspace"``). Default ``None``:
            5 for a cold start when the smaller side is at most 1024, 6 up to 2048, 8 beyond; 2 with ``init``.
            Each step costs one product with :math:`W^\top W`
            and buys accuracy.
        generator: random generator for the Gaussian start (default: torch's global one).
        init: ``(n, j)`` or ``(B, n, j)`` start subspace, normally ``.V`` of the previous call on
            the same matrix; columns beyond ``b`` are dropped, missing ones drawn at random.
        method: ``"auto"`` (default; chosen by shape, see the module docstring), ``"randomized"``
            (block Krylov), ``"subspace"`` (Halko, Martinsson & Tropp 2011, Algorithm 4.4, for
            comparison), ``"gram"`` (exact: float64 ``eigvalsh`` of the smaller Gram matrix) or
            ``"svdvals"`` (exact: ``torch.linalg.svdvals`` of the tall orientation).

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
    # A finite row sum proves its row finite, and costs a fraction of an entry-wise isfinite on a
    # large matrix; only a matrix whose sums say otherwise gets the exact entry-wise check.
    finite = torch.isfinite(A.sum(-1)).all(-1)  # (...,)
    all_finite = bool(finite.all())
    if not all_finite:
        finite = torch.isfinite(A).flatten(-2).all(-1)
        all_finite = bool(finite.all())
    if not all_finite:
        A = torch.where(finite[..., None, None], A, torch.zeros((), dtype=compute_dtype))

    k = min(k, m, n)
    width = min(k + n_oversamples, m, n)
    if n_iter is None:
        # A stale init (non-finite, from a matrix that was non-finite last time) is redrawn at
        # random in _start_block: that is a cold start and needs the cold depth.
        warm = init is not None and bool(torch.isfinite(init).all())
        n_iter = DEFAULT_N_ITER_WARM if warm else default_n_iter(m, n)
    chosen = _choose_method(m, n, width, n_iter, compute_dtype) if method == "auto" else method

    if chosen in ("randomized", "subspace"):
        S, V = _randomized(A, width, n_iter, generator, init, krylov=chosen == "randomized")
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


# Relative cost of one flop in each kind of kernel, in units of a large float32 matmul, calibrated on
# a 2-thread x86 CPU (torch 2.13, MKL): a big square product (the Gram matrix) runs near peak, skinny
# products and tall-skinny QR slower, eigvalsh memory bound (tridiagonal reduction). Float64 costs
# twice float32.
_COST_GEMM = 1.0
_COST_SKINNY = 2.5
_COST_QR = 7.5
_COST_EIGH = 14.0
# Exact is preferred when the block would cover this much of the smaller side anyway.
_EXACT_FRACTION = 0.5


def _choose_method(m: int, n: int, width: int, n_iter: int, dtype: torch.dtype) -> str:
    """The cheapest method for an ``m x n`` matrix by a flop count (deterministic, no timing)."""
    small, large = min(m, n), max(m, n)
    if width >= _EXACT_FRACTION * small:
        return "svdvals" if dtype == torch.float64 else "gram"
    randomized = min(_randomized_costs(m, n, width, n_iter, krylov=True))
    # Exact float64 Gram: product and eigvalsh both at float64 cost (2x).
    gram_exact = 2 * (2 * _COST_GEMM * small * small * large + _COST_EIGH * small**3)
    return "randomized" if randomized <= gram_exact else "gram"


def _randomized_costs(
    m: int, n: int, width: int, n_iter: int, *, krylov: bool
) -> tuple[float, float]:
    """Cost of the randomized path with products by W, and with an explicit Gram matrix."""
    small, large = min(m, n), max(m, n)
    applications = n_iter + 1 if krylov else n_iter
    # Orthogonalization in the smaller space: two QRs per step, plus (Krylov) two projections
    # against the growing basis.
    blocks = n_iter * (n_iter + 1) / 2 if krylov else 0
    ortho = small * width * width * (_COST_QR * 8 * n_iter + _COST_SKINNY * 8 * blocks)
    final = 2 * _COST_SKINNY * m * n * width  # W V
    by_products = applications * 4 * _COST_SKINNY * m * n * width + final + ortho
    gram = 2 * _COST_GEMM * small * small * large
    by_gram = gram + applications * 2 * _COST_SKINNY * small * small * width + final + ortho
    return by_products, by_gram


def _randomized(
    A: Tensor,
    width: int,
    n_iter: int,
    generator: torch.Generator | None,
    init: Tensor | None,
    *,
    krylov: bool,
) -> tuple[Tensor, Tensor]:
    """Block Krylov (or subspace iteration) + Rayleigh-Ritz on W itself; returns (S, V)."""
    m, n = A.shape[-2:]
    start = _start_block(A, width, generator, init)  # (..., n, b)
    by_products, by_gram = _randomized_costs(m, n, width, n_iter, krylov=krylov)
    # Iterate in the space of the smaller side when the Gram matrix is used, else on the right.
    wide = by_gram < by_products and m < n
    B = A.mT if wide else A  # iterate on the right space of B: (..., rows, d)
    if wide:
        start = A @ start  # (..., m, b): the left image of the right start
    if by_gram < by_products:
        G = B.mT @ B  # (..., d, d)

        def apply(X: Tensor) -> Tensor:
            return G @ X

    else:

        def apply(X: Tensor) -> Tensor:
            return B.mT @ (B @ X)

    basis = _block_krylov(apply, start, n_iter) if krylov else _subspace(apply, start, n_iter)
    # Rayleigh-Ritz on W itself: the singular values of the (rows, b) matrix B V.
    left, S, right_h = torch.linalg.svd(B @ basis, full_matrices=False)  # (..., rows, b), (..., b)
    # The right singular vectors of A: left ones of A^T U when wide, else the rotated basis.
    V = left if wide else basis @ right_h.mT  # (..., n, b)
    return S, V


def _block_krylov(apply: Callable[[Tensor], Tensor], start: Tensor, depth: int) -> Tensor:
    """Top-b Ritz vectors of the block Krylov space of ``apply`` (Musco & Musco 2015, Alg. 2)."""
    d, b = start.shape[-2:]
    blocks = [_orthonormalize(start)]  # Q_0
    images = []  # apply(Q_j), reused by the Rayleigh-Ritz step
    for _ in range(depth):
        room = d - sum(block.shape[-1] for block in blocks)
        if room <= 0:  # the space is all of R^d: Rayleigh-Ritz is now exact
            break
        image = apply(blocks[-1])
        images.append(image)
        # Q_{j+1}, trimmed so the basis never has more than d columns.
        blocks.append(_orthogonalize_against(image, torch.cat(blocks, -1))[..., :room])
    images.append(apply(blocks[-1]))
    basis = torch.cat(blocks, -1)  # (..., d, b (depth + 1))
    T = basis.mT @ torch.cat(images, -1)  # Rayleigh quotient of W^T W on the Krylov space
    _, vectors = torch.linalg.eigh((T + T.mT) / 2)  # ascending
    return basis @ vectors[..., -b:].flip(-1)  # (..., d, b) top-b Ritz vectors, descending


def _subspace(apply: Callable[[Tensor], Tensor], start: Tensor, n_iter: int) -> Tensor:
    """Subspace iteration: orth((W^T W)^q Omega), re-orthonormalized at every step."""
    V = _orthonormalize(start)
    for _ in range(n_iter):  # Halko, Martinsson & Tropp 2011, Algorithm 4.4
        V = _orthonormalize(apply(V))
    return V


def _orthogonalize_against(X: Tensor, basis: Tensor) -> Tensor:
    """Orthonormal columns spanning X minus its projection on ``basis`` (block CGS, done twice).

    The second pass also catches columns that the first left (nearly) zero, whose QR directions
    are arbitrary: they must still be orthogonal to ``basis`` for the Rayleigh quotient to hold.
    """
    X = _orthonormalize(X - basis @ (basis.mT @ X))
    return _orthonormalize(X - basis @ (basis.mT @ X))


def _start_block(
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
    # A stale subspace may hold NaN (from a matrix that was non-finite last time): draw those
    # columns afresh rather than start from zeros, whose QR directions are not random.
    stale = ~torch.isfinite(start).all(-2, keepdim=True)  # (..., 1, b)
    if bool(stale.any()):
        fresh = torch.randn(start.shape, dtype=A.dtype, device=A.device, generator=generator)
        start = torch.where(stale, fresh, start)
    return _orthonormalize(start)


def _orthonormalize(X: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``X`` (reduced Householder QR)."""
    return torch.linalg.qr(X).Q


def gram_singular_values(G: Tensor) -> Tensor:
    r"""Singular values of X, descending, from its Gram matrix :math:`G = X^\top X` (or :math:`X X^\top`).

    .. math:: \sigma_i(X) = \sqrt{\max(\lambda_i(G), 0)}

    Computed with ``eigvalsh`` in float64; rounding makes tiny eigenvalues slightly negative,
    hence the clamp.

    Args:
        G: ``(..., d, d)`` symmetric positive semi-definite matrix.

    Returns:
        ``(..., d)`` float64 singular values, descending.

    Example::

        >>> gram_singular_values(torch.diag(torch.tensor([4.0, 9.0, 1.0])))
        tensor([3., 2., 1.], dtype=torch.float64)
    """
    return torch.linalg.eigvalsh(G.to(torch.float64)).flip(-1).clamp_min(0).sqrt()


def _gram_eigvalsh(A: Tensor) -> Tensor:
    """All singular values, descending, from float64 ``eigvalsh`` of the smaller Gram matrix."""
    A64 = A.to(torch.float64)
    m, n = A.shape[-2:]
    G = A64.mT @ A64 if n <= m else A64 @ A64.mT  # (..., min, min)
    return gram_singular_values(G).to(A.dtype)


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
