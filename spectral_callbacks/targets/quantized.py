"""Weights stored quantized: read through the library's own dequantization, or refused in one line.

A bitsandbytes 4-bit (NF4, FP4, with or without double quantization) or 8-bit (LLM.int8()) layer
keeps its weight packed; the matrix it computes with is what bitsandbytes dequantizes from that
storage with the layer's own quantization state. :func:`dequantizer` reads it that way, through the
library's public functions, on whatever device and backend hold the weight:

* 4-bit: ``bitsandbytes.functional.dequantize_4bit(weight.data, weight.quant_state)`` (the state
  carries the block size, the code, the nested block scales of double quantization and the shape);
* 8-bit: ``bitsandbytes.functional.int8_vectorwise_dequant(weight.data, SCB)``, the row scales
  ``SCB`` on the weight, or on the layer's ``state`` once its first forward moved them there.

Both are what the layer's forward multiplies by (``tests/targets/test_quantized.py`` checks each
format against the layer's own forward on the identity, in float64).

One layout has no public way back: bitsandbytes' CPU backend repacks a 4-bit weight at its first
forward in eval mode without grad on a CPU with AVX512-BF16 (its nibbles regrouped for the kernel,
its block scales transposed to ``(blocks per row, rows)`` and rounded to bfloat16). Its inverse
(``_convert_weight_packed_for_cpu_inverse``, private) restores the scales' order only for double
quantization; on a plain state it leaves them transposed, so every block is scaled by another
block's absmax: up to half of ``max |W|`` wrong, stable ranks off by several per cent. Such a layer
is read from the packed codes and the transposed bfloat16 scales themselves (:func:`_packed_codes`):
exactly the matrix the packed kernel multiplies by.

A layer of another quantization library (HQQ, GPTQ, AWQ) or a float8 weight whose scale is kept
elsewhere has no public dequantization read here: :func:`unreadable_reason` says so in one line,
and the weight is left out. The library is the one the model already imported (never imported
here).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spectral_callbacks.targets.errors import TargetError
from spectral_callbacks.targets.target import Rows, Target

__all__ = [
    "QuantizedTarget",
    "dequantized_dtype",
    "dequantizer",
    "quantized_base",
    "unreadable_reason",
    "watch_quantized",
]

# Layer and weight classes of quantization libraries (bitsandbytes, HQQ, GPTQ, AWQ): a weight
# stored packed, whose matrix only a dequantization gives.
_QUANTIZED_CLASSES = frozenset(
    {
        "Linear4bit",
        "LinearNF4",
        "LinearFP4",
        "Linear8bitLt",
        "Params4bit",
        "Int8Params",
        "HQQLinear",
        "QuantLinear",
        "WQLinear_GEMM",
        "WQLinear_GEMV",
    }
)


def quantized_base(module: nn.Module) -> str | None:
    """``"Linear4bit, weight uint8"`` when ``module`` holds its weight quantized, else ``None``.

    Known by the class of the layer or of its weight (bitsandbytes ``Linear4bit``/``Params4bit``,
    ``Linear8bitLt``/``Int8Params``, HQQ, GPTQ, AWQ), or by a weight that is not floating point or
    is a one-byte float (float8 with a scale kept elsewhere).
    """
    weight = getattr(module, "weight", None)
    classes = {cls.__name__ for cls in type(module).__mro__}
    if isinstance(weight, torch.Tensor):
        classes |= {cls.__name__ for cls in type(weight).__mro__}
        packed = not weight.is_floating_point() or weight.element_size() == 1
    else:
        packed = False
    if not (classes & _QUANTIZED_CLASSES or packed):
        return None
    dtype = str(weight.dtype).removeprefix("torch.") if isinstance(weight, torch.Tensor) else "-"
    return f"{type(module).__name__}, weight {dtype}"


def _bitsandbytes(weight: object) -> Any:
    """``bitsandbytes.functional`` when ``weight`` is a bitsandbytes parameter, else ``None``."""
    if not isinstance(weight, torch.Tensor):
        return None
    if type(weight).__module__.partition(".")[0] != "bitsandbytes":
        return None
    return sys.modules.get("bitsandbytes.functional")


def dequantizer(module: nn.Module) -> Callable[[], torch.Tensor] | None:
    """How to read the ``(out_features, in_features)`` matrix a quantized ``module`` computes
    with, on its weight's device; ``None`` when it has no public dequantization read here
    (:func:`unreadable_reason` says why).

    Each call reads the layer's current storage and state (a state the layer replaces, as the
    CPU backend's repacking does, is read as it is then).
    """
    weight: Any = getattr(module, "weight", None)
    functional = _bitsandbytes(weight)
    if functional is None:
        return None
    if getattr(weight, "quant_state", None) is not None:

        def four_bit() -> torch.Tensor:
            state = weight.quant_state
            if getattr(state, "packing_format_for_cpu", False):
                return _packed_codes(weight.data, state)
            return functional.dequantize_4bit(weight.data, state)

        return four_bit
    if weight.dtype == torch.int8:

        def eight_bit() -> torch.Tensor:
            # The row scales sit on the weight until the first forward moves them to the state.
            scales = getattr(weight, "SCB", None)
            if scales is None:
                scales = getattr(getattr(module, "state", None), "SCB", None)
            if scales is None:
                raise RuntimeError(f"{type(module).__name__} has no row scales (SCB) to dequantize")
            return functional.int8_vectorwise_dequant(weight.data, scales)

        return eight_bit
    return None


def dequantized_dtype(module: nn.Module) -> torch.dtype:
    """The dtype :func:`dequantizer` gives for ``module``: a 4-bit state's ``dtype`` (the dtype
    the weight was quantized from; float32 for the CPU-packed layout, read in float32), float32
    for 8-bit (``int8_vectorwise_dequant``)."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None or getattr(state, "packing_format_for_cpu", False):
        return torch.float32
    return state.dtype  # type: ignore[no-any-return]


def _packed_codes(packed: torch.Tensor, state: Any) -> torch.Tensor:
    """The matrix of a 4-bit weight in bitsandbytes' CPU inference layout, as its kernel
    (``gemv_4bit`` on the CPU) multiplies by: each 4-bit code times its block's bfloat16 absmax.

    The layout (bitsandbytes ``_convert_weight_packed_for_cpu``): the ``(N, K)`` codes cut into
    tiles of 32 rows by 2 columns, each tile's 64 codes (row-major) in 32 bytes of the
    ``(N, K / 2)`` tensor, the first 32 in the low nibbles and the last 32 in the high ones; the
    block scales a ``(K / blocksize, N)`` bfloat16 tensor (double quantization already undone).
    """
    rows, columns = (int(size) for size in state.shape)  # (N, K)
    tile = 32  # rows per tile, bitsandbytes' block_n
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (rows, columns // 2) or rows % tile:
        raise RuntimeError(
            f"a 4-bit weight of shape {tuple(packed.shape)} in bitsandbytes' CPU inference layout "
            f"for a {(rows, columns)} matrix is not a layout this version reads"
        )
    pairs = packed.reshape(-1, tile)  # each row: one tile's 32 bytes of one column pair
    codes = torch.cat([pairs & 0xF, pairs >> 4], dim=-1)  # (.., 64): the pair's 2 x 32 codes
    codes = codes.reshape(rows // tile, columns // 2, tile, 2)  # (N/32, K/2, 32, 2)
    codes = codes.transpose(1, 2).reshape(rows, columns).long()  # (N, K)
    table = state.code.to(packed.device).float()  # the 16 values of NF4 or FP4
    scales = state.absmax.t().float()  # (N, K / blocksize): the bfloat16 scales the kernel reads
    values = table[codes].reshape(rows, columns // state.blocksize, state.blocksize)
    return (values * scales[:, :, None]).reshape(rows, columns)


def unreadable_reason(module: nn.Module) -> str | None:
    """Why the quantized ``module``'s matrix cannot be read (one line), or ``None`` if it can
    (or is not quantized)."""
    quantized = quantized_base(module)
    if quantized is None or dequantizer(module) is not None:
        return None
    if _bitsandbytes(getattr(module, "weight", None)) is not None:
        return (
            f"quantized layer ({quantized}) not yet quantized or of a bitsandbytes format without a "
            "public dequantization: not watched; move the model to its device (which quantizes "
            "it) before building the monitor"
        )
    return (
        f"quantized layer ({quantized}): not watched (no public dequantization of this format is "
        "read; bitsandbytes 4-bit and 8-bit layers are); leave it out with exclude="
    )


@dataclass(frozen=True)
class QuantizedTarget(Target):
    """A watched matrix of a quantized layer no adapter wraps (bitsandbytes 4-bit or 8-bit).

    Its ``parameter`` is the packed weight; each snapshot dequantizes it (:func:`dequantizer`) on
    the calling thread into an ``m x n`` copy in :func:`dequantized_dtype`, the only copy made.
    """

    layer_module: nn.Module = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def stored(self) -> torch.Tensor:
        """The dequantized ``(out_features, in_features)`` matrix (a fresh tensor)."""
        read = dequantizer(self.layer_module)
        if read is None:
            raise RuntimeError(f"{self.name}: {unreadable_reason(self.layer_module)}")
        return read()

    def matrix(self) -> torch.Tensor:
        return self.rows.take(self.stored())

    def copy_values_into(self, out: torch.Tensor) -> None:
        out.copy_(self.matrix())

    def batch_key(self) -> tuple[str, str]:
        """(group key, device): one shape, dequantized dtype and device batch together."""
        dtype = str(dequantized_dtype(self.layer_module)).removeprefix("torch.")
        m, n = self.shape
        return f"{m}x{n}/{dtype}/{self.parameter.device}/quantized", str(self.parameter.device)

    @classmethod
    def stack_batch(cls, targets: Sequence[QuantizedTarget]) -> torch.Tensor:  # type: ignore[override]
        """A fresh ``(B, m, n)`` tensor of the dequantized matrices of ``targets``."""
        first = targets[0]
        dtype = dequantized_dtype(first.layer_module)
        stack = torch.empty(
            (len(targets), *first.shape), dtype=dtype, device=first.parameter.device
        )
        for slot, target in zip(stack, targets, strict=True):
            target.copy_into(slot)
        return stack

    def snapshot_bytes(self) -> int:
        """The copy a snapshot keeps: ``shape`` in the dequantized dtype."""
        m, n = self.shape
        return m * n * dequantized_dtype(self.layer_module).itemsize


def whole_matrix(target: Target, base: nn.Module) -> dict[str, Any]:
    """``target``'s fields for the whole ``(out_features, in_features)`` matrix of the quantized
    ``base`` (the rules saw its packed storage, whose shape is not the matrix's).

    Raises:
        TargetError: the rules asked for a part of it (a fused weight split by role).
    """
    rows = target.rows
    if rows.start != 0 or rows.stop not in (None, target.parameter.shape[0]) or rows.groups != 1:
        raise TargetError(
            f"{target.name}: a part of a quantized weight cannot be watched (only whole "
            "quantized matrices are dequantized); leave it out with exclude="
        )
    fields = target.fields()
    fields["shape"] = (int(base.out_features), int(base.in_features))  # type: ignore[arg-type]
    fields["rows"] = Rows()  # bitsandbytes stores (out, in), whatever layer it replaced
    return fields


def watch_quantized(target: Target, modules: Mapping[str, nn.Module]) -> Target:
    """``target`` as a :class:`QuantizedTarget` when its parameter is the weight of a quantized
    layer that :func:`dequantizer` reads (the rules refused the others)."""
    owner = modules.get(target.parameter_name.rpartition(".")[0])
    if type(target) is not Target or owner is None or dequantizer(owner) is None:
        return target
    return QuantizedTarget(**whole_matrix(target, owner), layer_module=owner)
