"""Does the module compute ``W x`` for the ``W`` a snapshot copies? Checked once, on random inputs.

A weight can look like a projection's and still not be the matrix its module applies: a
hand-written adapter adds ``B A x`` to its frozen ``weight``, a custom layer rescales or masks it.
Charting that ``weight`` would draw a plausible spectrum of the wrong matrix. So every watched
weight's module is run once at discovery on a few random rows and compared with ``x W^T (+ b)``;
a module that does something else is refused with the reason, never watched.

A module whose forward is not a one-tensor call (``nn.MultiheadAttention`` owns ``in_proj_weight``
but takes query, key and value) cannot be checked this way and is left to the rules that read it.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(4, 3)
    >>> computes_weight(layer, layer.weight) is None
    True
    >>> class Scaled(torch.nn.Linear):
    ...     def forward(self, x):
    ...         return 2 * super().forward(x)
    >>> scaled = Scaled(4, 3)
    >>> computes_weight(scaled, scaled.weight)
    'its forward is not x W^T + b for this weight (relative difference 1 on random inputs)'
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["computes_weight"]

_ROWS = 3  # random input rows: enough to see a different matrix, cheap at any width

# Layers that keep a high-precision master weight and multiply in FP8 (torchao's Float8Linear):
# the weight is the matrix trained and watched; e4m3 keeps 3 mantissa bits, so x and W are each
# rounded by up to 2^-4 relative and the product differs from x W^T by ~4 % on random inputs.
# A different matrix (a scale, a mask, another weight) differs by ~1: 0.2 tells them apart.
_FP8_PRODUCT = frozenset({"Float8Linear"})
_FP8_TOLERANCE = 0.2


def computes_weight(
    module: nn.Module, weight: torch.Tensor, transposed: bool = False
) -> str | None:
    """``None`` if ``module(x) == x W^T (+ module.bias)`` on random ``x``, else why not.

    Args:
        module: the module that owns ``weight`` as its ``weight`` attribute.
        weight: the parameter a target would watch, stored ``(out, in)`` or, with
            ``transposed=True``, ``(in, out)`` (Hugging Face ``Conv1D``).
        transposed: how ``weight`` is stored; default ``False``.

    Returns ``None`` also where the check cannot run (a module that is not called on one tensor,
    a weight on the meta device or sharded): such modules are read by the rules alone.
    """
    if getattr(module, "weight", None) is not weight or weight.dim() != 2:
        return None
    if weight.device.type == "meta" or type(weight).__name__ == "DTensor":
        return None
    if not weight.dtype.is_floating_point:
        return None
    matrix = weight.detach().t() if transposed else weight.detach()  # (out, in)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, matrix.shape[1], generator=generator).to(weight.device, weight.dtype)
    bias = getattr(module, "bias", None)
    with torch.no_grad():
        try:
            got = module(x)
        except Exception:  # not a one-tensor projection: the rules read it
            return None
        if not isinstance(got, torch.Tensor):
            return None
        expected = x @ matrix.t()
        if isinstance(bias, torch.Tensor) and bias.shape == expected.shape[-1:]:
            expected = expected + bias.detach()
    if got.shape != expected.shape:
        return (
            f"its forward returns shape {tuple(got.shape)} for {_ROWS} inputs, not the "
            f"{tuple(expected.shape)} of x W^T"
        )
    difference = (got.double() - expected.double()).norm() / expected.double().norm().clamp_min(
        1e-30
    )
    tolerance = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    if _FP8_PRODUCT & {cls.__name__ for cls in type(module).__mro__}:
        tolerance = _FP8_TOLERANCE
    if not bool(difference <= tolerance):
        return (
            f"its forward is not x W^T + b for this weight (relative difference "
            f"{float(difference):.2g} on random inputs)"
        )
    return None
