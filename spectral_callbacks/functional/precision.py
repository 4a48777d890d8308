"""Float32 matrix products at float32 precision, whatever the process's TF32 setting.

TF32 (float32 matmuls on tensor cores with 10 mantissa bits, ``torch.backends.cuda.matmul.
fp32_precision = "tf32"`` or its legacy forms) is process-global: training shares the setting,
and the SVD runs on a worker thread beside it, so it cannot be switched off around the SVD. Instead
:func:`matmul` splits each float32 CUDA operand into a head exact in TF32 and a tail, and three
TF32 products recover float32 accuracy (the 3xTF32 scheme of NVIDIA's CUTLASS). Every float32
product of the SVD goes through it, the products with W and the small bookkeeping products of
the Krylov iteration (projections, combinations, Rayleigh quotients) alike: a bookkeeping product
left in TF32 costs as much accuracy as no split at all (emulated on 1024 x 768 with
sigma_i = i^-0.5, top 32: 1.5e-4 relative against 4e-7 with every product split). Products in
float64 (the final Gram matrices) and decompositions (QR, eigh: cuSOLVER) are not TF32.

Cost while TF32 is on: three products instead of one, and the head and tail of each operand, two
float32 copies (8 bytes per entry of W) alive during a product with W.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["NARROW", "accumulate", "gram", "matmul", "split_tf32", "tf32_enabled", "tf32_in_use"]

#: Products with at most this many output columns are computed transposed (:func:`matmul`);
#: measured up to 8 (48 x 768 x 768 times 8 columns: 17 against 38 ms).
NARROW = 8


def tf32_enabled() -> bool:
    """Whether float32 CUDA matmuls may run in a reduced precision (TF32), by the user's setting.

    torch >= 2.9 resolves every way of setting it (``torch.backends.fp32_precision``,
    ``torch.backends.cuda.matmul.fp32_precision``, and the legacy ``allow_tf32`` and
    ``set_float32_matmul_precision``) into ``torch.backends.cuda.matmul.fp32_precision``; once
    the new API has been used (as ``transformers.TrainingArguments(tf32=True)`` does), reading
    the legacy flags raises ``RuntimeError``. The legacy flags are read only where the new API
    does not exist. ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` in the environment makes cuBLAS use
    TF32 whatever the flags: then it is enabled too. (``NVIDIA_TF32_OVERRIDE=0`` only turns TF32
    off, so the split products are then exact and merely slower.)

    >>> tf32_enabled()
    False
    """
    # torch's own override: cuBLAS then runs float32 products in TF32 whatever the flags say.
    if os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        return True
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is not None:
        return precision not in ("ieee", "none")
    return (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )


def tf32_in_use(X: Tensor) -> bool:
    """Whether a product with the float32 operand ``X`` would run in TF32."""
    return X.is_cuda and X.dtype == torch.float32 and tf32_enabled()


def split_tf32(X: Tensor) -> tuple[Tensor, Tensor]:
    """``X = head + tail`` with ``head`` exact in TF32 (10 mantissa bits): the low 13 bits cleared.

    >>> head, tail = split_tf32(torch.tensor([1.0 + 2.0**-12]))
    >>> head.item(), tail.item() == 2.0**-12
    (1.0, True)
    """
    head = (X.contiguous().view(torch.int32) & -8192).view(torch.float32)  # -8192 = ~0x1FFF
    return head, X - head


def matmul(A: Tensor, B: Tensor) -> Tensor:
    """``A @ B`` at full float32 precision even where TF32 is enabled for float32 matmuls.

    A narrow output (at most ``NARROW`` columns) is computed as ``(B^T A^T)^T`` with ``B^T``
    contiguous: MKL's batched GEMM with a few output columns runs at a fraction of its speed on
    the transposed problem (one column of 48 x 768 x 768: 37 against 8 ms; two: 38 against 14;
    one column of 48 x 768 x 40: 2-6 against 0.2-0.3 ms).
    """
    if B.shape[-1] <= NARROW and A.shape[-2] > B.shape[-1]:
        return matmul(B.mT.contiguous(), A.mT).mT
    if tf32_in_use(A):
        A_hi, A_lo = split_tf32(A)
        B_hi, B_lo = split_tf32(B)
        return A_hi @ B_hi + (A_hi @ B_lo + A_lo @ B_hi)
    return A @ B


def gram(B: Tensor) -> Tensor:
    r"""``B^T B`` at full float32 precision even where TF32 is enabled, from one split of ``B``.

    With :math:`B = H + L` (head and tail), :math:`B^\top B \approx H^\top H + (C + C^\top)`,
    :math:`C = H^\top L` (the tail's own product is below float32's rounding): two TF32 products
    and two ``B``-sized copies, where :func:`matmul` of ``B.mT`` and ``B`` would split both
    operands (four copies, and a fifth to make the transposed one contiguous) and multiply three
    times. A transposed ``B`` (a view) is split through its contiguous transpose, never copied.

    >>> B = torch.randn(6, 3)
    >>> torch.allclose(gram(B), B.mT @ B)
    True
    """
    if not tf32_in_use(B):
        return B.mT @ B
    if not B.is_contiguous() and B.mT.is_contiguous():
        head, tail = (part.mT for part in split_tf32(B.mT))
    else:
        head, tail = split_tf32(B)
    cross = head.mT @ tail  # (..., d, d)
    return head.mT @ head + (cross + cross.mT)


def accumulate(out: Tensor, A: Tensor, B: Tensor, alpha: float, *, in_place: bool) -> Tensor:
    """``out + alpha * (A @ B)`` at full float32 precision: ``addmm``/``baddbmm`` (into ``out``
    itself ``in_place``, else into a new tensor) where the product is exact anyway.

    Where ``A`` has one column the product is an outer product, added elementwise (one rounding
    per entry, as a GEMM's, and no TF32); where ``B`` is narrow, by :func:`matmul`'s transposed
    form. MKL's ``baddbmm`` took 2-8 ms on either at 48 x 768 x 40, these forms 0.2-1 ms.
    """
    if A.shape[-1] == 1:
        if in_place:
            return out.addcmul_(A, B, value=alpha)
        return torch.addcmul(out, A, B, value=alpha)
    if tf32_in_use(A) or B.shape[-1] <= NARROW:
        product = matmul(A, B)
        return out.add_(product, alpha=alpha) if in_place else out.add(product, alpha=alpha)
    if in_place:
        return (out.addmm_ if out.ndim == 2 else out.baddbmm_)(A, B, alpha=alpha)
    return (torch.addmm if A.ndim == 2 else torch.baddbmm)(out, A, B, alpha=alpha)
