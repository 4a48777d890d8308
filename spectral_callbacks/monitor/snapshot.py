"""Consistent copies of the watched matrices, grouped by shape so the SVD can run batched.

A snapshot is exactly the weights after optimizer step ``s``: the copy is taken in a hook that runs
after that step's update and before the next one (see ``tracker.py``), and

* on the CPU it is made on the calling (main) thread, so the next update, which runs on the same
  thread, cannot start before the copy is complete;
* on CUDA it is enqueued on a side stream that first waits for an event recorded on the training
  stream (so the copy sees the update of step ``s``), and the training stream then waits for an
  event recorded after the copy (so the update of step ``s + 1`` cannot overwrite a weight that is
  still being read). Only the copy is ordered against training - the SVD that follows on the side
  stream is not.

Same-shaped matrices are stacked into one ``(B, m, n)`` tensor in the parameter's dtype (the
conversion to float32 happens off the main thread, in the engine).

Example::

    >>> import torch
    >>> from types import SimpleNamespace
    >>> weights = [torch.ones(4, 3), torch.zeros(4, 3), torch.ones(2, 3)]
    >>> targets = [SimpleNamespace(name=f"w{i}", shape=tuple(w.shape), matrix=lambda w=w: w)
    ...            for i, w in enumerate(weights)]
    >>> groups = group_by_shape(targets)
    >>> [(group.key, group.names) for group in groups]
    [('4x3/float32/cpu', ('w0', 'w1')), ('2x3/float32/cpu', ('w2',))]
    >>> snapshot = take_snapshot(groups, step=7)
    >>> snapshot.step, tuple(snapshot.tensors["4x3/float32/cpu"].shape)
    (7, (2, 4, 3))
    >>> weights[0].add_(1.0)[0, 0].item(), snapshot.tensors["4x3/float32/cpu"][0, 0, 0].item()
    (2.0, 1.0)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class MatrixSource(Protocol):
    """What a snapshot needs of a target (``spectral_callbacks.targets.Target`` is one)."""

    name: str

    def matrix(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class ShapeGroup:
    """Watched matrices of one shape, dtype and device, snapshotted and decomposed as one batch."""

    key: str
    targets: tuple[Any, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(target.name for target in self.targets)


@dataclass
class Snapshot:
    """Copies of every group's matrices after one optimizer step.

    ``main_thread_seconds`` is what taking it cost the calling thread; ``stream`` is the CUDA side
    stream the copies were made on (``None`` on the CPU, where they are complete on return).
    """

    step: int
    tensors: dict[str, torch.Tensor]
    main_thread_seconds: float = 0.0
    stream: Any = None


def group_by_shape(targets: Sequence[MatrixSource]) -> list[ShapeGroup]:
    """Group targets whose matrices share shape, dtype and device, in first-seen order."""
    groups: dict[str, list[MatrixSource]] = {}
    for target in targets:
        weight = target.matrix()
        dtype = str(weight.dtype).removeprefix("torch.")
        key = f"{weight.shape[0]}x{weight.shape[1]}/{dtype}/{weight.device}"
        groups.setdefault(key, []).append(target)
    return [ShapeGroup(key, tuple(members)) for key, members in groups.items()]


def take_snapshot(
    groups: Sequence[ShapeGroup], step: int, stream: torch.cuda.Stream | None = None
) -> Snapshot:
    """Copy every group's current matrices; on CUDA pass the side ``stream`` to copy on.

    Args:
        groups: from :func:`group_by_shape`.
        step: the optimizer step whose weights these are (``trainer.global_step``).
        stream: for CUDA weights, the side stream the copy runs on. Default ``None`` copies on the
            current stream (the CPU path, and a correct if less overlapped CUDA path).

    Returns:
        The snapshot, with the main-thread seconds the copy cost.
    """
    start = time.perf_counter()
    if stream is None:
        with torch.no_grad():
            tensors = {group.key: _stack(group) for group in groups}
        return Snapshot(step, tensors, time.perf_counter() - start)

    training_stream = torch.cuda.current_stream(stream.device)
    # 1. The side stream waits for everything queued so far on the training stream - the update of
    #    step `step` included - so the copy reads the weights after that step.
    stream.wait_stream(training_stream)
    with torch.no_grad(), torch.cuda.stream(stream):
        tensors = {}
        for group in groups:
            views = [target.matrix() for target in group.targets]
            for view in views:
                # The views may be temporaries the training stream allocated (a fused projection
                # split with a copy); tell the caching allocator they are in use on the side stream
                # so their memory is not handed out again before the copy has read it.
                view.record_stream(stream)
            # Allocated inside the side-stream context, the stack belongs to the side stream's
            # pool: the engine's kernels on that stream are ordered after the copy for free.
            tensors[group.key] = torch.stack(views)
        ready = torch.cuda.Event()
        ready.record(stream)
    # 2. The next update on the training stream waits for the copy - not for the SVD, which is
    #    queued on the side stream later and overlaps training.
    training_stream.wait_event(ready)
    return Snapshot(step, tensors, time.perf_counter() - start, stream=stream)


def _stack(group: ShapeGroup) -> torch.Tensor:
    # torch.stack allocates a fresh tensor: later in-place updates of the parameters cannot reach it.
    return torch.stack([target.matrix() for target in group.targets])
