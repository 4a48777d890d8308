"""Adapted layers (PEFT LoRA and kin): one target per adapted base matrix, its effective weight.

A PEFT tuner layer wraps its base module (``q_proj.base_layer``) and adds the active adapters'
update: for LoRA ``W = W_0 + s B A`` (``s = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), for
DoRA ``W = diag(g / ||W_0 + s B A||_row) (W_0 + s B A)``. ``find_targets`` maps the base weight
by its name without the ``base_layer`` segment (so ``q_proj.base_layer.weight`` is a ``Q`` like
``q_proj.weight``), then :func:`adapt` turns that target into an :class:`AdaptedTarget`, which

* snapshots only what changes: the adapter factors (``s B`` and ``A``, and DoRA's magnitude),
  never the frozen base, which the worker reads live (a base that requires grad, or a layer whose
  update was merged into its base, is copied: then the base itself changes);
* multiplies itself as ``W_0 X + s B (A X)`` (``functional.lowrank.AdaptedMatrices``), so the
  engine decomposes the effective weight without forming it;
* carries its update ``s B A`` (PEFT's ``get_delta_weight``), whose spectrum is exact from the
  factors: the ``spectral_update_*`` metrics.

Nothing here imports ``peft``: a tuner layer is recognized by what it has (``base_layer``,
``get_base_layer``, ``active_adapters``, ``lora_A``/``lora_B``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from spectral_callbacks.functional.lowrank import AdaptedMatrices
from spectral_callbacks.targets.target import Target

__all__ = ["AdaptedTarget", "adapt", "is_tuner_layer", "unsupported_reason"]


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


def _active(layer: Any) -> list[str]:
    return [name for name in layer.active_adapters if name in layer.lora_A]


def unsupported_reason(layer: nn.Module) -> str | None:
    """Why the adapted ``layer`` cannot be watched as base + factors, or ``None`` if it can."""
    kind = f"{type(layer).__module__.rpartition('.')[0].rpartition('.')[2]}.{type(layer).__name__}"
    base = layer.get_base_layer()  # type: ignore[operator]
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        return (
            f"PEFT layer {kind} over a quantized or non-matrix base ({type(base).__name__}): "
            "not watched (dequantizing it per snapshot is not supported)"
        )
    if not _is_lora(layer):
        return (
            f"PEFT layer {kind}: only LoRA-style adapters (lora_A, lora_B) are read as factors; "
            "not watched"
        )
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
    #: The update family (``spectral_update_*``) is logged for this target.
    has_update: bool = True

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

    @staticmethod
    def stack_batch(targets: Sequence[AdaptedTarget]) -> AdaptedMatrices:
        """Copy the adapter factors of ``targets`` (on the calling thread / current stream).

        A factor shared by several targets (the ``A`` of a fused ``c_attn`` split into Q, K, V) is
        copied once; the base is referenced, not copied, unless it changes (merged into, or
        trained).
        """
        shared: dict[int, torch.Tensor] = {}
        owned: list[torch.Tensor] = []

        def copy(tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            out = tensor.detach().clone() if scale == 1.0 else tensor.detach() * scale
            owned.append(out)
            return out

        def copy_shared(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in shared:
                shared[id(tensor)] = copy(tensor)
            return shared[id(tensor)]

        bases, ups, downs, magnitudes, adds = [], [], [], [], []
        with torch.no_grad():
            for target in targets:
                base, up, down, magnitude, add = target._snapshot(copy, copy_shared)
                bases.append(base)
                ups.append(up)
                downs.append(down)
                magnitudes.append(magnitude)
                adds.append(add)
        return AdaptedMatrices(
            tuple(bases), tuple(ups), tuple(downs), tuple(magnitudes), tuple(adds), tuple(owned)
        )

    def snapshot_bytes(self) -> int:
        """The bytes :meth:`stack_batch` copies for this target: its adapter factors (and the base
        only where it changes), counted by the same walk without copying (a factor shared by
        several targets is counted for each: an upper bound)."""
        counted = 0

        def count(tensor: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            nonlocal counted
            counted += tensor.numel() * tensor.element_size()
            return tensor.detach()

        with torch.no_grad():
            self._snapshot(count, count)
        return counted

    def _snapshot(self, copy: Any, copy_shared: Any) -> tuple[Any, ...]:
        lora: Any = self.layer_module
        rows = replace(self.rows, transposed=False)  # rows of the (out, ...) factors
        active = _active(lora)
        weight = self.parameter.detach()
        # The base itself moves when merged into or trained: then it is copied like a dense
        # matrix, as are rows interleaved per head (no view can hold them). Otherwise the worker
        # reads the live frozen parameter: nothing can write it while the SVD runs.
        changes = lora.merged or self.parameter.requires_grad or self.rows.groups > 1
        base = copy(self.rows.take(weight)) if changes else self.rows.take(weight)
        if not active:
            empty = weight.new_zeros((self.shape[0], 0))
            return base, empty, weight.new_zeros((0, self.shape[1])), None, False
        ups = [
            copy(rows.take(lora.lora_B[a].weight.detach()), float(lora.scaling[a])) for a in active
        ]
        downs = [copy_shared(lora.lora_A[a].weight) for a in active]
        up = ups[0] if len(ups) == 1 else torch.cat(ups, dim=1)
        down = downs[0] if len(downs) == 1 else torch.cat(downs, dim=0)
        magnitude = None
        if active[0] in lora.lora_magnitude_vector:
            magnitude = copy(
                rows.take(lora.lora_magnitude_vector[active[0]].weight.detach()[:, None])[:, 0]
            )
        add = not lora.merged and not lora.disable_adapters
        return base, up, down, magnitude, add

    def matrix(self) -> torch.Tensor:
        """The current effective weight, formed (offline analysis; the engine never calls it)."""
        batch = self.stack_batch([self])
        return batch.dense(torch.promote_types(batch.dtype, torch.float32))[0]

    def copy_into(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the current effective weight into ``out`` (a dense snapshot, when asked for one)."""
        if tuple(out.shape) != self.shape:
            raise ValueError(
                f"`out` must have shape {self.shape} for {self.name}, got {tuple(out.shape)}"
            )
        with torch.no_grad():
            out.copy_(self.matrix())
        return out


def adapt(target: Target, modules: Mapping[str, nn.Module]) -> Target:
    """``target`` as an :class:`AdaptedTarget` when its parameter is a tuner layer's base weight."""
    owner, _, _ = target.parameter_name.rpartition(".")
    path, _, leaf = owner.rpartition(".")
    layer = modules.get(path)
    if leaf != "base_layer" or layer is None or not is_tuner_layer(layer) or not _is_lora(layer):
        return target
    lora: Any = layer
    active = tuple(_active(lora))
    rank = sum(int(lora.r[a]) for a in active)
    fields = {name: getattr(target, name) for name in target.__dataclass_fields__}
    return AdaptedTarget(**fields, layer_module=layer, adapters=active, rank=rank)
