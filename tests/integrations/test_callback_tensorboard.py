"""End to end: a small GPT trains with SpectralMonitor and a TensorBoardLogger; the event files,
read back with TensorBoard's own reader, hold the exact stable rank of the weights at every
scheduled step, the custom-scalars layout and the figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tiny_models import TinyGPT, WeightRecorder, exact_stable_rank, quiet_trainer, token_loader

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor import dashboards
from spectral_callbacks.monitor.dashboards import tag_pattern
from spectral_callbacks.names import NUM_LAYERS_TAG, ROLES, monitor_tag, scalar_tag
from spectral_callbacks.targets import find_targets

SCHEDULED = [0, 1, 2, 4, 8, 10, 20, 30]


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[event_accumulator.EventAccumulator, WeightRecorder, TinyGPT]:
    logger = TensorBoardLogger(tmp_path_factory.mktemp("tb"), name="gpt")
    model, recorder = TinyGPT(n_layer=2, n_embd=64, n_head=2), WeightRecorder()
    # max_pending covers the dense early steps even on a loaded CI machine: this test is about
    # consistency; skipping has its own test.
    monitor = SpectralMonitor(
        every_n_steps=10, log_spaced_until=16, figure_every_n_steps=10, max_pending=8
    )
    trainer = quiet_trainer(max_steps=30, logger=logger, callbacks=[monitor, recorder])
    trainer.fit(model, token_loader())
    assert dashboards.wait_for_figures(timeout=120)  # fit() does not wait for the final figures
    reader = event_accumulator.EventAccumulator(
        str(Path(logger.log_dir)),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.IMAGES: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    reader.Reload()
    return reader, recorder, model


@pytest.mark.slow
def test_logged_stable_rank_is_the_exact_value_of_the_weights_at_each_scheduled_step(run) -> None:
    reader, recorder, model = run
    targets = find_targets(model)
    assert len(targets) == 12
    for target in targets:
        events = reader.Scalars(
            scalar_tag("stable_rank", target.layer, target.role, target.num_layers)
        )
        assert [event.step for event in events] == SCHEDULED, target.name
        for event in events:
            expected = exact_stable_rank(recorder.weights[event.step][target.name])
            assert event.value == pytest.approx(expected, rel=0.01), (target.name, event.step)


@pytest.mark.slow
def test_compression_is_relative_to_step_zero_and_means_average_the_layers(run) -> None:
    reader, _, _ = run
    for role in ROLES:
        ranks = [
            {e.step: e.value for e in reader.Scalars(scalar_tag("stable_rank", layer, role))}
            for layer in (0, 1)
        ]
        compression = {e.step: e.value for e in reader.Scalars(scalar_tag("compression", 0, role))}
        for step in SCHEDULED:
            assert compression[step] == pytest.approx(
                100 * (1 - ranks[0][step] / ranks[0][0]), abs=1e-3
            )
        mean = {e.step: e.value for e in reader.Scalars(scalar_tag("stable_rank", None, role))}
        assert mean[30] == pytest.approx((ranks[0][30] + ranks[1][30]) / 2, rel=1e-6)


@pytest.mark.slow
def test_every_metric_health_and_depth_are_logged(run) -> None:
    reader, _, _ = run
    scalars = set(reader.Tags()["scalars"])
    for metric in ("alpha", "alpha_r2", "spectral_norm", "frobenius_norm"):
        assert scalar_tag(metric, 1, "MLP_down") in scalars
    assert scalar_tag("energy_rank_90", 1, "MLP_down") not in scalars  # NaN beyond k: opt-in
    assert [(e.step, e.value) for e in reader.Scalars(NUM_LAYERS_TAG)] == [(0, 2.0)]
    for name in ("main_thread_ms", "svd_ms", "pending", "skipped"):
        assert [e.step for e in reader.Scalars(monitor_tag(name))] == SCHEDULED
    assert all(e.value == 0 for e in reader.Scalars(monitor_tag("skipped")))


@pytest.mark.slow
def test_custom_scalars_layout_has_charts_per_layer_and_per_role(run) -> None:
    reader, _, _ = run
    [event] = reader.Tensors("custom_scalars__config__")  # every chart had a finite line at step 0
    layout = layout_pb2.Layout()
    layout.ParseFromString(event.tensor_proto.string_val[0])
    categories = {category.title: category for category in layout.category}
    assert [category.closed for category in layout.category][:2] == [False, True]
    by_layer = {
        chart.title: list(chart.multiline.tag)
        for chart in categories["spectral stable_rank by layer"].chart
    }
    assert by_layer["L01 Q K V O"] + by_layer["L01 MLP_up MLP_down"] == [
        tag_pattern(scalar_tag("stable_rank", 1, role)) for role in ROLES
    ]
    by_role = {
        chart.title: list(chart.multiline.tag)
        for chart in categories["spectral compression by role"].chart
    }
    assert by_role["K"] == [
        tag_pattern(scalar_tag("compression", layer, "K")) for layer in (0, 1, None)
    ]


@pytest.mark.slow
def test_figures_are_logged_at_the_cadence_and_at_the_end(run) -> None:
    reader, _, _ = run
    images = set(reader.Tags()["images"])
    expected = {
        "spectral_figures/alpha_vs_depth/Q",
        "spectral_figures/stable_rank_vs_steps/L00",
        "spectral_figures/compression_by_layer",
        "spectral_figures/compression_wave/Q",
    }
    assert images == expected
    steps = [event.step for event in reader.Images("spectral_figures/compression_by_layer")]
    assert steps[-1] == 30 and len(steps) >= 2  # at least one during the run, always one at the end
    assert reader.Images("spectral_figures/compression_by_layer")[-1].width > 100
