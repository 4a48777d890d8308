"""A watched matrix (``Target``), how a stored parameter holds it (``Split``), and the printed map.

A ``Target`` keeps a reference to the live ``Parameter`` and a description of which rows of it form
the matrix, so ``Target.matrix()`` always reads the current values and costs no copy of the whole
parameter: a plain or contiguously fused weight gives a view; a matrix interleaved per head (GPT-NeoX
``query_key_value``, MLA ``kv_b_proj``) gives a copy of just its own rows.

Example::

    >>> import torch
    >>> fused = torch.nn.Parameter(torch.arange(12.0).reshape(6, 2))  # rows [q; k; v], 2 each
    >>> k = Target.from_parameter("attn.c_attn.weight", fused, role="K", layer=1, num_layers=3,
    ...                           rows=Rows(start=2, stop=4), fused=True)
    >>> k.name, k.shape, k.depth
    ('attn.c_attn.weight[K]', (2, 2), 0.5)
    >>> k.matrix()
    tensor([[4., 5.],
            [6., 7.]])
    >>> k.matrix().data_ptr() == fused.data_ptr() + 4 * fused.element_size()  # a view, no copy
    True
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from typing_extensions import Self

from spectral_callbacks.functional.batch import Stack
from spectral_callbacks.messages import count
from spectral_callbacks.names import ROLE_ORDER as ROLE_ORDER  # re-exported: targets.ROLE_ORDER
from spectral_callbacks.names import relative_depth, role_sort_key

_ROLE_RE = re.compile(r"^[A-Za-z0-9_]+$")


def check_role(role: object, where: str) -> str:
    """``role`` if it is a valid role name (it goes verbatim into logged tags), else a ValueError."""
    if not isinstance(role, str) or not _ROLE_RE.match(role):
        raise ValueError(
            f"{where}: a role must be a non-empty string of letters, digits and '_' (it becomes "
            f"part of the logged tag spectral_<metric>/L00/<role>), got {role!r}"
        )
    return role


@dataclass(frozen=True)
class Rows:
    """Which rows of a stored parameter's ``(out, in)`` matrix form one target.

    The output dimension is read as ``groups`` equal chunks (one per head for per-head layouts) and
    the target takes rows ``start:stop`` of every chunk. ``transposed`` marks weights stored
    ``(in, out)`` such as Hugging Face ``Conv1D`` (GPT-2).
    """

    start: int = 0
    stop: int | None = None
    groups: int = 1
    transposed: bool = False

    def shape_of(self, stored: tuple[int, ...]) -> tuple[int, int]:
        """The ``(rows, in)`` shape ``take`` returns for a weight of shape ``stored``."""
        out, inp = (stored[1], stored[0]) if self.transposed else (stored[0], stored[1])
        per_group = range(out // self.groups)[self.start : self.stop]
        return (self.groups * len(per_group), inp)

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """The selected ``(rows, in)`` matrix of ``weight``: a view unless ``groups > 1``."""
        matrix = weight.t() if self.transposed else weight  # (out, in)
        if self.groups == 1:
            whole = (self.start, self.stop) == (0, None)
            return matrix if whole else matrix[self.start : self.stop]
        # Rows of one part are strided across the groups, so a 2-D result needs a copy of them.
        return self.grouped(weight).reshape(-1, matrix.shape[1])

    def grouped(self, weight: torch.Tensor) -> torch.Tensor:
        """The selected rows as a ``(groups, rows per group, in)`` view of ``weight``, never a copy."""
        matrix = weight.t() if self.transposed else weight  # (out, in)
        out, inp = matrix.shape
        chunks = matrix.reshape(self.groups, out // self.groups, inp)  # (groups, chunk, in), a view
        return chunks[:, self.start : self.stop]


@dataclass(frozen=True)
class Target:
    """One watched matrix: a (layer, role) of the model and where its values live.

    Every way the snapshot and the engine use a target is declared here with the default of a
    dense matrix; a kind of target (``targets/experts.py``, ``targets/adapted.py``,
    ``targets/delta.py``) is a subclass that overrides what it does differently, and the monitor
    calls each extension point unconditionally. The extension points:

    * :meth:`matrix` / :meth:`stored`: the current values (an expert reads its slice);
    * :meth:`copy_values_into`: write them into one slot of a stack (:meth:`copy_into` checks the
      slot's shape first);
    * :meth:`batch_key` and :meth:`stack_batch`: which targets are snapshotted as one batch, and
      that batch (a ``(B, m, n)`` tensor, or a ``functional.batch.MatrixBatch``);
      :meth:`stack_batch_reading` where the kind reads other targets' copies of the same
      snapshot (:attr:`reads_copies`);
    * :meth:`snapshot_bytes`: what one snapshot copies for this target (the memory budget), and
      :meth:`working_bytes` what computing its metrics needs where the kind computes them itself;
    * :attr:`has_update`: whether its batch carries an update (the ``spectral_update_*`` family);
    * :attr:`description`: what ``format_targets`` prints beside the shape.

    Attributes:
        name: unique name, the parameter name plus ``[role]`` when the parameter is fused,
            e.g. ``transformer.h.0.attn.c_attn.weight[Q]``.
        parameter_name: the name of the stored parameter in the model given to ``find_targets``.
        layer: index of the block in its list of blocks (``transformer.h.3`` -> 3).
        num_layers: length of that list.
        role: ``Q``, ``K``, ``V``, ``O``, ``MLP_up``, ``MLP_down`` or a documented extra role;
            used verbatim in logged tags.
        shape: ``(out_features, in_features)`` of ``matrix()``.
        parameter: the live parameter (not a copy); excluded from comparison and repr.
        rows: which rows of the parameter form this matrix.
        stack: the stack of blocks it belongs to (``enc``/``dec``, ``text``/``vision``) where
            a model has several, else ``""``; ``layer`` and ``num_layers`` are within it.
        expert: the expert's index where the matrix is one expert's slice of a mixture of
            experts (``targets/experts.py``), else ``None``.
        head: the query head whose circuits the target is (``targets/circuits.py``), else
            ``None``.
    """

    name: str
    parameter_name: str
    layer: int
    num_layers: int
    role: str
    shape: tuple[int, int]
    parameter: torch.Tensor = field(repr=False, compare=False)
    rows: Rows = field(default_factory=Rows, repr=False)
    stack: str = ""
    expert: int | None = None
    head: int | None = None

    #: Whether the batch of this kind carries an update whose spectrum is logged as the
    #: ``spectral_update_*`` family (``MatrixBatch.update_spectrum``). A dense matrix has none.
    has_update: ClassVar[bool] = False
    #: Whether this kind's batch may read the dense copies the same snapshot took of other targets
    #: (:meth:`stack_batch_reading`): it is then stacked after them and computed before them.
    reads_copies: ClassVar[bool] = False

    @classmethod
    def from_parameter(
        cls,
        parameter_name: str,
        parameter: torch.Tensor,
        *,
        role: str,
        layer: int = 0,
        num_layers: int = 1,
        rows: Rows | None = None,
        fused: bool = False,
        stack: str = "",
        expert: int | None = None,
    ) -> Target:
        """A target on ``parameter``; ``fused=True`` appends ``[role]`` to the name; ``expert``:
        the expert whose own matrix it is (a mixture keeping its experts as separate modules)."""
        rows = rows or Rows()
        check_role(role, f"target {parameter_name}")
        shape = rows.shape_of(tuple(parameter.shape))  # no copy, even for interleaved rows
        name = f"{parameter_name}[{role}]" if fused else parameter_name
        return cls(
            name, parameter_name, layer, num_layers, role, shape, parameter, rows, stack, expert
        )

    @property
    def depth(self) -> float:
        """Relative depth ``layer / (num_layers - 1)``, 0 for a one-layer model."""
        return relative_depth(self.layer, self.num_layers)

    @property
    def description(self) -> str:
        """What ``format_targets`` prints beside the shape (``lora r=8 (default)``); ``""`` for a
        plain matrix."""
        return ""

    @property
    def attention_layer(self) -> str | None:
        """The attention module whose heads this target is one of (``targets/circuits.py``);
        ``None`` for a matrix."""
        return None

    def adapter_rank_and_scaling(self) -> tuple[int, float | None, str] | None:
        """The target map's ``r``, ``s`` and scaling rule of an adapted layer (ΔW = s B A, summed
        over its active adapters; ``s`` ``None`` where the layer states none; the rule ``"lora"``
        for s = lora_alpha / r, ``"rslora"`` for s = lora_alpha / sqrt(r), ``""`` where the layer
        does not say); ``None`` for a matrix without adapters."""
        return None

    def stored(self) -> torch.Tensor:
        """The stored 2-D weight ``rows`` are taken from, detached: the parameter itself (an
        expert's target: its slice of the 3-D experts tensor)."""
        return self.parameter.detach()

    def matrix(self) -> torch.Tensor:
        """The current ``(out_features, in_features)`` values, detached from autograd.

        A view of the parameter when its rows are contiguous (plain, transposed or contiguously
        fused weights); a copy of only this matrix's rows when they are interleaved per head.
        """
        return self.rows.take(self.stored())

    def copy_into(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the current values into ``out`` (a ``shape`` tensor, e.g. one slot of a stack).

        Checks the shape, then :meth:`copy_values_into` copies. Returns ``out``.

        Raises:
            ValueError: ``out`` does not have this target's ``shape``.
        """
        if tuple(out.shape) != self.shape:
            raise ValueError(
                f"`out` must have shape {self.shape} for {self.name}, got {tuple(out.shape)}"
            )
        with torch.no_grad():
            self.copy_values_into(out)
        return out

    def copy_values_into(self, out: torch.Tensor) -> None:
        """Write the current values into ``out``, whose shape :meth:`copy_into` has checked.

        One copy even where ``matrix()`` would need two (per-head interleaved rows copied into a
        fresh tensor, then into the stack).
        """
        source = self.rows.grouped(self.stored())  # (groups, rows, in), a view
        out.view(source.shape).copy_(source)

    def batch_key(self) -> tuple[str, str]:
        """``(group key, device)``: targets with one key are snapshotted and decomposed as one
        batch. A dense matrix: its shape, the parameter's dtype and its device
        (``768x768/float32/cpu``); a kind with its own batch adds a suffix (``/adapted``)."""
        dtype = str(self.parameter.dtype).removeprefix("torch.")
        m, n = self.shape
        return f"{m}x{n}/{dtype}/{self.parameter.device}", str(self.parameter.device)

    @classmethod
    def stack_batch(cls, targets: Sequence[Self]) -> Stack:
        """The snapshot of ``targets`` (this one's group, sharing its :meth:`batch_key`), copied
        on the calling thread and the current stream: later updates cannot reach it.

        A dense matrix: :func:`dense_stack`.
        """
        return dense_stack(targets)

    @classmethod
    def stack_batch_reading(
        cls, targets: Sequence[Self], copies: Mapping[int, tuple[torch.Tensor, int]]
    ) -> Stack:
        """:meth:`stack_batch`, given the dense copies the same snapshot has taken already:
        ``id(target) -> (its group's (B, m, n) stack, its slot)``. Only a kind that
        :attr:`reads_copies` uses them."""
        return cls.stack_batch(targets)

    def snapshot_bytes(self) -> int:
        """The bytes a snapshot copies for this target: its ``shape`` in the parameter's dtype."""
        return self.shape[0] * self.shape[1] * self.parameter.element_size()

    def working_bytes(self, batch: int) -> int | None:
        """An upper bound of what computing the metrics of ``batch`` targets of this kind
        allocates, where the kind computes them itself (attention heads); ``None``: what the
        compute function's SVD needs (``SpectrumCompute.working_bytes``)."""
        return None

    def release_reference(self) -> None:
        """Drop what only the run needed, once it is over (a ``delta=`` reference weight); a dense
        matrix keeps nothing."""

    def adapter_layer(self) -> torch.nn.Module | None:
        """The adapter layer (a PEFT tuner layer) this target's update lives in, whose parameters
        a learning-rate factor scales with the base's; ``None`` for a plain matrix."""
        return None

    def fields(self) -> dict[str, Any]:
        """The values of :class:`Target`'s own fields: what a kind of target built from this one
        (``targets/adapted.py``, ``targets/delta.py``) takes over before adding its own."""
        return {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(Target)}


def dense_stack(targets: Sequence[Target]) -> torch.Tensor:
    """One fresh ``(B, m, n)`` tensor holding the current values of ``targets`` (one shape, dtype
    and device), one :meth:`Target.copy_into` per slot.

    Shape, dtype and device come from the first target, not from a ``matrix()`` (for an
    interleaved per-head split that is a whole copy). Allocated on the device's current stream,
    the training stream: its memory returns to training's pool when the engine frees it (after
    ``record_stream`` on the compute stream).
    """
    first = targets[0]
    shape = (len(targets), *first.shape)
    stack = torch.empty(shape, dtype=first.parameter.dtype, device=first.parameter.device)
    for slot, target in zip(stack, targets, strict=True):
        target.copy_into(slot)
    return stack


@dataclass(frozen=True)
class Skipped:
    """A parameter that is not watched, and why (shown by ``format_targets``)."""

    parameter_name: str
    shape: tuple[int, ...]
    reason: str


class TargetList(list):  # type: ignore[type-arg]
    """``list[Target]`` that also remembers the parameters that were not watched (``.skipped``).

    ``low_dim`` counts parameters with fewer than 2 dimensions (biases, norm scales), which are
    never targets and are only counted, not listed. ``unwatched_experts`` lists the mixture's
    routed experts that are not watched because no rule reads them (``name (shape): reason``).
    """

    def __init__(
        self,
        targets: Iterable[Target] = (),
        skipped: Iterable[Skipped] = (),
        low_dim: int = 0,
        unwatched_experts: Iterable[str] = (),
    ) -> None:
        super().__init__(targets)
        self.skipped: list[Skipped] = list(skipped)
        self.low_dim = low_dim
        self.unwatched_experts: list[str] = list(unwatched_experts)
        #: Where each target's role came from, by target name: ``"names"`` (the rules),
        #: ``"data flow"`` (the forward, ``targets/roles.py``) or ``"names = data flow"``.
        self.sources: dict[str, str] = {}
        #: Weights inside the blocks that look like targets but that the rules could not read
        #: (no rule, an unknown fused layout, a module that does not compute ``x W^T``).
        self.unread: list[str] = []
        #: Heads the forward showed, by ``(parameter_name, role)`` of the Q/K/V targets it read
        #: (query heads for Q, K/V heads for K and V); empty where no forward was read.
        self.heads_read: dict[tuple[str, str], int] = {}


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(size) for size in shape) + ")"


def _table(rows: Sequence[tuple[str, ...]], right_align: tuple[int, ...] = ()) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if i in right_align else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_targets(targets: Iterable[Target]) -> str:
    """A table of the watched matrices (layer, role, parameter, shape) and of what was not watched.

    A ``TargetList`` from ``find_targets`` also says, in a ``from`` column and a tally, what
    decided each target's role: ``names`` (the rules alone: no forward was read, or the forward
    could not be followed there), ``data flow`` (the forward alone: no rule knows the name) or
    ``names = data flow`` (both, in agreement).

    Args:
        targets: what ``find_targets`` returned (a ``TargetList`` also lists its skipped
            parameters; a plain list of targets prints only the targets).

    Example::

        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(4, 2))
        >>> targets = TargetList(
        ...     [Target.from_parameter("h.0.q.weight", w, role="Q", num_layers=2)],
        ...     [Skipped("wte.weight", (10, 2), "embedding")], low_dim=3)
        >>> print(format_targets(targets))
        layer  role  parameter     shape
            0  Q     h.0.q.weight  (4, 2)
        1 target in 2 layers; roles: Q
        not watched:
          wte.weight  (10, 2)  embedding
        and 3 parameters with fewer than 2 dims (biases, norms), never watched
    """
    targets = targets if isinstance(targets, TargetList) else TargetList(targets)
    lines: list[str] = []
    if targets:
        rows: list[tuple[str, ...]] = [("layer", "role", "parameter", "shape")]
        rows += [(str(t.layer), t.role, t.name, _shape_text(t.shape)) for t in targets]
        stacks = list(dict.fromkeys(t.stack for t in targets))
        if stacks != [""]:  # several stacks: each row says which, the layer is within it
            rows = [("stack", *rows[0])] + [
                (t.stack, *row) for t, row in zip(targets, rows[1:], strict=True)
            ]
        # An adapted layer says what adapts it (``lora r=8 (default)``): targets/adapted.py.
        described = [t.description for t in targets]
        if any(described):
            rows = [(*rows[0], "adapter")] + [
                (*row, text) for row, text in zip(rows[1:], described, strict=True)
            ]
        # What decided each role: the names, the forward, or both agreeing (find_targets).
        sources = targets.sources
        if sources:
            rows = [(*rows[0], "from")] + [
                (*row, sources.get(t.name, "names"))
                for t, row in zip(targets, rows[1:], strict=True)
            ]
        lines += _table(rows, right_align=(0 if stacks == [""] else 1,))
        roles = sorted({t.role for t in targets}, key=role_sort_key)
        layers_of = {t.stack: t.num_layers for t in targets}
        where = (
            count(layers_of[""], "layer")
            if stacks == [""]
            else ", ".join(f"{stack} {count(layers_of[stack], 'layer')}" for stack in stacks)
        )
        lines.append(f"{count(len(targets), 'target')} in {where}; roles: {' '.join(roles)}")
        if sources:
            tally = Counter(sources.get(t.name, "names") for t in targets)
            lines.append(
                "roles from: " + ", ".join(f"{source} {tally[source]}" for source in sorted(tally))
            )
    else:
        lines.append("no targets")
    skipped = targets.skipped
    if skipped:
        lines.append("not watched:")
        lines += [
            "  " + line
            for line in _table(
                [(s.parameter_name, _shape_text(s.shape), s.reason) for s in skipped]
            )
        ]
    low_dim = targets.low_dim
    if low_dim:
        lines.append(
            f"and {count(low_dim, 'parameter')} with fewer than 2 dims (biases, norms), never watched"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Skip:
    """A parameter deliberately not watched; ``reason`` is shown in the summary.

    ``warn=True`` marks something that looks like a target but could not be mapped (for example a
    fused projection of unknown layout): ``find_targets`` then warns as well.
    """

    reason: str
    warn: bool = False
