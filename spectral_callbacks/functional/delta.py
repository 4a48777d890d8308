r"""Dense updates :math:`\Delta W` beside the weight: of a full fine-tune, and of an adapter without factors.

``DeltaMatrices`` is a batch of snapshotted weights :math:`W_t` (copies) with the reference weights
:math:`W_\mathrm{ref}` they are compared with (the first snapshot's, or a base model's; kept for the
whole run): :math:`\Delta W = W_t - W_\mathrm{ref}`.

``DenseUpdateMatrices`` is a batch of adapted layers whose update has no low-rank factors to read
(PEFT LoHa, LoKr and the other additive tuner types, through their ``get_delta_weight``): the
effective weight is :math:`W = W_0 + \Delta W`, with :math:`W_0` the live frozen base (not copied)
and :math:`\Delta W` an ``m x n`` copy formed when the snapshot was taken.

Either batch's weight spectrum is computed as for any batch (``randomized_svd`` multiplies it
through its products: ``DeltaMatrices`` the dense copy, ``DenseUpdateMatrices`` ``AdaptedMatrices``'
base plus its dense update); ``update_spectrum`` gives the top-k of the dense :math:`\Delta W`
(randomized SVD) and its exact :math:`\lVert \Delta W \rVert_F^2`.

Example::

    >>> base = torch.eye(4)
    >>> now = base + torch.diag(torch.tensor([0.0, 0.0, 2.0, 1.0]))
    >>> batch = DeltaMatrices.of(now[None], (base,))
    >>> S, base_norm, rank, frobenius_sq = batch.update_spectrum(k=2)
    >>> S.tolist(), float(frobenius_sq[0]), float(base_norm[0])
    ([[2.0, 1.0]], 5.0, 2.0)
    >>> adapted = DenseUpdateMatrices.of((base,), (now - base,), ranks=(4.0,))
    >>> torch.equal(adapted.dense()[0], now), adapted.update_spectrum(k=2)[0].tolist()
    (True, [[2.0, 1.0]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from spectral_callbacks.functional.batch import Matmul, UpdateSpectrum
from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.functional.metrics import frobenius_norm_sq
from spectral_callbacks.functional.svd import DEFAULT_K, randomized_svd

__all__ = ["DeltaMatrices", "DenseUpdateMatrices"]


@dataclass
class DeltaMatrices:
    r"""Snapshotted dense weights :math:`W_t` (one ``(B, m, n)`` copy) and the references of their
    update :math:`W_t - W_\mathrm{ref}`.

    The weights are multiplied as they are (``matmul``, ``rmatmul``: the randomized SVD's
    products, one matrix at a time in the compute dtype); the update is formed only for its own
    spectrum (:meth:`update_spectrum`).

    Attributes:
        current: ``(B, m, n)`` the snapshot's copy of the weights.
        references: ``(m, n)`` each, the reference weights (kept by the target, not copied here).
        k: how many singular values of each update to compute.
        compute_dtype: the dtype the products run in (:meth:`to`; the copy stays as it is).
        owned: whether this batch holds the copy (a slice of a batch does not).
    """

    current: Tensor
    references: tuple[Tensor, ...] = field(default=(), repr=False)
    k: int = DEFAULT_K
    compute_dtype: torch.dtype | None = None
    owned: bool = True

    @classmethod
    def of(cls, current: Tensor, references: Sequence[Tensor], k: int = DEFAULT_K) -> DeltaMatrices:
        """A batch of the ``(B, m, n)`` copy ``current`` (owned) against ``references``."""
        return cls(current, tuple(references), k)

    # --- tensor-like --------------------------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return self.current.shape

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype or self.current.dtype

    @property
    def device(self) -> torch.device:
        return self.current.device

    @property
    def nbytes(self) -> int:
        """Bytes this batch copied: the weights' copy (a slice of the batch copied nothing)."""
        return self.current.numel() * self.current.element_size() if self.owned else 0

    def __len__(self) -> int:
        return self.current.shape[0]

    def __getitem__(self, index: slice) -> DeltaMatrices:
        return replace(
            self, current=self.current[index], references=self.references[index], owned=False
        )

    def to(self, dtype: torch.dtype) -> DeltaMatrices:
        """The batch computing in ``dtype`` (the copy is converted one matrix at a time, per
        product, in the worker: never a batch copy)."""
        return self if dtype == self.dtype else replace(self, compute_dtype=dtype)

    def float(self) -> DeltaMatrices:
        return self.to(torch.float32)

    def record_stream(self, stream: Any) -> None:
        """Mark the copy as in use on ``stream`` (the caching allocator then waits for it)."""
        if self.owned:
            self.current.record_stream(stream)

    # --- the operator -------------------------------------------------------------------------

    def _weight(self, i: int, dtype: torch.dtype) -> Tensor:
        weight = self.current[i].detach()
        return weight if weight.dtype == dtype else weight.to(dtype)

    def matmul(self, X: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W_t X`` for ``X`` of shape ``(B, n, b)``."""
        return torch.stack([mm(self._weight(i, x.dtype), x) for i, x in enumerate(X)])

    def rmatmul(self, Y: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W_t^T Y`` for ``Y`` of shape ``(B, m, b)``, as ``(Y^T W_t)^T`` (BLAS reads a
        transposed W at about half the speed)."""
        return torch.stack([mm(y.mT, self._weight(i, y.dtype)).mT for i, y in enumerate(Y)])

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``(B, m, n)`` weights, in ``dtype`` (default: the compute dtype), a new tensor."""
        return self.current.detach().to(dtype or self.dtype, copy=True)

    def frobenius_norm_sq(self) -> Tensor:
        """``(B,)`` exact ``||W_t||_F^2`` in float64; NaN where a value is not finite."""
        result = torch.stack(
            [
                torch.linalg.vector_norm(self._weight(i, self.dtype), dim=-1, dtype=torch.float64)
                .square()
                .sum()
                for i in range(len(self))
            ]
        )
        return torch.where(torch.isfinite(result), result, float("nan"))

    def update_spectrum(self, k: int | None = None) -> UpdateSpectrum:
        """The top-k singular values of each ``W_t - W_ref``, ``||W_ref||_F``, NaN for the rank (no
        adapter) and the exact ``||W_t - W_ref||_F^2``."""
        dtype = torch.promote_types(self.current.dtype, torch.float32)
        diff = torch.stack(
            [
                b.to(dtype) - r.to(device=b.device, dtype=dtype)
                for b, r in zip(self.current.unbind(0), self.references, strict=True)
            ]
        )  # (B, m, n), formed in the worker
        reference = torch.stack(
            [torch.linalg.vector_norm(r, dtype=torch.float64) for r in self.references]
        )
        rank = torch.full((len(self),), float("nan"), dtype=torch.float64)
        return _dense_spectrum(diff, reference, rank, self.k if k is None else k)


def _dense_spectrum(update: Tensor, base_frobenius: Tensor, rank: Tensor, k: int) -> UpdateSpectrum:
    """What ``functional.update_metrics`` takes for a ``(B, m, n)`` dense update: its top-k
    singular values (randomized SVD), ``||W_0||_F``, the adapter rank and the exact ``||dW||_F^2``."""
    S = randomized_svd(update, k).S  # k clamped to the smaller side there
    return UpdateSpectrum(
        S, base_frobenius.to(S.device), rank.to(S.device), frobenius_norm_sq(update)
    )


@dataclass
class DenseUpdateMatrices(AdaptedMatrices):
    r"""Effective weights :math:`W_0 + \Delta W` of adapted layers whose update is read dense.

    ``bases`` are the live frozen bases (a view of the parameter; a copy where the base changes:
    merged into, or trained), ``adds`` whether :math:`\Delta W` is added to them (``False``: the
    base already holds it, or the adapters are disabled; the update family still reads it).
    The low-rank factors are empty.

    Attributes:
        updates: ``(m, n)`` each, :math:`\Delta W` summed over the active adapters (copies, formed
            at the snapshot; in ``owned``).
        ranks: per matrix the adapter's rank r (the sum over active adapters), NaN where the tuner
            type has none.
        k: how many singular values of each update to compute.
    """

    updates: tuple[Tensor, ...] = field(default=(), repr=False)
    ranks: tuple[float, ...] = ()
    k: int = DEFAULT_K

    @classmethod
    def of(
        cls,
        bases: Sequence[Tensor],
        updates: Sequence[Tensor],
        adds: Sequence[bool] | None = None,
        ranks: Sequence[float] | None = None,
        owned: Sequence[Tensor] = (),
        k: int = DEFAULT_K,
    ) -> DenseUpdateMatrices:
        """A batch of ``bases`` plus ``updates`` (``adds``: default all added; ``ranks``: NaN)."""
        count = len(bases)
        m, n = bases[0].shape
        empty = updates[0].new_zeros
        return cls(
            tuple(bases),
            tuple(empty((m, 0)) for _ in range(count)),
            tuple(empty((0, n)) for _ in range(count)),
            None,
            tuple(adds) if adds is not None else (True,) * count,
            tuple(owned),
            updates=tuple(updates),
            ranks=tuple(ranks) if ranks is not None else (float("nan"),) * count,
            k=k,
        )

    def __getitem__(self, index: slice) -> DenseUpdateMatrices:
        assert self.adds is not None
        return DenseUpdateMatrices.of(
            self.bases[index], self.updates[index], self.adds[index], self.ranks[index], (), self.k
        )

    def to(self, dtype: torch.dtype) -> DenseUpdateMatrices:
        """The updates in ``dtype`` with the factors (converted once here, not at each of the
        Krylov products; the bases stay as they are, converted per product)."""
        converted = super().to(dtype)
        if converted is self:
            return self
        assert isinstance(converted, DenseUpdateMatrices)  # replace() keeps the class
        return replace(converted, updates=tuple(update.to(dtype) for update in self.updates))

    def _update(self, i: int, dtype: torch.dtype) -> Tensor:
        update = self.updates[i]
        return update if update.dtype == dtype else update.to(dtype)

    def matmul(self, X: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W X`` for ``X`` of shape ``(B, n, b)``: ``W_0 X + dW X`` per matrix."""
        assert self.adds is not None
        out = []
        for i in range(len(self)):
            y = mm(self._base(i, X.dtype), X[i])  # (m, b)
            out.append(y + mm(self._update(i, X.dtype), X[i]) if self.adds[i] else y)
        return torch.stack(out)

    def rmatmul(self, Y: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W^T Y`` for ``Y`` of shape ``(B, m, b)``, as ``(Y^T W)^T`` (BLAS reads a transposed
        W at about half the speed)."""
        assert self.adds is not None
        out = []
        for i in range(len(self)):
            y = Y[i].mT  # (b, m)
            x = mm(y, self._base(i, Y.dtype))
            out.append((x + mm(y, self._update(i, Y.dtype)) if self.adds[i] else x).mT)
        return torch.stack(out)

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``(B, m, n)`` effective weights, formed."""
        dtype = dtype or torch.promote_types(self.bases[0].dtype, self.dtype)
        assert self.adds is not None
        return torch.stack(
            [
                self._base(i, dtype) + self._update(i, dtype)
                if self.adds[i]
                else self._base(i, dtype)
                for i in range(len(self))
            ]
        )

    def frobenius_norm_sq(self) -> Tensor:
        """``(B,)`` exact ``||W_0 + dW||_F^2`` in float64 (of the formed weights: dW is dense
        already)."""
        return frobenius_norm_sq(self.dense(torch.promote_types(self.dtype, torch.float32)))

    def update_spectrum(self, k: int | None = None) -> UpdateSpectrum:
        """The top-k singular values of each ``dW``, ``||W_0||_F``, the adapter ranks and the exact
        ``||dW||_F^2``."""
        dtype = torch.promote_types(self.dtype, torch.float32)
        update = torch.stack([self._update(i, dtype) for i in range(len(self))])  # (B, m, n)
        rank = torch.tensor(self.ranks, dtype=torch.float64)
        return _dense_spectrum(update, self.base_frobenius_norm(), rank, self.k if k is None else k)
