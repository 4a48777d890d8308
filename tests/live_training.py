"""A tiny training run that keeps writing for a while, for the live-update browser test.

``python tests/live_training.py ROOT NAME --steps 400 --pause 0.1`` trains the 3-layer
``TinyTransformer`` of cli_runs.py with ``SpectralMonitor`` (a snapshot every 2 steps), pausing
``--pause`` s after each step so the run lasts as long as a real one would between snapshots.
TensorBoard files go to ``ROOT/tb/NAME``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import BATCH, SEQ, WIDTH, TinyTransformer  # noqa: E402

from spectral_callbacks import SpectralMonitor  # noqa: E402


class Pause(L.Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("name")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--pause", type=float, default=0.1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(args.steps * BATCH, SEQ, WIDTH))
    trainer = L.Trainer(
        max_steps=args.steps,
        logger=TensorBoardLogger(args.root / "tb", name=args.name, version=""),
        callbacks=[SpectralMonitor(every_n_steps=2, figures=False), Pause(args.pause)],
        accelerator="cpu",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyTransformer(), torch.utils.data.DataLoader(data, batch_size=BATCH))


if __name__ == "__main__":
    main()
