"""Snapshots: grouped by shape, exact copies that later updates cannot reach."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
from spectral_callbacks.targets import Target


def _targets(weights: dict[str, torch.Tensor]) -> list[Target]:
    return [Target.from_parameter(name, w, role="Q") for name, w in weights.items()]


def test_groups_keep_first_seen_order_and_split_by_dtype() -> None:
    weights = {
        "a": torch.randn(8, 4),
        "b": torch.randn(4, 8),
        "c": torch.randn(8, 4),
        "d": torch.randn(8, 4, dtype=torch.bfloat16),
    }
    groups = group_by_shape(_targets(weights))
    assert [group.names for group in groups] == [("a", "c"), ("b",), ("d",)]
    assert [group.key for group in groups] == [
        "8x4/float32/cpu",
        "4x8/float32/cpu",
        "8x4/bfloat16/cpu",
    ]


def test_snapshot_is_an_exact_copy_untouched_by_the_next_update() -> None:
    weights = {"q": torch.randn(6, 5), "k": torch.randn(6, 5)}
    originals = {name: w.clone() for name, w in weights.items()}
    groups = group_by_shape(_targets(weights))
    snapshot = take_snapshot(groups, step=3)
    for weight in weights.values():
        weight.mul_(-2.0)  # the "next optimizer step", in place as optimizers do
    stacked = snapshot.tensors["6x5/float32/cpu"]
    assert torch.equal(stacked[0], originals["q"]) and torch.equal(stacked[1], originals["k"])
    assert snapshot.main_thread_seconds > 0 and snapshot.copied == {}


def test_a_one_matrix_group_and_interleaved_rows_are_copies_untouched_by_the_next_update() -> None:
    from spectral_callbacks.targets.target import Rows, Target

    torch.manual_seed(0)
    alone = torch.nn.Parameter(torch.randn(7, 5))  # the only 7x5 matrix: a group of one
    fused = torch.nn.Parameter(torch.randn(12, 5))  # 2 heads x (Q, K, V) x 2 rows, per head
    targets = [Target.from_parameter("alone", alone, role="Q")] + [
        Target.from_parameter(
            "fused", fused, role=role, rows=Rows(2 * part, 2 * part + 2, groups=2), fused=True
        )
        for part, role in enumerate(("Q", "K", "V"))
    ]
    # Independent reference: the rows of each part picked by hand, head by head.
    heads = fused.detach().clone().reshape(2, 6, 5)
    expected = [alone.detach().clone()] + [
        heads[:, 2 * part : 2 * part + 2].reshape(4, 5) for part in range(3)
    ]
    groups = group_by_shape(targets)
    assert [group.names for group in groups] == [
        ("alone",),
        ("fused[Q]", "fused[K]", "fused[V]"),
    ]
    snapshot = take_snapshot(groups, step=1)
    with torch.no_grad():
        alone.mul_(-2.0)  # the next update, in place
        fused.add_(1.0)
    stacks = [snapshot.tensors["7x5/float32/cpu"][0]] + list(snapshot.tensors["4x5/float32/cpu"])
    for stacked, reference in zip(stacks, expected, strict=True):
        assert torch.equal(stacked, reference)


def test_snapshot_keeps_the_parameter_dtype() -> None:
    weights = {"w": torch.randn(4, 4).to(torch.float16)}
    snapshot = take_snapshot(group_by_shape(_targets(weights)), step=0)
    assert snapshot.tensors["4x4/float16/cpu"].dtype == torch.float16


@pytest.mark.gpu
def test_cuda_copy_sees_a_late_update_and_not_the_next_one() -> None:
    from cuda_checks import sleep_ms

    weight = torch.randn(256, 256, device="cuda")
    original = weight.clone()
    groups = group_by_shape(_targets({"w": weight}))
    torch.cuda.synchronize()
    sleep_ms(200)  # the update of step s is late on the training stream...
    weight.mul_(2.0)
    snapshot = take_snapshot(groups, step=1)  # ...and the copy is enqueued before it ran
    weight.add_(1.0)  # the update of step s + 1, in place
    torch.cuda.synchronize()
    assert torch.equal(snapshot.tensors["256x256/float32/cuda:0"][0], original * 2.0)


@pytest.mark.gpu
def test_cuda_copy_does_not_queue_behind_work_on_the_compute_stream() -> None:
    from cuda_checks import sleep_ms

    weight = torch.randn(256, 256, device="cuda")
    groups = group_by_shape(_targets({"w": weight}))
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        sleep_ms(500)  # an earlier snapshot's SVD, still running
    snapshot = take_snapshot(groups, step=2)
    weight.mul_(3.0)  # the next update
    torch.cuda.current_stream().synchronize()  # the training stream is done: copy and update...
    assert snapshot.copied["cuda:0"].query()
    assert not side.query()  # ...while the compute stream is still busy: it never waited for it
    side.synchronize()


@pytest.mark.gpu
def test_the_compute_stream_reads_the_stack_only_after_the_copy() -> None:
    from cuda_checks import sleep_ms

    from spectral_callbacks.monitor.engines.engine import SnapshotEngine
    from spectral_callbacks.monitor.options import MonitorOptions

    weight = torch.randn(256, 256, device="cuda")
    groups = group_by_shape(_targets({"w": weight}))
    total = lambda group, batch: {"sum": batch.double().sum((-2, -1))}  # noqa: E731
    engine = SnapshotEngine(total, groups, MonitorOptions())
    expected = float((weight.double() * 2.0).sum())
    torch.cuda.synchronize()
    sleep_ms(300)  # training is behind: the copy runs 300 ms from now
    weight.mul_(2.0)
    assert engine.submit(take_snapshot(groups, step=3))
    [result] = engine.collect(wait_seconds=60)
    engine.close()
    assert result.metrics["w"]["sum"] == pytest.approx(expected, rel=1e-9)
    assert result.copy_seconds > 0 and result.svd_seconds > 0  # both measured, never left 0


def test_a_snapshot_of_targets_that_copy_themselves_never_builds_their_matrix() -> None:
    # matrix() of an interleaved per-head split is a whole copy; the stack's shape, dtype and
    # device come from the group, so a snapshot makes only the copy_into copies.
    weights = [torch.randn(6, 4), torch.randn(6, 4)]
    built: list[int] = []

    class CopiesItself(Target):
        def matrix(self) -> torch.Tensor:
            built.append(self.layer)
            return weights[self.layer].clone()

        def copy_values_into(self, out: torch.Tensor) -> None:
            out.copy_(weights[self.layer])

    def target(index: int) -> Target:
        return CopiesItself.from_parameter(f"w{index}", weights[index], role="Q", layer=index)

    groups = group_by_shape([target(0), target(1)])
    built.clear()  # grouping reads each shape once, at construction
    snapshot = take_snapshot(groups, step=3)
    assert built == []
    assert torch.equal(snapshot.tensors[groups[0].key], torch.stack(weights))


@pytest.mark.gpu
def test_a_freed_stack_is_not_reused_by_training_while_the_compute_stream_reads_it() -> None:
    # The engine frees each stack as soon as its compute is enqueued. Without `record_stream` the
    # caching allocator would hand that block back to the training stream (where it was allocated)
    # at once, and a same-sized tensor written there - training does not wait for the compute
    # stream - would overwrite the stack before the compute stream, still 300 ms behind, reads it.
    from cuda_checks import sleep_ms

    from spectral_callbacks.monitor.engines.engine import SnapshotEngine
    from spectral_callbacks.monitor.options import MonitorOptions

    weight = torch.randn(512, 512, device="cuda")
    expected = float(weight.double().sum())
    groups = group_by_shape(_targets({"w": weight}))

    def late_total(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        sleep_ms(300)  # the compute stream reads the stack only 300 ms from now
        return {"sum": batch.double().sum((-2, -1))}

    engine = SnapshotEngine(late_total, groups, MonitorOptions())
    torch.cuda.synchronize()
    assert engine.submit(take_snapshot(groups, step=1))
    job = engine._jobs[0]  # the worker is done once its compute is enqueued and the stack freed
    while not job.future.done():
        time.sleep(0.001)
    assert not job.snapshot.tensors  # the snapshot no longer holds the stack
    # Training allocates same-sized tensors and writes them, on its own stream, right away.
    overwrites = [torch.full((1, 512, 512), 7.0, device="cuda") for _ in range(4)]
    [result] = engine.collect(wait_seconds=60)
    engine.close()
    torch.cuda.synchronize()
    assert all(bool((tensor == 7.0).all()) for tensor in overwrites)
    assert result.metrics["w"]["sum"] == pytest.approx(expected, rel=1e-9)
