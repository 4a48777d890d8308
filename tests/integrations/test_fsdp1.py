"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``, one unit per GPT-2 block) in a raw
loop with SpectralTracker, on 2 and on 4 CPU processes with gloo (and, ``gpu``-marked, 2 and 4 GPUs
with NCCL): each snapshot gathers one unit at a time with FSDP1's own ``summon_full_params``, and
every logged value equals a float64 SVD of the full matrix that the test gathers with the same
public API, at every scheduled step; the same values as the unwrapped model in one process; within
a budget that holds one unit, the allocations of each snapshot measured; resumed with the step-0
references; each rank keeping the ``delta=`` references of the matrices it decomposes only; with
PEFT LoRA adapters, every effective matrix ``W_0 + s B A`` and its update exact too; a linear layer
inside a block held by the root unit around the module given refused in one line.

Every check of one process count reads one group of ranks (``partitioned_cases.fsdp1_runs``): a
spawn costs more than the runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import partitioned_cases as cases
import pytest
from sharded_models import exact_metrics
from spawn_ranks import backend_params, run_ranks
from tiny_models import read_scalars

from spectral_callbacks.monitor.engines.distributed import partition
from spectral_callbacks.names import monitor_tag, scalar_tag

pytestmark = pytest.mark.slow
SCHEDULED = [0, 1, 2, 4, 8, 10]
ROLES = ("Q", "K", "V", "O", "MLP_up", "MLP_down")


@pytest.fixture(scope="module", params=backend_params(gloo=(2, 4)))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    backend, world_size = request.param
    outdir = tmp_path_factory.mktemp(f"fsdp1-{backend}-{world_size}")
    ranks = run_ranks(
        cases.fsdp1_runs, world_size, outdir, str(outdir), backend=backend, timeout=300
    )
    cases.single_process_run(str(outdir))
    return {"outdir": outdir, "ranks": ranks}


def test_fsdp1_logs_the_exact_spectrum_and_update_of_every_gathered_matrix(runs: dict) -> None:
    scalars = read_scalars(runs["outdir"] / "fsdp1")
    rank0 = runs["ranks"][0]["fsdp1"]
    weights, targets = rank0["weights"], rank0["targets"]
    assert len(targets) == 12
    for layer, role in targets:
        for metric in (
            "stable_rank",
            "spectral_norm",
            "update_stable_rank",
            "update_spectral_norm",
        ):
            logged = scalars[scalar_tag(metric, layer, role)]
            assert sorted(logged) == SCHEDULED, (metric, layer, role)
            for step in SCHEDULED:
                matrix = weights[step][layer, role]
                if metric.startswith("update_"):  # delta="first": W_t - W_0, W_0 gathered too
                    matrix = matrix - weights[0][layer, role]
                    if step == 0:
                        continue  # a zero update: no spectrum to compare
                truth = exact_metrics(matrix, cases.K)[metric.removeprefix("update_")]
                assert logged[step] == pytest.approx(truth, rel=1e-4), (metric, layer, role, step)
    assert set(scalars[monitor_tag("skipped")].values()) == {0.0}


def test_fsdp1_lora_logs_the_exact_spectrum_and_update_of_every_effective_matrix(
    runs: dict,
) -> None:
    scalars = read_scalars(runs["outdir"] / "lora")
    rank0 = runs["ranks"][0]["lora"]
    weights, targets, adapted = rank0["weights"], rank0["targets"], rank0["adapted"]
    assert len(targets) == 12 and len(adapted) == 10  # Q, K, V, O, down adapted; up dense
    for layer, role in targets:
        metrics = ["stable_rank", "spectral_norm"]
        if (layer, role) in adapted:
            metrics += ["update_stable_rank", "update_spectral_norm", "update_frobenius_norm"]
        else:
            assert scalar_tag("update_stable_rank", layer, role) not in scalars
        for metric in metrics:
            logged = scalars[scalar_tag(metric, layer, role)]
            assert sorted(logged) == SCHEDULED, (metric, layer, role)
            for step in SCHEDULED:
                seen = weights[step][layer, role]
                matrix = seen["update"] if metric.startswith("update_") else seen["weight"]
                truth = exact_metrics(matrix, cases.K)[metric.removeprefix("update_")]
                assert logged[step] == pytest.approx(truth, rel=1e-4), (metric, layer, role, step)
        if (layer, role) in adapted:  # the adapter trained: the update moved
            assert weights[10][layer, role]["update"].ne(weights[0][layer, role]["update"]).any()
    assert set(scalars[monitor_tag("skipped")].values()) == {0.0}


def test_fsdp1_lora_snapshots_count_the_base_they_copy_inside_the_gather(runs: dict) -> None:
    for rank in runs["ranks"]:
        for counted, (m, n), size in rank["lora"]["adapted"].values():
            # the base (whole only in the gather, so copied) and the factors s B and A
            assert counted == (m * n + m * cases.R + cases.R * n) * size


def test_fsdp1_logs_what_the_unwrapped_model_logs(runs: dict) -> None:
    fsdp1 = read_scalars(runs["outdir"] / "fsdp1")
    single = read_scalars(runs["outdir"] / "single")
    spectral = [tag for tag in single if tag.startswith("spectral_") and "monitor" not in tag]
    assert len(spectral) > 12 * 4
    for tag in spectral:
        assert sorted(fsdp1[tag]) == sorted(single[tag]), tag
        for step, value in single[tag].items():
            assert fsdp1[tag][step] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), tag


def test_fsdp1_snapshots_within_a_budget_that_holds_one_gathered_unit(runs: dict) -> None:
    for rank in runs["ranks"]:
        # The run above went on within the larger of the ranks' needs; one byte less is refused.
        assert rank["budget"] >= rank["need"]
        assert "of them one gathered unit" in rank["too_small"], rank["too_small"]
        assert rank["too_small"].startswith("`max_snapshot_bytes` (")


def test_fsdp1_snapshots_allocate_at_most_the_budget_on_every_rank(runs: dict) -> None:
    # The same run inline (synchronous=True), each tracker.step measured by the allocator:
    # the gathers, the copies and the SVD of the snapshot each scheduled step takes.
    measured = [0, 1, 2, 4]  # step 0 is taken by the tracker's construction, unmeasured
    for rank in runs["ranks"]:
        peaks = rank["memory"]["peaks"]
        print("peaks", peaks, "unit", rank["unit"], "budget", rank["budget"])  # shown with -s
        for step in measured[1:]:
            # The measure sees the gathers: one unit is whole at once on this rank ...
            assert peaks[step] >= rank["unit"], (step, peaks[step], rank["unit"])
            # ... and never more than the budget the run was given.
            assert peaks[step] <= rank["budget"], (step, peaks[step], rank["budget"])


def test_a_resumed_fsdp1_run_keeps_the_step_0_compression_references(runs: dict) -> None:
    first = read_scalars(runs["outdir"] / "first")
    resumed = read_scalars(runs["outdir"] / "resumed")
    rank0 = runs["ranks"][0]
    references = rank0["resumed"]["state"]["references"]
    assert references == rank0["first"]["state"]["references"]
    weights = rank0["resumed"]["weights"]
    for layer, role in rank0["resumed"]["targets"]:
        step0 = first[scalar_tag("stable_rank", layer, role)][0]
        assert sorted(resumed[scalar_tag("compression", layer, role)]) == [8, 10]
        truth = exact_metrics(weights[10][layer, role], cases.K)["stable_rank"]
        expected = 100 * (1 - truth / step0)
        logged = resumed[scalar_tag("compression", layer, role)][10]
        assert logged == pytest.approx(expected, rel=1e-3, abs=1e-3), (layer, role)


def _shares(shapes: list[Any], world_size: int) -> list[dict[str, int]]:
    """Each rank's share of the watched matrices, by name, with their bytes: the partition the
    engine splits the SVD work by."""
    owners = partition([SimpleNamespace(shape=shape) for _, shape, _ in shapes], world_size)
    shares: list[dict[str, int]] = [{} for _ in range(world_size)]
    for (name, (m, n), size), owner in zip(shapes, owners, strict=True):
        shares[owner][name] = m * n * size
    return shares


@pytest.mark.parametrize("run", ["fsdp1", "first", "resumed"])
def test_each_fsdp1_rank_keeps_the_delta_references_of_its_own_share_only(
    runs: dict, run: str
) -> None:
    ranks = [rank[run] for rank in runs["ranks"]]
    shapes = ranks[0]["shapes"]
    shares = _shares(shapes, len(ranks))
    scalars = read_scalars(runs["outdir"] / run)
    watched = sum(m * n * size for _, (m, n), size in shapes)
    for rank, (found, share) in enumerate(zip(ranks, shares, strict=True)):
        assert found["shapes"] == shapes  # the same targets, in the same order, on every rank
        assert 0 < sum(share.values()) < watched
        # exactly the references of the matrices this rank decomposes, each a whole matrix ...
        assert found["references"] == share, rank
        # ... which are the matrices its engine decomposed at every snapshot (a new run and a
        # resumed one alike)
        counted = scalars[monitor_tag(f"rank{rank}/matrices")]
        assert set(counted.values()) == {float(len(share))}, (rank, counted)
    assert sorted(name for share in shares for name in share) == sorted(n for n, _, _ in shapes)


def test_a_resumed_fsdp1_run_measures_delta_from_the_weights_it_resumed_from(runs: dict) -> None:
    resumed = read_scalars(runs["outdir"] / "resumed")
    rank0 = runs["ranks"][0]["resumed"]
    weights = rank0["weights"]
    for layer, role in rank0["targets"]:
        for metric in ("update_stable_rank", "update_spectral_norm"):
            logged = resumed[scalar_tag(metric, layer, role)]
            assert sorted(logged) == [8, 10], (metric, layer, role)
            for step in (8, 10):
                update = weights[step][layer, role] - weights[6][layer, role]
                truth = exact_metrics(update, cases.K)[metric.removeprefix("update_")]
                assert logged[step] == pytest.approx(truth, rel=1e-4), (metric, layer, role, step)


def test_fsdp1_wrappings_that_cannot_be_gathered_are_refused_in_one_line(runs: dict) -> None:
    said = runs["ranks"][0]["refusals"]
    assert said["wrapper, use_orig_params=True"] == "accepted"
    for held in ("wrapper", "inside"):
        message = said[f"{held}, use_orig_params=False"]
        assert message.startswith("SpectralTracker cannot watch a model trained with FSDP1"), (
            message
        )
        assert "use_orig_params=True" in message and "\n" not in message
    assert said["inside, use_orig_params=True"].endswith("pass the wrapper")


def test_matrices_held_by_the_root_unit_around_the_model_given_are_refused_in_one_line(
    runs: dict,
) -> None:
    # Lightning's FSDPStrategy and the Hugging Face Trainer hand their callbacks the module inside
    # FSDP1's root wrapper: the root's own parameters can never be gathered from there.
    said = runs["ranks"][0]["outer_unit"]
    every = sorted((layer, role) for layer in (0, 1) for role in ROLES)
    # blocks in units of their own (the root holds only embeddings and the final norm)
    assert said["GPT2Block", "inside"] == said["GPT2Block", "wrapper"] == every
    # only attention wrapped: the root holds the MLP's matrices; the wrapper gathers them
    assert said["GPT2Attention", "wrapper"] == every
    message = said["GPT2Attention", "inside"]
    assert message.startswith("SpectralTracker cannot watch a model trained with FSDP1"), message
    assert "4 linear weights inside its blocks (transformer.h.0.mlp.c_fc.weight" in message
    assert "FSDPStrategy(auto_wrap_policy={Block})" in message and "\n" not in message
