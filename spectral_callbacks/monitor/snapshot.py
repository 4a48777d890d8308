"""Consistent copies of the watched matrices, grouped by shape so the SVD can run batched.

A snapshot is exactly the weights after optimizer step ``s``: the copy is taken in a hook that runs
after that step's update and before the next one (see ``tracker.py``), and it is
made *on the stream that runs training*:

* on the CPU, on the calling (main) thread, so the next update, which runs on the same thread,
  cannot start before the copy is complete;
* on CUDA, enqueued on each device's current (training) stream, behind the update of step ``s``
  and ahead of the update of step ``s + 1``: stream order is the whole synchronisation, and
  training never waits for anything but its own copy (not for the SVDs of earlier snapshots
  queued on the engine's compute streams). An event recorded after the copies (``copied``, one per
  device) is what the engine's compute stream waits on before it reads the stacks.

Each group is one ``(B, m, n)`` tensor allocated with one ``torch.empty`` and filled with one copy
per matrix (``Target.copy_into``: a per-head interleaved split is gathered straight into its slot,
not copied twice), in the parameter's dtype (the conversion to float32 happens off the main thread,
in the engine), or the batch a kind of target copies for itself (``Target.stack_batch``: an adapted
layer's factors). Which targets form a group is theirs to say (``Target.batch_key``): nothing here
knows what kind of target it holds.

Example::

    >>> import torch
    >>> from spectral_callbacks.targets import Target
    >>> weights = [torch.ones(4, 3), torch.zeros(4, 3), torch.ones(2, 3)]
    >>> targets = [Target.from_parameter(f"w{i}", w, role="Q") for i, w in enumerate(weights)]
    >>> groups = group_by_shape(targets)
    >>> [(group.key, group.names) for group in groups]
    [('4x3/float32/cpu', ('w0', 'w1')), ('2x3/float32/cpu', ('w2',))]
    >>> snapshot = take_snapshot(groups, step=7)
    >>> snapshot.step, tuple(snapshot.tensors["4x3/float32/cpu"].shape), snapshot.copied
    (7, (2, 4, 3), {})
    >>> weights[0].add_(1.0)[0, 0].item(), snapshot.tensors["4x3/float32/cpu"][0, 0, 0].item()
    (2.0, 1.0)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from spectral_callbacks.functional.batch import Stack
from spectral_callbacks.monitor.engines.streams import record_event
from spectral_callbacks.targets.target import Target


@dataclass(frozen=True)
class ShapeGroup:
    """Watched matrices of one shape, dtype and device, snapshotted and decomposed as one batch."""

    key: str
    targets: tuple[Target, ...]
    device: str = "cpu"
    shape: tuple[int, int] = (0, 0)  # (m, n) of each matrix
    dtype: torch.dtype = torch.float32  # the stored (copied) dtype

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(target.name for target in self.targets)


@dataclass
class Snapshot:
    """Copies of every group's matrices after one optimizer step.

    ``copied`` is empty on the CPU (the copies are complete when :func:`take_snapshot` returns)
    and, on CUDA, maps each device (``"cuda:0"``) to a timing event recorded on its training stream
    after that device's copies; ``copy_started`` holds the events recorded before them, so the
    copy's time on the training stream can be measured once it is done.
    """

    step: int
    tensors: dict[str, Stack]
    main_thread_seconds: float = 0.0
    copied: dict[str, Any] = field(default_factory=dict)
    copy_started: dict[str, Any] = field(default_factory=dict)


def group_by_shape(targets: Sequence[Target]) -> list[ShapeGroup]:
    """Group targets that share a ``Target.batch_key`` (shape, dtype and device, and their kind's
    own batch), in first-seen order."""
    groups: dict[str, list[Target]] = {}
    devices: dict[str, str] = {}
    for target in targets:
        key, device = target.batch_key()
        groups.setdefault(key, []).append(target)
        devices.setdefault(key, device)
    return [
        ShapeGroup(key, tuple(members), devices[key], members[0].shape, members[0].parameter.dtype)
        for key, members in groups.items()
    ]


def take_snapshot(
    groups: Sequence[ShapeGroup],
    step: int,
    gathers: Sequence[tuple[Callable[[], AbstractContextManager[object]], Sequence[ShapeGroup]]]
    | None = None,
) -> Snapshot:
    """Copy every group's current matrices, on the stream that runs training (see the module doc).

    Args:
        groups: from :func:`group_by_shape`.
        step: the optimizer step whose weights these are (``trainer.global_step``).
        gathers: where the parameters are whole only inside a gather (FSDP1, ZeRO-3:
            ``engines/partitioned.py``), ``(open, groups)`` pairs: each pair's groups are copied
            inside ``open()``, in order; every pair is opened, even with no group to copy (the
            gathers are collectives). ``None``: ``groups`` copied as they are.

    Returns:
        The snapshot, with the main-thread seconds the copy cost (on CUDA: the launches only).
    """
    start = time.perf_counter()
    rounds = [(contextlib.nullcontext, groups)] if gathers is None else gathers
    every = [group for _, members in rounds for group in members]
    cuda = list(dict.fromkeys(group.device for group in every if group.device.startswith("cuda")))
    copy_started = {device: record_event(device) for device in cuda}
    tensors: dict[str, Stack] = {}
    with torch.no_grad():
        for gather, members in rounds:
            with gather():
                tensors.update(_stacks(members))
    # The compute stream waits on this event before it reads the stacks (engine.py); the training
    # stream itself waits for nothing: the copies are simply the next work in its order.
    copied = {device: record_event(device) for device in cuda}
    return Snapshot(step, tensors, time.perf_counter() - start, copied, copy_started)


def _stacks(groups: Sequence[ShapeGroup]) -> dict[str, Stack]:
    """Each group's snapshot, as its kind of target copies it: a fresh ``(B, m, n)`` tensor of a
    dense group (later updates cannot reach it), or the batch a kind copies for itself.

    A kind that reads other targets' copies (``Target.reads_copies``: attention heads read Q/K/V/O)
    is stacked after the dense groups, given their stacks, and put first in the result: the engine
    computes in this order, so it reads them before anything computes (or changes) them.
    """
    readers = [group for group in groups if group.targets[0].reads_copies]
    stacks: dict[str, Stack] = {}
    copies: dict[int, tuple[torch.Tensor, int]] = {}  # id(target) -> (dense stack, slot)
    for group in groups:
        if group.targets[0].reads_copies:
            continue
        stack = stacks[group.key] = _stack(group)
        if _dense(group.targets[0]) and isinstance(stack, torch.Tensor):
            copies.update({id(target): (stack, i) for i, target in enumerate(group.targets)})
    read = {
        group.key: group.targets[0].stack_batch_reading(group.targets, copies) for group in readers
    }
    return read | stacks


def _stack(group: ShapeGroup) -> Stack:
    """A group's snapshot as its kind of target copies it (``Target.stack_batch``)."""
    return group.targets[0].stack_batch(group.targets)


def _dense(target: Target) -> bool:
    """Whether the target's kind snapshots with ``Target``'s own stack (slot i: target i's
    values), not a batch of its own (adapters, quantized or delta weights)."""
    owner = next(kind for kind in type(target).__mro__ if "stack_batch" in vars(kind))
    return owner is Target
