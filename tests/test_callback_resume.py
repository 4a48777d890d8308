"""Resume: the compression reference and the schedule survive a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import (
    RecordingLogger,
    TinyGPT,
    WeightRecorder,
    exact_compute,
    exact_stable_rank,
    quiet_trainer,
    token_loader,
)

from spectral_callbacks.integrations.lightning import SpectralMonitor
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
