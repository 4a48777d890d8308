"""A record of one forward pass: which torch functions ran on which tensors, and which modules.

Names say what a weight is only by convention; the forward pass says it by use. ``record`` wraps a
forward the model makes anyway (or one on an example input) and writes down, without changing
anything it computes, each torch function call as an :class:`Op` whose inputs and outputs are
:class:`Value` nodes (shapes), plus each module call's input and output values (forward hooks).
No tensor of the forward's data is kept alive: a tensor is found again by ``id`` and checked by a
weak reference; a shape operation, which the replay runs again, keeps stand-ins on the meta device
for its floating-point arguments and only its small integer ones (an index). So a forward under
activation checkpointing frees what it frees without the record. The ops and values refer to each
other; :meth:`Recording.release` breaks those cycles once the roles are read, so the record goes
with its last reference, not at the cyclic collector's next pass.

``targets/roles.py`` reads roles from the record (attention calls, the projections feeding them,
gated MLPs); ``targets/provenance.py`` replays the shape operations between a projection and an
attention call on index tensors to find which rows of a fused weight land where.

What the record cannot see: functions called inside a Python function of ``torch.nn.functional``
that is dispatched whole (``multi_head_attention_forward``), a compiled graph, custom kernels. The
roles of such layers come from the name rules (``find_targets`` says which, naming the layer). A
bitsandbytes 4-/8-bit layer (its kernel multiplies by a dequantized copy of the weight) is
recorded as one projection by its weight.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(4, 6)
    >>> with record(layer) as rec:
    ...     _ = layer(torch.randn(2, 4)).relu()
    >>> [op.name for op in rec.ops]
    ['linear', 'relu']
    >>> rec.ops[0].weight
    Weight(name='weight', transposed=False)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from spectral_callbacks.targets.quantized import dequantizer

__all__ = ["ModuleCall", "Op", "Recording", "Value", "Weight", "record"]

# Functions that only move, select or join elements: replayed on index tensors as they ran.
SHAPE_OPS = frozenset(
    {
        "view",
        "reshape",
        "view_as",
        "reshape_as",
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "moveaxis",
        "t",
        "split",
        "split_with_sizes",
        "tensor_split",
        "chunk",
        "unbind",
        "__getitem__",
        "unflatten",
        "flatten",
        "expand",
        "expand_as",
        "repeat_interleave",
        "repeat",
        "narrow",
        "select",
        "squeeze",
        "unsqueeze",
        "cat",
        "concat",
        "concatenate",
        "stack",
        "roll",
        "flip",
        "index_select",
        "T",
        "mT",
        "__setitem__",
    }
)
# Functions whose output keeps each element's place (dtype casts, copies, norms within a head,
# rotary products, scaling, masking): an index passes through them unchanged.
PASS_OPS = frozenset(
    {"to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone"}
    | {"detach", "data", "dropout", "layer_norm", "rms_norm", "group_norm", "neg", "__neg__"}
)
# A product with a weight: a projection whose output features are rows of that weight.
LINEAR_OPS = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm"})
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax"})
ATTENTION_OPS = frozenset({"scaled_dot_product_attention", "flex_attention"})
ACTIVATION_OPS = frozenset(
    {"gelu", "silu", "relu", "relu6", "sigmoid", "tanh", "mish", "elu", "selu", "celu"}
    | {"leaky_relu", "softplus", "hardswish", "hardsigmoid", "gelu_", "relu_", "silu_"}
)
MUL_OPS = frozenset({"mul", "__mul__", "__rmul__", "multiply", "mul_"})
# New tensors shaped like an input but holding none of its data: provenance stops there.
CREATION_OPS = frozenset(
    {"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "zeros_like", "ones_like"}
    | {"empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
)
# Functions that return no new data and need no record (shape queries, grad mode, ...).
_IGNORED = frozenset({"size", "dim", "numel", "_set_grad_enabled", "__len__", "stride"})


@dataclass(frozen=True)
class Weight:
    """The parameter a projection multiplies by, and whether it is used as ``(in, out)``."""

    name: str
    transposed: bool


@dataclass(eq=False)
class Value:
    """One tensor of the forward: the op that made it (``None`` for inputs and parameters)."""

    index: int
    shape: tuple[int, ...]
    op: Op | None = None
    parameter: Weight | None = None  # a parameter, or a view / cast of one (``W.t()``, ``W.to``)
    consumers: list[Op] = field(default_factory=list, repr=False)
    made_by: list[ModuleCall] = field(default_factory=list, repr=False)  # innermost first
    fed_to: list[ModuleCall] = field(default_factory=list, repr=False)
    floating: bool = True  # a floating-point tensor (not token ids, positions or a mask)


@dataclass(eq=False)
class Op:
    """One torch function call: its name, input values (tensors in argument order), outputs.

    ``template`` and ``spec`` rebuild the call's arguments with other tensors in place of the
    recorded ones (``provenance.py`` replays shape operations on index tensors). No tensor of the
    forward's data is kept: a shape operation's floating-point tensors are stand-ins on the meta
    device (their shape and dtype), its small integer and boolean ones (the index of a
    ``__getitem__``) are kept (moved to the CPU when the recording ends); every other op keeps
    only its plain arguments (numbers, strings, dtypes, slices), never an object that may hold data.
    """

    index: int
    name: str
    func: Callable[..., Any] = field(repr=False)
    inputs: list[Value | None] = field(repr=False)  # None: an argument that is not a tensor slot
    outputs: list[Value] = field(repr=False)
    template: list[Any] = field(repr=False)
    spec: Any = field(repr=False)
    weight: Weight | None = None  # set for a projection by a parameter
    modules: tuple[str, ...] = ()  # the module calls it ran inside, outermost first
    # A ``write`` (``base[...].copy_(src)``): the shape ops that made the written view of the base.
    view_chain: tuple[Op, ...] = field(default=(), repr=False)

    @property
    def data_inputs(self) -> list[Value]:
        """The inputs that are not parameters (the activations it computes on)."""
        return [v for v in self.inputs if v is not None and v.parameter is None]


@dataclass(eq=False)
class ModuleCall:
    """One module's forward: its name, the values it was given and the value(s) it returned."""

    name: str
    module: nn.Module = field(repr=False)
    inputs: list[Value] = field(repr=False)
    outputs: list[Value] = field(repr=False)


class Recording:
    """The ops and module calls of one forward, in the order they ran (see :func:`record`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.ops: list[Op] = []
        self.module_calls: list[ModuleCall] = []
        self.values: list[Value] = []
        self.parameter_names: dict[int, str] = {
            id(p): name for name, p in model.named_parameters(remove_duplicate=True)
        }
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], Value]] = {}
        self._module_stack: list[str] = []

    # --- building -------------------------------------------------------------------------------

    def value_of(self, tensor: torch.Tensor) -> Value:
        """The value recorded for ``tensor``, or a new input value (a parameter when it is one)."""
        found = self._by_id.get(id(tensor))
        if found is not None and found[0]() is tensor:
            return found[1]
        name = self.parameter_names.get(id(tensor))
        value = self._new_value(tensor)
        if name is not None:
            value.parameter = Weight(name, transposed=False)
        return value

    def _new_value(self, tensor: torch.Tensor, op: Op | None = None) -> Value:
        value = Value(len(self.values), tuple(tensor.shape), op)
        value.floating = tensor.is_floating_point() or tensor.is_complex()
        self.values.append(value)
        # A tensor subclass without weak references is not found again: a new input when used.
        with suppress(TypeError):
            self._by_id[id(tensor)] = (weakref.ref(tensor), value)
        return value

    def add_op(self, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
        """Record ``func(*args, **kwargs) -> out`` (only calls that return new tensors)."""
        name = op_name(func)
        if name in _IGNORED:
            return
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        leaves, spec = tree_flatten((args, kwargs))
        if name == "copy_" and len(leaves) >= 2 and isinstance(leaves[1], torch.Tensor):
            self._add_write(func, leaves[0], leaves[1])
            return
        if name == "__setitem__" and leaves and isinstance(leaves[0], torch.Tensor):
            results = [leaves[0]]  # ``x[key] = y`` writes into x: a new version of x
        if not results:
            return
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return  # a new tensor made from nothing (a mask, positions): an input when used
        replayed = name in SHAPE_OPS
        inputs: list[Value | None] = []
        template: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                inputs.append(self.value_of(leaf))
                template.append(stand_in(leaf) if replayed else None)
            else:
                inputs.append(None)
                template.append(leaf if _plain(leaf) else DROPPED)
        op = Op(len(self.ops), name, func, inputs, [], template, spec)
        op.modules = tuple(self._module_stack)
        fresh = {id(t) for t in leaves if isinstance(t, torch.Tensor)}
        for tensor in results:
            if id(tensor) in fresh and name != "__setitem__":
                continue  # an in-place op returns its input: the value stays as made
            value = self._new_value(tensor, op)
            value.parameter = _derived_weight(name, op, inputs)
            op.outputs.append(value)
        if not op.outputs:
            return
        op.weight = _projection_weight(name, inputs, leaves)
        for given in op.inputs:
            if given is not None:
                given.consumers.append(op)
        self.ops.append(op)

    def _add_write(self, func: Callable[..., Any], view: torch.Tensor, src: torch.Tensor) -> None:
        """``view.copy_(src)`` where ``view`` is a slice of a base tensor: a new version of the
        base, with ``src`` written where the recorded shape ops of the slice point."""
        base = view._base if view._base is not None else view
        base_value, current = self.value_of(base), self.value_of(view)
        chain: list[Op] = []
        while current is not base_value:
            op = current.op
            single = op is not None and op.name in SHAPE_OPS and len(op.outputs) == 1
            if op is None or not single or len(chain) > 8 or not op.data_inputs:
                return  # a view made otherwise: not followed
            chain.append(op)
            current = op.data_inputs[0]
        source = self.value_of(src)
        op = Op(len(self.ops), "write", func, [base_value, source], [], [], None)
        op.view_chain = tuple(reversed(chain))
        op.modules = tuple(self._module_stack)
        op.outputs.append(self._new_value(base, op))  # the base's name now means this version
        base_value.consumers.append(op)
        source.consumers.append(op)
        self.ops.append(op)

    # --- after the forward -----------------------------------------------------------------------

    def close(self) -> None:
        """The forward is over: the index tensors kept on an accelerator are moved to the CPU,
        once each (the replay runs there), and the lookup by ``id`` is dropped."""
        self._by_id.clear()
        self._module_stack.clear()
        moved: dict[int, torch.Tensor] = {}
        for op in self.ops:
            for slot, leaf in enumerate(op.template):
                if isinstance(leaf, torch.Tensor) and leaf.device.type not in ("cpu", "meta"):
                    if id(leaf) not in moved:
                        moved[id(leaf)] = leaf.to("cpu")
                    op.template[slot] = moved[id(leaf)]

    def release(self) -> None:
        """Break the record's reference cycles (an op names its values, a value its op and its
        consumers), so it is freed when the last reference goes, not at the cyclic collector's
        next pass; call it once the roles are read. The record is empty afterwards."""
        for value in self.values:
            value.op = None
            value.consumers.clear()
            value.made_by.clear()
            value.fed_to.clear()
        for op in self.ops:
            op.inputs.clear()
            op.outputs.clear()
            op.template.clear()
            op.view_chain = ()
        for call in self.module_calls:
            call.inputs.clear()
            call.outputs.clear()
        self.values.clear()
        self.ops.clear()
        self.module_calls.clear()
        self._by_id.clear()

    # --- module hooks ---------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        self._module_stack.append(name)

    def _leave(self, name: str, module: nn.Module, args: tuple, out: Any) -> None:
        if self._module_stack and self._module_stack[-1] == name:
            self._module_stack.pop()
        given = [self.value_of(t) for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        made = [self.value_of(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if len(given) == 1 and len(made) == 1 and dequantizer(module) is not None:
            self._as_projection(name, module, given[0], made[0])
        call = ModuleCall(name, module, given, made)
        self.module_calls.append(call)
        for value in given:
            value.fed_to.append(call)
        for value in made:
            value.made_by.append(call)

    def _as_projection(self, name: str, module: nn.Module, given: Value, made: Value) -> None:
        """Record a quantized layer's call as one ``linear`` by its weight. Its kernel multiplies
        by a dequantized copy the record cannot tie to the parameter (``targets/quantized.py``),
        so the ops inside are cut off: the input no longer leads into them, the output is made by
        the projection."""
        weight = module.weight
        weight_name = self.parameter_names.get(id(weight))
        if weight_name is None or not isinstance(weight, torch.Tensor):
            return
        parameter = self.value_of(weight)
        spec = tree_flatten(((None, None), {}))[1]  # linear(x, W): never replayed
        inputs: list[Value | None] = [given, parameter]
        op = Op(
            len(self.ops), "linear", torch.nn.functional.linear, inputs, [made], [None, None], spec
        )
        op.weight = Weight(weight_name, transposed=False)
        op.modules = (*self._module_stack, name)
        given.consumers = [c for c in given.consumers if name not in c.modules] + [op]
        parameter.consumers.append(op)
        made.op = op
        self.ops.append(op)


# An integer or boolean tensor argument of a shape operation (an index, a mask) up to this size is
# kept for the replay; a larger one is a stand-in, and the replay stops at its op.
INDEX_BYTES = 1 << 20


class _Dropped:
    """An argument the record does not keep (an object that is neither a tensor nor plain)."""

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED = _Dropped()
_PLAIN: tuple[type, ...] = (int, float, bool, complex, str, bytes, type(None), type(...))
_PLAIN += (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _plain(leaf: Any) -> bool:
    """A value that holds no tensor: a number, a string, a dtype, a slice of numbers."""
    if isinstance(leaf, slice):
        return all(_plain(part) for part in (leaf.start, leaf.stop, leaf.step))
    return isinstance(leaf, _PLAIN)


def stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """What a shape operation's record keeps of ``tensor``: a small integer or boolean tensor (an
    index) itself, detached; anything else an empty tensor of its shape and dtype on the meta
    device (a floating-point tensor of the forward is never kept: the replay puts an index tensor
    in its place)."""
    index = not (tensor.is_floating_point() or tensor.is_complex())
    if index and tensor.numel() * tensor.element_size() <= INDEX_BYTES:
        return tensor.detach()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def op_name(func: Callable[..., Any]) -> str:
    """The function's name; a property read (``x.T``, ``x.data``) gives the property's name."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return str(name)


def _derived_weight(name: str, op: Op, inputs: list[Value | None]) -> Weight | None:
    """A view or cast of a parameter is still that parameter (``W.t()`` is ``W`` transposed)."""
    sources = [v for v in inputs if v is not None]
    if len(sources) != 1 or sources[0].parameter is None:
        return None
    weight = sources[0].parameter
    if name in PASS_OPS:
        return weight
    if name in ("t", "transpose", "mT", "T"):
        return Weight(weight.name, not weight.transposed)
    return None


def _projection_weight(name: str, inputs: list[Value | None], leaves: list[Any]) -> Weight | None:
    """The weight of ``F.linear(x, W)``, ``x @ W`` or ``addmm(b, x, W)``, as an ``(out, in)`` use.

    ``F.linear`` uses ``W`` as ``(out, in)``; ``x @ W`` uses ``W`` as ``(in, out)`` (so a
    parameter stored that way, like Hugging Face ``Conv1D``, reads ``transposed=True``).
    """
    if name == "einsum":
        return _einsum_weight(inputs, leaves)
    if name not in LINEAR_OPS:
        return None
    tensors = [v for v in inputs if v is not None]
    if name == "linear":
        used = tensors[1].parameter if len(tensors) >= 2 else None
        if used is None or tensors[0].parameter is not None:
            return None
        return used
    if name == "addmm":  # addmm(bias, x, W): x @ W + bias
        tensors = tensors[1:]
    if len(tensors) != 2:
        return None
    activation, right = tensors
    if right.parameter is None or activation.parameter is not None:
        return None
    # x @ W multiplies by W as (in, out): the (out, in) matrix is W^T.
    return Weight(right.parameter.name, not right.parameter.transposed)


def _einsum_weight(inputs: list[Value | None], leaves: list[Any]) -> Weight | None:
    """The weight of an ``einsum`` that is a projection, ``"...i,oi->...o"`` (``x W^T``) or
    ``"bti,io->bto"`` (``x W``, stored ``(in, out)``): a 2-D parameter whose one subscript is
    contracted with the activation's last and whose other takes that place in the output, every
    other subscript of the activation kept in order. Any other equation mixes more than a
    projection does (heads, factors): ``None``.
    """
    equation = next((leaf for leaf in leaves if isinstance(leaf, str)), None)
    tensors = [v for v in inputs if v is not None]
    if equation is None or len(tensors) != 2 or "->" not in equation:
        return None
    operands, output = equation.replace(" ", "").split("->")
    subscripts = operands.split(",")
    if len(subscripts) != 2:
        return None
    weights = [i for i, v in enumerate(tensors) if v.parameter is not None]
    if len(weights) != 1 or len(tensors[weights[0]].shape) != 2:
        return None
    weight, activation = tensors[weights[0]], tensors[1 - weights[0]]
    w_sub, x_sub = subscripts[weights[0]], subscripts[1 - weights[0]]
    if len(w_sub) != 2 or not x_sub or x_sub[-1] not in w_sub or activation.parameter is not None:
        return None
    contracted = x_sub[-1]
    produced = w_sub.replace(contracted, "", 1)
    if len(produced) != 1 or produced in x_sub or output != x_sub[:-1] + produced:
        return None
    assert weight.parameter is not None
    stored_in_out = w_sub == contracted + produced  # (in, out): used as x W
    return Weight(weight.parameter.name, weight.parameter.transposed != stored_in_out)


class _RecordingMode(TorchFunctionMode):
    """Records every torch function call; returns exactly what the call returns."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Code that torch.compile traces (flex_attention, a compiled block) runs as a graph the
        # record cannot see into; recording while tracing would put this mode in the graph.
        if not torch.compiler.is_compiling():
            self.recording.add_op(func, args, kwargs, out)
        return out


@functools.cache
def _handler_never_compiled() -> None:
    """Keep dynamo from compiling :class:`_RecordingMode`'s handler as a frame of its own.

    Where a compiled function falls back to eager for part of its code (``flex_attention``
    raising on the CPU, a graph break), dynamo compiles the frames that code calls, the mode's
    handler among them, as graphs of their own; so compiled, a handler that asks
    ``torch.compiler.is_compiling()`` returns a wrong value (torch 2.13: FlexAttention's
    ``query.dim()`` came back ``False``). Skipped as a root frame, the handler runs as the Python
    it is, as in any eager code; dynamo still inlines it where it traces a compiled region (where
    it records nothing). ``torch._dynamo`` is imported here, at the first recording, not with the
    package.
    """
    import torch._dynamo.eval_frame as eval_frame

    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is not None:
        skip_code(_RecordingMode.__torch_function__.__code__)


@contextmanager
def record(model: nn.Module, *, running: nn.Module | None = None) -> Iterator[Recording]:
    """Record the forward passes run inside the ``with`` block (normally exactly one).

    Module hooks (removed on exit) tell which module each call ran in and which values each
    module returned; the function mode records each torch call. The computation is unchanged.
    ``running``: a module whose call is already under way (a recording started from its own
    pre-hook, while torch walks that module's hooks): it gets none.
    """
    _handler_never_compiled()
    recording = Recording(model)
    handles = []
    for name, module in model.named_modules():
        if module is running:
            continue
        handles.append(
            module.register_forward_pre_hook(lambda m, a, name=name: recording._enter(name))
        )
        handles.append(
            module.register_forward_hook(
                lambda m, a, out, name=name: recording._leave(name, m, a, out)
            )
        )
    try:
        with _RecordingMode(recording):
            yield recording
    finally:
        for handle in handles:
            handle.remove()
        recording.close()


@dataclass(frozen=True)
class _Slot:
    """The place of the ``index``-th leaf in a flattened argument structure."""

    index: int


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of nested tuples, lists and dicts, in order, and the structure with each leaf
    replaced by its ``_Slot`` (what :func:`tree_unflatten` fills back in)."""
    leaves: list[Any] = []
    return leaves, _walk(tree, leaves)


def _walk(node: Any, leaves: list[Any]) -> Any:
    # A module-level function, not a closure over ``leaves``: a closure that calls itself is a
    # reference cycle, and it would hold the forward's tensors until the cyclic collector ran.
    if isinstance(node, (tuple, list)):
        return _same_kind(node, [_walk(item, leaves) for item in node])
    if isinstance(node, dict):
        return {key: _walk(value, leaves) for key, value in node.items()}
    leaves.append(node)
    return _Slot(len(leaves) - 1)


def _same_kind(node: tuple | list, items: list[Any]) -> Any:
    """``items`` as a ``node``'s type (a list, a tuple, a ``torch.Size``), else as a tuple."""
    if isinstance(node, list):
        return items
    try:
        return type(node)(items)
    except TypeError:  # a structseq (torch.return_types) or named tuple built otherwise
        return tuple(items)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """``spec`` (from :func:`tree_flatten`) with each slot replaced by its leaf."""
    if isinstance(spec, _Slot):
        return leaves[spec.index]
    if isinstance(spec, (tuple, list)):
        return _same_kind(spec, [tree_unflatten(leaves, item) for item in spec])
    if isinstance(spec, dict):
        return {key: tree_unflatten(leaves, value) for key, value in spec.items()}
    return spec


def rebuild(op: Op, replace: dict[int, torch.Tensor]) -> tuple[tuple, dict]:
    """``op``'s arguments with ``replace[i]`` in tensor slot ``i`` (others as recorded)."""
    leaves = [replace.get(i, leaf) for i, leaf in enumerate(op.template)]
    args, kwargs = tree_unflatten(leaves, op.spec)
    return args, kwargs
