r"""Per-head QK and OV circuits of an attention layer, exact from their ``d_h``-wide factors.

Head :math:`h` of an attention layer (Elhage et al. 2021, "A Mathematical Framework for Transformer
Circuits") reads its attention logits through the QK circuit and writes to the residual stream
through the OV circuit:

.. math::

    W_{QK}^h = W_Q^{h\top} W_K^{g(h)}, \qquad W_{OV}^h = W_O^h W_V^{g(h)},

with :math:`W_Q^h, W_K^g, W_V^g` the ``(d_h, d)`` rows of head :math:`h` (K/V head :math:`g(h)`
of its group under GQA/MQA), :math:`W_O^h` the ``(d, d_h)`` columns of the output projection.
Both are ``d x d`` of rank at most ``d_h``. The logit of head :math:`h` between tokens i and j is
:math:`s\,(W_Q^h x_i + b_Q^h)^\top P_{ij} (W_K^{g} x_j + b_K^{g})`, with :math:`s` the logit scale
the attention applies (:math:`1/\sqrt{d_h}` is only SDPA's default), :math:`b` the projections'
biases and :math:`P_{ij}` the rotation RoPE puts between them (the identity without RoPE). Writing
each projection with its bias as one map on :math:`\tilde x = [x; 1]`,
:math:`\tilde W = [W \; b]`,

.. math::

    |\mathrm{logit}_{ij}| \le s\,\sigma_1(\tilde W_Q^{h\top} \tilde W_K^{g})
        \lVert \tilde x_i \rVert \lVert \tilde x_j \rVert \ \text{(no rotation)}, \qquad
    |\mathrm{logit}_{ij}| \le s\,\lVert \tilde W_Q^h \rVert_2 \lVert \tilde W_K^g \rVert_2
        \lVert \tilde x_i \rVert \lVert \tilde x_j \rVert \ \text{(any rotation)},

``qk_logit_bound`` is the one that holds (``rotary`` says which); ``qk_spectral_norm`` is
:math:`s\,\sigma_1(W_{QK}^h)` of the weights alone, the circuit at relative distance 0.

The spectrum of a product :math:`A B^\top` of tall factors (``(..., m, r)`` and ``(..., n, r)``)
is exact without an ``m x n`` matrix: with reduced QRs :math:`A = Q_A R_A` and
:math:`B = Q_B R_B`, :math:`A B^\top = Q_A (R_A R_B^\top) Q_B^\top`, so its nonzero singular values
are those of the ``r x r`` matrix :math:`R_A R_B^\top` (the same path as the LoRA update in
``lowrank.low_rank_singular_values``, batched over heads). Cost :math:`O((m + n) r^2)` per head;
R is taken as the Cholesky factor of the Gram matrix :math:`A^\top A` (a GEMM, several times
faster than a Householder QR of A), or from the QR where that Gram is ill-conditioned.
``circuit_singular_values`` works in float64. ``circuit_metrics``, which needs only σ₁ and the
Frobenius norm of each core, works in float32 on float32 or half-precision weights (the precision
of the spectra's Krylov products): their relative error is at most about
:math:`\epsilon_{32} \kappa(A)^2`, and a factor whose Cholesky diagonal shows a :math:`\kappa`
past :math:`\epsilon_{32} \kappa^2 = 10^{-3}` (or whose Gram is singular in float32) is redone
in float64.

Example::

    >>> torch.manual_seed(0) and None
    >>> q, k = torch.randn(2 * 4, 6), torch.randn(2 * 4, 6)  # 2 heads of d_h = 4, d = 6
    >>> S = circuit_singular_values(query_factors(q, 2), key_factors(k, 2, 2))
    >>> formed = q[:4].double().T @ k[:4].double()  # head 0's (6, 6) product, for the check
    >>> torch.allclose(S[0], torch.linalg.svdvals(formed)[:4])
    True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "CIRCUIT_METRICS",
    "augmented",
    "circuit_metrics",
    "circuit_singular_values",
    "key_factors",
    "output_factors",
    "qk_norm_logit_bound",
    "query_factors",
]

#: The per-head metrics, logged as ``spectral_<name>`` (docs/logged-names.md).
CIRCUIT_METRICS: tuple[str, ...] = (
    "qk_spectral_norm",
    "qk_logit_bound",
    "qk_norm_logit_bound",
    "qk_stable_rank",
    "ov_spectral_norm",
    "ov_stable_rank",
)


def circuit_singular_values(left: Tensor, right: Tensor) -> Tensor:
    r"""Exact singular values of each :math:`A B^\top`, float64, descending, never forming it.

    .. math:: A B^\top = Q_A (R_A R_B^\top) Q_B^\top, \quad
        \sigma(A B^\top) = \sigma(R_A R_B^\top) \text{ (reduced QRs of } A, B)

    Args:
        left: ``(..., m, r)`` factors :math:`A`.
        right: ``(..., n, r)`` factors :math:`B` (the same batch shape and ``r``).

    Returns:
        ``(..., min(m, n, r))`` float64: every nonzero singular value of :math:`A B^\top` (its rank
        is at most ``r``), zeros where it has fewer.

    Raises:
        ValueError: the factors' batch shapes or widths ``r`` differ.

    Example::

        >>> A = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # (3, 2)
        >>> circuit_singular_values(A, torch.eye(2))
        tensor([3., 1.], dtype=torch.float64)
    """
    if left.shape[:-2] != right.shape[:-2] or left.shape[-1] != right.shape[-1]:
        raise ValueError(
            "`left` (..., m, r) and `right` (..., n, r) must share the batch shape and r, got "
            f"{tuple(left.shape)!r} and {tuple(right.shape)!r}"
        )
    # 1. The (r, r) triangle of each tall factor; 2. the small core R_A R_B^T has the nonzero
    # spectrum of A B^T.
    return torch.linalg.svdvals(_triangle(left) @ _triangle(right).mT)  # (..., min(m, n, r))


#: A factor whose Cholesky diagonal spans more than this ratio takes the QR: the Gram route loses
#: relative accuracy on its small singular values as eps * cond(A)^2 (float64: about 1e-8 here).
_GRAM_CONDITION = 1e4

#: float32 keeps a factor whose diagonal spread (a lower estimate of cond(R)) stays under this:
#: eps32 * cond^2 <= 1e-3, the spectra's own warm error, bounds the logged values' relative error.
_FLOAT32_CONDITION = math.sqrt(1e-3 / torch.finfo(torch.float32).eps)  # about 92


def _triangle(factor: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    r"""An ``(..., r, r)`` upper triangle :math:`R` with :math:`R^\top R = A^\top A` (the R of
    A's reduced QR, up to signs), in ``dtype`` (float32 or float64).

    The Cholesky factor of the Gram matrix :math:`A^\top A` is that R and costs a GEMM and an
    ``r x r`` factorization (about a fifth of a Householder QR of the tall A, measured at
    768 x 64). In float64, a factor whose Gram is singular or ill-conditioned (a zero-initialized
    projection, a rank-deficient head) takes the QR instead; in float32, such a factor is redone
    in float64 (and the result is float64 for the whole batch).
    """
    A = factor.detach().to(dtype)
    if A.shape[-2] < A.shape[-1]:  # wide: the QR's R is (m, r), no Gram shortcut
        return torch.linalg.qr(A.double(), mode="r").R
    L, info = torch.linalg.cholesky_ex(A.mT @ A)  # (..., r, r) lower, A^T A = L L^T
    diagonal = L.diagonal(dim1=-2, dim2=-1)
    limit = _GRAM_CONDITION if dtype == torch.float64 else _FLOAT32_CONDITION
    spread = diagonal.amin(-1) * limit <= diagonal.amax(-1)
    poor = (info != 0) | spread | ~diagonal.isfinite().all(-1)
    R = L.mT
    if not poor.any():
        return R
    R = R.double()  # float64 (a copy of a float32 R; L itself is ours): poor heads redone below
    if dtype == torch.float64:
        R[poor] = torch.linalg.qr(A[poor], mode="r").R
    else:
        R[poor] = _triangle(factor.detach()[poor], torch.float64)
    return R


def query_factors(query: Tensor, num_heads: int) -> Tensor:
    r"""The ``(H, d, d_h)`` factors :math:`W_Q^{h\top}` of a ``(H * d_h, d)`` query projection whose
    rows are head-major (head 0's ``d_h`` rows first).

    >>> query_factors(torch.arange(8.0).reshape(4, 2), 2)[1]  # head 1: rows 2, 3, transposed
    tensor([[4., 6.],
            [5., 7.]])
    """
    rows, d = query.shape[-2:]
    _check_heads(rows, num_heads, "query")
    return query.reshape(*query.shape[:-2], num_heads, rows // num_heads, d).mT  # (..., H, d, d_h)


def key_factors(key: Tensor, num_kv_heads: int, num_heads: int) -> Tensor:
    r"""The ``(H, d, d_h)`` factors :math:`W_K^{g(h)\top}` (or :math:`W_V^{g(h)\top}`) of a
    ``(G * d_h, d)`` key (value) projection, repeated for the ``H / G`` query heads of each group.

    GQA (Ainslie et al. 2023) groups query heads ``g * H/G .. (g + 1) * H/G - 1`` on K/V head ``g``
    (as ``repeat_interleave`` does in the model's forward); MQA is ``G = 1``, MHA ``G = H``.

    >>> key_factors(torch.arange(4.0).reshape(2, 2), 1, 3).shape  # MQA: one head for 3 queries
    torch.Size([3, 2, 2])
    """
    rows, d = key.shape[-2:]
    _check_heads(rows, num_kv_heads, "key/value")
    group = _check_groups(num_heads, num_kv_heads)
    factors = key.reshape(*key.shape[:-2], num_kv_heads, rows // num_kv_heads, d).mT
    if group == 1:  # MHA: each query head has its own K/V head, a view (no copy)
        return factors
    return factors.repeat_interleave(group, dim=-3)  # (..., H, d, d_h)


def output_factors(output: Tensor, num_heads: int) -> Tensor:
    r"""The ``(H, d, d_h)`` factors :math:`W_O^h` of a ``(d, H * d_h)`` output projection (head
    ``h`` reads columns ``h * d_h .. (h + 1) * d_h - 1``).

    >>> output_factors(torch.arange(8.0).reshape(2, 4), 2)[1]  # head 1: columns 2, 3
    tensor([[2., 3.],
            [6., 7.]])
    """
    d, columns = output.shape[-2:]
    _check_heads(columns, num_heads, "output")
    return output.reshape(*output.shape[:-2], d, num_heads, columns // num_heads).movedim(-2, -3)


def augmented(weight: Tensor, bias: Tensor | None) -> Tensor:
    r"""The ``(..., rows, d + 1)`` map :math:`\tilde W = [W \; b]` on :math:`[x; 1]`, which is
    :math:`W x + b`: a projection's bias folded in as one more input column (``weight`` itself
    where there is no bias).

    >>> augmented(torch.eye(2), torch.tensor([5.0, 6.0])) @ torch.tensor([1.0, 2.0, 1.0])
    tensor([6., 8.])
    """
    if bias is None:
        return weight
    return torch.cat([weight, bias.to(weight.dtype).unsqueeze(-1)], dim=-1)


def circuit_metrics(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    scale: float | None = None,
    query_bias: Tensor | None = None,
    key_bias: Tensor | None = None,
    rotary: bool = False,
) -> dict[str, Tensor]:
    r"""Per head: ``qk_spectral_norm``, ``qk_logit_bound``, ``qk_stable_rank``,
    ``ov_spectral_norm``, ``ov_stable_rank``.

    .. math::

        \mathrm{qk\_spectral\_norm}_h = s\,\sigma_1(W_{QK}^h), \quad
        \mathrm{qk\_stable\_rank}_h = \frac{\sum_i \sigma_i(W_{QK}^h)^2}{\sigma_1(W_{QK}^h)^2},

    and likewise for :math:`W_{OV}^h` (its norm unscaled); the spectra are complete (rank at most
    ``d_h``), so the Frobenius norms are exact sums. Computed in float64 where any input is
    float64, else in float32 with a float64 redo of each factor float32 cannot carry (module
    docstring). ``qk_logit_bound`` bounds
    :math:`|\mathrm{logit}_{ij}| / (\lVert \tilde x_i \rVert \lVert \tilde x_j \rVert)` (module
    docstring): :math:`s\,\sigma_1(\tilde W_Q^{h\top} \tilde W_K^g)` without a rotation between
    the factors, :math:`s\,\lVert \tilde W_Q^h \rVert_2 \lVert \tilde W_K^g \rVert_2` with one
    (``rotary``); without biases :math:`\tilde x = x`.

    Args:
        query: ``(..., H * d_h, d)`` query rows, head-major.
        key: ``(..., G * d_h, d)`` key rows.
        value: ``(..., G * d_v, d)`` value rows.
        output: ``(..., d, H * d_v)`` output projection.
        num_heads: ``H`` query heads.
        num_kv_heads: ``G`` K/V heads (``H`` for MHA, 1 for MQA).
        scale: the logit scale the attention applies; default ``None`` is SDPA's default,
            ``1 / sqrt(d_h)`` (give the module's own wherever it sets one).
        query_bias: ``(..., H * d_h)`` the query projection's bias; default ``None`` (none).
        key_bias: ``(..., G * d_h)`` the key projection's bias; default ``None`` (none).
        rotary: a position-dependent rotation (RoPE) acts between the query and the key; default
            ``False``.

    Returns:
        metric name -> ``(..., H)`` float64.

    Example::

        >>> eye = torch.eye(4)
        >>> out = circuit_metrics(2 * eye, eye, eye, eye, num_heads=2, num_kv_heads=2)
        >>> out["qk_spectral_norm"], out["qk_stable_rank"]  # sigma = (2, 2), d_h = 2
        (tensor([1.4142, 1.4142], dtype=torch.float64), tensor([2., 2.], dtype=torch.float64))
        >>> biased = circuit_metrics(2 * eye, eye, eye, eye, 2, 2, key_bias=torch.ones(4))
        >>> biased["qk_logit_bound"]  # 2 * sigma_1([I  1]) / sqrt(2) = 2 sqrt(3) / sqrt(2)
        tensor([2.4495, 2.4495], dtype=torch.float64)
    """
    head_dim = query.shape[-2] // num_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = _check_groups(num_heads, num_kv_heads)
    # Only sigma_1 and Frobenius norms are logged, whose relative error the float32 Gram route
    # bounds by eps32 * cond^2 (checked per factor in _triangle): float64 only for float64 weights.
    float64 = any(part.dtype == torch.float64 for part in (query, key, value, output))
    dtype = torch.float64 if float64 else torch.float32

    def triangle(factor: Tensor) -> Tensor:
        return _triangle(factor, dtype)

    def shared(factor: Tensor) -> Tensor:
        # A K/V head's triangle once, then for each query head of its group (GQA, MQA).
        R = triangle(key_factors(factor, num_kv_heads, num_kv_heads))
        return R if group == 1 else R.repeat_interleave(group, dim=-3)

    R_query, R_key = triangle(query_factors(query, num_heads)), shared(key)
    R_output = triangle(output_factors(output, num_heads))
    # Only sigma_1 and the Frobenius norm of each d_h x d_h core are logged: no full spectrum.
    qk_norm, qk_frobenius = _norms(_core(R_query, R_key))  # (..., H) each
    ov_norm, ov_frobenius = _norms(_core(R_output, shared(value)))
    if query_bias is not None or key_bias is not None:
        # The biases as one more input column of each factor: the same d_h x d_h cores.
        R_query = triangle(query_factors(augmented(query, query_bias), num_heads))
        R_key = shared(augmented(key, key_bias))
    if rotary:  # a rotation between the factors: only their norms bound the product
        bound = _norms(R_query)[0] * _norms(R_key)[0]
    elif query_bias is None and key_bias is None:
        bound = qk_norm
    else:
        bound = _norms(_core(R_query, R_key))[0]
    metrics = {
        "qk_spectral_norm": scale * qk_norm,
        "qk_logit_bound": scale * bound,
        "qk_stable_rank": _stable_rank(qk_norm, qk_frobenius),
        "ov_spectral_norm": ov_norm,
        "ov_stable_rank": _stable_rank(ov_norm, ov_frobenius),
    }
    return {name: value.double() for name, value in metrics.items()}


def qk_norm_logit_bound(scale: float, query_norm: Tensor, key_norm: Tensor) -> Tensor:
    r"""The bound on :math:`|\mathrm{logit}_{ij}|` whatever the inputs, of an attention whose
    query and key are normalized (QK-norm) before their product.

    A normalization of width :math:`n` with gain :math:`\gamma` and shift :math:`\beta` (RMSNorm:
    :math:`\beta = 0`; LayerNorm) writes :math:`\gamma \odot u + \beta` with
    :math:`\lVert u \rVert \le \sqrt{n}` (:math:`u = y / \sqrt{\mathrm{mean}(y^2) + \epsilon}`, or
    centred), so each head's normalized query or key has norm at most
    :math:`\max|\gamma| \sqrt{n} + \lVert \beta \rVert`, a rotation after it (RoPE) changes no
    norm, and

    .. math:: |\mathrm{logit}_{ij}| \le s\,(\max|\gamma_Q| \sqrt{n_Q} + \lVert \beta_Q \rVert)
        (\max|\gamma_K| \sqrt{n_K} + \lVert \beta_K \rVert).

    Args:
        scale: the logit scale :math:`s`.
        query_norm: ``(..., 2, n_Q)``: the query norm's effective gain :math:`\gamma` and shift
            :math:`\beta` (zeros for RMSNorm).
        key_norm: ``(..., 2, n_K)``: the key norm's.

    Returns:
        ``(...)`` float64.

    >>> gain_and_shift = torch.stack([torch.full((4,), 2.0), torch.zeros(4)])
    >>> qk_norm_logit_bound(0.5, gain_and_shift, gain_and_shift)  # 0.5 * (2 * 2) ** 2
    tensor(8., dtype=torch.float64)
    """

    def largest(norm: Tensor) -> Tensor:
        gain, shift = norm.double().unbind(-2)
        return gain.abs().amax(-1) * math.sqrt(gain.shape[-1]) + shift.norm(dim=-1)

    return scale * largest(query_norm) * largest(key_norm)


def _core(left: Tensor, right: Tensor) -> Tensor:
    r""":math:`R_A R_B^\top` of two ``(..., r, r)`` triangles, in the wider of their dtypes (one
    may have been redone in float64)."""
    dtype = torch.promote_types(left.dtype, right.dtype)
    return left.to(dtype) @ right.to(dtype).mT


def _norms(core: Tensor) -> tuple[Tensor, Tensor]:
    r"""σ₁ and the squared Frobenius norm of each ``(..., r, r)`` matrix :math:`M`, in its dtype.

    σ₁² is the largest eigenvalue of the symmetric :math:`M M^\top` (values only: about half the
    time of ``svdvals`` at r = 64); its absolute error is :math:`O(\epsilon \lVert M \rVert_2^2)`,
    so σ₁ keeps the dtype's relative accuracy. The squared Frobenius norm is the sum of squares.
    """
    top = torch.linalg.eigvalsh(core @ core.mT)[..., -1].clamp_min(0.0)
    return top.sqrt(), core.square().sum((-2, -1))


def _stable_rank(norm: Tensor, frobenius: Tensor) -> Tensor:
    """``||M||_F^2 / sigma_1^2`` of each matrix; NaN for a zero circuit."""
    top = norm.square()
    return torch.where(top > 0, frobenius / top, torch.full_like(top, float("nan")))


def _check_groups(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per K/V head, or a ValueError where they do not group."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"`num_heads` ({num_heads}) must be a multiple of the K/V heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads


def _check_heads(size: int, heads: int, what: str) -> None:
    if not isinstance(heads, int) or heads < 1 or size % heads:
        raise ValueError(
            f"the {what} projection's {size} head channels do not split into {heads!r} heads: "
            "give the head count of this layer (heads=...)"
        )
