"""SpectrumCompute's warm start: each shape group's next snapshot starts from its last subspace."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from spectral_callbacks.monitor.engines import compute as compute_module
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.snapshot import ShapeGroup

_PRODUCTS = {torch.matmul, torch.bmm, torch.baddbmm, torch.mm, torch.Tensor.__matmul__}


class _CountProducts(TorchFunctionMode):
    """Counts the matrix products (every Krylov step is a pair of them with W)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in _PRODUCTS
        return func(*args, **(kwargs or {}))


def test_each_groups_second_snapshot_starts_from_its_first_subspace_and_costs_fewer_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    starts: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
    svd = compute_module.randomized_svd

    def recording_svd(batch: torch.Tensor, k: int, *, init: Any = None, **options: Any) -> Any:
        top = svd(batch, k, init=init, **options)
        starts.append((tuple(batch.shape), init, top.V))
        return top

    monkeypatch.setattr(compute_module, "randomized_svd", recording_svd)
    generator = torch.Generator().manual_seed(0)
    groups = {
        ShapeGroup("192x128/float32/cpu", ()): torch.randn(3, 192, 128, generator=generator),
        ShapeGroup("128x256/float32/cpu", ()): torch.randn(2, 128, 256, generator=generator),
    }
    compute = SpectrumCompute(k=16, method="randomized")
    products = []
    for snapshot in range(2):
        for group, weights in groups.items():
            moved = weights + 1e-3 * snapshot * torch.randn(weights.shape, generator=generator)
            with _CountProducts() as counter:
                values = compute(group, moved)
            products.append(counter.count)
            reference = torch.linalg.matrix_norm(moved.double(), ord=2)
            assert torch.allclose(values["spectral_norm"].double(), reference, rtol=1e-3)
    (cold_a, none_a, v_a), (cold_b, none_b, v_b), (warm_a, init_a, _), (warm_b, init_b, _) = starts
    assert none_a is None and none_b is None  # the first snapshot starts cold
    assert init_a is v_a and init_b is v_b  # the second starts from the same group's subspace
    assert products[2] < products[0] and products[3] < products[1]
