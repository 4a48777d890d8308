"""Figures rendered in a child process at the lowest priority, so they cost training nothing.

Drawing and rendering the callback's figures is mostly Python (matplotlib) and takes seconds; on a
thread of the training process it holds the GIL the training loop needs to launch its kernels.
Measured on the loaded 2-core development machine (a main thread launching tiny ops as fast as it
can while every figure of a 12-layer run is drawn): building the figures on a thread left it
0.28-0.38x of its rate, in a process 0.63-0.81x (three alternating rounds each); drawing and
rendering to PNG (``benchmarks/gpu_check.py``'s figure part, ``device="cpu"``): 0.51-0.73x on a
thread, 0.56-0.87x with this process.

So the figure thread only pickles the rows to a child ``python -m
spectral_callbacks.monitor.figure_process`` (started at the first drawing, not before) and waits
on the pipe, which releases the GIL; the child draws and renders each figure to PNG. What remained
with a process was the CPU the drawing takes from busy cores, so the child runs at the lowest
scheduling priority (``SCHED_IDLE`` on Linux, else nice 19): it runs on a core only when nothing
of training's wants it, and a drawing still waiting for one when the next is due makes that one
skip (never queue). Two requests:

* ``render``: the PNGs come back and the parent's thread writes them through the run's own
  ``SummaryWriter`` (the figures during training);
* ``write``: the child writes the PNGs itself, into an event file of its own in each run
  directory, and answers with the tags (the final figures: ``fit()`` returns without waiting for
  them, and the parent's writers may already be closed).

A child that dies is restarted at the next drawing; its error is re-raised in the parent like any
drawing error.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from spectral_callbacks.monitor.figures import image_summary, render
from spectral_callbacks.tensorboard_adapter import write_event_file

#: The suffix of the event files the child writes (TensorBoard reads them with the run's others).
EVENT_FILE_SUFFIX = ".spectral_figures"


class FigureProcess:
    """A child Python that renders figures, one request at a time (started lazily)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None

    def render(self, rows: Any, roles: Sequence[str] | None) -> dict[str, bytes]:
        """PNG bytes by tag; blocks (GIL released) while the child draws.

        Raises:
            RuntimeError: the child could not draw (its error), or it died.
        """
        return self._ask(("render", rows, _roles(roles)))

    def write(
        self, rows: Any, roles: Sequence[str] | None, logdirs: Sequence[str], step: int
    ) -> list[str]:
        """Have the child draw and write the figures at ``step`` into each of ``logdirs``; the tags.

        Raises:
            RuntimeError: the child could not draw or write (its error), or it died.
        """
        return self._ask(("write", rows, _roles(roles), list(logdirs), step))

    def kill(self) -> None:
        """Stop the child now (a request waiting on it then fails)."""
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (it exits on the end of its input); kill it after ``timeout``. Both
        pipes are closed here: left to the garbage collector, the one the answers came on was an
        "unclosed file" ResourceWarning at the exit of every run that drew final figures."""
        child, self._child = self._child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                child.stdin.close()  # closed even where the flush fails on a dead child
            child.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()
        finally:
            if child.stdout is not None:
                child.stdout.close()

    def _ask(self, request: tuple[Any, ...]) -> Any:
        child = self._start()
        assert child.stdin is not None and child.stdout is not None
        try:
            pickle.dump(request, child.stdin)
            child.stdin.flush()
            status, payload = pickle.load(child.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as error:
            self.close(timeout=0)
            raise RuntimeError(
                f"the figure process stopped: {type(error).__name__}: {error}"
            ) from error
        if status != "ok":
            raise RuntimeError(payload)
        return payload

    def _start(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is not None:
            self.close(timeout=0)  # a child that died: its pipes closed before another starts
        if self._child is None:
            # The child imports this package the way the parent does.
            path = os.pathsep.join(entry for entry in sys.path if entry)
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"},
            )
        return self._child


def _roles(roles: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(roles) if roles is not None else None


def lowest_priority() -> str:
    """Put the calling process at the lowest scheduling priority it may take; which one it got."""
    try:  # Linux: run only on a core that would otherwise idle
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # type: ignore[attr-defined]
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
        return "nice 19"
    except (AttributeError, OSError):
        return "normal"


def answer(request: tuple[Any, ...]) -> Any:
    """The child's work for one request (see the module docstring)."""
    kind, rows, roles, *where = request
    pngs = render(rows, roles)
    if kind == "render":
        return pngs
    logdirs, step = where
    summaries = [image_summary(tag, png) for tag, png in pngs.items()]
    for logdir in logdirs:
        write_event_file(logdir, summaries, step, EVENT_FILE_SUFFIX)
    return sorted(pngs)


def main() -> None:
    """The child: answer requests on stdin with ``("ok", result)`` or ``("error", message)``."""
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything the drawing code prints must not corrupt the pipe
    lowest_priority()
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            result: tuple[str, Any] = ("ok", answer(request))
        except Exception as error:  # noqa: BLE001 - sent back, re-raised in the parent
            result = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(result, answers)
        answers.flush()


if __name__ == "__main__":
    main()
