"""SnapshotEngine: decompose snapshots off the training path, a bounded number at a time.

::

    main thread (offer)             worker thread (1, daemon)              CUDA, per device
    -------------------             -------------------------              ----------------
    take_snapshot (copy on the ──── submit ──► per shape group:            training stream: ... update s,
      training stream, `copied`      (skipped    compute.wait_event(copied)   copy, `copied`, step s+1 ...
      event after it)                + counted   stack.record_stream(compute) compute stream: SVD kernels,
                                     if full)    compute(group, batch)        metrics packed into one tensor
                                                 free the group's stack       -> one copy into a reused
                                                                              pinned host buffer, `done`
    collect ◄── future done and every `done` event reached (polled with query(), never waited on) ◄─┘

* CPU: the copy was made on the main thread; one daemon worker thread (started lazily) runs the
  compute function, so training only loses what the worker takes from the shared cores.
* CUDA: the worker enqueues each group's compute on its device's compute stream (one per device,
  the worker's current device set to it), after a wait on the snapshot's ``copied`` event - so the
  compute stream, not training, waits for the copy. The training stream never waits on the
  compute stream. The main thread polls ``event.query()`` in later hooks: no ``synchronize()`` and
  no ``.item()`` on the training path. The worker itself may block on the device inside the SVD
  math (LAPACK-style error checks, data-dependent branches): that stalls only the worker.
* Memory: each group's stack is freed as soon as its compute is enqueued (``record_stream`` keeps
  the caching allocator from reusing it before the compute stream is done with it); a snapshot's
  results travel in one pinned host buffer per device, reused from a pool of at most
  ``max_pending`` per device.
* ``synchronous=True`` runs the compute inline and waits for it: on a CPU with no core spare for
  the worker that costs training less than a worker would (``placement.py`` chooses).

Errors raised by the compute function are re-raised on the main thread by :meth:`collect`, as a
:class:`SpectralComputeError` naming the matrix, with the frames' locals cleared (a kept traceback
would otherwise pin the snapshot's memory). A worker thread that cannot even start fails every
snapshot the same way, so the error surfaces at the next hook. At interpreter exit, work still in
flight is abandoned at the next shape group and reported (``background.py``), never a crash.

Example::

    >>> import torch
    >>> from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    >>> from spectral_callbacks.targets import Target
    >>> target = Target.from_parameter("w", 2 * torch.eye(3), role="Q")
    >>> groups = group_by_shape([target])
    >>> def top_singular_value(group, batch):
    ...     return {"spectral_norm": torch.linalg.matrix_norm(batch, ord=2)}
    >>> from spectral_callbacks.monitor.options import MonitorOptions
    >>> engine = SnapshotEngine(top_singular_value, groups, MonitorOptions())
    >>> engine.submit(take_snapshot(groups, step=0))
    True
    >>> [(result.step, result.metrics) for result in engine.collect(wait_seconds=10)]
    [(0, {'w': {'spectral_norm': 2.0}})]
    >>> engine.close()
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from spectral_callbacks.functional.batch import Stack
from spectral_callbacks.monitor import background
from spectral_callbacks.monitor.engines.budget import Ledger, plan_snapshot
from spectral_callbacks.monitor.engines.compute import Compute
from spectral_callbacks.monitor.engines.streams import ComputeStreams
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import ShapeGroup, Snapshot, take_snapshot

_POLL_SECONDS = 0.005
#: The name of the engine's worker thread (tests and benchmarks find the thread by it).
WORKER_THREAD_NAME = "SpectralMonitor-worker"


class SpectralComputeError(RuntimeError):
    """The compute function failed on a snapshot; the message names the matrix and the step."""


class _Abandoned(Exception):
    """The engine was closed (or the interpreter is exiting) while this snapshot was computed."""


@dataclass
class SnapshotResult:
    """The metrics of one snapshot: target name -> metric -> value, and what it cost.

    ``svd_seconds`` is the compute's busy time: on the CPU the worker's wall time, on CUDA the sum
    over shape groups of the compute stream's time from the group's first kernel to its last
    (so neither the wait for the copy nor the gaps between groups count; kernels slowed by
    training's running alongside still do). ``copy_seconds`` is the copy's time on the training
    stream (CUDA; 0 on the CPU, where the copy is in ``main_thread_seconds``). ``rank_scalars``
    holds health scalars an engine adds to the log (under DDP: each rank's health and the total of
    skipped snapshots over ranks); empty for one process. ``due_step`` is the scheduled step of the
    snapshot these copies belong to (``step`` itself unless the snapshot was staggered over several
    steps by the budget); ``held_bytes`` what the engine's ledger held right after the copy.
    """

    step: int
    metrics: dict[str, dict[str, float]]
    svd_seconds: float
    main_thread_seconds: float
    copy_seconds: float = 0.0
    rank_scalars: dict[str, float] = field(default_factory=dict)
    due_step: int | None = None
    held_bytes: int = 0


@dataclass
class _Packed:
    """Where each group's metrics lie in a snapshot's one flat result tensor."""

    columns: list[tuple[str, tuple[str, ...], int, int]]  # (group key, metric names, offset, B)
    size: int


@dataclass
class _DeviceWork:
    """What the worker enqueued on the compute streams; complete once every ``done`` is reached."""

    host: dict[str, torch.Tensor]  # device -> pinned flat float64 results
    layout: dict[str, _Packed]  # device -> layout of its flat results
    busy: list[tuple[Any, Any]]  # (start, end) timing events per group
    done: list[Any]


@dataclass
class _Job:
    snapshot: Snapshot
    future: Future
    due_step: int = 0  # the scheduled step of the snapshot these parts belong to
    held_bytes: int = 0  # what the ledger held right after the copy
    token: int = -1  # the ledger holds this job's parts under (token, part key)


@dataclass
class _Round:
    """A scheduled snapshot whose parts are still being copied, one step after another."""

    due_step: int
    parts: collections.deque[ShapeGroup]  # not yet copied, in order


class SnapshotEngine:
    """Runs ``compute`` on snapshots off the training path, at most ``max_pending`` at a time.

    Args:
        compute: the function that turns a ``(B, m, n)`` float batch into metric tensors, for
            example :class:`spectral_callbacks.monitor.engines.compute.SpectrumCompute`.
        groups: the shape groups the snapshots hold, from ``group_by_shape``.
        options: what the engine reads of them:

            * ``max_pending``: how many snapshots may be submitted and not yet collected.
            * ``worker_threads``: intra-op threads of the worker thread (``torch.set_num_threads``,
              undone for every other thread: see :func:`background.limit_this_thread`), so a CPU
              SVD does not claim every core training uses. ``None`` leaves torch's default.
            * ``worker_nice``: raise the worker thread's nice value by this much (Linux: per
              thread), so on busy cores the scheduler runs training first and the SVD in what is
              left. ``None`` leaves it; ignored on CUDA, where the worker only enqueues kernels.
            * ``every_n_steps``: the delay bound of a staggered snapshot, which copies its parts
              within ``max(every_n_steps, 2 * parts)`` steps of its scheduled step; the matrices
              of parts still waiting then are skipped and counted in :attr:`skipped_matrices`.
            * ``synchronous``: where ``inline`` is ``None``, ``True`` computes inline.

            ``max_snapshot_bytes`` is not read: ``budget`` is its resolved value.
        inline: compute inline in :meth:`submit` and wait for it, as ``placement.py`` chose.
            Default ``None``: ``bool(options.synchronous)``.
        budget: the bytes the copies and working set may hold (``monitor/engines/budget.py``,
            ``resolve_budget``); a snapshot that does not fit at once is copied in parts over
            consecutive steps (:meth:`advance`). ``None``: no bound. Default ``None``.
        skipped: snapshots skipped before a resume, so ``skipped`` keeps counting. Default ``0``.

    It implements :class:`spectral_callbacks.monitor.engines.protocol.Engine`; :meth:`submit` is the
    lower-level hand-over of a snapshot taken elsewhere.

    Raises:
        ConfigurationError: one matrix does not fit ``budget`` alone.
    """

    def __init__(
        self,
        compute: Compute,
        groups: Sequence[ShapeGroup],
        options: MonitorOptions,
        *,
        inline: bool | None = None,
        budget: int | None = None,
        skipped: int = 0,
    ) -> None:
        self.compute = compute
        self.plan = plan_snapshot(groups, compute, budget)
        self.groups = {part.key: part for part in self.plan.parts}
        self.ledger = Ledger(budget, self.plan.kept)
        self.max_delay_steps = max(options.every_n_steps, 2 * len(self.plan.parts))
        self._round: _Round | None = None
        self._skipped_matrices = 0
        self._tokens = 0  # ledger tokens handed out, one per copy
        self.max_pending = options.max_pending
        self.synchronous = bool(options.synchronous) if inline is None else inline
        self.worker_threads = options.worker_threads
        # On CUDA the worker only enqueues kernels: lowering its priority would only add latency.
        on_cuda = any(group.device.startswith("cuda") for group in self.groups.values())
        self.worker_nice = None if on_cuda else options.worker_nice
        # The skip count lives here only: changed by _skip and by finish() retaking a skipped step.
        self._skipped = skipped
        self._last_skipped: int | None = None
        self._last_accepted: int | None = None
        self.pinned_allocated = 0  # pinned result buffers ever allocated (bounded by max_pending)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._worker = background.Worker(
            self._work,
            WORKER_THREAD_NAME,
            threads=self.worker_threads,
            nice=self.worker_nice,
            stop=self._stop_at_exit,
            left_running="it is left running as a daemon thread and its snapshot is dropped",
        )
        self._closing = threading.Event()
        self._streams = ComputeStreams()
        # device -> pinned result buffers free for reuse; at most max_pending exist per device.
        self._pinned: dict[str, collections.deque[torch.Tensor]] = {}

    @property
    def pending(self) -> int:
        """Snapshots submitted and not yet collected."""
        return len(self._jobs)

    @property
    def skipped(self) -> int:
        """Scheduled snapshots not taken because ``max_pending`` were in flight."""
        return self._skipped

    @property
    def skipped_matrices(self) -> int:
        """Matrices of staggered snapshots not copied within the delay bound (``max_delay_steps``)."""
        return self._skipped_matrices

    @property
    def awaiting_results(self) -> bool:
        """Whether :meth:`collect` may still return a result here."""
        return self.pending > 0

    def offer(self, step: int) -> bool:
        """A scheduled point: snapshot the weights of ``step`` and hand them over, or skip.

        The bound is checked before the copy, so a skipped snapshot costs nothing. The snapshot
        is skipped too while an earlier one is still being copied in parts (staggered by the
        budget): that one's next parts are copied at this step, as at every step that follows
        (:meth:`advance`), so a scheduled step never stalls it.
        """
        if self._round is not None or self._rounds(uncollected=True) >= self.max_pending:
            self._skip(step)
            self.advance(step)
            return False
        self._last_accepted = step
        self._round = _Round(step, collections.deque(self.plan.parts))
        self._copy_what_fits(step)
        return True

    def advance(self, step: int) -> None:
        """After the update of ``step`` (every step): copy the parts of a staggered snapshot that
        fit the budget now; past the delay bound the parts left are skipped and counted."""
        if self._round is not None and step > self._round.due_step:
            self._copy_what_fits(step)

    def finish(self, step: int, *, offered: bool, deadline: float) -> None:
        """End of training at ``step``: measure it unless it already was, waiting for room.

        The final step is always measured: if it was skipped (or never offered) the engine waits
        until ``deadline`` for a snapshot in flight to finish computing, then takes it, and a skip
        of it counted earlier is taken back.
        """
        if self._round is not None:  # a staggered snapshot's last parts: copied at the last step
            self._copy_until(step, deadline)
        if offered and self._last_accepted == step:
            return
        while self._rounds() >= self.max_pending and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
        if self._rounds() >= self.max_pending:
            if self._last_skipped != step:
                self._skip(step)
            return
        retaken = self._last_skipped == step
        self._last_accepted = step
        self._round = _Round(step, collections.deque(self.plan.parts))
        self._copy_until(step, deadline)
        if retaken:
            self._skipped -= 1

    def abort(self) -> None:
        """After an exception: nothing to do for one process (no collective can hang)."""

    def submit(self, snapshot: Snapshot) -> bool:
        """Hand a snapshot over; ``False`` (and ``skipped`` counts it) if ``max_pending`` are in flight."""
        if self.pending >= self.max_pending:
            self._skip(snapshot.step)
            return False
        self._last_accepted = snapshot.step
        self._hand_over(snapshot)
        return True

    def _copy_what_fits(self, step: int, *, final: bool = False) -> bool:
        """Copy, at ``step``, the open round's next parts that fit the budget now (in order).

        Returns whether the round is closed (every part copied, or, unless ``final``, the delay
        bound reached: the parts left are counted as skipped matrices).
        """
        round_ = self._round
        assert round_ is not None
        self._release_complete()
        chosen: list[ShapeGroup] = []
        copies = working = 0
        while round_.parts:
            part = round_.parts[0]
            more_copies = copies + self.plan.copies[part.key]
            more_working = max(working, self.plan.working[part.key])
            if not self.ledger.fits(more_copies, more_working):
                break
            chosen.append(round_.parts.popleft())
            copies, working = more_copies, more_working
        if chosen:
            with torch.no_grad():
                snapshot = take_snapshot(chosen, step)
            self._tokens += 1
            for part in chosen:  # released one by one as the worker finishes each part
                self.ledger.reserve(
                    (self._tokens, part.key),
                    self.plan.copies[part.key],
                    self.plan.working[part.key],
                )
            self._hand_over(snapshot, round_.due_step, self._tokens)
        if not round_.parts:
            self._round = None
        elif not final and step - round_.due_step >= self.max_delay_steps:
            self._skipped_matrices += sum(len(part.targets) for part in round_.parts)
            self._round = None
        return self._round is None

    def _copy_until(self, step: int, deadline: float) -> None:
        """End of training: copy the open round's parts at ``step``, waiting for room until
        ``deadline``; the parts left then are counted as skipped matrices."""
        while not self._copy_what_fits(step, final=True):
            if time.monotonic() >= deadline:
                assert self._round is not None
                self._skipped_matrices += sum(len(part.targets) for part in self._round.parts)
                self._round = None
                return
            time.sleep(_POLL_SECONDS)

    def _skip(self, step: int) -> None:
        self._skipped += 1
        self._last_skipped = step

    def _rounds(self, uncollected: bool = False) -> int:
        """Snapshots (rounds of parts) in flight: one being copied, or holding copies (with
        ``uncollected``: or with results not yet collected)."""
        computing = {job.due_step for job in self._jobs if uncollected or not self._complete(job)}
        if self._round is not None:
            computing.add(self._round.due_step)
        return len(computing)

    def _release_complete(self) -> None:
        """Give the ledger back the parts of snapshots that are decomposed (on CUDA: once their
        ``done`` events are reached, so the compute stream has read the stacks)."""
        for job in self._jobs:
            if self._complete(job):
                self._release(job)

    def _release(self, job: _Job, keys: Sequence[str] | None = None) -> None:
        for key in self.groups if keys is None else keys:
            self.ledger.release((job.token, key))

    def _hand_over(self, snapshot: Snapshot, due_step: int | None = None, token: int = -1) -> None:
        due = snapshot.step if due_step is None else due_step
        job = _Job(snapshot, Future(), due, self.ledger.held, token)
        self._jobs.append(job)
        if self.synchronous:
            self._run(job)
            work = job.future.result() if job.future.exception() is None else None
            if isinstance(work, _DeviceWork):
                for done in work.done:
                    done.synchronize()  # the baseline blocks by design
            return
        if not self._worker.alive:
            self._closing.clear()
        self._worker.submit(job)

    def collect(self, wait_seconds: float = 0.0) -> list[SnapshotResult]:
        """The results that are complete, in step order; waits up to ``wait_seconds`` for all.

        Raises:
            SpectralComputeError: if the compute function failed on a snapshot, or the worker thread
                could not start (raised once; the snapshots before it are returned by the next call).
        """
        deadline = time.monotonic() + wait_seconds
        results: list[SnapshotResult] = []
        while self._jobs:
            job = self._jobs[0]
            if not self._complete(job) and not self._wait(job, deadline):
                break
            self._jobs.popleft()
            self._release(job)
            if job.future.cancelled():
                continue
            error = job.future.exception()
            if isinstance(error, _Abandoned):
                continue
            if error is not None:
                if results:  # hand the finished ones over first; the error comes next call
                    self._jobs.appendleft(job)
                    break
                raise error
            results.append(self._result(job))
        return results

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker: queued snapshots are dropped, a running one may finish within ``timeout``.

        A worker still inside a computation after ``timeout`` is left to finish it (a daemon
        thread; at exit it is waited for and what it abandons is reported, see ``background.py``).
        """
        self._closing.set()
        self._worker.close(timeout)
        for job in self._jobs:
            self._release(job)
        self._jobs.clear()
        self._round = None

    # --- worker side ------------------------------------------------------------------------

    def _stop_at_exit(self) -> str | None:
        """At interpreter exit: abandon the queued snapshots and the current one (next group)."""
        self._closing.set()
        self._worker.wake()
        in_flight = sum(not job.future.done() for job in list(self._jobs))
        return f"{in_flight} snapshot(s) still in flight" if in_flight else None

    def _work(self, job: _Job, failure: Exception | None) -> None:
        """One job on the worker thread (``failure``: the thread's setup failed)."""
        if self._closing.is_set():
            job.future.cancel()
            return
        if failure is not None:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(
                    SpectralComputeError(
                        f"SpectralMonitor's worker thread could not start "
                        f"({type(failure).__name__}: {failure}); check `worker_threads` "
                        f"({self.worker_threads!r}) and `worker_nice` ({self.worker_nice!r})"
                    )
                )
            return
        self._run(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(self._compute_snapshot(job))
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread by collect()
            # The traceback's frames hold the batch (GPU memory, on CUDA) until the error is
            # dropped: clear their locals, keep the lines.
            cause: BaseException | None = error
            while cause is not None:
                traceback.clear_frames(cause.__traceback__)
                cause = cause.__cause__ or cause.__context__
            job.future.set_exception(error)
        finally:
            job.snapshot.tensors = {}  # free the copies as soon as they are decomposed

    def _compute_snapshot(self, job: _Job) -> dict[str, Any] | _DeviceWork:
        snapshot = job.snapshot
        if not snapshot.copied:
            start = time.perf_counter()
            values = {}
            for key in list(snapshot.tensors):
                self._raise_if_closing()
                values[key] = self._compute_group(key, snapshot.tensors.pop(key), snapshot.step)
                self._release(job, [key])  # its copy and working set are freed
            layout, flat = _pack(values)
            return {
                "values": flat.tolist(),
                "layout": layout,
                "seconds": time.perf_counter() - start,
            }
        per_device: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        on_host: dict[str, dict[str, torch.Tensor]] = {}  # groups of a model partly on the CPU
        busy = []
        for key in list(snapshot.tensors):
            self._raise_if_closing()
            batch = snapshot.tensors.pop(key)  # the snapshot no longer holds it: freed after use
            device = self.groups[key].device
            if not device.startswith("cuda"):
                on_host[key] = self._compute_group(key, batch, snapshot.step)
                continue
            # On the compute stream, after the copy, the stack recorded there (streams.py).
            with self._streams.after_copy(batch, snapshot.copied) as stream:
                first = torch.cuda.Event(enable_timing=True)
                last = torch.cuda.Event(enable_timing=True)
                first.record(stream)
                per_device.setdefault(device, {})[key] = self._compute_group(
                    key, batch, snapshot.step
                )
                last.record(stream)
                busy.append((first, last))
            del batch
        host, layouts, done = {}, {}, []
        if on_host:
            layouts["cpu"], host["cpu"] = _pack(on_host)
        for device, values in per_device.items():
            stream = self._streams.get(device)
            with torch.cuda.device(torch.device(device)), torch.cuda.stream(stream):
                layout, flat = _pack(values)
                pinned = self._pinned_buffer(device, layout.size)
                # One copy into pinned memory: truly asynchronous, and the buffer is reused.
                pinned.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            host[device], layouts[device] = pinned, layout
            done.append(event)
        return _DeviceWork(host, layouts, busy, done)

    def _raise_if_closing(self) -> None:
        if self._closing.is_set():
            raise _Abandoned("the engine was closed while this snapshot was computed")

    def _pinned_buffer(self, device: str, size: int) -> torch.Tensor:
        free = self._pinned.setdefault(device, collections.deque())
        while free:
            buffer = free.popleft()
            if buffer.numel() == size:
                return buffer
        self.pinned_allocated += 1
        # On the host whatever torch.set_default_device says on the training thread.
        return torch.empty(size, dtype=torch.float64, device="cpu", pin_memory=True)

    def _compute_group(self, key: str, batch: Stack, step: int) -> dict[str, torch.Tensor]:
        group = self.groups[key]
        work = batch if batch.dtype in (torch.float32, torch.float64) else batch.float()
        try:
            # A caller's autocast region (synchronous=True inside a plain loop's autocast) must
            # not run the SVD's products in bf16; on CUDA after_copy has turned it off already.
            with torch.autocast(work.device.type, enabled=False):
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

    def _find_culprit(self, group: ShapeGroup, batch: Stack) -> str:
        """Name the matrix that fails alone, or the whole group if none does."""
        if len(group.targets) > 1:
            for index, name in enumerate(group.names):
                single = dataclasses.replace(group, targets=(group.targets[index],))
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
        return not isinstance(work, _DeviceWork) or all(done.query() for done in work.done)

    def _wait(self, job: _Job, deadline: float) -> bool:
        while time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            if self._complete(job):
                return True
        return False

    def _result(self, job: _Job) -> SnapshotResult:
        work = job.future.result()
        snapshot = job.snapshot
        host: dict[str, dict[str, list[float]]] = {}
        if isinstance(work, _DeviceWork):
            for device, pinned in work.host.items():
                host.update(_unpack(work.layout[device], pinned.tolist()))
                if device != "cpu":
                    self._pinned.setdefault(device, collections.deque()).append(pinned)  # reuse
            seconds = sum(start.elapsed_time(end) for start, end in work.busy) / 1000.0
            copy_seconds = (
                sum(
                    snapshot.copy_started[device].elapsed_time(event)
                    for device, event in snapshot.copied.items()
                )
                / 1000.0
            )
        else:
            host = _unpack(work["layout"], work["values"])
            seconds, copy_seconds = work["seconds"], 0.0
        metrics: dict[str, dict[str, float]] = {}
        for key, values in host.items():
            for index, name in enumerate(self.groups[key].names):
                metrics[name] = {metric: float(column[index]) for metric, column in values.items()}
        return SnapshotResult(
            snapshot.step,
            metrics,
            seconds,
            snapshot.main_thread_seconds,
            copy_seconds,
            due_step=job.due_step,
            held_bytes=job.held_bytes,
        )


def _pack(values: dict[str, dict[str, torch.Tensor]]) -> tuple[_Packed, torch.Tensor]:
    """Every group's ``(B,)`` metrics in one flat float64 tensor (one device-to-host copy).

    >>> layout, flat = _pack({"g": {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}})
    >>> flat.tolist(), _unpack(layout, flat.tolist())
    ([1.0, 2.0, 3.0, 4.0], {'g': {'a': [1.0, 2.0], 'b': [3.0, 4.0]}})
    """
    columns: list[tuple[str, tuple[str, ...], int, int]] = []
    parts: list[torch.Tensor] = []
    offset = 0
    for key, metrics in values.items():
        batch = len(next(iter(metrics.values()))) if metrics else 0
        columns.append((key, tuple(metrics), offset, batch))
        parts.extend(value.to(torch.float64) for value in metrics.values())  # each (B,)
        offset += batch * len(metrics)
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64, device="cpu")
    return _Packed(columns, offset), flat


def _unpack(layout: _Packed, flat: list[float]) -> dict[str, dict[str, list[float]]]:
    """Group key -> metric -> values, from a flat list laid out by :func:`_pack`."""
    return {
        key: {
            name: flat[offset + i * batch : offset + (i + 1) * batch]
            for i, name in enumerate(names)
        }
        for key, names, offset, batch in layout.columns
    }
