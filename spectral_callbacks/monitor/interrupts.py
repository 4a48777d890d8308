"""Ctrl-C held off while the monitor writes: raised when the write is done, not inside it.

Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives. The monitor's
writes (a result into the TensorBoard writer's queue and the ``report_to`` trackers, a flush) run
between the end-of-training wait's polls, and a Ctrl-C landing inside one can leave a queue with an
item its count missed or a lock taken: the writer's flush at exit then waits forever. So each write
runs in :func:`ctrl_c_after`, which notes a SIGINT and hands it to the handler that was there (the
``KeyboardInterrupt``) once the write is whole; the waits around the writes stay interruptible.

Example::

    >>> with ctrl_c_after():
    ...     written = ["a result"]
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def ctrl_c_after() -> Iterator[None]:
    """Hold a SIGINT that arrives inside the block and deliver it to the previous handler after.

    Only on the main thread (the one Python runs signal handlers on) and only where a Python
    handler is installed: a SIGINT that is ignored, or left to the operating system, stays so.
    """
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[tuple[int, FrameType | None]] = []

    def note(signum: int, frame: FrameType | None) -> None:
        held.append((signum, frame))

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(*held[0])  # the default handler raises KeyboardInterrupt here
