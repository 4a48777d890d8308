"""Sharded weights that carry an update: an adapter's effective weight, a ``delta=`` fine-tune.

The sharded engine (``sharded.py``) decomposes each watched matrix where its shards live. A
target with an update needs a little more than its shard:

* **an adapted layer** (PEFT LoRA / DoRA / rsLoRA, and the LoRA-style layers
  ``targets/lowrank.py`` verifies): the effective weight is ``D (W_0 + U V)`` with ``U = s B``
  (``m x r``) and ``V = A`` (``r x n``). The base ``W_0`` is sharded like any weight and read where
  it lives (its local shard, not copied while frozen); the factors are tiny, so each rank copies
  its own part of them at the snapshot (a factor may be a sharded DTensor, FSDP2's ``Shard(0)``,
  or a plain replicated tensor, a tensor-parallel adapter's unsharded half) and the worker sums
  the zero-padded parts over the SVD's group: every rank then holds the whole ``U`` and ``V``, at
  ``r (m + n)`` floats per matrix, the only bytes an adapter adds. The rows a rank holds are
  multiplied as ``W_{0,r} X + U_r (V X)`` inside the sharded Krylov iteration
  (``functional/sharded_svd.py``; ``U_r`` the rows of ``U`` held here); split by columns (a
  row-parallel base) the rows of ``W^T`` held are ``W_{0}[:, C]^T + V[:, C]^T U^T``. The update
  family is exact from the whole factors (``functional.lowrank.low_rank_singular_values``), the
  same on every rank. DoRA's row scale ``g / ||(W_0 + U V)_{i,:}||`` is local where the split is by
  rows (each rank holds whole rows); split by columns or in tiles it is refused in one line.
* **a ``delta=`` target** keeps its reference with the parameter's own placements (each rank the
  reference of its own shard, ``targets/delta.py``): ``W_t - W_ref`` is sharded exactly as ``W_t``,
  and its spectrum is a second sharded SVD of the same shape.

Example (one process, a one-rank group: the local block is the whole matrix)::

    >>> import torch
    >>> from spectral_callbacks.targets import Target
    >>> from spectral_callbacks.monitor.engines.shards import local_piece
    >>> factor = factor_shard(torch.arange(6.0).reshape(3, 2), group_rank=0)
    >>> factor.place(factor.copy()).tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    >>> factor_shard(torch.ones(3, 2), group_rank=1).copy().shape  # a replica: rank 0 sends it
    torch.Size([0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from spectral_callbacks.functional.batch import Matmul
from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.monitor.engines.shards import (
    LocalPiece,
    ShardingError,
    is_replica,
    local_indices,
)
from spectral_callbacks.targets.adapted import AdaptedTarget, DenseAdaptedTarget
from spectral_callbacks.targets.quantized import quantized_base
from spectral_callbacks.targets.target import Target

__all__ = [
    "AdaptedCopy",
    "FactorShard",
    "LocalAdapted",
    "adapted_rows",
    "base_moves",
    "factor_shard",
    "gather_factors",
    "refuse_unsupported",
]


@dataclass(frozen=True)
class FactorShard:
    """One factor parameter (an adapter's ``A`` or ``B``, a DoRA magnitude) as this rank holds it.

    Attributes:
        parameter: the factor (a DTensor, or a plain tensor every rank holds whole).
        index: per dimension, the global positions of the local block's entries; ``None`` where
            another rank contributes this very block (a replica: it sends nothing).
    """

    parameter: Tensor
    index: tuple[Tensor, ...] | None

    def copy(self) -> Tensor:
        """A copy of this rank's part (on the calling thread: later updates cannot reach it)."""
        local = self.parameter.to_local() if isinstance(self.parameter, DTensor) else self.parameter
        return local.new_empty(0) if self.index is None else local.detach().clone()

    def place(self, part: Tensor) -> Tensor:
        """Float32 zeros of the whole factor's shape with ``part`` at its positions: the sum of
        every rank's placed part is the whole factor (each entry sent by exactly one rank)."""
        whole = torch.zeros(tuple(self.parameter.shape), dtype=torch.float32, device=part.device)
        if self.index is None or part.numel() == 0:
            return whole
        grid = torch.meshgrid(*(i.to(part.device) for i in self.index), indexing="ij")
        whole[grid] = part.float()
        return whole


def factor_shard(parameter: Tensor, group_rank: int, lowest_rank: int = 0) -> FactorShard:
    """Where this rank's part of ``parameter`` lies in the whole; no communication.

    ``lowest_rank``: the lowest global rank of the SVD group. A factor on a smaller mesh than the
    group's (under FSDP2 over tensor parallelism, the ``A`` of a column-parallel base is sharded
    over dp only) is held again, block for block, by each parallel mesh (each tp rank): only the
    mesh that holds ``lowest_rank`` sends it, so the sum counts it once."""
    if not isinstance(parameter, DTensor):
        whole = tuple(torch.arange(size) for size in parameter.shape)
        return FactorShard(parameter, whole if group_rank == 0 else None)
    if is_replica(parameter) or lowest_rank not in parameter.device_mesh.mesh.flatten().tolist():
        return FactorShard(parameter, None)
    index = tuple(local_indices(parameter, dim) for dim in range(parameter.dim()))
    return FactorShard(parameter, index)


def gather_factors(
    factors: Sequence[FactorShard], parts: Sequence[Tensor], group: Any
) -> tuple[list[Tensor], int]:
    """The whole factors (in the order of ``factors``) from every rank's parts, summed over
    ``group`` in one all-reduce; and the bytes it sent. A collective: every rank of ``group``
    calls it with the same factors in the same order."""
    placed = [factor.place(part) for factor, part in zip(factors, parts, strict=True)]
    if not placed:
        return [], 0
    flat = torch.cat([whole.flatten() for whole in placed])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    wholes, offset = [], 0
    for whole in placed:
        wholes.append(flat[offset : offset + whole.numel()].view(whole.shape))
        offset += whole.numel()
    return wholes, flat.numel() * flat.element_size()


def refuse_unsupported(targets: Sequence[Target], pieces: Sequence[LocalPiece]) -> None:
    """Refuse, in one line, what carries an update the sharded engine cannot decompose exactly:
    an adapter without factors (LoHa, LoKr, ...: its dense ``dW`` is not sharded), a quantized
    base, DoRA split other than by rows (its row norms would need the other ranks' columns), and
    an adapted base sharded along both dimensions (tiles)."""
    for target, piece in zip(targets, pieces, strict=True):
        why = None
        if isinstance(target, DenseAdaptedTarget):
            why = "its adapter has no low-rank factors (a dense update is not sharded)"
        elif isinstance(target, AdaptedTarget):
            layer: Any = target.layer_module
            base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else None
            if base is not None and quantized_base(base) is not None:
                why = "its base is quantized"
            elif piece.split == "tiles":
                why = "its base is sharded along both dimensions (tiles)"
            elif piece.split == "columns" and _is_dora(target):
                why = "DoRA's row norms of a base split by columns would need every rank's columns"
        if why is not None:
            raise ShardingError(
                f"{target.name} is not decomposed where its shards live: {why}; watch it "
                "unsharded, or leave it out with exclude="
            )


def _is_dora(target: AdaptedTarget) -> bool:
    layer: Any = target.layer_module
    layout = getattr(target, "layout", None)
    if layout is not None:
        return layout.magnitude is not None
    magnitudes = getattr(layer, "lora_magnitude_vector", {})
    return any(name in magnitudes for name in target.adapters)


@dataclass
class AdaptedCopy:
    """What one snapshot holds of an adapted group on this rank: each member's local base rows
    (a view of the frozen shard, or a copy where the base changes) and its factor parts."""

    bases: list[Tensor]
    parts: list[Tensor]

    @property
    def device(self) -> torch.device:
        return self.bases[0].device

    def record_stream(self, stream: Any) -> None:
        """Mark the copies as in use on ``stream`` (the caching allocator then waits for it)."""
        for tensor in (*self.bases, *self.parts):
            tensor.record_stream(stream)


def adapted_rows(
    piece: LocalPiece, factors: dict[str, Tensor], base: Tensor
) -> tuple[AdaptedMatrices, Tensor, Tensor]:
    """This rank's rows of ``piece``'s effective weight as an operator of one matrix, and the
    whole ``U`` (the scaling folded in) and ``V`` of its update.

    ``base``: the local rows of the base (``piece.block()``); ``factors``: the target's whole
    factors by their names (``AdaptedTarget.factor_names``, from :func:`gather_factors`), which the
    target's own reading of its adapters (``AdaptedTarget.factors_of``) turns into ``U`` and ``V``.
    """
    target = piece.target
    assert isinstance(target, AdaptedTarget) and piece.held is not None
    up, down, magnitude, add = target.factors_of(factors.__getitem__, base)
    dtype = torch.promote_types(base.dtype, torch.float32)
    up, down = up.to(dtype), down.to(dtype)
    held = piece.held.to(up.device)
    if piece.split == "rows":  # W_r = D_r (W_{0,r} + U_r V)
        g = None if magnitude is None else magnitude.to(dtype).index_select(0, held)
        local = AdaptedMatrices((base,), (up.index_select(0, held),), (down,), (g,), (add,))
    else:  # rows of W^T held: W_0[:, C]^T + V[:, C]^T U^T (DoRA is refused here)
        ups = (down.index_select(1, held).mT.contiguous(),)
        local = AdaptedMatrices((base,), ups, (up.mT.contiguous(),), (None,), (add,))
    return local, up, down


def base_moves(target: Target) -> bool:
    """Whether an adapted target's base changes under a snapshot (trained, or merged into): then
    its local rows are copied; a frozen base is read where it lives."""
    layer = getattr(target, "layer_module", None)
    return target.parameter.requires_grad or bool(getattr(layer, "merged", False))


class LocalAdapted:
    """The ``(B, rows, d)`` local rows of a group of adapted matrices, as one operator: member
    ``i``'s rows (an ``AdaptedMatrices`` of one) padded with zero rows to ``rows``, the padding
    the dense stacks carry too. What ``sharded_randomized_svd`` multiplies."""

    def __init__(self, members: Sequence[AdaptedMatrices], rows: int) -> None:
        self.members = list(members)
        self.rows = rows
        self.d = int(members[0].shape[-1])
        self.dtype: torch.dtype = members[0].dtype
        self.device: torch.device = members[0].device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.members), self.rows, self.d))

    def to(self, dtype: torch.dtype) -> LocalAdapted:
        return (
            self
            if dtype == self.dtype
            else LocalAdapted([member.to(dtype) for member in self.members], self.rows)
        )

    def _pad(self, rows: Tensor) -> Tensor:  # (r_i, c) -> (rows, c)
        return torch.nn.functional.pad(rows, (0, 0, 0, self.rows - rows.shape[0]))

    def matmul(self, X: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W_r X`` for ``X`` of shape ``(B, d, b)``: ``(B, rows, b)``."""
        return torch.stack(
            [self._pad(m.matmul(X[i : i + 1], mm)[0]) for i, m in enumerate(self.members)]
        )

    def rmatmul(self, Y: Tensor, mm: Matmul = torch.matmul) -> Tensor:
        """``W_r^T Y`` for ``Y`` of shape ``(B, rows, b)`` (the padding rows are not read)."""
        return torch.stack(
            [m.rmatmul(Y[i : i + 1, : m.shape[-2]], mm)[0] for i, m in enumerate(self.members)]
        )

    def frobenius_norm_sq(self) -> Tensor:
        """``(B,)`` exact float64 ``||W_r||_F^2`` of the local rows (NaN where not finite)."""
        return torch.cat([member.frobenius_norm_sq() for member in self.members])

    def dense(self, dtype: torch.dtype | None = None) -> Tensor:
        """The ``(B, rows, d)`` local rows, formed (the exact Gram path of a narrow matrix)."""
        return torch.stack([self._pad(member.dense(dtype)[0]) for member in self.members])
