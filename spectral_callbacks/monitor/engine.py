"""SnapshotEngine: decompose snapshots off the training path, a bounded number at a time.

::

    main thread (hooks)                 worker thread                     CUDA side stream
    -------------------                 -------------                     ----------------
    take_snapshot ───── submit ───────► compute(group, batch) per group ► SVD kernels, results
      (skipped + counted if               (one thread, FIFO)                 copied to pinned host
       max_pending are in flight)                                            memory, `done` event
    collect ◄── future done and `done` event reached (polled, never waited on) ◄──┘

* CPU: the copy was made on the main thread; one daemon worker thread (started lazily) runs the
  compute function, so training only loses what the worker takes from the shared cores.
* CUDA: the worker only *enqueues* the compute on the snapshot's side stream and records an event;
  the main thread polls ``event.query()`` in later hooks - no ``synchronize()`` and no ``.item()``
  on the training path.
* ``synchronous=True`` runs the compute inline and waits for it: the naive baseline.

Errors raised by the compute function are re-raised on the main thread by :meth:`collect`, as a
:class:`SpectralComputeError` naming the matrix.

Example::

    >>> import torch
    >>> from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    >>> from types import SimpleNamespace
    >>> target = SimpleNamespace(name="w", matrix=lambda: 2 * torch.eye(3))
    >>> groups = group_by_shape([target])
    >>> def top_singular_value(group, batch):
    ...     return {"spectral_norm": torch.linalg.matrix_norm(batch, ord=2)}
    >>> engine = SnapshotEngine(top_singular_value, groups)
    >>> engine.submit(take_snapshot(groups, step=0))
    True
    >>> [(result.step, result.metrics) for result in engine.collect(wait_seconds=10)]
    [(0, {'w': {'spectral_norm': 2.0}})]
    >>> engine.close()
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from spectral_callbacks.monitor.messages import rank_zero_warn
from spectral_callbacks.monitor.snapshot import ShapeGroup, Snapshot, take_snapshot

#: ``compute(group, batch)``: ``batch`` is a float ``(B, m, n)`` stack of the group's matrices;
#: returns metric name -> ``(B,)`` tensor. On CUDA it runs with the side stream current.
Compute = Callable[[ShapeGroup, torch.Tensor], dict[str, torch.Tensor]]

_POLL_SECONDS = 0.005


class SpectralComputeError(RuntimeError):
    """The compute function failed on a snapshot; the message names the matrix and the step."""


@dataclass
class SnapshotResult:
    """The metrics of one snapshot: target name -> metric -> value, and what it cost.

    ``rank_scalars`` holds health scalars an engine adds to the log (under DDP: each rank's health
    and the total of skipped snapshots over ranks); empty for one process.
    """

    step: int
    metrics: dict[str, dict[str, float]]
    svd_seconds: float
    main_thread_seconds: float
    rank_scalars: dict[str, float] = field(default_factory=dict)


@dataclass
class _DeviceWork:
    """What the worker enqueued on a CUDA stream; complete once ``done`` is reached."""

    host: dict[str, dict[str, torch.Tensor]]  # group key -> metric -> pinned (B,) tensor
    start: Any
    done: Any


@dataclass
class _Job:
    snapshot: Snapshot
    future: Future


class SnapshotEngine:
    """Runs ``compute`` on snapshots off the training path, at most ``max_pending`` at a time.

    Args:
        compute: the function that turns a ``(B, m, n)`` float batch into metric tensors, for
            example :class:`spectral_callbacks.monitor.compute.SpectrumCompute`.
        groups: the shape groups the snapshots hold, from ``group_by_shape``.
        max_pending: how many snapshots may be submitted and not yet collected. Default ``2``.
        synchronous: compute inline in :meth:`submit` and wait for it. Default ``False``.
        worker_threads: ``torch.set_num_threads`` in the worker thread (it is per-thread for the
            OpenMP pool), so a CPU SVD does not claim every core training uses. ``None`` leaves
            torch's default. Default ``1``.
        worker_nice: raise the worker thread's nice value by this much (Linux: per thread), so on
            busy cores the scheduler runs training first and the SVD in what is left. ``None``
            leaves it; ignored on CUDA, where the worker only enqueues kernels. Default ``None``.
        skipped: snapshots skipped before a resume, so ``skipped`` keeps counting. Default ``0``.

    It implements :class:`spectral_callbacks.monitor.protocol.Engine`; :meth:`submit` is the
    lower-level hand-over of a snapshot taken elsewhere.

    Raises:
        ValueError: if ``max_pending`` is not a positive int.
    """

    def __init__(
        self,
        compute: Compute,
        groups: Sequence[ShapeGroup],
        *,
        max_pending: int = 2,
        synchronous: bool = False,
        worker_threads: int | None = 1,
        worker_nice: int | None = None,
        skipped: int = 0,
    ) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"`max_pending` must be a positive int, got {max_pending!r}")
        self.compute = compute
        self.groups = {group.key: group for group in groups}
        self.max_pending = max_pending
        self.synchronous = synchronous
        self.worker_threads = worker_threads
        devices = [group.targets[0].matrix().device for group in self.groups.values()]
        cuda = [device for device in devices if device.type == "cuda"]
        #: The side stream CUDA snapshots are copied and decomposed on (``None`` on the CPU).
        self.stream = torch.cuda.Stream(cuda[0]) if cuda and not synchronous else None
        # On CUDA the worker only enqueues kernels: lowering its priority would only add latency.
        self.worker_nice = worker_nice if self.stream is None else None
        # The skip count lives here only: changed by _skip and by finish() retaking a skipped step.
        self._skipped = skipped
        self._last_skipped: int | None = None
        self._last_accepted: int | None = None
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def pending(self) -> int:
        """Snapshots submitted and not yet collected."""
        return len(self._jobs)

    @property
    def skipped(self) -> int:
        """Scheduled snapshots not taken because ``max_pending`` were in flight."""
        return self._skipped

    @property
    def awaiting_results(self) -> bool:
        """Whether :meth:`collect` may still return a result here."""
        return self.pending > 0

    def offer(self, step: int) -> bool:
        """A scheduled point: snapshot the weights of ``step`` and hand them over, or skip.

        The bound is checked before the copy, so a skipped snapshot costs nothing.
        """
        if self.pending >= self.max_pending:
            self._skip(step)
            return False
        return self.submit(self._take(step))

    def finish(self, step: int, *, offered: bool, deadline: float) -> None:
        """End of training at ``step``: measure it unless it already was, waiting for room.

        The final step is always measured: if it was skipped (or never offered) the engine waits
        until ``deadline`` for a snapshot in flight to finish computing, then takes it, and a skip
        of it counted earlier is taken back.
        """
        if offered and self._last_accepted == step:
            return
        while self._computing() >= self.max_pending and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        if self._computing() >= self.max_pending:
            if self._last_skipped != step:
                self._skip(step)
            return
        retaken = self._last_skipped == step
        self._hand_over(self._take(step))
        if retaken:
            self._skipped -= 1

    def abort(self) -> None:
        """After an exception: nothing to do for one process (no collective can hang)."""

    def submit(self, snapshot: Snapshot) -> bool:
        """Hand a snapshot over; ``False`` (and ``skipped`` counts it) if ``max_pending`` are in flight."""
        if self.pending >= self.max_pending:
            self._skip(snapshot.step)
            return False
        self._hand_over(snapshot)
        return True

    def _take(self, step: int) -> Snapshot:
        with torch.no_grad():
            return take_snapshot(list(self.groups.values()), step, stream=self.stream)

    def _skip(self, step: int) -> None:
        self._skipped += 1
        self._last_skipped = step

    def _computing(self) -> int:
        """Snapshots still holding their copies (not yet decomposed)."""
        return sum(not self._complete(job) for job in self._jobs)

    def _hand_over(self, snapshot: Snapshot) -> None:
        self._last_accepted = snapshot.step
        job = _Job(snapshot, Future())
        self._jobs.append(job)
        if self.synchronous:
            self._run(job)
            work = job.future.result() if job.future.exception() is None else None
            if isinstance(work, _DeviceWork):
                work.done.synchronize()  # the baseline blocks by design
            return
        self._ensure_worker()
        self._queue.put(job)

    def collect(self, wait_seconds: float = 0.0) -> list[SnapshotResult]:
        """The results that are complete, in step order; waits up to ``wait_seconds`` for all.

        Raises:
            SpectralComputeError: if the compute function failed on a snapshot (raised once; the
                snapshots before it are returned by the next call).
        """
        deadline = time.monotonic() + wait_seconds
        results: list[SnapshotResult] = []
        while self._jobs:
            job = self._jobs[0]
            if not self._complete(job) and not self._wait(job, deadline):
                break
            self._jobs.popleft()
            if job.future.cancelled():
                continue
            error = job.future.exception()
            if error is not None:
                if results:  # hand the finished ones over first; the error comes next call
                    self._jobs.appendleft(job)
                    break
                raise error
            results.append(self._result(job))
        return results

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: queued snapshots are dropped, a running one may finish within ``timeout``."""
        self._closing.set()
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._queue.put(None)
        worker.join(timeout)
        if worker.is_alive():  # a daemon thread: it cannot keep the interpreter alive
            rank_zero_warn(
                f"SpectralMonitor's worker thread did not stop within {timeout} s; it is left "
                "running as a daemon thread and its snapshot is dropped",
                category=RuntimeWarning,
            )
        self._jobs.clear()

    # --- worker side ------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._closing.clear()
            self._worker = threading.Thread(
                target=self._loop, name="SpectralMonitor-worker", daemon=True
            )
            self._worker.start()

    def _loop(self) -> None:
        if self.worker_threads is not None:
            torch.set_num_threads(self.worker_threads)
        if self.worker_nice and hasattr(os, "setpriority"):
            try:  # on Linux a thread is a task: this lowers the priority of this thread only
                thread = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS,
                    thread,
                    os.getpriority(os.PRIO_PROCESS, thread) + self.worker_nice,
                )
            except OSError:  # not permitted here: run at normal priority
                pass
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._closing.is_set():
                job.future.cancel()
                continue
            self._run(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self._compute_snapshot(job.snapshot))
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread by collect()
            job.future.set_exception(error)
        finally:
            job.snapshot.tensors = {}  # free the copies as soon as they are decomposed

    def _compute_snapshot(self, snapshot: Snapshot) -> dict[str, Any] | _DeviceWork:
        if snapshot.stream is None:
            start = time.perf_counter()
            values = {
                key: self._compute_group(key, batch, snapshot.step)
                for key, batch in snapshot.tensors.items()
            }
            host = {
                key: {m: t.tolist() for m, t in metrics.items()} for key, metrics in values.items()
            }
            return {"host": host, "seconds": time.perf_counter() - start}
        stream = snapshot.stream
        with torch.cuda.stream(stream):
            started = torch.cuda.Event(enable_timing=True)
            started.record(stream)
            host_tensors: dict[str, dict[str, torch.Tensor]] = {}
            for key, batch in snapshot.tensors.items():
                metrics = self._compute_group(key, batch, snapshot.step)
                host_tensors[key] = {}
                for name, value in metrics.items():
                    # Pinned memory makes the device-to-host copy truly asynchronous.
                    pinned = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    pinned.copy_(value, non_blocking=True)
                    host_tensors[key][name] = pinned
            done = torch.cuda.Event(enable_timing=True)
            done.record(stream)
        return _DeviceWork(host_tensors, started, done)

    def _compute_group(self, key: str, batch: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        group = self.groups[key]
        work = batch if batch.dtype in (torch.float32, torch.float64) else batch.float()
        try:
            metrics = self.compute(group, work)
            for name, value in metrics.items():
                if value.shape != (len(group.targets),):
                    raise ValueError(
                        f"metric {name!r} has shape {tuple(value.shape)}, expected ({len(group.targets)},)"
                    )
            return {name: value.detach() for name, value in metrics.items()}
        except Exception as error:
            culprit = self._find_culprit(group, work)
            raise SpectralComputeError(
                f"SpectralMonitor could not compute the spectrum of {culprit} at step {step} "
                f"(shape group {key}): {type(error).__name__}: {error}"
            ) from error

    def _find_culprit(self, group: ShapeGroup, batch: torch.Tensor) -> str:
        """Name the matrix that fails alone, or the whole group if none does."""
        if len(group.targets) > 1:
            for index, name in enumerate(group.names):
                single = ShapeGroup(group.key, (group.targets[index],))
                try:
                    self.compute(single, batch[index : index + 1])
                except Exception:
                    return f"matrix {name!r}"
        return "matrices " + ", ".join(repr(name) for name in group.names)

    # --- main-thread side -------------------------------------------------------------------

    def _complete(self, job: _Job) -> bool:
        if not job.future.done():
            return False
        if job.future.cancelled() or job.future.exception() is not None:
            return True
        work = job.future.result()
        return not isinstance(work, _DeviceWork) or work.done.query()

    def _wait(self, job: _Job, deadline: float) -> bool:
        while time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            if self._complete(job):
                return True
        return False

    def _result(self, job: _Job) -> SnapshotResult:
        work = job.future.result()
        if isinstance(work, _DeviceWork):
            host = {
                key: {m: t.tolist() for m, t in metrics.items()}
                for key, metrics in work.host.items()
            }
            seconds = work.start.elapsed_time(work.done) / 1000.0
        else:
            host, seconds = work["host"], work["seconds"]
        metrics: dict[str, dict[str, float]] = {}
        for key, values in host.items():
            for index, name in enumerate(self.groups[key].names):
                metrics[name] = {metric: float(column[index]) for metric, column in values.items()}
        return SnapshotResult(job.snapshot.step, metrics, seconds, job.snapshot.main_thread_seconds)
