"""Which output rows of a projection land where: index provenance, replayed from a recording.

A fused projection's layout (``[q; k; v]``, per head ``(heads, 3, head_dim)``, per group
``[q x g; k; v]``, ``[up; gate]``) is whatever the model's forward does with its output: views,
splits, transposes, ``repeat_interleave`` for grouped K/V, rotary products. Reading it from the
recorded forward (``targets/dataflow.py``) instead of guessing it from head counts: the projection's
output is replaced by an *index tensor* (element ``[..., j]`` holds ``j``), and the recorded
operations between it and the consumer are replayed on it - shape operations exactly as they ran,
element-wise ones (casts, norms, scaling, rotary mixing within a head) as the identity on the
index. A complex view (torchtitan's rotary embedding: ``view_as_complex`` of row pairs, a complex
product, ``view_as_real``) carries the two rows of each pair as the real and imaginary parts of
a complex index. At the consumer each element then names the output row it came from; ``-1``
marks elements from elsewhere.

Example::

    >>> import torch
    >>> from spectral_callbacks.targets.dataflow import record
    >>> qkv = torch.nn.Linear(8, 24, bias=False)  # rows [q; k; v], 2 heads of 4
    >>> with record(qkv) as rec:
    ...     q, k, v = qkv(torch.randn(1, 3, 8)).view(1, 3, 3, 2, 4).permute(2, 0, 3, 1, 4)
    >>> source = rec.ops[0].outputs[0]
    >>> k_value = rec.ops[-1].outputs[1]
    >>> heads_of(replay(rec, source, k_value), feature_axis=-1, token_axis=-2)
    ((8, 9, 10, 11), (12, 13, 14, 15))
"""

from __future__ import annotations

import torch

from spectral_callbacks.targets.dataflow import (
    ACTIVATION_OPS,
    ATTENTION_OPS,
    CREATION_OPS,
    LINEAR_OPS,
    SHAPE_OPS,
    SOFTMAX_OPS,
    Op,
    Recording,
    Value,
    rebuild,
)

__all__ = ["at_two_tokens", "heads_of", "replay"]

# Operations an index never passes: they mix features (products, softmax) or are the consumers.
_STOPS = (
    LINEAR_OPS
    | ATTENTION_OPS
    | SOFTMAX_OPS
    | ACTIVATION_OPS
    | {"multi_head_attention_forward"}
    | CREATION_OPS
    | {"einsum", "embedding"}
)


def replay(
    recording: Recording, source: Value, target: Value, through: frozenset[str] = frozenset()
) -> torch.Tensor | None:
    """The index tensor at ``target``: each element the row of ``source``'s last dimension it
    came from (``-1``: not from ``source``), or ``None`` if ``target`` is not reached.
    ``through``: activations replayed as element-wise (a feature map ``elu(x) + 1`` keeps each
    element's place; elsewhere an activation ends what a projection's rows reach)."""
    features = source.shape[-1] if source.shape else 0
    index: dict[int, torch.Tensor] = {
        source.index: torch.arange(features).expand(source.shape)  # (..., out), no copy
    }
    if target.index == source.index:
        return index[source.index]
    start = source.op.index + 1 if source.op is not None else 0
    stop = target.op.index + 1 if target.op is not None else 0
    for op in recording.ops[start:stop]:
        traced = {
            slot: index[value.index]
            for slot, value in enumerate(op.inputs)
            if value is not None and value.index in index
        }
        if not traced or (op.name in _STOPS and op.name not in through):
            continue
        made = _propagate(op, traced)
        if made is None:
            continue
        for value, tensor in zip(op.outputs, made, strict=False):
            index[value.index] = tensor
        if target.index in index:
            return index[target.index]
    return index.get(target.index)


def _propagate(op: Op, traced: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """The index tensors of ``op``'s outputs given those of its traced inputs."""
    if not _replayable(op, traced):
        return None
    if op.name == "write":  # base[...].copy_(src): the base's index with src's written there
        return _write(op, traced)
    if op.name == "__setitem__":  # x[key] = y: x's index with y's written at key
        base = traced.get(0)
        written = torch.full(op.outputs[0].shape, -1, dtype=torch.long) if base is None else base
        written = written.clone()
        args, _ = rebuild(op, traced)
        source = traced.get(len(op.template) - 1, -1)
        try:
            written[args[1]] = source
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None
        return [written]
    if op.name == "view_as_complex":  # (..., n, 2) -> (..., n): each pair of rows one number
        pairs = traced.get(0)
        if pairs is None or pairs.shape[-1:] != (2,):
            return None
        return [torch.view_as_complex(pairs.to(torch.float64).contiguous())]
    if op.name == "view_as_real":  # (..., n) -> (..., n, 2): the pair back (exact below 2**53)
        numbers = traced.get(0)
        if numbers is None or not numbers.is_complex():
            return None
        return [torch.view_as_real(numbers.contiguous())]
    if op.name in SHAPE_OPS:
        # Other tensors in a join (``cat`` with a cached part) come from elsewhere: -1.
        others = {
            slot: torch.full(leaf.shape, -1, dtype=torch.long)
            for slot, leaf in enumerate(op.template)
            if isinstance(leaf, torch.Tensor) and slot not in traced and _is_data(leaf)
        }
        args, kwargs = rebuild(op, {**others, **traced})
        func = torch.Tensor.reshape if op.name == "view" else op.func  # an expanded index
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None
        made = [out] if isinstance(out, torch.Tensor) else list(out)
        if len(made) != len(op.outputs) or any(
            tuple(m.shape) != v.shape for m, v in zip(made, op.outputs, strict=True)
        ):
            return None
        return made
    # Element-wise: the index of the first traced input that covers the output's shape.
    if len(op.outputs) != 1:
        return None
    shape = op.outputs[0].shape
    for tensor in traced.values():
        if _broadcasts_to(tuple(tensor.shape), shape):
            return [tensor.expand(shape)]
    return None


def _write(op: Op, traced: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """Replay ``base[...].copy_(src)`` on index tensors: the same view of a copy of the base's
    index (so writing into it writes into the copy), then ``src``'s index written into it."""
    shape = op.outputs[0].shape
    base = traced[0].clone() if 0 in traced else torch.full(shape, -1, dtype=torch.long)
    view = base
    for step in op.view_chain:
        slot = next(i for i, value in enumerate(step.inputs) if value is not None)
        args, kwargs = rebuild(step, {slot: view})
        try:
            made = step.func(*args, **kwargs)
        except (RuntimeError, TypeError, IndexError, ValueError):
            return None
        if not isinstance(made, torch.Tensor):
            return None
        view = made
    written = traced.get(1)
    try:
        view.copy_(written if written is not None else torch.full_like(view, -1))
    except RuntimeError:
        return None
    return [base]


def _replayable(op: Op, traced: dict[int, torch.Tensor]) -> bool:
    """Whether the record kept every argument the replay of ``op`` (and of the shape ops of a
    write's view) reads: an integer argument too large to keep is only a stand-in."""
    steps = [(op, traced), *((step, {}) for step in op.view_chain)]
    return not any(
        isinstance(leaf, torch.Tensor) and leaf.is_meta and not _is_data(leaf)
        for step, replaced in steps
        for slot, leaf in enumerate(step.template)
        if slot not in replaced
    )


def _is_data(tensor: torch.Tensor) -> bool:
    """A tensor of the forward's numbers (recorded as a stand-in), not an index or a mask."""
    return tensor.is_floating_point() or tensor.is_complex()


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (``torch.broadcast_shapes`` imports sympy on its
    first call, seconds for a check this simple)."""
    if len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape) :]
    return all(size in (1, want) for size, want in zip(shape, tail, strict=True))


def at_two_tokens(
    index: torch.Tensor, feature_axis: int = -1, token_axis: int = -2
) -> torch.Tensor:
    """``(batch * heads, 2, features)``: an operand's index at its first and last token only.

    A projection applies per token, so two tokens tell everything the index says (and whether it
    varies with the token) at a cost that does not grow with the sequence or the batch's tokens.
    """
    if index.dim() < 2:
        return index.reshape(1, 1, -1)
    moved = index.movedim((token_axis, feature_axis), (-2, -1))  # (..., tokens, features)
    ends = torch.tensor([0, moved.shape[-2] - 1])
    two = moved.index_select(-2, ends)  # (..., 2, features), a copy of two tokens only
    return two.reshape(-1, 2, two.shape[-1])


def heads_of(
    index: torch.Tensor | None, feature_axis: int, token_axis: int
) -> tuple[tuple[int, ...], ...] | None:
    """The source rows of each head of an attention operand, from its index tensor.

    The operand is ``(..., tokens, features)`` with ``feature_axis`` and ``token_axis`` saying
    where those are (a transposed key is ``(..., features, tokens)``); the leading axes are batch
    and heads. Every token of a head must read the same rows (a projection applied per token) and
    a repeated head (grouped K/V expanded with ``repeat_interleave``, or the batch) is one head.
    Rows from elsewhere (``-1``) are left out. ``None`` when the index is missing or varies along
    the tokens.
    """
    if index is None or index.dim() < 2:
        return None
    two = at_two_tokens(index, feature_axis, token_axis)  # (batch * heads, 2, features)
    if not torch.equal(two[:, 0], two[:, 1]):
        return None  # a row's source changes with the token: not a per-token projection
    heads: dict[tuple[int, ...], None] = {}
    for rows in two[:, 0].tolist():
        kept = tuple(int(r) for r in rows if r >= 0)
        if kept:
            heads.setdefault(kept, None)
    return tuple(heads) if heads else None
