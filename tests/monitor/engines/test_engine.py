"""SnapshotEngine: results in order, bounded in flight, errors named, shutdown that never hangs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spectral_callbacks.monitor.engines.engine import SnapshotEngine, SpectralComputeError
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import ShapeGroup, group_by_shape, take_snapshot
from spectral_callbacks.targets import Target


def _groups(weights: dict[str, torch.Tensor]) -> list[ShapeGroup]:
    return group_by_shape([Target.from_parameter(n, w, role="Q") for n, w in weights.items()])


def exact_stable_rank(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    singular = torch.linalg.svdvals(batch.double())
    return {"stable_rank": (singular**2).sum(-1) / singular[..., 0] ** 2}


def test_results_match_a_float64_reference_per_matrix() -> None:
    weights = {"a": torch.randn(16, 8), "b": torch.randn(16, 8), "c": torch.randn(8, 32)}
    engine = SnapshotEngine(exact_stable_rank, _groups(weights), MonitorOptions())
    groups = list(engine.groups.values())
    assert engine.submit(take_snapshot(groups, step=5))
    [result] = engine.collect(wait_seconds=30)
    engine.close()
    assert result.step == 5 and set(result.metrics) == {"a", "b", "c"}
    for name, weight in weights.items():
        singular = torch.linalg.svdvals(weight.double())
        expected = float((singular**2).sum() / singular[0] ** 2)
        assert result.metrics[name]["stable_rank"] == pytest.approx(expected, rel=1e-9)


def test_bfloat16_snapshots_reach_compute_as_float32() -> None:
    seen = []

    def record_dtype(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(batch.dtype)
        return {"one": torch.ones(batch.shape[0])}

    groups = _groups({"w": torch.randn(4, 4, dtype=torch.bfloat16)})
    engine = SnapshotEngine(record_dtype, groups, MonitorOptions())
    engine.submit(take_snapshot(groups, step=0))
    assert len(engine.collect(wait_seconds=30)) == 1
    engine.close()
    assert seen == [torch.float32]


def test_a_slow_engine_skips_and_counts_instead_of_queueing() -> None:
    release = threading.Event()

    def blocked(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        release.wait(timeout=30)
        return {"x": torch.zeros(batch.shape[0])}

    groups = _groups({"w": torch.randn(4, 4)})
    engine = SnapshotEngine(blocked, groups, MonitorOptions(max_pending=2))
    accepted = [engine.submit(take_snapshot(groups, step=s)) for s in range(6)]
    assert accepted == [True, True, False, False, False, False]
    assert engine.pending == 2 and engine.skipped == 4
    assert engine.collect() == []  # nothing finished: collect does not wait
    release.set()
    assert [r.step for r in engine.collect(wait_seconds=30)] == [0, 1]
    assert engine.pending == 0
    assert engine.submit(take_snapshot(groups, step=7))  # room again
    engine.close()


def test_worker_error_is_raised_on_the_main_thread_naming_the_matrix() -> None:
    def fails_on_nan(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if torch.isnan(batch).any():
            raise torch.linalg.LinAlgError("the input contains NaN")
        return {"x": torch.zeros(batch.shape[0])}

    weights = {"h.0.q": torch.randn(4, 4), "h.1.q": torch.full((4, 4), float("nan"))}
    groups = _groups(weights)
    engine = SnapshotEngine(fails_on_nan, groups, MonitorOptions())
    engine.submit(take_snapshot(groups, step=12))
    deadline = time.monotonic() + 30
    with pytest.raises(SpectralComputeError, match=r"matrix 'h\.1\.q' at step 12.*LinAlgError"):
        while time.monotonic() < deadline:
            engine.collect(wait_seconds=0.1)
    engine.close()


def test_results_before_an_error_are_handed_over_first() -> None:
    calls = []

    def fails_second_time(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("boom")
        return {"x": torch.zeros(batch.shape[0])}

    groups = _groups({"w": torch.randn(3, 3)})
    engine = SnapshotEngine(fails_second_time, groups, MonitorOptions(max_pending=3))
    engine.submit(take_snapshot(groups, step=0))
    engine.submit(take_snapshot(groups, step=1))
    time.sleep(0.2)
    first = engine.collect(wait_seconds=30)
    assert [r.step for r in first] == [0]
    with pytest.raises(SpectralComputeError, match="'w' at step 1.*ValueError: boom"):
        engine.collect(wait_seconds=30)
    engine.close()


def test_close_returns_within_its_timeout_even_if_the_worker_is_stuck() -> None:
    never = threading.Event()

    def stuck(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        never.wait(timeout=60)
        return {"x": torch.zeros(batch.shape[0])}

    groups = _groups({"w": torch.randn(3, 3)})
    engine = SnapshotEngine(stuck, groups, MonitorOptions())
    engine.submit(take_snapshot(groups, step=0))
    start = time.monotonic()
    assert engine.collect(wait_seconds=0.2) == []
    with pytest.warns(RuntimeWarning, match="did not stop within 0.2 s"):
        engine.close(timeout=0.2)
    assert time.monotonic() - start < 5
    never.set()


def test_synchronous_mode_has_the_result_at_once_on_the_calling_thread() -> None:
    threads = []

    def where(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        threads.append(threading.current_thread())
        return {"x": torch.zeros(batch.shape[0])}

    groups = _groups({"w": torch.randn(3, 3)})
    engine = SnapshotEngine(where, groups, MonitorOptions(synchronous=True))
    engine.submit(take_snapshot(groups, step=4))
    assert [r.step for r in engine.collect()] == [4]
    assert threads == [threading.current_thread()]


def test_max_pending_is_checked() -> None:
    with pytest.raises(ValueError, match="`max_pending` must be a positive int, got 0"):
        SnapshotEngine(exact_stable_rank, [], MonitorOptions(max_pending=0))


def test_synchronous_compute_inside_a_callers_autocast_runs_in_float32() -> None:
    # synchronous=True computes on the calling thread, inside whatever autocast region it is in
    # (a plain loop, Fabric): the SVD's products then ran in bfloat16.
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute

    generator = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(96, 64, generator=generator) for i in range(2)}
    groups = _groups(weights)
    engine = SnapshotEngine(
        SpectrumCompute(k=8, method="randomized"), groups, MonitorOptions(synchronous=True)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.submit(take_snapshot(groups, step=0))
    (result,) = engine.collect()
    for name, weight in weights.items():
        singular = torch.linalg.svdvals(weight.double())
        exact = float((singular**2).sum() / singular[0] ** 2)
        assert result.metrics[name]["stable_rank"] == pytest.approx(exact, rel=1e-5), name
