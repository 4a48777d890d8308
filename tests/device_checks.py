"""CPU stand-ins for properties of an accelerator, so that the CPU suite can catch their defects.

* ``factories_elsewhere``: a tensor made without ``device=`` (``torch.full(shape, x)``) lands on
  the default device. On a GPU run that is the CPU while the inputs are on CUDA, and mixing them
  fails; here the inputs are on the CPU and the default device is ``meta``, so the same mistake
  fails the same way, with "Tensor on device meta is not on the expected device cpu".
* ``tf32_matmuls``: every float32 matrix product rounds its operands to TF32 (10 mantissa bits,
  round to nearest), as cuBLAS does with TF32 enabled, and ``functional/precision.py`` is told
  TF32 is on, so its full-precision products take the path they take on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode


@contextlib.contextmanager
def factories_elsewhere() -> Iterator[None]:
    """Make ``meta`` the default device for the duration: a tensor made without ``device=``
    cannot be combined with the (CPU) inputs."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def round_to_tf32(X: torch.Tensor) -> torch.Tensor:
    """``X`` rounded to the nearest TF32 value (the low 13 mantissa bits cleared, rounding)."""
    bits = X.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -8192).view(torch.float32)  # -8192 = ~0x1FFF


_PRODUCTS = {
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.bmm,
    torch.Tensor.addmm,
    torch.Tensor.addmm_,
    torch.Tensor.baddbmm,
    torch.Tensor.baddbmm_,
}


class _TF32Products(TorchFunctionMode):
    """Rounds the matrix operands of every float32 product to TF32 (not the added term of
    ``addmm``: cuBLAS accumulates ``beta C`` in float32)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            args = list(args)
            first = 1 if func.__name__.startswith(("addmm", "baddbmm")) else 0
            for index in range(first, min(first + 2, len(args))):
                operand = args[index]
                if isinstance(operand, torch.Tensor) and operand.dtype == torch.float32:
                    args[index] = round_to_tf32(operand)
        return func(*args, **kwargs)


@contextlib.contextmanager
def tf32_matmuls(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Float32 products in TF32 on the CPU, with the precision module seeing TF32 enabled."""
    from spectral_callbacks.functional import precision

    monkeypatch.setattr(precision, "tf32_in_use", lambda X: X.dtype == torch.float32)
    with _TF32Products():
        yield
