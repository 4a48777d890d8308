"""Where an engine's work runs on a CUDA device: a compute stream of its own, after the copy.

Both engines (``engine.SnapshotEngine``, ``sharded.ShardedEngine``) copy a snapshot on the
training stream, record an event after the copy (:func:`record_event`), and hand the stacks to
their worker thread, which runs every kernel of the SVD inside :meth:`ComputeStreams.after_copy`:

* on the device's compute stream, one per device, created once and kept for the engine's life:
  training's stream never waits for the SVD, and the SVD (and gloo's host staging of the sharded
  engine's CUDA all-reduces, which follows the stream that issues them) never waits for training
  beyond the copy;
* after a wait on the snapshot's ``copied`` event: the compute stream, not training, waits for
  the copy;
* with ``record_stream`` on the stack, allocated on the training stream: freeing it on the worker
  cannot hand its memory back to training before the compute stream is done reading it;
* with the worker's current device set to the stack's (a worker thread starts on device 0);
* with autocast off: a user's autocast region (a plain loop or Fabric with ``synchronous=True``,
  where the compute runs on the calling thread) would otherwise run the SVD's products in bf16.

The stream's priority is explicit: the lowest, 0 (torch's default too; lower numbers are higher
priorities), so the SVD yields to training's kernels where both are ready. torch hands out streams
round-robin from a pool of 32 per device and priority, which NCCL and gloo draw their streams from
too: a stream drawn once at an engine's first snapshot and kept shares its queue with one of
theirs only if a multiple of 32 other low-priority streams were drawn in between, and then the two
serialize (they cannot deadlock: the SVD waits only on events recorded before it). torch has no
call that creates a stream outside the pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from spectral_callbacks.functional.batch import Stack

__all__ = ["ComputeStreams", "record_event"]

# torch's stream priorities run from 0 (the lowest, the default) to negative (higher).
_LOWEST_PRIORITY = 0


def record_event(device: str) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current (training) stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(torch.device(device)))
    return event


class ComputeStreams:
    """One compute stream per CUDA device, created at first use and kept."""

    def __init__(self) -> None:
        self._streams: dict[str, torch.cuda.Stream] = {}

    def get(self, device: str) -> torch.cuda.Stream:
        """``device``'s compute stream (``"cuda:0"``)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(torch.device(device), priority=_LOWEST_PRIORITY)
            self._streams[device] = stream
        return stream

    @contextlib.contextmanager
    def after_copy(
        self, batch: Stack, copied: Mapping[str, Any]
    ) -> Iterator[torch.cuda.Stream | None]:
        """Run the block's work on ``batch``'s compute stream, after its copy (see the module doc).

        Off CUDA only autocast is turned off (the copy was complete when the snapshot returned);
        yields the stream, or ``None`` off CUDA.
        """
        device_type = batch.device.type
        with torch.autocast(device_type, enabled=False):
            if device_type != "cuda":
                yield None
                return
            device = str(batch.device)
            stream = self.get(device)
            with torch.cuda.device(batch.device), torch.cuda.stream(stream):
                # The compute stream, not training, waits for the copy on the training stream.
                stream.wait_event(copied[device])
                # The stack was allocated on the training stream: tell the caching allocator it is
                # in use here too, so freeing it on the worker cannot hand its memory to training
                # before these kernels have read it.
                batch.record_stream(stream)
                yield stream
