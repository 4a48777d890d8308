"""Attention calls found in a recorded forward by their structure, whatever operators write them.

An attention call is two contractions with a normaliser between them (``targets/contraction.py``
labels each product's axes):

1. the **logits**: two streams contracted over one axis (the per-head features), each keeping one
   free axis (the query's positions, the key's positions);
2. the **normaliser**: ``softmax`` (also ``log_softmax(...).exp()``, a written-out ``exp``/sum,
   ``sigmoid``), with whatever element-wise steps around it: a float32 upcast and the cast back,
   a scale before or after, masks by ``masked_fill``/``where``/addition, an additive bias
   (``baddbmm``'s, ALiBi), dropout;
3. the **mixing**: the normalised weights contracted with a third stream over the key positions.

Which stream is which follows from the axes, not from the operators or their order: the query is
the logits operand whose free axis survives the mixing, the key the one whose free axis the mixing
contracts, the value the mixing's other operand (its free axis: the value's features). So
``einsum`` in any index naming, ``q @ k.transpose(-2, -1)``, ``bmm`` on ``(B * H, T, d)``,
``baddbmm`` and the operands given in either order read alike. ``scaled_dot_product_attention``
and ``flex_attention`` are one op each, with their documented ``(query, key, value)``;
``nn.MultiheadAttention`` runs whole (``multi_head_attention_forward``) and is read from its
arguments (``targets/roles.py``).

**Linear attention** (no normaliser between the products; a feature map such as ``elu(x) + 1`` on
the query and the key): the same two products, either in the quadratic order above or with the
key and value contracted over positions first (``(phi(k)^T v)`` then ``phi(q) @ that``). It is
read as an attention call of kind ``linear``: which of the two orders ran is told by the projections
themselves (``targets/provenance.py``: a projection's output varies along its features and is
constant along its positions). Two products of activations with no normaliser and no feature
map are not attention: left alone.

Example::

    >>> import torch
    >>> from spectral_callbacks.targets.dataflow import record
    >>> q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    >>> with record(torch.nn.Identity()) as rec:
    ...     w = torch.einsum("bhid,bhjd->bhij", q, k).mul(0.5).float().softmax(-1)
    ...     _ = torch.einsum("bhij,bhjd->bhid", w.to(q.dtype), v)
    >>> [(call.kind, call.logits.name, call.normaliser) for call in attention_calls(rec)]
    [('softmax', 'einsum', 'softmax')]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from spectral_callbacks.targets.contraction import CONTRACTION_OPS, Contraction, contraction_of
from spectral_callbacks.targets.dataflow import (
    ACTIVATION_OPS,
    ATTENTION_OPS,
    CREATION_OPS,
    LINEAR_OPS,
    Op,
    Recording,
    Value,
)

__all__ = ["LINEAR", "AttentionCall", "Operands", "attention_calls"]

#: Kind of a call with no normaliser between its products (a feature map before them).
LINEAR = "linear"
#: ``(value, feature axis, token axis)`` of the query, key and value of one reading of a call.
Operands = dict[str, tuple[Value, int, int]]

# What turns logits into weights, by the name the call's kind takes from it.
_NORMALISERS = {"softmax": "softmax", "_softmax": "softmax", "log_softmax": "log_softmax"}
_NORMALISERS |= {"sigmoid": "sigmoid", "exp": "exp"}
# Where the walk from the weights back to the logits stops: products with weights, whole attention
# calls, new tensors, look-ups (the walk passes element-wise steps, casts, masks and reshapes).
_STOPS = LINEAR_OPS | ATTENTION_OPS | CREATION_OPS | {"embedding", "multi_head_attention_forward"}
_MAX_STEPS = 32  # element-wise steps between the two products: a block's worth
_MAX_VISITS = 256  # ops looked at per walk back: never the whole graph
_FEATURE_MAPS = ACTIVATION_OPS - {"sigmoid"}  # sigmoid attention normalises by a sigmoid
# Axes are matched from the end through views and reshapes; an op that reorders them ends the walk
# (transposed weights would swap the query and the key).
_PERMUTES = frozenset({"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis"})
_PERMUTES |= {"t", "T", "mT", "flip", "roll"}


@dataclass(eq=False)
class AttentionCall:
    """One attention call: where it ran, its operands and output, what its logits went through.

    Attributes:
        op: the op that is the call (SDPA, flex, ``multi_head_attention_forward``; the mixing
            product of a written-out one): its place in the forward and the modules it ran in.
        readings: the ways its query, key and value may be read, tried in order (one but for
            linear attention, whose two orders of products share one structure).
        output: the call's output (what the output projection consumes).
        kind: ``scaled_dot_product_attention``, ``flex_attention``,
            ``multi_head_attention_forward``; or, written out, the normaliser (``softmax``,
            ``log_softmax``, ``sigmoid``, ``exp``) or ``linear``.
        logits: the product giving the logits (``None`` where one op is the whole call).
        normaliser: the name of the op that normalised them (``None``: none, or one op).
        steps: the element-wise ops between the logits and the mixing, in forward order
            (the scale, masks, biases, casts a reader of the logits looks at).
    """

    op: Op
    readings: list[Operands]
    output: Value
    kind: str
    logits: Op | None = None
    normaliser: str | None = None
    steps: tuple[Op, ...] = field(default=(), repr=False)

    @property
    def operands(self) -> Operands:
        """The first reading's query, key and value."""
        return self.readings[0] if self.readings else {}


def attention_calls(recording: Recording) -> list[AttentionCall]:
    """Every attention call of the recorded forward, in the order they ran."""
    calls = []
    for op in recording.ops:
        if op.name == "multi_head_attention_forward" and op.outputs:
            calls.append(AttentionCall(op, [], op.outputs[0], op.name))  # read from its arguments
        elif op.name in ATTENTION_OPS:
            data = [v for v in op.inputs if v is not None][:3]
            if len(data) == 3 and op.outputs:
                operands = {r: (v, -1, -2) for r, v in zip(("Q", "K", "V"), data, strict=True)}
                calls.append(AttentionCall(op, [operands], op.outputs[0], op.name))
        else:
            mixing = contraction_of(op)
            call = None if mixing is None else _written(mixing)
            if call is not None:
                calls.append(call)
    return calls


def _written(mixing: Contraction) -> AttentionCall | None:
    """The call whose mixing product is ``mixing``, if its structure is attention's."""
    axes = mixing.axes()
    if axes is None:
        return None
    for side in (0, 1):
        weights = mixing.operands[side]
        for found in _back_to_logits(weights):
            logits, steps = found
            call = _read(mixing, side, logits, steps)
            if call is not None:
                return call
    return None


def _read(
    mixing: Contraction, side: int, logits: Contraction, steps: tuple[Op, ...]
) -> AttentionCall | None:
    """The call where ``mixing``'s operand ``side`` was computed from ``logits`` through
    ``steps``: the query and key told apart by which free axis the mixing contracts."""
    mixing_axes, logit_axes = mixing.axes(), logits.axes()
    if mixing_axes is None or logit_axes is None:
        return None
    weights, value = mixing.operands[side], mixing.operands[1 - side]
    made = logits.op.outputs[0]
    # The weights' axes counted from the end: reshapes between (bmm's (B * H, T, T) viewed as
    # (B, H, T, T)) keep the last two, which are the ones that count.
    summed, kept = (axis - len(weights.shape) for axis in mixing_axes[side])
    sides = {logits.output_axis(logits.kept(s)): s for s in (0, 1)}
    if summed not in sides or kept not in sides or summed == kept:
        return None
    if made.shape[summed] != weights.shape[summed] or made.shape[kept] != weights.shape[kept]:
        return None
    key, query = sides[summed], sides[kept]
    (q_summed, q_kept), (k_summed, k_kept) = logit_axes[query], logit_axes[key]
    v_summed, v_kept = mixing_axes[1 - side]
    q, k = logits.operands[query], logits.operands[key]
    normalisers = [_NORMALISERS[op.name] for op in steps if op.name in _NORMALISERS]
    readings: list[Operands] = [
        {"Q": (q, q_summed, q_kept), "K": (k, k_summed, k_kept), "V": (value, v_kept, v_summed)}
    ]
    if normalisers:
        kind = "log_softmax" if "log_softmax" in normalisers else normalisers[0]
        return AttentionCall(
            mixing.op, readings, mixing.op.outputs[0], kind, logits.op, kind, steps
        )
    # The key is the same stream in both orders below; the query (quadratic order) or the value
    # operand (keys and values first) is the other mapped one.
    if not (_feature_mapped(k) and (_feature_mapped(q) or _feature_mapped(value))):
        return None  # two products of activations, nothing between: not attention
    # Keys and values first (phi(k)^T v over positions, then phi(q) times that): the logits'
    # operands are the key and the value, each contracted over its positions.
    readings.append(
        {"Q": (value, v_summed, v_kept), "K": (k, k_kept, k_summed), "V": (q, q_kept, q_summed)}
    )
    return AttentionCall(mixing.op, readings, mixing.op.outputs[0], LINEAR, logits.op, None, steps)


def _back_to_logits(value: Value) -> Iterator[tuple[Contraction, tuple[Op, ...]]]:
    """The products of two activations ``value`` was computed from through element-wise steps,
    nearest first, each with the steps between (in forward order)."""
    frontier: list[tuple[Value, tuple[Op, ...]]] = [(value, ())]
    seen: set[int] = set()
    while frontier and len(seen) < _MAX_VISITS:
        current, steps = frontier.pop(0)
        op = current.op
        if op is None or op.index in seen or len(steps) > _MAX_STEPS:
            continue
        seen.add(op.index)
        product = contraction_of(op)
        if product is not None:
            yield product, steps
            continue
        if op.name in _STOPS | CONTRACTION_OPS | _FEATURE_MAPS | _PERMUTES:
            continue  # a projection, a product of three, an activation: not the logits' path
        size = _numel(current.shape)
        for parent in op.data_inputs:
            # The input the output is made of (a scale, a mask or a broadcast bias is smaller).
            if parent.floating and _numel(parent.shape) == size:
                frontier.append((parent, (op, *steps)))


def _feature_mapped(value: Value) -> bool:
    """``value`` is a feature map's output (``elu(x) + 1``, ``relu``) through element-wise steps."""
    for _ in range(8):
        op = value.op
        if op is None or op.name in _STOPS or contraction_of(op) is not None:
            return False
        if op.name in _FEATURE_MAPS:
            return True
        same = [v for v in op.data_inputs if v.shape == value.shape]
        if not same:
            return False
        value = same[0]
    return False


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
