"""The GPU tests' helpers on the CPU. The trap for waits of the training thread
(cuda_checks.SyncDetector) reports what it is meant to: a pageable copy to the meta device stands
for one to a GPU, and the wrapped synchronize calls are recorded before they run (here they then
fail: no CUDA). The ranks' helper of tests/cuda/test_cuda_ranks.py runs its whole course on the host."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

import cuda_tracker_cases as cases
import pytest
import torch
from cuda_checks import (
    FIRST_FORWARD_HOOKS,
    CheckedMonitor,
    SyncDetector,
    after_the_reading,
    monitor_hooks,
)
from spawn_ranks import run_ranks
from tiny_models import read_scalars

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.names import scalar_tag


def test_the_checked_monitor_runs_every_hook_the_monitor_implements_inside_the_detector() -> None:
    # before: it wrapped six hooks; on_train_batch_start, on_before_backward and
    # on_before_optimizer_step, where the first forward is read, ran unchecked
    from tiny_models import TinyGPT, quiet_trainer, token_loader

    hooks = monitor_hooks()
    assert set(FIRST_FORWARD_HOOKS) | {"on_train_batch_end", "state_dict"} <= set(hooks)
    assert all(getattr(CheckedMonitor, h) is not getattr(SpectralMonitor, h) for h in hooks)
    detector = SyncDetector(device_type="meta")
    monitor = CheckedMonitor(detector, figures=False, roles_from_first_forward=True)
    with detector.active():
        quiet_trainer(max_steps=2, callbacks=[monitor]).fit(TinyGPT(), token_loader(4))
    for region in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step"):
        assert (
            f"{region} at step 0" in detector.regions and f"{region} at step 1" in detector.regions
        )
    assert "on_train_batch_end at step 2" in detector.regions and detector.found == []


def test_only_the_first_forwards_reading_at_step_0_may_wait() -> None:
    found = [
        "on_before_backward at step 0: aten._local_scalar_dense.default: a scalar read",
        "on_train_batch_start at step 0: Event.synchronize",
        "on_before_backward at step 1: aten._local_scalar_dense.default: a scalar read",
        "on_train_batch_end at step 0: torch.cuda.synchronize",
    ]
    assert after_the_reading(found) == found[2:]


def test_a_pageable_copy_on_the_training_thread_is_reported_by_op_and_region() -> None:
    detector = SyncDetector(device_type="meta")
    host = torch.ones(8)
    with detector.active():
        with detector.checking("offer"):
            host.to("meta")  # aten._to_copy
            torch.empty(8, device="meta").copy_(host, non_blocking=True)  # aten.copy_, pageable
        host.to("meta")  # outside a checked region: not reported
    assert len(detector.found) == 2, detector.found
    assert all(found.startswith("offer: ") for found in detector.found)
    assert "_to_copy" in detector.found[0] and "copy_" in detector.found[1]
    assert all("pageable copy cpu -> meta" in found for found in detector.found)


def test_copies_within_the_host_or_on_another_thread_are_not_reported() -> None:
    detector = SyncDetector(device_type="meta")
    host = torch.ones(8)

    def worker() -> None:
        host.to("meta")  # the worker thread may wait for the device

    with detector.active(), detector.checking("collect"):
        torch.empty(8).copy_(host)
        host.clone().to(torch.float64)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert detector.found == []


@pytest.mark.parametrize(
    ("call", "label"),
    [
        (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize"),
        (lambda: torch.cuda.Event.synchronize(None), "Event.synchronize"),
        (lambda: torch.cuda.Stream.synchronize(None), "Stream.synchronize"),
    ],
    ids=["torch.cuda.synchronize", "Event.synchronize", "Stream.synchronize"],
)
def test_each_synchronize_call_is_reported_and_put_back_afterwards(
    call: Callable[[], object], label: str
) -> None:
    originals = [getattr(owner, name) for owner, name in SyncDetector.WAITS]
    detector = SyncDetector(device_type="meta")
    with detector.active():
        with detector.checking("on_train_batch_end"), contextlib.suppress(Exception):
            call()  # recorded before it runs; without CUDA the call itself then fails
        with contextlib.suppress(Exception):
            call()  # outside a checked region: not reported
    assert detector.found == [f"on_train_batch_end: {label}"]
    assert [getattr(owner, name) for owner, name in SyncDetector.WAITS] == originals


@pytest.mark.parametrize("how", ["ddp", "sharded"])
def test_the_rank_helper_of_the_gpu_tests_runs_on_the_cpu(how: str, tmp_path: Path) -> None:
    # tests/cuda/test_cuda_ranks.py runs it on one GPU; here it shows the helper builds the model,
    # picks the engine, hands figures over and logs every scheduled step.
    logdir = tmp_path / "tb"
    ranks = run_ranks(cases.tracked_on_one_gpu, 2, tmp_path, str(logdir), how, "cpu")
    assert [rank["engine"] for rank in ranks] == [cases.ENGINES[how]] * 2
    assert ranks[0]["drawn"] and all(rank["found"] == [] for rank in ranks)
    logged = read_scalars(logdir)
    assert sorted(logged[scalar_tag("stable_rank", 0, "Q")]) == cases.SCHEDULED


def _has_qwen3_moe() -> bool:
    try:
        import transformers
    except ImportError:
        return False
    return hasattr(transformers, "Qwen3MoeConfig")


@pytest.mark.parametrize(
    "kind",
    [
        "lora-two-adapters",
        pytest.param(
            "moe",
            marks=pytest.mark.skipif(
                not _has_qwen3_moe(), reason="Qwen3-MoE needs transformers 4.51"
            ),
        ),
    ],
)
def test_the_target_kind_helper_of_the_gpu_tests_runs_on_the_cpu(kind: str) -> None:
    # tests/cuda/test_cuda_targets.py runs it on a GPU; here it shows the fit logs every scheduled step
    # of every matrix, each beside its float64 reference (the update of two adapters too).
    pytest.importorskip("peft")
    from cuda_target_cases import SCHEDULE, compared, run

    outcome = run(kind, accelerator="cpu")
    assert outcome["on_device"] and outcome["syncs"] == []
    metrics = ["stable_rank"] + (["update_stable_rank"] if kind != "moe" else [])
    for metric in metrics:
        source = outcome["updates"] if metric.startswith("update_") else outcome["weights"]
        rows = compared(outcome, metric, source)
        assert sorted({step for step, *_ in rows}) == SCHEDULE
        layers_roles = {key[:2] for _, key, _, _ in rows}
        assert layers_roles == {key[:2] for key in outcome["targets"]}
        for step, key, logged, expected in rows:
            assert logged == pytest.approx(expected, rel=0.01), (metric, step, key)
