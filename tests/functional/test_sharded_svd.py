"""sharded_randomized_svd: 2 gloo processes, each holding a block of rows (or columns), against the
float64 SVD of the full matrix and against the single-process ``randomized_svd``."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import sharded_svd_cases as cases
import torch
from device_checks import factories_elsewhere, tf32_matmuls
from spawn_ranks import run_ranks

from spectral_callbacks.functional import metrics_from_spectrum, randomized_svd
from spectral_callbacks.functional.sharded_svd import sharded_randomized_svd
from spectral_callbacks.functional.svd import default_n_iter

K = cases.K


def exact_metrics(full: torch.Tensor) -> dict[str, float]:
    S = torch.linalg.svdvals(full.double())
    frobenius_sq = (full.double() ** 2).sum()
    return {key: float(v) for key, v in metrics_from_spectrum(S[:K], frobenius_sq).items()}


def metrics(S: torch.Tensor, frobenius_sq: torch.Tensor) -> dict[str, float]:
    return {key: float(v) for key, v in metrics_from_spectrum(S, frobenius_sq).items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(cases.svd_cases, 2, tmp_path_factory.mktemp("svd"))


@pytest.mark.parametrize("name", list(cases.cases()))
def test_matches_the_float64_svd_of_the_full_matrix(ranks, name: str) -> None:
    full, split, cut = cases.cases()[name]
    expected = exact_metrics(full)
    results = [ranks[rank][name] for rank in (0, 1)]
    for rank, result in enumerate(results):
        got = metrics(result["S"], result["frobenius_sq"])
        assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01), rank
        assert got["alpha"] == pytest.approx(expected["alpha"], abs=0.02), rank
        assert float(result["frobenius_sq"]) == pytest.approx(
            float((full.double() ** 2).sum()), rel=1e-7
        )
    # Every rank ends with exactly the same spectrum (and warm-start subspace).
    assert torch.equal(results[0]["S"], results[1]["S"])
    if results[0]["V"] is not None:
        assert torch.equal(results[0]["V"], results[1]["V"])


@pytest.mark.parametrize("name", ["power_0.5_rows", "power_1.0_columns", "power_1.0_long_rows"])
def test_recovers_a_known_power_law(ranks, name: str) -> None:
    full, _, _ = cases.cases()[name]
    a = float(name.split("_")[1])
    result = ranks[0][name]
    truth = torch.arange(1, K + 1, dtype=torch.float64) ** -a
    torch.testing.assert_close(result["S"].double(), truth, rtol=1e-3, atol=1e-5)
    assert metrics(result["S"], result["frobenius_sq"])["alpha"] == pytest.approx(a, abs=0.02)


@pytest.mark.parametrize("name", ["gaussian_rows_uneven", "gaussian_columns_uneven"])
def test_agrees_with_the_single_process_randomized_svd(ranks, name: str) -> None:
    full, _, _ = cases.cases()[name]
    single = randomized_svd(full, K, method="randomized")
    torch.testing.assert_close(ranks[0][name]["S"], single.S, rtol=2e-3, atol=0.0)


@pytest.mark.parametrize("name", [n for n in cases.cases() if n != "small_gram"])
def test_no_rank_creates_a_full_matrix(ranks, name: str) -> None:
    full, split, _ = cases.cases()[name]
    m, n = full.shape
    unsplit = n if split == "rows" else m
    depth = default_n_iter(m, n)
    krylov_basis = unsplit * (K + 8) * (depth + 1)
    for rank in (0, 1):
        result = ranks[rank][name]
        # The largest tensor the call creates is this rank's own block or the Krylov basis of the
        # unsplit side, whichever is larger; a rank holding part of the matrix never holds it all.
        assert result["largest"] <= max(result["local"], krylov_basis), rank
        if result["local"] < full.numel():
            assert result["largest"] < full.numel(), rank


def test_communication_is_a_few_blocks_not_the_matrix(ranks) -> None:
    full, _, _ = cases.cases()["gaussian_rows_uneven"]  # 400 x 160, depth 5, b = 24
    sent = ranks[0]["gaussian_rows_uneven"]["sent_bytes"]
    b, depth, n = K + 8, 5, 160
    # Scalars, q + 1 blocks (the last for the Rayleigh quotient: cheaper here than the Gram of W
    # over the whole basis) and the upper triangle of the b x b Gram of W V.
    assert sent == 3 * 8 + (depth + 1) * n * b * 4 + b * (b + 1) // 2 * 8
    assert sent < 0.5 * full.numel() * 4
    # A long unsplit side: the Gram matrix of W over the whole basis (its upper triangle) costs
    # less than the last block would.
    sent = ranks[0]["long_rows"]["sent_bytes"]
    n, depth = 1536, default_n_iter(256, 1536)
    columns = b * (depth + 1)
    assert sent == 3 * 8 + depth * n * b * 4 + columns * (columns + 1) // 2 * 8


def test_batch_warm_start_and_nan_on_one_rank(ranks) -> None:
    fulls = torch.stack([cases.gaussian(200, 96, seed=20 + i) for i in range(3)])
    for i in range(3):
        expected = exact_metrics(fulls[i])
        got = metrics(ranks[0]["batch"]["S"][i], ranks[0]["batch"]["frobenius_sq"][i])
        assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01)
        moved = torch.cat([ranks[0]["batch"]["moved"][i], ranks[1]["batch"]["moved"][i]])
        expected = exact_metrics(moved)
        got = metrics(ranks[1]["warm"]["S"][i], ranks[1]["warm"]["frobenius_sq"][i])
        assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01)
    # The warm start stopped by the stopping rule: fewer Krylov blocks than the cold call.
    assert ranks[0]["warm"]["sent_bytes"] < ranks[0]["batch"]["sent_bytes"] / 2
    for rank in (0, 1):
        S = ranks[rank]["nan"]["S"]
        assert torch.isnan(S[1]).all() and torch.isfinite(S[[0, 2]]).all()
        assert math.isnan(float(ranks[rank]["nan"]["frobenius_sq"][1]))
    torch.testing.assert_close(ranks[0]["nan"]["S"][[0, 2]], ranks[0]["batch"]["S"][[0, 2]])


def test_a_warm_start_that_no_longer_fits_goes_deeper_and_stays_exact(ranks) -> None:
    stale = ranks[0]["stale"]
    for i in range(3):
        expected = exact_metrics(stale["full"][i])
        for rank in (0, 1):
            got = metrics(ranks[rank]["stale"]["S"][i], ranks[rank]["stale"]["frobenius_sq"][i])
            assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01), rank
            assert got["alpha"] == pytest.approx(expected["alpha"], abs=0.02), rank
    assert stale["sent_bytes"] > 2 * ranks[0]["warm"]["sent_bytes"]
    assert torch.equal(ranks[0]["stale"]["S"], ranks[1]["stale"]["S"])


def test_a_rank_that_never_arrives_is_an_error_within_the_group_timeout(tmp_path: Path) -> None:
    rank0, _ = run_ranks(cases.missing_rank, 2, tmp_path)
    # The group's timeout error, not any immediate failure: after the 3 s, with slack above.
    assert re.search(r"[Tt]imed? ?out", rank0["error"] or ""), rank0["error"]
    assert 2.5 <= rank0["seconds"] < 30


def test_one_process_without_a_group_is_the_plain_algorithm() -> None:
    W = cases.power_law(120, 80, 1.0, seed=0)
    top = sharded_randomized_svd(W, 8, generator=torch.Generator().manual_seed(0))
    exact = torch.arange(1, 9.0, dtype=torch.float64) ** -1
    torch.testing.assert_close(top.S.double(), exact, rtol=1e-6, atol=0)  # float32: a few ulps
    assert top.sent_bytes == 0 and top.V is not None and top.V.shape == (80, 16)


def test_bad_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="`split` must be one of"):
        sharded_randomized_svd(torch.ones(3, 3), 2, split="diagonal")
    with pytest.raises(TypeError, match="floating-point"):
        sharded_randomized_svd(torch.ones(3, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="every rank's block is empty"):
        sharded_randomized_svd(torch.ones(0, 3), 2)
    with pytest.raises(ValueError, match="empty unsplit side"):
        sharded_randomized_svd(torch.ones(3, 0), 2)
    with pytest.raises(ValueError, match="`init` must have shape"):
        sharded_randomized_svd(torch.ones(30, 40), 2, init=torch.ones(30, 4))


@pytest.mark.parametrize("name", ["gaussian_rows_uneven", "power_1.0_columns"])
def test_krylov_blocks_in_bfloat16_keep_the_accuracy_at_half_the_bytes(ranks, name: str) -> None:
    full, _, _ = cases.cases()[name]
    expected = exact_metrics(full)
    for rank in (0, 1):
        result = ranks[rank][f"{name}_bf16"]
        got = metrics(result["S"], result["frobenius_sq"])
        assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=0.01), rank
        assert got["alpha"] == pytest.approx(expected["alpha"], abs=0.02), rank
    float32, bf16 = ranks[0][name]["sent_bytes"], ranks[0][f"{name}_bf16"]["sent_bytes"]
    b = K + 8
    gram = b * (b + 1) // 2 * 8
    assert float32 - bf16 == (float32 - 3 * 8 - gram) // 2  # the Krylov blocks halve


@pytest.mark.parametrize(
    ("split", "method"),
    [("rows", "randomized"), ("rows", "gram"), ("columns", "randomized"), ("tiles", "randomized")],
)
def test_every_tensor_it_makes_lives_on_the_input_device(split: str, method: str) -> None:
    # On CUDA a tensor made without device= is a CPU tensor beside CUDA ones: the first sharded
    # snapshot failed. Here such a tensor would land on the meta device (factories_elsewhere).
    W = torch.stack([cases.power_law(60, 40, 1.0, seed=i) for i in range(3)])
    W[1, 2, 3] = float("nan")  # the masks of a non-finite matrix run too
    local = W.mT if split == "columns" else W
    tiles = {}
    if split == "tiles":
        tiles = {"shape": (60, 40), "row_index": torch.arange(60), "col_index": torch.arange(40)}
    options = dict(split=split, method=method, generator=torch.Generator().manual_seed(0), **tiles)
    cold = sharded_randomized_svd(local, 4, **options)  # the reference, default device the CPU
    with factories_elsewhere():
        top = sharded_randomized_svd(local, 4, **options)
        if cold.V is not None:
            warm = sharded_randomized_svd(local, 4, **options | {"init": cold.V})
    torch.testing.assert_close(top.S, cold.S, equal_nan=True)
    assert torch.isnan(top.S[1]).all() and torch.isfinite(top.S[[0, 2]]).all()
    if cold.V is not None:
        assert warm.S.device.type == "cpu"


@pytest.mark.parametrize("split", ["rows", "tiles"])
def test_with_tf32_products_it_keeps_float32_accuracy(
    split: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TF32 emulated on the CPU (device_checks.tf32_matmuls): its products with W and its own
    # (Ritz pairs, the Rayleigh-Ritz basis) all go through precision.matmul's 3xTF32 split.
    W = cases.power_law(600, 400, 0.5, seed=3)
    exact = torch.linalg.svdvals(W.double())[:16]
    tiles = {}
    if split == "tiles":
        tiles = {
            "shape": (600, 400),
            "row_index": torch.arange(600),
            "col_index": torch.arange(400),
        }
    with tf32_matmuls(monkeypatch):
        top = sharded_randomized_svd(W, 16, split=split, method="randomized", n_iter=6, **tiles)
    relative = ((top.S.double() - exact) / exact).abs().max().item()
    assert relative < 1e-5, relative


def test_local_rows_held_as_an_operator_give_the_values_of_the_formed_rows() -> None:
    # A LoRA layer's rows: W = W0 + U V multiplied as W0 X + U (V X), never formed; DoRA's row
    # scale too. One process (group=None): the whole matrix, against float64 and the formed one.
    from spectral_callbacks.functional.lowrank import AdaptedMatrices

    generator = torch.Generator().manual_seed(7)
    base = torch.randn(2, 60, 40, generator=generator) / 8
    U, V = torch.randn(2, 60, 4, generator=generator), torch.randn(2, 4, 40, generator=generator)
    g = torch.rand(2, 60, generator=generator) + 0.5
    for magnitudes in ((None, None), (g[0], g[1])):
        batch = AdaptedMatrices(tuple(base), tuple(U), tuple(V), magnitudes)
        formed = batch.dense(torch.float64)
        held = sharded_randomized_svd(batch, K, method="randomized")
        dense = sharded_randomized_svd(formed.float(), K, method="randomized")
        for i in range(2):
            expected = exact_metrics(formed[i])
            got = metrics(held.S[i], held.frobenius_sq[i])
            assert got["stable_rank"] == pytest.approx(expected["stable_rank"], rel=1e-3)
            assert float(held.frobenius_sq[i]) == pytest.approx(
                float((formed[i] ** 2).sum()), rel=1e-6
            )
        assert torch.allclose(held.S, dense.S, rtol=1e-4)
    base[1, 3, 5] = float("nan")  # a NaN in one matrix: its values NaN, the other's kept
    held = sharded_randomized_svd(AdaptedMatrices(tuple(base), tuple(U), tuple(V)), K)
    assert bool(held.S[1].isnan().all()) and bool(held.S[0].isfinite().all())
