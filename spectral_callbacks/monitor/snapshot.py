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
in the engine).

Example::

    >>> import torch
    >>> from types import SimpleNamespace
    >>> weights = [torch.ones(4, 3), torch.zeros(4, 3), torch.ones(2, 3)]
    >>> targets = [SimpleNamespace(name=f"w{i}", matrix=lambda w=w: w)
    ...            for i, w in enumerate(weights)]
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

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from spectral_callbacks.monitor.streams import record_event


class MatrixSource(Protocol):
    """What a snapshot needs of a target (``spectral_callbacks.targets.Target`` is one).

    A target may also offer ``copy_into(out)`` (one copy into a slot of the stack); without it the
    snapshot copies ``matrix()``. A target that is not copied as a dense matrix (an adapted layer:
    ``targets.adapted.AdaptedTarget``) offers ``batch_key()`` (its group key and device) and
    ``stack_batch(targets)``, which copies what it needs and returns the batch the compute
    function gets in place of a ``(B, m, n)`` stack.
    """

    name: str

    def matrix(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class ShapeGroup:
    """Watched matrices of one shape, dtype and device, snapshotted and decomposed as one batch."""

    key: str
    targets: tuple[Any, ...]
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
    tensors: dict[str, torch.Tensor]
    main_thread_seconds: float = 0.0
    copied: dict[str, Any] = field(default_factory=dict)
    copy_started: dict[str, Any] = field(default_factory=dict)


def group_by_shape(targets: Sequence[MatrixSource]) -> list[ShapeGroup]:
    """Group targets whose matrices share shape, dtype and device, in first-seen order."""
    groups: dict[str, list[MatrixSource]] = {}
    first: dict[str, tuple[tuple[int, int], torch.dtype, str]] = {}  # shape, dtype, device
    for target in targets:
        batch_key = getattr(target, "batch_key", None)
        if batch_key is not None:
            key, device = batch_key()
            kind: Any = target  # a target kind that batches itself: its shape and parameter
            shape, dtype_of = tuple(kind.shape), kind.parameter.dtype
        else:
            weight = target.matrix()
            dtype = str(weight.dtype).removeprefix("torch.")
            key = f"{weight.shape[0]}x{weight.shape[1]}/{dtype}/{weight.device}"
            device = str(weight.device)
            shape, dtype_of = (weight.shape[0], weight.shape[1]), weight.dtype
        groups.setdefault(key, []).append(target)
        first.setdefault(key, (shape, dtype_of, device))
    return [
        ShapeGroup(key, tuple(members), first[key][2], first[key][0], first[key][1])
        for key, members in groups.items()
    ]


def take_snapshot(groups: Sequence[ShapeGroup], step: int) -> Snapshot:
    """Copy every group's current matrices, on the stream that runs training (see the module doc).

    Args:
        groups: from :func:`group_by_shape`.
        step: the optimizer step whose weights these are (``trainer.global_step``).

    Returns:
        The snapshot, with the main-thread seconds the copy cost (on CUDA: the launches only).
    """
    start = time.perf_counter()
    cuda = list(dict.fromkeys(group.device for group in groups if group.device.startswith("cuda")))
    copy_started = {device: record_event(device) for device in cuda}
    with torch.no_grad():
        tensors = {group.key: _stack(group) for group in groups}
    # The compute stream waits on this event before it reads the stacks (engine.py); the training
    # stream itself waits for nothing: the copies are simply the next work in its order.
    copied = {device: record_event(device) for device in cuda}
    return Snapshot(step, tensors, time.perf_counter() - start, copied, copy_started)


def _stack(group: ShapeGroup) -> Any:
    """One fresh ``(B, m, n)`` tensor holding the group's matrices: later updates cannot reach it
    (or the batch a target kind copies for itself: ``stack_batch``)."""
    stack_batch = getattr(group.targets[0], "stack_batch", None)
    if stack_batch is not None:
        return stack_batch(group.targets)
    # Shape, dtype and device from the group, not from a target's matrix(): for an interleaved
    # per-head split that is a whole copy. Allocated on the device's current stream, the training
    # stream: its memory returns to training's pool when the engine frees it (after
    # `record_stream` on the compute stream).
    shape = (len(group.targets), *group.shape)
    stack = torch.empty(shape, dtype=group.dtype, device=torch.device(group.device))
    for slot, target in zip(stack, group.targets, strict=True):
        copy_into = getattr(target, "copy_into", None)
        if copy_into is not None:
            copy_into(slot)
        else:
            slot.copy_(target.matrix())
    return stack
