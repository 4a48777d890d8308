"""The engine protocol: what the tracker asks of an engine, and the one place an engine is chosen.

The tracker drives every engine through these calls and never asks which one it has:

::

    each scheduled step      offer(step)                  snapshot now, or skip and count
    every other step         advance(step)                copy the next parts of a staggered snapshot
    every call of step()     collect(wait_seconds=0)      finished results, in step order
    end of training          finish(step, offered=, deadline=)   measure the last step, send what is due
    after an exception       abort()                      issue no further collective
    shutdown                 close(timeout)               stop the worker (idempotent)
    health                   pending, skipped, skipped_matrices, awaiting_results

Implementations: :class:`~spectral_callbacks.monitor.engines.engine.SnapshotEngine` (one process: a worker
thread, a CUDA side stream), :class:`~spectral_callbacks.monitor.engines.distributed.DistributedEngine`
(DDP: each rank decomposes its share, rank 0 gets every result) and
:class:`~spectral_callbacks.monitor.engines.sharded.ShardedEngine` (sharded DTensor weights, FSDP2 or
tensor parallel: each rank snapshots its local shards, the ranks decompose every matrix together,
and every rank gets every result).

Rules every implementation keeps:

* ``offer`` is called at the same steps on every rank (the schedule depends only on the step),
  so an engine may issue collectives there and in ``finish``, and nowhere else.
* ``offer`` never blocks on an SVD; when the bound is hit it skips, and the skip is counted in
  ``skipped`` - the engine is the only place that count changes. (The sharded engine never skips:
  a skip on one rank and not another would desynchronize its collectives; a rank that falls
  behind ends the run with an error instead.)
* ``collect`` returns results at least where they are logged (rank 0); the tracker writes on rank
  0 only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch.distributed.tensor import DTensor

from spectral_callbacks.monitor.engines.budget import resolve_budget
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.engines.engine import Compute, SnapshotResult
from spectral_callbacks.monitor.engines.partitioned import Gathering
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.targets.target import Target


@runtime_checkable
class Engine(Protocol):
    """Decomposes snapshots off the training path; see the module docstring for the rules."""

    @property
    def pending(self) -> int:
        """Snapshots (and, under DDP, gathers of results) handed over and not yet collected."""
        ...

    @property
    def skipped(self) -> int:
        """Scheduled snapshots that were not measured (bound hit, or late under DDP), in total."""
        ...

    @property
    def skipped_matrices(self) -> int:
        """Matrices of snapshots staggered by the budget that were not copied within the delay
        bound, in total (``0`` where snapshots are never staggered)."""
        ...

    @property
    def awaiting_results(self) -> bool:
        """Whether waiting in :meth:`collect` can still bring a result to this process."""
        ...

    def advance(self, step: int) -> None:
        """After the update of ``step``, when no snapshot is due: copy the parts of a snapshot
        staggered by the budget that fit now (nothing to do for engines that never stagger)."""
        ...

    def offer(self, step: int) -> bool:
        """A scheduled point: snapshot the weights after optimizer step ``step``, or skip.

        Returns:
            Whether the snapshot was taken (``False``: skipped and counted).
        """
        ...

    def collect(self, wait_seconds: float = 0.0) -> list[SnapshotResult]:
        """The finished results, in step order, waiting up to ``wait_seconds`` for the rest.

        Raises:
            SpectralComputeError: if the compute function failed on a snapshot (once; the results
                before it come first).
        """
        ...

    def finish(self, step: int, *, offered: bool, deadline: float) -> None:
        """End of training at ``step``: make sure it is measured and send everything still due.

        Args:
            step: the last optimizer step.
            offered: whether ``step`` was already a scheduled point (:meth:`offer` was called).
            deadline: ``time.monotonic()`` value after which nothing more is waited for.
        """
        ...

    def abort(self) -> None:
        """After an exception: issue no further collective (peers may never reach it)."""
        ...

    def close(self, timeout: float = 5.0) -> None:
        """Stop the background work; queued snapshots are dropped. Idempotent.

        A computation still running after ``timeout`` seconds is left to a daemon thread, with a
        warning unless ``timeout`` is 0 (the caller chose not to wait).
        """
        ...


def make_engine(
    compute: Compute,
    targets: Sequence[Target],
    metrics: Sequence[str],
    options: MonitorOptions,
    *,
    inline: bool | None = None,
    skipped: int = 0,
    gathering: Gathering | None = None,
) -> Engine:
    """The engine for this process: a ``ShardedEngine`` if a watched parameter is a DTensor, a
    ``DistributedEngine`` under DDP or where the parameters are gathered (``gathering``: FSDP1,
    ZeRO-3), else a :class:`SnapshotEngine`.

    Under several processes (a default process group with more than one rank) it is a collective:
    every rank must call it, in the same order relative to other collectives.

    Args:
        compute: the compute function each shape group goes through.
        targets: every watched matrix, in the same order on every rank.
        metrics: the logged metric names (under DDP they fix the layout the results travel in).
        options: passed to the engine, which reads what it needs (``max_pending``,
            ``worker_threads``, ``worker_nice``, ``every_n_steps`` as the delay bound of a
            staggered snapshot, ``drain_timeout``); read here: ``drain_timeout`` (it sizes the
            results and SVD groups' timeouts) and ``max_snapshot_bytes`` (resolved here into the
            engine's budget: under several processes each rank's share must fit at once;
            sharded DTensor weights are not counted).
        inline: where the snapshots' CPU work runs, as ``placement.machine_placement`` chose
            (``None``: ``options.synchronous``, ``None`` there being the worker).
        skipped: skips counted before a resume.
        gathering: how the model's partitioned parameters are gathered (``partitioned.py``'s
            :func:`~spectral_callbacks.monitor.engines.partitioned.gathering_of`), or ``None``.

    Raises:
        ConfigurationError: sharded weights with a custom ``compute`` (the sharded SVD runs the
            default metrics only) or with the ESD metrics (they need whole matrices).
    """
    from spectral_callbacks.monitor.engines import distributed
    from spectral_callbacks.monitor.engines.engine import SnapshotEngine
    from spectral_callbacks.monitor.snapshot import group_by_shape

    if any(isinstance(target.parameter, DTensor) for target in targets):
        return _sharded_engine(compute, targets, options, inline=inline, skipped=skipped)
    budget = resolve_budget(options.max_snapshot_bytes, targets)
    rank, world_size = distributed.world()
    if not _split_across_ranks(targets, gathering):
        return SnapshotEngine(
            compute,
            group_by_shape(targets),
            options,
            inline=inline,
            budget=budget,
            skipped=skipped,
        )
    return distributed.DistributedEngine(
        compute,
        targets,
        distributed.result_columns(metrics),
        options,
        rank=rank,
        world_size=world_size,
        group=distributed.results_group(2 * options.drain_timeout + 60),
        inline=inline,
        budget=budget,
        skipped=skipped,
        units=None if gathering is None else gathering.units(targets),
    )


def decomposed_here(targets: Sequence[Target], gathering: Gathering | None) -> set[str] | None:
    """The names of the targets this process copies and decomposes where :func:`make_engine`
    splits them across the ranks (a ``DistributedEngine``: DDP, FSDP1, ZeRO-3), its share of
    :func:`~spectral_callbacks.monitor.engines.distributed.partition`; ``None`` where it
    decomposes every one (one process) or the ranks decompose each matrix together (sharded
    DTensor weights: each rank holds its own shards).

    ``targets``: every watched matrix, in the order the engine gets them (the same on every rank).
    """
    from spectral_callbacks.monitor.engines import distributed

    if not _split_across_ranks(targets, gathering):
        return None
    return distributed.owned_names(targets, *distributed.world())


def _split_across_ranks(targets: Sequence[Target], gathering: Gathering | None) -> bool:
    """Whether each rank decomposes a share of the whole matrices (``DistributedEngine``)."""
    from spectral_callbacks.monitor.engines import distributed

    if any(isinstance(target.parameter, DTensor) for target in targets):
        return False
    return distributed.world()[1] > 1 or gathering is not None


def _sharded_engine(
    compute: Compute,
    targets: Sequence[Target],
    options: MonitorOptions,
    *,
    inline: bool | None,
    skipped: int,
) -> Engine:
    """The engine for DTensor weights, configured like the default compute function."""
    from spectral_callbacks.monitor.engines.sharded import ShardedEngine, svd_group

    if not isinstance(compute, SpectrumCompute):
        raise ConfigurationError(
            "`compute` cannot replace the SVD of sharded (DTensor) weights: the ranks decompose "
            "each matrix together with the built-in distributed SVD; pass `compute=None`"
        )
    if compute.esd:
        raise ConfigurationError(
            "the ESD metrics (esd_alpha, ...) need every eigenvalue of each matrix, and sharded "
            "(DTensor) weights are never gathered: drop them from `metrics`, or analyze a saved "
            "checkpoint with `spectral-callbacks rank-layers`"
        )
    return ShardedEngine(
        targets,
        compute,
        options,
        # Like DDP's results group: a rank that never arrives becomes an error, bounded.
        group=svd_group(timeout_seconds=max(60.0, 2 * options.drain_timeout + 60)),
        inline=inline,
        skipped=skipped,
    )
