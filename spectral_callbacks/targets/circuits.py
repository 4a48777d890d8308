r"""The heads of each attention layer, as targets of their own: the QK and OV circuits per head.

``find_circuits`` reads the attention layers out of the targets ``find_targets`` found, one
``AttentionLayout`` per layer: which targets form its query, key, value and output, how many query
heads ``H`` and K/V heads ``G`` it has. Each query head becomes a ``HeadCircuit`` target (role
``heads``, or ``heads_cross`` for cross-attention) that knows how to copy what its circuit needs
(``stack_batch``: the layer's Q/K/V/O, copied on the caller's thread like any snapshot, or views
of the snapshot's own copies of them where they are watched as dense matrices) and whose
batch computes ``functional.circuits.circuit_metrics`` off the training thread. The engine and the
reporting see one more kind of target; the per-head values are logged like a mixture's experts
(the mean, min and max over a layer's heads, the histogram over them, each head's own scalar).

Covered layouts (the factors of head ``h``, ``g(h)`` its K/V head):

* separate or fused projections (GPT-2 ``c_attn``, GPT-NeoX ``query_key_value``, Falcon,
  ``nn.MultiheadAttention``, Llama-style ``q/k/v/o_proj``), MHA, GQA and MQA alike: rows
  ``h * d_h .. (h + 1) * d_h`` of Q (K/V: of group ``g``), columns of O;
* factored (MLA, MFA): the query is ``Q_up @ Q_down`` where there is a ``Q_down``, K and V are
  ``K @ KV_down`` / ``V @ KV_down`` where they read the latent (their inputs are not ``d``); the
  rotary channels of the query (its last ``qk_rope_head_dim`` per head, beside ``K_rope``) are left
  out, as are the normalizations between the factors: the circuit is that of the content (``nope``)
  channels of the linear maps;
* the effective weights of adapted (LoRA) layers (``Target.matrix()`` forms ``W_0 + s B A``).

Refused, in one line naming the layer: tied or per-group latent K/V (GTA's ``KV``, GLA's ``K_g*``),
TPA factors, experts, sharded (DTensor) weights, and a layer whose head count cannot be read
(give it with ``circuits={pattern: num_heads}``, matched like ``find_targets``' ``mapping``). The
head count is the module's (``num_heads`` and kin, on it, its parents or their ``config``), else the
one a recorded forward showed (``TargetList.heads_read``: the query's and key's shapes replayed,
``targets/roles.py``), so a block that keeps it in an attribute of its own name is read too.

What each layer's QK values are depends on what the attention does to its logits, read from the
module (``targets/qk_logits.py``: the logit scale it declares, a rotation, QK-norm, the biases):

* ``qk_spectral_norm``: :math:`s\,\sigma_1(W_Q^{h\top} W_K^{g})` of the weights alone, the circuit
  at relative distance 0; left out where the scale is not read;
* ``qk_logit_bound``: a bound on :math:`|\mathrm{logit}_{ij}| / (\lVert \tilde x_i \rVert
  \lVert \tilde x_j \rVert)` (:math:`\tilde x = [x; 1]` where the projections have biases),
  logged only where it holds: without RoPE the augmented circuit's :math:`s\,\sigma_1`, with
  RoPE the product of the augmented factors' norms times :math:`s`; none with QK-norm, for
  factored (MLA, MFA) layouts (normalizations and rotary channels sit between their factors),
  or where the scale is not read;
* ``qk_norm_logit_bound``: with QK-norm, the bound on :math:`|\mathrm{logit}_{ij}|` whatever the
  inputs, from the norms' gains (``functional.circuits.qk_norm_logit_bound``).

Example::

    >>> import torch
    >>> from spectral_callbacks.targets import find_targets
    >>> layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
    >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    >>> heads = find_circuits(model, find_targets(model))
    >>> [(h.layer, h.head, h.role) for h in heads][:3], heads[0].layout.num_kv_heads
    ([(0, 0, 'heads'), (0, 1, 'heads'), (1, 0, 'heads')], 2)
    >>> batch = HeadCircuit.stack_batch(heads)
    >>> sorted(batch.exact_metrics()), batch.exact_metrics()["qk_spectral_norm"].shape
    (['ov_spectral_norm', 'ov_stable_rank', 'qk_logit_bound', 'qk_spectral_norm', 'qk_stable_rank'], torch.Size([4]))
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from spectral_callbacks.functional.batch import MeasuredBatch
from spectral_callbacks.functional.circuits import circuit_metrics, qk_norm_logit_bound
from spectral_callbacks.messages import first_few, rank_zero_warn
from spectral_callbacks.names import HEADS_ROLE
from spectral_callbacks.targets.errors import PartialTargetWarning, TargetError
from spectral_callbacks.targets.forward_scale import ForwardScale, attention_name
from spectral_callbacks.targets.matching import matches
from spectral_callbacks.targets.qk_logits import (
    SCALE_ATTRIBUTES,
    BiasRows,
    LogitScale,
    NormGain,
    bias_of,
    norm_gains,
    read_rotary,
    read_scale,
)
from spectral_callbacks.targets.rules import HEADS, KV_HEADS
from spectral_callbacks.targets.target import Target

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "AttentionLayout",
    "CircuitBatch",
    "HeadCircuit",
    "find_circuits",
    "heads_unread",
    "settle_scales",
]

#: Roles that are not a plain Q/K/V/O: a layer holding one has a layout the circuits do not read.
_REFUSED_ROLES = {"KV": "tied K/V (GTA)", "Q_A": "TPA factors", "K_A": "TPA factors"}
_ROPE_DIM = ("qk_rope_head_dim", "rope_dim")


@dataclass(frozen=True)
class AttentionLayout:
    """How one attention layer's heads are read from its targets.

    Attributes:
        query, key, value: the targets whose product is each ``(rows, d)`` projection, applied
            right to left (``(Q_up, Q_down)``: ``Q_up @ Q_down``); one target for a plain one.
        output: the ``(d, H * d_v)`` output projection.
        num_heads: ``H`` query heads.
        num_kv_heads: ``G`` K/V heads.
        query_rows: rows of each query head that meet the key (``d_h``; fewer than the head's
            rows where its last ones are rotary).
        logit_scale: the logit scale the attention applies: its recorded forward's where read
            (``forward_scale.py``), else its module's declaration (``qk_logits.read_scale``);
            ``scale`` is its value, ``None`` where neither shows one.
        name: the attention module's name (``transformer.h.0.attn``).
        rotary: RoPE rotates its queries and keys.
        query_bias, key_bias: the projections' biases (rows as the targets'), or ``None``.
        norms: the query and key norms' gains under QK-norm, or ``None``.
        no_bound: why ``qk_logit_bound`` does not hold for this layer whatever its scale
            (``""``: it holds where the scale is read).
        unread_norm: why the gains of its QK-norm are not read (``""``: read, or no QK-norm).
    """

    query: tuple[Any, ...]
    key: tuple[Any, ...]
    value: tuple[Any, ...]
    output: Any
    num_heads: int
    num_kv_heads: int
    query_rows: int
    logit_scale: LogitScale
    name: str
    rotary: bool = False
    query_bias: BiasRows | None = None
    key_bias: BiasRows | None = None
    norms: tuple[NormGain, NormGain] | None = None
    no_bound: str = ""
    unread_norm: str = ""

    @property
    def scale(self) -> float | None:
        """The logit scale its QK values are multiplied by (``None``: not read)."""
        return self.logit_scale.value

    def parts(self) -> tuple[Any, ...]:
        """Every target this layout copies, each once."""
        return tuple(dict.fromkeys((*self.query, *self.key, *self.value, self.output)))

    def small_parts(self) -> tuple[BiasRows | NormGain | None, ...]:
        """The vectors copied beside the matrices: query and key biases, their norms' gains."""
        norms = self.norms or (None, None)
        return (self.query_bias, self.key_bias, *norms)

    def kind(self) -> str:
        """What the layers of one batch share beyond shapes: which vectors, RoPE, a bound, a
        declared scale (the declaration: a key that the forward's scale, read later, leaves as
        it is)."""
        present = "".join("1" if part is not None else "0" for part in self.small_parts())
        scaled = "s" if self.logit_scale.declared is not None else "u"
        return f"{present}{'r' if self.rotary else ''}{scaled}{'b' if not self.no_bound else ''}"

    def copy_bytes(self) -> int:
        """What one copy of the layer's parts costs (their shapes in their dtypes)."""
        small = sum(part.nbytes() for part in self.small_parts() if part is not None)
        return sum(part.snapshot_bytes() for part in self.parts()) + small


@dataclass(frozen=True)
class HeadCircuit(Target):
    """One query head's QK and OV circuits: a target the snapshot copies and the engine batches.

    Attributes (beyond :class:`Target`'s):
        name: ``<attention module>[head <h>]``; ``parameter_name`` the attention module's name.
        layer, num_layers, stack: where the layer sits, as its Q target says.
        role: ``heads`` (``heads_cross`` for cross-attention).
        shape: ``(d, d)``: the circuit's shape (never formed).
        parameter: the query's parameter (its device and dtype are the batch's).
        head: the query head's index ``h``.
        layout: the layer's ``AttentionLayout`` (shared by its heads).
    """

    layout: AttentionLayout = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    reads_copies: ClassVar[bool] = True

    @classmethod
    def of_head(
        cls, name: str, layout: AttentionLayout, *, layer: int, num_layers: int, role: str,
        head: int, stack: str = "",
    ) -> HeadCircuit:  # fmt: skip
        """The circuits of query head ``head`` of the layer ``layout`` describes."""
        d = layout.output.shape[0]
        query = layout.query[0].parameter
        return cls(
            name, layout.name, layer, num_layers, role, (d, d), query, stack=stack, head=head,
            layout=layout,
        )  # fmt: skip

    @property
    def attention_layer(self) -> str:
        """The attention module whose head this is (its layout's name)."""
        return self.layout.name

    def matrix(self) -> Tensor:
        """Never formed: the circuits are computed from the Q/K/V/O factors (``stack_batch``)."""
        raise TypeError(f"{self.name}: a head's circuits are never formed as one matrix")

    def batch_key(self) -> tuple[str, str]:
        """Layers of one layout (shapes, heads, dtype, device) are one batch."""
        layout = self.layout
        shapes = "|".join("x".join(map(str, part.shape)) for part in layout.parts())
        device = str(self.parameter.device)
        dtype = str(self.parameter.dtype).removeprefix("torch.")
        kind = layout.kind()
        key = f"circuits/{layout.num_heads}h{layout.num_kv_heads}g{kind}/{shapes}/{dtype}/{device}"
        return key, device

    def snapshot_bytes(self) -> int:
        """This head's share of its layer's copies (the heads of a layer add up to them): an
        upper bound, counted also where they are views of the dense copies."""
        total, heads = self.layout.copy_bytes(), self.layout.num_heads
        return total // heads + (total % heads if self.head == 0 else 0)

    def working_bytes(self, batch: int) -> int | None:
        """An upper bound of what computing ``batch`` heads allocates: the float64 factors of each
        head (query and K/V repeated per head, four of ``d x d_h``) and the projections formed
        from factors (``Q_up @ Q_down``), float64."""
        layout = self.layout
        d = self.shape[0]
        widest = max(part.shape[0] for part in (*layout.query, *layout.key, *layout.value))
        per_head = 8 * (4 * d * max(widest // layout.num_heads, 1) + 4 * d)
        formed = 8 * 3 * widest * d * math.ceil(batch / layout.num_heads)
        return batch * per_head + formed

    @classmethod
    def stack_batch(cls, targets: Sequence[Self]) -> CircuitBatch:
        """Copies of the Q/K/V/O parts of the layers ``targets`` belong to (on the calling
        thread, like every snapshot copy), and which head of which layer each target is."""
        return cls.stack_batch_reading(targets, {})

    @classmethod
    def stack_batch_reading(
        cls, targets: Sequence[Self], copies: Mapping[int, tuple[Tensor, int]]
    ) -> CircuitBatch:
        """:meth:`stack_batch`, where a part whose layers the snapshot's dense copies already
        hold at evenly spaced slots of one stack is a view of it (no second copy)."""
        layers: dict[int, int] = {}  # id(layout) -> index in the batch
        layouts: list[AttentionLayout] = []
        for target in targets:
            if id(target.layout) not in layers:
                layers[id(target.layout)] = len(layouts)
                layouts.append(target.layout)
        first = layouts[0]
        with torch.no_grad():
            stacked = {
                id(part): _stacked_copy([layout.parts()[i] for layout in layouts], copies)
                for i, part in enumerate(first.parts())
            }  # (L, rows, columns) per part
            small = tuple(
                None
                if part is None
                else torch.stack([lay.small_parts()[i].copy() for lay in layouts])  # type: ignore[union-attr]
                for i, part in enumerate(first.small_parts())
            )  # (L, rows) biases, (L, 2, width) norms' gain and shift
        scales = torch.tensor([math.nan if lay.scale is None else lay.scale for lay in layouts])
        # (L,) copied with the snapshot: a scale the first forward reads later is the next one's
        index = [(layers[id(t.layout)], int(t.head or 0)) for t in targets]  # head: always set
        return CircuitBatch(first, tuple(stacked.values()), tuple(index), small, scales)


def _stacked_copy(
    targets: Sequence[Target], copies: Mapping[int, tuple[Tensor, int]] | None = None
) -> Tensor:
    """``(L, rows, columns)``: the current matrices of ``targets`` (of one shape): a view of the
    dense stack in ``copies`` (``id(target) -> (stack, slot)``, the same snapshot's) that holds
    them all at evenly spaced slots, else each copied once, straight into its slot."""
    found = [copies.get(id(target)) for target in targets] if copies else []
    if found and all(entry is not None for entry in found):
        stacks = {id(entry[0]) for entry in found if entry is not None}
        slots = [entry[1] for entry in found if entry is not None]
        step = slots[1] - slots[0] if len(slots) > 1 else 1
        if len(stacks) == 1 and step > 0 and slots == list(range(slots[0], slots[-1] + 1, step)):
            stack = found[0][0]  # type: ignore[index]
            return stack[slots[0] : slots[-1] + 1 : step]
    first = targets[0]
    out = torch.empty(
        (len(targets), *first.shape), dtype=first.parameter.dtype, device=first.parameter.device
    )
    for slot, target in zip(out, targets, strict=True):
        target.copy_into(slot)
    return out


@dataclass
class CircuitBatch(MeasuredBatch):
    """The copies a batch of heads needs, tensor-like where the engine needs it.

    Attributes:
        layout: the layout every layer in the batch shares (its parts in ``layout.parts()`` order).
        copies: per part, the ``(L, rows, columns)`` copies of the batch's ``L`` layers.
        index: per target, ``(layer in the batch, head)``.
        small: per ``layout.small_parts()``, the ``(L, ...)`` float64 copies (or ``None``).
        scales: ``(L,)`` each layer's logit scale (NaN where not read).
    """

    layout: AttentionLayout
    copies: tuple[Tensor, ...]
    index: tuple[tuple[int, int], ...]
    small: tuple[Tensor | None, ...] = (None, None, None, None)
    scales: Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.copies[0].dtype

    @property
    def device(self) -> torch.device:
        return self.copies[0].device

    @property
    def shape(self) -> tuple[int, ...]:
        d = self.layout.output.shape[0]
        return (len(self.index), d, d)

    def __len__(self) -> int:
        return len(self.index)

    def float(self) -> CircuitBatch:
        """Itself: the circuits pick their precision where they factor."""
        return self

    def __getitem__(self, index: slice) -> CircuitBatch:
        return CircuitBatch(self.layout, self.copies, self.index[index], self.small, self.scales)

    def record_stream(self, stream: Any) -> None:
        for copy in (*self.copies, *self.small):
            if copy is not None:
                copy.record_stream(stream)

    def exact_metrics(self) -> dict[str, Tensor]:
        """``functional.circuits.circuit_metrics`` of every layer, then each target's head:
        metric -> ``(B,)`` in the targets' order."""
        layout = self.layout
        query_bias, key_bias, query_norm, key_norm = (
            None if part is None else part.to(self.device) for part in self.small
        )

        def of_layer(i: int) -> dict[str, Tensor]:
            def biases(bias: Tensor | None) -> Tensor | None:
                return None if bias is None else bias[i : i + 1]

            return circuit_metrics(
                *self.projections(slice(i, i + 1)), layout.num_heads, layout.num_kv_heads,
                scale=1.0, query_bias=biases(query_bias), key_bias=biases(key_bias),
                rotary=layout.rotary,
            )  # fmt: skip

        # One layer at a time (all its heads in one batch): its Grams read one layer's copies while
        # they are in cache.
        layers = [of_layer(i) for i in range(len(self.copies[0]))]
        metrics = {name: torch.cat([layer[name] for layer in layers]) for name in layers[0]}
        # metric -> (L, H), the logit scale applied per layer below
        assert self.scales is not None
        scales = self.scales.to(self.device, torch.float64)[:, None]  # (L, 1)
        if bool(scales.isnan().any()):  # a layer's scale not read: nothing scaled, no bound
            del metrics["qk_spectral_norm"], metrics["qk_logit_bound"]
        else:
            metrics["qk_spectral_norm"] = metrics["qk_spectral_norm"] * scales
            metrics["qk_logit_bound"] = metrics["qk_logit_bound"] * scales
            if layout.no_bound:
                del metrics["qk_logit_bound"]
            if query_norm is not None and key_norm is not None:
                per_layer = qk_norm_logit_bound(1.0, query_norm, key_norm)[:, None] * scales
                metrics["qk_norm_logit_bound"] = per_layer.expand_as(metrics["qk_stable_rank"])
        layer = torch.tensor([i for i, _ in self.index])
        head = torch.tensor([h for _, h in self.index])
        return {name: value[layer, head] for name, value in metrics.items()}

    def projections(self, layers: slice = slice(None)) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The ``(L, H * d_h, d)`` query (content rows), key, value and ``(L, d, H * d_v)`` output
        of the batch's ``layers`` (default all): views of the copies (float32 where they are
        half precision), or formed in float64 from their factors where they are factored."""
        layout = self.layout
        by_part = {
            part: copy[layers] for part, copy in zip(layout.parts(), self.copies, strict=True)
        }

        def product(parts: tuple[Any, ...]) -> Tensor:
            if len(parts) == 1:
                return _at_least_float32(by_part[parts[0]])
            # 1. A factored projection formed from its factors (d_h-wide at most: never d x d).
            matrix = by_part[parts[0]].double()
            for part in parts[1:]:
                matrix = matrix @ by_part[part].double()  # (L, rows, ...) @ (L, ..., d)
            return matrix

        query = product(layout.query)  # (L, H * rows per head, d)
        if layout.query_rows * layout.num_heads != query.shape[-2]:
            # 2. The rotary rows of each query head do not meet the key's content rows.
            per_head = query.shape[-2] // layout.num_heads
            heads = query.unflatten(-2, (layout.num_heads, per_head))
            query = heads[..., : layout.query_rows, :].flatten(-3, -2)
        output = _at_least_float32(by_part[layout.output])
        return query, product(layout.key), product(layout.value), output


def _at_least_float32(copy: Tensor) -> Tensor:
    """``copy`` itself where it is float32 or float64 (no conversion), else its float32 copy."""
    return copy if copy.dtype in (torch.float32, torch.float64) else copy.float()


Heads = Mapping[str, int]


def find_circuits(
    model: nn.Module,
    targets: Sequence[Any],
    heads: Heads | None = None,
    read: Mapping[tuple[str, str], int] | None = None,
    scales: Mapping[str, ForwardScale | None] | None = None,
    *,
    scales_later: bool = False,
) -> list[HeadCircuit]:
    """One ``HeadCircuit`` per query head of every attention layer among ``targets``.

    Args:
        model: the model ``targets`` were found in (its modules carry the head counts).
        targets: from ``find_targets``.
        heads: ``{pattern: num_heads}`` for layers whose head count the modules do not carry
            (patterns as in ``find_targets``' ``mapping``, matched on the attention module's
            name); default ``None``.
        read: the heads a forward showed, ``TargetList.heads_read`` (``(parameter name, role)``
            of Q/K/V -> heads): used where the modules carry no count; default ``None``.
        scales: the logit scale each attention module's recorded forward applies
            (``FlowMap.logit_scales``); default ``None`` (no forward recorded: the modules'
            declarations).
        scales_later: the forward's scales come later (a run whose names decided before its
            first forward): :func:`settle_scales` is called then, and says what it finds;
            default ``False``.

    Returns:
        The heads in (stack, layer, head) order; layers that cannot be read are left out with one
        ``PartialTargetWarning`` naming each and why; layers whose QK-norm gains are not read are
        named in one more (no ``qk_norm_logit_bound``), and :func:`settle_scales` names those
        whose logit scale is not read (their QK values are not scaled, nor called a bound) and
        those whose forward applies another scale than they declare (the forward's is used).

    Raises:
        TargetError: ``heads`` is not a mapping of patterns to positive ints, a pattern of it
            matches no attention layer or gives a layer another head count than its module has,
            or no attention layer could be read.
    """
    if heads is not None and not (
        isinstance(heads, Mapping)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in heads.values())
    ):
        raise TargetError(
            f"`heads` must be a dict {{pattern: number of query heads}}, e.g. "
            f"{{'*.attn': 12}}, got {heads!r}"
        )
    modules = dict(model.named_modules())
    by_layer: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for target in targets:
        role = target.role
        suffix = "_cross" if role.endswith("_cross") else ""
        by_layer[(target.stack, target.layer, suffix)][role.removesuffix(suffix)] = target
    found: list[HeadCircuit] = []
    refused: list[str] = []
    unread_norms: list[str] = []
    attention_names: list[str] = []
    for (stack, layer, suffix), roles in by_layer.items():
        if "O" not in roles:
            continue  # no attention here (an MLP-only layer, or roles= left its O out)
        attention_names.append(_attention_name(roles))
        where = f"{stack} " if stack else ""
        try:
            layout = _layout(roles, modules, heads or {}, read or {})
        except _Refused as refusal:
            refused.append(f"{where}layer {layer} ({_attention_name(roles)}): {refusal}")
            continue
        if layout.unread_norm:
            unread_norms.append(f"{where}layer {layer} ({layout.name}): {layout.unread_norm}")
        first = roles["O"]
        found += [
            HeadCircuit.of_head(
                f"{layout.name}[head {h}]" if not suffix else f"{layout.name}[cross head {h}]",
                layout,
                layer=layer,
                num_layers=first.num_layers,
                role=HEADS_ROLE + suffix,
                head=h,
                stack=stack,
            )
            for h in range(layout.num_heads)
        ]
    unmatched = [
        pattern
        for pattern in heads or {}
        if not any(matches([pattern], name) is not None for name in attention_names)
    ]
    if unmatched:
        raise TargetError(
            f"circuits: pattern(s) {unmatched} match no attention layer; the attention modules "
            f"are {first_few(attention_names)}"
        )
    if refused:
        rank_zero_warn(
            "QK/OV circuits are not computed for "
            + "; ".join(refused)
            + ". Where a head count is missing, give it with circuits={pattern: num_heads}.",
            category=PartialTargetWarning,
        )
    if unread_norms:
        rank_zero_warn(
            "the QK-norm gains of "
            + first_few(unread_norms, "; ")
            + ": qk_norm_logit_bound is not logged for it (nor qk_logit_bound: QK-norm).",
            category=PartialTargetWarning,
        )
    if not found and by_layer:
        raise TargetError(
            "circuits: no attention layer could be read"
            + (f" ({refused[0]})" if refused else " (no layer has an O target)")
        )
    if not scales_later:
        settle_scales(found, scales or {})
    return found


def settle_scales(heads: Sequence[HeadCircuit], scales: Mapping[str, ForwardScale | None]) -> None:
    """Give each layer of ``heads`` the logit scale its recorded forward applies (``scales``,
    by attention module; ``{}``: no forward read), before their first snapshot copies it; one
    ``PartialTargetWarning`` names the layers whose forward applies another scale than their
    module declares (the forward's is used), one more those with no scale at all."""
    layouts = list({id(h.layout): (h, h.layout) for h in heads}.values())
    contradicted: list[str] = []
    unscaled: list[str] = []
    for head, layout in layouts:
        applied = scales.get(layout.name)
        if applied is not None:
            layout.logit_scale.applied = applied
            said = layout.logit_scale.contradiction()
            if said:
                contradicted.append(f"{layout.name} {said}")
        if layout.scale is None:
            where = f"{head.stack} " if head.stack else ""
            unscaled.append(f"{where}layer {head.layer} ({layout.name})")
    if contradicted:
        rank_zero_warn(
            "the logit scale the forward applies is not the one the module declares: "
            + first_few(contradicted, "; ")
            + ". The QK values are scaled by what the forward applies.",
            category=PartialTargetWarning,
        )
    if unscaled:
        rank_zero_warn(
            "the logit scale of "
            + first_few(unscaled)
            + " is not declared on its module (none of `"
            + "`, `".join(SCALE_ATTRIBUTES)
            + "`) nor shown by a recorded forward (an SDPA/flex `scale=`, a number multiplying "
            "the logits): qk_spectral_norm and qk_logit_bound are not logged for it. Set the attention "
            "module's `scaling` to the scale its softmax applies.",
            category=PartialTargetWarning,
        )


class _Refused(Exception):
    """A layer whose circuits are not read; the message says why."""


def _attention_name(roles: Mapping[str, Any]) -> str:
    """The attention module's name (``forward_scale.attention_name``: the common dotted prefix
    of its query's and output's modules, ``transformer.h.0.attn`` of ``attn.c_attn`` and
    ``attn.c_proj``), as the recorded forward names it too."""
    query = roles.get("Q", roles.get("Q_up"))
    if query is None:  # no query target: the output projection's owner
        return attention_name(roles["O"].parameter_name, None)
    return attention_name(query.parameter_name, roles["O"].parameter_name)


def _lookup(modules: Mapping[str, nn.Module], name: str, attributes: tuple[str, ...]) -> int | None:
    """The first int under ``attributes`` on module ``name``, its ancestors or their ``config``."""
    path = name.split(".") if name else []
    for depth in range(len(path), -1, -1):
        module = modules.get(".".join(path[:depth]))
        for source in (module, getattr(module, "config", None)):
            if source is None:
                continue
            for attribute in attributes:
                value = getattr(source, attribute, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _layout(
    roles: Mapping[str, Any],
    modules: Mapping[str, nn.Module],
    heads: Heads,
    read: Mapping[tuple[str, str], int],
) -> AttentionLayout:
    """The layout of one layer from its role -> target, or ``_Refused`` with the reason."""
    for role, reason in _REFUSED_ROLES.items():
        if role in roles:
            raise _Refused(f"{reason} is not a layout the circuits read")
    if any(role.startswith(("K_g", "V_g")) for role in roles):
        raise _Refused("per-group latent K/V (GLA) is not a layout the circuits read")
    missing = [role for role in ("K", "V") if role not in roles]
    if not {"Q", "Q_up"} & set(roles):
        missing.insert(0, "Q")
    if missing:
        raise _Refused(f"no {'/'.join(missing)} target")
    for target in roles.values():
        if target.expert is not None:
            raise _Refused("experts' attention is not read")
        if type(target.parameter).__name__ == "DTensor":
            raise _Refused("sharded (DTensor) weights are not gathered for circuits")
    name = _attention_name(roles)
    query: tuple[Any, ...] = (roles.get("Q") or roles["Q_up"],)
    if "Q_up" in roles and "Q_down" in roles:
        query = (roles["Q_up"], roles["Q_down"])
    d = roles["O"].shape[0]
    latent = roles.get("KV_down")
    key: tuple[Any, ...] = (roles["K"],)
    value: tuple[Any, ...] = (roles["V"],)
    if roles["K"].shape[1] != d:  # K and V read the latent
        if latent is None or latent.shape[0] != roles["K"].shape[1]:
            raise _Refused(f"K reads {roles['K'].shape[1]} inputs, neither d={d} nor a KV_down")
        key, value = (roles["K"], latent), (roles["V"], latent)
    given = next((n for pattern, n in heads.items() if matches([pattern], name) is not None), None)
    own = _lookup(modules, name, HEADS)
    if given is not None and own is not None and given != own:
        pattern = next(p for p in heads if matches([p], name) is not None)
        raise TargetError(
            f"circuits={{{pattern!r}: {given}}} gives {name} {given} query heads, but the module "
            f"has {own} ({'/'.join(HEADS)}) and {_lookup(modules, name, KV_HEADS) or own} K/V "
            "heads: leave the layer out of `circuits` (its own count is read)"
        )
    num_heads = given or own or _read_heads(roles, "Q", read)
    if num_heads is None:
        raise _Refused(HEADS_UNREAD)
    q_rows, k_rows, v_rows = query[0].shape[0], key[0].shape[0], value[0].shape[0]
    o_columns = roles["O"].shape[1]
    if q_rows % num_heads or o_columns % num_heads:
        raise _Refused(f"{q_rows} query rows or {o_columns} output columns per {num_heads} heads")
    per_head = q_rows // num_heads
    kv_heads = _lookup(modules, name, KV_HEADS)
    if kv_heads is None and given is None and own is None:  # the forward's count, as the query's
        kv_heads = _read_heads(roles, "K", read)
    if kv_heads is None or k_rows % kv_heads:
        kv_heads = k_rows // per_head if k_rows % per_head == 0 else num_heads
    rope = _lookup(modules, name, _ROPE_DIM) or 0
    k_head = k_rows // kv_heads if k_rows % kv_heads == 0 else 0
    rotary = "K_rope" in roles and per_head - rope == k_head
    if not k_head or num_heads % kv_heads or not (per_head == k_head or rotary):
        raise _Refused(
            f"{k_rows} key rows do not fit {num_heads} heads of {per_head} query rows "
            f"(K/V heads: {kv_heads})"
        )
    if v_rows % kv_heads or o_columns // num_heads != v_rows // kv_heads:
        raise _Refused(f"{v_rows} value rows do not fit {kv_heads} K/V heads and O's columns")
    return _with_logits(
        AttentionLayout(
            query, key, value, roles["O"], num_heads, kv_heads, k_head, LogitScale(None), name
        ),
        modules,
    )


HEADS_UNREAD = "its head count is not on the module or its config, nor read from a forward"


def _read_heads(
    roles: Mapping[str, Any], role: str, read: Mapping[tuple[str, str], int]
) -> int | None:
    """The heads a forward showed for the layer's ``role`` target (``None``: not read)."""
    target = roles.get(role)
    if target is None:
        return None
    return read.get((target.parameter_name, target.role))


def heads_unread(model: nn.Module, targets: Sequence[Any], heads: Heads | None = None) -> list[str]:
    """The attention layers among ``targets`` whose head count only a forward can tell (neither
    their modules nor ``heads`` give it): the circuits of these need the forward's reading."""
    modules = dict(model.named_modules())
    by_layer: dict[tuple[str, int, str], dict[str, Any]] = defaultdict(dict)
    for target in targets:
        suffix = "_cross" if target.role.endswith("_cross") else ""
        by_layer[(target.stack, target.layer, suffix)][target.role.removesuffix(suffix)] = target
    unread = []
    for roles in by_layer.values():
        if "O" not in roles or not {"Q", "Q_up"} & set(roles):
            continue
        name = _attention_name(roles)
        given = any(matches([pattern], name) is not None for pattern in heads or {})
        if not given and _lookup(modules, name, HEADS) is None:
            unread.append(name)
    return unread


def _with_logits(layout: AttentionLayout, modules: Mapping[str, nn.Module]) -> AttentionLayout:
    """``layout`` with what its attention does to the logits (``targets/qk_logits.py``): the
    scale, RoPE, QK-norm, the biases, and why ``qk_logit_bound`` does not hold where it does not."""
    module = modules.get(layout.name)
    if module is None:
        return dataclasses.replace(layout, no_bound="its attention module is not found")
    per_head = layout.query[0].shape[0] // layout.num_heads
    scale, declared_as = read_scale(module, per_head)
    norms = norm_gains(module)
    factored = len(layout.query) > 1 or len(layout.key) > 1 or layout.query_rows != per_head
    biases: tuple[BiasRows | None, ...] = (None, None)
    if not factored:
        biases = tuple(bias_of(part[0], dict(modules)) for part in (layout.query, layout.key))
    no_bound = ""
    if norms is not None:
        no_bound = "QK-norm: the logit does not grow with the inputs' norms"
    elif factored:
        no_bound = "factored Q/K: normalizations and rotary channels sit between the factors"
    return dataclasses.replace(
        layout,
        logit_scale=LogitScale(scale, declared_as),
        rotary=read_rotary(module),
        query_bias=biases[0],
        key_bias=biases[1],
        norms=norms if isinstance(norms, tuple) else None,
        no_bound=no_bound,
        unread_norm=norms if isinstance(norms, str) else "",
    )
