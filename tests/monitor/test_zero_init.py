"""A matrix that starts at exactly zero takes its first defined snapshot as compression reference."""

from __future__ import annotations

import math

import pytest
from tiny_models import (
    RecordingLogger,
    TinyGPT,
    WeightRecorder,
    exact_stable_rank,
    quiet_trainer,
    token_loader,
)

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.names import reference_step_tag, scalar_tag

STEPS = 8


def _fit_zero_init() -> tuple[SpectralMonitor, RecordingLogger, WeightRecorder]:
    # Room for every snapshot (no skip under load): the test checks every scheduled step.
    monitor = SpectralMonitor(every_n_steps=2, log_spaced_until=0, figures=False, max_pending=STEPS)
    logger, weights = RecordingLogger(), WeightRecorder()
    trainer = quiet_trainer(max_steps=STEPS, logger=logger, callbacks=[monitor, weights])
    trainer.fit(TinyGPT(init="zero_out"), token_loader())
    return monitor, logger, weights


@pytest.fixture(scope="module")
def zero_init_run() -> tuple[SpectralMonitor, RecordingLogger, WeightRecorder]:
    return _fit_zero_init()


@pytest.mark.parametrize(
    ("role", "name"),
    [
        ("O", "model.transformer.h.1.attn.c_proj.weight"),
        ("MLP_down", "model.transformer.h.1.mlp.c_proj.weight"),
    ],
)
def test_zero_initialised_matrix_compresses_against_its_first_defined_snapshot(
    zero_init_run: tuple[SpectralMonitor, RecordingLogger, WeightRecorder], role: str, name: str
) -> None:
    _, logger, weights = zero_init_run
    assert float(weights.weights[0][name].abs().max()) == 0.0  # really zero at step 0
    compression = logger.series(scalar_tag("compression", 1, role))
    assert math.isnan(compression[0])  # no stable rank of a zero matrix: no compression yet
    (reference_step,) = logger.series(reference_step_tag(1, role)).items()
    assert reference_step == (2, 2.0)  # logged once, at the snapshot that became the reference
    reference = exact_stable_rank(weights.weights[2][name])
    later = {step: value for step, value in compression.items() if step >= 2}
    assert sorted(later) == [2, 4, 6, 8]
    for step, value in later.items():
        expected = 100 * (1 - exact_stable_rank(weights.weights[step][name]) / reference)
        assert value == pytest.approx(expected, abs=1e-3), step
    assert later[8] != pytest.approx(0.0, abs=1e-2)


def test_matrices_defined_at_step_0_keep_step_0_as_reference(
    zero_init_run: tuple[SpectralMonitor, RecordingLogger, WeightRecorder],
) -> None:
    _, logger, _ = zero_init_run
    assert logger.series(reference_step_tag(0, "Q")) == {0: 0.0}
    assert logger.series(scalar_tag("compression", 0, "Q"))[0] == pytest.approx(0.0)


def test_reference_steps_survive_the_state_dict(
    zero_init_run: tuple[SpectralMonitor, RecordingLogger, WeightRecorder],
) -> None:
    monitor, _, _ = zero_init_run
    state = monitor.state_dict()
    steps = state["reference_steps"]
    assert steps["model.transformer.h.0.attn.c_proj.weight"] == 2
    assert steps["model.transformer.h.0.attn.c_attn.weight[Q]"] == 0
    assert set(steps) == set(state["references"])
    restored = SpectralMonitor(every_n_steps=2, log_spaced_until=0, figures=False)
    restored.load_state_dict(state)
    assert restored.state_dict()["reference_steps"] == steps


def test_a_nan_reference_of_an_older_checkpoint_is_replaced_by_the_next_defined_snapshot() -> None:
    from spectral_callbacks.monitor.reporting import Reporter
    from spectral_callbacks.names import MatrixLabel

    target = MatrixLabel(name="o", layer=0, num_layers=1, role="O")
    reporter = Reporter([target], metrics=("stable_rank", "compression"))
    reporter.load_state_dict({"references": {"o": math.nan}})  # the old rule's step-0 NaN
    scalars = reporter.scalars(30, {"o": {"stable_rank": 4.0}})
    assert scalars[scalar_tag("compression", 0, "O")] == 0.0
    assert reporter.state_dict() == {"references": {"o": 4.0}, "reference_steps": {"o": 30}}
