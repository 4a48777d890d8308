"""docs/distributed.md's table: each sharding strategy x kind of watched matrix, exact or refused,
and the bytes a rank moves per snapshot against the watched matrices' bytes, measured on N local
gloo processes.

Each function of ``ROWS`` runs its strategies on a gloo group of its own and returns ``Row``s.
``sharded_rows``: FSDP2 (``fully_shard`` per block and the root) and tensor parallelism (Q/K/V/up
column-parallel, O/down row-parallel; an adapter's ``B`` column-parallel beside a column-parallel
base, its ``A`` row-parallel beside a row-parallel one), each with the watched matrices ``dense``,
with PEFT ``LoRA`` adapters (r = 16 on Q, V, O and MLP down) and with ``delta="first"``, on the
Llama-layout GPT of tests/sharded_update_cases.py (2 layers of width ``--width``). It takes a cold
snapshot at step 0 and warm ones after each of 3 AdamW steps through the ``ShardedEngine`` the
tracker builds (k = 32, Krylov blocks in bfloat16); ``exact`` means every stable rank is within 1 %
of the float64 SVD of the whole effective matrix, gathered here by ``full_tensor()``.

Columns: ``moved KB`` (the payload a rank put into all-reduces per warm snapshot, the mean of the
warm ones; a ring all-reduce moves about twice its payload per rank over the wire); ``watched MB``
(the whole watched matrices, float32: what gathering them would move); ``moved %``; the note of a
LoRA row gives what its adapters add per snapshot (the factors, ``r (m + n)`` floats per adapted
matrix, and the bases' norms).

::

    python benchmarks/distributed_table.py                       # width 512, 2 ranks
    python benchmarks/distributed_table.py --width 1024 --world-size 4
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(Path(__file__).parent)]
import smoke  # noqa: E402

KINDS = ("dense", "lora", "delta")


def measure(rank: int, world_size: int, strategy: str, kind: str, args: Any) -> dict[str, Any]:
    """One strategy x kind: bytes per snapshot and whether every value is exact."""
    import sharded_update_cases as cases
    from sharded_engine_cases import batch
    from torch.distributed.tensor import init_device_mesh

    from spectral_callbacks.functional import metrics_from_spectrum
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.engines.sharded import ShardedEngine, svd_group
    from spectral_callbacks.monitor.options import MonitorOptions
    from spectral_callbacks.targets import find_targets
    from spectral_callbacks.targets.delta import with_references

    model = cases.build(kind, d=args.width, rank=args.rank)
    how = "fsdp" if strategy == "fsdp2" else "tp"
    cases.shard(model, how, init_device_mesh("cpu", (world_size,)))
    targets = list(find_targets(model))
    if kind == "delta":
        targets = with_references(targets, "first", "benchmark")
    engine = ShardedEngine(
        targets,
        SpectrumCompute(args.k),
        MonitorOptions(synchronous=True),
        group=svd_group(timeout_seconds=600),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sent, adapters, exact = [], [], True
    for step in range(args.steps + 1):
        if step:
            model(*batch(rank, step, how)).backward()
            optimizer.step()
            optimizer.zero_grad()
        engine.offer(step)
        wholes = {t.name: cases.effective(t)["weight"] for t in targets}  # collectives: all ranks
        (result,) = engine.collect()
        sent.append(result.sent_bytes)
        adapters.append(result.factor_bytes)
        for name, whole in wholes.items():
            S = torch.linalg.svdvals(whole)[: args.k]
            truth = float(metrics_from_spectrum(S, (whole**2).sum())["stable_rank"])
            exact &= abs(result.metrics[name]["stable_rank"] / truth - 1) < 0.01
    engine.close()
    watched = sum(t.shape[0] * t.shape[1] * 4 for t in targets)
    return {"watched": watched, "sent": sent, "adapters": adapters, "exact": exact}


class Row(NamedTuple):
    """One row of the table: bytes per rank per snapshot, measured ("" where not measured)."""

    strategy: str
    kind: str
    status: str  # "exact" or "refused"
    why: str
    moved_bytes: float | str  # what a rank sends per warm snapshot
    watched_bytes: float | str  # the watched matrices, whole (what gathering them would move)
    strategy_bytes_per_step: float | str  # the strategy's own traffic per training step


def _sharded_rank(rank: int, world_size: int, store: str, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    rows = []
    for strategy in ("fsdp2", "tp"):
        for kind in KINDS:
            try:
                row = measure(rank, world_size, strategy, kind, args)
            except Exception as error:  # noqa: BLE001 - a refusal is a row of the table
                row = {"refused": f"{type(error).__name__}: {error}"}
            rows.append((strategy, kind, row))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()
    os._exit(0)  # skip teardown: nothing is left to flush


def sharded_rows(world_size: int, width: int, smoke: bool) -> list[Row]:
    """FSDP2 and tensor parallelism x {dense, LoRA, delta}, measured on ``world_size`` processes."""
    args = argparse.Namespace(
        width=width, rank=4 if smoke else 16, k=8 if smoke else 32, steps=1 if smoke else 3
    )
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=_sharded_rank, args=(r, world_size, store, args, out))
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if not os.path.exists(out):
            sys.exit("a rank failed; see its traceback above")
        measured = torch.load(out, weights_only=False)
    rows = []
    for strategy, kind, row in measured:
        name = {"fsdp2": "FSDP2", "tp": "tensor parallel"}[strategy]
        label = {"dense": "dense", "lora": "LoRA", "delta": "delta"}[kind]
        if "refused" in row:
            rows.append(Row(name, label, "refused", row["refused"], "", "", ""))
            continue
        warm = sum(row["sent"][1:]) / max(len(row["sent"]) - 1, 1)
        why = "" if kind != "lora" else f"adapters' factors {row['adapters'][0] / 1e3:.1f} KB"
        status = "exact" if row["exact"] else "NOT EXACT"
        rows.append(Row(name, label, status, why, warm, row["watched"], ""))
    return rows


ROWS: list[Callable[[int, int, bool], list[Row]]] = [sharded_rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=2)
    args = smoke.parse_args(parser, argv, width=64)
    rows = [row for rows_of in ROWS for row in rows_of(args.world_size, args.width, args.smoke)]
    print(f"{args.world_size} gloo processes, width {args.width}; bytes per rank per snapshot")
    print("| strategy | watched | exact / refused | moved KB | watched MB | moved % | "
          "strategy's own KB/step | note |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        moved = f"{row.moved_bytes / 1e3:.0f}" if isinstance(row.moved_bytes, float) else ""
        watched = row.watched_bytes
        size = f"{watched / 1e6:.2f}" if isinstance(watched, int | float) else ""
        share = (
            f"{100 * row.moved_bytes / watched:.1f}"
            if isinstance(row.moved_bytes, float) and isinstance(watched, int | float)
            else ""
        )
        own = row.strategy_bytes_per_step
        own_text = f"{own / 1e3:.0f}" if isinstance(own, int | float) else ""
        print(
            f"| {row.strategy} | {row.kind} | {row.status} | {moved} | {size} | {share} | "
            f"{own_text} | {row.why} |"
        )


if __name__ == "__main__":
    main()
