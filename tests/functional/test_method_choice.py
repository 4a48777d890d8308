"""The stateless method choice: exact where the flop count says exact is cheaper, and every path
it can pick agrees with float64.

The decisions asserted here are the cost model's (``functional/method_choice.py``), never a
timing; the times quoted beside them were measured by ``benchmarks/stateless_vs_exact.py`` (1
thread, thread CPU time) and are what the model's constants were fitted to.
"""

from __future__ import annotations

import math

import pytest
import torch
from seeds import run_seed

import spectral_callbacks.functional.method_choice as method_choice
import spectral_callbacks.functional.svd as svd_module
from spectral_callbacks.functional import randomized_svd, spectral_metrics
from spectral_callbacks.functional.method_choice import (
    choose_method,
    exact_cost,
    randomized_costs,
    route_depth,
    stopping_rule_cost,
)

SEEDS = [0, run_seed()]


def cold_choice(m: int, n: int, dtype: torch.dtype = torch.float32, batch: int = 1) -> str:
    """What ``randomized_svd(W)`` with no ``init`` and no calibration runs on ``(batch, m, n)``."""
    _, width, depth = svd_module._sizes(m, n, 32, 8, None, False)
    first_test = svd_module._first_test(None, False)
    return choose_method(m, n, width, depth, dtype, batch=batch, first_test=first_test)


def decaying(m: int, n: int, a: float, seed: int) -> torch.Tensor:
    """float64 ``U diag(i^-a) V^T`` with random orthonormal U, V: a spectrum known exactly."""
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    return (U * torch.arange(1, r + 1, dtype=torch.float64).pow(-a)) @ V.mT


@pytest.mark.parametrize(
    "shape",
    # Exact measured faster, cold, one matrix (ms, exact Gram / cold randomized): 256^2 2.9 / 12.5,
    # 512^2 17.5 / 18.2, 1536x512 23.4 / 35.8, 512x1536 22.6 / 32.8, 4096x512 38.5 / 57.7,
    # 1024x256 4.0 / 13.8; the block covers most of a 64-side matrix.
    [(64, 64), (128, 64), (64, 128), (128, 128), (256, 256), (512, 512), (1536, 512), (512, 1536),
     (4096, 512), (1024, 256), (2048, 256)],
)  # fmt: skip
def test_a_stateless_call_is_exact_where_the_model_prices_exact_cheaper(
    shape: tuple[int, int],
) -> None:
    assert cold_choice(*shape) == "gram"


@pytest.mark.parametrize(
    "shape",
    # The randomized path measured faster, cold (ms, exact Gram / cold randomized): 768^2 55 /
    # 28, 3072x768 82 / 69, 768x3072 77 / 69, 1024^2 109 / 48, 2048^2 764 / 128.
    [(640, 640), (768, 768), (768, 3072), (3072, 768), (1024, 1024), (1024, 4096), (2048, 2048),
     (3584, 3584), (8192, 8192)],
)  # fmt: skip
def test_a_stateless_call_is_randomized_where_the_model_prices_it_cheaper(
    shape: tuple[int, int],
) -> None:
    assert cold_choice(*shape) == "randomized"


def test_the_choice_is_the_cheaper_of_the_two_costs_with_the_calls_fixed_cost() -> None:
    # The rule itself on a sweep of shapes: exact exactly where its cost is below the randomized
    # path's (its products, its stopping rule, and one call's fixed cost spread over the batch).
    for m in (96, 200, 384, 700, 1200, 3000):
        for n in (96, 300, 640, 1500):
            for batch in (1, 8):
                _, width, depth = svd_module._sizes(m, n, 32, 8, None, False)
                if width >= 0.5 * min(m, n):
                    assert cold_choice(m, n, batch=batch) == "gram"
                    continue
                products = min(randomized_costs(m, n, width, depth, krylov=True).values())
                # Two tests at the expected depth's basis, one at the early test's.
                tests = stopping_rule_cost(width, depth, svd_module._EARLY_CHECK)
                per_column_cubed = method_choice._COST_RAYLEIGH_RITZ
                assert tests == per_column_cubed * (
                    2 * ((depth + 1) * width) ** 3 + (3 * width) ** 3
                )
                randomized = batch * (products + tests) + 2.0e8
                exact = batch * exact_cost(m, n, torch.float32)
                expected = "randomized" if randomized <= exact else "gram"
                assert cold_choice(m, n, batch=batch) == expected, (m, n, batch)


@pytest.mark.parametrize("shape", [(768, 3072), (3072, 768)])
def test_a_cold_call_compares_the_ways_to_apply_the_gram_matrix_at_its_first_test(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # At a flat spectrum's expected depth (5) the count prices the explicit Gram matrix below
    # the products with W; a cold call, which a low-rank matrix ends at its first test (depth
    # 2), compares them there and multiplies by W (measured, 1 thread, thread CPU ms, products
    # against Gram: 3072 x 768 flat 62 / 67, sigma_i = 1/i 29 / 55). A fixed depth compares
    # them at that depth; so does a warm call (its expected depth, 1, is its first test).
    m, n = shape
    _, width, depth = svd_module._sizes(m, n, 32, 8, None, False)

    def cheapest(at: int) -> str:
        costs = randomized_costs(m, n, width, at, krylov=True)
        return min(costs, key=costs.__getitem__)

    assert (depth, cheapest(depth), cheapest(svd_module._EARLY_CHECK)) == (5, "gram", "products")
    assert route_depth(depth, svd_module._first_test(None, False)) == svd_module._EARLY_CHECK
    assert route_depth(depth, svd_module._first_test(depth, False)) == depth
    assert route_depth(1, svd_module._first_test(None, True)) == 1
    routes: list[str] = []
    costs = svd_module.randomized_costs

    def spied(*args: object, **kwargs: object) -> dict[str, float]:
        found = costs(*args, **kwargs)  # type: ignore[arg-type]
        routes.append(min(found, key=found.__getitem__))
        return found

    monkeypatch.setattr(svd_module, "randomized_costs", spied)
    W = torch.randn(m, n, generator=torch.Generator().manual_seed(0)) / n**0.5
    randomized_svd(W, method="randomized")
    randomized_svd(W, method="randomized", n_iter=depth)
    assert routes == ["products", "gram"]


def test_a_bigger_batch_spreads_the_calls_fixed_cost_and_float64_doubles_the_exact_cost() -> None:
    # One call's fixed cost is paid once per batch: a small warm-able shape goes randomized only
    # in a batch (measured warm, 1 thread: 256^2 3.7 ms against exact 2.9; 16 of them 17.5
    # against 42).
    assert choose_method(256, 256, 40, 1, torch.float32, batch=1) == "gram"
    assert choose_method(256, 256, 40, 1, torch.float32, batch=16) == "randomized"
    assert exact_cost(512, 1536, torch.float64) == 2 * exact_cost(512, 1536, torch.float32)
    # On an accelerator: never the float64 Gram path.
    assert choose_method(512, 1536, 40, 5, torch.float32, "cuda") == "randomized"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(256, 256), (128, 64), (700, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_path_a_stateless_call_takes_agrees_with_float64(
    shape: tuple[int, int], dtype: torch.dtype, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each path the choice can pick, on a spectrum known exactly (sigma_i = i^-0.5) and on a
    # flat one (Gaussian: the hard case for the randomized path), against float64 svdvals.
    m, n = shape
    chosen = cold_choice(m, n, dtype)
    taken: list[str] = []
    top_svd = svd_module._top_svd

    def spy(A: torch.Tensor, k: int, width: int, method: str, *args: object) -> object:
        taken.append(method)
        return top_svd(A, k, width, method, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(svd_module, "_top_svd", spy)
    flat = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for W64 in (decaying(m, n, 0.5, seed), flat / n**0.5):
        W = W64.to(dtype)
        truth = torch.linalg.svdvals(W.double())
        top = randomized_svd(W)
        metrics = spectral_metrics(W)
        assert taken[-1] == chosen and top.S.dtype == dtype
        assert top.V is None or chosen == "randomized"  # a stateless exact call: no subspace
        if chosen == "randomized":  # within the stopping rule's bound (docs/metrics.md)
            torch.testing.assert_close(top.S[0].double(), truth[0], rtol=2.5e-3, atol=0)
            torch.testing.assert_close(top.S.double(), truth[:32], rtol=2.5e-2, atol=0)
            assert bool((top.S.double() <= truth[:32] * (1 + 1e-5)).all())  # Ritz values
        else:  # exact: float32's rounding, squared by the float32 Gram matrix at sigma_32
            rtol = 1e-4 if dtype == torch.float32 else 1e-10
            torch.testing.assert_close(top.S.double(), truth[:32], rtol=rtol, atol=0)
        stable_rank = W.double().square().sum() / truth[0] ** 2
        rtol = 1e-2 if chosen == "randomized" else 1e-4
        torch.testing.assert_close(metrics["stable_rank"].double(), stable_rank, rtol=rtol, atol=0)
        torch.testing.assert_close(metrics["spectral_norm"].double(), truth[0], rtol=rtol, atol=0)


def spy_on_the_float32_gram_top(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, for each stateless float32 Gram call, whether its one-read path answered
    (True) or left the batch to the checked path (False)."""
    answered: list[bool] = []
    original = svd_module.float32_gram_top

    def spy(*args: object) -> object:
        top = original(*args)  # type: ignore[arg-type]
        answered.append(top is not None)
        return top

    monkeypatch.setattr(svd_module, "float32_gram_top", spy)
    return answered


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(64, 64), (96, 200), (200, 96)])
def test_the_stateless_float32_gram_path_agrees_with_float64_alone_and_batched(
    shape: tuple[int, int], seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The path that checks everything in two host reads, on known spectra (i^-0.5, i^-1) and a
    # flat one, one matrix and a batch of them, against float64 svdvals.
    m, n = shape
    answered = spy_on_the_float32_gram_top(monkeypatch)
    flat = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    batch64 = torch.stack([decaying(m, n, 0.5, seed), decaying(m, n, 1.0, seed), flat / n**0.5])
    truth = torch.linalg.svdvals(batch64.float().double())[..., :32]
    for W, expected in ((batch64.float(), truth), *zip(batch64.float(), truth, strict=True)):
        top = randomized_svd(W)
        assert answered[-1] and top.V is None and top.fell_back is None
        assert top.S.dtype == torch.float32 and top.S.shape == expected.shape
        # float32's rounding, squared by the float32 Gram matrix at sigma_32 >= sigma_1 / 32
        torch.testing.assert_close(top.S.double(), expected, rtol=1e-4, atol=0)
        assert bool((top.S[..., :-1] >= top.S[..., 1:]).all())  # descending


@pytest.mark.parametrize(
    "case", ["rank-deficient", "zero", "nan", "tiny", "huge", "one-rank-deficient-of-a-batch"]
)
def test_the_stateless_float32_gram_path_leaves_what_it_cannot_read_to_the_checked_path(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each kind of matrix the one-read path must not answer for: its top 32 reach below
    # 0.01 sigma_1 (redone in float64), a zero matrix, a NaN, a Gram matrix out of float32's
    # range (2^-70, 2^70). The checked path's answer, against float64.
    answered = spy_on_the_float32_gram_top(monkeypatch)
    seed = run_seed()
    good = decaying(80, 64, 0.5, seed)
    low_rank = torch.diag(torch.tensor([1.0, 0.5, 1e-3, *[0.0] * 61], dtype=torch.float64))
    low_rank = torch.cat([low_rank, torch.zeros(16, 64, dtype=torch.float64)])  # (80, 64)
    W64 = {
        "rank-deficient": low_rank,
        "zero": torch.zeros(80, 64, dtype=torch.float64),
        "nan": torch.where(
            (torch.arange(80)[:, None] == 3) & (torch.arange(64) == 5), math.nan, good
        ),
        "tiny": good * 2.0**-70,
        "huge": good * 2.0**70,
        "one-rank-deficient-of-a-batch": torch.stack([good, low_rank]),
    }[case]
    W = W64.float()
    top = randomized_svd(W)
    assert answered == [False] and top.fell_back is None
    if case == "nan":
        assert bool(top.S.isnan().all())
        return
    truth = torch.linalg.svdvals(W.double())[..., :32]
    # The rank tolerance (max(m, n) eps32 sigma_1) reads what lies below it as exactly 0.
    truth = torch.where(truth > 80 * 2.0**-23 * truth[..., :1], truth, 0.0)
    torch.testing.assert_close(top.S.double(), truth, rtol=1e-5, atol=0)


def test_a_batch_through_the_stateless_path_is_one_call_of_each_batched_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # All the Q's of a model: one batched eigvalsh of the (B, d, d) Gram matrices, not B calls.
    calls: list[tuple[int, ...]] = []
    eigvalsh = torch.linalg.eigvalsh

    def counting(G: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(tuple(G.shape))
        return eigvalsh(G, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.linalg, "eigvalsh", counting)
    W = torch.randn(12, 96, 128, generator=torch.Generator().manual_seed(run_seed()))
    out = spectral_metrics(W)
    assert calls == [(12, 96, 96)] and out["stable_rank"].shape == (12,)
