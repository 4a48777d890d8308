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
