"""The CUDA path on a real device: exact values, no wait of the training thread (figures
included), overlap, memory (the peak with two snapshots in flight, nothing accumulating).

Every test needs a CUDA device (``@pytest.mark.gpu``) and is skipped without one. ``make
gpu-check`` runs them (``pytest -m gpu``, one run per file) and reports them in its table. The
DDP and sharded engines' training threads are checked in tests/cuda/test_cuda_ranks.py.
"""

from __future__ import annotations

import threading
from pathlib import Path
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
from lightning.pytorch.loggers import TensorBoardLogger
from tiny_models import RecordingLogger, TinyGPT, WeightRecorder, quiet_trainer, token_loader

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor import dashboards
from spectral_callbacks.monitor.engines.compute import ComputeFunction, SpectrumCompute
from spectral_callbacks.monitor.engines.engine import SnapshotEngine
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import Target, find_targets

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
        _skip_unless_compile_works()
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


def _skip_unless_compile_works() -> None:
    """Skip, with the reason, where this machine cannot compile at all (Triton's launcher is
    built by a C compiler at the first compile): a trivial function is compiled first."""
    try:
        torch.compile(lambda x: x + 1)(torch.ones(4, device="cuda"))
    except Exception as error:  # noqa: BLE001 - any failure of the toolchain, said as the reason
        first = (str(error).strip().splitlines() or [""])[0][:200]
        pytest.skip(f"torch.compile does not work on this machine: {type(error).__name__}: {first}")


def test_no_hook_waits_for_the_device_on_the_training_thread_figures_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sleep_ms(1)  # calibrate here: it waits on an event, and no region is being checked yet
    drawn: list[int] = []
    draw = dashboards.LiveFigures.draw

    def counted_draw(self: Any, experiments: Any, rows: Any, step: int) -> None:
        drawn.append(step)
        draw(self, experiments, rows, step)

    monkeypatch.setattr(dashboards.LiveFigures, "draw", counted_draw)
    detector = SyncDetector()
    with detector.active():
        # Each trap works on this device: a stream's and an event's wait, and a pageable copy
        # (the last two are what sync-debug mode does not report)...
        with detector.checking("self-test"):
            torch.cuda.current_stream().synchronize()
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
            torch.ones(4, device="cuda").cpu()
        for expected in ("Stream.synchronize", "Event.synchronize", "pageable copy cuda:0 -> cpu"):
            assert any(expected in found for found in detector.found), (expected, detector.found)
        detector.found.clear()
        # ...and none is found in any hook of a fit with the default compute, a real TensorBoard
        # logger and figures drawn during the run (every 10 steps) and at its end.
        monitor = CheckedMonitor(
            detector, every_n_steps=5, log_spaced_until=8, figure_every_n_steps=10
        )
        trainer = quiet_trainer(
            accelerator="gpu",
            max_steps=30,
            logger=TensorBoardLogger(str(tmp_path), name="run"),
            callbacks=[monitor],
        )
        trainer.fit(TinyGPT(n_embd=256, n_head=4), token_loader())
    assert detector.found == []
    assert drawn, "no figure was handed over during the run: the trap checked no figure"


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


class GatedCompute(ComputeFunction):
    """A compute function whose calls wait until :attr:`gate` is open: the worker holds the first
    group of a snapshot (the snapshot the other groups) while the test takes the next one."""

    def __init__(self, compute: SpectrumCompute) -> None:
        self.compute = compute
        self.gate = threading.Event()
        self.working_bytes, self.kept_bytes = compute.working_bytes, compute.kept_bytes

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        self.gate.wait(60)
        return self.compute(group, batch)


#: Memory the CUDA libraries allocate through the caching allocator beside the ledger's count
#: (cuSOLVER's workspace of a factorization); the compute stream's cuBLAS workspace exists before
#: the measurement (the warm-up snapshot made it).
LIBRARY_SLACK = 32 * 2**20
#: The most by which the caching allocator's block for one stack may exceed the stack: it hands
#: out a cached block whole when what is left of it would be at most 1 MiB.
BLOCK_SLACK = 2 * 2**20


def test_the_peak_with_two_snapshots_in_flight_is_within_the_documented_bound(
    restored_fp32_precision: None,
) -> None:
    # docs/callback.md, The snapshot budget: held = the copies not yet decomposed + the largest
    # working set among them + the kept subspaces (functional/memory.py bounds the working set,
    # the TF32 split's 8 m n included: TF32 is on here, through the new API where it exists).
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"h.{i}.{role}": torch.randn(*shape, device="cuda", generator=generator).to(dtype)
        for i in range(4)
        for role, shape, dtype in (
            ("q", (1024, 1024), torch.float32),  # the first group: nothing is made before the gate
            ("up", (4096, 1024), torch.bfloat16),  # copied in bf16, converted by the worker
        )
    }
    targets = [Target.from_parameter(name, w, role="Q") for name, w in weights.items()]
    compute = GatedCompute(SpectrumCompute(method="randomized"))
    engine = SnapshotEngine(compute, group_by_shape(targets), MonitorOptions(max_pending=2))
    plan = engine.plan
    copies = sum(plan.copies.values())
    bound = 2 * copies + max(plan.working.values()) + plan.kept
    # A warm-up snapshot: the compute stream, its library workspaces, the generators and the
    # warm-start subspaces exist before the measurement.
    compute.gate.set()
    assert engine.offer(0)
    assert [result.step for result in engine.collect(wait_seconds=120)] == [0]
    compute.gate.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert engine.offer(1)  # the worker takes it and waits at the gate with its first stack
    assert engine.offer(2)  # and a second snapshot is copied meanwhile: two in flight
    assert engine.pending == 2
    at_gate = torch.cuda.memory_allocated() - before
    compute.gate.set()
    results = engine.collect(wait_seconds=120)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    engine.close()
    assert [result.step for result in results] == [1, 2]
    # The copy term is what the two snapshots hold on the device: their stacks, in the
    # parameters' dtypes (no conversion on the training thread).
    stacks = 2 * len(plan.parts)
    assert 2 * copies <= at_gate <= 2 * copies + stacks * BLOCK_SLACK, (at_gate, copies)
    # The ledger's account never exceeds the documented formula and never undercounts what the
    # allocator held (the allocator's peak, measured, within the ledger's peak).
    assert engine.ledger.peak <= bound
    assert peak <= engine.ledger.peak + LIBRARY_SLACK, (peak, engine.ledger.peak)
    assert peak <= bound + LIBRARY_SLACK, f"peak {peak} bytes against the bound {bound}"


def test_a_cold_snapshot_with_tf32_on_stays_within_its_working_set_bound(
    restored_fp32_precision: None,
) -> None:
    # The step-0 snapshot (no warm start: the Gram route of GPT-2 MLP shapes) with TF32 on, on a
    # fresh engine: what the allocator held beside the copies, against functional/memory.py's
    # bound. Also what the compute stream's freed memory keeps reserved in its pool, and whether
    # the allocator had to free its cache and retry (docs/callback.md, The snapshot budget).
    if hasattr(torch.backends, "fp32_precision"):
        torch.backends.fp32_precision = "tf32"
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"h.{i}.{role}": torch.randn(*shape, device="cuda", generator=generator)
        for i in range(2)
        for role, shape in (("up", (4096, 1024)), ("down", (1024, 4096)))
    }
    targets = [Target.from_parameter(name, w, role="Q") for name, w in weights.items()]
    compute = SpectrumCompute(method="randomized")
    engine = SnapshotEngine(compute, group_by_shape(targets), MonitorOptions(max_pending=1))
    plan = engine.plan
    bound = sum(plan.copies.values()) + max(plan.working.values()) + plan.kept
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    assert engine.offer(0)
    (result,) = engine.collect(wait_seconds=120)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    reserved = torch.cuda.memory_reserved() - reserved_before
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    engine.close()
    for name, weight in weights.items():
        exact = exact_metrics(weight)["stable_rank"]
        assert result.metrics[name]["stable_rank"] == pytest.approx(exact, rel=0.01), name
    assert peak <= bound + LIBRARY_SLACK, f"cold peak {peak} bytes against the bound {bound}"
    # Freed by the compute stream, kept in its pool: at most what it held at its peak.
    assert 0 <= reserved <= peak + 2 * BLOCK_SLACK + LIBRARY_SLACK, (reserved, peak)
    assert retries == 0


def test_gpu_memory_does_not_grow_over_50_snapshots_and_pinned_buffers_are_reused() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"h.{i}.{role}": torch.randn(*shape, device="cuda", generator=generator)
        for i in range(4)
        for role, shape in (("q", (512, 512)), ("up", (2048, 512)))
    }
    targets = [Target.from_parameter(name, w, role="Q") for name, w in weights.items()]
    groups = group_by_shape(targets)
    engine = SnapshotEngine(
        SpectrumCompute(method="randomized"), groups, MonitorOptions(max_pending=2)
    )
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
