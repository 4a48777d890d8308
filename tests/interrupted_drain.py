"""A plain loop whose end-of-training wait the parent interrupts with SIGINT (Ctrl-C).

Run by tests/monitor/test_tracker.py: ``python interrupted_drain.py LOGDIR``. Each shape group's compute
takes 0.3 s, so at the end four snapshots are still in flight when the wait begins. The loop is a
sweep of two runs: the Ctrl-C must reach it, not start the second run.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from typing import Any

import torch
from tiny_models import GPT, GPTConfig, exact_compute

from spectral_callbacks import SpectralTracker


def slow(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    time.sleep(0.3)  # one shape group's SVD
    return exact_compute(group, batch)


def main(logdir: str) -> None:
    # A shell hands a script Ctrl-C as KeyboardInterrupt; a parent that ignores SIGINT (pytest,
    # once Lightning has handled an interrupted fit in an earlier test) would hand down SIG_IGN.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's look when it hangs
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    options: dict[str, Any] = dict(
        compute=slow, metrics=("stable_rank",), figures=False, every_n_steps=1, log_spaced_until=0
    )
    try:
        for run in (0, 1):  # a sweep: a Ctrl-C at the end of the first run stops it
            with SpectralTracker(
                model, logdir=f"{logdir}/{run}", max_pending=4, synchronous=False, **options
            ) as t:
                for step in range(1, 4):
                    t.step(step)
            print(f"run {run} finished", flush=True)
    except KeyboardInterrupt:
        print("the sweep got the KeyboardInterrupt", flush=True)
        raise


if __name__ == "__main__":  # pytest --doctest-modules imports this file too
    main(sys.argv[1])
