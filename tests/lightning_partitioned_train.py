"""A short Lightning run on 2 CUDA devices with SpectralMonitor under a strategy whose parameters
no rank holds whole, for tests/cuda/test_cuda_partitioned_frontends.py.

``python tests/lightning_partitioned_train.py OUTDIR fsdp|deepspeed``

``fsdp``: ``FSDPStrategy`` (FSDP1, one unit per GPT-2 block, ``use_orig_params=True``);
``deepspeed``: ``DeepSpeedStrategy(stage=3)``. Both refuse the CPU in Lightning itself, so this
needs two GPUs. Lightning re-runs this script once per extra rank, so it must be a file. A recorder
gathers every watched matrix with the strategy's own public API (FSDP1's ``summon_full_params``,
DeepSpeed's ``GatheredParameters``; collectives on every rank) at the monitor's points, and rank 0
saves them in float64 to ``OUTDIR/weights.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from partitioned_cases import gpt2_with_biases  # noqa: E402
from tiny_models import WeightRecorder, token_loader  # noqa: E402

from spectral_callbacks import SpectralMonitor  # noqa: E402

STEPS = 10
K = 8  # snapshots at 0, 1, 2, every 4 steps and the last


class GPT2Module(LightningModule):
    """The tiny GPT-2 of partitioned_cases (non-zero biases), the same weights on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.loss_of = gpt2_with_biases()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        tokens, _ = batch
        return self.loss_of(self.model, tokens, None)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class GatheredWeights(WeightRecorder):
    """The watched matrices, gathered by the strategy's public API on every rank."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def _record(self, trainer: Trainer, pl_module: LightningModule) -> None:
        with _gathered(trainer, pl_module):
            super()._record(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save({step: _cpu(w) for step, w in self.weights.items()}, self.path)


def _gathered(trainer: Trainer, pl_module: LightningModule) -> contextlib.AbstractContextManager:
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        # the root wrapper (strategy.model), so the root unit's parameters are whole too
        return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False)
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(pl_module.parameters()), modifier_rank=None)


def _cpu(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.cpu() for name, value in weights.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("strategy", choices=["fsdp", "deepspeed"])
    args = parser.parse_args()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    strategy = (
        FSDPStrategy(auto_wrap_policy={GPT2Block}, use_orig_params=True)
        if args.strategy == "fsdp"
        else DeepSpeedStrategy(stage=3)
    )
    monitor = SpectralMonitor(
        every_n_steps=4, log_spaced_until=3, k=K, figures=False, max_pending=8, drain_timeout=20.0
    )
    trainer = Trainer(
        accelerator="cuda",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=TensorBoardLogger(args.outdir, name="tb", version=0),
        callbacks=[monitor, GatheredWeights(args.outdir / "weights.pt")],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(GPT2Module(), token_loader(num_batches=4 * STEPS))


if __name__ == "__main__":
    main()
