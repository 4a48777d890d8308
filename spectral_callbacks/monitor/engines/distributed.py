"""Several processes (DDP): each rank decomposes its share of the matrices, rank 0 logs them all.

Under DDP every rank holds the same weights after each optimizer step, so the matrices of a
snapshot are split across ranks (:func:`partition`, balanced by cost) and each rank runs its share
through its own :class:`~spectral_callbacks.monitor.engines.engine.SnapshotEngine`, exactly as one process would.
The small results (a few floats per matrix) travel to rank 0 without a blocking collective on the
training path:

::

    scheduled point k (every rank, same order)      gloo thread              rank 0, later hooks
    -------------------------------------------      -----------              -------------------
    result of snapshot k-lag is (normally) done ──► pack into a fixed layout
                                                    reduce(SUM, dst=0, async) ──► Work.is_completed()
    take + submit snapshot k (own matrices only)                                  polled, never waited
                                                                                 ──► log with the step

* Collectives are issued only at points every rank reaches in the same order: the scheduled
  snapshots (the schedule depends only on ``global_step``, identical on every rank) and the end of
  fit. Polling and logging issue none, so ranks that drift apart by a step cannot deadlock.
* The results ride on a separate **gloo** process group, created once at fit start: the tensors are
  on the CPU (no stream of the training device is touched even under NCCL) and the reduce runs on
  gloo's own thread. The group has a timeout, so a rank that never arrives makes the work fail with
  an error rather than hang.
* Layout: rows = all watched matrices; for each (matrix, metric) a value and a presence flag; one
  health row per rank. A rank writes only its own rows, zeros elsewhere, so a SUM is a gather
  (NaN metrics such as ``energy_rank_90`` survive: NaN + 0 = NaN).
* A result that is not done at its point is sent as missing (the training thread never waits
  for it: :data:`DUE_WAIT_SECONDS` is 0), counted in that rank's ``skipped`` and dropped when it
  arrives; rank 0 logs the rows present. The one exception is the run's first snapshot, the
  reference of ``compression``: its point waits up to :data:`FIRST_DUE_WAIT_SECONDS` for it.
* After an exception no collective is issued: rank 0 logs the reduces already complete and its
  own rows of later snapshots (with a warning that they are partial).

This engine is for whole (replicated) weights. Sharded DTensor weights (FSDP2, tensor parallel)
go to ``sharded.ShardedEngine``, which decomposes each matrix where its shards live
(``protocol.make_engine`` chooses). FSDP1 and DeepSpeed ZeRO-3, whose flattened parameters hold no
matrix, come here too with ``units=`` (``partitioned.py``): at each scheduled point every rank
opens every unit's gather, in order, and copies the matrices it owns inside it; the rest is DDP's.

Example::

    >>> from types import SimpleNamespace
    >>> targets = [SimpleNamespace(name=f"w{i}", shape=shape)
    ...            for i, shape in enumerate([(64, 64), (64, 64), (256, 64), (64, 256)])]
    >>> partition(targets, world_size=2)
    [0, 1, 0, 1]
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spectral_callbacks.messages import rank_zero_warn
from spectral_callbacks.monitor.engines.budget import Plan, mib, plan_snapshot
from spectral_callbacks.monitor.engines.compute import SVD_FALLBACK
from spectral_callbacks.monitor.engines.engine import Compute, SnapshotEngine, SnapshotResult
from spectral_callbacks.monitor.engines.partitioned import GatherUnit
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.monitor.snapshot import ShapeGroup, Snapshot, group_by_shape, take_snapshot
from spectral_callbacks.names import monitor_tag
from spectral_callbacks.targets.target import Target

#: Seconds a rank's training thread waits, at a scheduled point, for its result of the snapshot
#: that is due: none. The result had ``lag`` snapshot intervals to finish; one that did not is sent
#: as missing, as the single-process engine skips rather than waits. (A test that checks every
#: value raises it, so a loaded CI machine cannot make it miss.)
DUE_WAIT_SECONDS = 0.0

#: Seconds a rank waits, once per run, for the result of its first snapshot when it is due: the
#: first snapshot is the reference of ``compression`` and the slowest of the run (a cold start that
#: calibrates the method, the first CUDA kernels), while an early step is the shortest, so with no
#: wait it missed its one-step deadline and compression was measured against a later step. A
#: bounded wait on this rank's own worker (no collective): training stalls at most this long, once.
FIRST_DUE_WAIT_SECONDS = 60.0

#: Per-rank health columns, logged as ``spectral_monitor/rank<r>/<name>``.
RANK_HEALTH: tuple[str, ...] = ("svd_ms", "main_thread_ms", "matrices", "skipped")

_POLL_SECONDS = 0.005


def matrix_cost(shape: Sequence[int]) -> int:
    """Flops of an SVD-like pass over an ``m x n`` matrix, ``m * n * min(m, n)``: the balancing key.

    >>> matrix_cost((768, 3072))
    1811939328
    """
    m, n = int(shape[0]), int(shape[1])
    return m * n * min(m, n)


def partition(targets: Sequence[Target], world_size: int) -> list[int]:
    """The rank that analyses each target: longest-processing-time-first over :func:`matrix_cost`.

    Deterministic (ties broken by target order), so every rank computes the same answer without
    communicating. Same-shaped matrices spread over ranks and are batched again on each rank.

    Args:
        targets: objects with ``shape`` ``(out, in)``, in the same order on every rank.
        world_size: number of processes.

    Returns:
        The owner rank of each target, in target order.

    Raises:
        ValueError: if ``world_size`` is not a positive int.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"`world_size` must be a positive int, got {world_size!r}")
    order = sorted(range(len(targets)), key=lambda i: (-matrix_cost(targets[i].shape), i))
    load = [0] * world_size
    owners = [0] * len(targets)
    for index in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += matrix_cost(targets[index].shape)
    return owners


def owned_names(targets: Sequence[Target], rank: int, world_size: int) -> set[str]:
    """The names of the targets ``rank`` copies and decomposes: its share of :func:`partition`.

    A function of the targets' shapes and order and of the world size alone, so it is the same at
    every snapshot of a run and in a run resumed on as many ranks.
    """
    owners = partition(targets, world_size)
    return {target.name for target, owner in zip(targets, owners, strict=True) if owner == rank}


def result_columns(metrics: Sequence[str]) -> tuple[str, ...]:
    """The metrics each rank sends: the logged ones, with ``stable_rank`` for ``compression``,
    ``frobenius_norm`` for rank 0's check of non-finite weights (a NaN ``stable_rank`` alone could
    be an all-zero matrix) and the flag of a matrix whose SVD fell back (``SVD_FALLBACK``), which
    rank 0 counts.

    >>> result_columns(("compression", "alpha"))
    ('alpha', 'stable_rank', 'frobenius_norm', 'svd_fallback')
    """
    columns = [metric for metric in metrics if metric != "compression"]
    if "compression" in metrics and "stable_rank" not in columns:
        columns.append("stable_rank")
    if "frobenius_norm" not in columns:
        columns.append("frobenius_norm")
    columns.append(SVD_FALLBACK)
    return tuple(columns)


class ResultLayout:
    """The fixed float64 layout one snapshot's results travel in, the same on every rank.

    ``[values (T*C) | present (T*C) | health (W*H)]`` for T targets, C metric columns, W ranks and
    the H :data:`RANK_HEALTH` columns. Float64 holds the float32 results exactly.

    Example::

        >>> layout = ResultLayout(["a", "b"], ("stable_rank",), world_size=2)
        >>> rank0 = layout.pack(0, {"a": {"stable_rank": 3.0}}, {"svd_ms": 2.0, "matrices": 1})
        >>> rank1 = layout.pack(1, {"b": {"stable_rank": 5.0}}, {"svd_ms": 4.0, "matrices": 1})
        >>> metrics, health = layout.unpack(rank0 + rank1)
        >>> metrics
        {'a': {'stable_rank': 3.0}, 'b': {'stable_rank': 5.0}}
        >>> [row["svd_ms"] for row in health]
        [2.0, 4.0]
    """

    def __init__(self, names: Sequence[str], columns: Sequence[str], world_size: int) -> None:
        self.names = list(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.columns = tuple(columns)
        self.world_size = world_size
        self.cells = len(self.names) * len(self.columns)
        self.size = 2 * self.cells + world_size * len(RANK_HEALTH)

    def pack(
        self, rank: int, metrics: dict[str, dict[str, float]] | None, health: dict[str, float]
    ) -> torch.Tensor:
        """This rank's contribution: its own results and health row, zeros everywhere else."""
        # On the host (gloo) whatever torch.set_default_device says on the training thread.
        flat = torch.zeros(self.size, dtype=torch.float64, device="cpu")
        values = flat[: self.cells].view(len(self.names), len(self.columns))  # (T, C)
        present = flat[self.cells : 2 * self.cells].view(len(self.names), len(self.columns))
        for name, row in (metrics or {}).items():
            for column, metric in enumerate(self.columns):
                if metric in row:
                    values[self.index[name], column] = float(row[metric])
                    present[self.index[name], column] = 1.0
        own = flat[2 * self.cells :].view(self.world_size, len(RANK_HEALTH))[rank]  # (H,)
        for column, name in enumerate(RANK_HEALTH):
            own[column] = float(health.get(name, 0.0))
        return flat

    def unpack(
        self, flat: torch.Tensor
    ) -> tuple[dict[str, dict[str, float]], list[dict[str, float]]]:
        """The metrics present (target -> metric -> value) and each rank's health row."""
        values = flat[: self.cells].view(len(self.names), len(self.columns)).tolist()
        present = flat[self.cells : 2 * self.cells].view(len(self.names), len(self.columns))
        metrics: dict[str, dict[str, float]] = {}
        for row, column in (present > 0.5).nonzero().tolist():
            metrics.setdefault(self.names[row], {})[self.columns[column]] = values[row][column]
        health = flat[2 * self.cells :].view(self.world_size, len(RANK_HEALTH)).tolist()
        return metrics, [dict(zip(RANK_HEALTH, row, strict=True)) for row in health]


def rank_scalars(health: Sequence[dict[str, float]]) -> dict[str, float]:
    """``spectral_monitor/rank<r>/<name>`` per rank, and the total of ``skipped`` over ranks.

    >>> rank_scalars([{"svd_ms": 2.0, "skipped": 1.0}, {"svd_ms": 3.0, "skipped": 0.0}])
    {'spectral_monitor/rank0/svd_ms': 2.0, 'spectral_monitor/rank0/skipped': 1.0, \
'spectral_monitor/rank1/svd_ms': 3.0, 'spectral_monitor/rank1/skipped': 0.0, \
'spectral_monitor/skipped': 1.0}
    """
    scalars = {
        monitor_tag(f"rank{rank}/{name}"): float(value)
        for rank, row in enumerate(health)
        for name, value in row.items()
    }
    scalars[monitor_tag("skipped")] = float(sum(row.get("skipped", 0.0) for row in health))
    return scalars


@dataclass
class _Point:
    step: int
    accepted: bool


class DistributedEngine:
    """A :class:`SnapshotEngine` over this rank's share, plus the gather of every rank's results.

    It implements :class:`spectral_callbacks.monitor.engines.protocol.Engine`, so the tracker drives it
    exactly as a :class:`SnapshotEngine`: every rank calls :meth:`offer` at every scheduled point
    (it issues the collective, so it never skips the call - the local engine skips and counts a
    snapshot when full), :meth:`collect` returns the gathered results on rank 0 and nothing
    elsewhere, :meth:`finish` at the end of training on every rank, :meth:`abort` after an
    exception. :meth:`submit` and :meth:`flush` are the lower-level steps ``offer`` and ``finish``
    are made of.

    Args:
        compute: the compute function (see :class:`SnapshotEngine`).
        targets: every watched matrix, in the same order on every rank.
        columns: the metric names sent to rank 0 (:func:`result_columns`).
        options: read as :class:`SnapshotEngine` reads them (``max_pending``,
            ``worker_threads``, ``worker_nice``, ``synchronous``). The result of a snapshot is sent
            ``max(1, max_pending - 1)`` scheduled points after it was taken.
        rank, world_size: this process and the number of processes.
        group: the process group the results travel on (a gloo group, see :func:`results_group`).
        inline, budget, skipped: as for :class:`SnapshotEngine` (a budget that cannot hold this
            rank's share at once is refused: several processes never stagger a snapshot).
    """

    def __init__(
        self,
        compute: Compute,
        targets: Sequence[Target],
        columns: Sequence[str],
        options: MonitorOptions,
        *,
        rank: int,
        world_size: int,
        group: Any,
        inline: bool | None = None,
        budget: int | None = None,
        skipped: int = 0,
        units: Sequence[GatherUnit] | None = None,
    ) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        mine = owned_names(targets, rank, world_size)
        self.owned = [target for target in targets if target.name in mine]
        self.layout = ResultLayout([target.name for target in targets], columns, world_size)
        # FSDP1 / ZeRO-3: every unit is gathered on every rank, this rank's groups copied inside;
        # the largest unit's full parameters are held beside this rank's copies.
        self.gathers = None
        groups = group_by_shape(self.owned)
        gathered = 0
        if units is not None:
            self.gathers = [(unit.open, _unit_groups(unit, mine)) for unit in units]
            groups = [group for _, unit_groups in self.gathers for group in unit_groups]
            gathered = max((unit.gathered_bytes for unit in units), default=0)
            if budget is not None:  # checked whole, before any matrix alone is
                _refuse_staggered(plan_snapshot(groups, compute, None), budget, rank, gathered)
        self._local = SnapshotEngine(
            compute,
            groups,
            options,
            inline=inline,
            budget=None if budget is None else budget - gathered,
            skipped=skipped,
        )
        if self._local.plan.staggered:
            _refuse_staggered(self._local.plan, budget, rank, gathered)
        self.groups = self._local.groups
        self.max_pending = options.max_pending
        self.lag = max(1, self.max_pending - 1)
        self.missed = 0  # results not done at their point: sent as missing, counted as skipped
        self._points: collections.deque[_Point] = collections.deque()
        self._done: dict[int, SnapshotResult] = {}
        self._late: set[int] = set()
        self._sent_first = False  # the first result (compression's reference) waits, bounded
        self._in_flight: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()
        self._aborted = False

    @property
    def pending(self) -> int:
        """Local snapshots not yet decomposed plus reduces not yet complete."""
        return self._local.pending + len(self._in_flight)

    @property
    def in_flight(self) -> int:
        """Reduces issued and not yet collected."""
        return len(self._in_flight)

    @property
    def skipped(self) -> int:
        """Snapshots this rank skipped (bound hit) or sent as missing (not done in time)."""
        return self._local.skipped + self.missed

    @property
    def skipped_matrices(self) -> int:
        """Always 0: under several processes a snapshot is never staggered (refused instead)."""
        return 0

    @property
    def awaiting_results(self) -> bool:
        """Whether :meth:`collect` may still return a result here: rank 0, with reduces issued."""
        return self.rank == 0 and bool(self._in_flight)

    def advance(self, step: int) -> None:
        """Nothing: snapshots are never staggered here."""

    def offer(self, step: int) -> bool:
        """A scheduled point: send the result now due, then snapshot this rank's share of ``step``
        (FSDP1 / ZeRO-3: inside each unit's gather, which every rank opens, copying or not)."""
        if self._aborted:
            return False
        self._send_due()
        if self.gathers is not None:
            # No collect runs between this test and submit, so a full engine still skips there.
            room = self._local.pending < self.max_pending
            gathers = self.gathers if room else [(open_, []) for open_, _ in self.gathers]
            accepted = self._local.submit(take_snapshot([], step, gathers))
        else:
            accepted = self._local.offer(step)
        self._points.append(_Point(step, accepted))
        return accepted

    def submit(self, snapshot: Snapshot) -> bool:
        """:meth:`offer` for a snapshot of this rank's share taken elsewhere."""
        if self._aborted:
            return False
        self._send_due()
        accepted = self._local.submit(snapshot)
        self._points.append(_Point(snapshot.step, accepted))
        return accepted

    def finish(self, step: int, *, offered: bool, deadline: float) -> None:
        """End of training, on every rank: a last point at ``step`` unless it was one, then flush.

        A snapshot is a collective point, so every rank decides alike, by the shared schedule
        (``offered``): a local skip of the last scheduled snapshot cannot be retaken on one rank.
        """
        if not offered:
            self.offer(step)
        self.flush(deadline)

    def _send_due(self) -> None:
        self._harvest()
        while len(self._points) >= self.lag:
            wait = DUE_WAIT_SECONDS if self._sent_first else FIRST_DUE_WAIT_SECONDS
            self._sent_first = True
            self._send(self._points.popleft(), time.monotonic() + wait)

    def flush(self, deadline: float) -> None:
        """End of fit, on every rank: send every result still due (waiting until ``deadline``)."""
        if self._aborted:
            return
        while self._points:
            self._sent_first = True
            self._send(self._points.popleft(), deadline)

    def collect(self, wait_seconds: float = 0.0) -> list[SnapshotResult]:
        """Gathered results whose reduce is complete, in step order (rank 0; ``[]`` elsewhere)."""
        deadline = time.monotonic() + wait_seconds
        self._harvest()
        results: list[SnapshotResult] = []
        while self._in_flight:
            step, flat, work = self._in_flight[0]
            if not work.is_completed():
                if self._aborted or time.monotonic() >= deadline:
                    break
                time.sleep(_POLL_SECONDS)
                continue
            self._in_flight.popleft()
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - a lost peer: reported, training goes on
                rank_zero_warn(
                    f"SpectralMonitor: the results of step {step} could not be gathered from every "
                    f"rank and are dropped: {error}",
                    category=RuntimeWarning,
                )
                continue
            if self.rank == 0:
                results.append(self._decode(step, flat))
        if self._aborted and self.rank == 0:
            results.extend(self._partial(deadline))
        return results

    def abort(self) -> None:
        """After an exception: issue no more collectives (peers may never reach them)."""
        self._aborted = True
        self._in_flight = collections.deque(
            item for item in self._in_flight if item[2].is_completed()
        )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the local worker; reduces still in flight are abandoned (gloo finishes or times out)."""
        self._local.close(timeout)

    # --- helpers ----------------------------------------------------------------------------

    def _harvest(self, wait_seconds: float = 0.0) -> None:
        """Move finished local results into ``_done``; a result already sent as missing is dropped."""
        for result in self._local.collect(wait_seconds=wait_seconds):
            if result.step in self._late:
                self._late.discard(result.step)
            else:
                self._done[result.step] = result

    def _await(self, point: _Point, deadline: float) -> SnapshotResult | None:
        """This rank's result of ``point`` if it is done by ``deadline`` (``None`` if skipped)."""
        self._harvest()
        while point.step not in self._done and point.accepted and time.monotonic() < deadline:
            self._harvest(wait_seconds=_POLL_SECONDS)
        return self._done.pop(point.step, None)

    def _send(self, point: _Point, deadline: float) -> None:
        result = self._await(point, deadline)
        if result is None and point.accepted:
            self._late.add(point.step)
            self.missed += 1
        health: dict[str, float] = {"skipped": float(self.skipped)}
        if result is not None:
            health.update(
                svd_ms=1000 * result.svd_seconds,
                main_thread_ms=1000 * result.main_thread_seconds,
                matrices=len(result.metrics),
            )
        flat = self.layout.pack(self.rank, result.metrics if result else None, health)
        # 0 is rank 0 of the default group: results_group() holds every rank in order.
        work = dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._in_flight.append((point.step, flat, work))

    def _decode(self, step: int, flat: torch.Tensor) -> SnapshotResult:
        metrics, health = self.layout.unpack(flat)
        # The snapshot took as long as its slowest rank: that is what the aggregate health shows.
        svd = max(row["svd_ms"] for row in health) / 1000
        main = max(row["main_thread_ms"] for row in health) / 1000
        return SnapshotResult(step, metrics, svd, main, rank_scalars=rank_scalars(health))

    def _partial(self, deadline: float) -> list[SnapshotResult]:
        """Rank 0's own rows of snapshots never sent (after an exception), with a warning."""
        partial = []
        for point in list(self._points):
            result = self._await(point, deadline)
            if result is not None:
                partial.append(result)
        self._points.clear()
        if partial:
            rank_zero_warn(
                "SpectralMonitor: training stopped with an exception before the results of step(s) "
                f"{[r.step for r in partial]} were gathered; only rank 0's share of the matrices "
                f"({len(self.owned)} of {len(self.layout.names)}) is logged for them",
                category=RuntimeWarning,
            )
        return partial


def _refuse_staggered(plan: Plan, budget: int | None, rank: int, gathered: int) -> None:
    """Raise if ``plan``'s snapshot and ``gathered`` bytes of one gathered unit exceed ``budget``:
    under several processes a snapshot is never staggered over steps.

    Raises:
        ConfigurationError: with the bytes needed.
    """
    need = sum(plan.copies.values()) + max(plan.working.values(), default=0) + plan.kept
    need += gathered
    if budget is None or (need <= budget and not plan.staggered):
        return
    gather = f", {gathered} bytes of them one gathered unit" if gathered else ""
    raise ConfigurationError(
        f"`max_snapshot_bytes` ({budget} bytes = {mib(budget)}) cannot hold "
        f"rank {rank}'s share of a snapshot at once ({need} bytes = {mib(need)}{gather}); "
        "under several processes every snapshot is taken at one step on every rank, so "
        "raise `max_snapshot_bytes` to at least that, or watch fewer matrices (`roles=`, "
        "`exclude=`)"
    )


def _unit_groups(unit: GatherUnit, mine: set[str]) -> list[ShapeGroup]:
    """The shape groups of ``unit``'s targets that this rank owns, keyed by the unit too (each
    is copied inside its own gather)."""
    owned = [target for target in unit.targets if target.name in mine]
    return [
        dataclasses.replace(group, key=f"{unit.key}/{group.key}") for group in group_by_shape(owned)
    ]


def results_group(timeout_seconds: float) -> Any:
    """A gloo process group over every rank for the results (a collective: call on every rank).

    Gloo keeps the tensors on the CPU and runs on its own thread whatever the training backend is
    (NCCL included), and its ``timeout`` turns a rank that never arrives into an error.
    """
    return dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=max(60.0, timeout_seconds))
    )


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group if one is up; ``(0, 1)`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
