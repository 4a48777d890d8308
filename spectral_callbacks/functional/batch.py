"""What a snapshot of one shape group is: a ``(B, m, n)`` stack, or a batch that multiplies itself.

A dense target is snapshotted as one slot of a ``(B, m, n)`` tensor. A target kind that is not
copied as a dense matrix (an adapted layer: a frozen base and adapter factors; a dense fine-tune's
weights with their reference) hands the engine a :class:`MatrixBatch` instead: an operator the
randomized SVD multiplies (``matmul``, ``rmatmul``) without forming its matrices, that carries the
spectrum of its update (``update_spectrum``) and can still be formed (``dense``) where every
eigenvalue is needed. ``functional.lowrank.AdaptedMatrices`` and its subclasses in
``functional.delta`` are the kinds there are; a new one only needs these members.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

import torch
from torch import Tensor

__all__ = ["MatrixBatch", "MeasuredBatch", "Stack", "UpdateSpectrum"]

#: ``torch.matmul`` or the product a path chose (``functional.precision.matmul``: TF32 where asked).
Matmul = Callable[[Tensor, Tensor], Tensor]


class UpdateSpectrum(NamedTuple):
    """What ``functional.update_metrics`` takes for a batch's updates ``dW`` (in its order)."""

    #: ``(B, r)`` singular values of each update, descending (exact, or its top-k).
    S: Tensor
    #: ``(B,)`` ``||W_0||_F`` of the weight the update is added to (or taken from).
    base_frobenius: Tensor
    #: ``(B,)`` the adapter's rank r, NaN where there is none.
    rank: Tensor
    #: ``(B,)`` exact ``||dW||_F^2`` where ``S`` is only the top-k, else ``None`` (``S`` is whole).
    frobenius_sq: Tensor | None = None


@runtime_checkable  # randomized_svd tells a batch from bad input (a list) by it
class MatrixBatch(Protocol):
    """A batch of ``B`` matrices ``(m, n)`` held as an operator (what ``Target.stack_batch`` may
    return in place of a ``(B, m, n)`` tensor).

    Tensor-like where the engine needs it (``shape``, ``dtype``, ``device``, ``nbytes``, ``len``,
    slicing, ``to``/``float``, ``record_stream``); an operator where the SVD needs it.
    """

    @property
    def shape(self) -> torch.Size:
        """``(B, m, n)``."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the batch computes in (its copied factors')."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def nbytes(self) -> int:
        """Bytes this batch copied when the snapshot was taken (what it holds in memory)."""
        ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> MatrixBatch:
        """The matrices ``index`` of the batch (one culprit is found by decomposing each alone)."""
        ...

    def to(self, dtype: torch.dtype) -> MatrixBatch:
        """The batch computing in ``dtype`` (copies converted once, not at every product)."""
        ...

    def float(self) -> MatrixBatch: ...

    def record_stream(self, stream: Any) -> None:
        """Mark the copies as in use on ``stream`` (the caching allocator then waits for it)."""
        ...

    def matmul(self, X: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W X`` for ``X`` of shape ``(B, n, b)``."""
        ...

    def rmatmul(self, Y: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W^T Y`` for ``Y`` of shape ``(B, m, b)``."""
        ...

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``(B, m, n)`` matrices, formed (an exact SVD of small matrices, the ESD)."""
        ...

    def frobenius_norm_sq(self) -> Tensor:
        """``(B,)`` exact ``||W||_F^2`` in float64."""
        ...

    def update_spectrum(self) -> UpdateSpectrum:
        """The spectrum of each matrix's update (an adapter's ``s B A``, a fine-tune's
        ``W_t - W_ref``): what ``functional.update_metrics`` takes."""
        ...


class MeasuredBatch(ABC):
    """A batch whose metrics are exact from its own structure, with no SVD of a matrix (a layer's
    attention heads: ``targets.circuits.CircuitBatch``). Tensor-like where the engine needs it."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """``(B, m, n)``: one entry per target."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, index: slice) -> MeasuredBatch: ...

    @abstractmethod
    def float(self) -> MeasuredBatch: ...

    @abstractmethod
    def record_stream(self, stream: Any) -> None:
        """Mark the copies as in use on ``stream`` (the caching allocator then waits for it)."""

    @abstractmethod
    def exact_metrics(self) -> dict[str, Tensor]:
        """Metric name -> ``(B,)`` tensor, in the batch's order (what a compute function returns)."""


#: What a snapshot holds for one shape group and what a compute function is given.
Stack: TypeAlias = Tensor | MatrixBatch | MeasuredBatch
