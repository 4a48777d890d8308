"""ShardedEngine: live spectra of sharded weights (FSDP2, tensor parallel DTensors), never gathered.

Each rank copies only its own rows (or columns) of each watched matrix (``shards.py``) and a worker
thread decomposes every matrix *together with the other ranks*, with the distributed randomized
SVD of ``functional/sharded_svd.py`` on a process group of its own:

::

    main thread, every rank (scheduled steps)       worker thread, every rank
    -----------------------------------------       -------------------------
    offer(step): copy the local blocks into    ──►  per shape group, in the same order everywhere:
      padded (B, rows here, d) stacks, queue          scalars all-reduce, Krylov all-reduces (d x b),
      them for the worker (FIFO)                      b x b Gram all-reduce -> the same S on all ranks
    collect(): results whose worker job is done ◄──   metrics; every rank has every matrix's values

On CUDA the copies are queued on the training stream with an event after them, and the worker
runs each group on its device's compute stream once that event is reached (``streams.py``): neither
the SVD nor gloo's host staging of its CUDA all-reduces queues behind training's kernels, and
training never waits for them.

Targets with an update (``shard_updates.py``): an adapted layer's local rows are the base's shard
plus the small factors, which the worker gathers over the same group (``r (m + n)`` floats per
matrix) and multiplies as ``W_{0,r} X + U_r (V X)`` inside the Krylov iteration; its update family
is exact from the whole factors. A ``delta=`` target's reference is kept sharded as the weight, and
``W_t - W_ref`` gets a second sharded SVD.

Agreement, by construction: every rank computes every snapshot it is handed, groups and matrices in
one fixed order (target order), and the caller hands snapshots over at the steps of the shared
schedule (a function of the optimizer step alone). Nothing depends on local timing, so the
collectives of the ranks always match; no skip is ever decided locally (a skip on one rank and not
another would desynchronize the group) and no collective runs on the training thread.

Failure, bounded: the SVD's process group has a timeout, so a rank that never arrives makes the
others' worker fail within it; a worker error (on any rank) is re-raised on that rank's main
thread by the next :meth:`ShardedEngine.offer` / :meth:`ShardedEngine.collect` and the engine
issues no more collectives; a rank whose worker is more than ``max_pending`` snapshots behind when
the next one is due waits at most ``behind_timeout`` seconds and then raises. Either way the run
ends with an error on every rank, never a hang.

This engine keeps its own small worker loop rather than reusing ``SnapshotEngine``: that one skips
a snapshot when it is full (a local decision) and, after an error, recomputes single matrices to
name the culprit (collectives on one rank alone); both would desynchronize the group.

Example (one process, a one-rank gloo group)::

    >>> import tempfile, time, torch, torch.distributed as dist
    >>> from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    >>> from spectral_callbacks.monitor.options import MonitorOptions
    >>> from spectral_callbacks.targets import Target
    >>> store = tempfile.NamedTemporaryFile(delete=False).name
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> weight = torch.diag(torch.tensor([3.0, 1.0, 1.0, 1.0]))
    >>> engine = ShardedEngine([Target.from_parameter("w", weight, role="O")],
    ...                        SpectrumCompute(k=2), MonitorOptions(),
    ...                        group=svd_group(timeout_seconds=30))
    >>> engine.offer(step=0)
    True
    >>> engine.finish(0, offered=True, deadline=time.monotonic() + 30)
    >>> [(r.step, round(r.metrics["w"]["stable_rank"], 4)) for r in engine.collect()]
    [(0, 1.3333)]
    >>> engine.close(); dist.destroy_process_group()
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from spectral_callbacks.functional.batch import UpdateSpectrum
from spectral_callbacks.functional.lowrank import low_rank_singular_values
from spectral_callbacks.functional.metrics import metrics_from_spectrum, update_metrics
from spectral_callbacks.functional.sharded_svd import sharded_randomized_svd
from spectral_callbacks.functional.svd import DEFAULT_K
from spectral_callbacks.messages import count
from spectral_callbacks.monitor import background
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.engines.engine import SnapshotResult
from spectral_callbacks.monitor.engines.shard_updates import (
    AdaptedCopy,
    FactorShard,
    LocalAdapted,
    adapted_rows,
    base_moves,
    factor_shard,
    gather_factors,
    refuse_unsupported,
)
from spectral_callbacks.monitor.engines.shards import LocalPiece, local_piece, mesh_ranks
from spectral_callbacks.monitor.engines.streams import ComputeStreams, record_event
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.reporting import health_scalars
from spectral_callbacks.monitor.snapshot import Snapshot
from spectral_callbacks.targets.adapted import AdaptedTarget
from spectral_callbacks.targets.delta import DeltaTarget
from spectral_callbacks.targets.target import Target

__all__ = ["ShardGroup", "ShardedEngine", "ShardedEngineError", "ShardedResult", "svd_group"]

_POLL_SECONDS = 0.005
#: The name of the sharded engine's worker thread (tests find the thread by it).
SHARDED_WORKER_THREAD_NAME = "SpectralMonitor-sharded-worker"


class ShardedEngineError(RuntimeError):
    """The sharded computation failed or fell behind on this rank; the run cannot go on."""


@dataclass
class ShardedResult(SnapshotResult):
    """A snapshot's metrics (the same on every rank) and the payload this rank all-reduced.

    ``rank_scalars`` carries it to the log as ``spectral_monitor/sent_bytes``; ``factor_bytes``
    is the part of it adapters add: their factors (``shard_updates.gather_factors``) and their
    bases' ``||W_0||_F^2``.
    """

    sent_bytes: int = 0
    factor_bytes: int = 0


@dataclass(frozen=True)
class ShardGroup:
    """Watched matrices of one split, global shape and dtype, decomposed as one batch.

    The key and the members depend only on global facts (target order, global shapes, how the
    parameter is sharded), so every rank builds the same groups in the same order; the number of
    local rows of each member may differ between ranks, and the stack is padded with zero rows.
    """

    key: str
    pieces: tuple[LocalPiece, ...]
    #: For an adapted group, every factor its members read (each once), in target order, and
    #: for each member its factors' names -> positions there. Resolved once, on the training
    #: thread: the worker never reads a layer's parameters (FSDP2 swaps them during a forward).
    factors: tuple[FactorShard, ...] = ()
    factor_index: tuple[dict[str, int], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(piece.target.name for piece in self.pieces)

    @property
    def adapted(self) -> bool:
        """Whether the members are adapted layers (the effective weight ``W_0 + s B A``)."""
        return isinstance(self.pieces[0].target, AdaptedTarget)

    @property
    def delta(self) -> bool:
        """Whether the members keep a ``delta=`` reference (their update ``W_t - W_ref``)."""
        return isinstance(self.pieces[0].target, DeltaTarget)

    def stack(self) -> torch.Tensor | AdaptedCopy:
        """A fresh ``(B, rows, d)`` copy of the members' local blocks, zero rows as padding; for
        an adapted group, the local bases (views of the frozen shards, copies where the base
        moves) and copies of this rank's parts of the factors."""
        if self.adapted:
            bases = [
                piece.block().clone() if base_moves(piece.target) else piece.block()
                for piece in self.pieces
            ]
            return AdaptedCopy(bases, [factor.copy() for factor in self.factors])
        return _padded([piece.block() for piece in self.pieces])

    def reference_stack(self) -> torch.Tensor:
        """The ``(B, rows, d)`` local blocks of the members' ``delta=`` references, padded as
        :meth:`stack` pads (the references never change: read on the worker)."""
        references = [getattr(piece.target, "reference", None) for piece in self.pieces]
        return _padded([p.block(r) for p, r in zip(self.pieces, references, strict=True)])


def _padded(blocks: list[torch.Tensor]) -> torch.Tensor:
    """A fresh ``(B, rows, d)`` stack of ``blocks``, zero rows as padding."""
    rows = max(block.shape[0] for block in blocks)
    first = blocks[0]  # every member has the same width (d, or a tile's one member)
    out = torch.zeros((len(blocks), rows, first.shape[1]), dtype=first.dtype, device=first.device)
    for slot, block in zip(out, blocks, strict=True):
        slot[: block.shape[0]].copy_(block)
    return out


def svd_group(timeout_seconds: float = 300.0, ranks: Sequence[int] | None = None) -> Any:
    """A gloo process group of its own for the SVD's collectives (a collective: call on every rank).

    Args:
        timeout_seconds: how long a collective waits for a missing rank before it fails. Default
            300. It bounds how long a failure elsewhere can stall this rank's worker.
        ranks: the global ranks of the group; default ``None`` is every rank.
    """
    return dist.new_group(
        ranks=None if ranks is None else list(ranks),
        backend="gloo",
        timeout=datetime.timedelta(seconds=timeout_seconds),
    )


@dataclass
class _Job:
    snapshot: Snapshot
    future: Future


class ShardedEngine:
    """Decomposes the watched matrices of a sharded model where their shards live.

    It implements :class:`~spectral_callbacks.monitor.engines.protocol.Engine`, and ``make_engine`` picks
    it when a watched parameter is a DTensor: ``offer`` at each scheduled step on every rank,
    ``collect`` in later hooks (every rank gets every matrix's metrics; the tracker writes them
    on rank 0 only), ``finish`` at the end of training, ``abort`` after an exception, ``close``.

    Args:
        targets: every watched matrix, from ``find_targets`` on the sharded model, in the same
            order on every rank.
        group: the SVD's process group (:func:`svd_group`), never training's. Every rank of the
            targets' device mesh must be in it.
        compute: the default compute function the ranks configure the SVD like: its ``k``, its
            ``n_oversamples`` and ``n_iter`` (passed to ``sharded_randomized_svd``; its
            ``method`` is not read), its ``metric_options`` (``fit_window``) and ``warm_start``
            (start each group from its previous subspace).
        options: what the engine reads of them: ``max_pending`` (snapshots that may be queued or
            computing), ``drain_timeout`` (``behind_timeout`` unless given), ``worker_threads``
            (intra-op threads of the worker thread only, ``background.Worker``) and
            ``synchronous`` (where ``inline`` is ``None``).
        inline: compute inline in :meth:`offer` (a baseline, and for tests). Default ``None``:
            ``bool(options.synchronous)``.
        skipped: skips counted before a resume (this engine adds none). Default ``0``.
        behind_timeout: seconds :meth:`offer` waits for room when ``max_pending`` are in flight
            before it raises. Default ``None``: ``max(options.drain_timeout, 1.0)``.
        comm_dtype: the dtype the Krylov blocks travel in (``sharded_randomized_svd``). Default
            ``torch.bfloat16``: half the bytes of float32, with the same stable rank and alpha
            along the tested training runs (the Rayleigh-Ritz step always sums in float64).
            ``None`` sends float32.
        seed: seed of the random start blocks (the same on every rank). Default ``0``.

    Raises:
        ValueError: an argument is out of range, or this rank is not in ``group``.
        ShardingError: a parameter is sharded in a way the engine cannot decompose, or a target
            carries an update it cannot decompose exactly where the shards live
            (``shard_updates.refuse_unsupported``: an adapter without factors, a quantized base,
            DoRA split by columns, an adapted base in tiles).
    """

    def __init__(
        self,
        targets: Sequence[Target],
        compute: SpectrumCompute,
        options: MonitorOptions,
        *,
        group: Any,
        inline: bool | None = None,
        skipped: int = 0,
        behind_timeout: float | None = None,
        comm_dtype: torch.dtype | None = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        k = compute.k
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        if behind_timeout is None:
            behind_timeout = max(options.drain_timeout, 1.0)
        if not targets:
            raise ValueError("`targets` is empty: pass what find_targets returned for the model")
        if not behind_timeout > 0:
            raise ValueError(f"`behind_timeout` must be positive seconds, got {behind_timeout!r}")
        group_rank = dist.get_rank(group)
        if group_rank < 0:
            raise ValueError("this rank is not in `group`: build it with svd_group() on every rank")
        missing = set(mesh_ranks(list(targets))) - set(dist.get_process_group_ranks(group))
        if missing:
            raise ValueError(
                f"ranks {sorted(missing)} hold shards of the watched weights but are not in "
                "`group`; build it with svd_group() over every rank of the device mesh"
            )
        self.group = group
        self.k = k
        self.svd_options: dict[str, Any] = {"comm_dtype": comm_dtype}
        for name in ("n_oversamples", "n_iter"):
            if name in compute.svd_options:
                self.svd_options[name] = compute.svd_options[name]
        self.metric_options = dict(compute.metric_options)
        self.max_pending = options.max_pending
        self.behind_timeout = behind_timeout
        self.warm_start = compute.warm_start
        self.seed = seed
        self.synchronous = bool(options.synchronous) if inline is None else inline
        self.worker_threads = options.worker_threads
        pieces = [local_piece(target, group_rank) for target in targets]
        refuse_unsupported(targets, pieces)
        self.groups = _group(pieces, group_rank, min(dist.get_process_group_ranks(group)))
        self._subspaces: dict[str, torch.Tensor] = {}
        self._streams = ComputeStreams()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._worker = background.Worker(
            self._work,
            SHARDED_WORKER_THREAD_NAME,
            threads=self.worker_threads,
            stop=self._stop_at_exit,
            waiting_for="to leave the collective it is in (at most the SVD group's timeout)",
            left_running=(
                "it waits in a collective until the SVD group's timeout and is left as a daemon "
                "thread"
            ),
        )
        self._stopped = threading.Event()  # set after an error or abort(): no more collectives
        self._error: BaseException | None = None
        self._skipped = skipped

    @property
    def pending(self) -> int:
        """Snapshots offered and not yet collected."""
        return len(self._jobs)

    @property
    def skipped(self) -> int:
        """Only what a resumed run counted before: a snapshot is computed on every rank or the run
        ends with an error, never skipped."""
        return self._skipped

    @property
    def awaiting_results(self) -> bool:
        """Whether :meth:`collect` may still return a result (the same answer on every rank)."""
        return bool(self._jobs)

    @property
    def skipped_matrices(self) -> int:
        """Always 0: sharded snapshots are never staggered."""
        return 0

    def advance(self, step: int) -> None:
        """Nothing: sharded snapshots are never staggered."""

    def offer(self, step: int) -> bool:
        """Snapshot this rank's blocks of ``step`` and queue them for the worker; returns ``True``.

        Call it after optimizer step ``step`` on every rank. On the CPU the copy is complete when
        this returns, so the next update (on the same thread) cannot touch it; on CUDA it is
        queued on the current stream, before any later update, and the worker's compute stream
        waits for it by an event. No communication, no host-device synchronization.

        Raises:
            ShardedEngineError: an earlier snapshot failed (on this rank, or a peer stopped
                answering), or ``max_pending`` snapshots are still not decomposed after
                ``behind_timeout`` seconds.
        """
        self._raise_if_failed()
        self._wait_for_room(step)
        start = time.perf_counter()
        with torch.no_grad():
            tensors: dict[str, Any] = {key: group.stack() for key, group in self.groups.items()}
        # On CUDA the copies are queued on the training stream; the worker's compute stream waits
        # on this event (one per device) before it reads them (streams.py).
        devices = dict.fromkeys(str(t.device) for t in tensors.values() if t.device.type == "cuda")
        copied = {device: record_event(device) for device in devices}
        job = _Job(Snapshot(step, tensors, time.perf_counter() - start, copied), Future())
        self._jobs.append(job)
        if self.synchronous:
            self._run(job)
            self._raise_if_failed()
            return True
        self._worker.submit(job)
        return True

    def finish(self, step: int, *, offered: bool, deadline: float) -> None:
        """End of training, on every rank: measure ``step`` unless offered, wait for the worker.

        If snapshots are still not decomposed at ``deadline`` the engine fails: :meth:`collect`
        hands over the finished results, then raises :class:`ShardedEngineError`.
        """
        if not offered:
            self.offer(step)
        while self._unfinished() and self._error is None and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        if self._unfinished() and self._error is None:
            steps = [job.snapshot.step for job in self._jobs if not job.future.done()]
            self._fail(
                ShardedEngineError(
                    f"the sharded spectral engine did not finish the snapshots of steps {steps} "
                    "by the end of training; raise drain_timeout or snapshot less often"
                )
            )

    def collect(self, wait_seconds: float = 0.0) -> list[SnapshotResult]:
        """The finished results in step order; waits up to ``wait_seconds`` for all of them.

        Raises:
            ShardedEngineError: a snapshot failed (the results before it are returned first).
        """
        deadline = time.monotonic() + wait_seconds
        results: list[SnapshotResult] = []
        while self._jobs:
            job = self._jobs[0]
            while not job.future.done() and self._error is None and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
            if not job.future.done():
                if self._error is not None and not results:
                    raise self._error
                break
            if job.future.cancelled() or job.future.exception() is not None:
                if results:  # hand the finished ones over first; the error comes next call
                    break
                self._raise_if_failed()
                self._jobs.popleft()  # cancelled by abort(): nothing to report
                continue
            self._jobs.popleft()
            results.append(job.future.result())
        return results

    def abort(self) -> None:
        """After an exception: start no more collectives (peers may never reach them)."""
        self._stopped.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker; a job inside a collective ends by itself or at the group's timeout."""
        self._stopped.set()
        self._worker.close(timeout)
        self._jobs.clear()
        self._subspaces.clear()  # the warm starts hold device memory; the run is over

    # --- worker side ------------------------------------------------------------------------

    def _stop_at_exit(self) -> str | None:
        """At interpreter exit: start no more collectives; the worker returns after its job."""
        self._stopped.set()
        self._worker.wake()
        in_flight = sum(not job.future.done() for job in list(self._jobs))
        return f"{in_flight} sharded snapshot(s) still in flight" if in_flight else None

    def _work(self, job: _Job, failure: Exception | None) -> None:
        """One job on the worker thread (``failure``: the thread's setup failed)."""
        if failure is not None:
            error = ShardedEngineError(
                f"the sharded spectral worker could not start ({type(failure).__name__}: "
                f"{failure}); check `worker_threads` ({self.worker_threads!r})"
            )
            self._fail(error)
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
            return
        self._run(job)

    def _run(self, job: _Job) -> None:
        if self._stopped.is_set():  # after an error or abort: issue no more collectives
            job.future.cancel()
        if not job.future.set_running_or_notify_cancel():
            job.snapshot.tensors = {}
            return
        try:
            job.future.set_result(self._decompose(job.snapshot))
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
            wrapped = ShardedEngineError(
                f"the sharded spectral engine failed at step {job.snapshot.step}: "
                f"{type(error).__name__}: {error}"
            )
            wrapped.__cause__ = error
            self._fail(wrapped)
            job.future.set_exception(wrapped)
        finally:
            job.snapshot.tensors = {}  # free the copies as soon as they are decomposed

    def _decompose(self, snapshot: Snapshot) -> ShardedResult:
        start = time.perf_counter()
        metrics: dict[str, dict[str, float]] = {}
        sent = factor_bytes = 0
        for index, (key, group) in enumerate(self.groups.items()):
            held: Any = snapshot.tensors.pop(key)  # freed once decomposed
            # On the compute stream after the copy, autocast off (streams.py): the SVD and gloo's
            # host staging of its CUDA all-reduces do not queue behind training's kernels.
            with self._streams.after_copy(held, snapshot.copied):
                # The same seed on every rank (a function of the step and the group only).
                seed = self.seed + 1_000_003 * snapshot.step + index
                update = None
                if group.adapted:
                    weights, update, moved = self._adapted(group, held)
                    sent += moved
                    factor_bytes += moved
                else:
                    weights = held if held.dtype in (torch.float32, torch.float64) else held.float()
                top = self._svd(weights, key, group.pieces[0], seed, self.k)
                values = metrics_from_spectrum(top.S, top.frobenius_sq, **self.metric_options)
                sent += top.sent_bytes
                if group.delta:
                    update, moved = self._delta_update(group, weights, key, seed)
                    sent += moved
                if update is not None:
                    values.update(update_metrics(*update))
                # A host read on the worker: it waits for this compute stream only.
                columns = {name: value.tolist() for name, value in values.items()}
            del held, weights
            for row, name in enumerate(group.names):
                metrics[name] = {metric: float(column[row]) for metric, column in columns.items()}
        seconds = time.perf_counter() - start
        return ShardedResult(
            snapshot.step,
            metrics,
            seconds,
            snapshot.main_thread_seconds,
            rank_scalars=health_scalars(sent_bytes=sent),
            sent_bytes=sent,
            factor_bytes=factor_bytes,
        )

    def _svd(self, weights: Any, key: str, piece: LocalPiece, seed: int, k: int) -> Any:
        """The distributed SVD of one group's local rows, warm-started from the group's last."""
        init = self._subspaces.get(key) if self.warm_start else None
        generator = torch.Generator(device=weights.device)
        generator.manual_seed(seed)
        top = sharded_randomized_svd(
            weights,
            k,
            group=self.group,
            shape=piece.shape,
            generator=generator,
            init=init,
            # The stacks hold rows of the split orientation (columns were transposed).
            split="tiles" if piece.split == "tiles" else "rows",
            row_index=piece.row_index,
            col_index=piece.col_index,
            **self.svd_options,
        )
        if self.warm_start and top.V is not None:
            self._subspaces[key] = top.V
        return top

    def _adapted(self, group: ShardGroup, held: AdaptedCopy) -> tuple[Any, UpdateSpectrum, int]:
        """The local rows of an adapted group as an operator, the update's exact spectrum, and
        the bytes moved: the factors (one all-reduce) and ``||W_0||_F^2`` (one of B scalars)."""
        wholes, moved = gather_factors(group.factors, held.parts, self.group)
        members, ups, downs = [], [], []
        for piece, index, base in zip(group.pieces, group.factor_index, held.bases, strict=True):
            factors = {name: wholes[position] for name, position in index.items()}
            local, up, down = adapted_rows(piece, factors, base)
            members.append(local)
            ups.append(up)
            downs.append(down)
        base_sq = torch.stack(
            [torch.linalg.vector_norm(base, dtype=torch.float64).square() for base in held.bases]
        )
        moved += self._all_sum(base_sq)
        rank = torch.tensor([float(up.shape[-1]) for up in ups], dtype=torch.float64)
        spectrum = UpdateSpectrum(low_rank_singular_values(ups, downs), base_sq.sqrt(), rank)
        rows = max(base.shape[0] for base in held.bases)
        return LocalAdapted(members, rows), spectrum, moved

    def _delta_update(
        self, group: ShardGroup, weights: torch.Tensor, key: str, seed: int
    ) -> tuple[UpdateSpectrum, int]:
        """The spectrum of ``W_t - W_ref`` (a second distributed SVD of the same split: the
        references are sharded as the weights) and ``||W_ref||_F``; the bytes moved."""
        reference = group.reference_stack().to(weights.dtype)
        top = self._svd(weights - reference, f"{key}/update", group.pieces[0], seed, DEFAULT_K)
        reference_sq = torch.linalg.vector_norm(reference, dim=(-2, -1), dtype=torch.float64)
        reference_sq = reference_sq.square()
        moved = self._all_sum(reference_sq) + top.sent_bytes
        rank = torch.full((len(reference),), float("nan"), dtype=torch.float64)
        return UpdateSpectrum(top.S, reference_sq.sqrt(), rank, top.frobenius_sq), moved

    def _all_sum(self, tensor: torch.Tensor) -> int:
        """Sum ``tensor`` over the SVD's group in place; the bytes it sent."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.numel() * tensor.element_size()

    # --- state ------------------------------------------------------------------------------

    def _wait_for_room(self, step: int) -> None:
        deadline = time.monotonic() + self.behind_timeout
        while not self.synchronous and self._unfinished() >= self.max_pending:
            self._raise_if_failed()
            if time.monotonic() >= deadline:
                waiting = count(self.max_pending, "snapshot")
                verb = "was" if self.max_pending == 1 else "were"
                self._fail(
                    ShardedEngineError(
                        f"the sharded spectral engine fell behind: {waiting} {verb} still not "
                        f"decomposed {self.behind_timeout} s after step {step} was due; snapshot "
                        "less often (every_n_steps) or raise behind_timeout"
                    )
                )
                self._raise_if_failed()
            time.sleep(_POLL_SECONDS)

    def _unfinished(self) -> int:
        return sum(not job.future.done() for job in self._jobs)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._stopped.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _group(
    pieces: Sequence[LocalPiece], group_rank: int, lowest_rank: int
) -> dict[str, ShardGroup]:
    """Shape groups in first-seen (target) order, keyed by global facts only (a kind that carries
    an update groups apart: adapted layers, ``delta=`` targets); ``lowest_rank``: the SVD
    group's lowest global rank (which copy of a factor held by parallel meshes sends it)."""
    members: dict[str, list[LocalPiece]] = {}
    for piece in pieces:
        target = piece.target
        dtype = str(target.parameter.dtype).removeprefix("torch.")
        key = f"{piece.split}/{piece.shape[0]}x{piece.shape[1]}/{dtype}"
        if piece.split == "tiles":  # each its own group: the tiles' positions differ
            key += f"/{target.name}"
        if isinstance(target, AdaptedTarget):
            key += "/adapted"
        elif isinstance(target, DeltaTarget):
            key += "/delta"
        members.setdefault(key, []).append(piece)
    groups = {}
    for key, group in members.items():
        factors: dict[int, int] = {}  # id of a factor parameter -> its position
        shards: list[FactorShard] = []
        index: list[dict[str, int]] = []
        for piece in group:
            named = {}
            if isinstance(piece.target, AdaptedTarget):
                for name, parameter in piece.target.factor_parameters().items():
                    if id(parameter) not in factors:  # shared (a fused layer's A): once
                        factors[id(parameter)] = len(shards)
                        shards.append(factor_shard(parameter, group_rank, lowest_rank))
                    named[name] = factors[id(parameter)]
            index.append(named)
        groups[key] = ShardGroup(key, tuple(group), tuple(shards), tuple(index))
    return groups
