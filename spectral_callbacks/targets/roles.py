"""Roles read from the model's own forward pass: the attention calls and what feeds them.

From a recording (``targets/dataflow.py``) of one forward:

1. **Attention calls** (``targets/attention.py``): ``F.scaled_dot_product_attention`` (and
   ``flex_attention``) with their query, key and value; or any written-out attention, read by its
   structure (two contractions with a normaliser between, whatever operators write them), linear
   attention included (kind ``linear``). Heads and K/V groups come from the operands' shapes
   replayed (``FlowMap.calls``).
2. **Q, K, V**: the projection whose output reaches each operand, walking back through shape
   and element-wise operations (views, splits, rotary products, norms); the rows of that weight
   each head reads come from index provenance (``provenance.py``), so a fused weight's layout is
   read, not guessed. A call whose key and value come from another input than its query is
   cross-attention (``Q_cross`` ...).
3. **O**: the projection that first consumes the attention output.
4. **MLP**: a projection whose output reaches an activation is ``MLP_up`` - or ``MLP_gate``
   when the activated value is multiplied by another projection's output, which is then
   ``MLP_up`` (``[up; gate]`` in one weight gives each its rows); the projection consuming the
   result is ``MLP_down``.
5. **Layers**: a block is the outermost entry of a ``ModuleList``/``Sequential``/``ModuleDict``
   that holds one self-attention call; the blocks of one container are a stack, numbered by the
   order of their attention calls. An MLP in a block without attention (interleaved entries)
   belongs to the last attention call before it in its stack. A call that runs an earlier call's
   weights again (ALBERT's shared layer) is that call's layer: one set of targets, said in
   ``FlowMap.shared``.

A projection whose output is its weight's product plus other weights' (an adapter's ``B A x``) is
*composite*: the role is reported on the module that returns the sum (``FlowRole.composite``),
so it is never charted as its frozen base alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spectral_callbacks.targets.attention import LINEAR, AttentionCall, attention_calls
from spectral_callbacks.targets.dataflow import (
    ACTIVATION_OPS,
    ATTENTION_OPS,
    CREATION_OPS,
    LINEAR_OPS,
    MUL_OPS,
    SOFTMAX_OPS,
    ModuleCall,
    Op,
    Recording,
    Value,
    record,
)
from spectral_callbacks.targets.forward_scale import ForwardScale, attention_name, scale_of_call
from spectral_callbacks.targets.provenance import at_two_tokens, heads_of, replay

__all__ = ["CallRead", "FlowMap", "FlowRole", "discover_roles", "roles_from_recording"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_STOPS = LINEAR_OPS | ATTENTION_OPS | SOFTMAX_OPS | CREATION_OPS | {"einsum", "embedding"}
_STOPS |= {"multi_head_attention_forward"}
_MAX_WALK = 400  # values visited per walk: a block's worth, never the whole graph


@dataclass(frozen=True)
class FlowRole:
    """One role read from the forward.

    Attributes:
        role: ``Q``, ``K``, ``V``, ``O``, ``MLP_gate``, ``MLP_up``, ``MLP_down`` (``_cross`` for
            cross-attention).
        parameter: the weight's name in the model; for a composite, its largest weight.
        rows: the rows of the weight's ``(out, in)`` matrix this role reads, head by head;
            ``None`` for all rows in stored order.
        heads: how many heads ``rows`` holds (K/V: groups under GQA); 1 for O and MLP roles.
        transposed: the weight is used as ``(in, out)`` (``x @ W``, Hugging Face ``Conv1D``).
        stack: the path of the container of blocks (``""`` if the blocks are in none).
        block: the path of the block.
        layer: the block's number in its stack, by the order of attention calls.
        module: the module whose output the role is (the projection, or the composite).
        composite: that module adds other weights' products to ``W x`` (an adapter, for
            example); watching ``parameter`` alone would chart the wrong matrix.
    """

    role: str
    parameter: str
    rows: tuple[int, ...] | None
    heads: int
    transposed: bool
    stack: str
    block: str
    layer: int
    module: str
    composite: bool = False


@dataclass(frozen=True)
class CallRead:
    """One attention call the forward showed, as read.

    Attributes:
        number: its place among the forward's attention calls (0 first).
        kind: what computes it (``targets/attention.py``: ``scaled_dot_product_attention``,
            ``flex_attention``, ``multi_head_attention_forward``, or written out: ``softmax``,
            ``log_softmax``, ``sigmoid``, ``exp``, ``linear``).
        stack, block, layer: where it is (as its roles' ``FlowRole``).
        heads, kv_heads: query heads and K/V heads (groups), from the operands' shapes replayed.
        cross: its key and value read another stream than its query.
        reuses: the number of an earlier call whose weights it runs again (a shared layer).
    """

    number: int
    kind: str
    stack: str
    block: str
    layer: int
    heads: int
    kv_heads: int
    cross: bool = False
    reuses: int | None = None


@dataclass
class FlowMap:
    """Everything one forward says about roles: the roles, the calls, what could not be read."""

    roles: list[FlowRole] = field(default_factory=list)
    attention_calls: int = 0
    unfollowed: list[str] = field(default_factory=list)  # one line per call not followed
    calls: list[CallRead] = field(default_factory=list)  # each call followed, in forward order
    shared: list[str] = field(default_factory=list)  # one line per layer run several times
    #: attention module -> the logit scale its call applies (``forward_scale.py``); ``None``
    #: where the forward does not show it, or its calls apply different ones.
    logit_scales: dict[str, ForwardScale | None] = field(default_factory=dict)

    def add_scale(self, attention: str, scale: ForwardScale | None) -> None:
        """What one call of ``attention`` applies (a module called twice must agree)."""
        if attention in self.logit_scales and self.logit_scales[attention] != scale:
            scale = None
        self.logit_scales[attention] = scale

    def of_parameter(self) -> dict[str, list[FlowRole]]:
        """The roles of each parameter, by name."""
        found: dict[str, list[FlowRole]] = defaultdict(list)
        for role in self.roles:
            found[role.parameter].append(role)
        return dict(found)


@dataclass
class _Source:
    """What produced an operand: a projection's output value and its weight, or a composite."""

    value: Value
    parameter: str
    transposed: bool
    module: str
    composite: bool
    input: Value | None  # the activation the projection read (self vs cross attention)
    rows: tuple[int, ...] | None = None  # the rows an MLP part reads (None: all)


def discover_roles(
    model: nn.Module,
    example_input: Any = None,
    *,
    forward: Callable[[nn.Module], Any] | None = None,
) -> FlowMap:
    """Run one forward of ``model`` under the recorder and read the roles from it.

    Args:
        model: the network.
        example_input: what to call it with: a tensor, a tuple of positional arguments or a
            dict of keyword arguments; default ``None`` (then ``forward`` must be given).
        forward: ``forward(model)`` runs the pass instead (a loss, a custom call); default
            ``None``.

    The pass runs without gradients and with the random state restored after it, so it changes
    neither the weights nor the run's random stream.

    Raises:
        ValueError: neither ``example_input`` nor ``forward`` given.
    """
    if forward is None:
        if example_input is None:
            raise ValueError(
                "discover_roles needs `example_input` (a batch the model's forward takes) or "
                "`forward` (a function running the model), got neither"
            )

        def forward(module: nn.Module) -> Any:
            if isinstance(example_input, dict):
                return module(**example_input)
            if isinstance(example_input, tuple):
                return module(*example_input)
            return module(example_input)

    runner = getattr(model, "_orig_mod", model)  # a compiled model: the code it compiles
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices[:1]), torch.no_grad(), record(model) as rec:
        forward(runner)
    try:
        return roles_from_recording(rec)
    finally:
        rec.release()


def roles_from_recording(recording: Recording) -> FlowMap:
    """The roles a recorded forward shows (see the module docstring for how each is read)."""
    flow = FlowMap()
    calls = attention_calls(recording)
    flow.attention_calls = len(calls)
    modules = dict(recording.model.named_modules())
    entries = _container_entries(modules)
    call_ops = frozenset(call.op.index for call in calls)
    found: list[tuple[str, _Source, tuple[tuple[int, ...], ...] | None, Op]] = []
    read: dict[int, _Read] = {}  # op index of each call followed -> what it reads
    first_of: dict[tuple[str, ...], int] = {}  # the weights a call runs -> the first call's op
    for number, call in enumerate(calls):
        where = call.op.modules[-1] if call.op.modules else "the model"
        if call.kind == "multi_head_attention_forward":
            packed = _packed_attention(recording, call.op)
            if packed is None:
                flow.unfollowed.append(
                    f"attention call {number} in {where}: nn.MultiheadAttention with "
                    "separate q/k/v weights or its fused kernel"
                )
                continue
            *attention, out = packed
            roles = [(role, part, rows) for role, part, rows in attention]
            output: _Source | None = out[1]
        else:
            sources = _operand_sources(recording, call, modules)
            if sources is None:
                flow.unfollowed.append(
                    f"attention call {number} in {where}: its query, key or value does not come "
                    "from one projection the forward shows"
                )
                continue
            roles = [(role, source, heads) for role, (source, heads) in sources.items()]
            output = _consumer(recording, call.output, modules)
        query_input = roles[0][1].input
        cross = any(_other_stream(s.input, query_input, call_ops) for _, s, _ in roles[1:])
        weights = tuple(f"{role}:{source.parameter}" for role, source, _ in roles)
        reuses = first_of.setdefault(weights, call.op.index)
        heads = {role: len(rows) if rows is not None else 1 for role, _, rows in roles}
        read[call.op.index] = _Read(number, call.kind, cross, heads["Q"], heads["K"], reuses)
        if call.operands:  # the scale it applies, by attention module (a shared one must agree)
            parameter = None if output is None else output.parameter
            name = attention_name(roles[0][1].parameter, parameter)
            flow.add_scale(name, scale_of_call(call, call.operands["Q"][0], call.operands["K"][0]))
        if reuses != call.op.index:
            continue  # a shared layer run again: its roles are the first call's
        suffix = "_cross" if cross else ""
        found += [(role + suffix, source, rows, call.op) for role, source, rows in roles]
        if output is not None:
            found.append(("O" + suffix, output, None, call.op))

    in_attention = {s.parameter for _, s, _, _ in found}
    seen: set[tuple[str, str, tuple[int, ...] | None]] = set()
    for role, source, op in _mlp_roles(recording, modules, _block_entries(entries, calls)):
        key = (role, source.parameter, source.rows)
        if source.parameter not in in_attention and key not in seen:
            found.append((role, source, None, op))
            seen.add(key)

    _place(flow, found, calls, read, entries)
    return flow


@dataclass(frozen=True)
class _Read:
    """What one followed attention call reads (``CallRead`` once its layer is known)."""

    number: int
    kind: str
    cross: bool
    heads: int
    kv_heads: int
    reuses: int  # the op index of the first call running the same weights (its own if none)


def _operand_sources(
    recording: Recording, call: AttentionCall, modules: dict[str, nn.Module]
) -> dict[str, tuple[_Source, tuple[tuple[int, ...], ...]]] | None:
    """The projection of the call's query, key and value and each one's rows per head, from the
    first of its readings whose every operand comes from one projection applied per token."""
    # Linear attention's feature map (elu(x) + 1) keeps each element's place: walked through.
    through = ACTIVATION_OPS if call.kind == LINEAR else frozenset()
    for reading in call.readings:
        sources = {}
        for role, (value, feature_axis, token_axis) in reading.items():
            source = _source_of(recording, value, modules, feature_axis, token_axis, through)
            if source is None:
                break
            index = replay(recording, source.value, value, through)
            heads = heads_of(index, feature_axis, token_axis)
            if heads is None:
                break
            sources[role] = (source, heads)
        if len(sources) == 3:
            return sources
    return None


# --- attention calls ------------------------------------------------------------------------


def _packed_attention(
    recording: Recording, op: Op
) -> list[tuple[str, _Source, tuple[tuple[int, ...], ...] | None]] | None:
    """Q, K, V and O of ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``), which
    runs whole: its documented arguments say which weights it uses - ``in_proj_weight`` rows
    ``[q; k; v]``, head ``h`` rows ``h * d_h`` onward in each, and ``out_proj_weight``."""
    if len(op.inputs) < 13 or len(op.template) < 13:
        return None
    query, key, value = op.inputs[0], op.inputs[1], op.inputs[2]
    embed, heads = op.template[3], op.template[4]
    packed, out = op.inputs[5], op.inputs[11]
    usable = isinstance(embed, int) and isinstance(heads, int) and heads > 0 and embed % heads == 0
    if not usable or packed is None or packed.parameter is None or out is None:
        return None  # separate q/k/v weights (use_separate_proj_weight): left to the rules
    if out.parameter is None or packed.shape[0] != 3 * embed:
        return None
    size = embed // heads
    found: list[tuple[str, _Source, tuple[tuple[int, ...], ...] | None]] = []
    for part, (role, given) in enumerate((("Q", query), ("K", key), ("V", value))):
        rows = tuple(
            tuple(range(part * embed + h * size, part * embed + (h + 1) * size))
            for h in range(heads)
        )
        name = packed.parameter.name
        source = _Source(op.outputs[0], name, False, name.rpartition(".")[0], False, given)
        found.append((role, source, rows))
    name = out.parameter.name
    found.append(
        ("O", _Source(op.outputs[0], name, False, name.rpartition(".")[0], False, None), None)
    )
    return found


def _other_stream(
    key_input: Value | None, query_input: Value | None, calls: frozenset[int]
) -> bool:
    """Whether the key's projection reads another stream than the query's (cross-attention).

    Self-attention's projections read one hidden state, or values computed from it (latent
    attention's down-projections): they share an ancestor reached without passing an attention
    call. Cross-attention's keys read the encoder's output, which reaches the decoder's stream
    only through attention calls: no such shared ancestor.
    """
    if key_input is None or query_input is None or key_input is query_input:
        return False
    if not _reads_inputs(query_input):
        return False  # a learned query (SigLIP's pooling probe) attending over the sequence
    return not (_ancestors(key_input, calls) & _ancestors(query_input, calls))


def _reads_inputs(value: Value) -> bool:
    """Whether anything but parameters reaches ``value`` (an input of the model, a position)."""
    seen = {value.index}
    frontier = [value]
    while frontier:
        current = frontier.pop()
        if current.op is None:
            if current.parameter is None:
                return True
            continue
        for parent in current.op.data_inputs:
            if parent.index not in seen:
                seen.add(parent.index)
                frontier.append(parent)
    return False


def _ancestors(value: Value, calls: frozenset[int]) -> set[int]:
    """The values ``value`` was computed from, itself included, up to the attention calls
    before it (their outputs are kept, their inputs not) and leaving parameters out. Integer
    inputs are left out too: the same token ids given to an encoder and, shifted right as labels,
    to a decoder (T5 with ``labels=input_ids``) do not make its two stacks one stream."""
    seen = {value.index}
    frontier = [value]
    while frontier:
        current = frontier.pop()
        op = current.op
        if op is None or op.index in calls:
            continue
        for parent in op.data_inputs:
            if parent.op is None and not parent.floating:
                continue
            if parent.index not in seen:
                seen.add(parent.index)
                frontier.append(parent)
    return seen


# --- sources and consumers --------------------------------------------------------------------


def _breadth_first(frontier: list[Value]) -> Iterator[Value]:
    """The values of ``frontier`` in order, each once, while the caller appends the next ones to
    it: a breadth-first walk of at most ``_MAX_WALK`` values."""
    seen: set[int] = set()
    while frontier and len(seen) < _MAX_WALK:
        current = frontier.pop(0)
        if current.index not in seen:
            seen.add(current.index)
            yield current


def _source_of(
    recording: Recording,
    value: Value,
    modules: dict[str, nn.Module],
    feature_axis: int = -1,
    token_axis: int = -2,
    through: frozenset[str] = frozenset(),
) -> _Source | None:
    """The projection (or composite module) whose output reaches ``value``, an operand whose
    features and tokens lie along ``feature_axis`` and ``token_axis``; ``through``: activations
    walked through (linear attention's feature map)."""
    producers: list[Op] = []
    path: list[Value] = []
    frontier = [value]
    for current in _breadth_first(frontier):
        path.append(current)
        op = current.op
        if op is None:
            continue
        if op.weight is not None:
            producers.append(op)
            continue
        if op.name in _STOPS or (op.name in ACTIVATION_OPS and op.name not in through):
            continue
        frontier += op.data_inputs
    if not producers:
        return None
    weights = {op.weight.name for op in producers if op.weight is not None}
    if len(producers) == 1 or len(weights) == 1:
        op = producers[0]
        index = replay(recording, op.outputs[0], value, through)
        if index is None or bool((at_two_tokens(index, feature_axis, token_axis) < 0).any()):
            return None  # part of the operand comes through steps the replay cannot follow
        assert op.weight is not None
        owner = op.weight.name.rpartition(".")[0]
        data = op.data_inputs
        return _Source(
            op.outputs[0],
            op.weight.name,
            op.weight.transposed,
            owner,
            False,
            data[0] if data else None,
        )
    # Several weights: joined side by side (MLA's key is [k_nope; k_rope]) the one that fills
    # most of the operand is its projection; added up (an adapter's W x + B A x) the operand
    # is the sum, read on the module that returns it, if one does.
    reach = []
    for op in producers:
        index = replay(recording, op.outputs[0], value, through)
        reach.append(None if index is None else at_two_tokens(index, feature_axis, token_axis) >= 0)
    if all(mask is not None for mask in reach):
        masks = [mask for mask in reach if mask is not None]
        overlap = any(
            bool((masks[i] & masks[j]).any())
            for i in range(len(masks))
            for j in range(i + 1, len(masks))
            if producers[i].weight != producers[j].weight
        )
        covered = masks[0].clone()
        for mask in masks[1:]:
            covered |= mask
        if not overlap and bool(covered.all()):
            main = max(zip(producers, masks, strict=True), key=lambda pair: int(pair[1].sum()))[0]
            assert main.weight is not None
            data = main.data_inputs
            return _Source(
                main.outputs[0],
                main.weight.name,
                main.weight.transposed,
                main.weight.name.rpartition(".")[0],
                False,
                data[0] if data else None,
            )
    composite = _composite_call(recording, path, weights, producers, lambda v: v.made_by)
    if composite is None:
        return None
    current, call, largest, transposed = composite
    given = call.inputs[0] if call.inputs else None
    return _Source(current, largest, transposed, call.name, True, given)


def _consumer(recording: Recording, value: Value, modules: dict[str, nn.Module]) -> _Source | None:
    """The projection (or composite module) that first consumes ``value``."""
    found: list[Op] = []
    path: list[Value] = []
    frontier = [value]
    for current in _breadth_first(frontier):
        path.append(current)
        for op in current.consumers:
            if op.weight is not None and current in op.data_inputs:
                found.append(op)
            elif op.name not in _STOPS and op.name not in ACTIVATION_OPS:
                frontier += op.outputs
    weights = {op.weight.name for op in found if op.weight is not None}
    if not weights:
        return None
    if len(weights) == 1:
        op = found[0]
        assert op.weight is not None
        owner = op.weight.name.rpartition(".")[0]
        return _Source(op.outputs[0], op.weight.name, op.weight.transposed, owner, False, value)
    composite = _composite_call(recording, path, weights, found, lambda v: v.fed_to)
    if composite is None:
        return None
    _, call, largest, transposed = composite
    main = next(op for op in found if op.weight and op.weight.name == largest)
    out = call.outputs[0] if call.outputs else main.outputs[0]
    return _Source(out, largest, transposed, call.name, True, value)


def _composite_call(
    recording: Recording,
    path: list[Value],
    weights: set[str],
    ops: list[Op],
    calls_of: Callable[[Value], list[ModuleCall]],
) -> tuple[Value, ModuleCall, str, bool] | None:
    """The first module call along ``path`` (``calls_of`` a value: the calls that made it, or
    those it was fed to) that owns every one of ``weights``: that value, the call, the largest
    weight (the composite's name for its projection) and whether its op reads it transposed."""
    for current in path:
        for call in calls_of(current):
            prefix = f"{call.name}." if call.name else ""
            if all(name.startswith(prefix) for name in weights):
                largest = max(weights, key=lambda n: recording.model.get_parameter(n).numel())
                main = next(op for op in ops if op.weight and op.weight.name == largest)
                assert main.weight is not None
                return current, call, largest, main.weight.transposed
    return None


# --- MLPs -------------------------------------------------------------------------------------


def _mlp_roles(
    recording: Recording, modules: dict[str, nn.Module], entries: dict[str, str]
) -> Iterable[tuple[str, _Source, Op]]:
    """``(role, source, op)`` of each MLP: the activated projection, its gate partner, the down
    (in the same entry of the blocks' container: a walk that leaves the block has passed the
    residual stream, and what it reaches - the next block, the output head - is no MLP's)."""

    def entry(op: Op) -> str | None:
        return next((name for name in _enclosing(op) if name in entries), None)

    for op in recording.ops:
        if op.name not in ACTIVATION_OPS or not op.data_inputs:
            continue
        activated = _source_of(recording, op.data_inputs[0], modules)
        if activated is None:
            continue
        activated.rows = _rows(recording, activated, op.data_inputs[0])
        down = _consumer(recording, op.outputs[0], modules)
        if down is None or down.value.op is None or entry(down.value.op) != entry(op):
            continue  # a router's scores, a gate on attention: no projection of its block reads
        partner = _gate_partner(recording, op.outputs[0], activated, modules)
        if partner is None:
            yield "MLP_up", activated, op
        else:
            yield "MLP_gate", activated, op
            yield "MLP_up", partner, op
        assert down.value.op is not None
        yield "MLP_down", down, down.value.op


def _gate_partner(
    recording: Recording, value: Value, activated: _Source, modules: dict[str, nn.Module]
) -> _Source | None:
    """The other projection an activated value is multiplied by (a GLU's linear half), if any."""
    for _ in range(32):  # forward through element-wise steps (scaling, casts, dropout)
        nxt = None
        for consumer in value.consumers:
            if consumer.weight is not None or consumer.name in _STOPS | ACTIVATION_OPS:
                continue
            if consumer.name in MUL_OPS and len(consumer.data_inputs) == 2:
                other = next((v for v in consumer.data_inputs if v is not value), None)
                source = None if other is None else _source_of(recording, other, modules)
                if other is not None and source is not None and other.shape == value.shape:
                    source.rows = _rows(recording, source, other)
                    mine = (activated.parameter, activated.module, activated.rows)
                    if (source.parameter, source.module, source.rows) != mine:
                        return source  # GELU-tanh multiplies x by a function of x: not a gate
            if len(consumer.outputs) == 1:
                nxt = consumer.outputs[0]
        if nxt is None:
            return None
        value = nxt
    return None


def _rows(recording: Recording, source: _Source, at: Value) -> tuple[int, ...] | None:
    """The rows of ``source`` that every token of ``at`` (``(..., tokens, features)``) reads."""
    index = replay(recording, source.value, at)
    if index is None or index.dim() == 0:
        return None
    two = at_two_tokens(index).reshape(-1, index.shape[-1])  # (rows at two tokens, features)
    if not bool((two == two[:1]).all()):
        return None
    return tuple(int(r) for r in two[0].tolist() if r >= 0)


# --- layers -----------------------------------------------------------------------------------


def _container_entries(modules: dict[str, nn.Module]) -> dict[str, str]:
    """Each entry of a ModuleList/Sequential/ModuleDict: its path -> the container's path."""
    entries = {}
    for name, module in modules.items():
        if isinstance(module, _CONTAINERS):
            for key in module._modules:
                entries[f"{name}.{key}" if name else key] = name
    return entries


def _enclosing(op: Op) -> list[str]:
    """The modules ``op`` ran in and every module holding them, outermost first: a container's
    entry reached by indexing (``block["attn"](x)``) is a block though it is never called."""
    paths: dict[str, None] = {}
    for name in op.modules:
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            paths.setdefault(".".join(parts[:depth]), None)
    return list(paths)


def _block_entries(entries: dict[str, str], calls: list[AttentionCall]) -> dict[str, str]:
    """The entries of the containers whose entries run attention calls (the stacks of blocks):
    an ``nn.Sequential(Linear, act, Dropout, Linear)`` MLP is a container too, but not a block's."""
    ran = {name for call in calls for name in _enclosing(call.op)}
    stacks = {container for name, container in entries.items() if name in ran}
    return {name: container for name, container in entries.items() if container in stacks}


def _place(
    flow: FlowMap,
    found: list[tuple[str, _Source, tuple[tuple[int, ...], ...] | None, Op]],
    calls: list[AttentionCall],
    read: dict[int, _Read],
    entries: dict[str, str],
) -> None:
    """Number the blocks of each stack by attention order; give every role its layer. A call
    that runs an earlier call's weights again (a shared layer) is that call's layer."""
    # How many self-attention calls each module holds: a block is the outermost entry with one.
    holding: dict[str, int] = defaultdict(int)
    for call in calls:
        if call.op.index in read and not read[call.op.index].cross:
            for name in _enclosing(call.op):
                holding[name] += 1

    def block_of(op: Op) -> tuple[str, str]:
        for name in _enclosing(op):
            if name in entries and holding.get(name, 0) <= 1:
                return entries[name], name
        return "", ""

    order: dict[str, dict[str, int]] = defaultdict(dict)  # stack -> block -> layer
    call_layer: dict[int, tuple[str, str, int]] = {}
    reused: dict[int, list[int]] = defaultdict(list)  # first call's number -> later calls'
    for number, call in enumerate(calls):
        seen = read.get(call.op.index)
        if seen is None:
            continue
        if seen.reuses != call.op.index:
            call_layer[call.op.index] = call_layer[seen.reuses]
            reused[read[seen.reuses].number].append(number)
        else:
            stack, block = block_of(call.op)
            if not block:
                block = f"attention call {number}"
            blocks = order[stack]
            layer = blocks.setdefault(block, len(blocks))
            call_layer[call.op.index] = (stack, block, layer)
        stack, block, layer = call_layer[call.op.index]
        reuses = None if seen.reuses == call.op.index else read[seen.reuses].number
        flow.calls.append(
            CallRead(
                number,
                seen.kind,
                stack,
                block,
                layer,
                seen.heads,
                seen.kv_heads,
                seen.cross,
                reuses,
            )  # fmt: skip
        )
    for first, again in reused.items():
        where = calls[first].op.modules[-1] if calls[first].op.modules else "the model"
        flow.shared.append(
            f"attention call{'s' if len(again) > 1 else ''} {_numbers(again)} run the weights of "
            f"call {first} ({where}) again: a shared layer, watched as one set of targets"
        )
    ops_by_layer = sorted(call_layer.items())
    for role, source, heads, op in found:
        if op.index in call_layer:
            stack, block, layer = call_layer[op.index]
        else:  # an MLP: its own block's layer, else the last attention call before it
            stack, block = block_of(op)
            if block in order.get(stack, {}):
                layer = order[stack][block]
            else:
                before = [v for k, v in ops_by_layer if k < op.index and v[0] == stack]
                if not before:
                    before = [v for k, v in ops_by_layer if k < op.index]
                if not before:
                    continue
                stack, _, layer = before[-1]
        if heads is not None:
            rows: tuple[int, ...] | None = tuple(r for head in heads for r in head)
            count = len(heads)
        else:
            rows, count = source.rows, 1
        flow.roles.append(
            FlowRole(
                role=role,
                parameter=source.parameter,
                rows=rows,
                heads=count,
                transposed=source.transposed,
                stack=stack,
                block=block,
                layer=layer,
                module=source.module,
                composite=source.composite,
            )
        )


def _numbers(numbers: list[int]) -> str:
    """``1..11`` for a run of consecutive numbers, else them all."""
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}..{numbers[-1]}"
    return ", ".join(map(str, numbers))
