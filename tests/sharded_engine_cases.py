"""What each rank runs for tests/monitor/engines/test_sharded_engine.py: a raw training loop on a sharded model
with a ShardedEngine, recording the full weights (``full_tensor()``, test-only) at each snapshot."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from sharded_models import build, full_matrix, shard
from spawn_ranks import LargestTensor
from torch.distributed.tensor import init_device_mesh

from spectral_callbacks.functional import sharded_svd
from spectral_callbacks.monitor.engines import sharded as sharded_engine_module
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.engines.sharded import ShardedEngine, ShardedEngineError, svd_group
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.schedule import SnapshotSchedule
from spectral_callbacks.targets import Target, find_targets

K = 8
STEPS = 10
SCHEDULE = SnapshotSchedule(every_n_steps=4, log_spaced_until=3)  # 0, 1, 2, 4, 8 and the last
SCHEDULED = [s for s in range(STEPS) if SCHEDULE.on_grid(s)] + [STEPS]


def batch(rank: int, step: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    # FSDP is data parallel: each rank its own batch; tensor parallel ranks share one.
    seed = 1000 * step + (rank if how == "fsdp" else 0)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def sharded_engine(
    targets: Sequence[Target],
    *,
    group: Any,
    k: int = 32,
    max_pending: int = 4,
    behind_timeout: float | None = None,
    synchronous: bool = False,
) -> ShardedEngine:
    """A ShardedEngine as these cases build it: a ``SpectrumCompute(k)`` and ``MonitorOptions`` of
    the rest, ``max_pending`` 4 unless given (the copies are local shards, a fraction of the
    weights) and ``behind_timeout`` from ``drain_timeout`` (60 s) unless given."""
    options = MonitorOptions(max_pending=max_pending, synchronous=synchronous)
    return ShardedEngine(
        targets, SpectrumCompute(k), options, group=group, behind_timeout=behind_timeout
    )


def drain(engine: ShardedEngine, last_step: int, timeout: float) -> list[Any]:
    """End of training through the engine protocol: wait for the worker, then every result."""
    engine.finish(last_step, offered=True, deadline=time.monotonic() + timeout)
    return engine.collect()


def sharded_model(rank: int, world_size: int, how: str, name: str) -> tuple[Any, Any, list]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model, loss = build(name)
    shard(model, how, init_device_mesh("cpu", (world_size,)))
    return model, loss, find_targets(model)


def train(rank: int, world_size: int, how: str, name: str) -> dict[str, Any]:
    model, loss_of, targets = sharded_model(rank, world_size, how, name)
    engine = sharded_engine(targets, group=svd_group(timeout_seconds=60), k=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    results = []
    for step in range(STEPS + 1):
        if step in SCHEDULED:
            engine.offer(step)
            weights[step] = {target.name: full_matrix(target) for target in targets}
        results += engine.collect()
        if step == STEPS:
            break
        loss_of(model, *batch(rank, step, how)).backward()
        optimizer.step()
        optimizer.zero_grad()
    results += drain(engine, STEPS, timeout=120)
    engine.close()
    return {
        "targets": [(t.name, t.role, t.shape) for t in targets],
        "splits": {p.target.name: p.split for g in engine.groups.values() for p in g.pieces},
        "rows": {p.target.name: p.rows for g in engine.groups.values() for p in g.pieces},
        "results": [(r.step, r.metrics, r.sent_bytes) for r in results],
        "weights": weights if rank == 0 else None,
    }


def train_all(rank: int, world_size: int) -> dict[str, Any]:
    cases = [
        ("fsdp", "gpt2"),
        ("fsdp", "nanogpt"),
        ("fsdp", "llama"),
        ("tp", "neox"),
        ("tp", "llama"),
    ]
    return {f"{how}-{name}": train(rank, world_size, how, name) for how, name in cases}


def largest_tensors(rank: int, world_size: int) -> dict[str, Any]:
    """Per global shape, the largest matrix the engine creates while snapshotting and decomposing.

    Separate q/k/v under FSDP2: every matrix is split between the ranks (a fused shard may hold
    one role's matrix whole, and then its copy is that whole matrix by the sharding's choice).
    """
    _, _, targets = sharded_model(rank, world_size, "fsdp", "llama")
    group = svd_group(timeout_seconds=60)
    found = {}
    for shape in sorted({target.shape for target in targets}):
        subset = [target for target in targets if target.shape == shape]
        engine = sharded_engine(subset, group=group, k=K, synchronous=True)
        with LargestTensor() as largest:
            engine.offer(0)
        (result,) = engine.collect()
        found[shape] = {"matrix_numel": largest.matrix_numel, "metrics": result.metrics}
    return found


def failing_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's SVD raises at the third snapshot: both ranks must end with an error, soon."""
    _, _, targets = sharded_model(rank, world_size, "fsdp", "llama")
    original = sharded_svd.sharded_randomized_svd
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 5:
            raise RuntimeError("planned failure on rank 1")
        return original(*args, **kwargs)

    from spectral_callbacks.monitor.engines import sharded

    sharded.sharded_randomized_svd = flaky  # type: ignore[assignment]
    engine = sharded_engine(targets, group=svd_group(timeout_seconds=5), k=K)
    start = time.monotonic()
    try:
        for step in range(1000):
            engine.offer(step)
            engine.collect()
            time.sleep(0.05)
    except ShardedEngineError as error:
        outcome = {"error": str(error), "seconds": time.monotonic() - start, "step": step}
    else:
        outcome = {"error": None}
    engine.close(timeout=1)
    return outcome


def falling_behind(rank: int, world_size: int) -> dict[str, Any]:
    """Snapshots due faster than they are decomposed: each rank raises after behind_timeout."""
    _, _, targets = sharded_model(rank, world_size, "tp", "llama")
    engine = sharded_engine(
        targets, group=svd_group(timeout_seconds=60), k=K, max_pending=1, behind_timeout=1e-4
    )
    start = time.monotonic()
    try:
        for step in range(100):
            engine.offer(step)
    except ShardedEngineError as error:
        outcome = {"error": str(error), "seconds": time.monotonic() - start}
    else:
        outcome = {"error": None}
    engine.abort()
    engine.close(timeout=30)
    dist.barrier()
    return outcome


def placements(rank: int, world_size: int) -> dict[str, Any]:
    """Hand-made DTensors: uneven Shard(0), Shard(1), Replicate, a per-head fused split, 2-D meshes."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from spectral_callbacks.targets import Rows, Target

    generator = torch.Generator().manual_seed(0)
    full = torch.randn(150, 96, generator=generator)  # the same on every rank
    line = init_device_mesh("cpu", (world_size,))
    tall = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    layouts = {
        "shard0": (line, [Shard(0)]),
        "shard1": (line, [Shard(1)]),
        "replicate": (line, [Replicate()]),
        "replicate_dp_shard1_tp": (tall, [Replicate(), Shard(1)]),
        "shard0_dp_replicate_tp": (tall, [Shard(0), Replicate()]),
        "shard0_dp_shard1_tp": (tall, [Shard(0), Shard(1)]),  # tiles (of one column block)
    }
    targets = []
    for name, (mesh, placement) in layouts.items():
        parameter = torch.nn.Parameter(distribute_tensor(full, mesh, placement))
        targets.append(Target.from_parameter(name, parameter, role="O"))
    # GPT-NeoX-like per-head rows (heads=5, 3 parts of 10 rows): K of an uneven Shard(0).
    fused = torch.nn.Parameter(distribute_tensor(full, line, [Shard(0)]))
    for index, role in enumerate("QKV"):
        rows = Rows(start=10 * index, stop=10 * (index + 1), groups=5)
        targets.append(Target.from_parameter("fused", fused, role=role, rows=rows, fused=True))
    engine = sharded_engine(targets, group=svd_group(timeout_seconds=60), k=K)
    engine.offer(0)
    (result,) = drain(engine, 0, timeout=60)
    pieces = {p.target.name: (p.split, p.rows) for g in engine.groups.values() for p in g.pieces}
    engine.close()
    return {"metrics": result.metrics, "pieces": pieces, "full": full}


def fsdp_over_tp(rank: int, world_size: int) -> dict[str, Any]:
    """4 ranks, a 2 x 2 (dp, tp) mesh: tensor parallel blocks, then fully_shard over dp; plus the
    tiled SVD on hand-made tiles (uneven, and with scattered index sets)."""
    from sharded_models import TinyTPGPT, blocks
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from spectral_callbacks.functional.sharded_svd import sharded_randomized_svd

    group = svd_group(timeout_seconds=60)
    # 1. Hand-made tiles of a 150 x 96 matrix: row cut 100, column cut 40, rows permuted.
    full = torch.randn(150, 96, generator=torch.Generator().manual_seed(1))
    order = torch.randperm(150, generator=torch.Generator().manual_seed(2))
    rows = (order[:100], order[100:])[rank // 2]
    cols = (torch.arange(40), torch.arange(40, 96))[rank % 2]
    tile = full[rows][:, cols]
    top = sharded_randomized_svd(
        tile, K, group=group, split="tiles", shape=(150, 96), row_index=rows, col_index=cols
    )
    wide = sharded_randomized_svd(  # the transposed problem: iterates in its smaller side
        tile.T, K, group=group, split="tiles", shape=(96, 150), row_index=cols, col_index=rows
    )
    # 2. Training: TP inside each block, FSDP2 across the dp dimension.
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = TinyTPGPT(d=64, heads=4, fused=False)
    for block in blocks(model):
        plan = {f"attention.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({"attention.o_proj": RowwiseParallel(), "mlp.up_proj": ColwiseParallel()})
        plan["mlp.down_proj"] = RowwiseParallel()
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    targets = find_targets(model)
    engine = sharded_engine(targets, group=group, k=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights, results = {}, []
    for step in range(5):
        engine.offer(step)
        weights[step] = {target.name: full_matrix(target) for target in targets}
        if step < 4:
            x, y = batch(rank // 2, step, "fsdp")  # one batch per dp rank
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
    results = drain(engine, 4, timeout=120)
    engine.close()
    return {
        "tile": (top.S, top.frobenius_sq),
        "wide": (wide.S, wide.frobenius_sq),
        "full": full,
        "splits": {p.target.name: p.split for g in engine.groups.values() for p in g.pieces},
        "results": [(r.step, r.metrics) for r in results],
        "weights": weights if rank == 0 else None,
    }


class _Moves(torch.overrides.TorchFunctionMode):
    """Records every call that moves a tensor between devices (``to``, ``cpu``, ``cuda``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("to", "cpu", "cuda", "_to_copy", "copy_"):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def indices_on_the_device(rank: int, world_size: int) -> dict[str, Any]:
    """A per-head fused split (rows not contiguous): where its indices live, and what a block
    costs the training thread beyond the gather."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from spectral_callbacks.monitor.engines.shards import local_piece
    from spectral_callbacks.targets import Rows, Target

    full = torch.randn(150, 96, generator=torch.Generator().manual_seed(0))
    fused = torch.nn.Parameter(
        distribute_tensor(full, init_device_mesh("cpu", (world_size,)), [Shard(0)])
    )
    rows = Rows(start=10, stop=20, groups=5)  # K of 5 heads of (Q, K, V) x 10 rows
    piece = local_piece(
        Target.from_parameter("fused", fused, role="K", rows=rows, fused=True), rank
    )
    moves = _Moves()
    with moves:
        block = piece.block()
    select = piece._select
    return {
        "is_tensor": isinstance(select, torch.Tensor),
        "same_device": isinstance(select, torch.Tensor)
        and select.device == fused.to_local().device,
        "moves": moves.calls,
        "block": block,
        "local": fused.to_local().detach(),
        "select": select,
    }


class _HostDeviceTraffic(torch.overrides.TorchFunctionMode):
    """Records calls that move data between host and device (sync-debug mode misses pageable
    copies): ``to``/``cuda``/``cpu`` across devices, and ``copy_`` between a CPU and a CUDA tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in (*args, out) if isinstance(a, torch.Tensor)]
        moving = getattr(func, "__name__", "") in ("to", "cuda", "cpu", "copy_")
        if moving and len({t.device.type for t in tensors}) > 1:
            self.calls.append(func.__name__)
        return out


def cuda_engine(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank on the one GPU (gloo): hand-made CUDA DTensors (rows, columns, a per-head fused
    split), snapshots while training's stream is kept busy, and what the training thread did."""
    from cuda_checks import SyncDetector, sleep_ms
    from torch.distributed.tensor import Shard, distribute_tensor

    from spectral_callbacks.targets import Rows, Target

    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (world_size,))
    generator = torch.Generator().manual_seed(0)
    fulls = {name: torch.randn(150, 96, generator=generator) for name in ("rows", "cols", "fused")}
    params = {
        "rows": torch.nn.Parameter(
            distribute_tensor(fulls["rows"].cuda(), mesh, [Shard(0)], src_data_rank=None)
        ),
        "cols": torch.nn.Parameter(
            distribute_tensor(fulls["cols"].cuda(), mesh, [Shard(1)], src_data_rank=None)
        ),
        "fused": torch.nn.Parameter(
            distribute_tensor(fulls["fused"].cuda(), mesh, [Shard(0)], src_data_rank=None)
        ),
    }
    targets = [
        Target.from_parameter("rows", params["rows"], role="Q"),
        Target.from_parameter("cols", params["cols"], role="O"),
    ]
    for index, role in enumerate("QKV"):  # GPT-NeoX-like: 5 heads of (Q, K, V) x 10 rows
        rows = Rows(start=10 * index, stop=10 * (index + 1), groups=5)
        targets.append(
            Target.from_parameter("fused", params["fused"], role=role, rows=rows, fused=True)
        )
    engine = sharded_engine(targets, group=svd_group(timeout_seconds=60), k=K)
    # The stream each decomposition actually ran on, read when it is called (on the worker).
    ran: list[int] = []
    decompose = sharded_svd.sharded_randomized_svd

    def recording(*args: Any, **kwargs: Any) -> Any:
        ran.append(torch.cuda.current_stream().cuda_stream)
        return decompose(*args, **kwargs)

    sharded_engine_module.sharded_randomized_svd = recording
    sleep_ms(1)  # calibrate
    # Every wait of this (the training) thread: sync-debug mode, synchronize() calls, pageable
    # copies (cuda_checks.SyncDetector); and any data moved between host and device at all.
    traffic, detector = _HostDeviceTraffic(), SyncDetector()
    with detector.active(), detector.checking("offer"), traffic:
        engine.offer(0)
    # Keep the training stream busy for 3 s right after the copy: a worker on training's stream
    # would queue behind it; one on its own stream finishes meanwhile.
    busy_end = torch.cuda.Event()
    sleep_ms(3000)
    busy_end.record()
    started = time.monotonic()
    with detector.active(), detector.checking("collect"):
        results = engine.collect(wait_seconds=20)
    seconds = time.monotonic() - started
    still_busy = not busy_end.query()
    torch.cuda.synchronize()
    engine.finish(0, offered=True, deadline=time.monotonic() + 60)
    results += engine.collect()
    training = torch.cuda.current_stream()
    engine.close()
    sharded_engine_module.sharded_randomized_svd = decompose
    return {
        "metrics": results[0].metrics if results else None,
        "busy_while_collected": still_busy,
        "collect_seconds": seconds,
        "traffic": traffic.calls,
        "syncs": detector.found,
        "own_stream": bool(ran) and training.cuda_stream not in ran,
        "fulls": fulls,
    }


def tiny_qwen3_moe() -> Any:
    """A tiny Qwen3-MoE (3-D experts tensors ``(E, 2I, H)`` and ``(E, H, I)``), 3 experts so that
    ``fully_shard`` over 2 ranks splits them unevenly (2 and 1)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
        num_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def moe_experts(rank: int, world_size: int) -> dict[str, Any]:
    """A tiny Qwen3-MoE under ``fully_shard`` (each decoder layer, then the root): every expert's
    matrices decomposed where their shards live, at step 0 and after two optimizer steps, beside
    the float64 reference of each expert's gathered slice (test-only ``full_tensor()``)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = tiny_qwen3_moe()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    targets = find_targets(model)
    experts = [t for t in targets if t.expert is not None]
    engine = sharded_engine(targets, group=svd_group(timeout_seconds=60), k=K)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = {}
    for step in range(3):
        if step in (0, 2):
            engine.offer(step)
            weights[step] = {t.name: full_matrix(t) for t in experts}
        if step == 2:
            break
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    results = drain(engine, 2, timeout=120)
    pieces = {p.target.name: p.rows for g in engine.groups.values() for p in g.pieces}
    engine.close()
    return {
        "results": [(r.step, r.metrics) for r in results],
        "weights": weights,
        "rows": {t.name: pieces[t.name] for t in experts},
    }
