r"""Matrices held as a frozen base plus a low-rank update, and the exact spectrum of the update.

An adapted layer (PEFT LoRA and kin) computes with the effective weight

.. math:: W = D\,(W_0 + U V), \qquad U \in \mathbb{R}^{m \times r},\ V \in \mathbb{R}^{r \times n}

where :math:`W_0` is the frozen base, :math:`U V = s\,B A` the adapter's update (the scaling
:math:`s` folded into :math:`U`) and :math:`D` the identity, or for DoRA the diagonal
:math:`\mathrm{diag}(g / \lVert (W_0 + U V)_{i,:} \rVert)` of the magnitude vector :math:`g` over
the row norms. ``AdaptedMatrices`` holds a batch of such matrices without ever forming one: the
Krylov products of ``randomized_svd`` are :math:`W X = D (W_0 X + U (V X))` and
:math:`W^\top Y = W_0^\top (D Y) + V^\top (U^\top (D Y))`, on the base itself (a live parameter, not
a copy), and :math:`\lVert W \rVert_F^2` is exact from :math:`r`-sized products.

The update :math:`U V` has at most :math:`r` nonzero singular values, found exactly without an
:math:`m \times n` matrix (``low_rank_singular_values``): with :math:`U = Q_U R_U` and
:math:`V^\top = Q_V R_V` (reduced QR), :math:`U V = Q_U (R_U R_V^\top) Q_V^\top`, so the singular
values of :math:`U V` are those of the :math:`r \times r` matrix :math:`R_U R_V^\top`.

Example::

    >>> torch.manual_seed(0) and None
    >>> base, U, V = torch.randn(6, 5), torch.randn(6, 2), torch.randn(2, 5)
    >>> batch = AdaptedMatrices((base,), (U,), (V,))
    >>> X = torch.randn(1, 5, 3)
    >>> torch.allclose(batch.matmul(X)[0], (base + U @ V) @ X[0], atol=1e-5)
    True
    >>> S = low_rank_singular_values([U], [V])
    >>> torch.allclose(S[0], torch.linalg.svdvals((U @ V).double())[:2])
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from spectral_callbacks.functional.batch import Matmul, UpdateSpectrum

__all__ = ["AdaptedMatrices", "low_rank_singular_values"]


@dataclass
class AdaptedMatrices:
    """A batch of effective weights :math:`W_i = D_i (W_{0,i} + U_i V_i)` held as factors.

    Tensor-like where the engine needs it (``shape``, ``dtype``, ``device``, ``float()``,
    slicing, ``record_stream``), so a snapshot can hold it in place of a ``(B, m, n)`` stack.

    Attributes:
        bases: ``(m, n)`` each; the live frozen base (a view of the parameter, never copied) or, for
            a base that changes (merged into, or trained) or is whole only inside an FSDP1 /
            ZeRO-3 gather, a copy.
        ups: ``(m, r_i)`` each, the scaling folded in (copies).
        downs: ``(r_i, n)`` each (copies).
        magnitudes: ``(m,)`` DoRA magnitude vectors, or ``None`` (copies).
        adds: per matrix, whether ``U V`` is added to the base (``False``: the base already holds
            it, as in a merged layer; the update family still reads ``U V``).
        owned: the tensors this batch copied (what a snapshot costs in memory).
    """

    bases: tuple[Tensor, ...]
    ups: tuple[Tensor, ...]
    downs: tuple[Tensor, ...]
    magnitudes: tuple[Tensor | None, ...] | None = None
    adds: tuple[bool, ...] | None = None
    owned: tuple[Tensor, ...] = field(default=(), repr=False)
    _scales: list[Tensor | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        count = len(self.bases)
        if self.magnitudes is None:
            self.magnitudes = (None,) * count
        if self.adds is None:
            self.adds = (True,) * count
        if not count or not len(self.ups) == len(self.downs) == len(self.magnitudes) == count:
            raise ValueError(f"AdaptedMatrices needs one base, up, down per matrix, got {count}")

    # --- tensor-like --------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.bases), *self.bases[0].shape))

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self) -> torch.dtype:
        return self.ups[0].dtype

    @property
    def device(self) -> torch.device:
        return self.ups[0].device

    @property
    def nbytes(self) -> int:
        """Bytes this batch copied (the factors, and a base only where it had to be copied)."""
        return sum(t.numel() * t.element_size() for t in self.owned)

    def __len__(self) -> int:
        return len(self.bases)

    def __getitem__(self, index: slice) -> AdaptedMatrices:
        assert self.magnitudes is not None and self.adds is not None
        return AdaptedMatrices(
            self.bases[index],
            self.ups[index],
            self.downs[index],
            self.magnitudes[index],
            self.adds[index],
        )

    def to(self, dtype: torch.dtype) -> AdaptedMatrices:
        """The factors in ``dtype`` (the bases stay as they are: converted per product)."""
        if dtype == self.dtype:
            return self
        assert self.magnitudes is not None
        return replace(
            self,
            ups=tuple(u.to(dtype) for u in self.ups),
            downs=tuple(v.to(dtype) for v in self.downs),
            magnitudes=tuple(None if g is None else g.to(dtype) for g in self.magnitudes),
            _scales=None,
        )

    def float(self) -> AdaptedMatrices:
        return self.to(torch.float32)

    def record_stream(self, stream: Any) -> None:
        """Mark the copies as in use on ``stream`` (the caching allocator then waits for it)."""
        for tensor in self.owned:
            tensor.record_stream(stream)

    # --- the operator -------------------------------------------------------------------------

    def _base(self, i: int, dtype: torch.dtype) -> Tensor:
        # A bf16/fp16 base is converted one matrix at a time, in the worker: never a batch copy.
        base = self.bases[i].detach()
        return base if base.dtype == dtype else base.to(dtype)

    def _scale(self, i: int, mm: Matmul) -> Tensor | None:
        """DoRA's row scale ``g / ||(W_0 + U V)_i||``, from r-sized products (computed once)."""
        if self._scales is None:
            self._scales = [None] * len(self)
        assert self.magnitudes is not None and self.adds is not None
        g = self.magnitudes[i]
        if g is None or not self.adds[i]:
            return None
        if self._scales[i] is None:
            rows = self._row_norms_sq(i, mm)
            self._scales[i] = (g.double() / rows.sqrt()).to(self.dtype)
        return self._scales[i]

    def _row_norms_sq(self, i: int, mm: Matmul) -> Tensor:
        """``||(W_0 + U V)_{j,:}||^2`` per row j, float64: ``||W_0 j||^2 + 2 (W_0 V^T)_j U_j + U_j (V V^T) U_j^T``."""
        base, U, V = self._base(i, self.dtype), self.ups[i], self.downs[i]
        base_rows = torch.linalg.vector_norm(base, dim=-1, dtype=torch.float64).square()
        cross = (mm(base, V.mT).double() * U.double()).sum(-1)  # (m,)
        gram = V.double() @ V.double().mT  # (r, r)
        own = ((U.double() @ gram) * U.double()).sum(-1)
        return base_rows + 2 * cross + own

    def matmul(self, X: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W X`` for ``X`` of shape ``(B, n, b)``: ``D (W_0 X + U (V X))`` per matrix."""
        assert self.adds is not None
        out = []
        for i in range(len(self)):
            x = X[i]
            y = mm(self._base(i, x.dtype), x)  # (m, b)
            if self.adds[i]:
                y = y + mm(self.ups[i].to(x.dtype), mm(self.downs[i].to(x.dtype), x))
            scale = self._scale(i, mm)
            out.append(y if scale is None else scale.to(x.dtype)[:, None] * y)
        return torch.stack(out)

    def rmatmul(self, Y: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W^T Y`` for ``Y`` of shape ``(B, m, b)``: ``W_0^T (D Y) + V^T (U^T (D Y))``, with
        ``W_0^T Y`` as ``(Y^T W_0)^T`` (BLAS reads a transposed W at about half the speed)."""
        assert self.adds is not None
        out = []
        for i in range(len(self)):
            y = Y[i]
            scale = self._scale(i, mm)
            if scale is not None:
                y = scale.to(y.dtype)[:, None] * y
            x = mm(y.mT, self._base(i, y.dtype)).mT  # (n, b)
            if self.adds[i]:
                x = x + mm(self.downs[i].to(y.dtype).mT, mm(self.ups[i].to(y.dtype).mT, y))
            out.append(x)
        return torch.stack(out)

    def frobenius_norm_sq(self) -> Tensor:
        r"""``(B,)`` exact :math:`\lVert W \rVert_F^2` in float64, from r-sized products:
        :math:`\lVert W_0 \rVert_F^2 + 2 \langle U^\top W_0, V \rangle + \langle U^\top U, V V^\top \rangle`
        (DoRA: :math:`\sum_j d_j^2 \lVert (W_0 + U V)_{j,:} \rVert^2`). NaN where a value is not finite."""
        assert self.adds is not None
        values = []
        for i in range(len(self)):
            base = self._base(i, self.dtype)
            if not self.adds[i]:
                total = torch.linalg.vector_norm(base, dim=-1, dtype=torch.float64).square().sum()
            elif self._scale(i, torch.matmul) is not None:
                scale = self._scale(i, torch.matmul)
                assert scale is not None
                total = (scale.double().square() * self._row_norms_sq(i, torch.matmul)).sum()
            else:
                U, V = self.ups[i].double(), self.downs[i].double()
                base_sq = torch.linalg.vector_norm(base, dim=-1, dtype=torch.float64).square().sum()
                cross = ((self.ups[i].mT @ base).double() * V).sum()
                own = ((U.mT @ U) * (V @ V.mT)).sum()
                total = base_sq + 2 * cross + own
            values.append(total)
        result = torch.stack(values)
        return torch.where(torch.isfinite(result), result, float("nan"))

    def base_frobenius_norm(self) -> Tensor:
        """``(B,)`` float64 :math:`\\lVert W_0 \\rVert_F` (of the base as stored: for a merged layer,
        the merged weight)."""
        return torch.stack(
            [torch.linalg.vector_norm(base.detach(), dtype=torch.float64) for base in self.bases]
        )

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``(B, m, n)`` effective weights, formed (for an exact SVD of small matrices, or a check)."""
        dtype = dtype or self.dtype
        assert self.adds is not None
        out = []
        for i in range(len(self)):
            w = self._base(i, dtype)
            if self.adds[i]:
                w = w + self.ups[i].to(dtype) @ self.downs[i].to(dtype)
            scale = self._scale(i, torch.matmul)
            out.append(w if scale is None else scale.to(dtype)[:, None] * w)
        return torch.stack(out)

    def update_singular_values(self) -> Tensor:
        """``(B, r_max)`` exact singular values of each update ``U V`` (float64, zero-padded)."""
        return low_rank_singular_values(self.ups, self.downs)

    def update_spectrum(self) -> UpdateSpectrum:
        """What ``functional.update_metrics`` takes: the update's whole spectrum, ``||W_0||_F`` and
        each adapter's rank r."""
        rank = torch.tensor([float(u.shape[-1]) for u in self.ups], dtype=torch.float64)
        return UpdateSpectrum(
            self.update_singular_values(), self.base_frobenius_norm(), rank.to(self.device)
        )


def low_rank_singular_values(ups: Sequence[Tensor], downs: Sequence[Tensor]) -> Tensor:
    r"""Exact singular values of each :math:`U_i V_i`, float64, descending, zero-padded to the widest.

    With reduced QRs :math:`U = Q_U R_U` and :math:`V^\top = Q_V R_V`,
    :math:`U V = Q_U (R_U R_V^\top) Q_V^\top`: the nonzero singular values are those of the small
    :math:`R_U R_V^\top`. No :math:`m \times n` matrix is formed; cost :math:`O((m + n) r^2)`.

    Args:
        ups: ``(m, r_i)`` factors.
        downs: ``(r_i, n)`` factors.

    Returns:
        ``(B, max r_i)`` float64.

    Example::

        >>> U = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
        >>> low_rank_singular_values([U], [torch.eye(2)])
        tensor([[3., 1.]], dtype=torch.float64)
    """
    values = []
    for U, V in zip(ups, downs, strict=True):
        R_u = torch.linalg.qr(U.detach().double(), mode="r").R  # (min(m, r), r)
        R_v = torch.linalg.qr(V.detach().double().mT, mode="r").R  # (min(n, r), r)
        values.append(torch.linalg.svdvals(R_u @ R_v.mT))
    width = max(v.shape[-1] for v in values)
    padded = [torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in values]
    return torch.stack(padded)
