"""Per-rank spectral work of SpectralMonitor under DDP: the same GPT on 1 and on N processes.

Under DDP each rank decomposes only its share of the matrices (balanced by cost) and rank 0 logs
them all, so the SVD time per rank and per snapshot should drop about 1/N. For each process count
the training runs in a fresh subprocess (Lightning's ``strategy="ddp"`` re-runs the script per rank;
CPU with gloo, or one GPU per rank with NCCL when there are enough GPUs). The table gives, per rank,
medians over the snapshots of the run:

* ``matrices``  - matrices that rank decomposed per snapshot (``spectral_monitor/rank<r>/matrices``);
* ``svd ms``    - its SVD + metrics milliseconds per snapshot (``.../rank<r>/svd_ms``);
* ``main ms``   - its main-thread milliseconds per snapshot (copy of its share + hand-over);
* ``train s``   - rank 0's wall time of the training loop.

::

    python benchmarks/ddp_overhead.py                          # 1 and 2 processes, 4 x 256, 60 steps
    python benchmarks/ddp_overhead.py --processes 1,2,4 --width 768 --layers 8 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import SpectralMonitor  # noqa: E402
from spectral_callbacks.names import MONITOR_SECTION  # noqa: E402


class GPTModule(LightningModule):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HealthLogger(Logger):
    """Keeps every ``spectral_monitor/...`` scalar (only rank 0 logs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.health: dict[str, list[float]] = {}

    name = "health"  # type: ignore[assignment]
    version = 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for tag, value in metrics.items():
            if tag.startswith(MONITOR_SECTION + "/"):
                self.health.setdefault(tag.removeprefix(MONITOR_SECTION + "/"), []).append(value)

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class LoopTimer(Callback):
    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if not hasattr(self, "start"):
            self.start = time.perf_counter()

    def on_train_end(self, trainer: Trainer, *args: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def worker(args: argparse.Namespace) -> None:
    """One training run on ``args.devices`` processes; rank 0 writes the per-rank medians."""
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.device_count() >= args.devices else "cpu"
    if args.threads:  # the same per process for every count, so runs differ only in the split
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.layers, n_head=args.width // 32, n_embd=args.width, block_size=args.block
    )
    tokens = torch.randint(0, 256, (args.steps * args.batch * args.devices, args.block + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    health, timer = HealthLogger(), LoopTimer()
    monitor = SpectralMonitor(every_n_steps=args.every, figures=False)
    trainer = Trainer(
        accelerator=accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=[health],
        callbacks=[timer, monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPTModule(config), loader)
    if not trainer.is_global_zero:
        return
    rows = []
    for rank in range(args.devices):
        prefix = f"rank{rank}/" if args.devices > 1 else ""
        matrices = health.health.get(f"{prefix}matrices")
        rows.append(
            {
                "rank": rank,
                "snapshots": len(health.health[f"{prefix}svd_ms"]),
                "matrices": statistics.median(matrices) if matrices else len(monitor.targets),
                "svd_ms": statistics.median(health.health[f"{prefix}svd_ms"]),
                "main_ms": statistics.median(health.health[f"{prefix}main_thread_ms"]),
                "skipped": health.health[f"{prefix}skipped"][-1],
            }
        )
    result = {"accelerator": accelerator, "train_s": timer.seconds, "ranks": rows}
    Path(args.result).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,2", help="comma-separated process counts")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch and rank")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="SpectralMonitor every_n_steps")
    parser.add_argument(
        "--accelerator",
        default="auto",
        choices=("auto", "cpu", "gpu"),
        help="auto: one GPU per process when there are enough, else CPU (gloo)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (0: torch's default)"
    )
    parser.add_argument("--devices", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = smoke.parse_args(
        parser, argv, processes="1", layers=2, width=64, block=16, batch=2, steps=6, every=2
    )
    if args.devices is not None:  # a worker run (and, under DDP, each rank it re-launches)
        import logging
        import warnings

        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        worker(args)
        return

    counts = [int(count) for count in args.processes.split(",")]
    table = []
    with tempfile.TemporaryDirectory() as folder:
        for count in counts:
            result = Path(folder) / f"result{count}.json"
            command = [sys.executable, __file__, *(argv or sys.argv[1:])]
            command += ["--devices", str(count), "--result", str(result)]
            subprocess.run(command, check=True, timeout=1800)
            table.append((count, json.loads(result.read_text())))
    print(
        f"\n{args.layers} layers x {args.width} wide, {args.batch} x {args.block} tokens/step/rank, "
        f"{args.steps} steps, snapshot every {args.every} steps (+ early powers of two), "
        f"{table[0][1]['accelerator']}, {os.cpu_count()} cores, {args.threads} thread(s)/process\n"
    )
    print(
        "| processes | rank | snapshots | matrices | svd ms/snapshot | main ms/snapshot | skipped | train s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for count, result in table:
        for row in result["ranks"]:
            print(
                f"| {count} | {row['rank']} | {row['snapshots']} | {row['matrices']:.0f} | "
                f"{row['svd_ms']:.1f} | {row['main_ms']:.2f} | {row['skipped']:.0f} | "
                f"{result['train_s']:.2f} |"
            )


if __name__ == "__main__":
    main()
