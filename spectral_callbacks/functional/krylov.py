"""The block Krylov iteration that ``randomized_svd`` and ``sharded_randomized_svd`` share.

Everything here works on the right space of W through ``apply(X) = (W^T W) X`` (or its collective
form) and on small replicated blocks: the orthonormal start, block classical Gram-Schmidt, the
Rayleigh quotient grown block by block, and the a-posteriori stopping rule on the Ritz residuals
(``ritz_residuals``; calibration in svd.py and docs/metrics.md). How ``apply`` is made -
two skinny products with W, one with its Gram matrix, or an all-reduce over the ranks holding W's
rows - is the callers' business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

import spectral_callbacks.functional.precision as precision

__all__ = [
    "Basis",
    "Subspace",
    "block_krylov",
    "cholesky_qr",
    "column_norms",
    "combine",
    "keep_finite",
    "left_rayleigh_ritz",
    "orthogonalize_against",
    "orthonormalize",
    "project",
    "residual_excess",
    "ritz_residuals",
    "start_block",
    "subspace_iteration",
    "top_subspace",
]


class Subspace(NamedTuple):
    """What :func:`block_krylov` and :func:`subspace_iteration` found."""

    basis: Tensor | None
    """The top-b Ritz vectors ``X`` (..., d, b); None where ``start`` is given and nothing reads
    them (every matrix finite, on the CPU)."""
    images: Tensor | None
    """``apply(X)``, columns ~ ``sigma_i^2 x_i``; None where ``start`` is given."""
    left: Tensor | None
    """A matrix whose singular values are the Ritz values found: ``B X`` where ``apply`` makes
    the products with B; else None."""
    finite: Tensor
    """Which matrices are finite (...)."""
    start: Tensor | None = None
    """Orthonormal columns spanning the images (the next warm start), where the iteration formed
    them; else None (``orthonormal_columns(images)``)."""
    values: Tensor | None = None
    """The Ritz values (..., b), descending, in float64, where the iteration read them itself
    (the left Rayleigh-Ritz of a warm start's first block); ``left`` is then None."""


def block_krylov(
    apply: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    start: Tensor,
    k: int,
    depth: int,
    tol: float,
    *,
    first_check: int | None,
    finite: Tensor | None,
    rank_scale: int,
    forward: Callable[[Tensor], Tensor | None] | None = None,
    early_check: int | None = None,
) -> Subspace:
    """Top-b Ritz vectors of the block Krylov space of ``apply`` (Musco & Musco 2015, Alg. 2).

    With ``first_check`` set, the stopping rule is tested after every step from that one on (each
    test costs an ``eigh`` of the Rayleigh quotient, so a cold start skips the steps a flat
    spectrum needs anyway); with ``None`` the depth is fixed. With ``early_check`` (a cold
    start) it is also tested from that step on before ``first_check``, with sigma_1's bound a
    tenth as wide (``_EARLY_TOP_FRACTION``), for as long as the call comes close: a fast-decaying
    spectrum stops there, while a test that finds the call far from its bounds
    (``_EARLY_REACH``) ends the early tests and leaves the iteration as it was without them.
    With ``forward`` (``B X``; it returns None where
    ``apply``'s images are not ``B^T B X`` at B's own scale), a test after the first block that
    fails only on the top pair is taken again on the Rayleigh-Ritz of the left space
    ``B span(Q_0)`` (:func:`left_rayleigh_ritz`: free from the images, half a power step
    further), decided by one product ``B s_1`` and two more host reads. That first test reads
    every residual norm and the left Rayleigh-Ritz off one float64 Gram matrix of the first
    block's images (:func:`_first_block_gram`), not off (..., d, b) residual blocks.
    """
    d, b = start.shape[-2:]
    # The basis [Q_0, Q_1, ...], the images apply(Q_j) (the Rayleigh quotient and the next block)
    # and B Q_j (B X without one more product) stay lists of blocks, multiplied block by block:
    # no buffer to copy each block into, and no fresh pages to fault in (a 48 x 768 x 400
    # buffer costs more in page faults on this machine than the products it holds).
    blocks: list[Tensor] = []
    images: list[Tensor] = []
    lefts: list[Tensor] = []
    T: Tensor | None = None
    block, used = start, 0
    early_from = early_check  # None once an early test finds the call far from its bounds
    for step in range(depth + 1):
        width = block.shape[-1]
        image, left = apply(block)
        image = image.to(start.dtype)  # apply may compute in a lower precision
        blocks.append(block)
        used += width
        # A warm start's first test reads every residual norm, the left Rayleigh-Ritz and its
        # next start off two float64 Gram matrices of the first block (_first_block_grams), not
        # off (..., d, b) residual and Ritz image blocks.
        first = (
            step == 0
            and first_check == 0
            and forward is not None
            and left is not None
            and depth > 0
            and width < d
        )
        # Rayleigh quotient T = basis^T (W^T W) basis of the Krylov space, grown by its new block
        # column (T is symmetric: the new row is its transpose), not recomputed each step.
        if first:
            column64, G, P = _first_block_grams(block, image)
            column = column64.to(start.dtype)
        else:
            column = project(blocks, image)  # (..., used, width)
        if finite is None:  # a NaN/Inf of W (or a float32 overflow) shows in its first image,
            # on the diagonal of the block's own projection q^T W^T W q = ||W q||^2
            finite = torch.isfinite(column.diagonal(dim1=-2, dim2=-1)).all(-1)
        column = keep_finite(column, finite)  # what the projection of a zeroed image is
        images.append(keep_finite(image, finite))
        if left is not None:
            lefts.append(keep_finite(left, finite))
        if T is None:
            T = column
        else:
            T = torch.cat([torch.cat([T, column[..., :-width, :].mT], -2), column], -1)
        room = d - used
        last = (
            step == depth or room <= 0
        )  # at room 0 the space is all of R^d: Rayleigh-Ritz is exact
        check = first_check is not None and step >= first_check
        early = early_from is not None and early_from <= step and not check
        if last or check or early:
            # eigh reads only the lower triangle, which holds each column's transpose and the
            # new diagonal block's own lower half: no symmetrized copy of T (3 passes over it).
            theta, vectors = torch.linalg.eigh(keep_finite(column64, finite) if first else T)
            theta, vectors = (
                theta[..., -b:].flip(-1),
                vectors[..., -b:].flip(-1),
            )  # top-b, descending (float64 at a first test)
            if first:
                T64, G, P = (keep_finite(X, finite) for X in (column64, G, P))
                gram = _first_block_gram(T64, G, P, vectors, theta, k)
                theta64, theta, vectors = theta, theta.to(start.dtype), vectors.to(start.dtype)
            # The top-b Ritz vectors and their images: what the stopping rule tests, and what is
            # returned when it passes (formed once, not once for each); at a first test, the
            # images only where it goes on.
            ritz: Tensor | None = None if first else combine(blocks, vectors)
            ritz_images: Tensor | None = None if first else combine(images, vectors)
        # The next Krylov block and its projection on the basis (the Rayleigh quotient's new
        # column), unless the rule says what is missing.
        grow: Tensor = images[-1]
        projection: Tensor | None = column
        if (check or early) and not last:
            if first:
                excess = _excess(gram.residuals.to(theta.dtype), theta, k, tol, rank_scale)
            else:
                assert ritz is not None and ritz_images is not None
                residual = (
                    ritz_images[..., :k] - ritz[..., :k] * theta[..., None, :k]
                )  # (..., d, k)
                top_tol = _EARLY_TOP_FRACTION * tol if early else tol
                excess = residual_excess(residual, theta, k, tol, rank_scale, top_tol)
            # The stopping rule needs one host read per step (a sync on an accelerator; only a
            # few small kernels are queued behind it).
            if early:
                missing, worst = _failing(excess)
            else:
                missing = int((excess > 1).sum(-1).max())
            last = missing == 0
            if first:
                assert forward is not None
                decided = None
                if missing == 1:
                    decided = left_rayleigh_ritz(
                        forward,
                        lefts[0],
                        images[0],
                        vectors,
                        theta64,
                        gram.H,
                        tol,
                        rank_scale,
                        excess,
                    )
                values, next_start = (None, None) if decided is None else decided
                if values is not None and next_start is not None:
                    # The Ritz vectors stand in for the start of a non-finite matrix only.
                    if next_start.device.type != "cpu" or not bool(finite.all()):
                        ritz = combine(blocks, vectors)
                    return Subspace(ritz, None, None, finite, next_start, values)
                ritz, ritz_images = combine(blocks, vectors), combine(images, vectors)
                if values is not None:
                    return Subspace(ritz, ritz_images, None, finite, values=values)
                residual = ritz_images[..., :k] - ritz[..., :k] * theta[..., None, :k]
            if early and worst > _EARLY_REACH:
                # Far from its bounds (a flat spectrum): no more early tests, and the next
                # block is the whole Krylov block, so the iteration goes on as without them.
                early_from = None
            elif not last:
                # Only the pairs that failed need new directions: the next block is their
                # residuals (the worst `missing` of each matrix), not b new columns. A warm
                # start typically misses only sigma_1's tight bound, so it grows by one column,
                # not 40; Rayleigh-Ritz holds on any subspace, and the rule still decides at the
                # end.
                order = excess.argsort(-1, descending=True)[..., None, :missing]
                grow = residual.gather(-1, order.expand(*residual.shape[:-1], missing))
                projection = None
        if last:
            assert ritz is not None and ritz_images is not None
            left_vectors = combine(lefts, vectors) if lefts else None
            return Subspace(ritz, ritz_images, left_vectors, finite)
        # The next block, trimmed so the basis never has more than d columns.
        block = orthogonalize_against(grow, blocks, projection)[..., :room]
    raise AssertionError("unreachable: the last step returns")


# A cold call's early tests (before the expected depth of a flat spectrum). There sigma_1 is held
# to a tenth of its bound: by the rule's calibration (sigma_1's error at most 2.4x the fraction)
# sigma_1 within 2.4e-4 and stable rank within 5e-4 at tol = 1e-3, no less accurate than a flat
# matrix's expected depth gave (1.5e-4 to 6.5e-4 on 768^2 to 2048^2). The other pairs keep their
# bound. Measured worst excess at depth 2 (b = 40; 768^2, 768 x 3072, 1024^2, 2048^2):
# sigma_i = 1/i at most 1.1, i^-0.5 at most 4, i^-0.2 at most 2.8, Gaussian (flat) 150 or more
# (sigma_1's tightened bound; 19 on the others). Over _EARLY_REACH the call is far from its
# bounds: it tests no more before its expected depth.
_EARLY_TOP_FRACTION = 0.1
_EARLY_REACH = 10.0


def _failing(excess: Tensor) -> tuple[int, float]:
    """How many pairs the batch's most-failing matrix misses, and the largest excess
    (``excess`` (..., k)): one host read."""
    count = (excess > 1).sum(-1).amax().to(excess.dtype)
    missing, worst = torch.stack([count, excess.amax()]).tolist()
    return int(missing), worst


def _first_block_grams(Q: Tensor, Z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``Q^T Z``, ``Z^T Z`` and ``Q^T Q`` (..., b, b) in float64, for the first block ``Q`` and
    its images ``Z = apply(Q)``, a few matrices at a time through one pair of float64 buffers:
    a fresh float64 copy of each part costs more in page faults than the conversion itself (a
    4864 x 40 part: about 1.3 ms against 0.2 ms into a buffer already touched)."""
    b = Z.shape[-1]
    if Z.ndim < 3:
        Q64, Z64 = Q.to(torch.float64), Z.to(torch.float64)
        return Q64.mT @ Z64, Z64.mT @ Z64, Q64.mT @ Q64
    Qs, Zs = Q.expand_as(Z).reshape(-1, *Z.shape[-2:]), Z.reshape(-1, *Z.shape[-2:])
    step = min(Zs.shape[0], max(1, _GRAM64_BYTES // (Z.shape[-2] * b * 8)))
    Q_buffer = torch.empty(Qs[:step].shape, dtype=torch.float64, device=Z.device)
    # In Z's own layout (its images are often (Y^T W)^T, a transposed view): a straight copy.
    Z_buffer = torch.empty_like(Zs[:step], dtype=torch.float64)
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    for i in range(0, Zs.shape[0], step):
        count = min(step, Zs.shape[0] - i)
        Q64 = Q_buffer[:count].copy_(Qs[i : i + count])
        Z64 = Z_buffer[:count].copy_(Zs[i : i + count])
        parts.append((Q64.mT @ Z64, Z64.mT @ Z64, Q64.mT @ Q64))
    T, G, P = (torch.cat(part).reshape(*Z.shape[:-2], b, b) for part in zip(*parts, strict=True))
    return T, G, P


# The float64 parts of _first_block_grams: within a core's L2 cache.
_GRAM64_BYTES = 1 << 20


class _FirstBlockGram(NamedTuple):
    H: Tensor
    """``(Z x)^T (Z x)`` (..., b, b) in float64: the Gram matrix of the Ritz images."""
    residuals: Tensor
    """The top-k right residual norms ``||Z x_i - theta_i Q_0 x_i||`` (..., k), float64."""


def _first_block_gram(
    T: Tensor, G: Tensor, P: Tensor, vectors: Tensor, theta: Tensor, k: int
) -> _FirstBlockGram:
    """The first block's Ritz images' Gram matrix and the top-k residual norms read off it.

    With ``Z = apply(Q_0)``, ``T = Q_0^T Z``, ``G = Z^T Z``, ``P = Q_0^T Q_0`` and the Ritz
    pairs ``(theta_i, x_i)`` (all float64), the residual ``r_i = Z x_i - theta_i Q_0 x_i`` has
    ``||r_i||^2 = (x^T G x)_ii - 2 theta_i (x^T T x)_ii + theta_i^2 (x^T P x)_ii``: no (d, k)
    residual block, nor its norms, nor (for the left Rayleigh-Ritz and the values) the Ritz
    images and their Gram matrix. In float64 and with T and P themselves, not ``theta_i`` and
    1, because of the cancellation: float32's rounding, or T's asymmetry and P's distance from
    the identity at float32's rounding (a start counts as orthonormal within 1000 eps), would
    move ``||r_i||^2`` by up to ``eps32 theta_1 theta_i``, above the rounding floor of
    :func:`residual_excess` for a pair far below theta_1.
    """
    H = vectors.mT @ G @ vectors
    x, theta_k = vectors[..., :k], theta[..., :k]
    squares = (
        H.diagonal(dim1=-2, dim2=-1)[..., :k]
        - 2 * theta_k * (x * (T @ x)).sum(-2)
        + theta_k.square() * (x * (P @ x)).sum(-2)
    )
    return _FirstBlockGram(H, squares.clamp_min(0).sqrt())


def left_rayleigh_ritz(
    forward: Callable[[Tensor], Tensor | None],
    left: Tensor,
    images: Tensor,
    vectors: Tensor,
    theta: Tensor,
    H: Tensor,
    tol: float,
    rank_scale: int,
    excess: Tensor,
) -> tuple[Tensor, Tensor | None] | None:
    """The left Rayleigh-Ritz of the first block, when its top pair passes the stopping rule:
    its Ritz values (..., b), descending, in float64, and the
    orthonormal next start spanning the Ritz images (None where :func:`_orthonormal_images`
    cannot form it); else None.

    The first block's Rayleigh-Ritz on the right, ``Q_0^T B^T B Q_0 = x theta x^T``, also gives
    the left space ``span(B Q_0)`` its orthonormal basis ``U = B Q_0 x theta^{-1/2}`` and, free,
    ``B^T U = Z x theta^{-1/2}`` (``Z = B^T B Q_0``, ``images``), whose singular values are the
    Ritz values of ``B B^T`` there: lower bounds of ``sigma_i``, each one half power step past the
    first block's. They and its top right singular vector w come from its Gram matrix
    ``theta^{-1/2} H theta^{-1/2}`` (``H = (Z x)^T Z x`` in float64, :func:`_first_block_gram`).
    Its top pair ``(u_1, s_1 = B^T u_1)`` is tested by the rule of :func:`ritz_residuals` on
    ``B B^T``, whose residual ``B s_1 - ||s_1||^2 u_1`` costs one product with B (a warm start's
    ``sigma_1`` otherwise asks for a Krylov step: two). Taken only where every other pair passed
    on the right (``excess``, (..., k)) and ``theta_b >= _LEFT_LEAST theta_1``: ``theta^{-1/2}``
    multiplies the rounding of the small values by ``theta_1 / theta_i``.
    """
    if bool((excess[..., 1:] > 1).any()) or not bool(
        (theta[..., -1] >= _LEFT_LEAST * theta[..., 0]).all()
    ):
        return None
    theta64 = theta.to(torch.float64)
    scale = torch.where(theta64 > 0, theta64.rsqrt(), torch.zeros((), dtype=theta64.dtype))
    gram = scale[..., :, None] * H * scale[..., None, :]  # (B^T U)^T B^T U, float64
    values, axes = torch.linalg.eigh(gram)  # ascending
    # The top pair u_1 = U w, s_1 = B^T U w = Z x theta^{-1/2} w (a direction: float32 is enough).
    w = precision.matmul(vectors, (scale[..., :, None] * axes[..., -1:]).to(vectors.dtype))
    s = precision.matmul(images, w)  # (..., d, 1)
    product = forward(s)  # B B^T u_1, (..., rows, 1)
    if product is None:
        return None
    u = precision.matmul(left, w)
    value = s.square().sum(-2)  # ||s_1||^2 = u_1^T B B^T u_1, (..., 1)
    residual = product - u * value[..., None, :]
    if bool((residual_excess(residual, value, 1, tol, rank_scale) > 1).any()):
        return None
    # Singular values from the Gram matrix's eigenvalues (ascending); rounding's tiny negatives: 0.
    return values.flip(-1).clamp_min(0).sqrt(), _orthonormal_images(images, vectors, H)


def _orthonormal_images(images: Tensor, vectors: Tensor, H: Tensor) -> Tensor | None:
    """``orthonormal_columns(Z x)`` from the Gram matrix ``H = (Z x)^T Z x`` (float64): the
    columns' norms are its diagonal, their CholeskyQR factor its Cholesky factor, so the start
    is one product ``Z (x D^{-1} R^{-1})``; None where a column keeps less than half of its norm
    beyond the columns before it (then :func:`orthonormal_columns` decides, by Householder QR),
    or off the CPU, where that check is a host read."""
    if images.device.type != "cpu":
        return None
    norms = H.diagonal(dim1=-2, dim2=-1).sqrt()  # (..., b)
    if not bool((norms > 0).all()):
        return None
    L, info = torch.linalg.cholesky_ex(H / (norms[..., :, None] * norms[..., None, :]))
    if bool(info.any()) or not bool(L.diagonal(dim1=-2, dim2=-1).amin() >= 0.5):
        return None
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    inverse = torch.linalg.solve_triangular(L.mT, eye, upper=True)  # R^{-1}
    mix = vectors.to(torch.float64) @ (inverse / norms[..., :, None])
    return precision.matmul(images, mix.to(images.dtype))


# Where the smallest of the first block's Ritz values theta_b (~ sigma_b^2) is below this fraction
# of theta_1, theta^{-1/2} would scale float32 rounding (eps theta_1 in each) into B^T U's columns by
# more than eps / _LEFT_LEAST (~6e-5): the left Rayleigh-Ritz is then not taken.
_LEFT_LEAST = 1e-3


def ritz_residuals(
    basis: Basis,
    images: Basis,
    vectors: Tensor,
    theta: Tensor,
    k: int,
    tol: float,
    rank_scale: int,
) -> tuple[Tensor, Tensor]:
    """The stopping rule: the top-k residuals ``(..., d, k)`` and each pair's excess ``(..., k)``.

    A pair is converged when ``||r_1||^2 <= tol theta_1^2`` (the top pair) or
    ``||r_i||^2 <= 10 tol theta_i^2`` (i <= k): ``||r_i||^2 / theta_i^2`` is the fraction one more
    power step would add to ``theta_i``. The top pair decides stable rank and the spectral norm,
    so it gets the tight bound; the rest only move alpha's slope, which tolerates ten times more
    (see svd.DEFAULT_TOL). The excess is ``||r_i||^2 / (bound_i theta_i^2)``, so a matrix has
    converged when every excess is at most 1; a pair at the rounding floor has excess 0.

    Args:
        basis, images: ``(..., d, D)`` orthonormal basis and ``apply`` of it (or their blocks).
        vectors, theta: the top Ritz vectors (``(..., D, >= k)``, in the basis) and values.
        k: how many top pairs must converge.
        tol: the tolerance of the top pair.
        rank_scale: ``max(m, n)``, for the rounding floor of the residuals.
    """
    top = vectors[..., :k]  # (..., D, k)
    residual = combine(images, top) - combine(basis, top) * theta[..., None, :k]  # (..., d, k)
    return residual, residual_excess(residual, theta, k, tol, rank_scale)


def residual_excess(
    residual: Tensor,
    theta: Tensor,
    k: int,
    tol: float,
    rank_scale: int,
    top_tol: float | None = None,
) -> Tensor:
    """Each top-k pair's excess ``(..., k)`` over its bound (:func:`ritz_residuals`), from its
    residual ``(..., d, k)``; ``top_tol``: the top pair's bound (default ``tol``)."""
    return _excess(column_norms(residual), theta, k, tol, rank_scale, top_tol)


def _excess(
    r: Tensor, theta: Tensor, k: int, tol: float, rank_scale: int, top_tol: float | None = None
) -> Tensor:
    """Each top-k pair's excess (..., k) from its residual norm ``r`` (..., k)."""
    # residuals scale with theta ~ sigma^2
    theta_k = theta[..., :k]
    bound = torch.full_like(theta_k, 10 * tol)
    bound[..., 0] = tol if top_tol is None else top_tol
    # A residual at the rounding level of theta_1 cannot shrink further (rank-deficient or zero
    # matrices, steep spectra): that pair is as converged as float arithmetic allows.
    floor = rank_scale * torch.finfo(theta.dtype).eps * theta[..., :1]
    # (r / theta)^2, not r^2 / theta^2: theta^2 ~ sigma^4 leaves float32's range for sigma above
    # ~4e9, where the quotient read 0 and a warm start stopped with sigma_1 16 % short.
    excess = (r / theta_k).square() / bound
    excess = torch.where(r <= floor, torch.zeros((), dtype=r.dtype, device=r.device), excess)
    return torch.nan_to_num(excess, nan=0.0)


def subspace_iteration(
    apply: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    start: Tensor,
    n_iter: int,
    finite: Tensor | None,
) -> Subspace:
    """Subspace iteration: orth((W^T W)^q Omega), re-orthonormalized at every step; returns its
    Ritz vectors, their images and ``B X`` (as ``block_krylov``) and which matrices are finite."""
    V = start
    for _ in range(n_iter):  # Halko, Martinsson & Tropp 2011, Algorithm 4.4
        image, _ = apply(V)
        if finite is None:
            finite = torch.isfinite(image).flatten(-2).all(-1)
        V = orthonormalize(keep_finite(image, finite))
    image, left = apply(V)
    if finite is None:
        finite = torch.isfinite(image).flatten(-2).all(-1)
    image = keep_finite(image.to(start.dtype), finite)
    mm = precision.matmul
    vectors = torch.linalg.eigh(mm(V.mT, image)).eigenvectors.flip(-1)  # descending Ritz values
    left = None if left is None else mm(keep_finite(left, finite), vectors)
    return Subspace(mm(V, vectors), mm(image, vectors), left, finite)


def top_subspace(
    apply: Callable[[Tensor], tuple[Tensor, Tensor | None]],
    start: Tensor,
    k: int,
    depth: int,
    tol: float,
    *,
    krylov: bool,
    first_check: int | None,
    finite: Tensor | None,
    rank_scale: int,
    forward: Callable[[Tensor], Tensor | None] | None = None,
    early_check: int | None = None,
) -> Subspace:
    """:func:`block_krylov` (``krylov=True``) or :func:`subspace_iteration` (``depth`` steps,
    no stopping rule) on ``apply``: the one choice every caller of the two makes alike."""
    if krylov:
        return block_krylov(
            apply,
            start,
            k,
            depth,
            tol,
            first_check=first_check,
            finite=finite,
            rank_scale=rank_scale,
            forward=forward,
            early_check=early_check,
        )
    return subspace_iteration(apply, start, depth, finite)


Basis = Tensor | Sequence[Tensor]
"""An orthonormal ``(..., d, D)`` basis, whole or as its column blocks ``[Q_0, Q_1, ...]``."""


def _blocks(basis: Basis) -> Sequence[Tensor]:
    return [basis] if isinstance(basis, Tensor) else basis


def project(basis: Basis, X: Tensor) -> Tensor:
    """``basis^T X`` (..., D, c), block by block."""
    parts = [precision.matmul(Q.mT, X) for Q in _blocks(basis)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, -2)


def combine(basis: Basis, coefficients: Tensor) -> Tensor:
    """``basis @ coefficients`` (..., d, c), block by block, accumulated in place."""
    return _accumulate(None, basis, coefficients, 1.0)


def _minus_combination(
    X: Tensor, basis: Basis, coefficients: Tensor, *, in_place: bool = False
) -> Tensor:
    """``X - basis @ coefficients``, accumulated into one copy of X (no product to subtract), or
    into X itself ``in_place``."""
    return _accumulate(X, basis, coefficients, -1.0, in_place)


def _accumulate(
    X: Tensor | None, basis: Basis, coefficients: Tensor, alpha: float, in_place: bool = False
) -> Tensor:
    out, row = X, 0
    for Q in _blocks(basis):
        part = coefficients[..., row : row + Q.shape[-1], :]
        row += Q.shape[-1]
        if out is None:
            out = precision.matmul(Q, part)
        else:  # the first accumulation into X copies it, unless in_place
            out = precision.accumulate(out, Q, part, alpha, in_place=out is not X or in_place)
    assert out is not None and row > 0, "an empty basis"
    return out


def keep_finite(X: Tensor, finite: Tensor) -> Tensor:
    """``X`` (..., r, c) with the matrices that ``finite`` (...) flags as non-finite set to zero.

    On the CPU, where a host read costs nothing, the usual all-finite batch is returned as it is
    (no pass over X); on an accelerator the mask is applied without asking the host.
    """
    if X.device.type == "cpu" and bool(finite.all()):
        return X
    return torch.where(finite[..., None, None], X, torch.zeros((), dtype=X.dtype, device=X.device))


def orthogonalize_against(X: Tensor, basis: Basis, projection: Tensor | None = None) -> Tensor:
    """Orthonormal columns spanning X minus its projection on ``basis`` (block CGS, done twice).

    Twice is enough unless a direction of X lies (nearly) inside span(basis), as the blocks of
    a rank-deficient W do once its Krylov space has run out: what the projection leaves is
    rounding noise, which lies mostly along ``basis`` again, and QR normalizes it into columns
    that are not orthogonal to ``basis`` (sigma_1 read up to 2.4x too large at rank 60 of 768).
    Columns that still leak into ``basis`` after two passes restart from a fixed pseudo-random
    direction; Rayleigh-Ritz holds on any subspace. The leak allowed, 1000 eps, changes no
    Ritz value by more than that relative amount. The first pass of a block of at least 16
    columns orthonormalizes by CholeskyQR when every column keeps a hundredth of its norm beyond
    the basis and the columns before it (``_FIRST_PASS_LEAST``), else by Householder QR: a block
    that runs out of directions is exactly where Cholesky of its Gram matrix breaks down.
    ``projection`` is ``basis^T X`` when the caller has it already (a Krylov step's column of the
    Rayleigh quotient).
    """
    Q, orthogonal = _project_out_twice(X, basis, projection)
    if orthogonal:
        return Q
    leak = project(basis, Q).abs().amax(-2, keepdim=True)  # (..., 1, c)
    lost = ~(leak <= _rounding(Q.dtype))  # NaN counts as lost
    if Q.device.type != "cpu" or bool(lost.any()):  # the host read is free on the CPU only
        g = torch.Generator(Q.device).manual_seed(sum(B.shape[-1] for B in _blocks(basis)))
        fresh = torch.randn(Q.shape, dtype=Q.dtype, device=Q.device, generator=g)
        Q, _ = _project_out_twice(torch.where(lost, fresh, Q), basis)
    return Q


# The first pass need not be orthonormal to rounding, only span X's columns accurately: the second
# pass (CholeskyQR2) restores the orthogonality lost, about eps / least^2. A column that keeps at
# least a hundredth of its norm beyond the basis and the columns before it is far above rounding
# noise. Measured (the least kept per block): a cold GPT-2 small snapshot 0.14-0.61, every block
# CholeskyQR; sigma_i = i^-1 0.002-0.1 (3 of 5 blocks); a rank-60 matrix's blocks past its rank
# 2-3e-7 and i^-2's 1e-3-1e-5, all Householder as before.
_FIRST_PASS_LEAST = 1e-2
# Narrower blocks (a warm start's residual columns) are cheaper by Householder: at 48 x 768 x c,
# 40 against 269 us for one column, 567 against 744 for 8, 1684 against 1273 for 16.
_CHOLESKY_FIRST_PASS_WIDTH = 16


def _project_out_twice(
    X: Tensor, basis: Basis, projection: Tensor | None = None
) -> tuple[Tensor, bool]:
    """Two projections, each followed by an orthonormalization; and whether the result is
    known orthogonal to ``basis`` without measuring its leak.

    It is when the second pass keeps at least half of every column's norm beyond the columns
    before it (Kahan and Parlett's "twice is enough"): then what leaks into ``basis`` is rounding.
    The Cholesky factor of the block's Gram matrix tells, and orthonormalizes it (CholeskyQR: a
    third of a Householder QR at 768 x 40, exact to rounding at that condition). The check is a
    host read, free on the CPU only; elsewhere Householder, and the caller measures the leak.
    """
    if projection is None:
        projection = project(basis, X)
    X = _minus_combination(X, basis, projection)
    wide = X.shape[-1] >= _CHOLESKY_FIRST_PASS_WIDTH
    Q = cholesky_qr(X, _FIRST_PASS_LEAST, taken=projection) if wide else None
    X = orthonormalize(X) if Q is None else Q
    X = _minus_combination(X, basis, project(basis, X), in_place=True)  # X is ours: no copy
    Q = cholesky_qr(X)
    return (orthonormalize(X), False) if Q is None else (Q, True)


def cholesky_qr(X: Tensor, least: float = 0.5, taken: Tensor | None = None) -> Tensor | None:
    """Orthonormal basis of well-conditioned columns by CholeskyQR (a Gram matrix and a
    triangular solve: a third of a Householder QR at 768 x 40); ``None`` unless every column keeps
    at least the fraction ``least`` of its norm beyond the columns before it (the Cholesky
    factor's diagonal), and off the CPU, where that check would be a host read. The norm is 1
    (unit-norm columns), or with ``taken`` the norm the column had before a projection with these
    coefficients (``(..., D, c)`` on an orthonormal basis) was taken out of it.
    """
    if X.device.type != "cpu":
        return None
    G = precision.matmul(X.mT, X)
    L, info = torch.linalg.cholesky_ex(G)
    kept = L.diagonal(dim1=-2, dim2=-1)
    if taken is not None:  # Pythagoras: the norm before = what was taken out + what is left
        kept = kept / (G.diagonal(dim1=-2, dim2=-1) + taken.square().sum(-2)).sqrt()
    if bool(info.any()) or not bool(kept.amin() >= least):  # a zero column's NaN fails too
        return None
    # X R^-1 (R = L^T) as one GEMM with the small triangle's inverse: the solve on the (..., d, c)
    # block itself took 1.5-2x as long, and returned column-major blocks that every later
    # product with them read more slowly. R's condition is at most about 1 / least.
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return precision.matmul(X, torch.linalg.solve_triangular(L.mT, eye, upper=True))


def start_block(
    A: Tensor, width: int, generator: torch.Generator, init: Tensor | None, n: int | None = None
) -> Tensor:
    """Orthonormal ``(..., n, width)`` start: ``init`` (trimmed or topped up at random) or Gaussian.

    ``A`` gives the batch, dtype and device; ``n`` the side the iteration runs in (default
    ``A``'s last). Draws come from ``generator`` only.
    """
    n = A.shape[-1] if n is None else n
    batch = A.shape[:-2]
    if init is None:
        omega = torch.randn((*batch, n, width), dtype=A.dtype, device=A.device, generator=generator)
        return orthonormalize(omega)
    start = init.to(dtype=A.dtype, device=A.device).expand(*batch, *init.shape[-2:])[..., :width]
    missing = width - start.shape[-1]
    if missing > 0:
        extra = torch.randn(
            (*batch, n, missing), dtype=A.dtype, device=A.device, generator=generator
        )
        start = torch.cat([start, extra], dim=-1)
    # A stale subspace may hold NaN (from a matrix that was non-finite last time): those columns
    # are drawn afresh rather than started from zeros, whose QR directions are not random. A
    # column sum is NaN or Inf exactly when the column holds one (or overflows: drawn afresh too).
    # On an accelerator one block is drawn whether needed or not and selected per column, so no
    # host read decides it; on the CPU the read is free.
    stale = ~torch.isfinite(start.sum(-2, keepdim=True))  # (..., 1, b)
    if start.device.type == "cpu" and not bool(stale.any()):
        # The previous call's V is orthonormal already: a Gram check costs a third of its QR.
        defect = precision.matmul(start.mT, start) - torch.eye(
            start.shape[-1], dtype=A.dtype, device=A.device
        )
        if missing <= 0 and bool(defect.abs().amax() <= _rounding(A.dtype)):
            return start
        return orthonormalize(start)
    fresh = torch.randn(start.shape[-2:], dtype=A.dtype, device=A.device, generator=generator)
    return orthonormalize(torch.where(stale, fresh, start))


def _rounding(dtype: torch.dtype) -> float:
    """How far from orthonormal a basis may be and count as orthonormal: 1000 eps, which moves
    no Ritz value by more than that relative amount."""
    return 1e3 * torch.finfo(dtype).eps


def orthonormalize(X: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``X`` (reduced Householder QR)."""
    return torch.linalg.qr(X).Q


def orthonormal_columns(X: Tensor) -> Tensor:
    """An orthonormal basis of ``X``'s columns, leading first: the columns normalized, then
    CholeskyQR when they are well conditioned, else Householder QR."""
    X = X / column_norms(X)[..., None, :].clamp_min(1e-30)  # X may be images ~ sigma^2 v
    Q = cholesky_qr(X)  # None off the CPU or when ill conditioned
    return orthonormalize(X) if Q is None else Q


def column_norms(X: Tensor) -> Tensor:
    """The ``(..., c)`` column norms of ``X`` (..., d, c), at any scale float32 holds.

    Float32 squares overflow for entries above ~1e19 (a Krylov image ~ sigma^2 v at sigma above
    ~4e9: the norms read inf, and once the next warm start began from noise) and lose precision
    to underflow below ~1e-16. On the CPU the float32 norms are kept when every one lies in
    between, which a host read tells for free; otherwise, and on an accelerator, where that read
    would be a sync, the squares are summed in float64.
    """
    if X.device.type == "cpu":
        # The squares summed down the columns: vector_norm's reduction across rows of a
        # row-major block took 5-8x as long (2 against 0.35 ms at 48 x 768 x 40).
        norms = X.square().sum(-2).sqrt()
        if bool(((norms >= _SMALLEST_NORM) & (norms <= _LARGEST_NORM)).all()):
            return norms
    return torch.linalg.vector_norm(X, dim=-2, dtype=torch.float64).to(X.dtype)


# Column norms whose float32 squares are safe: the largest entry's square is at least
# norm^2 / d (d <= 2^20 here) and at most norm^2, both inside float32's normal range.
_SMALLEST_NORM = 2.0**-50
_LARGEST_NORM = 2.0**60
