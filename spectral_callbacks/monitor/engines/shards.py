"""Which part of each watched matrix this rank holds, when the weights are sharded DTensors.

FSDP2 (``fully_shard``) and tensor parallelism keep a parameter as a ``DTensor``: every rank holds
``to_local()``, a block of the stored weight, and no rank holds the whole. For a watched
``Target`` (a role's ``(out, in)`` matrix, possibly a few rows of a fused projection) this module
works out, once and without communication, which rows or columns of that matrix the local block
holds, so a snapshot copies only them:

* the stored dimension of the role's output rows (dim 1 for GPT-2's ``Conv1D``, stored
  ``(in, out)``) sharded (FSDP2 ``Shard(0)`` of a ``Linear``, column-parallel TP): the matrix is
  **split by rows**; the rank keeps the local output rows that belong to the role (a fused
  ``[q; k; v]`` shard may hold rows of Q and K, a per-head GPT-NeoX shard whole heads of all
  three, or none of a role: then it takes part with an empty block);
* the input dimension sharded (row-parallel TP ``Shard(1)``, FSDP2 on a ``Conv1D``): **split by
  columns**; every rank holds all of the role's rows and its own input columns;
* ``Replicate`` on a mesh dimension: the ranks along it hold the same block, so only the one at
  coordinate 0 contributes it (the others take part with an empty block), and the sums of the
  distributed SVD count every entry once; a plain (non-DTensor) parameter is replicated the same
  way over the whole group.

Which global indices a rank holds is computed by torch itself: ``distribute_tensor(...,
src_data_rank=None)`` of a small index vector with the parameter's placements (no communication;
``Shard``, uneven and empty chunks, and ``_StridedShard`` all follow torch's own rules).

* both dimensions sharded (FSDP2 over row-parallel TP on a 2-D mesh): each rank holds a **tile**,
  some rows and some columns, with their global positions (the SVD then needs two all-reduces per
  Krylov step instead of one).

A mixture's 3-D experts tensor ``(E, out, in)`` (``targets/experts.py``) is indexed by the expert
first, then as the expert's matrix: FSDP2 shards the expert dimension (``Shard(0)``), so a rank
holds some experts whole and the others not at all; a rank that does not hold the target's expert
takes part with an empty block, and sharding of the two matrix dimensions (tensor parallel
experts) is read as for a 2-D weight.

Example (one process, a 1-rank mesh: the whole matrix is the local block)::

    >>> import torch
    >>> from spectral_callbacks.targets import Target
    >>> piece = local_piece(Target.from_parameter("w", torch.ones(4, 3), role="O"), group_rank=0)
    >>> piece.split, tuple(piece.block().shape)
    ('rows', (4, 3))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from spectral_callbacks.targets.target import Target

__all__ = [
    "LocalPiece",
    "ShardingError",
    "is_replica",
    "local_indices",
    "local_piece",
    "mesh_ranks",
]


class ShardingError(ValueError):
    """A watched parameter is sharded in a way the sharded engine cannot decompose."""


@dataclass(frozen=True)
class LocalPiece:
    """This rank's part of one watched matrix, as rows of the split orientation.

    Attributes:
        target: the watched matrix.
        split: ``"rows"`` (the matrix's rows are spread over ranks), ``"columns"`` or
            ``"tiles"`` (both).
        shape: global ``(m, d)`` of the split orientation: ``target.shape`` for ``"rows"`` and
            ``"tiles"``, its transpose for ``"columns"``; ``d`` is whole on every rank unless tiles.
        rows: how many rows of the split orientation this rank holds (0 for an empty block).
        row_index, col_index: for ``"tiles"``, the positions in the matrix of the tile's rows and
            columns (``None`` otherwise).
        expert: for one expert of a 3-D experts tensor, its position in this rank's local block
            (``None`` for a 2-D weight).
        held: for ``"rows"`` and ``"columns"``, the positions in the matrix of the block's rows
            (the matrix's rows held here for ``"rows"``, its input columns for ``"columns"``):
            where an adapter's factors meet the block (``shard_updates.py``).

    Index tensors live on the local block's device, put there once when the piece is built:
    moving them at each snapshot would be a host-to-device copy (a sync) on the training thread.
    """

    target: Target
    split: str
    shape: tuple[int, int]
    rows: int
    _select: slice | torch.Tensor  # positions along the local output dimension, on its device
    row_index: torch.Tensor | None = None
    col_index: torch.Tensor | None = None
    expert: int | None = None
    held: torch.Tensor | None = None

    def block(self, source: torch.Tensor | None = None) -> torch.Tensor:
        """The current ``(rows, d)`` local block: a view where the rows are contiguous.

        Reads only ``to_local()`` of a DTensor (never ``full_tensor()``): no communication.
        ``source``: a tensor sharded as the parameter is, read in its place (a ``delta=``
        reference kept with the parameter's placements).
        """
        parameter = self.target.parameter if source is None else source
        local = (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach()
        if self.rows == 0:
            return local.new_empty((0, 0 if self.split == "tiles" else self.shape[1]))
        if self.expert is not None:
            local = local[self.expert]  # the expert's (out, in) or (in, out) slice: a view
        matrix = local.t() if self.target.rows.transposed else local  # (local out, local in)
        if isinstance(self._select, slice):
            own = matrix[self._select]
        else:  # the indices live on the block's device already: no copy, no sync here
            own = matrix.index_select(0, self._select)  # (role rows, local in)
        return own.t() if self.split == "columns" else own


def local_piece(target: Target, group_rank: int) -> LocalPiece:
    """Which rows (or columns) of ``target``'s matrix this rank holds; no communication.

    Args:
        target: from ``find_targets`` on the model *after* ``fully_shard`` /
            ``parallelize_module`` (so it refers to the sharded parameters).
        group_rank: this rank's index in the SVD's process group; with a plain (replicated)
            parameter only group rank 0 contributes the matrix.

    Raises:
        ShardingError: the parameter is ``Partial`` on a mesh dimension.
    """
    parameter = target.parameter
    # A 3-D experts tensor (E, out, in): the expert first, then its matrix's dimensions.
    expert = target.expert if parameter.dim() == 3 else None
    first = 0 if expert is None else 1
    out_dim = first + (1 if target.rows.transposed else 0)
    in_dim = 2 * first + 1 - out_dim
    if not isinstance(parameter, DTensor):
        select: slice | torch.Tensor = slice(None) if group_rank == 0 else slice(0, 0)
        whole = target.shape[0] if group_rank == 0 else 0
        held_rows = torch.arange(whole)
        return _piece(target, "rows", select, rows=whole, expert=expert, held=held_rows)
    placements = parameter.placements
    if any(placement.is_partial() for placement in placements):
        raise ShardingError(
            f"{target.parameter_name} is Partial on its mesh ({placements}): a parameter must be "
            "Shard or Replicate to be watched; redistribute it, or exclude it with exclude="
        )
    sharded = {_shard_dim(placement) for placement in placements} & {out_dim, in_dim}
    if sharded == {out_dim, in_dim}:
        split = "tiles"
    elif in_dim in sharded:
        split = "columns"
    else:
        split = "rows"
    replica = is_replica(parameter)
    position = None
    if expert is not None:  # where the expert lies in the local block, if this rank holds it
        found = (local_indices(parameter, 0) == expert).nonzero().flatten()
        replica = replica or len(found) == 0  # another rank holds it: an empty block here
        position = int(found[0]) if len(found) else None
    held = local_indices(parameter, out_dim)  # global output indices of the local rows
    rows = target.rows
    chunk = (parameter.shape[out_dim]) // rows.groups
    stop = chunk if rows.stop is None else rows.stop
    within = held % chunk
    positions = ((within >= rows.start) & (within < stop)).nonzero().flatten()
    if replica:  # another rank contributes this very block: take part with an empty one
        empty = torch.zeros(0, dtype=torch.long)
        tile = empty if split == "tiles" else None
        return _piece(
            target, split, slice(0, 0), rows=0, row_index=tile, col_index=tile, held=empty
        )
    kept = within[positions]  # the role's rows of each chunk, in matrix order
    role_rows = (held[positions] // chunk) * (stop - rows.start) + (kept - rows.start)
    if split == "tiles":
        columns = local_indices(parameter, in_dim)
        return _piece(
            target,
            split,
            _as_slice(positions),
            rows=len(positions),
            row_index=role_rows,
            col_index=columns,
            expert=position,
        )
    held_columns = None if split == "rows" else local_indices(parameter, in_dim)
    count = len(positions) if held_columns is None else int(held_columns.numel())
    where = role_rows if held_columns is None else held_columns
    return _piece(target, split, _as_slice(positions), rows=count, expert=position, held=where)


def mesh_ranks(targets: list[Target]) -> list[int]:
    """The global ranks of the device mesh the targets' DTensors live on (all on one mesh).

    Raises:
        ShardingError: the DTensors live on meshes of different ranks.
    """
    meshes = {
        tuple(target.parameter.device_mesh.mesh.flatten().tolist())
        for target in targets
        if isinstance(target.parameter, DTensor)
    }
    if len(meshes) > 1:
        raise ShardingError(
            f"the watched parameters live on device meshes of different ranks {sorted(meshes)}; "
            "watch the parameters of one mesh (include=/exclude=)"
        )
    return sorted(meshes.pop()) if meshes else []


def _piece(
    target: Target, split: str, select: Any, rows: int, expert: int | None = None, **indices: Any
) -> LocalPiece:
    m, n = target.shape
    shape = (n, m) if split == "columns" else (m, n)
    parameter = target.parameter
    device = (parameter.to_local() if isinstance(parameter, DTensor) else parameter).device
    if isinstance(select, torch.Tensor):
        select = select.to(device)
    moved = {name: None if index is None else index.to(device) for name, index in indices.items()}
    return LocalPiece(target, split, shape, rows, select, **moved, expert=expert)


def _shard_dim(placement: Any) -> int | None:
    """The tensor dimension a placement shards; ``None`` for Replicate / Partial."""
    # Duck-typed: torch's _StridedShard (FSDP2 over TP on one dim) says is_shard() False.
    if placement.is_replicate() or placement.is_partial():
        return None
    return int(placement.dim)


def local_indices(parameter: DTensor, dim: int) -> torch.Tensor:
    """Global indices along ``dim`` of this rank's local block, by torch's own placement rules."""
    # Only the placements of `dim` move its indices: sharding of the other dimension is dropped
    # (Replicate), so the proxy is a size-1 vector along it, never a full-size tensor.
    placements = [
        placement if _shard_dim(placement) == dim else Replicate()
        for placement in parameter.placements
    ]
    shape = [1] * parameter.dim()
    shape[dim] = parameter.shape[dim]
    proxy = torch.arange(parameter.shape[dim]).view(shape)
    local = distribute_tensor(proxy, parameter.device_mesh, placements, src_data_rank=None)
    return local.to_local().flatten().cpu()


def is_replica(parameter: DTensor) -> bool:
    """Whether another rank holds this very block: ``Replicate`` on a mesh dimension along which
    this rank is not at coordinate 0 (the one there contributes it, so sums count it once)."""
    coordinate: Sequence[int] = parameter.device_mesh.get_coordinate() or ()
    return any(
        placement.is_replicate() and coordinate[mesh_dim] != 0
        for mesh_dim, placement in enumerate(parameter.placements)
    )


def _as_slice(positions: torch.Tensor) -> slice | torch.Tensor:
    """A slice when the positions are one contiguous run (the block is then a view)."""
    if len(positions) == 0:
        return slice(0, 0)
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 == len(positions):
        return slice(first, last + 1)
    return positions
