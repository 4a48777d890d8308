"""Parameters no rank holds a matrix of - FSDP1's flat parameters, DeepSpeed ZeRO-3's partitions -
gathered by the strategy's own public API, one unit at a time.

The monitor decomposes a watched matrix where it lives: whole on every rank (one process, DDP), or
as DTensor shards whose global positions are known (FSDP2 ``fully_shard``, tensor parallelism;
see ``shards.py``). FSDP1 (``FullyShardedDataParallel``) concatenates each wrapped unit's
parameters into one 1-D ``FlatParameter`` and gives each rank a slice of it; with
``use_orig_params=True`` each original parameter is a 1-D view of that slice, often empty.
ZeRO-3 replaces every parameter by an empty placeholder with its partition kept aside. Neither
leaves a matrix on any rank, so a snapshot gathers them with the strategy's own public API:

* FSDP1: ``FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False)``
  per FSDP unit (inside it the original ``Parameter`` objects hold their full values);
* ZeRO-3: ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)`` per block of the
  model (the parameters its watched matrices read).

An adapted layer (PEFT LoRA and kin) is snapshotted as its base and factors; elsewhere the frozen
base is referenced, not copied, but here it is whole only inside the gather, so
:func:`held_in_gathers` makes each snapshot copy it there (and counts it in the budget): the
decomposition after the gather reads whole matrices.

A :class:`GatherUnit` is one such gather and the targets that read only what it gathers. The
engine (``distributed.DistributedEngine`` with ``units=``) opens every unit on every rank in the
same order (the gathers are collectives) and, inside each, copies the matrices this rank owns;
the ranks then decompose their own shares as under DDP. So a rank holds at most one unit's full
parameters beyond its own copies, and a snapshot moves each unit's parameters once: at a 25-step
cadence about 1/50 of the strategy's own traffic (it gathers every parameter twice a step,
forward and backward; docs/distributed.md has the measured bytes).

Finding the targets needs the model's full shapes once: :meth:`Gathering.whole` gathers the
whole model for that (as one forward does, unit by unit, and the whole model at once here).

How the schemes are recognised, the one place that reads other libraries' markers:

* FSDP1: a ``FullyShardedDataParallel`` module (public), else a parameter FSDP1 marked as
  flattened - the ``FlatParameter`` itself (``_is_flat_param``) or an original parameter under
  ``use_orig_params`` - through the private ``_fsdp_flattened`` / ``_is_flat_param`` attributes
  (torch's ``fsdp._common_utils.FSDP_FLATTENED``; FSDP2 sets neither).
* ZeRO-3: DeepSpeed's documented parameter attributes ``ds_id``, ``ds_status`` and ``ds_numel``
  (what ``deepspeed.zero.Init`` and the ZeRO-3 engine add to every partitioned parameter, and
  what ``deepspeed.zero.GatheredParameters`` users test for).

Example::

    >>> import torch
    >>> partitioning(torch.nn.Linear(4, 4)) is None
    True
    >>> layer = torch.nn.Linear(4, 4)
    >>> layer.weight.ds_id, layer.weight.ds_status, layer.weight.ds_numel = 0, "NOT_AVAILABLE", 16
    >>> partitioning(layer)
    'DeepSpeed ZeRO-3'
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.targets.adapted import AdaptedTarget
from spectral_callbacks.targets.matching import block_of
from spectral_callbacks.targets.target import Target

__all__ = [
    "GatherUnit",
    "Gathering",
    "gathering_of",
    "held_in_gathers",
    "partitioned_error",
    "partitioning",
    "refuse_partitioned",
]

FSDP1 = "FSDP1 (FullyShardedDataParallel)"
ZERO3 = "DeepSpeed ZeRO-3"

# FSDP1's marks on the parameters it flattened (private: torch.distributed.fsdp._common_utils).
_FSDP1_FLATTENED = ("_fsdp_flattened", "_is_flat_param")
# DeepSpeed's documented attributes of a ZeRO-3 partitioned parameter.
_ZERO3_PARAMETER = ("ds_id", "ds_status", "ds_numel")


def partitioning(model: torch.nn.Module) -> str | None:
    """Which scheme flattened or partitioned ``model``'s parameters: ``FSDP1``, ``ZERO3`` or ``None``.

    Args:
        model: the model as the training loop holds it (a wrapper or the module inside it).
    """
    if any(isinstance(module, _fsdp1_wrapper()) for module in model.modules()):
        return FSDP1
    for parameter in model.parameters():
        if any(getattr(parameter, mark, False) for mark in _FSDP1_FLATTENED):
            return FSDP1
        if all(hasattr(parameter, attribute) for attribute in _ZERO3_PARAMETER):
            return ZERO3
    return None


def partitioned_error(caller: str, scheme: str, why: str) -> ConfigurationError:
    """The error every frontend raises for a model trained with ``scheme`` that cannot be gathered.

    Args:
        caller: the frontend's name (``SpectralMonitor``, ``SpectralTracker``, ...).
        scheme: what partitions the parameters (``FSDP1``, ``ZERO3``, a Lightning strategy name).
        why: what stands in the way, and what to do.
    """
    return ConfigurationError(f"{caller} cannot watch a model trained with {scheme}: {why}")


def refuse_partitioned(model: torch.nn.Module, caller: str) -> None:
    """Raise :func:`partitioned_error` if FSDP1 or ZeRO-3 holds ``model``'s parameters in a way
    :func:`gathering_of` cannot gather (see there).

    Raises:
        ConfigurationError: see :func:`gathering_of`.
    """
    gathering_of(model, caller)


@dataclass(frozen=True)
class GatherUnit:
    """One gather of the strategy's public API and the watched matrices that read only what it
    gathers.

    Attributes:
        key: the unit's name in the snapshot's group keys (``u03``).
        targets: the targets read inside it, in target order.
        gathered_bytes: the full bytes of every parameter it gathers (what a rank holds inside it).
        open: enters the gather (a collective: every rank opens every unit, in the same order).
    """

    key: str
    targets: tuple[Target, ...]
    gathered_bytes: int
    open: Callable[[], AbstractContextManager[object]]


class Gathering:
    """How one scheme gathers a model's parameters: the whole model, or unit by unit.

    Args:
        model: the model the loop holds.
        scheme: :data:`FSDP1` or :data:`ZERO3`.
    """

    def __init__(self, model: torch.nn.Module, scheme: str) -> None:
        self.model = model
        self.scheme = scheme

    def whole(self) -> AbstractContextManager[object]:
        """Every parameter gathered (to find the targets and copy ``delta=``'s references)."""
        raise NotImplementedError

    def units(self, targets: Sequence[Target]) -> list[GatherUnit]:
        """The gathers a snapshot of ``targets`` opens, in order, each with the targets it serves."""
        raise NotImplementedError

    def check(self, targets: Sequence[Target], caller: str) -> None:
        """Refuse the kinds of target a gather cannot serve yet, in one line.

        Raises:
            ConfigurationError: attention heads (``circuits=``: their batch reads four
                projections the units do not group).
        """
        for target in targets:
            if target.attention_layer is not None:
                why = (
                    "the per-head circuits (circuits=) are not gathered: pass circuits=False, or "
                    "shard with FSDP2 (fully_shard)"
                )
                raise partitioned_error(caller, self.scheme, why)


class FSDP1Gathering(Gathering):
    """FSDP1 units: each ``FullyShardedDataParallel`` module, gathered without its nested units.

    ``summon_full_params(unit, recurse=False, writeback=False)`` restores the unit's original
    ``Parameter`` objects (``use_orig_params=True``) to their full values for the context, so a
    target, which holds the live parameter, reads its whole matrix there; ``writeback=False``
    discards nothing, the copies never write.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, FSDP1)
        from torch.distributed.fsdp import FullyShardedDataParallel

        self._fsdp = FullyShardedDataParallel
        self._units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        # id(parameter) -> index of the unit that flattened it (its own modules, not nested units).
        self._owner = {
            id(parameter): index
            for index, unit in enumerate(self._units)
            for module in _own_modules(unit, FullyShardedDataParallel)
            for parameter in module.parameters(recurse=False)
        }
        self._full_bytes: dict[int, int] = {}  # id(parameter) -> its full bytes, read in whole()

    def owned(self, parameter: torch.Tensor) -> bool:
        """Whether a unit inside the model flattened ``parameter`` (so a gather here holds it)."""
        return id(parameter) in self._owner

    @contextlib.contextmanager
    def whole(self) -> Iterator[object]:
        with self._fsdp.summon_full_params(self.model, recurse=True, writeback=False):
            for parameter in self.model.parameters():
                self._full_bytes[id(parameter)] = parameter.numel() * parameter.element_size()
            yield None

    def units(self, targets: Sequence[Target]) -> list[GatherUnit]:
        if not self._full_bytes:  # the plan found the targets without a whole gather
            with self.whole():
                pass
        by_units: dict[tuple[int, ...], list[Target]] = {}
        for target in targets:
            read = {self._owner[id(p)] for p in read_parameters(target) if id(p) in self._owner}
            by_units.setdefault(tuple(sorted(read)), []).append(target)
        gathers = []
        for owners, members in sorted(by_units.items()):
            units = [self._units[index] for index in owners]
            own = {
                id(p)
                for unit in units
                for m in _own_modules(unit, self._fsdp)
                for p in m.parameters(recurse=False)
            }
            gathers.append(
                GatherUnit(
                    "u" + "+".join(f"{index:03d}" for index in owners),
                    tuple(members),
                    sum(self._full_bytes.get(key, 0) for key in own),
                    functools.partial(self._summon, units),
                )
            )
        return gathers

    @contextlib.contextmanager
    def _summon(self, units: Sequence[torch.nn.Module]) -> Iterator[object]:
        with contextlib.ExitStack() as stack:
            for unit in units:
                stack.enter_context(
                    self._fsdp.summon_full_params(unit, recurse=False, writeback=False)
                )
            yield None


class Zero3Gathering(Gathering):
    """ZeRO-3 units: the parameters the watched matrices of one block (stack, layer) read,
    gathered by one ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, ZERO3)

    def whole(self) -> AbstractContextManager[object]:
        return self._gathered(list(self.model.parameters()))

    def units(self, targets: Sequence[Target]) -> list[GatherUnit]:
        blocks: dict[tuple[str, int], list[Target]] = {}
        for target in targets:
            blocks.setdefault((target.stack, target.layer), []).append(target)
        gathers = []
        for index, members in enumerate(blocks.values()):
            read = list({id(p): p for t in members for p in read_parameters(t)}.values())
            size = sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in read)
            gathers.append(
                GatherUnit(
                    f"u{index:03d}", tuple(members), size, functools.partial(self._gathered, read)
                )
            )
        return gathers

    @staticmethod
    def _gathered(parameters: list[torch.Tensor]) -> AbstractContextManager[object]:
        import deepspeed

        return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)


def gathering_of(model: torch.nn.Module, caller: str = "SpectralTracker") -> Gathering | None:
    """The gathering of ``model``'s partitioned parameters, or ``None`` where a rank holds them
    whole (one process, DDP) or as DTensor shards (FSDP2, tensor parallel).

    Args:
        model: the model as the training loop holds it.
        caller: the name messages use.

    Raises:
        ConfigurationError: FSDP1 with ``use_orig_params=False`` (its parameters are re-created
            at each gather, so a watched matrix cannot be held), FSDP1 parameters with no
            ``FullyShardedDataParallel`` unit inside ``model`` (the module held inside its
            wrapper: hand the tracker the wrapper), or a linear layer's weight inside ``model``'s
            blocks flattened by a unit outside ``model`` (see :func:`_held_outside`).
    """
    scheme = partitioning(model)
    if scheme == ZERO3:
        return Zero3Gathering(model)
    if scheme != FSDP1:
        return None
    if any(getattr(parameter, "_is_flat_param", False) for parameter in model.parameters()):
        raise partitioned_error(
            caller,
            scheme,
            "with use_orig_params=False its parameters are flat and the module's weights are "
            "re-created at each gather, so no watched matrix can be held; wrap with "
            "FullyShardedDataParallel(..., use_orig_params=True) (accelerate: "
            "fsdp_use_orig_params: true; the Hugging Face Trainer: "
            'fsdp_config={"use_orig_params": True})',
        )
    if not any(isinstance(module, _fsdp1_wrapper()) for module in model.modules()):
        raise partitioned_error(
            caller,
            scheme,
            "the model given holds FSDP1's flattened parameters but no FullyShardedDataParallel "
            "unit to gather them with (the module taken out of its wrapper); pass the wrapper",
        )
    gathering = FSDP1Gathering(model)
    outside = _held_outside(model, gathering.owned)
    if outside:
        shown = ", ".join(outside[:3]) + (
            f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        )
        raise partitioned_error(
            caller,
            scheme,
            f"{len(outside)} linear weights inside its blocks ({shown}) are flattened into a "
            "FullyShardedDataParallel unit outside the model given (the root unit around it), "
            "which it cannot gather, so they would go unwatched; wrap every block in a unit of its "
            "own (auto_wrap_policy=ModuleWrapPolicy({Block}); Lightning: "
            "FSDPStrategy(auto_wrap_policy={Block}); the Hugging Face Trainer: "
            'fsdp_config={"transformer_layer_cls_to_wrap": ["Block"]}), or pass the outermost '
            "wrapper",
        )
    return gathering


def _held_outside(model: torch.nn.Module, owned: Callable[[torch.Tensor], bool]) -> list[str]:
    """The weights of linear layers (``nn.Linear``, Hugging Face's ``Conv1D``) inside ``model``'s
    blocks that FSDP1 flattened into a unit ``model`` does not contain.

    A frontend handed the module inside FSDP1's root wrapper (Lightning's ``pl_module``, the
    Hugging Face Trainer's ``model``) sees every nested unit but not the root: what the root
    flattened stays a 1-D slice in every gather the tracker can open, so the matrices among it
    would never be found. Embeddings, norms and heads outside the blocks are never watched, so the
    root may hold them.
    """
    modules = dict(torch.nn.Module.named_modules(model))
    outside = []
    for name, parameter in torch.nn.Module.named_parameters(model):  # FSDP1's names kept
        path, _, leaf = name.rpartition(".")
        layer = modules.get(path)
        linear = isinstance(layer, torch.nn.Linear) or type(layer).__name__ == "Conv1D"
        flattened = any(getattr(parameter, mark, False) for mark in _FSDP1_FLATTENED)
        in_block = block_of(name, 0, modules) is not None
        if leaf == "weight" and linear and flattened and in_block and not owned(parameter):
            outside.append(name.replace("_fsdp_wrapped_module.", ""))
    return outside


def held_in_gathers(targets: Sequence[Target]) -> list[Target]:
    """``targets`` with each adapted one copying its base at every snapshot (the frozen base,
    which a snapshot elsewhere references, is whole only inside the gather) and its snapshot's
    bytes counted now, base included. Call it inside :meth:`Gathering.whole`."""
    return [t.for_gather() if isinstance(t, AdaptedTarget) else t for t in targets]


def read_parameters(target: Target) -> tuple[torch.Tensor, ...]:
    """The parameters a snapshot of ``target`` reads: its adapter layer's (base and factors) or
    its own parameter."""
    layer = target.adapter_layer()
    return tuple(layer.parameters()) if layer is not None else (target.parameter,)


def _own_modules(unit: torch.nn.Module, wrapper: type) -> Iterator[torch.nn.Module]:
    """``unit`` and its descendants that no nested ``wrapper`` (FSDP unit) holds."""
    yield unit
    for child in unit.children():
        if not isinstance(child, wrapper):
            yield from _own_modules(child, wrapper)


def _fsdp1_wrapper() -> tuple[type, ...]:
    """``FullyShardedDataParallel``, or nothing where torch is built without distributed."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return (FullyShardedDataParallel,)
