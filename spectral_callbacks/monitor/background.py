"""Background threads that can never crash the process at exit.

The monitor's threads (the SVD worker, the figure writer) are daemon threads, so they never keep
the interpreter alive. But a daemon thread still inside a torch (or LAPACK) call when the
interpreter finalizes is killed as soon as that call returns and tries to take the GIL back, and the
forced unwind through torch's C++ frames aborts the whole process (``terminate called without an
active exception``, exit status 134) after the user's program has finished successfully.

So every such thread is started through :func:`start_daemon` (the engines' through one
:class:`Worker`), and an ``atexit`` hook - which runs
before finalization, while daemon threads still run - asks each live one to stop (its ``stop``
function: the engine abandons its queued and current snapshots at the next shape-group boundary)
and waits for it to leave the call it is in. The wait is announced on stderr when it lasts, and
what was abandoned is counted and reported there; the process then exits with the status of the
user's program.

Example::

    >>> import threading
    >>> release = threading.Event()
    >>> thread = start_daemon(release.wait, "example", stop=lambda: release.set() or "nothing")
    >>> thread.daemon, thread.name
    (True, 'example')
    >>> release.set(); thread.join(); thread.is_alive()
    False
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Generic, TypeVar

import torch

from spectral_callbacks.messages import rank_zero_warn

#: Seconds of waiting at exit after which the wait is announced on stderr.
ANNOUNCE_AFTER_SECONDS = 1.0

#: What the exit's wait says it waits for, unless a thread says otherwise.
WAITING_FOR = (
    "to return from the torch call it is in (one shape group's SVD at most); a thread killed "
    "inside torch would abort the process"
)

# thread -> (stop function, returning a short description of what it abandoned or None; what the
# wait for it is for; who started it).
_LIVE: dict[threading.Thread, tuple[Callable[[], str | None], str, str]] = {}
_LOCK = threading.Lock()

# Who the threads started now belong to: the frontend's class the user wrote (SpectralTracker,
# SpectralMonitor, SpectralTrainerCallback), so the exit's messages name what the user knows.
_OWNER: ContextVar[str] = ContextVar("owner", default="spectral_callbacks")


@contextlib.contextmanager
def owned_by(owner: str) -> Iterator[None]:
    """Threads started by :func:`start_daemon` inside this block are ``owner``'s in the exit's
    messages ("SpectralTrainerCallback at exit: ...")."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


def start_daemon(
    target: Callable[[], object],
    name: str,
    stop: Callable[[], str | None] | None = None,
    waiting_for: str = WAITING_FOR,
) -> threading.Thread:
    """Start ``target`` on a daemon thread that exit waits for (after calling ``stop``).

    Args:
        target: the thread's function.
        name: the thread's name (shown in the at-exit message).
        stop: called at exit, before the wait, to make ``target`` return soon; returns what it
            abandoned (e.g. ``"2 snapshot(s) in flight"``) for the report, or ``None``.
        waiting_for: what the announced wait at exit is for. Default :data:`WAITING_FOR`.

    Returns:
        The started thread.
    """

    def run() -> None:
        try:
            target()
        finally:
            with _LOCK:
                _LIVE.pop(thread, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _LOCK:
        _LIVE[thread] = (stop or (lambda: None), waiting_for, _OWNER.get())
    thread.start()
    return thread


def waited_for() -> list[threading.Thread]:
    """The live threads started by :func:`start_daemon`: those exit stops and waits for."""
    with _LOCK:
        return [thread for thread in _LIVE if thread.is_alive()]


def stop_all(announce_after: float | None = None) -> list[str]:
    """Stop every live thread started by :func:`start_daemon` and wait for each; returns the reports.

    Runs at interpreter exit (``atexit``); callable directly, e.g. by tests. ``announce_after``
    defaults to :data:`ANNOUNCE_AFTER_SECONDS` as it is when called.
    """
    if announce_after is None:
        announce_after = ANNOUNCE_AFTER_SECONDS
    with _LOCK:
        live = [(thread, *entry) for thread, entry in _LIVE.items() if thread.is_alive()]
    reports = []
    for thread, stop, _, owner in live:
        report = stop()
        if report:
            reports.append(f"{thread.name}: {report}")
            print(f"{owner} at exit: abandoned {reports[-1]}", file=sys.stderr, flush=True)
    for thread, _, waiting_for, owner in live:
        thread.join(announce_after)  # said only when the thread still works after this
        if thread.is_alive():
            print(
                f"{owner} at exit: waiting for the {thread.name} thread {waiting_for}",
                file=sys.stderr,
                flush=True,
            )
            thread.join()
    return reports


atexit.register(stop_all)

Job = TypeVar("Job")


class Worker(Generic[Job]):
    """One daemon thread that runs an engine's jobs in order, started on the first :meth:`submit`.

    Every engine's background thread is one of these (``SnapshotEngine``, ``ShardedEngine``): it is
    started through :func:`start_daemon` (so exit waits for it, after ``stop``), it limits its own
    intra-op threads without changing any other thread's (:func:`limit_this_thread`) and may lower
    its own priority, and :meth:`close` warns when it outlives its timeout.

    Args:
        run: called on the worker thread with each job, and the error the thread's setup raised
            (``None`` when it started well: the engine fails the job with it otherwise).
        name: the thread's name.
        threads: intra-op threads of this thread; ``None`` keeps torch's default.
        nice: raise this thread's nice value by this much (Linux; ``None`` or ``0``: leave it).
        stop: called at interpreter exit before the wait (see :func:`start_daemon`).
        waiting_for: what the announced wait at exit is for.
        left_running: what :meth:`close`'s warning says about a worker still running.

    Example::

        >>> done = []
        >>> worker = Worker(lambda job, failure: done.append(job * 2), "example", threads=1)
        >>> worker.submit(21)
        >>> worker.close(timeout=5.0)
        >>> done, worker.alive
        ([42], False)
    """

    def __init__(
        self,
        run: Callable[[Job, Exception | None], None],
        name: str,
        *,
        threads: int | None = None,
        nice: int | None = None,
        stop: Callable[[], str | None] | None = None,
        waiting_for: str = WAITING_FOR,
        left_running: str = "it is left running as a daemon thread",
    ) -> None:
        self.run = run
        self.name = name
        self.threads = threads
        self.nice = nice
        self._stop = stop
        self._waiting_for = waiting_for
        self._left_running = left_running
        self._queue: queue.SimpleQueue[tuple[Job] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        """Whether the thread has been started and not yet returned."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the thread, starting it first if it is not running."""
        if self._thread is None:
            self._thread = start_daemon(
                self._loop, self.name, stop=self._stop, waiting_for=self._waiting_for
            )
        self._queue.put((job,))

    def wake(self) -> None:
        """Make the thread return after the job it is running (what ``stop`` functions call)."""
        self._queue.put(None)

    def close(self, timeout: float) -> None:
        """Stop the thread after its current job: wait up to ``timeout`` seconds, then warn (unless
        ``timeout`` is 0, the caller having chosen not to wait) and leave it to finish as a daemon."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout)
        if thread.is_alive() and timeout > 0:
            rank_zero_warn(
                f"the {self.name} thread did not stop within {timeout} s; {self._left_running}",
                category=RuntimeWarning,
            )
        # A job queued after the stop marker (never run) is dropped with the queue.
        self._queue = queue.SimpleQueue()

    def _loop(self) -> None:
        failure: Exception | None = None
        try:
            self._configure()
        except Exception as error:  # noqa: BLE001 - every job fails with it, on the main thread
            failure = error
        queued = self._queue
        while True:
            item = queued.get()
            if item is None:
                return
            self.run(item[0], failure)

    def _configure(self) -> None:
        if self.threads is not None:
            limit_this_thread(self.threads)
        if self.nice and hasattr(os, "setpriority"):
            try:  # on Linux a thread is a task: this lowers the priority of this thread only
                thread = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + self.nice
                )
            except OSError:  # not permitted here: run at normal priority
                pass


def limit_this_thread(threads: int) -> None:
    """``torch.set_num_threads(threads)`` for the calling thread only.

    ``torch.set_num_threads`` sets the calling thread's OpenMP/MKL count *and* the process-wide
    default that every thread which has not yet run a parallel op picks up (measured: a fresh thread
    then reports 1 thread). So the count is fixed for this thread first (``get_num_threads``
    initializes it), then the default is put back from a short-lived helper thread, which leaves
    this thread's count alone.
    """
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.get_num_threads()  # this thread's count is now initialized and kept
    helper = threading.Thread(target=torch.set_num_threads, args=(default,), daemon=True)
    helper.start()
    helper.join()
