"""The end-of-fit wait is announced (what it waits for, how long at most), and a Ctrl-C during it
drops what is in flight, in one line, without a second wait."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from tiny_models import RecordingLogger, TinyGPT, exact_compute, quiet_trainer, token_loader

from spectral_callbacks.integrations.lightning import SpectralMonitor


def test_the_end_of_fit_says_what_it_waits_for_and_how_long_at_most(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def held(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        release.wait(timeout=2.0)  # still computing when training ends
        return exact_compute(group, batch)

    monitor = SpectralMonitor(
        compute=held, metrics=("stable_rank",), every_n_steps=2, figures=False, drain_timeout=30
    )
    trainer = quiet_trainer(max_steps=2, logger=RecordingLogger(), callbacks=[monitor])
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyGPT(), token_loader())
    release.set()
    messages = [
        r.getMessage() for r in caplog.records if "SpectralMonitor: waiting" in r.getMessage()
    ]
    assert len(messages) == 1, messages
    assert messages[0].startswith("SpectralMonitor: waiting up to 30 s (drain_timeout) for ")
    assert "snapshot(s) in flight" in messages[0] and "Ctrl-C" in messages[0]


class _CtrlCInTheDrain(Callback):
    """Wraps the monitor's engine: a Ctrl-C arrives the first time the end of fit waits."""

    def __init__(self, monitor: SpectralMonitor) -> None:
        self.monitor = monitor
        self.waits_after_interrupt: list[float] = []
        self.interrupted = False

    def on_train_start(self, *args: Any) -> None:
        assert self.monitor.tracker is not None
        engine = self.monitor.tracker._engine
        assert engine is not None
        collect = engine.collect

        def interrupting_collect(wait_seconds: float = 0.0) -> Any:
            if self.interrupted:
                self.waits_after_interrupt.append(wait_seconds)
            elif wait_seconds > 1.0:
                self.interrupted = True
                raise KeyboardInterrupt
            return collect(wait_seconds)

        engine.collect = interrupting_collect  # type: ignore[method-assign]


def test_a_ctrl_c_during_the_end_of_fit_wait_drops_the_snapshots_and_ends_the_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()

    def held(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        release.wait(timeout=5.0)
        return exact_compute(group, batch)

    monitor = SpectralMonitor(
        compute=held, metrics=("stable_rank",), every_n_steps=2, figures=False, drain_timeout=60
    )
    ctrl_c = _CtrlCInTheDrain(monitor)
    trainer = quiet_trainer(max_steps=2, logger=RecordingLogger(), callbacks=[monitor, ctrl_c])
    previous = signal.getsignal(signal.SIGINT)
    try:
        # "Ctrl-C drops them", then the Ctrl-C goes on: Lightning ends the fit with status 1
        # (before: the fit returned normally and a sweep went on to its next run)
        with (
            caplog.at_level(logging.INFO, logger="spectral_callbacks"),
            pytest.raises(SystemExit) as exited,
        ):
            trainer.fit(TinyGPT(), token_loader())
    finally:
        signal.signal(signal.SIGINT, previous)
        release.set()
    assert exited.value.code == 1 and trainer.interrupted
    assert ctrl_c.interrupted and ctrl_c.waits_after_interrupt == []  # no second wait
    notes = [r.getMessage() for r in caplog.records if "Ctrl-C: stopped waiting" in r.getMessage()]
    assert len(notes) == 1 and "snapshot(s) dropped" in notes[0], notes
    assert monitor.tracker is not None and monitor.tracker._closed
