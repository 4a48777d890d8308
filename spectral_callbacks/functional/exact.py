"""The exact paths of ``randomized_svd``: every singular value, from float64 ``eigvalsh`` of the
smaller Gram matrix or from ``svdvals`` of the tall orientation, non-finite matrices flagged; and
the path a matrix takes when its own raised a solver error (``exact_after_failure``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spectral_callbacks.functional.krylov import keep_finite, orthonormal_columns

#: Rows of W converted at a time where the Gram matrix is formed in a wider dtype than W's.
GRAM_CHUNK_ROWS = 256


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
    return from_gram_eigenvalues(torch.linalg.eigvalsh(G.to(torch.float64)))


def from_gram_eigenvalues(values: Tensor) -> Tensor:
    """Singular values, descending, from a Gram matrix's eigenvalues in ``eigh``'s ascending
    order: the square roots, tiny negative ones (rounding) read as 0."""
    return values.flip(-1).clamp_min(0).sqrt()


def gram_eigvalsh(
    A: Tensor,
    width: int | None = None,
    dtype: torch.dtype = torch.float64,
    exponent: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """All singular values, descending, from ``eigvalsh`` of the smaller Gram matrix in ``dtype``.

    Returns ``(S, finite, V)``: a matrix with a NaN/Inf entry is zeroed in its Gram matrix (LAPACK
    would fail for the whole batch) and flagged, without a host read on an accelerator. Every
    entry of A is in some column norm on G's diagonal, so that is where a NaN/Inf shows (and, in
    float32, an overflow of the squares). With ``exponent``, so is a Gram matrix whose largest
    diagonal entry (a squared column norm) lies outside ``2^(+-exponent)`` and is not 0: a float32
    Gram matrix that far from unit scale lost its small squares to underflow, and LAPACK's
    eigensolvers failed to converge on such (MKL, AMD EPYC); the caller redoes it in float64.
    With ``width``, ``V`` is the top-``width`` right singular subspace (``eigh``; about twice the
    time), else ``None``.

    In float64 every singular value above ``sqrt(eps64) * sigma_1`` is exact to float32. A float32
    Gram matrix squares W's rounding: sigma_i then carries a relative error of about
    ``5e-7 (sigma_1 / sigma_i)^2`` (measured at most 6e-5 at sigma_i = 0.01 sigma_1, sides 128 to
    768), and values below about ``5e-4 sigma_1`` are noise; ``randomized_svd`` uses it only where
    its top k are above 0.01 sigma_1.
    """
    m, n = A.shape[-2:]
    G = _gram(A, dtype)  # (..., min, min)
    finite, every = _usable(G, exponent)
    if not every:
        G = keep_finite(G, finite)
    if width is None:
        values = torch.linalg.eigvalsh(G)
        return _as(from_gram_eigenvalues(values), A.dtype), finite, None
    values, vectors = torch.linalg.eigh(G)  # ascending
    S = _as(from_gram_eigenvalues(values), A.dtype)
    top = vectors.flip(-1)[..., :width]
    if n > m:  # left singular vectors: the right ones are A^T u_i / sigma_i
        top = orthonormal_columns(keep_finite(A.mT @ top.to(A.dtype), finite))
    return S, finite, top.to(A.dtype)


def _usable(G: Tensor, exponent: int | None) -> tuple[Tensor, bool]:
    """``(...)`` bool: the Gram matrices whose diagonal is finite and, with ``exponent``, whose
    largest diagonal entry is 0 or within ``2^(+-exponent)``; and whether every one is known to
    be. On the CPU the usual batch is settled by one host read of its extremes (each small
    kernel is a sizeable part of a small matrix's call); a batch with a zero, non-finite or
    out-of-range matrix, and every batch elsewhere, by the masks.

    >>> _usable(torch.eye(2).expand(3, 2, 2), 100)
    (tensor([True, True, True]), True)
    >>> _usable(torch.stack([torch.eye(2), torch.zeros(2, 2), torch.eye(2) * 2.0**101]), 100)
    (tensor([ True,  True, False]), False)
    """
    largest = G.diagonal(dim1=-2, dim2=-1).amax(-1)  # (...,): NaN and Inf propagate
    low, high = (0.0, math.inf) if exponent is None else (2.0**-exponent, 2.0**exponent)
    if G.device.type == "cpu" and _within(largest, low, high):
        return torch.ones(largest.shape, dtype=torch.bool), True
    in_range = (largest >= low) & (largest <= high) if exponent is not None else True
    return torch.isfinite(largest) & ((largest == 0) | in_range), False


def _within(X: Tensor, low: float, high: float) -> bool:
    """Whether every entry of the CPU tensor ``X`` lies in ``[low, high]`` and is finite (NaN
    fails)."""
    least, most = _extremes(X)
    return low <= least and most <= high and most < math.inf


def _extremes(X: Tensor) -> tuple[float, float]:
    """The least and the largest entry of the CPU tensor ``X`` (NaN if it has one), read on the
    host: a single entry as it is."""
    if X.numel() == 1:
        value = X.item()
        return value, value
    least, most = X.aminmax()
    return least.item(), most.item()


def ends_clear(S: Tensor, k: int, least: float, smallest: float = 0.0) -> bool:
    """Whether every matrix of ``S`` (..., >= k), descending, on the CPU has ``sigma_1 > 0``,
    ``sigma_1 >= smallest`` and ``sigma_k > least * sigma_1``: then no mask or redo that depends
    on those ends has anything to do.

    A sufficient test on the batch's extremes (the least sigma_k against the largest sigma_1),
    read on the host whatever the batch's size: the usual batch passes it, and one that fails
    (a NaN fails) takes the per-matrix masks, which decide exactly.

    >>> ends_clear(torch.tensor([[4.0, 2.0, 1.0], [2.0, 1.0, 0.5]]), 3, 0.1)
    True
    >>> ends_clear(torch.tensor([[4.0, 2.0, 0.3], [2.0, 1.0, 0.5]]), 3, 0.1)
    False
    """
    if S.ndim == 1:  # one matrix: its top k in one read
        values = (S if S.shape[-1] == k else S[:k]).tolist()
        top_low = top_high = values[0]
        kth_low = values[-1]
    else:
        top_low, top_high = _extremes(S[..., 0])
        kth_low, _ = _extremes(S[..., k - 1])
    return top_low > 0 and smallest <= top_low and least * top_high < kth_low


def float32_gram_top(
    A: Tensor, k: int, exponent: int, least: float, smallest: float
) -> Tensor | None:
    """The top ``k`` singular values of each matrix of a float32 CPU batch, descending, from
    ``eigvalsh`` of its float32 Gram matrix; ``None`` where some matrix needs the checked path of
    :func:`gram_eigvalsh` (and its float64 redo).

    That is a matrix whose squared column norms are not finite, or not all within
    ``2^(+-exponent)`` (decided before LAPACK sees it, from the Gram matrix's trace: it lies
    between the largest of them and d times it), or whose values have ``sigma_1 < smallest`` or
    ``sigma_k <= least * sigma_1`` (after). Each test is one host read of the batch's extremes,
    and nothing else is done: on a small matrix (64 x 64) every extra kernel costs about as much
    as the product that forms the Gram matrix.

    >>> float32_gram_top(torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0])), 2, 100, 0.01, 0.0)
    tensor([4., 3.])
    >>> float32_gram_top(torch.diag(torch.tensor([4.0, 3.0, 0.0, 0.0])), 4, 100, 0.01, 0.0) is None
    True
    """
    G = _gram(A, A.dtype)  # (..., d, d)
    d = G.shape[-1]
    # (...,) ||W||_F^2 in float32: NaN and Inf propagate. Twice d: float32's rounding of the sum.
    total = G.trace() if G.ndim == 2 else G.diagonal(dim1=-2, dim2=-1).sum(-1)
    if not _within(total, 2 * d * 2.0**-exponent, 2.0**exponent):
        return None
    # The top k of the ascending eigenvalues, descending; a negative one (rounding, on a
    # rank-deficient matrix) reads as NaN and fails the test below.
    S = torch.linalg.eigvalsh(G)[..., -k:].flip(-1).sqrt()  # (..., k)
    return S if ends_clear(S, k, least, smallest) else None


def _as(X: Tensor, dtype: torch.dtype) -> Tensor:
    """``X`` in ``dtype``, without a call where it is there already (each costs microseconds)."""
    return X if X.dtype == dtype else X.to(dtype)


def _gram(A: Tensor, dtype: torch.dtype) -> Tensor:
    """The smaller Gram matrix of ``A`` in ``dtype``; a wider ``dtype`` converts ``A`` by chunks of
    ``GRAM_CHUNK_ROWS`` along its longer side, so no converted copy of the whole of ``A`` exists
    (the snapshot budget counts ``functional/memory.py``'s bound, not a float64 copy of W)."""
    tall = A.shape[-2] >= A.shape[-1]
    X = A if tall else A.mT  # (..., long, short): G = X^T X
    if dtype == A.dtype:
        return X.mT @ X
    G = torch.zeros((*X.shape[:-2], X.shape[-1], X.shape[-1]), dtype=dtype, device=A.device)
    for start in range(0, X.shape[-2], GRAM_CHUNK_ROWS):
        rows = X[..., start : start + GRAM_CHUNK_ROWS, :].to(dtype)  # (..., chunk, short)
        G += rows.mT @ rows
    return G


def svdvals_tall(A: Tensor) -> tuple[Tensor, Tensor]:
    """All singular values, descending, from ``svdvals`` of the tall orientation; ``(S, finite)``."""
    m, n = A.shape[-2:]
    finite = torch.isfinite(A).flatten(-2).all(-1)
    A = keep_finite(A, finite)
    return torch.linalg.svdvals(A if m >= n else A.mT), finite


def exact_after_failure(
    A: Tensor, width: int | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(S, finite, V)`` as :func:`gram_eigvalsh`, for a matrix whose own path raised a solver error
    (LAPACK's ``eigh`` or SVD failing to converge, as the Krylov iteration's Rayleigh-Ritz ``eigh``
    did on matrices far from unit scale with MKL on an AMD EPYC).

    First the float64 Gram matrix's ``eigh`` (float64 holds the squares of any float32 matrix); if
    that raises too, LAPACK's SVD of the float64 tall orientation, a different algorithm (a
    bidiagonal divide and conquer), which then also gives ``V``. Only its error propagates.
    """
    try:
        return gram_eigvalsh(A, width)
    except torch.linalg.LinAlgError:
        pass
    m, n = A.shape[-2:]
    finite = torch.isfinite(A).flatten(-2).all(-1)
    tall = keep_finite(A.to(torch.float64), finite)
    tall = tall if m >= n else tall.mT  # (..., long, short)
    if width is None:
        return torch.linalg.svdvals(tall).to(A.dtype), finite, None
    U, S, Vh = torch.linalg.svd(tall, full_matrices=False)
    V = Vh.mT if m >= n else U  # the right singular vectors of A, leading first
    return S.to(A.dtype), finite, V[..., :width].to(A.dtype)
