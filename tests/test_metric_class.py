"""StableRank (torchmetrics) against the float64 stable rank of the stacked rows."""

from __future__ import annotations

import random

import pytest
import torch
from seeds import run_seed

from spectral_callbacks.metric import StableRank

SEEDS = [0, run_seed()]


def reference(X: torch.Tensor) -> float:
    X = X.double()
    return (X.square().sum() / torch.linalg.svdvals(X)[0] ** 2).item()


@pytest.mark.parametrize("seed", SEEDS)
def test_accumulated_batches_match_the_stacked_matrix(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batches = [
        torch.randn(n, 16, generator=g) @ torch.randn(16, 16, generator=g) for n in (5, 12, 1)
    ]
    metric = StableRank(num_features=16)
    for batch in batches:
        metric.update(batch.to(torch.bfloat16).float())
    expected = reference(torch.cat([b.to(torch.bfloat16).float() for b in batches]))
    assert metric.compute().item() == pytest.approx(expected, rel=1e-9)


def test_leading_dimensions_are_rows_and_reset_clears() -> None:
    x = torch.randn(2, 7, 8)  # (B, T, d) activations
    metric = StableRank(num_features=8)
    metric.update(x)
    assert metric.compute().item() == pytest.approx(reference(x.reshape(-1, 8)), rel=1e-9)
    metric.reset()
    with pytest.warns(UserWarning, match="called before the ``update``"):
        assert metric.compute().isnan()  # nothing seen: undefined


def test_center_removes_a_shared_offset() -> None:
    # Rows = a large common offset + isotropic noise: uncentered stable rank is ~1
    g = torch.Generator().manual_seed(random.randrange(2**31))
    x = 100.0 + torch.randn(500, 6, generator=g)
    centered = StableRank(num_features=6, center=True)
    centered.update(x[:200])
    centered.update(x[200:])
    plain = StableRank(num_features=6)
    plain.update(x)
    assert centered.compute().item() == pytest.approx(reference(x - x.mean(0)), rel=1e-6)
    assert plain.compute().item() == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_features": 0}, r"`num_features` must be a positive int, got 0"),
        ({"num_features": 2.0}, r"got 2.0"),
    ],
)
def test_bad_num_features_is_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StableRank(**kwargs)


def test_bad_rows_are_named() -> None:
    metric = StableRank(num_features=4)
    with pytest.raises(
        ValueError, match=r"`rows` must have last dimension num_features=4, got shape \(3, 5\)"
    ):
        metric.update(torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"`rows` must be a floating-point tensor"):
        metric.update(torch.ones(3, 4, dtype=torch.int64))
