"""A short sharded run (CPU, gloo, 2 processes) with SpectralMonitor, for tests/integrations/test_sharded_frontends.py.

``python tests/sharded_train.py OUTDIR [--tp] [--lora] [--steps S] [--fail-rank R --fail-step F]
[--checkpoint-every N] [--resume CKPT] [--suffix S]``

Lightning's ``ModelParallelStrategy`` on 2 CPU devices: by default ``data_parallel_size=2`` with
``fully_shard`` per block of Hugging Face's GPT-2 (fused ``c_attn``, ``Conv1D`` stored (in, out));
with ``--tp``, ``tensor_parallel_size=2`` with column/row-parallel attention and MLP of a GPT-NeoX
style GPT (fused ``query_key_value`` interleaved per head); with ``--lora``, ``fully_shard`` per
block of a Llama-layout GPT with PEFT LoRA adapters (``tests/sharded_update_cases.py``), whose
recorded matrices are the effective ``W_0 + s B A``. Lightning re-runs this script once per
extra rank, so it must be a file. A recorder gathers every watched matrix (``full_tensor()``, a
test-only collective on every rank) at every optimizer step and rank 0 saves them to
``OUTDIR/weights.pt``, with the callback's state to ``OUTDIR/monitor_state.pt``.

Resume: ``--checkpoint-every N`` saves Lightning checkpoints (under ``ModelParallelStrategy`` a
distributed checkpoint *directory*) to ``OUTDIR/checkpoints``; ``--resume CKPT`` fits again from
one of them (``ckpt_path=``), logging into the same ``OUTDIR/tb/version_0`` as a resumed run
does; ``--suffix S`` names its saved files ``weightsS.pt`` and ``monitor_stateS.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharded_update_cases as updates  # noqa: E402
from sharded_models import build, full_matrix, shard  # noqa: E402
from tiny_models import WeightRecorder, token_loader  # noqa: E402

from spectral_callbacks import SpectralMonitor  # noqa: E402

EVERY_N_STEPS = 4
LOG_SPACED_UNTIL = 3  # snapshots at 0, 1, 2, every 4 steps and the last
K = 8


class ShardedGPT(LightningModule):
    """A small GPT, sharded in ``configure_model`` (after the monitor's ``setup``)."""

    def __init__(self, name: str, how: str, fail_rank: int | None, fail_step: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        if name == "lora":
            self.model, self.loss_of = updates.build("lora"), lambda model, x, y: model(x, y)
        else:
            self.model, self.loss_of = build(name, d=64)
        self.name, self.how, self.fail_rank, self.fail_step = name, how, fail_rank, fail_step

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel" if self.how == "fsdp" else "tensor_parallel"]
        (updates.shard if self.name == "lora" else shard)(self.model, self.how, mesh)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            raise RuntimeError(f"planned failure on rank {self.fail_rank} at step {self.fail_step}")
        return self.loss_of(self.model, *batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


class FullWeights(WeightRecorder):
    """Gathers the watched matrices at the monitor's points; rank 0 saves them at the end."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def copy(self, target: Any) -> torch.Tensor:
        # Every rank: full_tensor() is a collective. An adapted target: W_0 + s B A, float64.
        return updates.effective(target)["weight"] if target.has_update else full_matrix(target)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(self.weights, self.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--suffix", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share a small machine
    how = "tp" if args.tp else "fsdp"
    monitor = SpectralMonitor(
        every_n_steps=EVERY_N_STEPS,
        log_spaced_until=LOG_SPACED_UNTIL,
        figures=False,
        k=K,
        max_pending=8,  # never a skip under load: the tests check every scheduled step
        drain_timeout=20.0,
    )
    strategy = ModelParallelStrategy(
        data_parallel_size=1 if args.tp else 2, tensor_parallel_size=2 if args.tp else 1
    )
    callbacks: list[Callback] = [monitor, FullWeights(args.outdir / f"weights{args.suffix}.pt")]
    if args.checkpoint_every is not None:
        callbacks.append(
            ModelCheckpoint(
                args.outdir / "checkpoints",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                filename="{step}",
            )
        )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=TensorBoardLogger(args.outdir, name="tb", version=0),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.checkpoint_every is not None,
        log_every_n_steps=1,
    )
    name = "lora" if args.lora else "neox" if args.tp else "gpt2"
    model = ShardedGPT(name, how, args.fail_rank, args.fail_step)
    trainer.fit(model, token_loader(num_batches=4 * args.steps), ckpt_path=args.resume)
    if trainer.is_global_zero:  # what a checkpoint written by rank 0 would hold
        torch.save(monitor.state_dict(), args.outdir / f"monitor_state{args.suffix}.pt")


if __name__ == "__main__":
    main()
