"""Sharded weights through the frontends: Lightning's ModelParallelStrategy and a raw loop with
SpectralTracker, 2 CPU processes with gloo, checked against a float64 exact SVD of the full
weights (``full_tensor()``) at every scheduled step; and a failure on one rank mid-run.

The Lightning runs launch ``tests/sharded_train.py`` in a subprocess of its own session (Lightning
re-runs the script per rank) so a timeout kills every rank; the raw loops run under
``spawn_ranks.run_ranks``, which kills ranks that outlive its timeout. A test never hangs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import sharded_tracker_cases as cases
import torch
from sharded_models import exact_metrics
from spawn_ranks import run_ranks
from test_ddp import run_script
from tiny_models import RecordingLogger, read_scalars

from spectral_callbacks.names import MatrixLabel, monitor_tag, scalar_tag
from spectral_callbacks.offline.events import read_event_file
from spectral_callbacks.targets import find_targets

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "sharded_train.py"
SCHEDULED = [0, 1, 2, 4, 8, 10]  # sharded_train.py and the raw loop: 0, 1, 2, every 4, the last


def lightning_targets(tp: bool) -> list:
    sys.path.insert(0, str(SCRIPT.parent))
    from sharded_train import ShardedGPT

    return find_targets(ShardedGPT("neox" if tp else "gpt2", "tp" if tp else "fsdp", None, None))


def check_against_exact(scalars: dict, weights: dict, targets: list, k: int) -> None:
    """Every matrix's logged stable rank (1 %) and alpha (0.02) at every scheduled step."""
    assert len(targets) == 12
    for target in targets:
        stable_rank = scalars[scalar_tag("stable_rank", target.layer, target.role)]
        alpha = scalars[scalar_tag("alpha", target.layer, target.role)]
        assert sorted(stable_rank) == sorted(alpha) == SCHEDULED, target.name
        for step in SCHEDULED:
            truth = exact_metrics(weights[step][target.name], k)
            assert stable_rank[step] == pytest.approx(truth["stable_rank"], rel=0.01), (
                target.name,
                step,
            )
            assert alpha[step] == pytest.approx(truth["alpha"], abs=0.02), (target.name, step)
    assert set(scalars[monitor_tag("skipped")].values()) == {0.0}
    assert all(sent > 0 for sent in scalars[monitor_tag("sent_bytes")].values())


@pytest.mark.parametrize("tp", [False, True], ids=["fsdp2-gpt2", "tensor-parallel-neox"])
def test_model_parallel_strategy_logs_the_exact_spectra_of_the_full_weights(
    tmp_path: Path, tp: bool
) -> None:
    finished = run_script(tmp_path, *(["--tp"] if tp else []), script=SCRIPT)
    assert finished.returncode == 0, finished.stdout[-3000:]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    weights = torch.load(tmp_path / "weights.pt")
    targets = lightning_targets(tp)
    check_against_exact(scalars, weights, targets, k=8)
    # What a checkpoint keeps: every compression reference, the logged step-0 stable rank.
    state = torch.load(tmp_path / "monitor_state.pt")
    for target in targets:
        logged = scalars[scalar_tag("stable_rank", target.layer, target.role)]
        assert state["references"][target.name] == pytest.approx(logged[0], rel=1e-6)


def test_model_parallel_strategy_with_lora_logs_the_exact_spectra_of_the_effective_weights(
    tmp_path: Path,
) -> None:
    # fully_shard per block of a PEFT LoRA model in configure_model: every matrix's logged values
    # against float64 of W_0 + s B A (adapted) or W (frozen), gathered by full_tensor().
    finished = run_script(tmp_path, "--lora", script=SCRIPT)
    assert finished.returncode == 0, finished.stdout[-3000:]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    weights = torch.load(tmp_path / "weights.pt")
    sys.path.insert(0, str(SCRIPT.parent))
    from sharded_train import ShardedGPT

    targets = find_targets(ShardedGPT("lora", "fsdp", None, None))
    check_against_exact(scalars, weights, targets, k=8)
    adapted = [target for target in targets if target.has_update]
    assert len(adapted) == 8
    for target in adapted:  # the update family is logged too
        assert sorted(scalars[scalar_tag("update_stable_rank", target.layer, target.role)])


def test_a_resumed_model_parallel_run_keeps_every_compression_reference(tmp_path: Path) -> None:
    # Fit 6 steps with a checkpoint at step 6 (a distributed checkpoint directory: the sharded
    # weights in .distcp files, the callback states in rank 0's meta.pt), then resume it to
    # step 10 with `ckpt_path=`, logging into the same TensorBoard directory.
    first = run_script(tmp_path, "--steps", "6", "--checkpoint-every", "6", script=SCRIPT)
    assert first.returncode == 0, first.stdout[-3000:]
    checkpoint = tmp_path / "checkpoints" / "step=6.ckpt"
    assert (checkpoint / "meta.pt").is_file(), sorted(tmp_path.rglob("*"))
    resumed = run_script(
        tmp_path,
        "--steps",
        "10",
        "--resume",
        str(checkpoint),
        "--suffix",
        "_resumed",
        script=SCRIPT,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "no state to resume from" not in resumed.stdout  # the monitor's state was restored
    before, after = torch.load(tmp_path / "weights.pt"), torch.load(tmp_path / "weights_resumed.pt")
    points = logged_points(tmp_path / "tb" / "version_0")
    assert len(points) == len(set(points))  # no (tag, step) written twice over both fits
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    state = torch.load(tmp_path / "monitor_state_resumed.pt")
    targets = lightning_targets(tp=False)
    assert len(targets) == 12
    for target in targets:
        assert torch.equal(after[6][target.name], before[6][target.name])  # weights restored
        stable_rank = scalars[scalar_tag("stable_rank", target.layer, target.role)]
        compression = scalars[scalar_tag("compression", target.layer, target.role)]
        # The first fit snapshots 0, 1, 2, 4 and its last step 6; the resumed one 8 and 10 and
        # not step 6 again (a fresh reference would be taken there).
        assert sorted(stable_rank) == sorted(compression) == [0, 1, 2, 4, 6, 8, 10], target.name
        reference = exact_metrics(before[0][target.name], k=8)["stable_rank"]  # float64, step 0
        assert state["references"][target.name] == pytest.approx(reference, rel=0.01)
        assert state["reference_steps"][target.name] == 0
        for step in (8, 10):  # measured against step 0 of the first fit, not step 6
            truth = exact_metrics(after[step][target.name], k=8)["stable_rank"]
            assert stable_rank[step] == pytest.approx(truth, rel=0.01), (target.name, step)
            tolerance = 2 * truth / reference + 0.01  # 1 % on each stable rank, in points
            expected = 100 * (1 - truth / reference)
            assert compression[step] == pytest.approx(expected, abs=tolerance), (target.name, step)
            fresh = 100 * (1 - truth / exact_metrics(after[6][target.name], k=8)["stable_rank"])
            assert abs(compression[step] - fresh) > tolerance, (target.name, step)  # it can fail
    reference_steps = [
        tag for tag, _ in points if tag.startswith("spectral_monitor/reference_step")
    ]
    assert len(reference_steps) == 12  # set once per matrix, at step 0 of the first fit


def logged_points(logdir: Path) -> list[tuple[str, int]]:
    """Every (tag, step) written to ``logdir``'s event files, repeats kept (no reservoir)."""
    points = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        read, problem = read_event_file(path)
        assert problem is None, problem
        points += [(tag, step) for tag, step, _, _ in read]
    return points


def test_model_parallel_failure_on_one_rank_ends_every_rank(tmp_path: Path) -> None:
    # Bounded by run_script's timeout: a hang fails the test instead of blocking it.
    finished = run_script(tmp_path, "--fail-rank", "1", "--fail-step", "6", script=SCRIPT)
    assert finished.returncode != 0
    assert "planned failure on rank 1 at step 6" in finished.stdout
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    steps = {
        target.name: sorted(scalars[scalar_tag("stable_rank", target.layer, target.role)])
        for target in lightning_targets(tp=False)
    }
    # What finished before the failure is logged: the same steps for every matrix, a prefix of
    # the schedule up to step 4 (the last point before step 6), the reference step 0 included.
    (logged,) = {tuple(value) for value in steps.values()}
    assert 1 <= len(logged) <= 4 and list(logged) == SCHEDULED[: len(logged)], logged


def test_raw_loop_with_spectral_tracker_under_fully_shard(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(cases.tracked_training, 2, tmp_path, str(tmp_path / "tb"))
    assert rank1["state"]["references"] == rank0["state"]["references"]  # the same on every rank
    scalars = read_scalars(tmp_path / "tb")
    targets = [MatrixLabel(n, layer, r) for n, layer, r in rank0["targets"]]
    check_against_exact(scalars, rank0["weights"], targets, k=cases.K)


@pytest.mark.parametrize("fail_in", ["training", "svd"])
def test_raw_loop_failure_on_one_rank_ends_every_rank_with_an_error(
    tmp_path: Path, fail_in: str
) -> None:
    logdir = str(tmp_path / "tb")
    rank0, rank1 = run_ranks(
        cases.tracked_training, 2, tmp_path, logdir, 1, 8, fail_in, allow_errors=True
    )
    assert "planned failure on rank 1 at step 8" in rank1
    if fail_in == "svd":  # raised on the worker, re-raised on the training thread
        assert "ShardedEngineError: the sharded spectral engine failed at step 8" in rank1
    # Rank 0 ends with an error too (its next collective, training's or the SVD group's, fails
    # when the peer is gone), within run_ranks' timeout: not a hang.
    assert isinstance(rank0, str) and "Error" in rank0, rank0


def test_a_resumed_sharded_run_keeps_every_compression_reference(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(cases.resumed_training, 2, tmp_path, str(tmp_path))
    for name, saved in rank0["saved"].items():  # the checkpoint restored the trained weights
        assert torch.equal(rank0["loaded"][name], saved), name
    references = rank0["state0"]["references"]
    assert len(references) == 12
    for rank in (rank0, rank1):  # the same references on every rank, before and after resuming
        assert rank["state0"]["references"] == references
        assert rank["state1"]["references"] == references
    first, resumed = read_scalars(tmp_path / "tb0"), read_scalars(tmp_path / "tb1")
    for name, layer, role in rank0["targets"]:
        assert first[scalar_tag("stable_rank", layer, role)][0] == pytest.approx(references[name])
        stable_rank = resumed[scalar_tag("stable_rank", layer, role)]
        compression = resumed[scalar_tag("compression", layer, role)]
        assert sorted(stable_rank) == sorted(compression) == [8, 10], name  # none at 6 again
        for step, value in compression.items():  # measured against step 0 of the first run
            expected = 100 * (1 - stable_rank[step] / references[name])
            assert value == pytest.approx(expected, abs=1e-3), (name, step)


def test_the_hugging_face_callback_under_fully_shard_uses_the_sharded_engine(
    tmp_path: Path,
) -> None:
    rank0, rank1 = run_ranks(cases.hf_callback_under_fully_shard, 2, tmp_path, str(tmp_path))
    assert rank0["engine"] == rank1["engine"] == "ShardedEngine"
    scalars = read_scalars(tmp_path / "tb")
    for name, layer, role in rank0["targets"]:  # snapshots 0, 1, 2 and 4, the last
        stable_rank = scalars[scalar_tag("stable_rank", layer, role)]
        assert sorted(stable_rank) == [0, 1, 2, 4], name
        for step, value in stable_rank.items():
            truth = exact_metrics(rank0["weights"][step][name], cases.K)["stable_rank"]
            assert value == pytest.approx(truth, rel=0.01), (name, step)


def test_make_engine_picks_the_sharded_engine_for_dtensors_and_refuses_a_custom_compute(
    tmp_path: Path,
) -> None:
    import torch.distributed as dist
    from sharded_models import build, shard
    from tiny_models import exact_compute
    from torch.distributed.tensor import init_device_mesh

    from spectral_callbacks import SpectralTracker
    from spectral_callbacks.monitor.engines.protocol import Engine
    from spectral_callbacks.monitor.engines.sharded import ShardedEngine
    from spectral_callbacks.monitor.options import ConfigurationError

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        torch.manual_seed(0)
        model, _ = build("gpt2", d=64)
        shard(model, "fsdp", init_device_mesh("cpu", (1,)))  # a one-rank mesh: still DTensors
        with pytest.raises(ConfigurationError, match="`compute` cannot replace the SVD of sharded"):
            SpectralTracker(
                model, writers=[RecordingLogger()], compute=exact_compute, figures=False
            )
        with SpectralTracker(
            model, writers=[RecordingLogger()], k=4, figures=False, synchronous=True
        ) as tracker:
            engine = tracker._engine
            assert isinstance(engine, ShardedEngine) and isinstance(engine, Engine)
            assert engine.awaiting_results and engine.pending == 1 and engine.skipped == 0
            tracker.step(1)  # step 0's result is logged; step 1 is on the schedule
            assert engine.pending == 1
        assert len(tracker.state_dict()["references"]) == 12
    finally:
        dist.destroy_process_group()
