"""Sharded weights with an update, on 2 gloo processes: FSDP2 (``fully_shard``) and tensor
parallelism (``parallelize_module``) x {dense, PEFT LoRA, DoRA, ``delta="first"``}, each through
``SpectralTracker`` in a raw loop. Every logged value at every scheduled step against the float64
SVD of the whole effective matrix (and of its update) formed in the test from ``full_tensor()``,
and against what one unsharded process computes from the same matrices; what a rank sends; a
resume keeps the step-0 references; what is refused is refused in one line. The same on 4 gloo
processes (FSDP2, tensor parallelism, FSDP2 over tensor parallelism on a 2 x 2 mesh, x {dense,
LoRA, delta}) with each snapshot's allocations measured, and ``gpu``-marked on 2 and 4 GPUs with
NCCL."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sharded_update_cases as cases
import torch
from spawn_ranks import backend_params, run_ranks
from tiny_models import read_scalars

from spectral_callbacks.functional import metrics_from_spectrum, spectral_metrics, update_metrics
from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.snapshot import ShapeGroup
from spectral_callbacks.names import monitor_tag, scalar_tag

pytestmark = pytest.mark.slow
CASES = [f"{how}-{kind}" for how, kind in cases.CASES]
K = cases.K


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("updates")
    return run_ranks(cases.tracked_all, 2, root, str(root / "tb"), timeout=400), root / "tb"


def exact(matrix: torch.Tensor) -> dict[str, float]:
    """Float64 reference: the metrics of the top K of a full SVD and the exact ‖W‖_F²."""
    S = torch.linalg.svdvals(matrix.double())
    values = metrics_from_spectrum(S[:K], (matrix.double() ** 2).sum())
    return {name: float(value) for name, value in values.items()}


def exact_update(update: torch.Tensor, base: torch.Tensor, rank: float) -> dict[str, float]:
    """Float64 reference of the update family: every singular value of ``update``."""
    S = torch.linalg.svdvals(update.double())[None]
    values = update_metrics(
        S, torch.linalg.vector_norm(base.double())[None], torch.tensor([rank], dtype=torch.float64)
    )
    return {name: float(value) for name, value in values.items()}


def single_process(seen: dict) -> dict[str, float]:
    """What one unsharded process logs for the same matrix: the default compute on a dense
    float32 copy, or on the adapter's factors (``AdaptedMatrices``, the single-process batch)."""
    factors = seen.get("factors")
    if factors is None:
        return {name: float(v) for name, v in spectral_metrics(seen["weight"].float(), k=K).items()}
    base, up, down, g = (None if t is None else t.float() for t in factors)
    batch = AdaptedMatrices((base,), (up,), (down,), (g,))
    m, n = base.shape
    values = SpectrumCompute(K)(ShapeGroup(f"{m}x{n}/float32/cpu", ()), batch)
    return {name: float(value[0]) for name, value in values.items()}


@pytest.mark.parametrize("case", CASES)
def test_every_logged_value_is_the_float64_svd_of_the_whole_effective_matrix(
    runs, case: str
) -> None:
    ranks, logroot = runs
    check_every_logged_value(ranks, logroot, case)


def check_every_logged_value(ranks: list[dict], logroot: Path, case: str) -> None:
    """Every logged value of ``case`` at every scheduled step against the float64 SVD of the whole
    effective matrix and of its update, and against one unsharded process on the same matrices;
    the same compression references on every rank."""
    rank0 = ranks[0][case]
    for rank in ranks[1:]:  # every rank agrees
        assert rank[case]["state"]["references"] == rank0["state"]["references"]
    scalars = read_scalars(logroot / case)
    kind = case.rsplit("-", 1)[1]
    updates = [t for t in rank0["targets"] if t[3]]
    assert len(rank0["targets"]) == 12
    adapted = 2 * len(cases.adapted_for(case.rsplit("-", 1)[0]))  # in each of the 2 layers
    assert len(updates) == {"dense": 0, "delta": 12}.get(kind, adapted)
    for name, layer, role, has_update in rank0["targets"]:
        for step in cases.SCHEDULED:
            seen = rank0["seen"][step][name]
            truth = exact(seen["weight"])
            for metric, tolerance in (
                ("stable_rank", {"rel": 0.01}),
                ("alpha", {"abs": 0.02}),
                ("frobenius_norm", {"rel": 1e-5}),
                ("spectral_norm", {"rel": 1e-3}),
            ):
                logged = scalars[scalar_tag(metric, layer, role)][step]
                assert logged == pytest.approx(truth[metric], **tolerance), (name, step, metric)
            single = single_process(seen)  # ... and what one process computes
            logged = scalars[scalar_tag("stable_rank", layer, role)][step]
            assert logged == pytest.approx(single["stable_rank"], rel=0.01), (name, step)
            if not has_update:
                assert scalar_tag("update_stable_rank", layer, role) not in scalars
                continue
            rank = 4.0 if kind in ("lora", "dora") else math.nan
            expected = exact_update(seen["update"], seen["base"], rank)
            for metric, tolerance in (
                ("update_stable_rank", {"rel": 0.01}),
                ("update_spectral_norm", {"rel": 1e-3}),
                ("update_frobenius_norm", {"rel": 1e-4}),
                ("update_relative_size", {"rel": 1e-4}),
                ("update_sv_2", {"rel": 1e-3}),
            ):
                logged = scalars[scalar_tag(metric, layer, role)][step]
                # delta= at step 0: the update is zero, its stable rank NaN in both
                assert logged == pytest.approx(expected[metric], nan_ok=True, **tolerance), (
                    name,
                    step,
                    metric,
                )
            if kind in ("lora", "dora"):  # the adapter's rank, read from its factors
                assert scalars[scalar_tag("update_rank", layer, role)][step] == 4.0


def test_training_moved_the_effective_weights_and_the_updates(runs) -> None:
    ranks, _ = runs
    for case in CASES:
        seen, targets = ranks[0][case]["seen"], ranks[0][case]["targets"]
        adapters = case.endswith(("lora", "dora"))  # then only the adapted matrices train
        for name, _, _, has_update in targets:
            if adapters and not has_update:
                continue
            moved = seen[cases.STEPS][name]["weight"] - seen[0][name]["weight"]
            assert float(moved.abs().max()) > 1e-4, (case, name)  # real, changing matrices


def test_each_layout_is_split_where_its_shards_are(runs) -> None:
    ranks, _ = runs
    # FSDP2 shards dim 0 of every Linear: rows. Tensor parallel: column-parallel Q/K/V/up by
    # rows, row-parallel O/down (adapted or not) by columns.
    assert set(ranks[0]["fsdp-lora"]["splits"].values()) == {"rows"}
    splits = ranks[0]["tp-lora"]["splits"]
    assert splits["base_model.model.layers.0.attention.q_proj.base_layer.weight"] == "rows"
    assert splits["base_model.model.layers.0.attention.o_proj.base_layer.weight"] == "columns"
    assert splits["base_model.model.layers.0.mlp.down_proj.base_layer.weight"] == "columns"


def test_an_adapter_adds_only_its_factors_to_what_a_rank_sends(runs) -> None:
    ranks, logroot = runs
    dense = read_scalars(logroot / "fsdp-dense")[monitor_tag("sent_bytes")]
    lora = read_scalars(logroot / "fsdp-lora")[monitor_tag("sent_bytes")]
    watched = 2 * (4 * 64 * 64 + 2 * 256 * 64) * 4  # the 12 matrices' float32 bytes
    # The factors of the 8 adapted matrices, float32 (each r x (m + n)), and 8 base norms.
    factors = 2 * 4 * 4 * ((64 + 64) * 3 + (64 + 256)) + 8 * 8
    for step in cases.SCHEDULED:
        assert 0 < dense[step] < watched and 0 < lora[step] < watched
    # The same Krylov traffic but for the factors: never a gathered matrix. (The Krylov part of
    # the two runs differs only by where the warm starts stop, which depends on the weights.)
    assert lora[0] >= factors


def test_a_resumed_run_keeps_its_step_0_references(tmp_path: Path) -> None:
    for how, kind in (("fsdp", "lora"), ("tp", "delta")):
        out = tmp_path / f"{how}-{kind}"
        out.mkdir()
        rank0, rank1 = run_ranks(cases.resumed, 2, out, how, kind, str(out), timeout=400)
        references = rank0["state0"]["references"]
        assert len(references) == 12
        for rank in (rank0, rank1):  # the same references on every rank, before and after
            assert rank["state0"]["references"] == rank["state1"]["references"] == references
        resumed = read_scalars(out / "tb1")
        for name, layer, role in rank0["targets"]:
            step0 = exact(rank0["step0"][name]["weight"])["stable_rank"]  # float64, step 0
            assert references[name] == pytest.approx(step0, rel=0.01), name
            stable_rank = resumed[scalar_tag("stable_rank", layer, role)]
            compression = resumed[scalar_tag("compression", layer, role)]
            assert sorted(stable_rank) == [4], name  # the resumed run's own snapshots only
            truth = exact(rank0["last1"][name]["weight"])["stable_rank"]
            assert stable_rank[4] == pytest.approx(truth, rel=0.01), name
            expected = 100 * (1 - stable_rank[4] / references[name])  # against step 0
            assert compression[4] == pytest.approx(expected, abs=1e-3), name


def test_what_cannot_be_decomposed_where_it_lives_is_refused_in_one_line(tmp_path: Path) -> None:
    # DoRA's row norms of a row-parallel (column-split) base would need every rank's columns.
    for message in run_ranks(cases.refused, 2, tmp_path, "tp", "dora", timeout=400):
        assert message.startswith("ShardingError: base_model.model.layers.0.attention.o_proj")
        assert "DoRA's row norms" in message and "exclude=" in message and "\n" not in message


def test_circuits_of_sharded_weights_are_refused_in_one_line(tmp_path: Path) -> None:
    # The heads' factors are the whole Q/K/V/O matrices of a layer: not gathered.
    for lines in run_ranks(cases.circuits_refused, 2, tmp_path, "fsdp", timeout=400):
        error = lines[-1]
        expected = "ConfigurationError: SpectralTracker: circuits: no attention layer could be read"
        assert error.startswith(expected), lines
        assert "sharded (DTensor) weights are not gathered for circuits" in error
        assert "\n" not in error


@pytest.fixture(scope="module", params=backend_params(gloo=(4,)))
def group(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict], Path, list[str]]:
    """Every case of ``CASES_ON_4`` (2 ranks: those without the 2 x 2 mesh) in one group."""
    backend, world_size = request.param
    root = tmp_path_factory.mktemp(f"updates-{backend}-{world_size}")
    ran = [c for c in cases.CASES_ON_4 if world_size == 4 or c[0] != "fsdp-tp"]
    ranks = run_ranks(
        cases.tracked_all, world_size, root, str(root / "tb"), ran, backend=backend, timeout=500
    )
    return ranks, root / "tb", [f"{how}-{kind}" for how, kind in ran]


def test_on_every_rank_count_every_logged_value_is_the_float64_svd_of_the_effective_matrix(
    group,
) -> None:
    ranks, logroot, ran = group
    for case in ran:
        check_every_logged_value(ranks, logroot, case)
    if len(ranks) == 4:  # FSDP2 over TP: column-parallel weights in rows, row-parallel in tiles
        splits = ranks[0]["fsdp-tp-delta"]["splits"]
        assert splits["layers.0.attention.q_proj.weight"] == "rows"
        assert splits["layers.0.attention.o_proj.weight"] == "tiles"
        assert splits["layers.0.mlp.down_proj.weight"] == "tiles"
        lora = ranks[0]["fsdp-tp-lora"]["splits"]
        assert lora["base_model.model.layers.0.attention.q_proj.base_layer.weight"] == "rows"


def test_on_every_rank_count_a_snapshot_allocates_less_than_one_process_is_budgeted(
    group,
) -> None:
    # Inline (synchronous=True), each tracker.step measured by the allocator: the snapshot's
    # copies, the Krylov blocks, the factors it all-reduces. Each rank allocates less than the
    # budget one process counts for the whole snapshot of the same model (the copies, the largest
    # working set, the kept subspaces); and the measure sees the work: at least the bytes of the
    # rank's own shards, which dense FSDP2 copies (every shard changed).
    ranks, _, _ = group
    for rank in ranks:
        for case in ("memory-fsdp-dense", "memory-fsdp-lora", "memory-fsdp-tp-dense"):
            run = rank.get(case)
            if run is None:  # the 2 x 2 mesh needs 4 ranks
                continue
            print(case, "peaks", run["peaks"], "one process", run["one_process_bytes"])  # -s
            for step in cases.SCHEDULED[1:]:
                peak = run["peaks"][step]
                assert peak < run["one_process_bytes"], (case, step, peak, run["one_process_bytes"])
        dense = rank["memory-fsdp-dense"]
        for step in cases.SCHEDULED[1:]:
            assert dense["peaks"][step] >= dense["local_bytes"], (step, dense["local_bytes"])


def test_an_adapter_on_a_base_split_in_tiles_is_refused_in_one_line(group) -> None:
    ranks, _, _ = group
    if len(ranks) < 4:
        pytest.skip("tiles need the 2 x 2 mesh of 4 ranks")
    for rank in ranks:
        message = rank["tiles"]
        assert message.startswith("ShardingError: "), message
        assert "its base is sharded along both dimensions (tiles)" in message, message
        assert "\n" not in message
