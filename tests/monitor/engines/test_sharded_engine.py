"""ShardedEngine on 2 gloo processes: raw training loops with FSDP2 ``fully_shard`` and with tensor
parallel ``parallelize_module``, fused and separate Q/K/V, against the float64 SVD of the full
weights (``full_tensor()``, recorded at every scheduled step); the largest tensor it creates; a
failing rank and a rank that falls behind."""

from __future__ import annotations

import math
from importlib import metadata

import pytest
import sharded_engine_cases as cases
import torch
import torch.distributed as dist
from sharded_models import exact_metrics
from spawn_ranks import run_ranks

from spectral_callbacks.functional import metrics_from_spectrum, spectral_metrics

CASES = ["fsdp-gpt2", "fsdp-nanogpt", "fsdp-llama", "tp-neox", "tp-llama"]
pytestmark = pytest.mark.slow


def exact(matrix: torch.Tensor) -> dict[str, float]:
    return exact_metrics(matrix, cases.K)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(cases.train_all, 2, tmp_path_factory.mktemp("train"))


@pytest.mark.parametrize("case", CASES)
def test_every_matrix_at_every_scheduled_step_matches_the_exact_svd(runs, case: str) -> None:
    rank0, rank1 = runs[0][case], runs[1][case]
    weights = rank0["weights"]
    assert sorted(weights) == cases.SCHEDULED
    steps = [step for step, _, _ in rank0["results"]]
    assert steps == cases.SCHEDULED  # every snapshot computed, none skipped, in order
    names = [name for name, _, _ in rank0["targets"]]
    assert len(names) == 12
    for (step, metrics, _), (step1, metrics1, _) in zip(
        rank0["results"], rank1["results"], strict=True
    ):
        assert step == step1
        assert metrics == metrics1 or _same(metrics, metrics1)  # every rank has every value
        assert sorted(metrics) == sorted(names)
        for name in names:
            full = weights[step][name]
            expected = exact(full)
            got = metrics[name]
            assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01), (
                name,
                step,
            )
            assert got["alpha"] == pytest.approx(expected["alpha"], abs=0.02), (name, step)
            assert got["frobenius_norm"] == pytest.approx(expected["frobenius_norm"], rel=1e-6)
            # ... and the same as one unsharded process computes on the same weights.
            single = spectral_metrics(full.float(), k=cases.K)
            assert got["stable_rank"] == pytest.approx(float(single["stable_rank"]), rel=0.01)


def _same(a: dict, b: dict) -> bool:
    return all(
        math.isclose(a[n][m], b[n][m], rel_tol=1e-6)
        or (math.isnan(a[n][m]) and math.isnan(b[n][m]))
        for n in a
        for m in a[n]
    )


def test_training_moved_the_spectra(runs) -> None:
    for case in CASES:
        results = runs[0][case]["results"]
        first, last = results[0][1], results[-1][1]
        moved = [abs(last[n]["stable_rank"] / first[n]["stable_rank"] - 1) for n in first]
        assert max(moved) > 0.01, case  # the test compares real, changing weights


@pytest.mark.parametrize(
    ("case", "splits"),
    [
        # GPT-2's Conv1D is stored (in, out): FSDP's Shard(0) splits every matrix by columns.
        ("fsdp-gpt2", {"columns"}),
        ("fsdp-nanogpt", {"rows"}),
        # Column-parallel Q/K/V/up by rows, row-parallel O/down by columns.
        ("tp-neox", {"rows", "columns"}),
    ],
)
def test_each_layout_is_split_where_its_shards_are(runs, case: str, splits: set) -> None:
    found = runs[0][case]["splits"]
    assert set(found.values()) == splits
    if case == "tp-neox":
        assert found["layers.0.attention.query_key_value.weight[Q]"] == "rows"
        assert found["layers.0.attention.dense.weight"] == "columns"


def test_a_fused_shard_without_a_role_takes_part_with_an_empty_block(runs) -> None:
    # nanoGPT's c_attn rows [q; k; v] (384 x 128), Shard(0): rank 0 holds Q and half of K,
    # rank 1 the other half of K and V.
    rows0, rows1 = runs[0]["fsdp-nanogpt"]["rows"], runs[1]["fsdp-nanogpt"]["rows"]
    name = "transformer.h.0.attn.c_attn.weight[{}]"
    assert (rows0[name.format("Q")], rows1[name.format("Q")]) == (128, 0)
    assert (rows0[name.format("K")], rows1[name.format("K")]) == (64, 64)
    assert (rows0[name.format("V")], rows1[name.format("V")]) == (0, 128)
    # GPT-NeoX per-head layout under column parallelism: each rank holds whole heads of all three.
    rows = runs[1]["tp-neox"]["rows"]
    assert rows["layers.0.attention.query_key_value.weight[K]"] == 64


def test_communication_per_snapshot_is_a_fraction_of_the_matrices(runs) -> None:
    for case in CASES:
        watched = sum(m * n * 4 for _, _, (m, n) in runs[0][case]["targets"])
        for _, _, sent in runs[0][case]["results"]:
            assert 0 < sent < watched, case


def test_no_rank_creates_a_full_watched_matrix(tmp_path) -> None:
    for found in run_ranks(cases.largest_tensors, 2, tmp_path):
        for (m, n), seen in found.items():
            assert seen["matrix_numel"] < m * n, (m, n)
            assert seen["matrix_numel"] >= m * n // 2  # the copy of its half was seen: it tracks
            assert all(math.isfinite(v["stable_rank"]) for v in seen["metrics"].values())


def test_an_error_on_one_rank_ends_every_rank_within_the_group_timeout(tmp_path) -> None:
    rank0, rank1 = run_ranks(cases.failing_rank, 2, tmp_path)
    assert "planned failure on rank 1" in rank1["error"]
    assert rank0["error"] is not None and "failed at step" in rank0["error"]
    # The peer's worker fails when its collective times out (5 s) or the connection drops.
    assert rank0["seconds"] < 60 and rank1["seconds"] < 60


def test_a_rank_that_falls_behind_raises_instead_of_waiting(tmp_path) -> None:
    for outcome in run_ranks(cases.falling_behind, 2, tmp_path):
        assert outcome["error"] is not None and "fell behind" in outcome["error"]
        assert "1 snapshot was still not decomposed" in outcome["error"]  # max_pending=1


def test_placements_uneven_replicated_and_per_head_fused(tmp_path) -> None:
    from spectral_callbacks.targets import Rows

    rank0, rank1 = run_ranks(cases.placements, 2, tmp_path)
    full = rank0["full"].double()
    expected = exact(full)
    for name in (
        "shard0",
        "shard1",
        "replicate",
        "replicate_dp_shard1_tp",
        "shard0_dp_replicate_tp",
    ):
        for rank in (rank0, rank1):  # a replicated block is counted once, not once per rank
            got = rank["metrics"][name]
            assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01), name
            assert got["frobenius_norm"] == pytest.approx(expected["frobenius_norm"], rel=1e-6)
    assert [rank0["pieces"]["shard0"], rank1["pieces"]["shard0"]] == [("rows", 75), ("rows", 75)]
    assert [rank0["pieces"]["shard1"], rank1["pieces"]["shard1"]] == [("columns", 48)] * 2
    assert [rank0["pieces"]["replicate"], rank1["pieces"]["replicate"]] == [
        ("rows", 150),
        ("rows", 0),
    ]
    assert rank1["pieces"]["replicate_dp_shard1_tp"] == ("columns", 0)
    for index, role in enumerate("QKV"):
        part = Rows(start=10 * index, stop=10 * (index + 1), groups=5).take(full)
        got = rank1["metrics"][f"fused[{role}]"]
        assert got["stable_rank"] == pytest.approx(exact(part)["stable_rank"], rel=0.01), role
    # 150 rows = 5 heads of 30 over 2 ranks (rows 0-74, 75-149): K is rows 10-19 of each head,
    # so rank 0 holds 10-19, 40-49, 70-74 and rank 1 75-79, 100-109, 130-139 (head 2 is cut).
    assert (rank0["pieces"]["fused[K]"], rank1["pieces"]["fused[K]"]) == (
        ("rows", 25),
        ("rows", 25),
    )
    assert rank1["pieces"]["shard0_dp_shard1_tp"] == ("tiles", 75)


def test_fsdp_over_tensor_parallel_on_a_2d_mesh(tmp_path) -> None:
    ranks = run_ranks(cases.fsdp_over_tp, 4, tmp_path, timeout=400)
    full = ranks[0]["full"].double()
    expected = exact(full)
    for rank in ranks:  # hand-made tiles, both orientations
        for S, frobenius_sq in (rank["tile"], rank["wide"]):
            got = {k: float(v) for k, v in metrics_from_spectrum(S, frobenius_sq).items()}
            assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01)
            assert got["alpha"] == pytest.approx(expected["alpha"], abs=0.02)
    # Column-parallel weights are rows under FSDP2 over TP (both shard dim 0); row-parallel ones
    # are tiles (FSDP2 shards dim 0, TP dim 1).
    splits = ranks[0]["splits"]
    assert splits["layers.0.attention.q_proj.weight"] == "rows"
    assert splits["layers.0.attention.o_proj.weight"] == "tiles"
    assert splits["layers.0.mlp.down_proj.weight"] == "tiles"
    weights = ranks[0]["weights"]
    assert [step for step, _ in ranks[0]["results"]] == [0, 1, 2, 3, 4]
    for rank in ranks:
        for step, metrics in rank["results"]:
            assert len(metrics) == 12
            for name, got in metrics.items():
                truth = exact(weights[step][name])
                assert got["stable_rank"] == pytest.approx(truth["stable_rank"], rel=0.01), name
                assert got["alpha"] == pytest.approx(truth["alpha"], abs=0.02), name


def test_bad_arguments_are_refused_before_any_work(tmp_path) -> None:
    from spectral_callbacks.monitor.engines.sharded import svd_group
    from spectral_callbacks.targets import Target

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        group = svd_group(timeout_seconds=30)
        targets = [Target.from_parameter("w", torch.eye(4), role="O")]
        with pytest.raises(ValueError, match="`k` must be a positive int, got 0"):
            cases.sharded_engine(targets, group=group, k=0)
        with pytest.raises(ValueError, match="`max_pending` must be a positive int, got 0"):
            cases.sharded_engine(targets, group=group, max_pending=0)
        with pytest.raises(ValueError, match="`behind_timeout` must be positive"):
            cases.sharded_engine(targets, group=group, behind_timeout=0)
        with pytest.raises(ValueError, match="`targets` is empty"):
            cases.sharded_engine([], group=group)
        engine = cases.sharded_engine(
            targets, group=group, k=2
        )  # a one-rank group: the plain problem
        engine.offer(3)
        (result,) = cases.drain(engine, 3, timeout=30)
        assert result.step == 3 and result.metrics["w"]["stable_rank"] == pytest.approx(4.0)
        engine.close()
    finally:
        dist.destroy_process_group()


def test_scattered_rows_are_gathered_with_indices_already_on_the_device(tmp_path) -> None:
    # Moving a CPU index tensor to the device inside offer() was a host-to-device copy (a sync)
    # on the training thread at every snapshot of a GPT-NeoX query_key_value or an MLA split.
    for outcome in run_ranks(cases.indices_on_the_device, 2, tmp_path):
        assert outcome["is_tensor"] and outcome["same_device"]
        assert outcome["moves"] == []  # block() moves nothing between devices
        expected = outcome["local"].index_select(0, outcome["select"])
        assert torch.equal(outcome["block"], expected) and len(expected) == 25


@pytest.mark.skipif(
    int(metadata.version("transformers").split(".")[0]) < 5,
    reason="Qwen3-MoE's experts as 3-D tensors: needs transformers 5.0",
)
def test_each_expert_of_a_fully_sharded_moe_matches_float64(tmp_path) -> None:
    # Qwen3-MoE's (E, 2I, H) / (E, H, I) experts tensors, Shard(0) over 2 ranks: 3 experts, 2 and 1.
    ranks = run_ranks(cases.moe_experts, 2, tmp_path)
    for outcome in ranks:
        held = {name: rows for name, rows in outcome["rows"].items() if rows}
        assert held  # each rank holds whole experts, and only those
        assert all(rows in (8, 16, 32) for rows in held.values())
    assert set(ranks[0]["rows"]) == set(ranks[1]["rows"])
    assert all(bool(ranks[0]["rows"][n]) != bool(ranks[1]["rows"][n]) for n in ranks[0]["rows"])
    results, weights = ranks[0]["results"], ranks[0]["weights"]
    assert [step for step, _ in results] == [0, 2]
    other = ranks[1]["results"][0][1]  # every rank has every expert's values
    assert {n: m["stable_rank"] for n, m in results[0][1].items()} == {
        n: m["stable_rank"] for n, m in other.items()
    }
    assert len(weights[0]) == 2 * 3 * 3  # 2 layers x 3 experts x (gate, up, down)
    for step, metrics in results:
        for name, matrix in weights[step].items():
            expected = exact(matrix)["stable_rank"]
            assert metrics[name]["stable_rank"] == pytest.approx(expected, rel=0.01), (step, name)
    moved = [weights[2][name] - weights[0][name] for name in weights[0]]
    assert all(float(delta.abs().max()) > 0 for delta in moved)
