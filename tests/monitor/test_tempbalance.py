"""TempBalance's own method, reproduced from its published formulas (Zhou et al., NeurIPS 2023, and
its reference code's ``pl_fitting='median'``, ``tb_linear_map``): the α fit on random spectra, and
the factors a balanced training run logs, per preset, against the same formulas applied to the
trained model's weights.

The reference here is written from the formulas, in float64 Python: with the ``N`` eigenvalues
λ = σ² of a weight ascending, ``i = int(N / 2)``, ``x_min = λ_i``, ``n = N - i``,
``α = 1 + n / (Σ_{j≥i} log λ_j − n log λ_i)``,
``D = max_k |1 − (λ_{i+k} / x_min)^(1−α) − k / n|``; the factor of each balanced unit is
``np.interp(α, [min α, max α], [low, high])``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gpt import GPT, GPTConfig
from tiny_models import read_scalars

from spectral_callbacks import LRBalance, SpectralTracker, balanced_param_groups
from spectral_callbacks.functional.esd import esd_eigenvalues, esd_fit_median
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.names import scalar_tag


def median_fit(evals: list[float]) -> tuple[float, float]:
    """(α, D) of TempBalance's median fit, from its formulas, one spectrum, float64."""
    evals = sorted(evals)
    i = int(len(evals) / 2)
    xmin, n = evals[i], len(evals) - i
    alpha = 1 + n / (sum(math.log(x) for x in evals[i:]) - n * math.log(xmin))
    ks = max(abs(1 - (x / xmin) ** (1 - alpha) - k / n) for k, x in enumerate(evals[i:]))
    return alpha, ks


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(64, 48), (33, 101), (7, 7)])
def test_the_median_fit_is_tempbalances_estimator_on_random_spectra(seed, shape) -> None:
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(shape, generator=generator, dtype=torch.float64)  # Marchenko-Pastur
    # heavy-tailed: a power-law spectrum of exponent 1 + 2 * 0.7 in eigenvalues
    u, _, v = torch.linalg.svd(torch.randn(shape, generator=generator, dtype=torch.float64))
    k = min(shape)
    sigma = torch.arange(1, k + 1, dtype=torch.float64).pow(-0.7) * (
        1 + torch.rand(k, generator=generator, dtype=torch.float64)
    )
    heavy = u[:, :k] @ torch.diag(sigma) @ v[:k]
    for W in (gaussian, heavy):
        evals = esd_eigenvalues(W)
        fit = esd_fit_median(evals)
        want_alpha, want_ks = median_fit(evals.tolist())
        assert float(fit.alpha) == pytest.approx(want_alpha, rel=1e-12)
        assert float(fit.ks_distance) == pytest.approx(want_ks, rel=1e-9, abs=1e-12)
        assert int(fit.tail_size) == k - k // 2
    batch = torch.stack([gaussian, gaussian.flip(0)])  # a batch gives each its own fit
    torch.testing.assert_close(
        esd_fit_median(esd_eigenvalues(batch)).alpha,
        esd_fit_median(esd_eigenvalues(gaussian)).alpha.expand(2),
    )


PRESETS = {
    "default (median fit, band [0.7, 1.3])": LRBalance(),
    "language_model() (band [1, 2], first/last and < 50 eigenvalues left out)": LRBalance.language_model(),
    "xmin_scan (WeightWatcher's fit)": LRBalance(fit="xmin_scan"),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_trained_models_logged_factors_are_tempbalances_per_preset(
    tmp_path: Path, preset: str
) -> None:
    balance = PRESETS[preset]
    torch.manual_seed(0)
    # Separate q/k/v projections: each watched module is one matrix, as TempBalance balances each
    # Linear; K and V (32 x 64) have fewer than 50 eigenvalues, Q, O and the MLP 64 or more.
    model = GPT(
        GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, block_size=16, attention="gqa")
    )
    optimizer = torch.optim.AdamW(balanced_param_groups(model, weight_decay=0.1), lr=3e-3)
    tokens = torch.randint(0, 256, (12, 4, 17), generator=torch.Generator().manual_seed(1))
    tracker = SpectralTracker(
        model, logdir=tmp_path, optimizer=optimizer, lr_balance=balance, synchronous=True,
        figures=False, every_n_steps=4, esd_every_n_snapshots=3, log_spaced_until=0,
    )  # fmt: skip
    for step in range(1, 13):
        _, loss = model(tokens[step - 1, :, :-1], tokens[step - 1, :, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    logged = read_scalars(tmp_path)
    # The units in the targets' order, each module's weight as it is after the last step (the
    # last step's snapshot carries the ESD family).
    units = [(t.layer, t.role, t.parameter_name) for t in tracker.targets]
    weights = dict(model.named_parameters())
    alphas = []
    for _, _, name in units:
        evals = torch.linalg.svdvals(weights[name].detach().double()).square().tolist()
        if balance.fit == "median":
            alphas.append(median_fit(evals)[0])
        else:  # WeightWatcher's fit, tested against weightwatcher itself elsewhere
            layer, role, _ = units[len(alphas)]
            alphas.append(logged[scalar_tag("esd_alpha", layer, role)][12])
    kept = [
        i for i, (_, _, name) in enumerate(units)
        if min(weights[name].shape) >= balance.min_eigenvalues
        and not (balance.skip_first_last and i in (0, len(units) - 1))
    ]  # fmt: skip
    assert len(kept) >= 2 and (len(kept) < len(units)) == (balance.min_eigenvalues > 0)
    mapped = np.interp(
        [alphas[i] for i in kept], [min(alphas[i] for i in kept), max(alphas[i] for i in kept)],
        [balance.low, balance.high],
    )  # fmt: skip
    want = dict.fromkeys(range(len(units)), 1.0) | dict(zip(kept, mapped, strict=True))
    for i, (layer, role, _) in enumerate(units):
        got = logged[scalar_tag("lr_factor", layer, role)][12]
        assert got == pytest.approx(want[i], abs=1e-5), (preset, layer, role)
    if balance.fit == "median":
        for i, (layer, role, _) in enumerate(units):
            logged_alpha = logged[scalar_tag("esd_alpha_median", layer, role)][12]
            assert logged_alpha == pytest.approx(alphas[i], rel=1e-5)


def test_a_bad_fit_or_exclusion_fails_at_construction() -> None:
    with pytest.raises(
        ConfigurationError, match=r"`fit` must be one of \('median', 'xmin_scan'\), got 'hill'"
    ):
        LRBalance(fit="hill")
    with pytest.raises(
        ConfigurationError, match=r"`min_eigenvalues` must be an int >= 0, e.g. 50, got -1"
    ):
        LRBalance(min_eigenvalues=-1)
    with pytest.raises(ConfigurationError, match=r"`skip_first_last` must be a bool, got 1"):
        LRBalance(skip_first_last=1)  # type: ignore[arg-type]
