"""Does the module compute ``W x`` for the ``W`` a snapshot copies? Checked once, on random inputs.

A weight can look like a projection's and still not be the matrix its module applies: a
hand-written adapter adds ``B A x`` to its frozen ``weight``, a custom layer rescales or masks it.
Charting that ``weight`` would draw a plausible spectrum of the wrong matrix. So every watched
weight's module is run once at discovery on a few random rows and compared with ``x W^T (+ b)``;
a module that does something else is refused with the reason, never watched.

The check runs in its own numerics (``probe.py``): autocast off, whatever the caller's (it may run
inside the first training forward), and a tolerance set by the arithmetic the module computes in
(its weights' dtype, TF32 where the process allows it, FP8 for a ``Float8Linear``-style module);
the formula is evaluated in float64.

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

from spectral_callbacks.targets.probe import probing, tolerance

__all__ = ["computes_weight"]

_ROWS = 3  # random input rows: enough to see a different matrix, cheap at any width


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
    a weight on the meta device, sharded or partitioned by ZeRO-3, whose module's forward hooks
    partition it again even inside a gather): such modules are read by the rules alone.
    """
    if getattr(module, "weight", None) is not weight or weight.dim() != 2:
        return None
    if weight.device.type == "meta" or type(weight).__name__ == "DTensor":
        return None
    if hasattr(weight, "ds_id"):  # ZeRO-3: its module's forward hooks re-partition the weight
        return None
    if not weight.dtype.is_floating_point:
        return None
    matrix = weight.detach().t() if transposed else weight.detach()  # (out, in)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, matrix.shape[1], generator=generator).to(weight.device, weight.dtype)
    bias = getattr(module, "bias", None)
    with probing(weight.device):
        try:
            got = module(x)
        except Exception:  # not a one-tensor projection: the rules read it
            return None
    if not isinstance(got, torch.Tensor):
        return None
    expected = x.double() @ matrix.double().t()
    if isinstance(bias, torch.Tensor) and bias.shape == expected.shape[-1:]:
        expected = expected + bias.detach().double()
    if got.shape != expected.shape:
        return (
            f"its forward returns shape {tuple(got.shape)} for {_ROWS} inputs, not the "
            f"{tuple(expected.shape)} of x W^T"
        )
    difference = (got.double() - expected).norm() / expected.norm().clamp_min(1e-30)
    if not bool(difference <= tolerance(module, weight)):
        return (
            f"its forward is not x W^T + b for this weight (relative difference "
            f"{float(difference):.2g} on random inputs)"
        )
    return None
