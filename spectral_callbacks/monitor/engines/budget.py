"""The snapshot budget: the bytes the engine's copies and working set may hold, and the parts a
snapshot is split into to stay within them.

The engine keeps its own ledger (:class:`Ledger`) and never asks the device or the allocator what
is in use: a copy is counted from what its ``Target`` says it copies (``snapshot_bytes()``: an
adapted layer copies its adapters only), the working set from the compute function's bound
(``SpectrumCompute.working_bytes``: ``functional/memory.py``), the warm-start subspaces it keeps
from ``SpectrumCompute.kept_bytes``. At any moment::

    held = Σ copies handed over and not yet decomposed
         + the largest working set among them      (the worker decomposes one part at a time)
         + the kept subspaces                       (always)

and a part is copied only when ``held`` with it stays within ``max_snapshot_bytes``.

Where the whole snapshot does not fit at once, the shape groups are split into parts
(:func:`plan_parts`), each as large as fits alone, and a snapshot due at step ``s`` copies the
parts that fit at ``s``, the next ones at ``s + 1``, ``s + 2``, ... as earlier parts are
decomposed and free their bytes: each matrix is logged at the step its copy was made.

Example::

    >>> import torch
    >>> from spectral_callbacks.monitor.snapshot import group_by_shape
    >>> from spectral_callbacks.targets import Target
    >>> weights = [torch.zeros(64, 64) for _ in range(4)]
    >>> targets = [Target.from_parameter(f"w{i}", w, role="Q") for i, w in enumerate(weights)]
    >>> parts = plan_parts(group_by_shape(targets), 40_000, working_bytes=lambda g, b: 0)
    >>> [part.names for part in parts]  # 16 KiB per matrix: two fit in 40,000 bytes
    [('w0', 'w1'), ('w2', 'w3')]
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spectral_callbacks.monitor.engines.compute import Compute, as_compute_function
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.monitor.snapshot import ShapeGroup
from spectral_callbacks.targets.target import Target

#: The default budget: this fraction of the total memory of the device the watched matrices live
#: on (a GPU's, or the host's physical memory on the CPU). A run tuned to the memory limit leaves
#: a few percent of a GPU free (the caching allocator's own slack is of that order), so a copy
#: within 5 % fits beside it; on an 80 GB GPU that is 4 GB, two snapshots in flight of the watched
#: matrices of a 1 B model in bf16: models of that size are still snapshotted at once, larger ones
#: over consecutive steps.
DEFAULT_FRACTION = 0.05

#: ``working_bytes(group, batch) -> bytes`` of decomposing ``batch`` matrices of ``group``.
WorkingBytes = Callable[[ShapeGroup, int], int]


def device_memory(device: str) -> int:
    """Total memory of ``device`` (``"cuda:0"``: the GPU's; ``"cpu"``: the host's physical memory)."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget(devices: Sequence[str]) -> int:
    """:data:`DEFAULT_FRACTION` of the smallest total memory among ``devices`` (``["cpu"]`` if none)."""
    return int(DEFAULT_FRACTION * min(device_memory(device) for device in (devices or ["cpu"])))


def conversion_bytes(group: ShapeGroup, batch: int) -> int:
    """The float32 copy the engine makes of a ``batch`` of a group stored in another dtype."""
    if group.dtype in (torch.float32, torch.float64):
        return 0
    m, n = group.shape
    return 4 * batch * m * n


def mib(size: float) -> str:
    """``size`` bytes for messages, in MiB (KiB below one MiB): ``'256.0 MiB'``, ``'12.5 KiB'``."""
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"


def plan_parts(
    groups: Sequence[ShapeGroup],
    budget: int | None,
    working_bytes: WorkingBytes,
    kept: int = 0,
    caller: str = "SpectralMonitor",
) -> list[ShapeGroup]:
    """The groups, each split into as few equal parts as fit the budget alone (with ``kept``).

    A group that fits whole stays whole (same key), so an unlimited budget (``None``) or a roomy
    one changes nothing. A part of a group is a ``ShapeGroup`` with the key
    ``"<group key>[start:stop]"`` (its warm-start subspace is its own).

    Raises:
        ConfigurationError: one matrix does not fit the budget alone, with the numbers.
    """
    if budget is None:
        return list(groups)

    def need(group: ShapeGroup, batch: int) -> int:
        each = max(target.snapshot_bytes() for target in group.targets)
        return batch * each + conversion_bytes(group, batch) + working_bytes(group, batch) + kept

    largest = max(groups, key=lambda group: need(group, 1), default=None)
    if largest is not None and need(largest, 1) > budget:
        name = max(largest.targets, key=lambda target: target.snapshot_bytes()).name
        m, n = largest.shape
        each = max(target.snapshot_bytes() for target in largest.targets)
        one = need(largest, 1)
        raise ConfigurationError(
            f"{caller}: `max_snapshot_bytes` ({budget} bytes = {mib(budget)}) cannot hold one "
            f"matrix: {name!r} ({m} x {n}, {str(largest.dtype).removeprefix('torch.')}) needs "
            f"{one} bytes ({mib(one)}: a copy of {mib(each)}, {mib(one - each - kept)} to "
            f"decompose it, {mib(kept)} of warm-start subspaces kept); raise "
            f"`max_snapshot_bytes` to at least {one}, or leave the matrix out (`exclude=`, `roles=`)"
        )
    parts: list[ShapeGroup] = []
    for group in groups:
        size = len(group.targets)
        fits = max(batch for batch in range(1, size + 1) if need(group, batch) <= budget)
        count = math.ceil(size / fits)
        if count == 1:
            parts.append(group)
            continue
        bounds = [round(i * size / count) for i in range(count + 1)]
        for start, stop in zip(bounds, bounds[1:], strict=False):
            parts.append(
                dataclasses.replace(
                    group, key=f"{group.key}[{start}:{stop}]", targets=group.targets[start:stop]
                )
            )
    return parts


class Ledger:
    """The engine's account of the bytes its snapshots hold (see the module docstring).

    ``reserve`` when parts are copied, ``release`` once they are decomposed (idempotent);
    ``peak`` is the most ever held. Thread-safe: the CPU worker releases as it finishes a part.

    >>> ledger = Ledger(budget=100, kept=10)
    >>> ledger.fits(copies=50, working=40), ledger.fits(copies=50, working=41)
    (True, False)
    >>> ledger.reserve("a", copies=50, working=40); ledger.held, ledger.fits(copies=1, working=0)
    (100, False)
    >>> ledger.release("a"); ledger.held, ledger.peak
    (10, 100)
    """

    def __init__(self, budget: int | None, kept: int = 0) -> None:
        self.budget = budget
        self.kept = kept
        self.peak = kept
        self._held: dict[Any, tuple[int, int]] = {}  # key -> (copies, working)
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return self._total(self._held.values())

    def fits(self, copies: int, working: int) -> bool:
        """Whether ``copies`` more bytes of copies, decomposed with ``working``, fit now."""
        if self.budget is None:
            return True
        with self._lock:
            return self._total([*self._held.values(), (copies, working)]) <= self.budget

    def reserve(self, key: Any, copies: int, working: int) -> None:
        with self._lock:
            self._held[key] = (copies, working)
            self.peak = max(self.peak, self._total(self._held.values()))

    def release(self, key: Any) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _total(self, entries: Any) -> int:
        entries = list(entries)
        copies = sum(copy for copy, _ in entries)
        working = max((work for _, work in entries), default=0)
        return copies + working + self.kept


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parts a snapshot is taken in, what each costs, and the budget they keep to."""

    parts: tuple[ShapeGroup, ...]
    budget: int | None
    kept: int
    working: dict[str, int]  # part key -> bytes to decompose it (its float32 copy included)
    copies: dict[str, int]  # part key -> bytes of its copy

    @property
    def staggered(self) -> bool:
        """Whether one snapshot needs more than the budget, so it is spread over several steps."""
        if self.budget is None:
            return False
        whole = sum(self.copies.values()) + max(self.working.values(), default=0) + self.kept
        return whole > self.budget


def plan_snapshot(
    groups: Sequence[ShapeGroup],
    compute: Compute,
    budget: int | None,
    caller: str = "SpectralMonitor",
) -> Plan:
    """The :class:`Plan` for ``groups`` decomposed by ``compute`` within ``budget`` bytes.

    ``compute`` is asked for its working set and kept bytes (``working_bytes(group, batch)``,
    ``kept_bytes(group)``: a plain compute function has :class:`~spectral_callbacks.monitor.
    engines.compute.ComputeFunction`'s defaults, the default SVD's bound and nothing kept).

    Raises:
        ConfigurationError: one matrix does not fit the budget alone (see :func:`plan_parts`).
    """
    function = as_compute_function(compute)

    def working(group: ShapeGroup, batch: int) -> int:
        return int(function.working_bytes(group, batch))

    kept = sum(int(function.kept_bytes(group)) for group in groups)
    parts = plan_parts(groups, budget, working, kept, caller)
    return Plan(
        tuple(parts),
        budget,
        kept,
        {p.key: conversion_bytes(p, len(p.targets)) + working(p, len(p.targets)) for p in parts},
        {p.key: sum(target.snapshot_bytes() for target in p.targets) for p in parts},
    )


def resolve_budget(value: int | str | None, targets: Sequence[Target]) -> int | None:
    """``max_snapshot_bytes`` as bytes: ``"auto"`` becomes :func:`default_budget` of the devices
    the watched parameters live on."""
    if value != "auto":
        return None if value is None else int(value)
    devices = sorted({str(target.parameter.device) for target in targets})
    return default_budget(devices)
