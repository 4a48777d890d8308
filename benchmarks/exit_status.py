"""Does a process that trains with SpectralMonitor always exit with its own status?

Each run is a fresh ``python`` process: a Hugging Face GPT-2 trains a few steps with
``SpectralMonitor(drain_timeout=...)`` (a small drain timeout leaves the worker thread inside an
SVD when ``fit`` returns) and then the interpreter exits. Before the fix such a process could abort
at exit (``terminate called without an active exception``, exit 134) from a daemon worker still
inside a LAPACK call. Prints one row per drain timeout: runs, exit statuses, aborts.

Run::

    PYTHONPATH=. python benchmarks/exit_status.py                     # 20 runs each of 0 and 1 s, 8 x 768
    PYTHONPATH=. python benchmarks/exit_status.py --runs 3 --layers 2  # quicker

Exit status 1 if any run did not exit 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import smoke

ROOT = Path(__file__).resolve().parents[1]

# The child: a Hugging Face GPT-2 (the configuration that aborted: 768 wide, 8 layers) trains
# `steps` steps with the callback's defaults (figures included) and returns; nothing after `fit`
# waits for the background threads.
CHILD = """
import tempfile, warnings
import torch
from lightning.pytorch import Trainer, LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging
from spectral_callbacks import SpectralMonitor

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
class Module(LightningModule):
    def __init__(self):
        super().__init__()
        config = GPT2Config(n_embd={width}, n_layer={layers}, n_head={width} // 64, vocab_size=256,
                            n_positions=64, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)
    def training_step(self, batch, _):
        return self.model(input_ids=batch[0], labels=batch[0]).loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
tokens = torch.randint(0, 256, (64, 16))
loader = DataLoader(TensorDataset(tokens), batch_size=2)
trainer = Trainer(max_steps={steps}, logger=TensorBoardLogger(tempfile.mkdtemp()),
                  callbacks=[SpectralMonitor(drain_timeout={drain})], enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
trainer.fit(Module(), loader)
print("fit returned", flush=True)
"""


def run_child(width: int, layers: int, steps: int, drain: float) -> tuple[int, str]:
    """Exit status and the last stderr line of one child process."""
    code = CHILD.format(width=width, layers=layers, steps=steps, drain=drain)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per drain timeout")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--drain", default="0,1", help="comma-separated drain_timeout values (s)")
    args = smoke.parse_args(parser, argv, runs=1, width=64, layers=2, steps=2, drain="1")
    print(
        f"| drain_timeout | runs | exit statuses | aborts | s per run |  ({args.layers} x {args.width})"
    )
    print("|---|---|---|---|---|")
    failed = False
    for drain in (float(value) for value in args.drain.split(",")):
        statuses: collections.Counter[int] = collections.Counter()
        last_error = ""
        start = time.perf_counter()
        for _ in range(args.runs):
            status, tail = run_child(args.width, args.layers, args.steps, drain)
            statuses[status] += 1
            if status != 0:
                last_error = tail
        seconds = (time.perf_counter() - start) / args.runs
        aborts = sum(count for status, count in statuses.items() if status != 0)
        failed = failed or aborts > 0
        shown = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
        print(f"| {drain:g} | {args.runs} | {shown} | {aborts} | {seconds:.1f} |", flush=True)
        if last_error:
            print(f"  last failure: {last_error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
