"""The update of a dense fine-tune: a target that also keeps the reference weight of its update.

``delta="first"`` compares each watched matrix with its own weights when the tracker starts (the
first snapshot); ``delta=<state_dict or path>`` with a base model's weights. A
:class:`DeltaTarget` keeps that reference as one copy of its matrix for the whole run, on the
parameter's device and in its dtype (where the worker forms ``W_t - W_ref``), and snapshots the
current weight like any dense target; the batch it hands the engine
(``functional.delta.DeltaMatrices``) carries both, so the compute logs the ``update_*`` family of
``W_t - W_ref`` beside the usual metrics of ``W_t``. :func:`with_references` refuses, with the
numbers, references that do not fit in the free memory of their device.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from spectral_callbacks.functional.delta import DeltaMatrices
from spectral_callbacks.targets.errors import TargetError
from spectral_callbacks.targets.matching import clean_name
from spectral_callbacks.targets.target import Target, dense_stack

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DeltaTarget", "load_state_dict", "with_references"]

Delta = str | os.PathLike[str] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class DeltaTarget(Target):
    """A dense watched matrix with the reference weight its update ``W_t - W_ref`` is taken from.

    ``reference`` is the matrix's reference (``shape``); for a sharded (DTensor) parameter it is
    the whole stored parameter's reference with the parameter's placements, so each rank keeps the
    reference of its own shard (the sharded engine reads the matrix's rows of it as it reads the
    parameter's, ``monitor/engines/shards.py``). ``None`` where another rank decomposes the matrix
    (gathered weights: each rank keeps the references of its own share) or after the run.
    """

    reference: torch.Tensor | None = field(default=None, repr=False, compare=False)
    has_update: ClassVar[bool] = True

    def release_reference(self) -> None:
        """Drop the reference weight (at the end of the run: it is a copy of the matrix, on its
        device). The target is shared by the tracker's parts (engine groups, reporter, alerts),
        so the one field is cleared in place rather than in a replaced copy some part would miss."""
        object.__setattr__(self, "reference", None)  # frozen dataclass: its one releasable field

    def batch_key(self) -> tuple[str, str]:
        """(group key, device): matrices of one shape, dtype and device batch together."""
        key, device = super().batch_key()
        return f"{key}/delta", device

    @classmethod
    def stack_batch(cls, targets: Sequence[Self]) -> DeltaMatrices:
        """One fresh ``(B, m, n)`` copy of the current weights, with the kept references.

        Raises:
            RuntimeError: a member keeps no reference (another rank decomposes it, or the run
                is over): the engine copies only the matrices whose references this rank keeps.
        """
        references = []
        for target in targets:
            if target.reference is None:
                raise RuntimeError(
                    f"{target.name}: no delta= reference is kept here (another rank decomposes "
                    "this matrix, or the run is over), so its update cannot be formed"
                )
            references.append(target.reference)
        return DeltaMatrices.of(dense_stack(targets), tuple(references))


def load_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` / ``.pt`` / ``.bin`` file or a model directory holding one
    (``model.safetensors`` or ``pytorch_model.bin``)."""
    path = Path(path)
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return load_state_dict(path / name)
        raise TargetError(
            f"`delta`={str(path)!r} is a directory without model.safetensors or pytorch_model.bin; "
            "give the weights file or a state_dict"
        )
    if not path.is_file():
        raise TargetError(
            f"`delta`={str(path)!r}: no such file; give a state_dict, its file or 'first'"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and "state_dict" in state:  # a Lightning checkpoint
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise TargetError(f"`delta`={str(path)!r} holds a {type(state).__name__}, not a state_dict")
    return dict(state)


def _find(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The entry of ``state`` for parameter ``name``: the same name, or one that ends the other
    (a base model's ``h.0.attn.c_attn.weight`` for a wrapper's ``model.transformer.h.0...``)."""
    if name in state:
        return state[name]
    clean = clean_name(name)
    for key, value in state.items():
        other = clean_name(key)
        if clean == other or clean.endswith("." + other) or other.endswith("." + clean):
            return value
    return None


def _free_bytes(device: torch.device) -> int:
    """Free memory of ``device`` now: the CUDA driver's count, or the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _sharded_reference(parameter: DTensor, stored: torch.Tensor | None) -> torch.Tensor:
    """The reference of a sharded parameter, with its placements: a copy of this rank's own shard
    (``stored`` ``None``: the parameter now), or this rank's part of ``stored`` (a base model's
    whole tensor, cut by torch's own placement rules without communication)."""
    if stored is None:
        return parameter.detach().clone()  # a DTensor: each rank clones its local shard
    return distribute_tensor(
        stored.detach().to(parameter.to_local().device, parameter.dtype),
        parameter.device_mesh,
        parameter.placements,
        src_data_rank=None,  # every rank holds the whole stored tensor: no scatter
    )


def with_references(
    targets: Sequence[Target], delta: Delta, caller: str, kept: Collection[str] | None = None
) -> list[Target]:
    """``targets`` with each dense one a :class:`DeltaTarget` keeping its reference weight.

    Targets that carry an update of their own (adapted layers) are kept as they are.

    Args:
        targets: the watched matrices.
        delta: ``"first"`` (each matrix's weights now), a state_dict or the path of one.
        caller: the name messages use.
        kept: the names of the targets whose references this process keeps (those it
            decomposes); the others become ``DeltaTarget``s without one. ``None``: every one.

    Raises:
        TargetError: ``delta`` is not ``"first"``, a state_dict or a path to one; a target has no
            entry in it, or one of another shape; or the references do not fit in the free memory
            of their device (the message gives both numbers).
    """
    if isinstance(delta, str) and delta == "first":
        state: Mapping[str, torch.Tensor] | None = None
    elif isinstance(delta, Mapping):
        state = delta
    elif isinstance(delta, str | os.PathLike):
        state = load_state_dict(delta)
    else:
        raise TargetError(
            f"{caller}: `delta` must be None, 'first', a state_dict or the path of one, got "
            f"{type(delta).__name__}"
        )
    dense = [t for t in targets if not t.has_update and (kept is None or t.name in kept)]
    needed: dict[torch.device, int] = {}
    for t in dense:
        size = t.shape[0] * t.shape[1] * t.parameter.element_size()
        if isinstance(t.parameter, DTensor):  # each rank keeps its own shard's reference
            size = t.parameter.to_local().numel() * t.parameter.element_size()
        needed[t.parameter.device] = needed.get(t.parameter.device, 0) + size
    for device, size in needed.items():
        free = _free_bytes(device)
        if size > free:
            raise TargetError(
                f"{caller}: `delta` keeps a reference copy of every watched matrix this process "
                f"decomposes: {size / 2**20:.0f} MiB on {device}, but only "
                f"{free / 2**20:.0f} MiB is free there; watch fewer "
                "matrices (roles=, include=) or leave `delta` unset"
            )
    missing, wrong, out = [], [], []
    sharded: dict[int, torch.Tensor] = {}  # a sharded parameter's reference, once for its targets
    for t in targets:
        if t.has_update:
            out.append(t)
            continue
        stored = None if state is None else _find(state, t.parameter_name)
        if state is not None and stored is None:
            missing.append(t.parameter_name)
            continue
        if stored is not None and tuple(stored.shape) != tuple(t.parameter.shape):
            wrong.append(f"{t.parameter_name} {tuple(stored.shape)} != {tuple(t.parameter.shape)}")
            continue
        if kept is not None and t.name not in kept:
            reference = None  # another rank decomposes it
        elif isinstance(t.parameter, DTensor):
            if id(t.parameter) not in sharded:
                sharded[id(t.parameter)] = _sharded_reference(t.parameter, stored)
            reference = sharded[id(t.parameter)]
        elif stored is None:
            reference = t.matrix().detach().clone()
        else:
            reference = (
                t.rows.take(stored.detach()).to(t.parameter.device, t.parameter.dtype).clone()
            )
        out.append(DeltaTarget(**t.fields(), reference=reference))
    if missing or wrong:
        listed = ", ".join((missing + wrong)[:5])
        raise TargetError(
            f"{caller}: `delta` has no matching weight for {len(missing)} and a different shape "
            f"for {len(wrong)} of the watched matrices (e.g. {listed}); give the state_dict of the "
            "model being fine-tuned's base"
        )
    return out
