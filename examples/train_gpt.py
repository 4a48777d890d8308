"""Train the example GPT with Lightning, watched by ``SpectralMonitor``, logged to TensorBoard.

The D8/D12/D16 family of the reference experiments (arXiv:2604.22778) is ``--depth 8/12/16`` at
``--width 768``; any attention variant of ``attention.py`` and either initialization can be chosen.
Text: the Python standard library's own source, byte-level (nothing to download), or ``--text``.

    python examples/train_gpt.py --depth 8 --width 768 --steps 10000 --logdir runs
    python examples/train_gpt.py --depth 8 --width 256 --attention mla --steps 2000 --accelerator cpu
    tensorboard --logdir runs

Logged: ``train/loss``, ``train/tokens`` (tokens seen after the step), ``train/lr``, and the
callback's ``spectral_*`` scalars and figures. ``main(argv)`` returns the run's log directory, so
scripts and tests run it in-process.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path

import lightning as L
import torch
from attention import ATTENTION_CLASSES
from data import RandomWindows, load_bytes
from gpt import GPT, INITS, GPTConfig
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from spectral_callbacks import SpectralMonitor
from spectral_callbacks.monitor.options import DEFAULT_METRICS


class GPTModule(L.LightningModule):
    """The GPT as a LightningModule: next-byte cross-entropy, AdamW, linear warmup then cosine decay.

    Args:
        config: the model's shape (a ``GPTConfig`` or its fields as a dict).
        lr: peak learning rate (default 6e-4, nanoGPT's GPT-2 small).
        max_steps: length of the cosine schedule, normally the Trainer's ``max_steps`` (default 1000).
        warmup_steps: linear warmup from 0 (default 100).
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio`` (default 0.1, as nanoGPT).
        weight_decay: AdamW decay on matrices only, not on norms (default 0.1).
    """

    def __init__(
        self,
        config: GPTConfig | dict,
        lr: float = 6e-4,
        max_steps: int = 1000,
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        config = GPTConfig(**config) if isinstance(config, dict) else config
        # Plain values only, so `load_from_checkpoint` (and `spectral-callbacks analyze
        # last.ckpt --arch train_gpt:GPTModule`) rebuilds the module from the checkpoint.
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "max_steps": max_steps,
                "warmup_steps": warmup_steps,
                "min_lr_ratio": min_lr_ratio,
                "weight_decay": weight_decay,
            }
        )
        self.model = GPT(config)
        self.lr, self.max_steps, self.warmup_steps = lr, max_steps, warmup_steps
        self.min_lr_ratio, self.weight_decay = min_lr_ratio, weight_decay

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        tokens = (
            (self.global_step + 1) * x.numel() * self.trainer.world_size
        )  # seen after this step
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", float(tokens))
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])  # the lr this step used
        return loss

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at ``step``: linear warmup, then cosine down to ``min_lr_ratio``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    def configure_optimizers(self):  # -> OptimizerLRSchedulerConfig
        matrices = [p for p in self.model.parameters() if p.ndim >= 2]
        vectors = [p for p in self.model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": self.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),  # GPT-3's: a shorter second-moment memory, steadier at high lr
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--depth", type=int, default=8, help="layers: 8, 12, 16 are the reference D8/D12/D16"
    )
    model.add_argument("--width", type=int, default=768, help="n_embd")
    model.add_argument(
        "--heads", type=int, default=None, help="attention heads (default width // 64, at least 1)"
    )
    model.add_argument(
        "--kv-heads", type=int, default=None, help="K/V heads of gqa/gta (default heads // 2)"
    )
    model.add_argument("--attention", choices=sorted(ATTENTION_CLASSES), default="mha")
    model.add_argument(
        "--init",
        choices=INITS,
        default="gpt",
        help="gpt: N(0,0.02), residual outputs /sqrt(2L); zero_out: residual outputs zero; normal: N(0,0.02) everywhere",
    )
    model.add_argument("--block-size", type=int, default=256, help="context length in bytes")
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    train.add_argument("--tokens-per-step", type=int, default=16384, help="batch size x block size")
    train.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    train.add_argument(
        "--warmup-steps", type=int, default=None, help="default: 5%% of --steps, at most 200"
    )
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument(
        "--text", type=Path, default=None, help="train on this text file (default: Python's stdlib)"
    )
    train.add_argument(
        "--max-bytes", type=int, default=None, help="use only the first bytes of the text"
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--accelerator", default="auto", help="cpu, gpu, auto")
    train.add_argument("--precision", default="32-true", help="e.g. bf16-mixed on a GPU")
    train.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    logging = parser.add_argument_group("logging")
    logging.add_argument("--logdir", type=Path, default=Path("runs"), help="TensorBoard save_dir")
    logging.add_argument(
        "--name", default=None, help="run name (default d<depth>-<attention>-<init>)"
    )
    logging.add_argument(
        "--version", default=None, help="run version folder (default version_N, next free)"
    )
    logging.add_argument(
        "--log-every-n-steps",
        type=int,
        default=1,
        help="loss logging interval (every step: differences of runs are not aliased)",
    )
    logging.add_argument(
        "--every-n-steps", type=int, default=25, help="SpectralMonitor snapshot interval"
    )
    logging.add_argument(
        "--checkpoint",
        action="store_true",
        help="save a checkpoint in <run>/checkpoints at the end",
    )
    logging.add_argument("--no-spectral", action="store_true", help="train without SpectralMonitor")
    logging.add_argument(
        "--esd",
        action="store_true",
        help="also log the ESD family (esd_alpha: WeightWatcher's power-law fit of the full "
        "spectrum) on every 10th snapshot, for `spectral-callbacks rank-layers RUN`",
    )
    logging.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar"
    )
    return parser


def check_args(args: argparse.Namespace) -> GPTConfig:
    """The model config of ``args``; bad flags raise ``MisconfigurationException`` naming the flag."""
    for flag in (
        "depth",
        "width",
        "steps",
        "tokens_per_step",
        "block_size",
        "every_n_steps",
        "log_every_n_steps",
    ):
        value = getattr(args, flag)
        if value < 1:
            raise MisconfigurationException(
                f"`--{flag.replace('_', '-')}` must be a positive int, got {value}"
            )
    if args.tokens_per_step % args.block_size:
        raise MisconfigurationException(
            f"`--tokens-per-step` ({args.tokens_per_step}) must be a multiple of `--block-size` "
            f"({args.block_size}): it is batch size x block size"
        )
    heads = args.heads or max(1, args.width // 64)
    try:
        return GPTConfig(
            block_size=args.block_size,
            n_layer=args.depth,
            n_head=heads,
            n_embd=args.width,
            attention=args.attention,
            n_kv_head=args.kv_heads,
            init=args.init,
        )
    except ValueError as error:
        raise MisconfigurationException(
            f"{error} (flags --width, --heads, --kv-heads, --attention)"
        ) from None


def main(argv: list[str] | None = None) -> Path:
    """Train one run as the flags say; return its log directory."""
    args = build_parser().parse_args(argv)
    config = check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, verbose=False)
    data = load_bytes(args.text, args.max_bytes)
    batch_size = args.tokens_per_step // args.block_size
    loader = DataLoader(RandomWindows(data, args.block_size, seed=args.seed), batch_size=batch_size)
    warmup = (
        args.warmup_steps if args.warmup_steps is not None else min(200, max(1, args.steps // 20))
    )
    module = GPTModule(
        config,
        lr=args.lr,
        max_steps=args.steps,
        warmup_steps=warmup,
        weight_decay=args.weight_decay,
    )
    name = args.name or f"d{args.depth}-{args.attention}-{args.init}"
    logger = TensorBoardLogger(
        args.logdir, name=name, version=args.version, default_hp_metric=False
    )
    metrics = (*DEFAULT_METRICS, "esd_alpha") if args.esd else DEFAULT_METRICS
    callbacks = (
        [] if args.no_spectral else [SpectralMonitor(metrics, every_n_steps=args.every_n_steps)]
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        # The stream of windows is endless, so the run is one epoch that max_steps ends; left
        # unset, max_epochs becomes -1 and the progress bar reads "Epoch 0/-2".
        max_epochs=1,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=args.checkpoint,
        enable_progress_bar=args.progress,
        enable_model_summary=args.progress,
    )
    trainer.fit(module, train_dataloaders=loader)
    return Path(logger.log_dir)


if __name__ == "__main__":
    log_dir = main(sys.argv[1:])
    print(f"run logged to {log_dir}\nwatch it with:  tensorboard --logdir {log_dir.parent}")
