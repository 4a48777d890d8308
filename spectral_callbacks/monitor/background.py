"""Background threads that can never crash the process at exit.

The monitor's threads (the SVD worker, the figure writer) are daemon threads, so they never keep
the interpreter alive. But a daemon thread still inside a torch (or LAPACK) call when the
interpreter finalizes is killed as soon as that call returns and tries to take the GIL back, and the
forced unwind through torch's C++ frames aborts the whole process (``terminate called without an
active exception``, exit status 134) after the user's program has finished successfully.

So every such thread is started through :func:`start_daemon`, and an ``atexit`` hook - which runs
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
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar

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
