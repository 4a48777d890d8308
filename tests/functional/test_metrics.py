"""The metrics of docs/metrics.md (Definitions) against spectra with known answers and a float64 reference."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from seeds import run_seed
from torch.profiler import ProfilerActivity, profile

import spectral_callbacks.functional.metrics as metrics_module
from spectral_callbacks.functional import (
    ESD_METRICS,
    compression,
    energy_rank,
    energy_rank_key,
    frobenius_norm_sq,
    metrics_from_spectrum,
    powerlaw_alpha,
    spectral_metrics,
    stable_rank,
)

SEEDS = [0, run_seed()]
KEYS = {"stable_rank", "alpha", "alpha_r2", "spectral_norm", "frobenius_norm", "energy_rank_90"}


def with_spectrum(s: torch.Tensor, m: int, n: int, seed: int) -> torch.Tensor:
    """``(m, n)`` float64 matrix U diag(s) V^T with random orthonormal U, V."""
    g = torch.Generator().manual_seed(seed)
    r = s.shape[-1]
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64)).Q
    return (U * s.double()) @ V.T


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rank", [1, 5, 20])
def test_equal_singular_values_have_stable_rank_equal_to_the_rank(rank: int, seed: int) -> None:
    W = with_spectrum(torch.full((rank,), 3.0), 90, 70, seed).float()
    out = spectral_metrics(W, k=8)
    torch.testing.assert_close(out["stable_rank"], torch.tensor(float(rank)), rtol=1e-4, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_metrics_match_the_float64_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(3, 160, 120, generator=g) * torch.tensor([1.0, 0.1, 10.0])[:, None, None]
    out = spectral_metrics(W, k=16, generator=g)
    s = torch.linalg.svdvals(W.double())
    fro_sq = W.double().square().sum((-2, -1))
    assert set(out) == KEYS and all(v.shape == (3,) for v in out.values())
    torch.testing.assert_close(
        out["stable_rank"].double(), fro_sq / s[:, 0] ** 2, rtol=2e-3, atol=0
    )
    torch.testing.assert_close(out["spectral_norm"].double(), s[:, 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(out["frobenius_norm"].double(), fro_sq.sqrt(), rtol=1e-6, atol=0)
    alpha, r2 = powerlaw_alpha(s[:, :16])
    torch.testing.assert_close(out["alpha"].double(), alpha.double(), atol=0.01, rtol=0)
    torch.testing.assert_close(out["alpha_r2"].double(), r2.double(), atol=0.02, rtol=0)


@pytest.mark.parametrize("a", [0.2, 0.5, 1.0])
def test_alpha_of_a_synthetic_power_law_is_the_same_with_every_method(a: float) -> None:
    s = torch.arange(1, 101, dtype=torch.float64).pow(-a)
    W = with_spectrum(s, 150, 100, random.randrange(2**31)).float()
    for method in ("auto", "randomized", "gram", "svdvals"):
        out = spectral_metrics(W, k=16, method=method)
        assert abs(out["alpha"].item() - a) < 0.02, method
        assert out["alpha_r2"].item() > 0.999, method
        assert out["energy_rank_90"].isnan() or out["energy_rank_90"].item() <= 16


def test_frobenius_norm_comes_from_w_not_from_the_truncated_spectrum() -> None:
    W = torch.eye(50)  # 50 equal singular values, only 4 computed
    out = spectral_metrics(W, k=4)
    assert out["frobenius_norm"].item() == pytest.approx(math.sqrt(50), rel=1e-6)
    assert out["stable_rank"].item() == pytest.approx(50.0, rel=1e-5)
    assert out["energy_rank_90"].isnan()  # 90 % needs rank 45, beyond the top 4: unknown


@pytest.mark.parametrize("a", [0.3, 1.0, 2.5])
def test_powerlaw_alpha_recovers_the_exponent_exactly_batched(a: float) -> None:
    S = torch.arange(1, 33, dtype=torch.float64).pow(-a).expand(4, 2, 32)
    alpha, r2 = powerlaw_alpha(S)
    assert alpha.shape == (4, 2)
    torch.testing.assert_close(alpha, torch.full((4, 2), a, dtype=torch.float32))
    torch.testing.assert_close(r2, torch.ones(4, 2))


def test_fit_window_selects_ranks_and_zeros_are_left_out() -> None:
    # i^-1 on ranks 1..10, then i^-3 beyond: the window picks which law is seen.
    i = torch.arange(1, 31, dtype=torch.float64)
    S = torch.where(i <= 10, 1 / i, 100 / i**3)
    assert powerlaw_alpha(S, (1, 10))[0].item() == pytest.approx(1.0, abs=1e-5)
    assert powerlaw_alpha(S, (11, 30))[0].item() == pytest.approx(3.0, abs=1e-5)
    assert powerlaw_alpha(S, (11, 1000))[0].item() == pytest.approx(3.0, abs=1e-5)  # clamped
    rank_2 = torch.tensor([2.0, 1.0, 0.0, 0.0])
    assert powerlaw_alpha(rank_2)[0].isnan()  # two nonzero values are not a fit


@pytest.mark.parametrize("window", [(0, 5), (5, 2), (1.0, 5), "1-5", (1, 2, 3)])
def test_bad_fit_window_is_named(window: object) -> None:
    with pytest.raises(ValueError, match=r"`fit_window` must be None or 1-based ranks"):
        powerlaw_alpha(torch.ones(8), window)  # type: ignore[arg-type]


def test_energy_rank_known_values_and_key_names() -> None:
    S = torch.tensor([[3.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    fro_sq = torch.tensor([10.0, 3.0])
    torch.testing.assert_close(energy_rank(S, fro_sq, 0.9), torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(energy_rank(S, fro_sq, 0.5), torch.tensor([1.0, 2.0]))
    assert energy_rank(S, fro_sq * 2, 0.9).isnan().all()  # not reached within the top 3
    assert set(metrics_from_spectrum(S, fro_sq, energy=0.99)) == KEYS - {"energy_rank_90"} | {
        "energy_rank_99"
    }
    assert energy_rank_key(0.75) == "energy_rank_75"


@pytest.mark.parametrize("energy", [0, 1.5, -0.1, float("nan"), True])
def test_bad_energy_is_named(energy: object) -> None:
    with pytest.raises(ValueError, match=r"`energy` must be a fraction in \(0, 1\]"):
        energy_rank(torch.ones(3), torch.tensor(3.0), energy)  # type: ignore[arg-type]


def test_compression_is_percent_of_the_reference_and_nan_without_one() -> None:
    sr = torch.tensor([20.0, 100.0, 250.0])
    torch.testing.assert_close(compression(sr, 200.0), torch.tensor([90.0, 50.0, -25.0]))
    assert compression(sr, torch.tensor(0.0)).isnan().all()
    assert compression(sr, float("nan")).isnan().all()


def test_zero_matrix_has_zero_norms_and_nan_elsewhere() -> None:
    out = spectral_metrics(torch.zeros(2, 30, 20), k=4)
    assert torch.equal(out["spectral_norm"], torch.zeros(2))
    assert torch.equal(out["frobenius_norm"], torch.zeros(2))
    for key in ("stable_rank", "alpha", "alpha_r2", "energy_rank_90"):
        assert out[key].isnan().all(), key


def test_non_finite_matrix_gets_nan_metrics_and_its_batch_is_unaffected() -> None:
    W = torch.randn(2, 30, 20)
    W[0, 1, 1] = float("inf")
    out = spectral_metrics(W, k=4, esd=True)
    clean = spectral_metrics(W[1], k=4, esd=True, method="gram")
    for key, value in out.items():
        assert value[0].isnan(), key
        if not key.startswith("esd_"):
            torch.testing.assert_close(value[1], clean[key], rtol=1e-3, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("shape", [(1, 12), (12, 1)])
def test_single_row_or_column(shape: tuple[int, int]) -> None:
    out = spectral_metrics(torch.randn(shape))
    assert out["stable_rank"].item() == pytest.approx(1.0, rel=1e-5)
    assert out["energy_rank_90"].item() == 1.0
    assert out["alpha"].isnan() and out["alpha_r2"].isnan()  # one point is not a fit


def test_scalar_outputs_for_a_matrix_and_esd_on_request() -> None:
    out = spectral_metrics(torch.randn(40, 30), k=12, esd=True)
    assert set(out) == KEYS | set(ESD_METRICS) and all(v.shape == () for v in out.values())
    assert all(v.dtype == torch.float32 for v in out.values())


@pytest.mark.parametrize(
    ("W", "match"),
    [
        (torch.ones(6), r"`W` must be a 2-D \(m, n\) matrix or a 3-D \(B, m, n\) batch"),
        (torch.ones(2, 2, 4, 4), r"`W` must be a 2-D \(m, n\) matrix or a 3-D \(B, m, n\) batch"),
    ],
)
def test_bad_shapes_are_named(W: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spectral_metrics(W)


def test_stable_rank_and_spectrum_functions_on_known_values() -> None:
    S = torch.tensor([[2.0, 1.0], [0.0, 0.0]])
    torch.testing.assert_close(
        stable_rank(S, torch.tensor([8.0, 0.0])), torch.tensor([2.0, float("nan")]), equal_nan=True
    )


def _largest_allocation(fn: Any) -> int:
    """The most bytes any one torch op allocated on the CPU while ``fn`` ran (torch profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((event.cpu_memory_usage for event in prof.events()), default=0)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [(torch.float32, 1e20), (torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.float64, 1.0)],
    ids=["float32-overflowing-rows", "bfloat16", "float16", "float64"],
)
def test_exact_frobenius_norm_makes_no_float64_copy_of_w(
    dtype: torch.dtype, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vector_norm(W, dtype=float64) converts all of W first: 8 bytes per entry, ~23 GB for a 7B
    # model's gate+up group (and on an accelerator it ran at every snapshot). Float32 rows that
    # overflow take the exact path on the CPU too.
    monkeypatch.setattr(metrics_module, "_FLOAT64_CHUNK_ELEMENTS", 1 << 14)
    generator = torch.Generator().manual_seed(random.randrange(2**31))
    W64 = torch.randn(3, 512, 256, dtype=torch.float64, generator=generator)
    W = (W64 * scale).to(dtype)
    expected = W.double().square().sum((-2, -1))
    got = frobenius_norm_sq(W)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    full_copy = 8 * W.numel()
    assert _largest_allocation(lambda: frobenius_norm_sq(W)) < full_copy / 8


def test_update_energy_rank_90_is_the_least_rank_holding_90_percent_of_the_update() -> None:
    from spectral_callbacks.functional import update_metrics

    generator = torch.Generator().manual_seed(0)
    ups = torch.randn(6, 24, 8, generator=generator, dtype=torch.float64)
    downs = torch.randn(6, 8, 16, generator=generator, dtype=torch.float64)
    S = torch.linalg.svdvals(ups @ downs)  # (6, 16), float64: the reference spectrum
    got = update_metrics(S[:, :8], torch.ones(6, dtype=torch.float64), torch.full((6,), 8.0))
    held = S.square().cumsum(-1) / S.square().sum(-1, keepdim=True)  # energy of the top r
    least = (held < 0.9).sum(-1) + 1  # the least r with at least 90 %
    assert got["update_energy_rank_90"].tolist() == least.double().tolist()


def reference_fit(S: torch.Tensor, first: int) -> tuple[float, float]:
    """float64 least squares of log sigma_i on log i over the positive values of the 1-D window
    ``S`` of ranks ``first ..``: ``(alpha, r2)``."""
    ranks = torch.arange(first, first + S.shape[-1], dtype=torch.float64)
    keep = S > 0
    x, y = ranks[keep].log(), S[keep].double().log()
    X = torch.stack([x, torch.ones_like(x)], -1)
    slope, intercept = torch.linalg.lstsq(X, y[:, None]).solution[:, 0].tolist()
    residual = y - (slope * x + intercept)
    return -slope, 1 - float(residual.square().sum() / (y - y.mean()).square().sum())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("window", [None, (1, 10), (4, 32)])
def test_the_fit_of_an_all_positive_spectrum_agrees_with_the_masked_fit_and_float64(
    window: tuple[int, int] | None, seed: int
) -> None:
    # Every value > 0 (read once on the host): the fit runs without masks on the kept centered
    # log ranks. The same numbers as the masked fit, and as float64 least squares.
    g = torch.Generator().manual_seed(seed)
    S = torch.rand(5, 32, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    S = S * torch.arange(1, 33, dtype=torch.float64).pow(-torch.rand(5, 1, generator=g) * 2)
    first, last = metrics_module._window(window, 32)
    fast = metrics_module._fit(S[..., first - 1 : last], first, True)
    masked = metrics_module._fit(S[..., first - 1 : last], first, False)
    for got, want in zip(fast, masked, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for i in range(5):
        alpha, r2 = reference_fit(S[i, first - 1 : last], first)
        assert fast[0][i].item() == pytest.approx(alpha, rel=1e-9, abs=1e-12)
        assert fast[1][i].item() == pytest.approx(r2, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(
    ("S", "positive"),
    [
        (torch.arange(1, 33, dtype=torch.float32).pow(-0.7), True),
        (torch.full((32,), 2.0), True),  # a flat window is an exact fit: R^2 = 1
        (torch.cat([torch.arange(1, 21, dtype=torch.float32).pow(-0.7), torch.zeros(12)]), False),
        (torch.tensor([[3.0, 2.0, 1.0, 0.5], [math.nan] * 4]), False),
    ],
    ids=["power-law", "flat", "zeros-below-the-rank-tolerance", "nan"],
)
def test_metrics_from_spectrum_masks_ranks_only_where_a_value_is_not_positive(
    S: torch.Tensor, positive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whichever way the fit runs, every metric is what each metric's own function and float64
    # give: zeros are left out of the fit, NaN gives NaN.
    taken: list[bool] = []
    fit = metrics_module._fit

    def spy(window: torch.Tensor, first: int, all_positive: bool) -> tuple[torch.Tensor, ...]:
        taken.append(all_positive)
        return fit(window, first, all_positive)

    monkeypatch.setattr(metrics_module, "_fit", spy)
    frobenius_sq = S.double().square().sum(-1) * 1.05  # a tail beyond the top k
    out = metrics_from_spectrum(S, frobenius_sq)
    assert taken == [positive]
    expected = {
        "stable_rank": stable_rank(S, frobenius_sq).float(),
        "energy_rank_90": energy_rank(S, frobenius_sq),
        "spectral_norm": S[..., 0].float(),
        "frobenius_norm": frobenius_sq.sqrt().float(),
    }
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value, equal_nan=True)
    assert not out["energy_rank_90"].isnan().all()  # 95 % of the energy lies in the top k
    rows = zip(
        S.reshape(-1, S.shape[-1]), out["alpha"].flatten(), out["alpha_r2"].flatten(), strict=True
    )
    for row, alpha, r2 in rows:
        if row.isnan().any():
            assert alpha.isnan() and r2.isnan()
            continue
        want_alpha, want_r2 = reference_fit(row, 1)
        assert alpha.item() == pytest.approx(want_alpha, abs=1e-6)
        assert r2.item() == pytest.approx(1.0 if row.unique().numel() == 1 else want_r2, abs=1e-6)


@pytest.mark.parametrize("scale", [2.0**-40, 2.0**64, 2.0**100])
def test_metrics_of_a_matrix_far_from_unit_scale_are_its_unit_scale_metrics(scale):
    # Scaling W by a power of two is exact in float32 and leaves every scale-free metric as it
    # is; a float32 square of sigma_1 (~1e19 and up) or of a row norm overflows on the way.
    W = torch.randn(64, 48, generator=torch.Generator().manual_seed(run_seed()))
    S64 = torch.linalg.svdvals(W.double())
    out = spectral_metrics(W * scale)
    want = (S64.square().sum() / S64[0].square()).item()
    assert out["stable_rank"].item() == pytest.approx(want, rel=1e-5)
    assert out["spectral_norm"].item() == pytest.approx(S64[0].item() * scale, rel=1e-5)
    assert out["frobenius_norm"].item() == pytest.approx(S64.norm().item() * scale, rel=1e-5)
    unit = spectral_metrics(W)
    assert out["alpha"].item() == pytest.approx(unit["alpha"].item(), rel=1e-4)


def float64_metrics(S: torch.Tensor, frobenius_sq: torch.Tensor, energy: float) -> dict[str, list]:
    """Each metric of every row of ``S`` (..., k) from float64 and least squares, row by row."""
    rows = S.double().reshape(-1, S.shape[-1])
    frob = frobenius_sq.double().reshape(-1)
    out: dict[str, list] = {"stable_rank": [], "alpha": [], "alpha_r2": [], "energy": []}
    for row, f in zip(rows, frob, strict=True):
        out["stable_rank"].append((f / row[0] ** 2).item())
        alpha, r2 = reference_fit(row, 1)
        out["alpha"].append(alpha)
        out["alpha_r2"].append(r2)
        held = row.square().cumsum(-1)
        reached = (held >= energy * f).nonzero()
        out["energy"].append(reached[0].item() + 1.0 if len(reached) else math.nan)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batch", [(), (1,), (5,), (2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_metrics_of_a_positive_spectrum_are_the_float64_metrics(
    batch: tuple[int, ...], dtype: torch.dtype, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every value > 0 on the CPU: the metrics are computed in numpy on the host, one batch at
    # once, and are the float64 metrics of each row (and, where torch runs the same cores, the
    # same numbers to float64 rounding).
    g = torch.Generator().manual_seed(seed)
    k = 32
    S = torch.rand(*batch, k, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    decay = torch.rand(*batch, 1, generator=g, dtype=torch.float64) * 2
    S = S * torch.arange(1, k + 1, dtype=torch.float64).pow(-decay) * 10.0 ** (4 * decay - 4)
    S = S.to(dtype)
    tail = 1 + torch.rand(batch, generator=g, dtype=torch.float64)  # energy beyond the top k
    frobenius_sq = S.double().square().sum(-1) * tail
    hosts: list[bool] = []
    host_arrays = metrics_module._host_arrays

    def spy(*args: torch.Tensor) -> Any:
        arrays = host_arrays(*args)
        hosts.append(arrays is not None)
        return arrays

    monkeypatch.setattr(metrics_module, "_host_arrays", spy)
    out = metrics_from_spectrum(S, frobenius_sq, energy=0.6)
    assert hosts == [True]
    assert all(v.dtype == torch.float32 and v.shape == batch for v in out.values())
    want = float64_metrics(S, frobenius_sq, 0.6)
    flat = {name: out[name].flatten().tolist() for name in out}
    assert flat["stable_rank"] == pytest.approx(want["stable_rank"], rel=1e-6)
    assert flat["alpha"] == pytest.approx(want["alpha"], rel=1e-6, abs=1e-6)
    assert flat["alpha_r2"] == pytest.approx(want["alpha_r2"], rel=1e-6, abs=1e-6)
    assert flat["energy_rank_60"] == pytest.approx(want["energy"], nan_ok=True)
    assert flat["spectral_norm"] == S[..., 0].float().flatten().tolist()
    assert flat["frobenius_norm"] == frobenius_sq.sqrt().float().flatten().tolist()
    # The same cores in torch (what an accelerator or a masked spectrum runs).
    torch_values = metrics_module._metrics(S.double(), frobenius_sq, 1, k, 0.6, positive=True)
    for name, value in zip(
        ("stable_rank", "alpha", "alpha_r2", "frobenius_norm", "energy_rank_60"),
        torch_values,
        strict=True,
    ):
        torch.testing.assert_close(out[name], value.float(), rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("k", [3, 5, 7, 17, 32])
def test_a_flat_window_is_an_exact_fit_whatever_its_value(k: int) -> None:
    # A flat window has var(y) = 0 exactly, so R^2 = 1 and alpha = 0, for any value (the mean of
    # k equal logs is not always that log in floating point; the fit shifts by the first value).
    values = torch.rand(
        50, 1, generator=torch.Generator().manual_seed(run_seed()), dtype=torch.float64
    )
    S = (values * 10.0 ** torch.randint(-20, 20, (50, 1))).expand(50, k)
    for spectrum in (S, S.float()):
        out = metrics_from_spectrum(spectrum, spectrum.double().square().sum(-1))
        assert torch.equal(out["alpha_r2"], torch.ones(50)), spectrum.dtype
        assert torch.equal(out["alpha"].abs(), torch.zeros(50)), spectrum.dtype
        alpha, r2 = powerlaw_alpha(spectrum)
        assert torch.equal(r2, torch.ones(50)) and torch.equal(alpha.abs(), torch.zeros(50))


def test_a_spectrum_that_is_not_positive_everywhere_takes_torch_and_keeps_each_rows_metrics() -> (
    None
):
    # One row with zeros below the rank tolerance, one NaN row, in a batch of positive rows: the
    # batch takes the masked torch path; the positive rows read as on the host.
    g = torch.Generator().manual_seed(run_seed())
    S = torch.rand(4, 16, generator=g, dtype=torch.float64).sort(-1, descending=True).values + 0.1
    frobenius_sq = S.square().sum(-1) * 1.05  # 90 % of the energy lies within the top k
    alone = metrics_from_spectrum(S, frobenius_sq)
    S_mixed = S.clone()
    S_mixed[1, 10:] = 0.0
    S_mixed[2] = math.nan
    out = metrics_from_spectrum(S_mixed, frobenius_sq)
    assert not alone["energy_rank_90"].isnan().any()
    for name in out:
        torch.testing.assert_close(
            out[name][[0, 3]], alone[name][[0, 3]], rtol=1e-6, atol=1e-7, equal_nan=True
        )
        assert out[name][2].isnan() or name in ("frobenius_norm",), name
    alpha, r2 = reference_fit(S_mixed[1], 1)  # the zeros left out of the fit
    assert out["alpha"][1].item() == pytest.approx(alpha, rel=1e-6)
    assert out["alpha_r2"][1].item() == pytest.approx(r2, rel=1e-6)


def test_a_spectrum_that_carries_a_graph_or_an_empty_batch_gets_its_metrics() -> None:
    S = torch.tensor([[4.0, 2.0, 1.0, 0.5]], dtype=torch.float64, requires_grad=True)
    frobenius_sq = torch.tensor([22.0], dtype=torch.float64)  # 90 % within the top 4
    out = metrics_from_spectrum(S, frobenius_sq)  # torch (numpy cannot hold a graph)
    plain = metrics_from_spectrum(S.detach(), frobenius_sq)  # the host
    for name in out:
        torch.testing.assert_close(out[name].detach(), plain[name], rtol=1e-6, atol=0)
    assert not plain["energy_rank_90"].isnan()
    empty = metrics_from_spectrum(torch.ones(0, 8), torch.ones(0, dtype=torch.float64))
    assert set(empty) == KEYS and all(v.shape == (0,) for v in empty.values())


def test_the_host_metrics_of_known_power_laws() -> None:
    # sigma_i = i^-a on ranks 1..32: alpha = a and R^2 = 1 exactly, stable rank = ||W||_F^2, and
    # the energy rank is the least r whose first r squares hold the fraction (float64 count).
    a = torch.tensor([0.25, 0.5, 1.0, 1.5, 2.0], dtype=torch.float64)[:, None]
    S = torch.arange(1, 33, dtype=torch.float64).pow(-a)  # (5, 32)
    frobenius_sq = S.square().sum(-1) * 1.01
    out = metrics_from_spectrum(S, frobenius_sq, energy=0.8)
    assert metrics_module._host_arrays(S, frobenius_sq) is not None  # the host computed these
    torch.testing.assert_close(out["alpha"], a[:, 0].float())
    torch.testing.assert_close(out["alpha_r2"], torch.ones(5))
    torch.testing.assert_close(out["stable_rank"], frobenius_sq.float())
    held = S.square().cumsum(-1)
    want = ((held < 0.8 * frobenius_sq[:, None]).sum(-1) + 1).float()
    want[held[:, -1] < 0.8 * frobenius_sq] = math.nan
    torch.testing.assert_close(out["energy_rank_80"], want, equal_nan=True)
    assert not want.isnan().all()
