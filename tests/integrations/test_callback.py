"""SpectralMonitor in short CPU fits: schedule, consistency, bounds, errors, shutdown, loggers."""

from __future__ import annotations

import csv
import signal
import threading
import time
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
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
from spectral_callbacks.monitor.engines.engine import WORKER_THREAD_NAME, SpectralComputeError
from spectral_callbacks.names import NUM_LAYERS_TAG, monitor_tag, scalar_tag


def _monitor(**kwargs: Any) -> SpectralMonitor:
    # max_pending covers every scheduled step of these short runs even on a loaded machine: tests
    # that assert which steps were logged must not depend on how fast the worker is (the skip
    # tests set their own bound).
    options: dict[str, Any] = dict(
        compute=exact_compute, metrics=("stable_rank", "compression"), figures=False, max_pending=32
    )
    options.update(kwargs)
    return SpectralMonitor(**options)


def _assert_matches_weights(
    logger: RecordingLogger, recorder: WeightRecorder, model: TinyGPT
) -> None:
    from spectral_callbacks.targets import find_targets

    for target in find_targets(model):
        series = logger.series(
            scalar_tag("stable_rank", target.layer, target.role, target.num_layers)
        )
        assert series, target.name
        for step, value in series.items():
            expected = exact_stable_rank(recorder.weights[step][target.name])
            assert value == pytest.approx(expected, rel=1e-6), (target.name, step)


def test_schedule_under_gradient_accumulation_and_values_are_the_weights_at_each_step() -> None:
    logger, recorder, model = RecordingLogger(), WeightRecorder(), TinyGPT()
    monitor = _monitor(every_n_steps=5, log_spaced_until=3)
    trainer = quiet_trainer(
        max_steps=12, accumulate_grad_batches=3, logger=logger, callbacks=[monitor, recorder]
    )
    trainer.fit(model, token_loader(num_batches=40))
    tag = scalar_tag("stable_rank", 0, "Q")
    assert sorted(logger.series(tag)) == [0, 1, 2, 5, 10, 12]  # 12: the final step, always
    assert logger.series(NUM_LAYERS_TAG) == {0: 2.0}
    assert logger.series(scalar_tag("compression", 0, "Q"))[0] == 0.0
    _assert_matches_weights(logger, recorder, model)


def test_manual_optimization_with_two_optimizers_cannot_jump_a_grid_step() -> None:
    logger, recorder = RecordingLogger(), WeightRecorder()
    model = TinyGPT(manual=True, two_optimizers=True)  # global_step advances by 2 per batch
    monitor = _monitor(every_n_steps=5, log_spaced_until=0)
    trainer = quiet_trainer(max_steps=20, logger=logger, callbacks=[monitor, recorder])
    trainer.fit(model, token_loader())
    assert sorted(logger.series(scalar_tag("stable_rank", 1, "MLP_down"))) == [0, 6, 10, 16, 20]
    _assert_matches_weights(logger, recorder, model)


def test_a_slow_engine_skips_and_counts_and_still_measures_the_final_step() -> None:
    def slow(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(0.05)
        return exact_compute(group, batch)

    logger = RecordingLogger()
    monitor = _monitor(compute=slow, every_n_steps=1, log_spaced_until=0, max_pending=1)
    trainer = quiet_trainer(max_steps=12, logger=logger, callbacks=[monitor])
    trainer.fit(TinyGPT(), token_loader())
    logged = sorted(logger.series(scalar_tag("stable_rank", 0, "Q")))
    skipped = logger.series(monitor_tag("skipped"))
    assert logged[0] == 0 and logged[-1] == 12
    assert skipped[12] > 0 and len(logged) + skipped[12] == 13  # every scheduled step accounted for
    assert max(logger.series(monitor_tag("pending")).values()) <= 1


def test_worker_error_is_raised_on_the_main_thread_naming_the_matrix() -> None:
    def fails_on_one_matrix(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if "model.transformer.h.1.mlp.c_fc.weight" in group.names:
            raise torch.linalg.LinAlgError("did not converge")
        return exact_compute(group, batch)

    trainer = quiet_trainer(
        max_steps=10, logger=RecordingLogger(), callbacks=[_monitor(compute=fails_on_one_matrix)]
    )
    with pytest.raises(
        SpectralComputeError,
        match=r"'model\.transformer\.h\.1\.mlp\.c_fc\.weight' at step 0.*did not converge",
    ):
        trainer.fit(TinyGPT(), token_loader())
    assert not _worker_alive()


def _worker_alive() -> bool:
    return any(
        thread.name == WORKER_THREAD_NAME and thread.is_alive() for thread in threading.enumerate()
    )


def _slow_compute(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    time.sleep(0.1)
    return exact_compute(group, batch)


def test_exception_mid_fit_finishes_in_flight_work_and_shuts_down() -> None:
    logger = RecordingLogger()
    monitor = _monitor(compute=_slow_compute, every_n_steps=1, log_spaced_until=0, max_pending=4)
    trainer = quiet_trainer(max_steps=50, logger=logger, callbacks=[monitor])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="planned failure at step 6"):
        trainer.fit(TinyGPT(fail_at_step=6), token_loader())
    assert time.monotonic() - start < 30
    assert not _worker_alive()
    logged = sorted(logger.series(scalar_tag("stable_rank", 0, "Q")))
    skipped = logger.series(monitor_tag("skipped"))[logged[-1]]
    # Steps 0..6 were scheduled before the failure: each was either skipped (counted) or, if in
    # flight when training failed, finished and logged after the exception.
    assert len(logged) > 1 and len(logged) + skipped == 7


def test_keyboard_interrupt_shuts_down_cleanly() -> None:
    logger = RecordingLogger()
    monitor = _monitor(compute=_slow_compute, every_n_steps=1, log_spaced_until=0, max_pending=2)
    trainer = quiet_trainer(max_steps=50, logger=logger, callbacks=[monitor])
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning turns Ctrl+C into a graceful exit(1)
            trainer.fit(TinyGPT(interrupt_at_step=4), token_loader())
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning ignores SIGINT after an interrupt
    assert not _worker_alive()
    assert 0 in logger.series(scalar_tag("stable_rank", 0, "Q"))


def test_csv_logger_gets_the_same_scalars(tmp_path: Any) -> None:
    logger, recording = CSVLogger(tmp_path, name="csv"), RecordingLogger()
    trainer = quiet_trainer(
        max_steps=6,
        logger=[logger, recording],
        callbacks=[_monitor(every_n_steps=3, log_spaced_until=0)],
    )
    trainer.fit(TinyGPT(), token_loader())
    with open(logger.log_dir + "/metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    tag = scalar_tag("stable_rank", 1, "V")
    steps = sorted(int(row["step"]) for row in rows if row.get(tag))
    assert steps == [0, 3, 6]
    assert any(row.get(NUM_LAYERS_TAG) == "2.0" for row in rows)
    # Every value the CSV holds is the one the other logger of the same run got, tag by tag.
    compared = 0
    for row in rows:
        for name, text in row.items():
            if name.startswith("spectral_") and text:
                expected = recording.series(name)[int(row["step"])]
                assert float(text) == pytest.approx(expected, rel=1e-6, abs=1e-9), (
                    name,
                    row["step"],
                )
                compared += 1
    tags = {name for _, metrics in recording.records for name in metrics}
    assert compared == sum(
        len(recording.series(name)) for name in tags if name.startswith("spectral_")
    )


def test_bfloat16_parameters_are_measured_in_float32() -> None:
    logger, recorder = RecordingLogger(), WeightRecorder()
    model = TinyGPT().to(torch.bfloat16)
    trainer = quiet_trainer(
        max_steps=4,
        logger=logger,
        callbacks=[_monitor(every_n_steps=2, log_spaced_until=0), recorder],
    )
    trainer.fit(model, token_loader())
    assert sorted(logger.series(scalar_tag("stable_rank", 0, "K"))) == [0, 2, 4]
    _assert_matches_weights(logger, recorder, model)


def test_bf16_mixed_precision_and_a_compiled_model() -> None:
    logger, recorder = RecordingLogger(), WeightRecorder()
    model = TinyGPT()
    model.model = torch.compile(model.model, backend="eager")  # names gain `_orig_mod.`
    trainer = quiet_trainer(
        max_steps=4,
        precision="bf16-mixed",
        logger=logger,
        callbacks=[_monitor(every_n_steps=2, log_spaced_until=0), recorder],
    )
    trainer.fit(model, token_loader())
    assert sorted(logger.series(scalar_tag("stable_rank", 1, "O"))) == [0, 2, 4]
    _assert_matches_weights(logger, recorder, model)


def test_no_logger_is_a_clear_error() -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, callbacks=[_monitor()])
    with pytest.raises(
        MisconfigurationException, match="the Trainer has none: pass `logger=TensorBoardLogger"
    ):
        trainer.fit(TinyGPT(), token_loader())


def test_no_targets_is_a_clear_error_listing_candidates() -> None:
    class NotATransformer(TinyGPT):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            # a forward that runs: the names place nothing, so the roles wait for it, and it
            # shows none either (the same error, at the first training forward)
            return self.model(torch.ones(2, 4)).sum()

    trainer = quiet_trainer(max_steps=2, logger=RecordingLogger(), callbacks=[_monitor()])
    with pytest.raises(
        MisconfigurationException,
        match=r"(?s)SpectralMonitor: .*model\.0\.weight \(4, 4\).*SpectralMonitor\(roles=, include=, exclude=, mapping=\)",
    ):
        trainer.fit(NotATransformer(), token_loader())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metrics": ("stable_rank", "rank")}, "`metrics` must be a non-empty list of stable_rank"),
        ({"every_n_steps": 0}, "`every_n_steps` must be a positive int, got 0"),
        ({"max_pending": 0}, "`max_pending` must be a positive int, got 0"),
        ({"figure_every_n_steps": 0}, "`figure_every_n_steps` must be a positive int or None"),
        ({"max_overhead": 2.0}, "`max_overhead` must be a fraction"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match):
        SpectralMonitor(**kwargs)


@pytest.mark.gpu
def test_cuda_fit_bf16_randomized_values_are_exact_and_training_never_waits_for_the_svd() -> None:
    from cuda_checks import TimedCompute, sleep_ms

    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.targets import find_targets

    sleep_ms(1)  # calibrate the GPU sleep on the main thread
    # A slow SVD: 100 ms of GPU sleep on the compute stream before each group's randomized SVD.
    compute = TimedCompute(SpectrumCompute(method="randomized"), sleep=100)
    overlapped = []

    class TrainingStreamDone(Callback):
        """After the monitor's hook: the training stream is done, is a slow SVD still running?"""

        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.current_stream().synchronize()  # the test's sync, not the callback's
            overlapped.append(any(not event.query() for event in compute.after_sleep))

    logger, recorder = RecordingLogger(), WeightRecorder()
    model = TinyGPT(n_embd=256, n_head=4)
    monitor = SpectralMonitor(
        metrics=("stable_rank",),
        every_n_steps=5,
        log_spaced_until=4,
        figures=False,
        compute=compute,
    )
    trainer = quiet_trainer(
        accelerator="gpu",
        precision="bf16-true",
        max_steps=20,
        logger=logger,
        callbacks=[monitor, TrainingStreamDone(), recorder],
    )
    trainer.fit(model, token_loader())
    assert any(overlapped)  # training finished steps while the compute stream slept
    for target in find_targets(model):
        assert target.matrix().dtype == torch.bfloat16
        series = logger.series(scalar_tag("stable_rank", target.layer, target.role))
        assert {0, 20} <= set(series) <= {0, 1, 2, 5, 10, 15, 20}
        for step, value in series.items():
            expected = exact_stable_rank(recorder.weights[step][target.name])
            assert value == pytest.approx(expected, rel=0.01), (target.name, step)


def test_overhead_budget_thins_the_schedule_instead_of_skipping() -> None:
    def slow(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(0.05)
        return exact_compute(group, batch)

    logger = RecordingLogger()
    monitor = _monitor(
        compute=slow, every_n_steps=1, log_spaced_until=0, max_overhead=0.01, max_pending=8
    )
    trainer = quiet_trainer(max_steps=30, logger=logger, callbacks=[monitor])
    trainer.fit(TinyGPT(), token_loader())
    logged = sorted(logger.series(scalar_tag("stable_rank", 0, "Q")))
    # A snapshot costs >= 150 ms against steps of tens of ms: 1 % allows far fewer than every step.
    assert logged[0] == 0 and logged[-1] == 30 and len(logged) < 10
    assert monitor.schedule.min_interval() > 10
    assert logger.series(monitor_tag("skipped"))[30] == 0
