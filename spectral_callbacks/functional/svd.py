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
On the CPU a cold batch goes through it a few matrices at a time (``_chunks``), so that the
blocks stay in cache. ``W^T W`` is applied either as two skinny products with W or, when the smaller
side is short enough that forming the Gram matrix once is cheaper, as one product with the
explicit Gram matrix. A cold start on a CPU with bfloat16 matrix tiles (Intel AMX) may instead
multiply by W rounded to bfloat16 once, at about three times the float32 rate: those products
only steer the subspace.
Every way, the singular values are read off ``W V`` in float32 or better (Rayleigh-Ritz on W
itself, not on the Gram matrix or a rounded W), so they carry W's own rounding, not its square.

The depth is decided a posteriori (``n_iter=None``): after each Krylov block the Ritz residuals of
the top k say how much one more power step could still raise each Ritz value, and the iteration
stops once that is below ``tol`` (``krylov.ritz_residuals``). A warm start from the previous
snapshot's subspace on slowly moving weights stops after its first block (4 m n b flops: ``W Q``
and ``W^T (W Q)``), plus one product ``W s_1`` where only sigma_1's tight bound fails there and
the Rayleigh-Ritz of the left space ``W span(Q)`` (free from those products, half a power step
further) passes it (``krylov.left_rayleigh_ritz``, read with the right residuals off float64
Gram matrices of the first block, ``krylov._first_block_gram``); a flat spectrum or a subspace rotated by a loss spike goes deeper, and after a
failed test the next block holds only the residuals of the pairs that failed (often one column).
A cold start is tested from the expected depth of a flat spectrum, and before that from depth 2
while it is within 10x of its bounds, with sigma_1's bound a tenth as wide: a fast-decaying
spectrum (a trained or low-rank matrix) stops there, after 3-4 blocks instead of 6-7, and a flat
one, far from its bounds at depth 2, goes on as without that test. A dense cold start iterates in the space of the smaller side, from a start drawn
there.
By products, ``W V`` for the final Rayleigh-Ritz step is a combination of the ``W Q_j`` already
made, and ``W^T Y`` is computed as ``(Y^T W)^T`` (BLAS reads a transposed W at about half the
speed).

The exact paths are ``eigvalsh`` of the smaller Gram matrix in float64 (exact for sigma_1 and every
singular value above ``sqrt(eps64) * sigma_1``) and ``svdvals`` of the tall orientation (LAPACK is
several times slower on the wide one). When ``auto`` picks the Gram path for float32 input, the
Gram matrix is formed and decomposed in float32 (0.5-0.8 of the time), and the matrices whose top
k reach below 0.01 sigma_1, where squaring W's rounding would show, are redone in float64. Which
path runs is decided by shape and device with a calibrated flop count
(``method_choice.choose_method``), so the choice is deterministic - unless a ``calibration`` is
passed: then, on the CPU, the count is only the prior and the randomized and the Gram path are
timed against each other at the first call of each kind (``calibration.py``); on an accelerator
the float64 Gram path is never chosen (weak FP64 on many GPUs).

Host synchronization (what a CUDA worker waits for): on an accelerator, masks (non-finite
matrices, the rank tolerance, stale ``init`` columns, Krylov columns that leak into the basis) are
applied with ``torch.where``, never decided on the host; on the CPU, where a host read is free,
the usual case skips them. Warm or cold is decided from whether ``init`` was given. What remains:
one host read per Krylov step of the stopping rule (none with an explicit ``n_iter``; two
more where a warm start's left Rayleigh-Ritz is tried), and the
error checks inside ``torch.linalg.eigh``/``svd``/``svdvals``/``eigvalsh`` (torch has no
non-checking variants of these).
Float32 products stay float32 even where the user enabled TF32 (``precision.matmul``, also for
the Krylov iteration's own products), without touching that process-global setting, which
training shares.

Every path returns the same top-k: an exact path truncates its full spectrum to k, and singular
values below ``max(m, n) * eps * sigma_1`` (``eps`` of the compute dtype, the rank tolerance of
``torch.linalg.matrix_rank``) are reported as exactly 0, so a rank-deficient matrix reads the same
whichever method ran.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from spectral_callbacks.functional.batch import MatrixBatch
from spectral_callbacks.functional.calibration import MethodCalibration
from spectral_callbacks.functional.exact import (
    ends_clear,
    exact_after_failure,
    float32_gram_top,
    gram_eigvalsh,
    gram_singular_values,
    svdvals_tall,
)
from spectral_callbacks.functional.krylov import (
    Subspace,
    column_norms,
    keep_finite,
    orthonormal_columns,
    orthonormalize,
    start_block,
    top_subspace,
)
from spectral_callbacks.functional.method_choice import (
    bf16_tiles,
    choose_method,
    randomized_costs,
    route_depth,
)
from spectral_callbacks.functional.precision import gram
from spectral_callbacks.functional.precision import matmul as _matmul

_log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_K",
    "DEFAULT_N_ITER",
    "DEFAULT_N_OVERSAMPLES",
    "DEFAULT_TOL",
    "METHODS",
    "TopSVD",
    "randomized_svd",
]

# Why these defaults (measured by benchmarks/svd_accuracy.py, table in docs/metrics.md):
# k = 32 ranks span 1.5 decades of log i, enough for a stable power-law fit, while the cost of every
# product with W stays linear in the block size k + n_oversamples.
DEFAULT_K = 32
# A few extra columns: the Krylov space (block size x (depth + 1) columns) already oversamples.
DEFAULT_N_OVERSAMPLES = 8
# Expected Krylov depth of a cold start, by the smaller side: the top gaps of a flat (Gaussian)
# spectrum shrink like n^(-2/3), so larger matrices need more. Measured worst sigma_1 miss on
# Gaussians: depth 5 up to a side of 768, -0.07 % (depth 4: -0.8 %); at 1024x4096 depth 5 missed by
# up to 0.3 % (the stopping rule asks for 6); depth 6 at 2048, ~-0.1 %; at 4096 depth 6 missed by
# 0.3 %, depth 8 by 0.02 %. The stopping rule decides the actual depth, first tested at this one
# (a failed test costs an eigh); the depth may exceed it by _EXTRA_DEPTH.
DEFAULT_N_ITER = 6
DEFAULT_N_ITER_SMALL = 5
DEFAULT_N_ITER_LARGE = 8
_SMALL_SIDE = 768
_LARGE_SIDE = 2048
_EXTRA_DEPTH = 4
# A cold start is first tested at depth 2 (3 blocks, a 120-column Rayleigh quotient: its eigh
# about 1.1 ms against 3.3 at 200 columns, one thread), where a fast-decaying spectrum has
# converged (sigma_i = 1/i at 768^2, 768 x 3072, 2048^2; at 1024^2 one pair short, one column
# later) and a flat one is far from it (its test decides no more, krylov._EARLY_REACH). Depth 1
# passed only for steeper spectra (i^-2), and decided nothing for 1/i: 15-20 pairs missing.
_EARLY_CHECK = 2
# A warm start from the previous snapshot's subspace normally stops after its first block.
_EXPECTED_WARM_DEPTH = 1
# Stopping rule: a Krylov step is the last when the top Ritz pair (theta_1, x_1) of W^T W has
# ||W^T W x_1 - theta_1 x_1||^2 <= tol * theta_1^2 (one more power step would raise theta_1 by at
# most a fraction tol) and every other top-k pair meets 10 * tol. Measured along the Krylov depth of
# Gaussian (flat, the hard case) matrices 768x768, 3072x768, 1024x4096: sigma_1's relative error is
# at most 2.4x that fraction, so tol = 1e-3 keeps stable rank (twice sigma_1's error) within 0.5 %;
# alpha's error is about half the worst fraction of the rest, so within 0.005.
DEFAULT_TOL = 1e-3
# How much of a CPU batch a cold Krylov iteration takes at a time. Cold snapshots (1 thread) took
# 10-20 % less CPU time in parts of 4 matrices at 768 x 768, 3 at 1024 and 1 at 2048 than as whole
# batches (GPT-2 small, medium, TinyLlama shapes). The likely reason: a 768 x 40 float32 block is
# 120 KiB, so 4 of them stay within a core's 2 MiB L2 cache.
_CHUNK_BYTES = 512 * 1024
# Below this sigma_1 (about 9e-16) a matrix is redone exactly: the float32 Krylov products of
# W^T W (~ sigma_1^2) lost their precision to underflow from sigma_1 = 5e-19 on (47 % off), and at
# 5e-17 were still as accurate as at unit scale; 2^-50 leaves a margin.
_SMALLEST_SIGMA = 2.0**-50
# The products with W^T W square W's scale, and float32 holds squares only from 2^-126 to 2^128;
# LAPACK's eigh of the Rayleigh quotient failed to converge (MKL) already at sigma_1 ~ 2^-70 and
# 2^60. The iteration by products multiplies by W^T W at unit size instead, by a power of two
# (exact) read off its first block W Q_0, wherever that block's largest column norm lies outside
# 2^(+-_UNIT_EXPONENT) (within it nothing is scaled: the usual weights compute as before). On the
# explicit Gram matrix, which is squared before anything can be read, a largest diagonal entry
# (column norm squared) outside 2^(+-_GRAM_EXPONENT) sends the matrix to the exact float64 path:
# sigma_1^2 is then at most d 2^100, or at least 2^-100.
_UNIT_EXPONENT = 20
_GRAM_EXPONENT = 100
# The automatic exact path forms the Gram matrix in float32 where the top k reach no lower than
# this fraction of sigma_1 (relative error about 5e-7 (sigma_1 / sigma_i)^2, measured at most 6e-5
# there; float32 Gram noise sits near 5e-4 sigma_1), else in float64.
_FLOAT32_GRAM_LEAST = 1e-2
#: A slice of a batch that is all of it (taken without making a view).
_WHOLE = slice(None)


def default_n_iter(m: int, n: int) -> int:
    """Expected Krylov depth of a cold start on an ``m x n`` matrix (see the measurements above).

    >>> default_n_iter(3072, 768), default_n_iter(2048, 2048), default_n_iter(4096, 4096)
    (5, 6, 8)
    """
    small = min(m, n)
    if small <= _SMALL_SIDE:
        return DEFAULT_N_ITER_SMALL
    return DEFAULT_N_ITER if small <= _LARGE_SIDE else DEFAULT_N_ITER_LARGE


#: The ``method`` of :func:`randomized_svd`.
Method = Literal["auto", "randomized", "subspace", "gram", "svdvals"]
METHODS: tuple[Method, ...] = get_args(Method)
#: The paths a calibration times against each other (``svdvals`` is never among them: the Gram
#: path was faster than it at every shape of benchmarks/method_calibration.py).
CALIBRATED = ("randomized", "gram")


class TopSVD(NamedTuple):
    """Top-k singular values and the right subspace that found them.

    Attributes:
        S: ``(..., k)`` singular values in descending order, float32 (float64 for float64 input).
        V: ``(..., n, l)`` orthonormal basis of the approximate top right singular subspace,
            ``l = k + n_oversamples`` (clamped to ``min(m, n)``), leading columns first (one power
            step past the Ritz vectors when the products with W were computed anyway); pass it
            back as ``init=`` to warm-start the next call on a slightly changed matrix. ``None``
            when an exact method ran.
        fell_back: ``(...)`` bool, the matrices whose path raised a solver error (LAPACK's
            ``eigh`` or SVD failing to converge) and whose ``S`` (and ``V``) come from the exact
            float64 path instead (``exact.exact_after_failure``); ``None`` when none did.
    """

    S: Tensor
    V: Tensor | None
    fell_back: Tensor | None = None


def randomized_svd(
    W: Tensor | MatrixBatch,
    k: int = DEFAULT_K,
    *,
    n_oversamples: int = DEFAULT_N_OVERSAMPLES,
    n_iter: int | None = None,
    generator: torch.Generator | None = None,
    init: Tensor | None = None,
    method: str = "auto",
    tol: float = DEFAULT_TOL,
    calibration: MethodCalibration | None = None,
) -> TopSVD:
    r"""Top-k singular values of ``W`` (or of each matrix of a batch).

    The randomized path (Musco & Musco 2015, Algorithm 2) builds an orthonormal basis :math:`Q` of
    the block Krylov space of :math:`W^\top W` from a start :math:`\Omega \in \mathbb{R}^{n \times b}`,
    :math:`b = k + p` (Gaussian, or ``init``), keeps the top-b Ritz vectors :math:`V` and reads the
    singular values off the small matrix :math:`W V`:

    .. math::

        \mathcal{K} = [\Omega,\ (W^\top W)\,\Omega,\ \dots,\ (W^\top W)^q\,\Omega], \qquad
        \sigma_i(W V) \le \sigma_i(W).

    With ``n_iter=None`` the depth ``q`` is decided a posteriori: after each block the Ritz
    residuals :math:`r_i = W^\top W x_i - \theta_i x_i` of the top k are checked, and the
    iteration stops once :math:`\lVert r_1 \rVert^2 \le \mathrm{tol}\,\theta_1^2` and
    :math:`\lVert r_i \rVert^2 \le 10\,\mathrm{tol}\,\theta_i^2` for the others (one more power
    step could raise :math:`\theta_1` by no more than the fraction ``tol``). A warm
    start on a slowly moving matrix stops after its first block; a flat spectrum or a rotated
    subspace goes deeper.

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` matrix of any float dtype; views (``W.T``, slices) are fine.
            Or a ``functional.batch.MatrixBatch`` (an adapted layer's base + low-rank factors, a
            fine-tune's copy beside its reference, ...), multiplied through its own products.
        k: how many singular values to return (default 32); clamped to ``min(m, n)``.
        n_oversamples: extra block columns ``p`` (default 8); the block size is ``b = k + p``.
            More columns cost linearly more and converge faster on flat spectra.
        n_iter: a fixed Krylov depth ``q`` (power iterations for ``method="subspace"``), no
            stopping rule. Default ``None``: the stopping rule decides, up to 4 steps beyond the
            expected cold depth (5 when the smaller side is at most 768, 6 up to 2048, 8 beyond).
            Each step costs one product with :math:`W^\top W` and buys accuracy.
        generator: random generator for the Gaussian start and for columns ``init`` lacks
            (default ``None``: a fresh generator seeded 0 on ``W``'s device, so the result is
            deterministic and torch's global RNG is never touched).
        init: ``(n, j)`` or ``(B, n, j)`` start subspace, normally ``.V`` of the previous call on
            the same matrix; columns beyond ``b`` are dropped, missing or non-finite ones drawn
            at random.
        method: ``"auto"`` (default; chosen by shape and device, see the module docstring),
            ``"randomized"`` (block Krylov), ``"subspace"`` (Halko, Martinsson & Tropp 2011,
            Algorithm 4.4, for comparison), ``"gram"`` (exact: float64 ``eigvalsh`` of the smaller
            Gram matrix) or ``"svdvals"`` (exact: ``torch.linalg.svdvals`` of the tall orientation).
        tol: the stopping rule's tolerance (default 1e-3: stable rank within 0.5 %, alpha within
            0.005 as measured); smaller is deeper and more accurate. Unused with ``n_iter``.
        calibration: with ``method="auto"`` on the CPU, choose between the randomized and the
            exact Gram path by what this :class:`~spectral_callbacks.functional.calibration.
            MethodCalibration` measured for calls like this one (same shape, batch, dtype,
            device, cold or warm), timing both on the first such call (the flop count is then
            only the prior). A calibration also says that warm calls will follow: an exact cold
            call then returns the top subspace ``V`` to start them from. Default ``None``: the
            flop count alone (deterministic), and an exact path returns ``V = None``.

    Returns:
        ``TopSVD(S, V, fell_back)``. A matrix with a NaN or Inf entry gets ``S`` all NaN (the
        rest of the batch is unaffected); a zero matrix gets ``S`` all 0. Any finite scale reads
        right: the iteration by products multiplies by W^T W scaled to unit size by a power of
        two; on the CPU, a matrix whose float32 W^T W cannot be held otherwise (its explicit Gram
        matrix out of range, or sigma_1 below about 1e-15) is computed by the exact float64 Gram
        path. A solver that raises (LAPACK's ``eigh`` or SVD failing to converge) never ends the
        call: the batch is taken again one matrix at a time, and a matrix that fails alone is
        computed by the exact float64 path, flagged in ``fell_back`` and logged as a warning.

    Raises:
        TypeError: ``W`` or ``init`` is not a floating-point tensor.
        ValueError: ``W`` is not 2-D or 3-D or has an empty side, ``k``/``n_oversamples``/
            ``n_iter``/``tol`` are out of range, ``method`` is unknown, or ``init`` does not fit
            ``W``.
        torch.linalg.LinAlgError: only where, after a matrix's own path, LAPACK's ``eigh`` and
            its SVD both fail on the same float64 matrix as well.

    Example::

        >>> W = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))
        >>> randomized_svd(W, 2).S
        tensor([4., 3.])
        >>> randomized_svd(torch.stack([W, 2 * W]), 1).S
        tensor([[4.],
                [8.]])
    """
    # A Tensor first: the Protocol's isinstance walks its members (tens of microseconds, a
    # sizeable part of a small matrix's call).
    if not isinstance(W, Tensor) and isinstance(W, MatrixBatch):
        return _adapted_svd(W, k, n_oversamples, n_iter, generator, init, method, tol)
    _check_matrix(W, "W")
    _check_options(k, n_oversamples, n_iter, method, tol)
    m, n = W.shape[-2:]
    if init is not None:
        _check_init(init, W)
    compute_dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    A = W if W.dtype == compute_dtype else W.to(compute_dtype)
    k, width, expected = _sizes(m, n, k, n_oversamples, n_iter, init is not None)
    # A cold start (several full blocks) may find its subspace with products on W rounded to
    # bfloat16, where the CPU multiplies bfloat16 in matrix tiles; a warm start's one block gets
    # its values free from its own products, which a rounded W could not give.
    rounded = init is None and compute_dtype == torch.float32 and bf16_tiles(A.device)
    batch = math.prod(A.shape[:-2])
    calibrated = calibration if A.device.type == "cpu" else None
    # An exact cold call of a caller that will call again (it keeps a calibration: the monitor's
    # compute) hands back a subspace for the warm calls that follow (priced for the whole batch),
    # unless they were measured to be exact too (then eigvalsh, not eigh: the subspace would go
    # unused). A stateless call gets eigvalsh: eigh's vectors would double its time for nothing.
    keep_subspace = False
    if calibration is not None:
        key = (f"{m}x{n}", batch, str(compute_dtype), A.device.type, init is not None)
        warm_is_exact = (
            calibrated is not None and calibrated.chosen.get((*key[:-1], True)) == "gram"
        )
        keep_subspace = (
            method == "auto"
            and init is None
            and not warm_is_exact
            and choose_method(m, n, width, _EXPECTED_WARM_DEPTH, compute_dtype, batch=batch)
            == "randomized"
        )

    def run(chosen: str, rows: slice = slice(None)) -> TopSVD:
        part, part_init = _rows(A, rows), _batch_rows(init, rows)
        # The exact path that stands in for a failed one returns a subspace where this one would.
        keeps = chosen in ("randomized", "subspace") or (chosen == "gram" and keep_subspace)

        def attempt(one: slice) -> TopSVD:
            return _top_svd(
                _rows(part, one),
                k,
                width,
                chosen,
                method == "auto",
                generator,
                _batch_rows(part_init, one),
                n_iter,
                tol,
                rounded,
                keep_subspace,
            )

        def fallback(one: slice) -> TopSVD:
            S, finite, V = exact_after_failure(part[one], width if keeps else None)
            return TopSVD(_tidy(S[..., :k], finite, max(m, n), compute_dtype), V)

        return _with_fallback(attempt, fallback, part.shape[0] if part.ndim == 3 else None, (m, n))

    if method != "auto":
        return run(method)
    first_test = _first_test(n_iter, init is not None)
    prior = choose_method(
        m, n, width, expected, compute_dtype, A.device.type, rounded, batch, first_test
    )
    if calibrated is None or prior not in CALIBRATED:
        return run(prior)
    chosen = calibrated.chosen.get(key)
    if chosen is not None:
        return run(chosen)
    # The prior first: on a tie (or a first call's warm-up) it is kept.
    candidates = (prior, *(other for other in CALIBRATED if other != prior))
    if batch == 1:
        return calibrated.run(key, candidates, run)
    # The candidates are timed on the batch's first matrix only, and the winner runs on the rest:
    # timing each candidate on the whole batch cost a GPT-2 small's first snapshot several times
    # the best exact method's time (every matrix decomposed by both paths, up to three times).
    # Per matrix the two paths scale alike with the batch, except the randomized path's fixed
    # cost per call, which one matrix pays in full: a close call leans to the exact path.
    first = calibrated.run(key, candidates, lambda candidate: run(candidate, slice(0, 1)))
    rest = run(calibrated.chosen[key], slice(1, None))
    return _concatenated([first, rest])


def _top_svd(
    A: Tensor,
    k: int,
    width: int,
    chosen: str,
    auto: bool,
    generator: torch.Generator | None,
    init: Tensor | None,
    n_iter: int | None,
    tol: float,
    rounded: bool,
    keep_subspace: bool = False,
) -> TopSVD:
    """The top k of ``A`` (already in its compute dtype) by the ``chosen`` path; ``auto``: as
    ``method="auto"`` runs it (the float32 Gram matrix with its float64 redo); ``keep_subspace``:
    an exact path also returns the top subspace, for the warm calls that will follow."""
    m, n = A.shape[-2:]
    compute_dtype = A.dtype
    V: Tensor | None
    if chosen in ("randomized", "subspace"):
        expected = _expected_depth(m, n, n_iter, init is not None)
        depth, first_check, early_check = _iteration(m, n, n_iter, chosen, init is not None)
        # A cold start iterates in the space of the smaller side, drawn there (a wide W's
        # right start would cost a QR of an n x b block and a product to map it across).
        start = _start(A.mT if init is None and m < n else A, width, generator, init)
        # A warm start's one or two blocks gain nothing from parts and pay their overhead
        # (GPT-2 small warm 0.422 s whole, 0.431 s in parts).
        rows_of_parts = _chunks(A, width) if init is None else [slice(None)]
        parts = [
            _randomized(
                A[rows],
                k,
                start[rows],
                depth,
                tol,
                expected,
                first_check,
                krylov=chosen == "randomized",
                early_check=early_check,
                rounded=rounded,
                cold=init is None,
            )
            for rows in rows_of_parts
        ]
        S, V, finite = parts[0] if len(parts) == 1 else map(torch.cat, zip(*parts, strict=True))
        S, V, finite = _exact_where_float32_falls_short(A, S, V, finite, width)
    elif chosen == "gram":
        # A small matrix's first call may be exact and its later ones warm: then the exact path
        # also hands back the top subspace (eigh, not eigvalsh), so there is something to warm
        # start from.
        subspace_width = width if keep_subspace else None
        cpu = A.device.type == "cpu"
        if auto and compute_dtype == torch.float32 and subspace_width is None and cpu:
            # The values alone (a stateless call), each check one host read; the batch that
            # has a matrix to redo or to mask takes the checked path below.
            least = max(_FLOAT32_GRAM_LEAST, _rank_tolerance(max(m, n), compute_dtype))
            top = float32_gram_top(A, k, _GRAM_EXPONENT, least, _SMALLEST_SIGMA)
            if top is not None:
                return TopSVD(top, None)
        if auto and compute_dtype == torch.float32:
            # A float32 Gram matrix: the product at float32's rate and no float64 copy of W
            # (a 4 x 512 x 128 batch: 2.1 ms against 3.6); what it cannot read is redone.
            S, finite, V = gram_eigvalsh(A, subspace_width, torch.float32, _GRAM_EXPONENT)
            S, V, finite = _exact_where_float32_falls_short(A, S, V, finite, subspace_width, k)
        else:
            S, finite, V = gram_eigvalsh(A, subspace_width)
    else:
        (S, finite), V = svdvals_tall(A), None
    return TopSVD(_tidy(S[..., :k], finite, max(m, n), compute_dtype), V)


def _sizes(
    m: int, n: int, k: int, n_oversamples: int, n_iter: int | None, warm: bool
) -> tuple[int, int, int]:
    """``k`` clamped to the matrix, the block width ``b = k + p``, and the expected Krylov depth
    that prices the methods (``n_iter``, else a warm or a cold start's).

    Warm or cold is decided on the host from whether a start subspace was given (no read of its
    values): it only prices the paths; the stopping rule finds the depth either way.
    """
    k = min(k, m, n)
    return k, min(k + n_oversamples, m, n), _expected_depth(m, n, n_iter, warm)


def _expected_depth(m: int, n: int, n_iter: int | None, warm: bool) -> int:
    """The Krylov depth a call is expected to reach: ``n_iter``, else a warm or a cold start's."""
    if n_iter is not None:
        return n_iter
    return _EXPECTED_WARM_DEPTH if warm else default_n_iter(m, n)


def _iteration(
    m: int, n: int, n_iter: int | None, chosen: str, warm: bool
) -> tuple[int, int | None, int | None]:
    """The iterative path's largest depth, the depth its stopping rule is tested at from then on
    (``None``: no rule), and the depth a cold start's early tests begin at (``None``: none).

    The stopping rule is tested from the first block of a warm start (where sigma_1's tight bound
    is nearly always decided by the left Rayleigh-Ritz, ``krylov.left_rayleigh_ritz``, at the
    cost of one product with W) and from the expected depth of a cold one: each test costs an
    eigh of the Rayleigh quotient, which at a cold depth's basis size (200-300 columns) costs
    more than a Krylov step. Before that a cold start is tested early (:func:`_first_test`,
    ``krylov.block_krylov``), where a fast-decaying spectrum has already converged. Subspace
    iteration (a comparison method) has no rule: the expected cold depth.
    """
    depth = default_n_iter(m, n) if n_iter is None else n_iter
    if n_iter is not None or chosen != "randomized":
        return depth, None, None
    return depth + _EXTRA_DEPTH, 0 if warm else depth, _first_test(n_iter, warm)


def _first_test(n_iter: int | None, warm: bool) -> int | None:
    """The depth a cold call's stopping rule is first tested at, before its expected depth
    (``None``: a warm call, tested from its first block, or a fixed ``n_iter``)."""
    return None if n_iter is not None or warm else _EARLY_CHECK


def _start(
    like: Tensor, width: int, generator: torch.Generator | None, init: Tensor | None
) -> Tensor:
    """The start block of the iterative paths for matrices shaped like ``like`` (``init``'s
    columns, the rest Gaussian); ``generator`` defaults to one seeded 0 on their device, made
    here: the exact paths draw nothing."""
    if generator is None:
        generator = torch.Generator(like.device).manual_seed(0)
    return start_block(like, width, generator, init)


def _rank_tolerance(side: int, compute_dtype: torch.dtype) -> float:
    """The rank tolerance relative to sigma_1, ``max(m, n) * eps`` (``torch.linalg.matrix_rank``'s)."""
    return side * torch.finfo(compute_dtype).eps


def _tidy(S: Tensor, finite: Tensor, side: int, compute_dtype: torch.dtype) -> Tensor:
    """``S`` with values below the rank tolerance as 0 and non-finite matrices as NaN."""
    # Values below the rank tolerance are rounding noise whose size depends on the method; report
    # them as 0 so every method gives the same answer for a rank-deficient matrix.
    tolerance = _rank_tolerance(side, compute_dtype)
    # A host read is free on the CPU: skip the masks when nothing is masked.
    if S.device.type == "cpu" and bool(finite.all()) and ends_clear(S, S.shape[-1], tolerance):
        return S
    rank_tol = tolerance * S[..., :1]
    S = torch.where(rank_tol < S, S, torch.zeros((), dtype=S.dtype, device=S.device))
    return torch.where(
        finite[..., None], S, torch.full((), float("nan"), dtype=S.dtype, device=S.device)
    )


def _adapted_svd(
    W: MatrixBatch,
    k: int,
    n_oversamples: int,
    n_iter: int | None,
    generator: torch.Generator | None,
    init: Tensor | None,
    method: str,
    tol: float,
) -> TopSVD:
    """``randomized_svd`` of a batch held as an operator (``functional.batch.MatrixBatch``), by
    the same plan as a dense one (:func:`_sizes`, :func:`_iteration`, :func:`_start`).

    The Krylov products are the batch's own ``W X`` and ``W^T Y`` (for ``lowrank.AdaptedMatrices``
    ``D (W_0 X + U (V X))``, on the live base): no ``m x n`` matrix is formed. Where the method
    choice prefers an exact path (small matrices, for which a block would cover most of the space
    anyway), the matrices are formed here in the worker, one batch at a time, and decomposed
    exactly.
    """
    _check_options(k, n_oversamples, n_iter, method, tol)
    batch, m, n = W.shape
    compute_dtype = torch.float64 if W.dtype == torch.float64 else torch.float32
    W = W.to(compute_dtype)
    k, width, expected = _sizes(m, n, k, n_oversamples, n_iter, init is not None)
    chosen = method
    if method == "auto":
        first_test = _first_test(n_iter, init is not None)
        chosen = choose_method(
            m, n, width, expected, compute_dtype, W.device.type, False, batch, first_test
        )
    if chosen not in ("randomized", "subspace"):
        dense = W.dense(compute_dtype)
        return randomized_svd(
            dense,
            k,
            n_oversamples=n_oversamples,
            n_iter=n_iter,
            generator=generator,
            init=init,
            method=method,
            tol=tol,
        )
    if init is not None:
        _check_init(init, torch.empty((), device="meta").expand(batch, m, n))
    probe = torch.empty((), dtype=compute_dtype, device=W.device).expand(batch, m, n)
    start = _start(probe, width, generator, init)
    depth, first_check, early_check = _iteration(m, n, n_iter, chosen, init is not None)

    def attempt(one: slice) -> TopSVD:
        part = W[one]

        def apply(X: Tensor) -> tuple[Tensor, Tensor | None]:
            Y = part.matmul(X, _matmul)  # (B, m, b)
            return part.rmatmul(Y, _matmul), Y

        found = top_subspace(
            apply,
            start[one],
            k,
            depth,
            tol,
            krylov=chosen == "randomized",
            first_check=first_check,
            finite=None,
            rank_scale=max(m, n),
            forward=lambda X: part.matmul(X, _matmul),
            early_check=early_check,
        )
        if found.values is not None:
            S = found.values.to(compute_dtype)
        else:
            S = _singular_values(_ritz_image(found, lambda X: part.matmul(X, _matmul)))
        return TopSVD(_tidy(S[..., :k], found.finite, max(m, n), compute_dtype), _next_start(found))

    def fallback(one: slice) -> TopSVD:  # the matrix formed here, as the exact choice does above
        S, finite, V = exact_after_failure(W[one].dense(compute_dtype), width)
        return TopSVD(_tidy(S[..., :k], finite, max(m, n), compute_dtype), V)

    return _with_fallback(attempt, fallback, batch, (m, n))


def _exact_where_float32_falls_short(
    A: Tensor, S: Tensor, V: Tensor | None, finite: Tensor, width: int | None, k: int | None = None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The matrices float32 could not read, done again by the exact float64 Gram path.

    Products with W^T W scale as sigma_1^2: for sigma_1 below ``_SMALLEST_SIGMA`` they underflow,
    above about 1e19 they overflow (the matrix read as non-finite). Both are far outside any
    trained weight's scale. With ``k`` (after the float32 Gram path, which squares W's rounding:
    see ``gram_eigvalsh``) a top k reaching below ``_FLOAT32_GRAM_LEAST`` sigma_1 is redone too
    (a rank-deficient matrix, one dominant outlier), so every value is within about 1e-4 of exact
    and a rank-deficient matrix reads as by the float64 path. A NaN/Inf of W stays NaN.

    The check is a host read of the top values, free on the CPU; off the CPU it would be a sync,
    so there the documented limits stand. ``S``, ``V`` and ``finite`` are the caller's own,
    updated in place where redone.
    """
    if A.device.type != "cpu":
        return S, V, finite
    least = 0.0 if k is None else _FLOAT32_GRAM_LEAST
    if bool(finite.all()) and ends_clear(S, k or 1, least, _SMALLEST_SIGMA):
        return S, V, finite  # the usual batch: nothing to redo
    # Else each matrix's sigma_1 and k-th value read on the host and checked there.
    ends = S[..., [0, (k or 1) - 1]].reshape(-1, 2).tolist()  # one read: (sigma_1, sigma_k)
    redo = [
        index
        for index, (is_finite, (top, kth)) in enumerate(
            zip(finite.flatten().tolist(), ends, strict=True)
        )
        if not is_finite
        or 0 < top < _SMALLEST_SIGMA
        or (k is not None and kth < _FLOAT32_GRAM_LEAST * top)
    ]
    if not redo:
        return S, V, finite
    batch = finite.shape
    A3 = A.reshape(-1, *A.shape[-2:])
    S, finite = S.reshape(-1, S.shape[-1]), finite.flatten()
    V = None if V is None else V.reshape(-1, *V.shape[-2:])
    # One matrix at a time, so the float64 work is one matrix's (the snapshot budget counts that:
    # functional/memory.py), not the batch's; a NaN/Inf of W stays NaN.
    for index in (index for index in redo if bool(torch.isfinite(A3[index]).all())):
        one = slice(index, index + 1)
        exact, exact_finite, subspace = gram_eigvalsh(A3[one], width)
        S[one], finite[one] = exact[..., : S.shape[-1]], exact_finite
        if V is not None:
            assert subspace is not None, "a width is given wherever there is a subspace to redo"
            V[one] = subspace
    V = None if V is None else V.view(*batch, *V.shape[-2:])
    return S.view(*batch, -1), V, finite.view(batch)


def _chunks(A: Tensor, width: int) -> list[slice]:
    """The parts of the batch that ``_randomized`` takes one at a time: on the CPU, as many
    matrices as keep one block of the iterated space within ``_CHUNK_BYTES``, so the block
    operations (projections, QR, the images' conversions) run out of the core's cache instead of
    memory; the whole batch elsewhere (an accelerator wants its batches large)."""
    if A.ndim == 2 or A.device.type != "cpu":
        return [slice(None)]
    size = max(1, _CHUNK_BYTES // (min(A.shape[-2:]) * width * A.element_size()))
    return [slice(i, i + size) for i in range(0, A.shape[0], size)]


def _randomized(
    A: Tensor,
    k: int,
    start: Tensor,
    depth: int,
    tol: float,
    expected: int,
    first_check: int | None,
    *,
    krylov: bool,
    rounded: bool = False,
    early_check: int | None = None,
    cold: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Block Krylov (or subspace iteration) + Rayleigh-Ritz on W itself; returns (S, V, finite)."""
    m, n = A.shape[-2:]
    # The way to apply W^T W, compared where the stopping rule may first end the call.
    priced = route_depth(expected, early_check)
    costs = randomized_costs(m, n, start.shape[-1], priced, krylov=krylov, rounded=rounded)
    route = min(costs, key=costs.__getitem__)
    use_gram = route == "gram"
    # B X for the left Rayleigh-Ritz of a warm start's first block (krylov.left_rayleigh_ritz):
    # only where the images are B^T B X themselves, at B's own scale.
    forward: Callable[[Tensor], Tensor | None] | None = None
    # Iterate in the space of the smaller side when W itself is not multiplied at full
    # precision (its Gram matrix, or W rounded to bfloat16), else on the right.
    wide = m < n and (route != "products" or cold)
    B = A.mT if wide else A  # iterate on the right space of B: (..., rows, d)
    if use_gram:
        # TF32 on: B split once (two copies, as the memory bound counts), not both operands.
        G = gram(B)  # (..., d, d)
        # A NaN/Inf entry (or a float32 overflow) shows on the Gram matrix's diagonal (squared
        # column norms); the images of those matrices are zeroed so LAPACK never sees a NaN. So
        # are those of a Gram matrix too far from unit scale for float32 (_GRAM_EXPONENT): both
        # are redone by the exact float64 path (_exact_where_float32_falls_short).
        squares = G.diagonal(dim1=-2, dim2=-1)  # (..., d)
        largest = squares.amax(-1)
        in_range = (largest >= 2.0**-_GRAM_EXPONENT) & (largest <= 2.0**_GRAM_EXPONENT)
        finite = torch.isfinite(squares).all(-1) & ((largest == 0) | in_range)
        if wide and start.shape[-2] != m:  # (..., m, b): the left image of a right start
            start = orthonormalize(keep_finite(_matmul(A, start), finite))

        def apply(X: Tensor) -> tuple[Tensor, Tensor | None]:
            return _matmul(G, X), None

    elif route == "rounded":
        # The products only steer the subspace: its values come from W V in float32 below,
        # exact Ritz values of W itself, and the stopping rule's residuals carry bfloat16's
        # rounding (about 2^-9 of each entry), far below its tolerance.
        low = torch.bfloat16
        A_low = A.to(low)
        finite = None
        if wide and start.shape[-2] != m:  # (..., m, b): the left image of a right start;
            # a NaN/Inf shows in its sum
            image = _matmul(A_low, start.to(low)).to(A.dtype)
            finite = torch.isfinite(image.sum((-2, -1)))
            start = orthonormalize(keep_finite(image, finite))
        if wide:

            def apply(X: Tensor) -> tuple[Tensor, Tensor | None]:
                Y = _matmul(X.to(low).mT, A_low).mT  # W^T X as (X^T W)^T
                return _matmul(A_low, Y).to(X.dtype), None

        else:

            def apply(X: Tensor) -> tuple[Tensor, Tensor | None]:
                Y = _matmul(A_low, X.to(low))
                return _matmul(Y.mT, A_low).mT.to(X.dtype), None

    else:
        finite = None
        unit: list[Tensor | None] = []  # the powers of two of _unit_scale, from the first block

        # B^T Y without a transposed W, which BLAS reads at half the speed (or torch copies):
        # W^T Y as (Y^T W)^T. W X as (X^T W^T)^T: MKL's skinny GEMM takes that transposed
        # problem faster (20 x 4864 x 896 times 40 columns: 140 against 148 ms; 10 x 896 x
        # 4864: 59 against 65; wide, 768 x 3072: 2.63 against 2.94 ms).
        def times_B(X: Tensor) -> Tensor:
            return _matmul(X.mT, A).mT if wide else _matmul(X.mT, A.mT).mT

        def times_Bt(Y: Tensor) -> Tensor:
            return _matmul(Y.mT, A.mT).mT if wide else _matmul(Y.mT, A).mT

        if wide and start.shape[-2] != m:  # (..., m, b): the left image of a right start (init)
            image = _matmul(A, start)
            finite = torch.isfinite(image.sum((-2, -1)))
            start = orthonormalize(keep_finite(image, finite))

        def apply(X: Tensor) -> tuple[Tensor, Tensor | None]:
            Y = times_B(X)  # (..., rows, b)
            if not unit:
                unit.append(_unit_scale(Y))
            c = unit[0]
            # Far from unit scale, c^2 B^T B X: the same Krylov space and Ritz vectors, every
            # product within float32's range; the values are read off the unscaled Y = B X.
            if c is None:
                return times_Bt(Y), Y
            return times_Bt(Y * c) * c, Y

        def multiply(X: Tensor) -> Tensor | None:  # B X, for the left Rayleigh-Ritz at B's scale
            return times_B(X) if unit[0] is None else None

        # The left Rayleigh-Ritz is a warm start's, whose start is on the right: never wide.
        forward = None if wide else multiply

    found = top_subspace(
        apply,
        start,
        k,
        depth,
        tol,
        krylov=krylov,
        first_check=first_check,
        finite=finite,
        rank_scale=max(m, n),
        forward=forward,
        early_check=early_check,
    )
    # Rayleigh-Ritz on W itself: the singular values of the (rows, b) matrix B V (where a warm
    # start's left Rayleigh-Ritz decided, those of B^T U, read off its Gram matrix already). By
    # products, B V is a combination of the images B Q_j already computed; with the Gram matrix
    # it costs one product.
    finite = found.finite
    if found.values is not None:  # never wide: that path iterates by products on W itself
        return found.values.to(A.dtype), _next_start(found), finite
    # One product with W in float32 where the iteration did not form B V (wide, B = W^T: as
    # (basis^T W)^T).
    BV = _ritz_image(found, lambda X: _matmul(X.mT, A).mT if wide else _matmul(B, X))
    S = _singular_values(BV)
    if wide:  # B V's columns are ~ sigma_i u_i, u_i the right singular vectors of A = B^T
        return S, orthonormal_columns(BV), finite
    return S, _next_start(found), finite


def _ritz_image(found: Subspace, times_B: Callable[[Tensor], Tensor]) -> Tensor:
    """``B V`` of the Ritz vectors found, whose singular values are the Ritz values: the
    iteration's own (``found.left``) where it formed it, else one product ``times_B(V)``; a
    non-finite matrix's zeroed."""
    BV = found.left
    if BV is None:
        assert found.basis is not None
        BV = times_B(found.basis)
    return keep_finite(BV, found.finite)


def _next_start(found: Subspace) -> Tensor:
    """The next warm start: one power step past the Ritz vectors, free since W^T W V was
    computed, so it begins closer to the top subspace; a non-finite matrix (its images zeroed)
    keeps its Ritz vectors instead."""
    past = found.start if found.start is not None else found.images  # start: orthonormal
    assert past is not None
    if past.device.type != "cpu" or not bool(found.finite.all()):
        assert found.basis is not None
        past = torch.where(found.finite[..., None, None], past, found.basis)
    # The images' columns ~ sigma_i^2 v_i: nearly orthogonal once normalized.
    return past if found.start is not None else orthonormal_columns(past)


def _unit_scale(Y: Tensor) -> Tensor | None:
    """``(..., 1, 1)`` powers of two ``c`` that bring the largest column of the first block
    ``Y = W Q_0`` (..., rows, b) into [1/2, 1), so that ``c^2 W^T W`` works at unit size (1 where
    that column is 0 or not finite); ``None`` on the CPU where every matrix lies within
    ``2^(+-_UNIT_EXPONENT)`` (a free host read): nothing to scale.

    >>> _unit_scale(torch.ones(1, 4, 2)) is None
    True
    >>> _unit_scale(torch.full((1, 1, 2), 2.0**-70)).flatten().tolist() == [2.0**69]
    True
    >>> _unit_scale(torch.full((1, 1, 2), 2.0**60)).flatten().tolist() == [2.0**-61]
    True
    """
    bound = 2.0**_UNIT_EXPONENT
    if Y.device.type == "cpu":
        # First from the largest entry a (one pass; column norms took 5x as long): the largest
        # column norm lies in [a, sqrt(rows) a], so a within [1/bound, bound / sqrt(rows)] says
        # it lies within 2^(+-_UNIT_EXPONENT).
        # amax and amin, not abs().amax: no |Y| copy (1.1 against 2.7 ms at 20 x 4864 x 40).
        entries = torch.maximum(Y.amax((-2, -1)), -Y.amin((-2, -1))).flatten().tolist()
        room = bound / math.sqrt(Y.shape[-2])
        if all(not 0 < a < math.inf or 1 / bound <= a <= room for a in entries):
            return None
    largest = column_norms(Y).amax(-1)  # (...,)
    if Y.device.type == "cpu" and all(
        not 0 < v < math.inf or 1 / bound <= v <= bound for v in largest.flatten().tolist()
    ):
        return None
    usable = torch.isfinite(largest) & (largest > 0)
    exponent = torch.frexp(torch.where(usable, largest, torch.ones_like(largest))).exponent
    return torch.ldexp(torch.ones_like(largest), -exponent)[..., None, None]


def _with_fallback(
    attempt: Callable[[slice], TopSVD],
    fallback: Callable[[slice], TopSVD],
    batch: int | None,
    shape: tuple[int, int],
) -> TopSVD:
    """``attempt`` on the whole batch; where a solver raises (``torch.linalg.LinAlgError``), on
    each of its ``batch`` matrices alone (``None``: one 2-D matrix), and on a matrix that fails
    alone ``fallback`` (the exact float64 path), flagged in ``fell_back`` and logged.

    Both take a slice of the batch. One matrix's failure costs its batch one more try, matrix by
    matrix: a batched LAPACK call fails as a whole.
    """
    try:
        return attempt(slice(None))
    except torch.linalg.LinAlgError as error:
        failure = error
    alone = batch is None or batch == 1
    parts: list[TopSVD] = []
    for one in [slice(None)] if alone else [slice(i, i + 1) for i in range(batch or 0)]:
        if not alone:
            try:
                parts.append(attempt(one))
                continue
            except torch.linalg.LinAlgError as error:
                failure = error
        top = fallback(one)
        _log.warning(
            "randomized_svd: %s: %s on a %dx%d matrix; its values come from the exact float64 "
            "path instead",
            type(failure).__name__,
            str(failure).split("\n")[0],
            *shape,
        )
        flag = torch.ones(top.S.shape[:-1], dtype=torch.bool, device=top.S.device)
        parts.append(top._replace(fell_back=flag))
    return _concatenated(parts)


def _concatenated(parts: list[TopSVD]) -> TopSVD:
    """The parts of a batch as one result (``V`` only where every part has one)."""
    if len(parts) == 1:
        return parts[0]
    subspaces = [top.V for top in parts if top.V is not None]
    V = torch.cat(subspaces) if len(subspaces) == len(parts) else None
    flags = [top.fell_back for top in parts]
    fell_back = None
    if any(flag is not None for flag in flags):
        fell_back = torch.cat(
            [
                torch.zeros(top.S.shape[:-1], dtype=torch.bool, device=top.S.device)
                if flag is None
                else flag
                for top, flag in zip(parts, flags, strict=True)
            ]
        )
    return TopSVD(torch.cat([top.S for top in parts]), V, fell_back)


def _rows(A: Tensor, rows: slice) -> Tensor:
    """The matrices ``rows`` of the batch ``A``; ``A`` itself for all of it (a view costs a small
    matrix's call microseconds)."""
    return A if rows == _WHOLE else A[rows]


def _batch_rows(X: Tensor | None, rows: slice) -> Tensor | None:
    """``X``'s matrices ``rows`` of a batch; a 2-D ``X`` (one ``init`` for every matrix) whole."""
    return X if X is None or X.ndim == 2 else _rows(X, rows)


def _singular_values(X: Tensor) -> Tensor:
    """Singular values, descending, of a tall-skinny ``X`` (``W V``, V the Ritz vectors).

    From ``eigvalsh`` of its Gram matrix in float64, as the sharded path does: squaring there
    adds about eps64 * sigma_1^2 to each sigma_i^2, i.e. a relative eps64 (sigma_1 / sigma_i)^2
    that is under 1e-6 above the float32 rank tolerance, far below the float32 rounding of ``X``
    that any way of reading its values inherits; for 48 x 768 x 40 it takes about a third of the
    time of a Householder QR and LAPACK's SVD of R (4.8 against 13.5 ms). A float64 ``X`` has no
    wider type to square in: QR, then the singular values of R.
    """
    if X.dtype == torch.float64:
        return torch.linalg.svdvals(torch.linalg.qr(X, mode="r").R)
    X64 = X.to(torch.float64)
    return gram_singular_values(X64.mT @ X64).to(X.dtype)


def _check_options(k: int, n_oversamples: int, n_iter: int | None, method: str, tol: float) -> None:
    """The arguments every path of ``randomized_svd`` takes, checked where they enter."""
    _check_int(k, "k", minimum=1)
    _check_int(n_oversamples, "n_oversamples", minimum=0)
    if n_iter is not None:
        _check_int(n_iter, "n_iter", minimum=0)
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}, got {method!r}")
    if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 < tol < 1:
        raise ValueError(f"`tol` must be a number in (0, 1), got {tol!r}")


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
            f"`init` must have shape ({', '.join(map(str, (*batch, n)))}, j)"
            f"{f' (or ({n}, j), one start for every matrix)' if batch else ''} to fit `W` of shape "
            f"{tuple(W.shape)}, got {tuple(init.shape)}; pass `.V` of the previous call on a "
            "matrix of the same shape, or None"
        )
