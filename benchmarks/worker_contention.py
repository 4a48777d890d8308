"""What a background thread's CPU seconds cost CPU training, by how the OS schedules that thread.

The question behind issue 13's unmet CPU overhead target: can the SVD worker run on cores that
training keeps busy without slowing it, if the thread is scheduled differently? The training loop is
overhead.py's GPT (plain PyTorch, no Lightning: only the loop and the stand-in worker run). At each
step of the callback's default schedule (``SnapshotSchedule()``: 0, powers of two, every 25) the
worker spends ``--burn-ms`` of its own CPU time (``time.thread_time``) in 192 x 192 float32 GEMMs,
about what one snapshot of this model costs; as in the engine, at most ``--max-pending`` are
outstanding and a step that finds the bound full is counted as skipped. Policies of the worker thread:

* ``normal`` - as the engine runs it (nice 0, any core);
* ``nice10``, ``nice19`` - a raised nice value (``os.setpriority`` on the thread);
* ``idle`` - ``SCHED_IDLE``: runs only when a core would otherwise be idle;
* ``pin0``, ``pin1`` - pinned to one core (``os.sched_setaffinity`` on the thread);
* ``drop`` - training runs one intra-op thread fewer while the worker is busy (checked after each
  step), so the worker has a core to itself.

Columns: ``train s`` the loop's wall time, until the worker has finished too; ``ratio`` against the
run without a worker in the same round, median over rounds; ``wall s per CPU-s`` the extra wall
time per second of the worker's CPU time; ``latency ms`` from hand-over to done (median, max);
``skipped``. Linux only (per-thread priority, policy and affinity)::

    python benchmarks/worker_contention.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from gpt import GPT  # noqa: E402
from overhead import TOY_MODEL, add_model_arguments, model_config  # noqa: E402

from spectral_callbacks.monitor.schedule import SnapshotSchedule  # noqa: E402

POLICIES = ("normal", "nice10", "nice19", "idle", "pin0", "pin1", "drop")


def schedule_policy(policy: str) -> None:
    """Apply ``policy`` to the calling thread (Linux: pid 0 is the calling thread)."""
    if policy.startswith("nice"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(policy[4:]))
    elif policy == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif policy.startswith("pin"):
        os.sched_setaffinity(0, {int(policy[3:])})


class Worker:
    """A thread that spends ``burn`` CPU seconds in GEMMs per hand-over, like one snapshot's SVD."""

    def __init__(self, policy: str, burn: float) -> None:
        self.policy, self.burn = policy, burn
        self.inbox: queue.Queue[float | None] = queue.Queue()
        self.latencies: list[float] = []
        self.cpu = 0.0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        torch.set_num_threads(1)
        schedule_policy(self.policy)
        operand = torch.randn(192, 192)
        while (handed_over := self.inbox.get()) is not None:
            start = time.thread_time()
            while time.thread_time() - start < self.burn:
                torch.mm(operand, operand)
            self.cpu += time.thread_time() - start
            self.latencies.append(time.perf_counter() - handed_over)
            self.inbox.task_done()

    def busy(self) -> int:
        return self.inbox.unfinished_tasks

    def close(self) -> None:
        self.inbox.join()
        self.inbox.put(None)
        self.thread.join()


def run_once(policy: str, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    model = GPT(model_config(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (args.batch, args.block + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    schedule = SnapshotSchedule()
    worker = Worker(policy, args.burn_ms / 1e3) if policy != "none" else None
    skipped = 0
    start = time.perf_counter()
    for step in range(args.steps):
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if worker is None:
            continue
        if torch.get_num_threads() < threads and not worker.busy():  # "drop": worker done
            torch.set_num_threads(threads)
        if schedule.on_grid(step):
            if worker.busy() >= args.max_pending:
                skipped += 1
                continue
            worker.inbox.put(time.perf_counter())
            if policy == "drop" and threads > 1:
                torch.set_num_threads(threads - 1)
    if worker is not None:
        worker.close()
    wall = time.perf_counter() - start
    torch.set_num_threads(threads)
    if worker is None:
        return {"wall": wall, "skipped": 0}
    return {
        "wall": wall,
        "cpu": worker.cpu,
        "latency_median": statistics.median(worker.latencies),
        "latency_max": max(worker.latencies),
        "skipped": skipped,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--burn-ms", type=float, default=14.0, help="worker CPU ms per snapshot")
    parser.add_argument("--max-pending", type=int, default=2)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = smoke.parse_args(parser, argv, **TOY_MODEL, policies="normal")
    unknown = [policy for policy in args.policies.split(",") if policy not in POLICIES]
    if unknown:
        parser.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    if not hasattr(os, "sched_setaffinity"):
        parser.error("needs Linux: per-thread priority, scheduling policy and affinity")
    if args.burn_ms <= 0 or args.max_pending < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--burn-ms must be > 0, and --max-pending, --steps, --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    policies = ("none", *args.policies.split(","))
    results: dict[str, list[dict[str, float]]] = {policy: [] for policy in policies}
    run_once("none", argparse.Namespace(**{**vars(args), "steps": 20}))  # warm-up
    for round_index in range(args.rounds):
        for policy in policies:
            results[policy].append(run_once(policy, args))
        line = ", ".join(f"{p} {results[p][-1]['wall']:.2f}s" for p in policies)
        print(f"round {round_index + 1}/{args.rounds}: {line}", flush=True)

    baseline = results["none"]
    print(
        f"\n{args.layers} layers x {args.width} wide, {args.batch} x {args.block} tokens/step, "
        f"{args.steps} steps, {args.burn_ms:g} ms of worker CPU per snapshot, "
        f"{torch.get_num_threads()} training threads, {os.cpu_count()} cores, "
        f"{args.rounds} alternating rounds\n"
    )
    print("| worker | train s | ratio | wall s per CPU-s | latency ms (median, max) | skipped |")
    print("|---|---|---|---|---|---|")
    for policy in policies:
        runs = results[policy]
        pairs = list(zip(runs, baseline, strict=True))
        ratio = statistics.median(run["wall"] / none["wall"] for run, none in pairs)
        cells = ["", ""]  # per worker CPU-second, latency: none without a worker
        if policy != "none":
            per_cpu = statistics.median(
                (run["wall"] - none["wall"]) / run["cpu"] for run, none in pairs
            )
            median = statistics.median(run["latency_median"] for run in runs)
            worst = max(run["latency_max"] for run in runs)
            cells = [f"{per_cpu:.2f}", f"{1e3 * median:.0f}, {1e3 * worst:.0f}"]
        print(
            f"| {policy} | {statistics.median(run['wall'] for run in runs):.2f} | {ratio:.3f} | "
            f"{cells[0]} | {cells[1]} | {max(run['skipped'] for run in runs):.0f} |"
        )


if __name__ == "__main__":
    main()
