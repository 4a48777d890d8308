"""Top-k singular values of a matrix whose rows (or columns) are spread over the ranks of a group.

Each rank holds a block of rows ``W_r`` of shape ``(m_r, n)`` (``m_r`` may be 0, and blocks may be
padded with zero rows); nobody holds ``W``. Because

.. math:: W^\\top W = \\sum_r W_r^\\top W_r, \\qquad \\lVert W \\rVert_F^2 = \\sum_r \\lVert W_r \\rVert_F^2,

every product of the randomized block Krylov method (Musco & Musco 2015, Algorithm 2 - the method
of ``randomized_svd``) with :math:`W^\\top W` is one local product with the rank's own rows and one
all-reduce of an ``n x b`` block, and every rank ends up with the same small projected problem.
Per matrix the ranks exchange

1. one all-reduce of 3 float64 scalars: ‖W_r‖_F² (exact, float64), the row count, the non-finite
   row count (so every rank agrees to report NaN for a matrix with a NaN anywhere);
2. one all-reduce of an ``n x b`` block per Krylov step (``b = k + n_oversamples``), ``q`` of
   them for depth ``q``; a warm start stops as soon as ``randomized_svd``'s stopping rule holds
   (often after one step), each test agreed by an all-reduce of one float64;
3. Rayleigh-Ritz on W itself, in whichever of two ways sends fewer bytes: the float64 Gram matrix
   of ``W Q`` over the whole Krylov basis ``Q`` (``b (q + 1)`` columns; its upper triangle), or
   one more block (the Rayleigh quotient of ``W^T W`` picks the top-b Ritz vectors ``V``) and the
   ``b x b`` Gram matrix of ``W V``. The first wins when ``n`` is long against ``b q``.

Against ``m n`` floats to gather the matrix, that is for a square ``d x d`` matrix at
``q = 2``, ``b = 40`` 21 % at d = 512 and 2.0 % at d = 4096; cold (``q = 5`` at 512,
``q = 8`` at 4096) 48 % and 8.6 %; ``comm_dtype=torch.bfloat16`` halves the Krylov part (12 %,
1.1 %, 24 %, 4.4 %). docs/distributed.md has measured numbers. A matrix split by columns (row-parallel tensor parallelism) is the same problem on
``W^T`` (``split="columns"``): the all-reduced blocks are then ``m x b``, and ``V`` spans the left
singular space of ``W``. A matrix sharded along both dimensions (FSDP2 over row-parallel TP on a
2-D mesh, ``split="tiles"``) needs the row and column positions of each rank's tile, and two
all-reduces per step: ``W X`` (``m x b``, each tile adds ``W[R, C] X[C]`` into rows R) and then
``W^T (W X)`` (``n x b``); it iterates in the smaller side.

The random start comes from ``generator``, which must be seeded identically on every rank (the
default is a fresh generator seeded with 0, never torch's global one): the ranks then draw the same
start block and, since the all-reduced results are the same everywhere, run the same iteration.

The building blocks (start block, orthogonalization, stopping rule) are ``functional/krylov.py``'s,
shared with ``randomized_svd``, with each product by ``W^T W`` replaced by a collective one; the
loop itself (``_krylov_blocks``) is this module's: it keeps the blocks whole for the choice of
Rayleigh-Ritz step and agrees its stop with the group.

A rank's rows may also be held as an operator (a ``functional.batch.MatrixBatch``, ``split="rows"``):
an adapted layer's local rows ``W_r = W_{0,r} + U_r V`` (LoRA on a sharded base: the base's own
shard, the rows of ``s B`` held here and the whole small ``A``) are then multiplied as
``W_{0,r} X + U_r (V X)`` inside the same iteration, never formed.

Example (one process: ``group=None`` means the local block is the whole matrix)::

    >>> W = torch.diag(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    >>> top = sharded_randomized_svd(W, 2)
    >>> top.S, top.frobenius_sq
    (tensor([4., 3.]), tensor(30., dtype=torch.float64))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from spectral_callbacks.functional.batch import MatrixBatch
from spectral_callbacks.functional.exact import from_gram_eigenvalues, gram_singular_values
from spectral_callbacks.functional.krylov import (
    orthogonalize_against,
    orthonormalize,
    ritz_residuals,
    start_block,
)
from spectral_callbacks.functional.metrics import frobenius_norm_sq
from spectral_callbacks.functional.precision import matmul as _mm
from spectral_callbacks.functional.svd import (
    DEFAULT_K,
    DEFAULT_N_OVERSAMPLES,
    DEFAULT_TOL,
    default_n_iter,
)

__all__ = ["SPLITS", "ShardedTopSVD", "sharded_randomized_svd"]

SPLITS = ("rows", "columns", "tiles")
SHARDED_METHODS = ("auto", "randomized", "gram")
# The exact path all-reduces the n x n Gram matrix: only worth it when that is no bigger than a
# few Krylov blocks, i.e. when the block would cover most of the unsplit side anyway.
_GRAM_FACTOR = 2


class ShardedTopSVD(NamedTuple):
    """The same answer on every rank of the group.

    Attributes:
        S: ``(..., k)`` singular values, descending, float32 (float64 for float64 blocks).
        V: ``(..., d, b)`` orthonormal right subspace of the split orientation (``d = n`` for
            ``split="rows"``, ``d = m`` for ``"columns"``); pass it back as ``init=`` to warm-start
            the next call. ``None`` when the exact Gram path ran.
        frobenius_sq: ``(...)`` exact float64 ‖W‖_F² (NaN where W has a non-finite entry).
        sent_bytes: payload bytes this rank put into all-reduces (gloo's ring moves about twice
            that over the wire per rank, whatever the number of ranks).
    """

    S: Tensor
    V: Tensor | None
    frobenius_sq: Tensor
    sent_bytes: int


class _Collective:
    """SUM all-reduces on one process group, counting their payload (none without a group)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.sent_bytes = 0

    def sum(self, tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The sum over the group, travelling (and rounded, also without a group) in ``dtype``."""
        sent = tensor if dtype is None else tensor.to(dtype)
        if self.group is not None:
            dist.all_reduce(sent, op=dist.ReduceOp.SUM, group=self.group)
            self.sent_bytes += sent.numel() * sent.element_size()
        return sent if dtype is None else sent.to(tensor.dtype)

    def sum_symmetric(self, gram: Tensor) -> Tensor:
        """The sum of ``(..., c, c)`` symmetric matrices, sending only their upper triangles."""
        c = gram.shape[-1]
        rows, cols = torch.triu_indices(c, c, device=gram.device)
        upper = self.sum(gram[..., rows, cols].contiguous())
        total = gram.new_zeros(gram.shape)
        total[..., rows, cols] = upper
        total[..., cols, rows] = upper
        return total


def _triangle_bytes(c: int) -> int:
    """What ``sum_symmetric`` sends for one ``c x c`` float64 matrix."""
    return c * (c + 1) // 2 * 8


def sharded_randomized_svd(
    local: Tensor | MatrixBatch,
    k: int = DEFAULT_K,
    *,
    group: Any = None,
    split: str = "rows",
    shape: tuple[int, int] | None = None,
    row_index: Tensor | None = None,
    col_index: Tensor | None = None,
    n_oversamples: int = DEFAULT_N_OVERSAMPLES,
    n_iter: int | None = None,
    generator: torch.Generator | None = None,
    init: Tensor | None = None,
    method: str = "auto",
    comm_dtype: torch.dtype | None = None,
) -> ShardedTopSVD:
    r"""Top-k singular values and exact ‖W‖_F² of a matrix split across the ranks of ``group``.

    A collective: every rank of ``group`` calls it with the same ``k``, options, ``init`` and
    equally seeded ``generator``, and its own block, in the same order as every other collective
    on ``group``.

    Args:
        local: this rank's block, ``(m_r, n)`` rows of W for ``split="rows"`` or ``(m, n_r)``
            columns for ``"columns"``, or a batch ``(B, ., .)`` of such blocks (the same ``B`` on
            every rank). ``m_r`` / ``n_r`` may be 0 and may differ between ranks; zero rows (or
            columns) added as padding change nothing but the count (pass ``shape`` then). With
            ``split="rows"`` a ``(B, m_r, n)`` operator (what it reads of a ``MatrixBatch``:
            ``shape``, ``dtype``, ``device``, ``to``, ``matmul``, ``rmatmul``,
            ``frobenius_norm_sq``, and ``dense`` on the exact Gram path) is multiplied through its
            own products.
        k: singular values to return (default 32), clamped to ``min(m, n)``.
        group: the process group the blocks are spread over, e.g. a ``dist.new_group(backend=
            "gloo", timeout=...)`` of its own (its timeout bounds how long a missing rank can
            stall the call). Default ``None``: no communication, ``local`` is the whole matrix.
        split: ``"rows"`` (default; FSDP2 and column-parallel TP, ``Shard(0)``), ``"columns"``
            (row-parallel TP, ``Shard(1)``) or ``"tiles"`` (both: FSDP2 over row-parallel TP on
            a 2-D mesh): ``local`` is then ``W[row_index][:, col_index]``, and each product costs
            two all-reduces, of an ``m x b`` and an ``n x b`` block.
        shape: the global ``(m, n)`` of W; default ``None`` sums the ranks' row (column) counts;
            required for ``"tiles"``.
        row_index, col_index: for ``"tiles"``, the rows and columns of W that ``local`` holds
            (LongTensors; the ranks' tiles must cover every entry of W exactly once).
        n_oversamples: extra block columns ``p`` (default 8), block size ``b = k + p``.
        n_iter: Krylov depth ``q``, fixed; default ``None`` picks ``randomized_svd``'s cold
            depth by shape, and with ``init`` stops earlier by ``randomized_svd``'s stopping rule
            (tested after each block, agreed by one all-reduce of a scalar). Each step is one
            all-reduce of a ``d x b`` block.
        generator: source of the Gaussian start, seeded identically on every rank. Default
            ``None``: a fresh generator seeded with 0.
        init: ``(d, j)`` or ``(B, d, j)`` start subspace, normally ``.V`` of the previous call on
            the same matrix (identical on every rank). For ``"tiles"`` ``d`` is the smaller side.
        method: ``"auto"`` (default: ``"gram"`` when the unsplit side is at most twice the block,
            else ``"randomized"``), ``"randomized"`` (block Krylov) or ``"gram"`` (exact: float64
            ``eigvalsh`` of the all-reduced ``d x d`` Gram matrix; not for ``"tiles"``, whose Gram
            matrix has cross terms between ranks).
        comm_dtype: the dtype the Krylov blocks travel in, e.g. ``torch.bfloat16`` to halve the
            bytes (the blocks only steer the subspace; the scalars and the Rayleigh-Ritz Gram
            matrix always travel in float64, so the singular values stay those of ``W V``).
            Default ``None``: the compute dtype (float32).

    Returns:
        ``ShardedTopSVD(S, V, frobenius_sq, sent_bytes)``, the same on every rank (but for
        ``sent_bytes``). A matrix with a non-finite entry on any rank gets ``S`` all NaN.

    Raises:
        TypeError: ``local`` or ``init`` is not a floating-point tensor.
        ValueError: ``local`` is not 2-D or 3-D or its unsplit side is empty, every rank's block
            is empty, ``split``/``method`` is unknown, or ``k``/``n_oversamples``/``n_iter``/
            ``init`` are out of range, or ``"tiles"`` lacks ``shape`` or an index that fits.
    """
    _check_arguments(local, k, split, method, n_oversamples, n_iter)
    tiles = _check_tiles(local, split, shape, row_index, col_index, method)
    A: Any = local.mT if isinstance(local, Tensor) and split == "columns" else local  # (..., r, c)
    if tiles is not None:
        rows_held, cols_held, m, d = tiles
        if d > m:  # iterate in the smaller side: a tile of W is a tile of W^T
            A, rows_held, cols_held, m, d = A.mT, cols_held, rows_held, d, m
        rows_held, cols_held = rows_held.to(A.device), cols_held.to(A.device)
    else:
        d = A.shape[-1]
    compute_dtype = torch.float64 if A.dtype == torch.float64 else torch.float32
    A = A.to(compute_dtype)
    if init is not None:
        _check_init(init, d, tuple(A.shape[:-2]))
    collective = _Collective(group)
    if generator is None:
        generator = torch.Generator(device=A.device).manual_seed(0)

    # 1. Scalars: exact ‖W_r‖_F² in float64, row counts, matrices or rows with a non-finite entry
    #    (a finite row sum proves a row finite); summed, they are the same on every rank.
    batch = tuple(A.shape[:-2])
    count = torch.full(batch, float(A.shape[-2]), dtype=torch.float64, device=A.device)
    if isinstance(A, Tensor):
        own_sq = frobenius_norm_sq(A)
        not_finite = (~torch.isfinite(A.sum(-1))).sum(-1).to(torch.float64)  # (...,)
    else:  # an operator: its exact ‖W_r‖_F² is NaN where a value is not finite
        own_sq = A.frobenius_norm_sq()
        not_finite = (~torch.isfinite(own_sq)).to(torch.float64)
    scalars = torch.stack([torch.nan_to_num(own_sq, nan=0.0), count, not_finite], dim=-1)
    collective.sum(scalars)  # (..., 3)
    frobenius_sq, rows, bad = scalars.unbind(-1)
    finite = bad == 0
    frobenius_sq = torch.where(finite, frobenius_sq, float("nan"))
    if tiles is None:
        m = (shape[0] if split == "rows" else shape[1]) if shape is not None else int(rows.max())
    if m == 0:
        raise ValueError(
            f"every rank's block is empty (local shape {tuple(local.shape)} here): there is no "
            "matrix to decompose; check which rows each rank passes"
        )

    k = min(k, m, d)
    width = min(k + n_oversamples, m, d)
    converged = None
    if n_iter is None:
        # A warm start tests randomized_svd's stopping rule from its first block on, up to the
        # cold depth; a cold start runs the cold depth, which a flat spectrum needs anyway.
        if init is not None and bool(torch.isfinite(init).all()):
            converged = _agreed_stopping_rule(collective, k, width, rank_scale=max(m, d))
        n_iter = default_n_iter(m, d)
    if method == "auto":
        method = "gram" if d <= _GRAM_FACTOR * width and tiles is None else "randomized"
    if method == "gram" and not isinstance(A, Tensor):
        A = A.dense(compute_dtype)  # the exact path reads every entry of the local rows
    if not bool(finite.all()):  # zero the matrices with a NaN anywhere; their S is NaN below
        A = _ZeroedWhere(A, finite) if not isinstance(A, Tensor) else _zeroed(A, finite)
    times, times_t = _products(A)

    if method == "gram":
        A64 = A.to(torch.float64)  # one float64 copy of the shard, read on both sides
        gram = A64.mT @ A64  # (..., d, d)
        S = gram_singular_values(collective.sum(gram)).to(compute_dtype)
        V = None
    elif tiles is None:

        def apply(X: Tensor) -> Tensor:  # (W^T W) X = sum_r W_r^T (W_r X), one all-reduce
            return collective.sum(times_t(times(X)), comm_dtype)

        start = start_block(A, width, generator, init, n=d)  # (..., d, b)
        blocks, images, ritz = _krylov_blocks(apply, start, n_iter, converged)
        block_bytes = d * width * (comm_dtype or compute_dtype).itemsize
        columns = sum(block.shape[-1] for block in blocks)
        if ritz is not None:  # stopped by the rule, on the Ritz vectors it tested
            basis = ritz
        elif _triangle_bytes(columns) < block_bytes + _triangle_bytes(width):
            # 3a. Rayleigh-Ritz on W over the whole Krylov basis: the float64 Gram of the local
            #     rows of W Q costs less to send than the last block (the unsplit side is long).
            basis = torch.cat(blocks, -1)  # (..., d, b (q + 1))
        else:
            # 3b. One more block gives the Rayleigh quotient of W^T W, whose top-b Ritz vectors
            #     V are kept; Rayleigh-Ritz on W then needs only the b x b Gram of W V.
            basis = _top_ritz_vectors(blocks, [*images, apply(blocks[-1])], width)
        image = times(basis).to(torch.float64)  # (..., r, columns of basis)
        gram = collective.sum_symmetric(image.mT @ image)
    else:

        def product(X: Tensor, dtype: torch.dtype | None) -> Tensor:  # W X, (..., m, b)
            # Each tile adds W[R, C] X[C] into rows R.
            local = _mm(A, X.index_select(-2, cols_held))
            return collective.sum(_spread(local, rows_held, m), dtype)

        def apply(X: Tensor) -> Tensor:  # W^T (W X): each tile adds W[R, C]^T (W X)[R]
            image = product(X, comm_dtype).index_select(-2, rows_held)
            return collective.sum(_spread(_mm(A.mT, image), cols_held, d), comm_dtype)

        start = start_block(A, width, generator, init, n=d)
        blocks, images, ritz = _krylov_blocks(apply, start, n_iter, converged)
        if ritz is None:
            ritz = _top_ritz_vectors(blocks, [*images, apply(blocks[-1])], width)
        basis = ritz
        # (..., m, b): the whole W V on every rank, summed in float64 (the values come from it).
        local_image = _mm(A, basis.index_select(-2, cols_held)).to(torch.float64)
        image = collective.sum(_spread(local_image, rows_held, m))
        gram = image.mT @ image
    if method != "gram":  # Ritz values and the top-b Ritz vectors of the Gram of W basis
        values, vectors = torch.linalg.eigh((gram + gram.mT) / 2)  # ascending
        S = from_gram_eigenvalues(values).to(compute_dtype)
        V = _mm(basis, vectors.flip(-1)[..., :width].to(compute_dtype))
    S = S[..., :k]
    # As randomized_svd: values below the rank tolerance are rounding noise, reported as 0.
    tol = max(m, d) * torch.finfo(compute_dtype).eps * S[..., :1]
    S = torch.where(tol < S, S, torch.zeros((), dtype=S.dtype, device=S.device))
    S = torch.where(
        finite[..., None], S, torch.full((), float("nan"), dtype=S.dtype, device=S.device)
    )
    return ShardedTopSVD(S, V, frobenius_sq, collective.sent_bytes)


def _zeroed(A: Tensor, finite: Tensor) -> Tensor:
    return torch.where(finite[..., None, None], A, 0.0)


class _ZeroedWhere:
    """An operator whose matrices with a non-finite entry anywhere (on any rank) multiply as zero."""

    def __init__(self, A: MatrixBatch, finite: Tensor) -> None:
        self.A, self.finite = A, finite[..., None, None]
        self.shape, self.dtype, self.device = A.shape, A.dtype, A.device

    def matmul(self, X: Tensor, mm: Any = _mm) -> Tensor:
        return torch.where(self.finite, torch.nan_to_num(self.A.matmul(X, mm)), 0.0)

    def rmatmul(self, Y: Tensor, mm: Any = _mm) -> Tensor:
        return torch.where(self.finite, torch.nan_to_num(self.A.rmatmul(Y, mm)), 0.0)


def _products(A: Any) -> tuple[Any, Any]:
    """``X -> A X`` and ``Y -> A^T Y`` of the local rows (a tensor, or an operator's own products)."""
    if isinstance(A, Tensor):
        return (lambda X: _mm(A, X)), (lambda Y: _mm(A.mT, Y))
    return (lambda X: A.matmul(X, _mm)), (lambda Y: A.rmatmul(Y, _mm))


def _krylov_blocks(
    apply: Any, start: Tensor, depth: int, converged: Any = None
) -> tuple[list[Tensor], list[Tensor], Tensor | None]:
    """Orthonormal blocks ``Q_0 .. Q_j`` of the block Krylov space of ``apply`` (Musco & Musco
    2015, Alg. 2) from the orthonormal ``start``, the images ``apply(Q_i)``, and the top Ritz
    vectors if ``converged`` stopped the loop.

    2. The same loop as svd.py's: ``apply`` is collective, everything else is replicated math on
    identical inputs, so every rank builds the same basis. ``converged`` (blocks, images -> the
    top Ritz vectors or None, agreed by every rank) is tested after each image and stops the loop
    as soon as it returns vectors; otherwise the loop runs ``depth`` steps and the last block has
    no image.
    """
    d = start.shape[-2]
    blocks = [orthonormalize(start)]  # Q_0
    images: list[Tensor] = []  # apply(Q_i): one all-reduce each, reused by a Rayleigh quotient
    for _ in range(depth):
        room = d - sum(block.shape[-1] for block in blocks)
        if room <= 0:  # the basis spans R^d: Rayleigh-Ritz is exact
            break
        images.append(apply(blocks[-1]))
        ritz = None if converged is None else converged(blocks, images)
        if ritz is not None:
            return blocks, images, ritz
        blocks.append(orthogonalize_against(images[-1], blocks)[..., :room])
    return blocks, images, None


def _agreed_stopping_rule(collective: _Collective, k: int, b: int, *, rank_scale: int) -> Any:
    """randomized_svd's stopping rule on the Ritz pairs of the Krylov basis, agreed by the group:
    the top-b Ritz vectors once it holds on every rank, else None.

    The rule runs on all-reduced (identical) images on every rank, so the ranks should agree
    anyway; summing their counts of unconverged matrices makes it exact whatever rounding one
    rank's BLAS adds (a rank stopping alone would desynchronize every later collective).
    """

    def converged(blocks: list[Tensor], images: list[Tensor]) -> Tensor | None:
        basis, theta, vectors = _ritz_pairs(blocks, images, b)
        _, excess = ritz_residuals(blocks, images, vectors, theta, k, DEFAULT_TOL, rank_scale)
        done = (excess <= 1).all(-1)
        pending = collective.sum((~done).sum().to(torch.float64).reshape(1))
        return _mm(basis, vectors) if pending.item() == 0 else None

    return converged


def _ritz_pairs(
    blocks: list[Tensor], images: list[Tensor], b: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The basis and the top-b Ritz values and vectors (in the basis, descending) of the Rayleigh
    quotient of ``apply`` on it, given ``apply`` of every block."""
    basis = torch.cat(blocks, -1)  # (..., d, b (depth + 1))
    T = _mm(basis.mT, torch.cat(images, -1))
    theta, vectors = torch.linalg.eigh((T + T.mT) / 2)  # ascending
    return basis, theta[..., -b:].flip(-1), vectors[..., -b:].flip(-1)


def _top_ritz_vectors(blocks: list[Tensor], images: list[Tensor], b: int) -> Tensor:
    """The top-b Ritz vectors of the Rayleigh quotient of ``apply`` on the Krylov basis."""
    basis, _, vectors = _ritz_pairs(blocks, images, b)
    return _mm(basis, vectors)


def _spread(local: Tensor, index: Tensor, size: int) -> Tensor:
    """``(..., size, b)`` zeros with ``local``'s rows placed at ``index`` (a tile's share of a sum)."""
    out = local.new_zeros((*local.shape[:-2], size, local.shape[-1]))
    return out.index_copy_(-2, index, local)


def _check_arguments(
    local: object, k: object, split: str, method: str, n_oversamples: object, n_iter: object
) -> None:
    if not isinstance(local, Tensor) and callable(getattr(local, "rmatmul", None)):
        shape = tuple(getattr(local, "shape", ()))
        if split != "rows" or len(shape) != 3:
            raise ValueError(
                f"a `local` operator ({type(local).__name__}) must be a (B, m_r, n) batch split "
                f'by rows, got shape {shape} and split={split!r}; pass "rows"'
            )
        return
    if not isinstance(local, Tensor) or not local.is_floating_point():
        raise TypeError(
            f"`local` must be a floating-point torch.Tensor, got {type(local).__name__}"
            + (f" of {local.dtype}" if isinstance(local, Tensor) else "")
        )
    if local.ndim not in (2, 3):
        raise ValueError(
            f"`local` must be a 2-D block or a 3-D batch of blocks, got shape {tuple(local.shape)}"
        )
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
    if method not in SHARDED_METHODS:
        raise ValueError(f"`method` must be one of {SHARDED_METHODS}, got {method!r}")
    unsplit = {"rows": local.shape[-1], "columns": local.shape[-2]}.get(split, 1)
    if unsplit == 0:
        raise ValueError(
            f"`local` of shape {tuple(local.shape)} split by {split} has an empty unsplit side"
        )
    for name, value, minimum in (("k", k, 1), ("n_oversamples", n_oversamples, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")
    if n_iter is not None and (
        isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0
    ):
        raise ValueError(f"`n_iter` must be an int >= 0 or None, got {n_iter!r}")


def _check_tiles(
    local: Tensor | MatrixBatch,
    split: str,
    shape: tuple[int, int] | None,
    row_index: Tensor | None,
    col_index: Tensor | None,
    method: str,
) -> tuple[Tensor, Tensor, int, int] | None:
    """``(rows, columns, m, n)`` of a tile, checked; ``None`` for the other splits."""
    if split != "tiles":
        return None
    if shape is None or row_index is None or col_index is None or method == "gram":
        raise ValueError(
            '`split="tiles"` needs `shape`, `row_index` and `col_index`, and a randomized '
            f"`method`; got shape={shape!r}, method={method!r}"
        )
    if (len(row_index), len(col_index)) != tuple(local.shape[-2:]):
        raise ValueError(
            f"`row_index` and `col_index` must have {tuple(local.shape[-2:])} entries for a "
            f"tile of shape {tuple(local.shape)}, got {len(row_index)} and {len(col_index)}"
        )
    return row_index.long(), col_index.long(), int(shape[0]), int(shape[1])


def _check_init(init: object, d: int, batch: tuple[int, ...]) -> None:
    if not isinstance(init, Tensor) or not init.is_floating_point():
        raise TypeError(f"`init` must be a floating-point torch.Tensor, got {init!r:.60}")
    ok = init.ndim in (2, 3) and init.shape[-2] == d and init.shape[-1] >= 1
    if not ok or (init.ndim == 3 and tuple(init.shape[:-2]) != batch):
        raise ValueError(
            f"`init` must have shape ({d}, j) or {(*batch, d, 'j')} for this matrix, got "
            f"{tuple(init.shape)}; pass `.V` of the previous call on the same matrix, or None"
        )
