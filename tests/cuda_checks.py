"""Helpers for the GPU tests: a calibrated GPU sleep, a per-thread sync detector, a recorder.

Nothing here fakes CUDA: every helper needs a real device and is only used by ``@pytest.mark.gpu``
tests.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch import Callback

from spectral_callbacks.functional import metrics_from_spectrum
from spectral_callbacks.integrations.lightning import SpectralMonitor

_CYCLES_PER_MS: float | None = None


def sleep_ms(milliseconds: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for about ``milliseconds``.

    ``torch.cuda._sleep`` spins for a number of clock cycles; the rate is measured once.
    """
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(milliseconds * _CYCLES_PER_MS))


class SyncDetector:
    """Records every synchronizing CUDA call made on the main thread inside :meth:`checking`.

    ``torch.cuda.set_sync_debug_mode`` is process-wide, and in ``"error"`` mode it would also fail
    the worker thread, whose syncs (inside the SVD math) are allowed. So the mode is ``"warn"``
    and each warning is attributed to the thread that raised it (torch issues it on the calling
    thread); only the main thread's, inside a checked region, count.
    """

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self) -> None:
        self.found: list[str] = []
        self._region: str | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[SyncDetector]:
        previous_mode = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            original = warnings.showwarning

            def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
                main = threading.current_thread() is threading.main_thread()
                if self.MESSAGE in str(message) and main and self._region is not None:
                    self.found.append(f"{self._region}: {filename}:{lineno}")
                elif self.MESSAGE not in str(message):
                    original(message, category, filename, lineno, *args)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(previous_mode)

    @contextlib.contextmanager
    def checking(self, region: str) -> Iterator[None]:
        self._region = region
        try:
            yield
        finally:
            self._region = None


class CheckedMonitor(SpectralMonitor):
    """SpectralMonitor whose every hook runs inside ``detector.checking(hook name)``."""

    def __init__(self, detector: SyncDetector, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.detector = detector

    def setup(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("setup"):
            super().setup(*args, **kwargs)

    def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("on_fit_start"):
            super().on_fit_start(*args, **kwargs)

    def on_train_start(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("on_train_start"):
            super().on_train_start(*args, **kwargs)

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("on_train_batch_end"):
            super().on_train_batch_end(*args, **kwargs)

    def on_train_end(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("on_train_end"):
            super().on_train_end(*args, **kwargs)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        with self.detector.checking("teardown"):
            super().teardown(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        with self.detector.checking("state_dict"):
            return super().state_dict()


def exact_metrics(weight: torch.Tensor, k: int = 32) -> dict[str, float]:
    """Stable rank and α of a float64 full SVD of ``weight``, over the callback's default window."""
    W = weight.double()
    S = torch.linalg.svdvals(W)[:k]
    out = metrics_from_spectrum(S, W.square().sum())
    return {"stable_rank": float(out["stable_rank"]), "alpha": float(out["alpha"])}


class TrainingEvents(Callback):
    """A timing event on the training stream after every batch (placed after the monitor)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, torch.cuda.Event]] = []

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((trainer.global_step, event))


class TimedCompute:
    """Wraps a compute function: timing events around each call on the compute stream, and an
    optional GPU sleep (a slow SVD) before it."""

    def __init__(self, compute: Any, sleep: float = 0.0) -> None:
        self.compute, self.sleep = compute, sleep
        self.intervals: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.after_sleep: list[torch.cuda.Event] = []  # timing events, one per call with a sleep
        self.streams: list[int] = []  # the stream each call ran on (its cuda_stream handle)

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        self.streams.append(torch.cuda.current_stream().cuda_stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if self.sleep:
            sleep_ms(self.sleep)
            slept = torch.cuda.Event(enable_timing=True)
            slept.record()
            self.after_sleep.append(slept)
        out = self.compute(group, batch)
        end.record()
        self.intervals.append((start, end))
        return out
