"""How the checks of ``targets/`` run a module: in their own numerics, not the training run's.

A check (``verify.py``: does the module compute ``x W^T + b``? ``lowrank.py``: is it
``W_0 x + s B A x``?) runs the module on random inputs and compares with the formula. It may run
inside the user's forward (the first training forward, under ``torch.autocast``), where a bf16
product of a biased projection is rounded ~2e-3 away from the formula and a tolerance made for
float32 would refuse every projection of a checkpoint. So:

* :func:`probing` runs the module with autocast off and without autograd: it computes in the
  dtype of its own weights, as the snapshot reads them;
* :func:`tolerance` is set by the arithmetic the module then computes in (:func:`unit_roundoff`):
  its weights' dtype; float32 products at reduced precision where the process allows them (TF32,
  ``torch.set_float32_matmul_precision("high")``); FP8 products of a ``Float8Linear``-style module
  (a float32 master weight, an ``float8_e4m3`` product), recognised by its class name.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(4, 3).to(torch.bfloat16)
    >>> unit_roundoff(layer, layer.weight) == torch.finfo(torch.bfloat16).eps
    True
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), probing(layer.weight.device):
    ...     torch.is_autocast_enabled("cpu")
    False
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from spectral_callbacks.functional.precision import tf32_enabled

__all__ = ["is_float8", "probing", "tolerance", "unit_roundoff"]

# A float8 product's class (or a base class), by the names FP8 training libraries give it
# (torchao's Float8Linear, hand-written Fp8Linear): its weight is a high-precision master.
_FLOAT8_CLASS = re.compile(r"float8|fp8", re.IGNORECASE)
# e4m3 keeps 3 mantissa bits, so x and W are each rounded by up to 2^-4 relative and the product
# differs from x W^T by ~4 % on random inputs; a different matrix (a scale, a mask, another
# weight) differs by ~1: 0.2 tells them apart.
_FLOAT8_TOLERANCE = 0.2

# Reduced float32 matmul precisions (torch.set_float32_matmul_precision, the backends' fp32_precision).
_TF32 = 2.0**-10
_BF16 = torch.finfo(torch.bfloat16).eps
_FLOAT32 = torch.finfo(torch.float32).eps
_LEGACY = {"highest": _FLOAT32, "high": _TF32, "medium": _BF16}
_BACKEND = {"ieee": _FLOAT32, "tf32": _TF32, "bf16": _BF16}


@contextlib.contextmanager
def probing(device: torch.device) -> Iterator[None]:
    """Autocast off (for ``device``'s type and the CPU) and no autograd, for a check's forward."""
    with contextlib.ExitStack() as stack:
        for device_type in dict.fromkeys((device.type, "cpu")):
            if device_type in ("cpu", "cuda", "xpu", "mps", "hpu"):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(torch.no_grad())
        yield


def is_float8(module: nn.Module) -> bool:
    """``module`` computes its product in FP8 (by its class's or a base class's name)."""
    return any(_FLOAT8_CLASS.search(kind.__name__) for kind in type(module).__mro__)


def unit_roundoff(module: nn.Module, weight: torch.Tensor) -> float:
    """The machine epsilon of the arithmetic ``module`` computes in with autocast off."""
    if is_float8(module):
        return float(torch.finfo(torch.float8_e4m3fn).eps)
    if weight.dtype != torch.float32:
        return float(torch.finfo(weight.dtype).eps) if weight.dtype.is_floating_point else 0.0
    return _float32_matmul(weight.device.type)


def tolerance(module: nn.Module, weight: torch.Tensor, floor: float = 1e-4) -> float:
    """A relative difference a product in ``module``'s arithmetic stays within on random inputs:
    a few of its rounding units (bf16: 3e-2, fp16 and TF32: 4e-3), ``floor`` at float32 and
    float64 (sums over thousands of terms), 0.2 for an FP8 product (~4e-2 from the formula). A
    different matrix (a scaled or an adapted weight) is off by a relative difference of order 1."""
    if is_float8(module):
        return _FLOAT8_TOLERANCE
    return max(floor, 4.0 * unit_roundoff(module, weight))


def _float32_matmul(device_type: str) -> float:
    """The epsilon float32 products are computed with on ``device_type`` (TF32 where allowed)."""
    if device_type == "cuda":  # every way of setting it, resolved where the engine reads it too
        return _TF32 if tf32_enabled() else _FLOAT32
    backend = {"cpu": "mkldnn"}.get(device_type)
    with warnings.catch_warnings():  # the legacy settings' deprecation notes
        warnings.simplefilter("ignore")
        try:
            matmul = getattr(getattr(torch.backends, backend), "matmul", None) if backend else None
            chosen = getattr(matmul, "fp32_precision", None)
            if chosen in _BACKEND:
                return _BACKEND[chosen]
            return _LEGACY.get(torch.get_float32_matmul_precision(), _BF16)
        except RuntimeError:  # legacy and new precision settings mixed: assume the loosest
            return _BF16
