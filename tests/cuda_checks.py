"""Helpers for the GPU tests: a calibrated GPU sleep, a trap for every wait of the training
thread, recorders of events and streams.

Nothing here fakes CUDA: the helpers that need a device are used by ``@pytest.mark.gpu`` tests
only. The trap (:class:`SyncDetector`) is also tested on the CPU (tests/cuda/test_cuda_checks.py),
against the meta device, to show it reports what it is meant to report.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils._python_dispatch import TorchDispatchMode  # torch's docs import it from here

from spectral_callbacks.functional import metrics_from_spectrum
from spectral_callbacks.integrations.lightning import SpectralMonitor

_CYCLES_PER_MS: float | None = None


def sleep_ms(milliseconds: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for about ``milliseconds``.

    ``torch.cuda._sleep`` spins for a number of clock cycles; the rate is measured once. torch has
    no public kernel that holds a stream for a set time, and this is the one torch's own stream
    tests use; a GPU-only helper (tests marked ``gpu``).
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
    """Records every way the main (training) thread waits for the device, inside :meth:`checking`.

    torch's sync-debug mode sees only some of them, so there are three traps, each recording on
    the main thread only (the worker's waits, inside the SVD math, are allowed):

    * ``torch.cuda.set_sync_debug_mode("warn")`` (where CUDA is present): the waits torch itself
      reports (``.item()``, a blocking copy, ``nonzero``). The mode is process-wide and ``"error"``
      would also fail the worker thread, so each warning is attributed to the thread that raised
      it (torch issues it on the calling thread);
    * ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize`` and
      ``torch.cuda.Stream.synchronize`` wrapped: a call is recorded before it runs (the mode does
      not report an event's wait);
    * a dispatch mode (:class:`HostDeviceCopies`), pushed on the main thread for each checked
      region: every copy between the host and ``device_type`` whose host side is not pinned, or
      that is not ``non_blocking`` (a pageable copy blocks the host and no sync is reported), and
      every read of a device scalar.

    ``device_type`` is ``"cuda"`` for the GPU tests; the CPU tests of the trap itself use
    ``"meta"``, the one other device a CPU build has.
    """

    MESSAGE = "called a synchronizing CUDA operation"
    #: The waits sync-debug mode does not see, wrapped while :meth:`active`.
    WAITS = (
        (torch.cuda, "synchronize"),
        (torch.cuda.Event, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
    )

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.found: list[str] = []
        self.regions: list[str] = []  # every checked region entered, in order
        self._region: str | None = None

    def note(self, what: str) -> None:
        """Record ``what`` if it happens on the main thread inside a checked region."""
        if threading.current_thread() is threading.main_thread() and self._region is not None:
            self.found.append(f"{self._region}: {what}")

    @contextlib.contextmanager
    def active(self) -> Iterator[SyncDetector]:
        saved = [(owner, name, getattr(owner, name)) for owner, name in self.WAITS]
        cuda = torch.cuda.is_available()
        previous_mode = torch.cuda.get_sync_debug_mode() if cuda else None
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            original_show = warnings.showwarning

            def show(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
                if self.MESSAGE in str(message):
                    self.note(f"{filename}:{lineno}")
                else:
                    original_show(message, category, filename, lineno, *args)

            warnings.showwarning = show
            try:
                for owner, name, original in saved:
                    # Labels: torch.cuda.synchronize, Event.synchronize, Stream.synchronize.
                    setattr(owner, name, self._noting(original, f"{owner.__name__}.{name}"))
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous_mode)
                for owner, name, original in saved:
                    setattr(owner, name, original)

    @contextlib.contextmanager
    def checking(self, region: str) -> Iterator[None]:
        if self._region is not None:  # a hook called from a checked hook: already checked
            yield
            return
        self._region = region
        self.regions.append(region)
        try:
            with HostDeviceCopies(self.device_type, self.note):
                yield
        finally:
            self._region = None

    def _noting(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.note(label)
            return original(*args, **kwargs)

        return wrapper


# ATen operator names (as a dispatch mode sees them), not private attributes: these two begin with _.
_TO_COPY = torch.ops.aten._to_copy.default
_COPY = torch.ops.aten.copy_.default
_SCALAR = torch.ops.aten._local_scalar_dense.default


class HostDeviceCopies(TorchDispatchMode):
    """Calls ``note(what)`` for each op of this thread that makes the host wait for the device:
    a copy between the host and ``device_type`` unless it is ``non_blocking`` with a pinned host
    side, and a read of a ``device_type`` scalar (``.item()``).

    A dispatch mode sees the ops torch runs for ``.cpu()``, ``.to()``, ``.tolist()``, ``copy_``
    alike (``_to_copy`` and ``copy_``); it lives on the thread that enters it.
    """

    def __init__(self, device_type: str, note: Callable[[str], None]) -> None:
        super().__init__()
        self.device_type, self.note = device_type, note

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _TO_COPY:
            self._check_copy(func, args[0], out, bool(kwargs.get("non_blocking", False)))
        elif func is _COPY:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._check_copy(func, args[1], args[0], bool(non_blocking))
        elif func is _SCALAR and args[0].device.type == self.device_type:
            self.note(f"{func}: a scalar read from {args[0].device}")
        return out

    def _check_copy(self, func: Any, source: Any, destination: Any, non_blocking: bool) -> None:
        sides = {source.device.type: source, destination.device.type: destination}
        if set(sides) != {"cpu", self.device_type}:
            return
        host = sides["cpu"]
        pinned = bool(host.is_pinned())
        if not (pinned and non_blocking):
            kind = "pinned but blocking" if pinned else "pageable"
            self.note(f"{func}: {kind} copy {source.device} -> {destination.device}")


#: The hooks where the first training forward is recorded and read (roles_from_first_forward):
#: at step 0 they may wait for the device (the reading replays index tensors); never later.
FIRST_FORWARD_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step")


def monitor_hooks() -> list[str]:
    """Every hook SpectralMonitor implements (a Callback method it overrides)."""
    return sorted(
        name
        for name, value in vars(SpectralMonitor).items()
        if callable(value) and callable(getattr(Callback, name, None)) and not name.startswith("_")
    )


def after_the_reading(found: list[str]) -> list[str]:
    """The waits of ``found`` other than the first forward's reading at step 0."""
    reading = tuple(f"{hook} at step 0: " for hook in FIRST_FORWARD_HOOKS)
    return [what for what in found if not what.startswith(reading)]


class CheckedMonitor(SpectralMonitor):
    """SpectralMonitor whose every hook (:func:`monitor_hooks`) runs inside
    ``detector.checking("<hook> at step <global_step>")`` (or ``"<hook>"`` where the hook is not
    given the Trainer), so a wait is reported with the hook and step that made it."""

    def __init__(self, detector: SyncDetector, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.detector = detector


def _checked(name: str) -> Callable[..., Any]:
    original = getattr(SpectralMonitor, name)

    @functools.wraps(original)
    def hook(self: CheckedMonitor, *args: Any, **kwargs: Any) -> Any:
        trainer = args[0] if args else None
        step = getattr(trainer, "global_step", None)
        with self.detector.checking(name if step is None else f"{name} at step {step}"):
            return original(self, *args, **kwargs)

    return hook


for _name in monitor_hooks():
    setattr(CheckedMonitor, _name, _checked(_name))


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
