"""make_engine hands MonitorOptions to the engine it picks, which reads its settings from them."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from tiny_models import TinyGPT, exact_compute

from spectral_callbacks.monitor.engines.distributed import DistributedEngine
from spectral_callbacks.monitor.engines.engine import SnapshotEngine
from spectral_callbacks.monitor.engines.protocol import make_engine
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.targets import find_targets

# Every value differs from both MonitorOptions' default and the engines' former keyword defaults.
OPTIONS = MonitorOptions(
    max_pending=3,
    worker_threads=2,
    worker_nice=5,
    every_n_steps=1000,
    max_snapshot_bytes=10**9,
    synchronous=True,
)


def test_one_process_engine_reads_the_options() -> None:
    targets = find_targets(TinyGPT())
    engine = make_engine(exact_compute, targets, ("stable_rank",), OPTIONS, skipped=4)
    assert type(engine) is SnapshotEngine
    assert (engine.max_pending, engine.worker_threads, engine.worker_nice) == (3, 2, 5)
    assert engine.synchronous is True  # options.synchronous, where placement said nothing
    assert engine.max_delay_steps == 1000  # every_n_steps bounds a staggered snapshot's delay
    assert engine.plan.budget == 10**9  # max_snapshot_bytes, resolved by make_engine
    assert engine.skipped == 4
    engine.close()
    placed = make_engine(exact_compute, targets, ("stable_rank",), OPTIONS, inline=False)
    assert isinstance(placed, SnapshotEngine) and placed.synchronous is False  # placement wins
    placed.close()


def test_ddp_engine_reads_the_options(tmp_path: Path) -> None:
    targets = find_targets(TinyGPT())
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        engine = DistributedEngine(
            exact_compute, targets, ("stable_rank",), OPTIONS, rank=0, world_size=1,
            group=dist.group.WORLD, budget=10**9,
        )  # fmt: skip
        assert (engine.max_pending, engine.lag) == (3, 2)
        local = engine._local
        assert (local.max_pending, local.worker_threads, local.worker_nice) == (3, 2, 5)
        assert local.synchronous is True and local.plan.budget == 10**9
        engine.close()
    finally:
        dist.destroy_process_group()
