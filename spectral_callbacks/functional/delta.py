r"""The update of a dense fine-tune, :math:`\Delta W = W_t - W_\mathrm{ref}`, beside the weight itself.

``DeltaMatrices`` is a batch of snapshotted weights :math:`W_t` (copies) with the reference weights
:math:`W_\mathrm{ref}` they are compared with (the first snapshot's, or a base model's; kept for the
whole run). The weight's own spectrum is computed as for any batch (``randomized_svd`` multiplies
it through ``AdaptedMatrices``' products, with no factors); ``update_spectrum`` gives the top-k of
the dense :math:`\Delta W` (randomized SVD) and its exact :math:`\lVert \Delta W \rVert_F^2`.

Example::

    >>> base = torch.eye(4)
    >>> now = base + torch.diag(torch.tensor([0.0, 0.0, 2.0, 1.0]))
    >>> batch = DeltaMatrices.of(now[None], (base,))
    >>> S, base_norm, rank, frobenius_sq = batch.update_spectrum(k=2)
    >>> S.tolist(), float(frobenius_sq[0]), float(base_norm[0])
    ([[2.0, 1.0]], 5.0, 2.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.functional.metrics import frobenius_norm_sq
from spectral_callbacks.functional.svd import DEFAULT_K, randomized_svd

__all__ = ["DeltaMatrices"]


@dataclass
class DeltaMatrices(AdaptedMatrices):
    """Snapshotted dense weights (``bases``, copies) and the references of their update.

    Attributes:
        references: ``(m, n)`` each, the reference weights (kept by the target, not copied here).
        k: how many singular values of each update to compute.
    """

    references: tuple[Tensor, ...] = field(default=(), repr=False)
    k: int = DEFAULT_K

    @classmethod
    def of(cls, current: Tensor, references: Sequence[Tensor], k: int = DEFAULT_K) -> DeltaMatrices:
        """A batch of the ``(B, m, n)`` copy ``current`` (owned) against ``references``."""
        count, m, n = current.shape
        ups = tuple(current.new_zeros((m, 0)) for _ in range(count))
        downs = tuple(current.new_zeros((0, n)) for _ in range(count))
        return cls(
            tuple(current.unbind(0)),
            ups,
            downs,
            None,
            (False,) * count,
            (current,),
            references=tuple(references),
            k=k,
        )

    def __getitem__(self, index: slice) -> DeltaMatrices:
        part = DeltaMatrices.of(torch.stack(self.bases[index]), self.references[index], self.k)
        part.owned = ()
        return part

    def update_spectrum(self, k: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # type: ignore[override]
        """The top-k singular values of each ``W_t - W_ref``, ``||W_ref||_F``, NaN for the rank (no
        adapter) and the exact ``||W_t - W_ref||_F^2``."""
        dtype = torch.promote_types(self.bases[0].dtype, torch.float32)
        diff = torch.stack(
            [
                b.to(dtype) - r.to(device=b.device, dtype=dtype)
                for b, r in zip(self.bases, self.references, strict=True)
            ]
        )  # (B, m, n), formed in the worker
        S = randomized_svd(diff, self.k if k is None else k).S
        reference = torch.stack(
            [torch.linalg.vector_norm(r, dtype=torch.float64) for r in self.references]
        ).to(S.device)
        rank = torch.full((len(self),), float("nan"), dtype=torch.float64, device=S.device)
        return S, reference, rank, frobenius_norm_sq(diff)
