"""DeltaMatrices (functional/delta.py) as an operator: its products, norm and formed weights
against float64 dense references, its slices holding no copy, and the randomized SVD through it
against float64 ``svdvals``."""

from __future__ import annotations

import pytest
import torch

from spectral_callbacks.functional import randomized_svd
from spectral_callbacks.functional.delta import DeltaMatrices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_products_norm_and_weights_are_the_dense_copys(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    current = torch.randn(3, 24, 16, generator=generator).to(dtype)
    references = tuple(torch.randn(24, 16, generator=generator) for _ in range(3))
    batch = DeltaMatrices.of(current, references).float()
    W = current.double()
    X, Y = torch.randn(3, 16, 5, dtype=torch.float64), torch.randn(3, 24, 5, dtype=torch.float64)
    assert batch.dtype == torch.float32 and batch.current.dtype == dtype  # no batch copy
    torch.testing.assert_close(batch.matmul(X.float()).double(), W @ X, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.rmatmul(Y.float()).double(), W.mT @ Y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        batch.frobenius_norm_sq(), W.square().sum((-2, -1)), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(batch.dense().double(), W)
    assert batch.nbytes == current.numel() * current.element_size()
    part = batch[1:2]
    assert (len(part), part.nbytes) == (1, 0) and part.references == references[1:2]
    torch.testing.assert_close(part.dense().double(), W[1:2])


def test_the_randomized_svd_through_it_is_the_dense_weights():
    generator = torch.Generator().manual_seed(1)
    current = torch.randn(2, 64, 48, generator=generator)
    batch = DeltaMatrices.of(current, (torch.zeros(64, 48),) * 2)
    S = randomized_svd(batch, 8, method="randomized", tol=1e-6).S
    exact = torch.linalg.svdvals(current.double())[:, :8]
    torch.testing.assert_close(S.double(), exact, rtol=1e-4, atol=0)
