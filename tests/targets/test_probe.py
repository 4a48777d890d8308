"""The checks of targets/ in their own numerics: autocast off, a tolerance by the module's arithmetic.

``computes_weight`` (verify.py) and the LoRA-style verification (lowrank.py) may run inside the
user's first training forward, under bf16 or fp16 autocast. There they must still accept every
projection that computes ``x W^T + b`` (with non-zero biases, as in every checkpoint) and still
refuse one that computes something else; an FP8 module (a float32 master weight, an FP8 product)
is checked at a tolerance of its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spectral_callbacks.targets import find_targets
from spectral_callbacks.targets.lowrank import Layout, recognise
from spectral_callbacks.targets.probe import is_float8, probing, tolerance, unit_roundoff
from spectral_callbacks.targets.verify import computes_weight

AUTOCAST = [torch.bfloat16, torch.float16]


def biased_linear(seed: int, dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(64, 48)
    with torch.no_grad():
        layer.bias.normal_(0.0, 1.0)  # a checkpoint's biases: the GEMM and the bias rounded apart
    return layer.to(dtype)


class Doubled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_a_biased_projection_is_accepted_inside_autocast(autocast: torch.dtype, seed: int) -> None:
    # before: inside autocast the module computed in bf16/fp16, ~2e-3 away from x W^T + b, and the
    # float32 tolerance (1e-4) refused every biased projection
    layer = biased_linear(seed)
    with torch.autocast("cpu", dtype=autocast):
        assert computes_weight(layer, layer.weight) is None


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_a_module_that_computes_another_matrix_is_still_refused_inside_autocast(
    autocast: torch.dtype,
) -> None:
    layer = Doubled(64, 48)
    with torch.autocast("cpu", dtype=autocast):
        reason = computes_weight(layer, layer.weight)
    assert reason is not None and "relative difference 1 " in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weights_stored_in_half_precision_are_checked_at_their_own_tolerance(
    dtype: torch.dtype,
) -> None:
    for seed in range(5):
        layer = biased_linear(seed, dtype)
        assert computes_weight(layer, layer.weight) is None
    doubled = Doubled(64, 48).to(dtype)
    assert computes_weight(doubled, doubled.weight) is not None


def test_probing_turns_autocast_and_autograd_off_and_restores_them() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with probing(torch.device("cpu")):
            assert not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()
        assert torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()


def test_the_tolerance_follows_the_arithmetic_the_module_computes_in() -> None:
    layer = nn.Linear(4, 4)
    assert unit_roundoff(layer, layer.weight) == torch.finfo(torch.float32).eps
    assert tolerance(layer, layer.weight) == 1e-4
    half = nn.Linear(4, 4).to(torch.bfloat16)
    assert tolerance(half, half.weight) == 4 * torch.finfo(torch.bfloat16).eps
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 products allowed
        assert unit_roundoff(layer, layer.weight) == 2.0**-10
    finally:
        torch.set_float32_matmul_precision(previous)


def _float8_model() -> nn.Module:
    """A two-layer MLP converted by torchao to Float8Linear (float32 master weights, FP8 GEMMs),
    with non-zero biases."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.bias.normal_(0.0, 1.0)
    float8.convert_to_float8_training(model)
    return model


def test_an_fp8_module_is_checked_at_the_tolerance_of_its_fp8_product() -> None:
    # before: its FP8 product (~4e-2 from x W^T + b) was refused at the float32 tolerance
    model = _float8_model()
    layer = model[0]
    assert is_float8(layer) and layer.weight.dtype == torch.float32
    assert tolerance(layer, layer.weight) == 0.2
    for autocast in (None, torch.bfloat16):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            assert computes_weight(layer, layer.weight) is None
    doubled = _float8_model()[0]
    doubled.forward = lambda x: 2 * type(doubled).forward(doubled, x)  # type: ignore[method-assign]
    assert computes_weight(doubled, doubled.weight) is not None


class HandLoRA(nn.Module):
    """A hand-written LoRA layer with a biased base: ``x W^T + b + 0.5 (x A^T) B^T``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = biased_linear(0)
        self.down = nn.Parameter(torch.randn(4, 64) / 8)
        self.up = nn.Parameter(torch.randn(48, 4) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + 0.5 * (x @ self.down.T) @ self.up.T


@pytest.mark.parametrize("autocast", AUTOCAST, ids=str)
def test_a_lora_style_layer_is_verified_inside_autocast(autocast: torch.dtype) -> None:
    # before: its probe ran in the user's autocast at a float32 tolerance, and it was refused
    layer = HandLoRA()
    with torch.autocast("cpu", dtype=autocast):
        layout = recognise(layer)
    assert isinstance(layout, Layout) and layout.scale == pytest.approx(0.5, rel=1e-6)


def test_find_targets_inside_autocast_finds_what_it_finds_outside() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.5)
    outside = [(t.name, t.role) for t in find_targets(layer)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = [(t.name, t.role) for t in find_targets(layer)]
    assert inside == outside and len(outside) == 6
