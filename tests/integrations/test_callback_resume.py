"""Resume: the compression reference and the schedule survive a checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import (
    RecordingLogger,
    TinyGPT,
    WeightRecorder,
    exact_compute,
    exact_stable_rank,
    quiet_trainer,
    token_loader,
)

from spectral_callbacks import SpectralTracker
from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.names import scalar_tag


def _monitor() -> SpectralMonitor:
    return SpectralMonitor(
        metrics=("stable_rank", "compression"),
        compute=exact_compute,
        every_n_steps=5,
        log_spaced_until=0,
        figures=False,
        max_pending=8,  # never a skip under load: the test checks every scheduled step
    )


def test_compression_continues_from_the_original_reference_after_resume(tmp_path: Path) -> None:
    first_logger, first_weights = RecordingLogger(), WeightRecorder()
    first = quiet_trainer(max_steps=12, logger=first_logger, callbacks=[_monitor(), first_weights])
    first.fit(TinyGPT(), token_loader())
    checkpoint = tmp_path / "step12.ckpt"
    first.save_checkpoint(checkpoint)

    second_logger, second_weights = RecordingLogger(), WeightRecorder()
    second = quiet_trainer(
        max_steps=24, logger=second_logger, callbacks=[_monitor(), second_weights]
    )
    second.fit(TinyGPT(), token_loader(), ckpt_path=str(checkpoint))

    name = "model.transformer.h.0.attn.c_attn.weight[Q]"
    reference = exact_stable_rank(first_weights.weights[0][name])
    compression = second_logger.series(scalar_tag("compression", 0, "Q"))
    assert sorted(compression) == [15, 20, 24]  # the schedule continues; no new step-0 reference
    for step, value in compression.items():
        expected = 100 * (1 - exact_stable_rank(second_weights.weights[step][name]) / reference)
        assert value == pytest.approx(expected, abs=1e-4), step
    assert compression[24] != pytest.approx(0.0, abs=1e-3)


def test_state_dict_round_trip_keeps_references_and_schedule() -> None:
    monitor = _monitor()
    trainer = quiet_trainer(max_steps=6, logger=RecordingLogger(), callbacks=[monitor])
    trainer.fit(TinyGPT(), token_loader())
    state = monitor.state_dict()
    assert len(state["references"]) == 12 and state["schedule"]["last_snapshot_step"] == 6
    restored = _monitor()
    restored.load_state_dict(state)
    assert restored.state_dict() == state


# --- the ESD cadence (every Nth snapshot) counts on across a resume -----------------------------


def esd_steps(logger: RecordingLogger) -> list[int]:
    """The steps at which the ESD family was logged."""
    return sorted({step for step, row in logger.records if any("esd_alpha/" in tag for tag in row)})


# Snapshots on a plain grid, the ESD on every 3rd of them.
ESD_OPTIONS: dict = dict(
    metrics=("stable_rank", "esd_alpha"),
    log_spaced_until=0,
    esd_every_n_snapshots=3,
    figures=False,
    max_pending=8,
)


def _esd_monitor() -> SpectralMonitor:
    return SpectralMonitor(**ESD_OPTIONS, every_n_steps=2)


def test_the_esd_cadence_continues_after_a_resume_from_a_checkpoint(tmp_path: Path) -> None:
    # Snapshots at steps 0, 2, 4, ...: the ESD family on snapshots 0, 3, 6, 9, 12 = steps 0, 6,
    # 12, 18, 24, whether or not the run stops at step 12 and resumes from its checkpoint.
    whole = RecordingLogger()
    quiet_trainer(max_steps=24, logger=whole, callbacks=[_esd_monitor()]).fit(
        TinyGPT(), token_loader()
    )
    assert esd_steps(whole) == [0, 6, 12, 18, 24]

    first = quiet_trainer(max_steps=12, logger=RecordingLogger(), callbacks=[_esd_monitor()])
    first.fit(TinyGPT(), token_loader())
    checkpoint = tmp_path / "step12.ckpt"
    first.save_checkpoint(checkpoint)
    resumed = RecordingLogger()
    second = quiet_trainer(max_steps=24, logger=resumed, callbacks=[_esd_monitor()])
    second.fit(TinyGPT(), token_loader(), ckpt_path=str(checkpoint))
    assert esd_steps(resumed) == [18, 24]  # restarted, the count gave 14 and 20


class HeldCompute(SpectrumCompute):
    """The default compute whose calls wait, once ``hold`` is set, until ``proceed`` is."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hold, self.proceed = threading.Event(), threading.Event()

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.hold.is_set():
            self.proceed.wait(timeout=60)
        return super().__call__(group, batch)


def test_a_checkpoint_taken_while_a_snapshot_is_in_flight_keeps_the_esd_cadence() -> None:
    # The snapshot of step 4 is still on the worker when the state is saved: the worker's own
    # count says 4 snapshots (or fewer), the run has taken 5. Snapshots every step, the ESD on
    # every 3rd: steps 0, 3, 6, 9.
    options = {**ESD_OPTIONS, "every_n_steps": 1, "synchronous": False}
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    compute = HeldCompute(k=4, esd=True, esd_every_n_snapshots=3)
    tracker = SpectralTracker(model, writers=[RecordingLogger()], compute=compute, **options)
    for step in range(1, 4):
        tracker.step(step)
    compute.hold.set()
    tracker.step(4)
    state = tracker.state_dict()
    compute.proceed.set()
    tracker.close()
    assert state["schedule"]["snapshots"] == 5

    resumed = RecordingLogger()
    tracker = SpectralTracker(model, writers=[resumed], start_step=4, state=state, **options)
    for step in range(5, 10):
        tracker.step(step)
    tracker.close()
    assert esd_steps(resumed) == [6, 9]
