"""Snapshots: grouped by shape, exact copies that later updates cannot reach."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot


def _targets(weights: dict[str, torch.Tensor]) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=name, matrix=lambda w=w: w) for name, w in weights.items()]


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
    assert snapshot.main_thread_seconds >= 0 and snapshot.copied == {}


def test_snapshot_keeps_the_parameter_dtype() -> None:
    weights = {"w": torch.randn(4, 4).to(torch.float16)}
    snapshot = take_snapshot(group_by_shape(_targets(weights)), step=0)
    assert snapshot.tensors["4x4/float16/cpu"].dtype == torch.float16


@pytest.mark.gpu
def test_cuda_snapshot_is_ordered_before_the_next_update() -> None:
    weight = torch.randn(256, 256, device="cuda")
    expected = weight.clone()
    groups = group_by_shape(_targets({"w": weight}))
    side = torch.cuda.Stream()
    snapshot = take_snapshot(groups, step=1, stream=side)
    weight.mul_(3.0)  # queued on the training stream, which must wait for the copy
    snapshot.ready.synchronize()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(snapshot.tensors["256x256/float32/cuda:0"][0], expected)
