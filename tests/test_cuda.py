"""The CUDA path on a real device: exact values, no sync on the training thread, overlap, memory.

Every test needs a CUDA device (``@pytest.mark.gpu``) and is skipped without one. ``make
gpu-check`` runs them (``pytest -m gpu``) and reports them in its table.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cuda_checks import (
    CheckedMonitor,
    SyncDetector,
    TimedCompute,
    TrainingEvents,
    exact_metrics,
    sleep_ms,
)
from tiny_models import RecordingLogger, TinyGPT, WeightRecorder, quiet_trainer, token_loader

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.compute import SpectrumCompute
from spectral_callbacks.monitor.engine import SnapshotEngine
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import find_targets

pytestmark = pytest.mark.gpu

SCHEDULE = [0, 1, 2, 4, 5, 10, 15, 20, 25, 30]


@pytest.mark.parametrize(
    ("precision", "compiled"),
    [("32-true", False), ("bf16-mixed", False), ("32-true", True)],
    ids=["fp32", "bf16-mixed", "torch.compile"],
)
def test_every_scheduled_step_matches_a_float64_svd(precision: str, compiled: bool) -> None:
    logger, recorder = RecordingLogger(), WeightRecorder()
    model = TinyGPT(n_embd=256, n_head=4)
    if compiled:
        model.model = torch.compile(model.model)
    monitor = SpectralMonitor(
        metrics=("stable_rank", "alpha"),
        every_n_steps=5,
        log_spaced_until=5,
        svd_method="randomized",  # the path that matters on a GPU (auto may pick exact at 256)
        max_pending=32,  # nothing skipped: every scheduled step is checked
        figures=False,
    )
    trainer = quiet_trainer(
        accelerator="gpu",
        precision=precision,
        max_steps=30,
        logger=logger,
        callbacks=[monitor, recorder],
    )
    trainer.fit(model, token_loader())
    targets = find_targets(model)
    assert targets and all(target.matrix().is_cuda for target in targets)
    for target in targets:
        ranks = logger.series(scalar_tag("stable_rank", target.layer, target.role))
        alphas = logger.series(scalar_tag("alpha", target.layer, target.role))
        assert sorted(ranks) == SCHEDULE == sorted(alphas), target.name
        for step in SCHEDULE:
            exact = exact_metrics(recorder.weights[step][target.name])
            assert ranks[step] == pytest.approx(exact["stable_rank"], rel=0.01), (target.name, step)
            assert alphas[step] == pytest.approx(exact["alpha"], abs=0.02), (target.name, step)


def test_no_hook_synchronizes_the_training_thread() -> None:
    detector = SyncDetector()
    with detector.active():
        # The detector itself works: a sync in a checked region is found...
        with detector.checking("self-test"):
            torch.cuda.current_stream().synchronize()
        assert detector.found and detector.found[0].startswith("self-test")
        detector.found.clear()
        # ...and none is found in any hook of a fit with the default compute and figures.
        monitor = CheckedMonitor(detector, every_n_steps=5, log_spaced_until=8)
        trainer = quiet_trainer(
            accelerator="gpu", max_steps=30, logger=RecordingLogger(), callbacks=[monitor]
        )
        trainer.fit(TinyGPT(n_embd=256, n_head=4), token_loader())
    assert detector.found == []


def test_the_svd_runs_while_later_training_steps_run() -> None:
    sleep_ms(1)  # calibrate on the main thread
    # A real SVD, made slow enough (20 ms of GPU sleep per group) to span several steps.
    compute = TimedCompute(SpectrumCompute(method="randomized"), sleep=20)
    steps = TrainingEvents()
    monitor = SpectralMonitor(
        metrics=("stable_rank",),
        every_n_steps=5,
        log_spaced_until=0,
        compute=compute,
        figures=False,
    )
    trainer = quiet_trainer(
        accelerator="gpu", max_steps=30, logger=RecordingLogger(), callbacks=[monitor, steps]
    )
    training_stream = torch.cuda.current_stream().cuda_stream  # Lightning trains on it
    trainer.fit(TinyGPT(n_embd=256, n_head=4), token_loader())
    torch.cuda.synchronize()
    # The compute ran on a stream of its own, never on training's.
    assert compute.streams and training_stream not in compute.streams
    origin = steps.events[0][1]
    training = [(step, origin.elapsed_time(event)) for step, event in steps.events]
    overlaps = 0
    for (start, _), slept in zip(compute.intervals, compute.after_sleep, strict=True):
        # Strictly inside the compute's 20 ms GPU sleep: only work on another stream, running
        # at the same time, can complete there (a serialized SVD would hold training back).
        begin, awake = origin.elapsed_time(start), origin.elapsed_time(slept)
        overlaps += sum(begin < at < awake for _, at in training)
    assert overlaps > 0  # a training step completed while the SVD's stream slept


def test_gpu_memory_does_not_grow_over_50_snapshots_and_pinned_buffers_are_reused() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"h.{i}.{role}": torch.randn(*shape, device="cuda", generator=generator)
        for i in range(4)
        for role, shape in (("q", (512, 512)), ("up", (2048, 512)))
    }
    targets = [SimpleNamespace(name=name, matrix=lambda w=w: w) for name, w in weights.items()]
    groups = group_by_shape(targets)
    engine = SnapshotEngine(SpectrumCompute(method="randomized"), groups, max_pending=2)
    allocated: list[int] = []
    for step in range(50):
        for weight in weights.values():
            weight.add_(0.01 * torch.randn_like(weight))  # training moves the weights
        assert engine.submit(take_snapshot(groups, step))
        results: list[Any] = engine.collect(wait_seconds=60)
        assert [result.step for result in results] == [step]
        allocated.append(torch.cuda.memory_allocated())
    engine.close()
    # After warm-up (generators, warm-start subspaces, library workspaces) nothing accumulates.
    assert max(allocated[5:]) == min(allocated[5:]), allocated
    assert engine.pinned_allocated <= engine.max_pending
