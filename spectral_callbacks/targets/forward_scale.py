r"""The logit scale an attention call applies, read from the recorded forward (``dataflow.py``).

A module's attributes say what scale it *declares*; its forward says what it *applies*. Where the
recorded first forward shows it, this is what ``targets/circuits.py`` scales the QK values by
(``qk_logits.read_scale``, the declaration, only where it does not). Read per attention call:

1. **the contraction's scale**: ``scaled_dot_product_attention``'s and ``flex_attention``'s
   ``scale=`` (their documented default :math:`1/\sqrt{E}`, ``E`` the query's last dimension,
   where it is ``None``); in a written-out ``softmax(q @ k^T ...)``, ``baddbmm``'s ``alpha``;
2. **between the contraction and the softmax** (written out): each multiplication or division by
   a number (``* c``, ``/ c``); masks and biases added, casts and views pass; a soft-cap
   (``c * tanh(x / c)``) passes, as :math:`|\tanh u| \le |u|`;
3. **on q and k before the contraction**: each multiplication or division by a number met walking
   back from the operand through views and casts, up to the first other step (the projection, a
   norm, a rotation).

A step the record cannot put a number on (a multiplication by a tensor, ``flex_attention``'s
``score_mod``, an op this reading does not know) leaves the call's scale unread (``None``): the
module's declaration is used, never a guess. A multiplier applied before a rotation (RoPE's
products with ``cos``/``sin`` end the walk of step 3) is not seen.

Example::

    >>> import torch, torch.nn.functional as F
    >>> from spectral_callbacks.targets.attention import attention_calls
    >>> from spectral_callbacks.targets.dataflow import record
    >>> qkv = torch.nn.Linear(8, 24)
    >>> with record(qkv) as rec:
    ...     q, k, v = qkv(torch.randn(1, 2, 3, 8)).chunk(3, dim=-1)
    ...     _ = F.scaled_dot_product_attention(q * 2.0, k, v, scale=0.3)
    ...     w = (q @ k.transpose(-1, -2) / 4.0).softmax(-1)
    ...     _ = w @ v
    >>> [scale_of_call(call, call.operands["Q"][0], call.operands["K"][0])
    ...  for call in attention_calls(rec)]  # doctest: +NORMALIZE_WHITESPACE
    [ForwardScale(value=0.6, source='scaled_dot_product_attention(scale=0.3), q * 2'),
     ForwardScale(value=0.25, source='logits * 0.25')]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spectral_callbacks.targets.dataflow import DROPPED, SOFTMAX_OPS, Op, Value, tree_unflatten

if TYPE_CHECKING:
    from spectral_callbacks.targets.attention import AttentionCall

__all__ = ["ForwardScale", "attention_name", "scale_of_call"]

#: Steps that move or cast elements without changing their size.
_MOVES = frozenset(
    {"view", "reshape", "view_as", "reshape_as", "transpose", "swapaxes", "swapdims", "permute"}
    | {"movedim", "moveaxis", "t", "T", "mT", "unflatten", "flatten", "contiguous", "clone"}
    | {"to", "float", "half", "bfloat16", "double", "type", "type_as", "detach", "expand"}
    | {"expand_as", "repeat_interleave", "repeat", "squeeze", "unsqueeze", "__getitem__"}
)
_MULTIPLY = frozenset({"mul", "__mul__", "__rmul__", "multiply", "mul_"})
_DIVIDE = frozenset({"div", "__truediv__", "true_divide", "divide", "div_"})
# Between the contraction and the softmax: an added mask or bias keeps the product's scale.
_ADDED = frozenset({"add", "__add__", "__radd__", "add_", "sub", "__sub__", "sub_"})
_ADDED |= {"masked_fill", "masked_fill_", "where"}
#: The positional place of ``scale`` in each attention function's signature (torch 2.13).
_SCALE_ARGUMENT = {"scaled_dot_product_attention": 6, "flex_attention": 5}


@dataclass(frozen=True)
class ForwardScale:
    """The scale an attention call applies to ``q . k`` and the steps it was read from."""

    value: float
    source: str


def attention_name(query_parameter: str, output_parameter: str | None) -> str:
    """The attention module's name: the common dotted prefix of the modules of its query's and
    output's weights (``transformer.h.0.attn`` of ``attn.c_attn.weight`` and
    ``attn.c_proj.weight``); the output's owner's owner where only one is known."""
    query_module = query_parameter.rpartition(".")[0]
    if output_parameter is None:
        return query_module.rpartition(".")[0]
    common: list[str] = []
    for first, second in zip(
        query_module.split("."), output_parameter.rpartition(".")[0].split("."), strict=False
    ):
        if first != second:
            break
        common.append(first)
    return ".".join(common)


def scale_of_call(call: AttentionCall, query: Value, key: Value) -> ForwardScale | None:
    """The scale ``call`` (``attention.attention_calls``) applies to ``query . key``: an
    attention function's, or a written-out softmax attention's; ``None`` where a step of it is
    not a number the record shows (or the call normalises otherwise)."""
    if call.kind in _SCALE_ARGUMENT:
        applied = _attention_function(call.op, query)
    elif call.logits is not None and any(op.name in SOFTMAX_OPS for op in call.steps):
        softmax = next(op for op in call.steps if op.name in SOFTMAX_OPS)
        applied = _written_out(softmax, call.logits)
    else:
        return None
    if applied is None:
        return None
    value, steps = applied
    for name, operand in (("q", query), ("k", key)):
        factor = _multipliers_before(operand, name)
        if factor is None:
            return None
        value *= factor[0]
        steps += factor[1]
    if not (math.isfinite(value) and value > 0):
        return None
    return ForwardScale(value, ", ".join(steps))


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _attention_function(call: Op, query: Value) -> tuple[float, list[str]] | None:
    """``scale=`` of SDPA or flex_attention (``1/sqrt(E)`` where None)."""
    args, kwargs = tree_unflatten(call.template, call.spec)
    place = _SCALE_ARGUMENT[call.name]
    if call.name == "flex_attention":
        score_mod = kwargs.get("score_mod", args[3] if len(args) > 3 else None)
        if score_mod is not None:
            return None  # a function of the score the record does not see into
    given = kwargs.get("scale", args[place] if len(args) > place else None)
    if given is None:
        return 1.0 / math.sqrt(query.shape[-1]), [f"{call.name}: 1/sqrt({query.shape[-1]})"]
    number = _number(given)
    if number is None or given is DROPPED:
        return None
    return number, [f"{call.name}(scale={number:g})"]


def _written_out(softmax: Op, logits: Op) -> tuple[float, list[str]] | None:
    """The numbers the logits are multiplied by between their product (``logits``) and the
    softmax."""
    value = softmax.data_inputs[0] if softmax.data_inputs else None
    factor, steps = 1.0, []
    for _ in range(16):
        if value is None or value.op is None:
            return None
        op = value.op
        if op is logits:
            if op.name == "baddbmm":
                args, kwargs = tree_unflatten(op.template, op.spec)
                alpha = _number(kwargs.get("alpha", args[4] if len(args) > 4 else 1.0))
                if alpha is None:
                    return None
                factor *= alpha
                steps.append(f"baddbmm(alpha={alpha:g})")
            return factor, steps or ["q . k"]
        step = _step_factor(op, value)
        if step is None:
            if op.name not in _ADDED and op.name != "tanh":
                return None
            step = 1.0
        elif step != 1.0:
            steps.append(f"logits * {step:g}")
        factor *= step
        value = _along(op, value)
    return None


def _multipliers_before(operand: Value, name: str) -> tuple[float, list[str]] | None:
    """The numbers ``operand`` was multiplied by since the last step that is not a move or a
    multiplication by a number; ``None`` where a multiplication by a one-element tensor (a
    number the record does not keep) comes first."""
    factor, steps, value = 1.0, [], operand
    for _ in range(32):
        op = value.op
        if op is None:
            break
        step = _step_factor(op, value)
        if step is None:
            if op.name in _MULTIPLY | _DIVIDE and any(
                math.prod(v.shape) == 1 for v in op.data_inputs
            ):
                return None  # by a one-element tensor: a number the record does not keep
            break  # a rotation's products with cos/sin, a norm, a projection: the walk ends
        if step != 1.0:
            factor *= step
            steps.append(f"{name} * {step:g}")
        before = _along(op, value)
        if before is None:
            break
        value = before
    return factor, steps


def _step_factor(op: Op, value: Value) -> float | None:
    """What ``op`` multiplies its one data input by: 1 for a move, ``c`` for ``* c`` or
    ``1/c`` for ``/ c``; ``None`` for any other step."""
    data = op.data_inputs
    if op.name in _MOVES and len(data) == 1:
        return 1.0
    if op.name not in _MULTIPLY | _DIVIDE or len(data) != 1:
        return None
    read = [_number(leaf) for leaf in op.template if leaf is not None]
    numbers = [n for n in read if n is not None]
    if len(numbers) != 1 or op.template.count(None) != 1 or numbers[0] == 0:
        return None
    if op.name in _DIVIDE:
        if op.template.index(None) != 0:
            return None  # c / x is no multiple of x
        return 1.0 / numbers[0]
    return numbers[0]


def _along(op: Op, value: Value) -> Value | None:
    """The input ``op`` made ``value`` from: its one data input, or (an added mask) the
    floating-point one of ``value``'s shape."""
    data = op.data_inputs
    if len(data) == 1:
        return data[0]
    same = [v for v in data if v.floating and v.shape == value.shape]
    return same[0] if same else None
