"""Adapted layers (PEFT LoRA and kin): one target per adapted base matrix, its effective weight.

A PEFT tuner layer wraps its base module (``q_proj.base_layer``) and adds the active adapters'
update: for LoRA ``W = W_0 + s B A`` (``s = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), for
DoRA ``W = diag(g / ||W_0 + s B A||_row) (W_0 + s B A)``. ``find_targets`` maps the base weight
by its name without the ``base_layer`` segment (so ``q_proj.base_layer.weight`` is a ``Q`` like
``q_proj.weight``), then :func:`adapt` turns that target into an :class:`AdaptedTarget`, which

* snapshots only what changes: the adapter factors (``s B`` and ``A``, and DoRA's magnitude),
  never the frozen base, which the worker reads live (a base that requires grad, or a layer whose
  update was merged into its base, is copied: then the base itself changes; so is a base whole
  only inside an FSDP1 / ZeRO-3 gather: :meth:`AdaptedTarget.for_gather`);
* multiplies itself as ``W_0 X + s B (A X)`` (``functional.lowrank.AdaptedMatrices``), so the
  engine decomposes the effective weight without forming it;
* carries its update ``s B A`` (PEFT's ``get_delta_weight``), whose spectrum is exact from the
  factors: the ``spectral_update_*`` metrics.

The other additive tuner types (LoHa, LoKr, VeRA, ...: :data:`ADDITIVE_TUNERS`) have no factors to
read: a :class:`DenseAdaptedTarget` asks the layer for ``get_delta_weight(adapter)`` when the
snapshot is taken (an ``m x n`` copy per matrix, on the training thread) and decomposes
``W_0 + dW`` on the live base. Types whose update is not added to the base (OFT, BOFT, HRA
rotate it; IA3 scales it) are refused in one line naming the layer type.

A LoRA layer over a bitsandbytes 4-/8-bit base (QLoRA) has its base dequantized at each snapshot
by the library's own functions (``targets/quantized.py``): an ``m x n`` copy, like a dense matrix.
Other quantized bases are refused in one line naming the layer type.

Nothing here imports ``peft``: a tuner layer is recognized by what it has (``base_layer``,
``get_base_layer``, ``active_adapters``, ``lora_A``/``lora_B``, ``get_delta_weight``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from spectral_callbacks.functional.delta import DenseUpdateMatrices
from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.targets.quantized import (
    dequantized_dtype,
    dequantizer,
    quantized_base,
    whole_matrix,
)
from spectral_callbacks.targets.target import Target

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "ADDITIVE_TUNERS",
    "AdaptedTarget",
    "DenseAdaptedTarget",
    "adapt",
    "is_tuner_layer",
    "unsupported_reason",
]

#: PEFT tuner types (the package under ``peft.tuners``) whose layer computes ``base(x) + x dW^T``
#: with ``dW = sum of get_delta_weight(adapter)`` over the active adapters, in the base weight's
#: stored layout, as their ``merge`` adds it: read as a dense update. Each is checked against
#: ``merge_and_unload()`` in tests/targets/test_peft.py. (LoRA itself is read as factors.)
ADDITIVE_TUNERS = frozenset(
    {"loha", "lokr", "adalora", "vera", "randlora", "vblora", "fourierft", "c3a", "shira"}
)


def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (``BaseTunerLayer``), by what it has."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and callable(getattr(module, "get_base_layer", None))
        and hasattr(module, "active_adapters")
    )


def _is_lora(layer: nn.Module) -> bool:
    return isinstance(getattr(layer, "lora_A", None), nn.ModuleDict) and isinstance(
        getattr(layer, "lora_B", None), nn.ModuleDict
    )


def _tuner(layer: nn.Module) -> str:
    """The tuner type of a PEFT layer: ``"loha"`` for ``peft.tuners.loha.layer.Linear``."""
    return type(layer).__module__.rpartition(".")[0].rpartition(".")[2]


def _reads_delta(layer: nn.Module) -> bool:
    return _tuner(layer) in ADDITIVE_TUNERS and callable(getattr(layer, "get_delta_weight", None))


def _active(layer: Any) -> list[str]:
    """The active adapters the layer holds (an adapter may target other layers only)."""
    if _is_lora(layer):
        return [name for name in layer.active_adapters if name in layer.lora_A]
    stores = [getattr(layer, store, {}) for store in getattr(layer, "adapter_layer_names", ())]
    return [name for name in layer.active_adapters if any(name in store for store in stores)]


def unsupported_reason(layer: nn.Module) -> str | None:
    """Why the adapted ``layer`` cannot be watched, or ``None`` if it can (one line)."""
    kind = f"{_tuner(layer)}.{type(layer).__name__}"
    base = layer.get_base_layer()  # type: ignore[operator]
    weight = getattr(base, "weight", None)
    quantized = quantized_base(base)
    if quantized is not None and not (_is_lora(layer) and dequantizer(base) is not None):
        return (
            f"PEFT layer {kind} over a quantized base ({quantized}): not watched (its weight is "
            "not a matrix until dequantized, which is not done per snapshot)"
        )
    if quantized is None and (not isinstance(weight, torch.Tensor) or weight.dim() != 2):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        return f"PEFT layer {kind} over a non-matrix base ({type(base).__name__}, {shape}): not watched"
    if _reads_delta(layer):
        if getattr(layer, "fan_in_fan_out", False):
            return (
                f"PEFT layer {kind} with fan_in_fan_out (a Conv1D base): not watched (only LoRA's "
                "update is read in that layout)"
            )
        return None
    if not _is_lora(layer):
        if callable(getattr(layer, "get_delta_weight", None)):
            return (
                f"PEFT layer {kind}: its get_delta_weight is not read as an update added to the base "
                f"(that holds for LoRA and {', '.join(sorted(ADDITIVE_TUNERS))}); not watched"
            )
        return f"PEFT layer {kind} has no get_delta_weight to read its update from; not watched"
    lora: Any = layer
    for name in _active(lora):
        if not isinstance(lora.lora_A[name], nn.Linear) or not isinstance(
            lora.lora_B[name], nn.Linear
        ):
            return (
                f"PEFT layer {kind}: adapter {name!r} is not a pair of Linear factors; not watched"
            )
        variant = getattr(lora, "lora_variant", {}).get(name)
        if variant is not None and name not in lora.lora_magnitude_vector:
            return (
                f"PEFT layer {kind}: adapter {name!r} uses the {type(variant).__name__} variant, "
                "whose effective weight is not W0 + s B A; not watched"
            )
    doras = [name for name in _active(lora) if name in getattr(lora, "lora_magnitude_vector", {})]
    if doras and len(_active(lora)) > 1:
        return (
            f"PEFT layer {kind}: DoRA adapter {doras[0]!r} active together with others "
            f"({', '.join(_active(lora))}); activate one DoRA adapter at a time to watch it"
        )
    return None


@dataclass(frozen=True)
class AdaptedTarget(Target):
    """A watched matrix of a PEFT tuner layer: the effective weight ``W_0 + s B A`` (or DoRA's).

    Its ``parameter`` is the base weight (live, never copied while frozen); ``layer_module`` the
    tuner layer. ``rank`` and ``adapters`` describe the active adapters at ``find_targets`` time;
    each snapshot reads the adapters active then.
    """

    layer_module: nn.Module = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    adapters: tuple[str, ...] = ()
    rank: int = 0
    has_update: ClassVar[bool] = True
    #: The layer's parameters are whole only inside a gather (FSDP1, DeepSpeed ZeRO-3): each
    #: snapshot, taken there, copies the base like the factors (``in_gather``), and the bytes it
    #: copies were counted there, with the base (``gathered_bytes``). See :meth:`for_gather`.
    in_gather: bool = False
    gathered_bytes: int | None = None

    def for_gather(self) -> Self:
        """This target where its parameters are whole only inside a gather: the base copied by
        each snapshot, and the bytes a snapshot copies counted now. Call it inside the gather."""
        marked = replace(self, in_gather=True)
        return replace(marked, gathered_bytes=marked.snapshot_bytes())

    def adapter_layer(self) -> nn.Module | None:
        """The tuner layer: its adapters are scaled with the base by a learning-rate factor."""
        return self.layer_module

    def adapter_rank_and_scaling(self) -> tuple[int, float | None, str] | None:
        """``r`` (the active adapters' ranks summed), ``s`` (their scalings summed) and the rule
        PEFT computed ``s`` by (``use_rslora``: ``"rslora"``, s = lora_alpha / sqrt(r); else
        ``"lora"``, s = lora_alpha / r, DoRA's too; ``""`` where the adapters differ or the layer
        does not say), or ``None`` for a kind of adapter without a rank."""
        if not self.rank:
            return None
        scales = getattr(self.layer_module, "scaling", {})  # LoRA-kin: per adapter name
        scaling = sum(float(scales.get(name, 0.0)) for name in self.adapters) or None
        rules = getattr(self.layer_module, "use_rslora", None)
        kinds = {
            ("rslora" if rules[name] else "lora") if isinstance(rules, dict) and name in rules
            else ""
            for name in self.adapters
        }  # fmt: skip
        return self.rank, scaling, kinds.pop() if len(kinds) == 1 else ""

    @property
    def description(self) -> str:
        """``lora r=8 (default)``: what ``format_targets`` prints beside the shape."""
        lora: Any = self.layer_module
        kind = "dora" if any(a in lora.lora_magnitude_vector for a in self.adapters) else "lora"
        return f"{kind} r={self.rank} ({', '.join(self.adapters)})"

    def batch_key(self) -> tuple[str, str]:
        """(group key, device): adapted matrices of one shape, dtype and device batch together."""
        weight = self.parameter
        dtype = str(weight.dtype).removeprefix("torch.")
        m, n = self.shape
        return f"{m}x{n}/{dtype}/{weight.device}/adapted", str(weight.device)

    @classmethod
    def stack_batch(cls, targets: Sequence[Self]) -> AdaptedMatrices:
        """Copy the adapter factors of ``targets`` (on the calling thread / current stream).

        A factor shared by several targets (the ``A`` of a fused ``c_attn`` split into Q, K, V) is
        copied once; the base is referenced, not copied, unless it changes (merged into, or
        trained).
        """
        copies = _Copies()
        bases, ups, downs, magnitudes, adds = [], [], [], [], []
        with torch.no_grad():
            for target in targets:
                base, up, down, magnitude, add = target._snapshot(copies)
                bases.append(base)
                ups.append(up)
                downs.append(down)
                magnitudes.append(magnitude)
                adds.append(add)
        return AdaptedMatrices(
            tuple(bases),
            tuple(ups),
            tuple(downs),
            tuple(magnitudes),
            tuple(adds),
            tuple(copies.owned),
        )

    def snapshot_bytes(self) -> int:
        """The bytes :meth:`stack_batch` copies for this target: its adapter factors (and the base
        only where it changes), counted by the same walk without copying (a factor shared by
        several targets is counted for each: an upper bound); under a gather, as counted there."""
        if self.gathered_bytes is not None:  # the parameters are not whole here: not read
            return self.gathered_bytes
        counting = _Copies(count_only=True)
        with torch.no_grad():
            self._snapshot(counting, dequantize=False)
        return counting.counted

    def _snapshot(self, copies: _Copies, dequantize: bool = True) -> tuple[Any, ...]:
        """``(base, U, V, magnitude, add)`` of the current weights, copied through ``copies``."""
        lora: Any = self.layer_module
        copy = copies.copy
        weight = self.parameter.detach()
        read = dequantizer(lora.get_base_layer())
        if read is not None:  # a quantized base: its matrix, dequantized (a dense copy)
            # Counting (dequantize=False) takes the copy's size from a meta tensor, not a read.
            dtype = dequantized_dtype(lora.get_base_layer())
            base = copy(
                read() if dequantize else torch.empty(self.shape, dtype=dtype, device="meta")
            )
        elif quantized_base(lora.get_base_layer()) is not None:  # packed, no longer readable
            raise RuntimeError(f"{self.name}: its quantized base cannot be dequantized any more")
        elif _base_changes(self):
            base = copy(self.rows.take(weight))
        else:
            base = self.rows.take(weight)
        # The parameters themselves: a factor several targets share is then one object, copied once.
        return (base, *self._factors(copies, self.factor_parameters().__getitem__, weight))

    def factors_of(
        self, read: Callable[[str], torch.Tensor], like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """``(U, V, magnitude, add)`` of the adapters, each factor read by its name in
        :meth:`factor_parameters` through ``read`` (a sharded engine's whole factors, gathered
        from every rank's part): ``U = s B`` (the active adapters side by side, ``(m, r)``),
        ``V = A`` (``(r, n)``), DoRA's magnitude of the matrix's rows or ``None``, and whether
        ``U V`` is added to the base. Reads no parameter of the layer (a sharding wrapper may
        swap them while a forward runs); only its adapters' names, scalings and flags. ``like``:
        the dtype and device of zero-width factors (a layer with no active adapter)."""
        return self._factors(_Copies(), read, like)

    def factor_names(self) -> list[str]:
        """The names of :meth:`factor_parameters`, read without touching a parameter."""
        lora: Any = self.layer_module
        names: list[str] = []
        for name in _active(lora):
            names += [f"lora_B.{name}", f"lora_A.{name}"]
            if name in lora.lora_magnitude_vector:
                names.append(f"magnitude.{name}")
        return names

    def factor_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters the update is read from, by name (the active adapters' ``lora_B``,
        ``lora_A`` and DoRA magnitude): what a sharded engine gathers."""
        lora: Any = self.layer_module
        stores = {
            "lora_B": lambda a: lora.lora_B[a].weight,
            "lora_A": lambda a: lora.lora_A[a].weight,
            "magnitude": lambda a: lora.lora_magnitude_vector[a].weight,
        }
        found = {}
        for name in self.factor_names():
            store, _, adapter = name.partition(".")
            found[name] = stores[store](adapter)
        return found

    def _factors(
        self, copies: _Copies, read: Callable[[str], torch.Tensor], like: torch.Tensor
    ) -> tuple[Any, ...]:
        """``(U, V, magnitude, add)``, each factor read by name through ``read``; ``like``: the
        dtype and device of zero-width factors (a layer with no active adapter)."""
        lora: Any = self.layer_module
        copy = copies.copy
        rows = replace(self.rows, transposed=False)  # rows of the (out, ...) factors
        active = _active(lora)
        if not active:
            # No active adapter on this layer (another one is set): a plain dense target, its
            # effective weight the base; the zero-width factors make its update family NaN.
            zeros = torch.zeros((), dtype=like.dtype, device=like.device)
            up = copy(zeros.expand(self.shape[0], 0))
            down = copy(zeros.expand(0, self.shape[1]))
            return up, down, None, False
        # Several active adapters: their factors side by side, each written once into one copy
        # (a concatenation of copies would be a second tensor the batch reads but does not own).
        up = copies.concat(
            [rows.take(read(f"lora_B.{a}").detach()) for a in active],
            [float(lora.scaling[a]) for a in active],
            dim=1,
        )
        down = copies.concat([read(f"lora_A.{a}") for a in active], dim=0, shared=True)
        magnitude = None
        if active[0] in lora.lora_magnitude_vector:
            g = read(f"magnitude.{active[0]}").detach()
            magnitude = copy(rows.take(g[:, None])[:, 0])
        add = not lora.merged and not lora.disable_adapters
        return up, down, magnitude, add

    def matrix(self) -> torch.Tensor:
        """The current effective weight, formed (offline analysis; the engine never calls it)."""
        batch = self.stack_batch([self])
        return batch.dense(torch.promote_types(batch.dtype, torch.float32))[0]

    def copy_values_into(self, out: torch.Tensor) -> None:
        """Copy the current effective weight into ``out`` (a dense snapshot, when asked for one)."""
        out.copy_(self.matrix())


@dataclass(frozen=True)
class DenseAdaptedTarget(AdaptedTarget):
    """A watched matrix of an additive tuner layer without factors (LoHa, LoKr, ...): ``W_0 + dW``.

    ``dW`` is the layer's own ``get_delta_weight`` summed over the active adapters, formed when
    the snapshot is taken: one dense ``m x n`` copy per adapted layer (the price of having no
    factors to read); the frozen base is read live, as for LoRA. ``rank`` is the sum of the
    adapters' ``r`` (0 for a type without one: its ``update_rank`` is NaN).
    """

    @property
    def description(self) -> str:
        """``loha r=4 (default)``: what ``format_targets`` prints beside the shape."""
        rank = f" r={self.rank}" if self.rank else ""
        return f"{_tuner(self.layer_module)}{rank} ({', '.join(self.adapters)})"

    def batch_key(self) -> tuple[str, str]:
        """(group key, device): dense-update matrices of one shape, dtype and device batch together."""
        key, device = super().batch_key()
        return f"{key}-dense", device

    @classmethod
    def stack_batch(cls, targets: Sequence[Self]) -> DenseUpdateMatrices:
        """Form each layer's update (once for the targets it is split into, e.g. a fused QKV) and
        reference its base (copied only where it changes), on the calling thread / current stream."""
        owned: list[torch.Tensor] = []
        updates: dict[int, torch.Tensor] = {}
        bases, deltas, adds, ranks = [], [], [], []
        with torch.no_grad():
            for target in targets:
                layer: Any = target.layer_module
                weight = target.parameter.detach()
                # Rows interleaved per head (groups > 1) are gathered into a copy by take().
                gathered = target.rows.groups > 1
                base = target.rows.take(weight)
                if _base_changes(target):
                    base = base if gathered else base.clone()
                    owned.append(base)
                whole = updates.get(id(layer))
                if whole is None:
                    whole = updates[id(layer)] = _update_of(layer, weight)
                    if not gathered:
                        owned.append(whole)  # the targets' rows are views of it
                update = target.rows.take(whole)
                if gathered:
                    owned.append(update)
                bases.append(base)
                deltas.append(update)
                adds.append(not layer.merged and not layer.disable_adapters)
                rank = _rank(layer)
                # 0: no active adapter (the update family is NaN); NaN: a type without an r.
                ranks.append(float(rank) if rank or not _active(layer) else float("nan"))
        return DenseUpdateMatrices.of(bases, deltas, adds, ranks, owned)

    def snapshot_bytes(self) -> int:
        """The bytes :meth:`stack_batch` copies for this target: its rows of ``dW`` in the adapters'
        dtype, and the base where it changes."""
        m, n = self.shape
        adapter = next(
            (
                p
                for name, p in self.layer_module.named_parameters()
                if not name.startswith("base_layer.")
            ),
            self.parameter,
        )
        base = m * n * self.parameter.element_size() if _base_changes(self) else 0
        return m * n * adapter.element_size() + base


class _Copies:
    """What a snapshot of adapter factors copies, on the calling thread / current stream.

    Every tensor a batch reads that is not a parameter's storage is made here and kept in
    ``owned``: those are what ``AdaptedMatrices.record_stream`` marks in use on the compute stream
    (on CUDA a fresh allocation it does not know of could be handed back to training while the
    SVD still reads it). ``count_only``: count the bytes without copying (``snapshot_bytes``).
    """

    def __init__(self, count_only: bool = False) -> None:
        self.count_only = count_only
        self.owned: list[torch.Tensor] = []
        self.counted = 0
        self._shared: dict[tuple[int, ...], torch.Tensor] = {}

    def copy(self, tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """A copy of ``tensor`` times ``scale``."""
        return self.concat([tensor], [scale], dim=0)

    def concat(
        self,
        parts: Sequence[torch.Tensor],
        scales: Sequence[float] | None = None,
        dim: int = 0,
        shared: bool = False,
    ) -> torch.Tensor:
        """One copy of ``parts`` side by side along ``dim``, part i times ``scales[i]``;
        ``shared``: the same parts (a factor several targets share: the ``A`` of a fused
        ``c_attn`` split into Q, K, V) are copied once."""
        key = tuple(id(part) for part in parts)
        if shared and key in self._shared:
            return self._shared[key]
        if self.count_only:
            self.counted += sum(part.numel() * part.element_size() for part in parts)
            return parts[0].detach()
        out = torch.cat([part.detach() for part in parts], dim=dim)  # a fresh tensor
        offset = 0
        for part, scale in zip(parts, scales or [1.0] * len(parts), strict=True):
            width = part.shape[dim]
            if scale != 1.0:
                out.narrow(dim, offset, width).mul_(scale)
            offset += width
        self.owned.append(out)
        if shared:
            self._shared[key] = out
        return out


def _base_changes(target: AdaptedTarget) -> bool:
    """Whether the base must be copied: it moves under the snapshot (merged into, trained), its
    rows are gathered per head (no view can hold them), or it is whole only inside the gather the
    snapshot is taken in. Otherwise nothing writes the frozen parameter while the SVD reads it."""
    layer: Any = target.layer_module
    moves = bool(layer.merged) or target.parameter.requires_grad
    return moves or target.rows.groups > 1 or target.in_gather


def _update_of(layer: Any, weight: torch.Tensor) -> torch.Tensor:
    """``sum of get_delta_weight(a)`` over the layer's active adapters, dense, in ``weight``'s layout."""
    total = None
    for name in _active(layer):
        delta = _delta_weight(layer, name).detach()
        delta = delta.to_dense() if delta.layout != torch.strided else delta  # SHiRA: sparse
        total = delta if total is None else total + delta
    if total is None:
        return weight.new_zeros(weight.shape)
    # A type may hand back one of its own parameters as the update: the snapshot must own it.
    live = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    if total.untyped_storage().data_ptr() in live:
        total = total.clone()
    return total.reshape(weight.shape)


def _delta_weight(layer: Any, name: str) -> torch.Tensor:
    """``layer.get_delta_weight(name)`` without rank dropout: LoHa and LoKr drop ranks in train
    mode (a draw from torch's global generator, which would change the run); newer PEFT takes
    ``apply_rank_dropout=False``, older PEFT reads ``layer.training``, set off for the call."""
    method = layer.get_delta_weight
    if "apply_rank_dropout" in inspect.signature(method).parameters:
        return method(name, apply_rank_dropout=False)
    training = layer.training
    layer.training = False  # this layer only: its children's modes are not touched
    try:
        return method(name)
    finally:
        layer.training = training


def _rank(layer: Any) -> int:
    ranks = getattr(layer, "r", None)
    if not isinstance(ranks, Mapping):
        return 0
    return sum(int(ranks[name]) for name in _active(layer) if name in ranks)


def adapt(target: Target, modules: Mapping[str, nn.Module]) -> Target:
    """``target`` as an :class:`AdaptedTarget` when its parameter is a tuner layer's base weight
    (a :class:`DenseAdaptedTarget` for the additive types without factors)."""
    owner, _, _ = target.parameter_name.rpartition(".")
    path, _, leaf = owner.rpartition(".")
    layer = modules.get(path)
    if leaf != "base_layer" or layer is None or not is_tuner_layer(layer):
        return target
    if _is_lora(layer):
        kind: type[AdaptedTarget] = AdaptedTarget
    elif _reads_delta(layer):
        kind = DenseAdaptedTarget
    else:
        return target
    rank = _rank(layer)  # the sum over the active adapters of their r
    fields = target.fields()
    base = layer.get_base_layer()  # type: ignore[operator]
    if quantized_base(base) is not None:
        fields = whole_matrix(target, base)
    return kind(**fields, layer_module=layer, adapters=tuple(_active(layer)), rank=rank)
