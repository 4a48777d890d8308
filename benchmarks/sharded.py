"""ShardedEngine: bytes communicated per snapshot against the watched matrices, per-rank SVD time,
and training's wall-time ratio with / without the engine, on N local gloo processes.

Part 1 (per width): the six matrices of one GPT layer (Q, K, V, O: d x d; MLP up 4d x d, down
d x 4d), float32 DTensors sharded over N ranks either as FSDP2 does (every matrix ``Shard(0)``) or as
tensor parallelism does (Q/K/V/up column-parallel ``Shard(0)``, O/down row-parallel ``Shard(1)``).
One cold snapshot, then a warm one after a small change of the weights. Columns:

* ``watched MB`` - bytes of the full watched matrices (float32), what gathering them would move;
* ``sent KB``    - payload this rank put into all-reduces for the snapshot (a ring all-reduce moves
  ``2 (N-1)/N`` times its payload per rank over the wire: 1x for N = 2);
* ``sent %``     - sent / watched;
* ``svd ms``     - each rank's worker time (SVD + metrics) for the snapshot, and
  ``1-proc ms`` - one process decomposing the full matrices with the single-process default
  (``SpectrumCompute``), measured in the same run while the other ranks wait.

Part 2: the example GPT under ``fully_shard`` (per block and the root), a raw AdamW loop, measured
in alternating rounds of ``--steps`` steps without and with a ShardedEngine snapshotting every
``--every`` steps (in one run, same processes); the ratio is the median over rounds of rank 0.

::

    python benchmarks/sharded.py                                   # widths 256 512 768 1024, 2 ranks
    python benchmarks/sharded.py --widths 512 --world-size 2 --k 32 --steps 40 --rounds 3
    python benchmarks/sharded.py --comm-dtype float32               # Krylov blocks in float32
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks.monitor.engines.compute import SpectrumCompute  # noqa: E402
from spectral_callbacks.monitor.engines.sharded import ShardedEngine, svd_group  # noqa: E402
from spectral_callbacks.monitor.options import MonitorOptions  # noqa: E402
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot  # noqa: E402
from spectral_callbacks.targets import Target, find_targets  # noqa: E402

ROLES = ("Q", "K", "V", "O", "MLP_up", "MLP_down")


def layer_matrices(d: int, seed: int) -> dict[str, torch.Tensor]:
    """One GPT layer's watched matrices at GPT-2's init scale, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"Q": (d, d), "K": (d, d), "V": (d, d), "O": (d, d)}
    shapes.update({"MLP_up": (4 * d, d), "MLP_down": (d, 4 * d)})
    return {role: 0.02 * torch.randn(*shape, generator=generator) for role, shape in shapes.items()}


def bytes_and_times(
    rank: int, world_size: int, widths: list[int], k: int, comm_dtype: torch.dtype | None
) -> list[dict]:
    mesh = init_device_mesh("cpu", (world_size,))
    group = svd_group(timeout_seconds=600)
    rows: list[dict] = []
    for d in widths:
        full = layer_matrices(d, seed=d)
        watched = sum(matrix.numel() * 4 for matrix in full.values())
        for layout in ("fsdp", "tp"):
            targets = []
            for role, matrix in full.items():
                dim = 1 if layout == "tp" and role in ("O", "MLP_down") else 0
                local = distribute_tensor(matrix, mesh, [Shard(dim)], src_data_rank=None)
                targets.append(Target.from_parameter(role, torch.nn.Parameter(local), role=role))
            engine = ShardedEngine(
                targets,
                SpectrumCompute(k),
                MonitorOptions(max_pending=4),
                group=group,
                inline=True,
                comm_dtype=comm_dtype,
            )
            for step, label in enumerate(("cold", "warm")):
                if step:  # the weights move a little between snapshots, as in training
                    with torch.no_grad():
                        for target in targets:
                            local = target.parameter.to_local()
                            local.add_(1e-3 * torch.randn_like(local))
                dist.barrier()
                engine.offer(step)
                (result,) = engine.collect()
                rows.append(
                    dict(
                        width=d,
                        layout=layout,
                        snapshot=label,
                        watched=watched,
                        sent=result.sent_bytes,
                        svd_ms=1000 * result.svd_seconds,
                    )
                )
            engine.close()
        # One process, full matrices, the single-process default compute (cold, then warm).
        dist.barrier()
        if rank == 0:
            plain = [
                Target.from_parameter(role, matrix.clone(), role=role)
                for role, matrix in full.items()
            ]
            compute, groups = SpectrumCompute(k), group_by_shape(plain)
            for label in ("cold", "warm"):
                snapshot = take_snapshot(groups, 0)
                start = time.perf_counter()
                for group_ in groups:
                    compute(group_, snapshot.tensors[group_.key])
                seconds = time.perf_counter() - start
                for row in rows:
                    if row["width"] == d and row["snapshot"] == label:
                        row["single_ms"] = 1000 * seconds
        dist.barrier()
    return rows


def training_ratio(
    rank: int, world_size: int, width: int, steps: int, rounds: int, every: int, k: int
) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=width, block_size=64))
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ShardedEngine(
        find_targets(model),
        SpectrumCompute(k),
        MonitorOptions(max_pending=4),  # the copies are local shards, a fraction of the weights
        group=svd_group(timeout_seconds=600),
    )
    generator = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (8, 65), generator=generator)

    def train(count: int, watch: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for step in range(count):
            if watch and step % every == 0:
                engine.offer(step)
            engine.collect()
            _, loss = model(data[:, :-1], data[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if watch:
            engine.finish(count - 1, offered=True, deadline=time.monotonic() + 600)
            engine.collect()
        return time.perf_counter() - start

    train(5, watch=False)  # warm-up
    ratios = []
    for _ in range(rounds):
        without = train(steps, watch=False)
        ratios.append(train(steps, watch=True) / without)
    engine.close()
    return ratios


def _rank(rank: int, world_size: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    comm_dtype = None if args.comm_dtype == "float32" else getattr(torch, args.comm_dtype)
    rows = bytes_and_times(rank, world_size, args.widths, args.k, comm_dtype)
    ratios = training_ratio(
        rank, world_size, args.train_width, args.steps, args.rounds, args.every, args.k
    )
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (rows, ratios))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()
    os._exit(0)  # skip teardown: nothing is left to flush


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 768, 1024])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--train-width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--comm-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of the all-reduced Krylov blocks (the engine's default: bfloat16)",
    )
    args = smoke.parse_args(
        parser, argv, widths=[64], k=8, train_width=64, steps=4, rounds=1, every=2
    )
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_rank, args=(r, args.world_size, store, args, out))
            for r in range(args.world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if not os.path.exists(out):
            sys.exit("a rank failed; see its traceback above")
        gathered = torch.load(out, weights_only=False)
    per_rank = [rows for rows, _ in gathered]
    print(
        f"{args.world_size} processes, gloo, k={args.k}, Krylov blocks in {args.comm_dtype}, "
        "1 torch thread per process"
    )
    header = "| width | layout | snapshot | watched MB | sent KB/rank | sent % |"
    header += "".join(f" svd ms r{r} |" for r in range(args.world_size)) + " 1-proc ms |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for index, row in enumerate(per_rank[0]):
        times = "".join(f" {rows[index]['svd_ms']:.0f} |" for rows in per_rank)
        print(
            f"| {row['width']} | {row['layout']} | {row['snapshot']} | {row['watched'] / 1e6:.2f} "
            f"| {row['sent'] / 1e3:.0f} | {100 * row['sent'] / row['watched']:.1f} |{times} "
            f"{row['single_ms']:.0f} |"
        )
    ratios = gathered[0][1]
    print(
        f"\ntraining wall-time ratio with / without the engine (rank 0, FSDP2 GPT 2 x "
        f"{args.train_width}, snapshot every {args.every} steps, {args.rounds} rounds of "
        f"{args.steps} steps): median {statistics.median(ratios):.3f} "
        f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
