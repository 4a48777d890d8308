"""A product of two recorded tensors as a contraction: which axis of each is summed, which is kept.

``matmul``/``@``/``bmm``/``baddbmm`` and ``einsum`` write the same computation many ways; an
attention reader (``targets/attention.py``) needs only what they share: each axis of each operand
gets a label, as ``einsum`` would write it, and the output's axes say which labels survive. A
label in both operands and not in the output is *contracted*; a label in one operand and the output
is that operand's *free* axis (a query's positions, a key's positions, a value's features); a label
in both and the output is a batch axis (batch, heads).

Example::

    >>> import torch
    >>> from spectral_callbacks.targets.dataflow import record
    >>> q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4)
    >>> with record(torch.nn.Identity()) as rec:
    ...     _ = torch.einsum("b h i d, b h j d -> b h i j", q, k)
    ...     _ = q @ k.transpose(-2, -1)
    >>> [contraction_of(op).axes() for op in rec.ops if op.name != "transpose"]
    [((3, 2), (3, 2)), ((3, 2), (2, 3))]
"""

from __future__ import annotations

import string
from dataclasses import dataclass

from spectral_callbacks.targets.dataflow import Op, Value

__all__ = ["CONTRACTION_OPS", "Contraction", "contraction_of"]

#: Products of two tensors the reader labels (``baddbmm``'s first tensor is an added bias).
CONTRACTION_OPS = frozenset({"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"})


@dataclass(frozen=True)
class Contraction:
    """Two operands and their axes' labels, and the output's labels (``einsum``'s notation).

    Attributes:
        op: the recorded product.
        operands: the two multiplied values, in the order the product takes them.
        labels: each operand's labels, one per axis.
        output: the output's labels.
    """

    op: Op
    operands: tuple[Value, Value]
    labels: tuple[str, str]
    output: str

    def contracted(self) -> str:
        """The labels summed over: in both operands, not in the output."""
        first, second = self.labels
        return "".join(label for label in first if label in second and label not in self.output)

    def free(self, side: int) -> str:
        """Operand ``side``'s labels kept in the output and absent from the other operand."""
        mine, other = self.labels[side], self.labels[1 - side]
        return "".join(label for label in mine if label not in other and label in self.output)

    def axes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Per operand ``(contracted axis, free axis)`` (non-negative) where one label is
        contracted and each operand keeps a free axis; else ``None``. Of several free axes the
        last is taken: a query's heads-per-group axis (``bgrid``) comes before its positions
        (the reader checks each choice on the projections' rows, ``provenance.heads_of``)."""
        contracted = self.contracted()
        if len(contracted) != 1 or not self.free(0) or not self.free(1):
            return None
        first, second = (
            (labels.index(contracted), labels.index(self.free(side)[-1]))
            for side, labels in enumerate(self.labels)
        )
        return first, second

    def kept(self, side: int) -> str:
        """The free label :meth:`axes` takes for operand ``side``."""
        return self.free(side)[-1]

    def output_axis(self, label: str) -> int:
        """Where ``label`` lies in the output, counted from its end (negative)."""
        return self.output.index(label) - len(self.output)


def contraction_of(op: Op) -> Contraction | None:
    """``op`` as a contraction of two activations (no parameter among them), or ``None``."""
    if op.name not in CONTRACTION_OPS or op.weight is not None or len(op.outputs) != 1:
        return None
    tensors = [v for v in op.inputs if v is not None]
    if op.name == "baddbmm":
        tensors = tensors[1:]  # baddbmm(bias, a, b): a @ b plus the bias
    if len(tensors) != 2 or any(v.parameter is not None for v in tensors):
        return None
    first, second = tensors
    if op.name == "einsum":
        labelled = _einsum_labels(op, first, second)
    elif op.name == "__rmatmul__":  # b.__rmatmul__(a) is a @ b: the recorded order is (b, a)
        labelled = _matmul_labels(second, first, op.outputs[0])
        first, second = second, first
    else:
        labelled = _matmul_labels(first, second, op.outputs[0])
    if labelled is None:
        return None
    labels, output = labelled
    return Contraction(op, (first, second), labels, output)


def _matmul_labels(first: Value, second: Value, out: Value) -> tuple[tuple[str, str], str] | None:
    """``(..., i, k) @ (..., k, j) -> (..., i, j)``; the batch axes broadcast from the right."""
    if len(first.shape) < 2 or len(second.shape) < 2:
        return None
    batch = len(out.shape) - 2
    names = string.ascii_lowercase[:batch]  # batch labels a, b, ... (i, j, k come after)
    if batch > 8:
        return None
    a = names[batch - (len(first.shape) - 2) :] + "iz"
    b = names[batch - (len(second.shape) - 2) :] + "zj"
    return (a, b), names + "ij"


def _einsum_labels(op: Op, first: Value, second: Value) -> tuple[tuple[str, str], str] | None:
    """The equation's labels, ``...`` spelled out as one label per broadcast axis."""
    equation = next((leaf for leaf in op.template if isinstance(leaf, str)), None)
    if equation is None or "->" not in equation:
        return None
    operands, output = equation.replace(" ", "").split("->")
    parts = operands.split(",")
    if len(parts) != 2:
        return None
    spare = "".join(c for c in string.ascii_uppercase if c not in equation)
    # The axes "..." stands for, per operand; they line up from the right, as they broadcast.
    hidden = [
        len(value.shape) - (len(part) - 3) if "..." in part else 0
        for part, value in zip(parts, (first, second), strict=True)
    ]
    widest = max(hidden)
    filled = []
    for part, value, count in zip(parts, (first, second), hidden, strict=True):
        part = part.replace("...", spare[widest - count : widest])
        if len(part) != len(value.shape):
            return None
        filled.append(part)
    return (filled[0], filled[1]), output.replace("...", spare[:widest])
