"""The bytes of tensors a process holds, as tests/targets/test_recording_memory.py and
benchmarks/recording_memory.py count them: every tensor object the interpreter tracks,
deduplicated by storage, with the cyclic collector off while they are counted (so what only a
reference cycle keeps alive still counts)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def bytes_alive() -> int:
    """The bytes of every tensor storage the interpreter can see, counted once per storage."""
    storages: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:
            continue
        try:
            storage = obj.untyped_storage()
            where = storage.data_ptr()
        except RuntimeError:  # a fake tensor (torch.compile's tracing, other tests): no memory
            continue
        storages[(str(storage.device), where)] = storage.nbytes()
    return sum(storages.values())


@contextmanager
def collector_off() -> Iterator[None]:
    """Collect once, then keep the cyclic collector off until the block ends."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class AllocationPeak:
    """The largest rise of allocated bytes above the level at entry, while the block runs.

    On the CPU, from the allocator's own events (``torch.profiler`` with ``profile_memory=True``:
    every allocation and free of torch's CPU allocator on this thread, in order); on a CUDA device,
    from the caching allocator's statistics (``max_memory_allocated``, every thread and stream).
    Independent of what the library accounts: it sees storages resized in place (FSDP1's gathered
    flat parameters) and temporaries as well as the copies. On the CPU it sees this thread only, so
    the work measured must run on it (``synchronous=True``)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.peak = 0

    def __enter__(self) -> AllocationPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        self._profile.__exit__(*exc)
        events = [
            event
            for event in self._profile.profiler.kineto_results.events()
            if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
        ]
        level = 0
        for event in sorted(events, key=lambda event: event.start_ns()):
            level += event.nbytes()  # negative for a free
            self.peak = max(self.peak, level)
