"""SpectralMonitor under several processes: real 2-process DDP on the CPU (gloo) through Lightning,
the cost partition, the result layout, the gather protocol, and the strategies it refuses.

The DDP runs launch ``tests/ddp_train.py`` in a subprocess (Lightning's ``strategy="ddp"`` re-runs
the script per rank), in their own session so a timeout kills every rank: a test never hangs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from sharded_models import exact_metrics
from spawn_ranks import run_session
from tiny_models import TinyGPT, exact_compute, exact_stable_rank, read_scalars

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.engines import distributed as multi
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import take_snapshot
from spectral_callbacks.names import monitor_tag, scalar_tag
from spectral_callbacks.targets import Target, find_targets

SCRIPT = Path(__file__).resolve().parents[1] / "ddp_train.py"
TIMEOUT_SECONDS = 180
SCHEDULED = [0, 1, 2, 4, 8, 12, 14]  # ddp_train.py: 0, 1, 2, every 4, and the last step (14)


def run_script(outdir: Path, *args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    """Run ``script`` (ddp_train.py); on timeout kill the whole process group (every rank), fail."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)  # never inherit a rank from an outer launcher
    return run_session([sys.executable, str(script), str(outdir), *args], TIMEOUT_SECONDS, env)


def tiny_targets() -> list:
    torch.manual_seed(0)
    return find_targets(TinyGPT(n_layer=2, n_embd=32, n_head=2))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict, list[dict]]:
    outdir = tmp_path_factory.mktemp("ddp")
    # max_pending 8: never a skip; delta="first": the update W_t - W_0 too
    finished = run_script(outdir, "--devices", "2", "--max-pending", "8", "--delta")
    assert finished.returncode == 0, finished.stdout[-3000:]
    weights = torch.load(outdir / "weights.pt")
    state = torch.load(outdir / "monitor_state.pt")
    held = [torch.load(outdir / f"references_rank{rank}.pt") for rank in (0, 1)]
    return read_scalars(outdir / "tb" / "version_0"), weights, state, held


# --- real 2-process DDP ---------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_logs_the_exact_stable_rank_of_every_matrix_at_every_scheduled_step(ddp_run) -> None:
    scalars, weights, _, _ = ddp_run
    targets = tiny_targets()
    assert len(targets) == 12
    for target in targets:
        logged = scalars[scalar_tag("stable_rank", target.layer, target.role, target.num_layers)]
        assert sorted(logged) == SCHEDULED, target.name
        for step, value in logged.items():
            # The single-process reference on the very weights DDP trained (rank 0's copy).
            expected = exact_stable_rank(weights[step][target.name])
            assert value == pytest.approx(expected, rel=0.01), (target.name, step)
        compression = scalars[scalar_tag("compression", target.layer, target.role)]
        assert compression[14] == pytest.approx(100 * (1 - logged[14] / logged[0]), abs=1e-3)


@pytest.mark.slow
def test_ddp_reads_the_roles_from_every_ranks_first_forward(tmp_path: Path) -> None:
    # before: no rule reads this model, so SpectralMonitor refused it at on_fit_start
    from unhelpful_model import Unhelpful

    finished = run_script(tmp_path, "--devices", "2", "--steps", "2", "--unhelpful")
    assert finished.returncode == 0, finished.stdout[-3000:]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    torch.manual_seed(0)
    initial = Unhelpful(vocab=256, layers=2)  # the script's model, built from the same seed
    found = find_targets(initial, example_input=torch.randint(0, 256, (1, 6)))
    assert len(found) == 14
    for target in found:
        tag = scalar_tag("stable_rank", target.layer, target.role)
        assert scalars[tag][0] == pytest.approx(exact_stable_rank(target.matrix()), rel=1e-4), tag
        assert set(scalars[tag]) == {0, 1, 2}


@pytest.mark.slow
def test_ddp_each_rank_computes_its_share_of_the_matrices(ddp_run) -> None:
    scalars, _, _, _ = ddp_run
    owners = multi.partition(tiny_targets(), world_size=2)
    for rank in (0, 1):
        matrices = scalars[monitor_tag(f"rank{rank}/matrices")]
        assert sorted(matrices) == SCHEDULED
        assert set(matrices.values()) == {float(owners.count(rank))}
        assert 0 < owners.count(rank) < len(owners)
        assert all(ms > 0 for ms in scalars[monitor_tag(f"rank{rank}/svd_ms")].values())
        assert set(scalars[monitor_tag(f"rank{rank}/skipped")].values()) == {0.0}
    # The aggregate is the slowest rank's time: a snapshot is done when every share is.
    for step, svd_ms in scalars[monitor_tag("svd_ms")].items():
        per_rank = [scalars[monitor_tag(f"rank{r}/svd_ms")][step] for r in (0, 1)]
        assert svd_ms == pytest.approx(max(per_rank))


@pytest.mark.slow
def test_each_ddp_rank_keeps_the_delta_references_of_its_own_share_only(ddp_run) -> None:
    _, weights, _, held = ddp_run
    targets = tiny_targets()
    owners = multi.partition(targets, world_size=2)
    for rank, references in enumerate(held):
        share = {t.name: t.shape for t, owner in zip(targets, owners, strict=True) if owner == rank}
        assert 0 < len(share) < len(targets)
        # exactly the references of the matrices this rank decomposes, whole, by name and bytes
        # (float32), which are copies of the weights the run started from
        assert {name: tuple(ref.shape) for name, ref in references.items()} == share, rank
        kept = sum(ref.numel() * ref.element_size() for ref in references.values())
        assert kept == sum(4 * m * n for m, n in share.values()), rank
        for name, reference in references.items():
            assert torch.equal(reference.double(), weights[0][name]), (rank, name)


@pytest.mark.slow
def test_ddp_logs_the_exact_update_of_every_matrix_from_the_share_of_references(ddp_run) -> None:
    scalars, weights, _, _ = ddp_run
    for target in tiny_targets():  # each matrix's update measured on the rank that holds W_0
        for metric in ("update_stable_rank", "update_spectral_norm"):
            logged = scalars[scalar_tag(metric, target.layer, target.role, target.num_layers)]
            assert sorted(logged) == SCHEDULED, (metric, target.name)
            for step in SCHEDULED[1:]:  # step 0: a zero update, no spectrum to compare
                value = logged[step]
                update = weights[step][target.name] - weights[0][target.name]
                truth = exact_metrics(update, 8)[metric.removeprefix("update_")]
                assert value == pytest.approx(truth, rel=1e-4), (metric, target.name, step)


@pytest.mark.slow
def test_ddp_rank_zero_state_holds_every_compression_reference(ddp_run) -> None:
    scalars, _, state, _ = ddp_run
    targets = tiny_targets()
    assert set(state["references"]) == {target.name for target in targets}
    for target in targets:  # the step-0 stable rank of every matrix, whichever rank computed it
        logged = scalars[scalar_tag("stable_rank", target.layer, target.role)]
        assert state["references"][target.name] == pytest.approx(logged[0], rel=1e-6)


@pytest.mark.slow
def test_ddp_failure_on_one_rank_ends_every_rank_and_rank_zero_keeps_what_it_has(
    tmp_path: Path,
) -> None:
    finished = run_script(tmp_path, "--devices", "2", "--fail-rank", "1", "--fail-step", "6")
    assert finished.returncode != 0
    assert "planned failure on rank 1 at step 6" in finished.stdout
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    targets = tiny_targets()
    owners = multi.partition(targets, world_size=2)
    for target, owner in zip(targets, owners, strict=True):
        steps = sorted(scalars[scalar_tag("stable_rank", target.layer, target.role)])
        # 0, 1, 2 were gathered from both ranks before the failure; step 4's rows never left
        # rank 1, so only rank 0's share of step 4 is logged (with a warning).
        assert steps == ([0, 1, 2, 4] if owner == 0 else [0, 1, 2]), target.name
    assert "only rank 0's share of the matrices" in finished.stdout


# --- the pieces, in one process -------------------------------------------------------------


def diagonal(second: float) -> torch.Tensor:
    matrix = torch.zeros(4, 3)
    matrix[0, 0], matrix[1, 1] = 1.0, second
    return matrix


def test_partition_balances_cost_and_is_deterministic() -> None:
    shapes = [(96, 32)] * 3 + [(32, 32)] * 9 + [(128, 32)] * 2
    targets = [SimpleNamespace(name=f"w{i}", shape=shape) for i, shape in enumerate(shapes)]
    for world_size in (1, 2, 3, 4):
        owners = multi.partition(targets, world_size)
        assert owners == multi.partition(targets, world_size)
        assert set(owners) == set(range(world_size))
        loads = [
            sum(multi.matrix_cost(t.shape) for t, o in zip(targets, owners, strict=True) if o == r)
            for r in range(world_size)
        ]
        # LPT: no rank exceeds the lightest by more than one matrix's cost.
        assert max(loads) - min(loads) <= max(multi.matrix_cost(s) for s in shapes)
    assert multi.partition(targets[:1], 3) == [0]  # more ranks than matrices: some idle
    with pytest.raises(ValueError, match="`world_size` must be a positive int, got 0"):
        multi.partition(targets, 0)


def test_layout_round_trip_keeps_nan_and_leaves_out_what_is_absent() -> None:
    layout = multi.ResultLayout(["a", "b", "c"], ("stable_rank", "energy_rank_90"), world_size=3)
    parts = [
        layout.pack(0, {"a": {"stable_rank": 2.5, "energy_rank_90": math.nan}}, {"matrices": 1}),
        layout.pack(1, {"b": {"stable_rank": 7.0}}, {"svd_ms": 3.0, "skipped": 2}),
        layout.pack(2, None, {"skipped": 1}),  # its result was late: nothing present
    ]
    metrics, health = layout.unpack(sum(parts))
    assert metrics["a"]["stable_rank"] == 2.5 and math.isnan(metrics["a"]["energy_rank_90"])
    assert metrics["b"] == {"stable_rank": 7.0}
    assert "c" not in metrics
    assert [row["skipped"] for row in health] == [0.0, 2.0, 1.0]
    assert health[1]["svd_ms"] == 3.0 and health[0]["matrices"] == 1.0


def _wait_computed(engine: multi.DistributedEngine, step: int) -> None:
    deadline = time.monotonic() + 30
    while step not in engine._done and time.monotonic() < deadline:
        engine._harvest(wait_seconds=0.05)


def test_engine_sends_each_result_at_the_next_point_and_a_late_one_as_missing(
    tmp_path: Path,
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        # diag(1, 1/(i+1)): stable rank 1 + 1/(i+1)^2, a different known answer per matrix.
        targets = [
            Target.from_parameter(f"w{i}", diagonal(1 / (i + 1)), role="Q") for i in range(3)
        ]
        slow = {"on": False}

        def compute(group, batch):
            if slow["on"]:
                time.sleep(0.3)  # keep the worker busy past the due wait
            return exact_compute(group, batch)

        engine = multi.DistributedEngine(
            compute,
            targets,
            ("stable_rank",),
            MonitorOptions(),
            rank=0,
            world_size=1,
            group=dist.group.WORLD,
        )
        assert engine.lag == 1
        assert engine.submit(take_snapshot(engine.groups.values(), 0))
        assert engine.collect(wait_seconds=0.5) == []  # nothing is sent before the next point
        _wait_computed(engine, 0)  # points never wait for a result: let it finish first
        engine.submit(take_snapshot(engine.groups.values(), 1))  # sends step 0
        (first,) = engine.collect(wait_seconds=5)
        assert first.step == 0
        ranks = {name: row["stable_rank"] for name, row in first.metrics.items()}
        assert ranks == pytest.approx({"w0": 2.0, "w1": 1.25, "w2": 1 + 1 / 9})
        assert first.rank_scalars[monitor_tag("rank0/matrices")] == 3.0
        _wait_computed(engine, 1)  # step 1 is computed...
        slow["on"] = True
        engine.submit(take_snapshot(engine.groups.values(), 2))  # ...and sent, without a wait
        engine.flush(deadline=0.0)  # step 2 is still computing: sent as missing
        results = engine.collect(wait_seconds=5)
        assert [r.step for r in results] == [1, 2]
        assert results[1].metrics == {} and engine.skipped == 1
        assert results[1].rank_scalars[monitor_tag("skipped")] == 1.0
        deadline = time.monotonic() + 5
        while engine.pending and time.monotonic() < deadline:  # the late result comes back...
            engine.collect(wait_seconds=0.05)
        assert engine.pending == 0 and engine.collect() == []
        assert not engine._done and not engine._late  # ...and is dropped, not kept forever
        engine.close()
    finally:
        dist.destroy_process_group()


def test_fsdp1_and_model_parallel_are_accepted_at_setup() -> None:
    fsdp = SimpleNamespace(strategy=FSDPStrategy(), world_size=2, loggers=[object()])
    SpectralMonitor().setup(fsdp, TinyGPT(), "fit")  # FSDP1: gathered unit by unit
    sharded = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=2, loggers=[object()])
    SpectralMonitor().setup(sharded, TinyGPT(), "fit")  # FSDP2 / tensor parallel DTensors
    with pytest.raises(MisconfigurationException, match="`max_overhead` is not supported with 2"):
        SpectralMonitor(max_overhead=0.01).setup(sharded, TinyGPT(), "fit")


def test_budget_mode_and_non_ddp_multi_process_strategies_are_refused() -> None:
    ddp = SimpleNamespace(strategy=DDPStrategy(), world_size=2, loggers=[object()])
    with pytest.raises(MisconfigurationException, match="`max_overhead` is not supported with 2"):
        SpectralMonitor(max_overhead=0.01).setup(ddp, TinyGPT(), "fit")
    SpectralMonitor().setup(ddp, TinyGPT(), "fit")  # plain DDP is supported
    other = SimpleNamespace(strategy=object(), world_size=4, loggers=[object()])
    with pytest.raises(MisconfigurationException, match="does not support object with 4 processes"):
        SpectralMonitor().setup(other, TinyGPT(), "fit")


def test_a_scheduled_point_never_waits_for_a_result_on_the_training_thread(
    tmp_path: Path,
) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    release = threading.Event()
    try:
        targets = [Target.from_parameter("w", diagonal(0.5), role="Q")]

        def blocked(group, batch):
            release.wait(timeout=30)
            return exact_compute(group, batch)

        engine = multi.DistributedEngine(
            blocked,
            targets,
            ("stable_rank",),
            MonitorOptions(),
            rank=0,
            world_size=1,
            group=dist.group.WORLD,
        )
        waits: list[float] = []
        local_collect = engine._local.collect

        def recording_collect(wait_seconds: float = 0.0):
            waits.append(wait_seconds)
            return local_collect(wait_seconds)

        engine._local.collect = recording_collect  # type: ignore[method-assign]
        release.set()  # the first snapshot (compression's reference) is awaited, bounded: let it be
        engine.submit(take_snapshot(engine.groups.values(), 0))
        _wait_computed(engine, 0)
        release.clear()
        engine.submit(take_snapshot(engine.groups.values(), 1))  # sends step 0
        waits.clear()
        engine.submit(take_snapshot(engine.groups.values(), 2))  # step 1 still computing
        assert waits and max(waits) == 0.0  # polled, never waited on
        assert engine.missed == 1  # sent as missing instead
        release.set()
        engine.flush(deadline=time.monotonic() + 10)
        deadline = time.monotonic() + 10
        while engine.pending and time.monotonic() < deadline:
            engine.collect(wait_seconds=0.05)
        engine.close()
    finally:
        release.set()
        dist.destroy_process_group()


def _slow_first_snapshot(rank: int, world_size: int) -> dict:
    """Each rank's share of three matrices, its first snapshot 1.5 s to compute (a cold start)
    and the next ones instant, at points that follow each other at once (the shortest steps)."""
    targets = [Target.from_parameter(f"w{i}", diagonal(1 / (i + 1)), role="Q") for i in range(3)]
    calls = {"n": 0}

    def compute(group, batch):
        calls["n"] += 1
        if calls["n"] == 1:
            time.sleep(1.5)
        return exact_compute(group, batch)

    engine = multi.DistributedEngine(
        compute, targets, ("stable_rank",), MonitorOptions(), rank=rank, world_size=world_size,
        group=multi.results_group(60),
    )  # fmt: skip
    started = time.monotonic()
    for step in range(3):
        engine.submit(take_snapshot(engine.groups.values(), step))
    engine.flush(deadline=time.monotonic() + 30)
    results = []
    deadline = time.monotonic() + 30
    while engine.pending and time.monotonic() < deadline:
        results += engine.collect(wait_seconds=0.05)
    engine.close()
    return {
        "steps": {r.step: sorted(r.metrics) for r in results},
        "stable_rank": {r.step: r.metrics.get("w1", {}).get("stable_rank") for r in results},
        "missed": engine.missed,
        "seconds": time.monotonic() - started,
    }


def test_ddp_keeps_the_first_snapshot_compressions_reference_when_it_is_slow(
    tmp_path: Path,
) -> None:
    from spawn_ranks import run_ranks

    rank0, rank1 = run_ranks(_slow_first_snapshot, 2, tmp_path)
    # Step 0 was sent at step 1's point, before it was done: awaited (bounded), not dropped.
    assert rank0["steps"][0] == ["w0", "w1", "w2"]
    assert rank0["stable_rank"][0] == pytest.approx(1.25)
    # Only the first point waits: step 1, sent at once at step 2's point, may still be missing.
    assert rank1["steps"] == {} and rank0["missed"] <= 1 and rank1["missed"] <= 1
    assert rank0["seconds"] < multi.FIRST_DUE_WAIT_SECONDS
