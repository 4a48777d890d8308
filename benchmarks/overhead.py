"""Training overhead of SpectralMonitor: the same small GPT without it and with it, by placement.

The variants run alternately in one process (round 1: none, default, worker, inline; round 2: ...),
so a machine shared with other work slows them alike; the table gives medians over rounds. The
placement variants: ``default`` chooses from the machine (``monitor/engines/placement.py``: the worker
where a core is spare beside training's threads, inline where none is), ``worker`` forces the
worker thread (``synchronous=False``), ``inline`` the training thread (``synchronous=True``); each
has a ``-no-figures`` twin (``figures=False``). ``--train-threads N`` gives training N intra-op
threads (``torch.set_num_threads``) instead of one per core, so both cases of the choice are
measured on one machine:

* ``placed``   - where the run's snapshots went (``spectral_monitor/inline``): inline or worker;
* ``train s``  - wall time of the training loop (first batch start to ``on_train_end``);
* ``fit s``    - the whole ``trainer.fit`` (including the final snapshot, drain and end figures);
* ``ratio``    - each against the run without the callback, same round, then the median;
* ``cpu ratio`` - the same for the CPU seconds of the whole process (all threads) during the
  training loop: what the callback's work costs in core time, far less sensitive than wall time to
  other processes on a shared machine;
* ``main ms``  - main-thread milliseconds per snapshot (copy + hand-over; the SVD too when
  inline), from ``spectral_monitor/main_thread_ms``;
* ``svd ms``   - SVD + metrics milliseconds per snapshot (worker thread or side stream);
* ``figures after fit s`` - the wait, after ``fit()`` returned and outside its time, for the final
  figures the figure process draws then (so they cannot slow the next variant's run);
* ``worker cpu s`` - CPU seconds of the worker thread during the training loop (0 when the SVD runs
  on the main thread), and below the table, for each variant with a worker, the training wall
  seconds each of them cost: ``(train s - none's train s) / worker cpu s``, same round, median.
  Where training keeps every core busy (its OpenMP threads spin at their barriers), that is above
  1: a core the worker takes stalls both training threads.

Two more variants take the worker's cost apart (each replays the ``worker`` run of its round, call
by call, on the worker thread): ``no-svd`` returns the recorded metrics without computing (what the hooks, the copies, the
hand-over and the logging cost), ``same-cpu-gemm`` first spends each call's recorded CPU seconds in
large GEMMs (the same worker CPU time in a few GIL-releasing kernels instead of the SVD's hundreds
of small operations)::

    python benchmarks/overhead.py --variants worker,no-svd,same-cpu-gemm --rounds 5

The device is chosen automatically (CUDA when available), so the same command prints the same
table on a GPU::

    python benchmarks/overhead.py                 # 4 layers x 128 wide, 16 x 64 tokens, 600 steps, 3 rounds
    python benchmarks/overhead.py --rounds 5 --train-threads 1   # training leaves a core spare
    python benchmarks/overhead.py --width 768 --layers 8 --block 256 --steps 500   # a GPU-sized run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import SpectralMonitor  # noqa: E402
from spectral_callbacks.monitor import dashboards  # noqa: E402
from spectral_callbacks.monitor.engines.compute import SpectrumCompute  # noqa: E402
from spectral_callbacks.monitor.engines.engine import WORKER_THREAD_NAME  # noqa: E402
from spectral_callbacks.monitor.engines.placement import available_cores  # noqa: E402
from spectral_callbacks.names import monitor_tag  # noqa: E402

# Keyword arguments of SpectralMonitor per variant; "none" runs without the callback. The last two
# take the worker run of the same round apart (see ReplayCompute): they need "worker" before them.
VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "default": {},  # placement chosen from the machine
    "worker": {"synchronous": False},
    "inline": {"synchronous": True},
    "default-no-figures": {"figures": False},
    "worker-no-figures": {"synchronous": False, "figures": False},
    "inline-no-figures": {"synchronous": True, "figures": False},
    "nice": {"synchronous": False, "worker_nice": 10},  # the worker thread at lower priority
    "budget-1%": {"synchronous": False, "max_overhead": 0.01},  # the worker within a budget
    # The worker's results replayed: hooks, copies, hand-over and logging only; then the same after
    # the worker's CPU seconds per call, spent in large GEMMs.
    "no-svd": {"synchronous": False},
    "same-cpu-gemm": {"synchronous": False},
}
REPLAYS = ("no-svd", "same-cpu-gemm")


class RecordingCompute(SpectrumCompute):
    """The default compute (of the worker variant), remembering each call's metrics and thread CPU
    seconds, in order."""

    def __init__(self, record: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
        super().__init__()
        self.record = record

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        start = time.thread_time()
        metrics = super().__call__(group, batch)
        self.record.append((time.thread_time() - start, metrics))
        return metrics


class ReplayCompute:
    """The recorded worker run's metrics, call by call, instead of the SVD.

    With ``burn`` each call first spends the CPU seconds the default's call took, in 192 x 192
    float32 GEMMs: the same worker CPU time in a few large kernels with the GIL released, so the
    difference from the default is what the SVD's pattern (hundreds of small operations a
    snapshot, each releasing and retaking the GIL the training loop's Python needs) costs beyond
    its CPU seconds. A CPU diagnostic: on CUDA the compute only enqueues kernels.
    """

    def __init__(self, record: list[tuple[float, dict[str, torch.Tensor]]], burn: bool) -> None:
        if not record:
            raise RuntimeError("the worker run of this round recorded no snapshot to replay")
        self.record, self.burn, self.calls = record, burn, 0
        self.operand = torch.randn(192, 192)

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        seconds, metrics = self.record[min(self.calls, len(self.record) - 1)]
        self.calls += 1
        start = time.thread_time()
        while self.burn and time.thread_time() - start < seconds:
            torch.mm(self.operand, self.operand)
        return {name: value.clone() for name, value in metrics.items()}


class GPTModule(LightningModule):
    def __init__(self, config: GPTConfig, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = GPT(config)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LoopTimer(Callback):
    """Wall time from the first batch start to the end of training (before the callback drains).

    Placed first in ``callbacks``, its ``on_train_end`` runs before SpectralMonitor's. On CUDA it
    waits for the *training* stream only, so work on the callback's side stream still overlaps.
    """

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.cpu_start = self.cpu_end = 0.0
        self.worker_cpu = 0.0
        self._worker_cpu_start: dict[int, float] = {}

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self.start is None:
            _sync()
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()
            # The worker already exists (the step-0 snapshot is taken at train start).
            self._worker_cpu_start = {ident: _cpu(ident) for ident in _workers()}

    def on_train_end(self, trainer: Trainer, *args: Any) -> None:
        _sync()
        self.end = time.perf_counter()
        self.cpu_end = time.process_time()
        self.worker_cpu = sum(
            _cpu(ident) - self._worker_cpu_start.get(ident, 0.0) for ident in _workers()
        )


def _workers() -> list[int]:
    """Thread ids of the live SVD worker threads (the engine names them)."""
    return [
        t.ident
        for t in threading.enumerate()
        if t.name == WORKER_THREAD_NAME and t.ident is not None and t.is_alive()
    ]


def _cpu(ident: int) -> float:
    """CPU seconds a live thread has used."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


class HealthLogger(Logger):
    """Keeps the callback's per-snapshot health scalars in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.main_ms: list[float] = []
        self.svd_ms: list[float] = []
        self.skipped = 0.0
        self.inline: float | None = None

    name = "health"  # type: ignore[assignment]
    version = 0  # type: ignore[assignment]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.inline = metrics.get(monitor_tag("inline"), self.inline)
        if monitor_tag("main_thread_ms") in metrics:
            self.main_ms.append(metrics[monitor_tag("main_thread_ms")])
            self.svd_ms.append(metrics[monitor_tag("svd_ms")])
            self.skipped = metrics[monitor_tag("skipped")]

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def _sync() -> None:
    if torch.cuda.is_available():  # the training stream only: a measurement, not the callback
        torch.cuda.current_stream().synchronize()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT, its tokens per step and the rounds (worker_contention.py measures the same loop)."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    # 1,024 tokens per step and 600 steps: the dense early schedule and the every-25-steps grid both
    # show; a 256-token step (--batch 4) is the worst case, where the SVD rivals a step's cost.
    parser.add_argument("--batch", type=int, default=16, help="sequences per batch")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)


# ``--smoke``'s sizes of ``add_model_arguments`` (seconds; nothing is measured at this size).
TOY_MODEL = {"layers": 1, "width": 32, "block": 8, "batch": 2, "steps": 12, "rounds": 1}


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The GPT that ``add_model_arguments`` describes: 32-wide heads."""
    return GPTConfig(
        n_layer=args.layers, n_head=args.width // 32, n_embd=args.width, block_size=args.block
    )


def run_once(
    variant: str,
    args: argparse.Namespace,
    logdir: str,
    record: list[tuple[float, dict[str, torch.Tensor]]] | None = None,
) -> dict[str, float]:
    """One training run; ``record`` is what the worker variant records and the replays read."""
    torch.manual_seed(0)
    config = model_config(args)
    tokens = torch.randint(0, 256, (args.steps * args.batch, args.block + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    timer, health = LoopTimer(), HealthLogger()
    callbacks: list[Callback] = [timer]
    if variant != "none":
        options = dict(VARIANTS[variant])
        if record is not None and variant == "worker":
            record.clear()
            options["compute"] = RecordingCompute(record)
        elif variant in REPLAYS:
            options["compute"] = ReplayCompute(record or [], burn=variant == "same-cpu-gemm")
        callbacks.append(SpectralMonitor(**options))
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.steps,
        precision=getattr(args, "precision", "32-true"),
        logger=[TensorBoardLogger(logdir, name=variant), health],
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=50,
    )
    start = time.perf_counter()
    trainer.fit(GPTModule(config), loader)
    fit = time.perf_counter() - start
    # The final figures are drawn after fit() returns, at the lowest priority: waited for here,
    # outside the timed fit, so they cannot spill into the next variant's run.
    after = time.perf_counter()
    dashboards.wait_for_figures(timeout=300)
    figures_after = time.perf_counter() - after
    assert timer.start is not None and timer.end is not None
    return {
        "train": timer.end - timer.start,
        "cpu": timer.cpu_end - timer.cpu_start,
        "worker_cpu": timer.worker_cpu,
        "fit": fit,
        "figures_after": figures_after,
        "main_ms": statistics.median(health.main_ms) if health.main_ms else float("nan"),
        "svd_ms": statistics.median(health.svd_ms) if health.svd_ms else float("nan"),
        "snapshots": len(health.main_ms),
        "skipped": health.skipped,
        "inline": health.inline,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--precision", default="32-true", help="Trainer precision, e.g. bf16-mixed")
    parser.add_argument(
        "--train-threads",
        type=int,
        default=None,
        help="training's intra-op threads (torch.set_num_threads); default: torch's, one per core",
    )
    parser.add_argument(
        "--variants",
        default="default,worker,inline",
        help=f"comma-separated, from {', '.join(list(VARIANTS)[1:])}".replace("%", "%%"),
    )
    args = smoke.parse_args(parser, argv, **TOY_MODEL, variants="inline")

    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    # The table's `placed` column says where the snapshots ran: no note per run.
    logging.getLogger("spectral_callbacks").setLevel(logging.WARNING)
    if args.train_threads is not None:
        if args.train_threads < 1:
            parser.error(f"--train-threads must be a positive int, got {args.train_threads!r}")
        torch.set_num_threads(args.train_threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU, training on {torch.get_num_threads()} threads of {available_cores():g} cores"
    )
    variants = ("none", *args.variants.split(","))
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(list(VARIANTS)[1:])}")
    replays = [variant for variant in variants if variant in REPLAYS]
    if replays and (
        "worker" not in variants or variants.index("worker") > variants.index(replays[0])
    ):
        parser.error(f"--variants: list worker before {', '.join(replays)}, which replay its runs")
    results: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as logdir:
        run_once("default", argparse.Namespace(**{**vars(args), "steps": 20}), logdir)  # warm-up
        # Only recorded when a replay needs it: otherwise "worker" is SpectralMonitor(...) exactly.
        record: list[tuple[float, dict[str, torch.Tensor]]] | None = [] if replays else None
        for round_index in range(args.rounds):
            for variant in variants:
                results[variant].append(run_once(variant, args, logdir, record))
            line = ", ".join(f"{v} {results[v][-1]['train']:.2f}s" for v in variants)
            print(f"round {round_index + 1}/{args.rounds}: {line}", flush=True)

    def median_ratio(variant: str, key: str) -> float:
        return statistics.median(
            r[key] / n[key] for r, n in zip(results[variant], results["none"], strict=True)
        )

    print(
        f"\n{args.layers} layers x {args.width} wide, {args.batch} x {args.block} tokens/step, "
        f"{args.steps} steps, {args.rounds} alternating rounds, {device}\n"
    )
    print(
        "| variant | placed | train s | train ratio | cpu ratio | fit s | fit ratio | snapshots "
        "| skipped | main ms/snapshot | svd ms/snapshot | worker cpu s | figures after fit s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for variant in variants:
        runs = results[variant]
        placed = {_placed(r["inline"]) for r in runs}
        print(
            f"| {variant} | {'/'.join(sorted(placed))} | "
            f"{statistics.median(r['train'] for r in runs):.2f} | "
            f"{median_ratio(variant, 'train'):.3f} | {median_ratio(variant, 'cpu'):.3f} | "
            f"{statistics.median(r['fit'] for r in runs):.2f} | "
            f"{median_ratio(variant, 'fit'):.3f} | {runs[-1]['snapshots']} | {runs[-1]['skipped']:.0f} | "
            f"{statistics.median(r['main_ms'] for r in runs):.2f} | {statistics.median(r['svd_ms'] for r in runs):.1f} | "
            f"{statistics.median(r['worker_cpu'] for r in runs):.2f} | "
            f"{statistics.median(r['figures_after'] for r in runs):.2f} |"
        )
    for variant in variants[1:]:
        pairs = list(zip(results[variant], results["none"], strict=True))
        if all(r["worker_cpu"] > 0 for r, _ in pairs):
            cost = statistics.median((r["train"] - n["train"]) / r["worker_cpu"] for r, n in pairs)
            print(f"{variant}: each worker CPU second cost training {cost:.2f} s of wall time")


def _placed(inline: float | None) -> str:
    """The ``placed`` column: where the run's snapshots were computed."""
    return "-" if inline is None else "inline" if inline else "worker"


if __name__ == "__main__":
    main()
