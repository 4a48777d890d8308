"""What ``SpectralTracker.step(step)`` costs when nothing is due, against one training step.

``python benchmarks/tracker_idle_step.py [--calls N] [--rounds R]``: a 4-layer x 128-wide GPT on the
CPU (one thread); the tracker's schedule is set so that no snapshot falls due, so each call is only
the bookkeeping every loop pays on every optimizer step. Prints a table: microseconds per idle
call, milliseconds per training step (batch 8 x 64 tokens), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402


class Discard:
    def log_metrics(self, metrics: dict, step: int) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="idle calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = smoke.parse_args(parser, argv, calls=100, rounds=1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (8, 65))
    tracker = SpectralTracker(
        model, writers=[Discard()], every_n_steps=10**9, log_spaced_until=0, figures=False
    )
    idle_us, train_ms = [], []
    step = 0
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            step += 1
            tracker.step(step)
        idle_us.append((time.perf_counter() - start) / args.calls * 1e6)
        start = time.perf_counter()
        for _ in range(20):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        train_ms.append((time.perf_counter() - start) / 20 * 1e3)
    tracker.close()
    print("| round | idle tracker.step() µs | training step ms | ratio |")
    print("|---|---|---|---|")
    for index, (idle, train) in enumerate(zip(idle_us, train_ms, strict=True)):
        print(f"| {index} | {idle:.2f} | {train:.1f} | {idle / 1e3 / train:.5f} |")
    median = statistics.median(idle_us) / 1e3 / statistics.median(train_ms)
    print(
        f"| median | {statistics.median(idle_us):.2f} | {statistics.median(train_ms):.1f} | {median:.5f} |"
    )


if __name__ == "__main__":
    main()
