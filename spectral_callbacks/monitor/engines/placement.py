"""Where the CPU work of a snapshot runs: inline at its step, or on the worker thread.

A worker thread is free only where it has a core to itself. Where training's intra-op threads
already fill every core the process may use, their OpenMP threads spin at their barriers and a
worker that takes one core stalls all of them: measured on a 2-core machine (``benchmarks/
overhead.py``, ``worker_contention.py``), each CPU second of the worker cost training 1.5-3 s of
wall time, while the same SVD run inline at its step costs exactly its own time. So on the CPU
the engine computes inline where no core is spare and on the worker where one is; on CUDA the
worker only enqueues kernels on a side stream, and it always runs there.

The cores a process may use are the fewer of its affinity mask (``os.sched_getaffinity``) and its
cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the
smallest along the process's cgroup and its parents), shared among the processes of one launch
on this machine (``LOCAL_WORLD_SIZE``). Training uses ``torch.get_num_threads()`` of them; the
worker needs ``worker_threads`` (torch's count when ``None``).

Example::

    >>> choose_placement(None, devices=["cpu"], cores=2.0, training_threads=2, worker_threads=1)
    Placement(inline=True, reason='2 cores for 2 training threads: none spare for the worker')
    >>> choose_placement(None, devices=["cpu"], cores=4.0, training_threads=2, worker_threads=1).inline
    False
    >>> choose_placement(False, devices=["cpu"], cores=2.0, training_threads=2, worker_threads=1).reason
    'synchronous=False'
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Placement:
    """``inline``: each snapshot computed on the training thread at its step; ``reason``: why."""

    inline: bool
    reason: str

    def describe(self) -> str:
        """One line for the log: where the snapshots run and why."""
        where = "inline at their step" if self.inline else "on a worker thread"
        return f"snapshots computed {where} ({self.reason})"


def choose_placement(
    synchronous: bool | None,
    *,
    devices: Iterable[str],
    cores: float,
    training_threads: int,
    worker_threads: int | None,
) -> Placement:
    """Inline or worker, from ``synchronous`` (``True``/``False`` force it) or else the machine.

    Args:
        synchronous: ``True`` inline, ``False`` the worker, ``None`` chosen here.
        devices: the watched matrices' device types (``"cpu"``, ``"cuda"``, ...).
        cores: cores this process may use (:func:`available_cores`, shared by local processes).
        training_threads: training's intra-op threads (``torch.get_num_threads()``).
        worker_threads: the worker's intra-op threads; ``None``: torch's count, like training.
    """
    if synchronous is not None:
        return Placement(synchronous, f"synchronous={synchronous}")
    accelerators = sorted({device for device in devices if device != "cpu"})
    if accelerators:
        return Placement(False, f"{'/'.join(accelerators)}: the worker only enqueues kernels")
    needed = worker_threads if worker_threads is not None else training_threads
    spare = cores - training_threads
    counted = f"{_count(cores)} cores for {training_threads} training threads"
    if spare >= needed:
        return Placement(False, f"{counted}: {_count(spare)} spare for the worker")
    return Placement(True, f"{counted}: none spare for the worker")


def machine_placement(
    synchronous: bool | None, devices: Iterable[str], worker_threads: int | None
) -> Placement:
    """:func:`choose_placement` with this process's cores and training's threads, read now."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    processes = int(local) if local.isdigit() and int(local) > 0 else 1
    return choose_placement(
        synchronous,
        devices=devices,
        cores=available_cores() / processes,
        training_threads=torch.get_num_threads(),
        worker_threads=worker_threads,
    )


def available_cores(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path | None = None) -> float:
    """The cores this process may run on: its affinity mask, capped by its cgroup CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        cores = float(len(os.sched_getaffinity(0)))
    else:  # macOS, Windows: no affinity mask to read
        cores = float(os.cpu_count() or 1)
    quota = cgroup_quota(cgroup_root, proc_cgroup or Path("/proc/self/cgroup"))
    return min(cores, quota) if quota is not None else cores


def cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The CPU quota in cores along this process's cgroup and its parents; ``None`` if unlimited.

    ``proc_cgroup`` is ``/proc/self/cgroup`` (``0::/path`` on cgroup v2, ``N:cpu,cpuacct:/path``
    on v1); a quota set on a parent limits its children too, so the smallest one counts.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            for folder in _up_from(root, path):
                quotas += _v2_quota(folder / "cpu.max")
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                if mount.is_dir():
                    for folder in _up_from(mount, path):
                        quotas += _v1_quota(folder)
                    break
    return min(quotas) if quotas else None


def _up_from(root: Path, path: str) -> list[Path]:
    """``root/path`` and each parent up to ``root`` (in a container the path may be ``/``)."""
    parts = [part for part in path.strip("/").split("/") if part and part != ".."]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_quota(path: Path) -> list[float]:
    try:  # "max 100000" (unlimited) or "200000 100000": quota and period in microseconds
        quota, period = path.read_text().split()[:2]
        return [] if quota == "max" else [int(quota) / int(period)]
    except (OSError, ValueError):
        return []


def _v1_quota(folder: Path) -> list[float]:
    try:  # cfs_quota_us is -1 when unlimited
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return [quota / period] if quota > 0 and period > 0 else []
    except (OSError, ValueError):
        return []


def _count(cores: float) -> str:
    """``2`` for whole cores, ``1.5`` for a fractional quota."""
    return str(int(cores)) if math.isclose(cores, round(cores)) else f"{cores:.2g}"
