"""A Ctrl-C that lands while the monitor writes is raised once the write is whole."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
from tiny_models import RecordingLogger, TinyGPT, exact_compute

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.interrupts import ctrl_c_after


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler, as a script has it (an earlier test may have left another)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def press_ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs a handler at the next instruction: it has had its chance


def test_a_ctrl_c_inside_the_block_is_raised_after_it(ctrl_c_raises: None) -> None:
    finished = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_after():
        press_ctrl_c()
        finished.append("the rest of the write")
    assert finished == ["the rest of the write"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # and a later one is raised where it lands again
        press_ctrl_c()


def test_without_a_ctrl_c_the_block_changes_nothing(ctrl_c_raises: None) -> None:
    with ctrl_c_after():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_ctrl_c_stays_ignored_and_another_thread_is_left_alone() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_after():
            press_ctrl_c()  # ignored, as it was before the block
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            with ctrl_c_after():  # signal.signal would raise ValueError off the main thread
                pass
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert errors == []


class _CtrlCInsideTheWrite(RecordingLogger):
    """A writer a Ctrl-C reaches half-way through the scalars of step 1's snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.pressed = False

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step == 1 and not self.pressed:
            self.pressed = True
            press_ctrl_c()
        super().log_metrics(metrics, step)


def test_the_tracker_finishes_the_write_a_ctrl_c_lands_in_then_raises_it(
    ctrl_c_raises: None,
) -> None:
    writer = _CtrlCInsideTheWrite()
    tracker = SpectralTracker(
        TinyGPT(),
        writers=[writer],
        compute=exact_compute,
        figures=False,
        every_n_steps=1,
        synchronous=True,
    )
    with pytest.raises(KeyboardInterrupt):
        for step in range(1, 4):  # step 1's results are logged at a later step: the Ctrl-C
            tracker.step(step)  # comes inside that write
    assert writer.pressed
    assert 1 in {step for step, _ in writer.records}  # the write it landed in was finished
    tracker.close(error=KeyboardInterrupt())
