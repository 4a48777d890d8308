"""Figures rendered in a child process, so matplotlib never holds the training process's GIL.

Drawing and rendering the callback's figures is mostly Python (matplotlib) and takes seconds; on a
thread of the training process it holds the GIL the training loop needs to launch its kernels.
Measured on the loaded 2-core development machine (a main thread launching tiny ops as fast as it
can while every figure of a 12-layer run is drawn): building the figures on a thread left it
0.28-0.38x of its rate, in a process 0.63-0.81x (three alternating rounds each); drawing and
rendering to PNG (``benchmarks/gpu_check.py``'s figure part, ``device="cpu"``): 0.51-0.73x on a
thread, 0.56-0.87x with this process. What remains with a process is CPU the drawing takes from
two busy cores, which a GPU machine's spare cores absorb; ``make gpu-check`` measures it there.

So the figure thread only pickles the rows to a child ``python -m
spectral_callbacks.monitor.figure_process`` (started at the first drawing) and waits on the pipe,
which releases the GIL; the child draws, renders each figure to PNG and sends the bytes back; the
thread writes them to TensorBoard as image summaries. A child that dies is restarted at the next
drawing; its error is re-raised on the main thread like any drawing error.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from spectral_callbacks.monitor.figures import render


def png_size(png: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header.

    >>> png_size(b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8) + (640).to_bytes(4, "big") + (480).to_bytes(4, "big"))
    (640, 480)
    """
    width, height = struct.unpack(">II", png[16:24])
    return width, height


class FigureProcess:
    """A child Python that renders figures to PNG bytes, one request at a time (started lazily)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None

    def render(self, rows: Any, roles: Sequence[str] | None) -> dict[str, bytes]:
        """PNG bytes by tag; blocks (GIL released) while the child draws.

        Raises:
            RuntimeError: the child could not draw (its error), or it died.
        """
        child = self._start()
        assert child.stdin is not None and child.stdout is not None
        try:
            pickle.dump((rows, tuple(roles) if roles is not None else None), child.stdin)
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

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (it exits on the end of its input); kill it after ``timeout``."""
        child, self._child = self._child, None
        if child is None:
            return
        try:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            child.kill()
            child.wait()

    def _start(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            # The child imports this package the way the parent does.
            path = os.pathsep.join(entry for entry in sys.path if entry)
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": path, "MPLBACKEND": "Agg"},
            )
        return self._child


def main() -> None:
    """The child: answer ``(rows, roles)`` requests on stdin with ``("ok", pngs)`` or an error."""
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # anything the drawing code prints must not corrupt the pipe
    while True:
        try:
            rows, roles = pickle.load(requests)
        except EOFError:
            return
        try:
            answer: tuple[str, Any] = ("ok", render(rows, roles))
        except Exception as error:  # noqa: BLE001 - sent back, re-raised in the parent
            answer = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    main()
