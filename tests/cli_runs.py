"""Event files for the command-line tests: real short training runs, a long run, a subprocess runner.

The training runs are made once per test session (``training_runs``) and shared by the
test_cli_*.py modules: a tiny transformer trained for 30 steps with ``SpectralMonitor`` and two
loggers, TensorBoard (what the CLI reads) and CSV (an independent record of what was logged).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pandas as pd
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from spectral_callbacks import SpectralMonitor
from spectral_callbacks.names import scalar_tag

NUM_LAYERS = 3
STEPS = 30
BATCH, SEQ, WIDTH = 8, 8, 32
_RUNS: dict[str, Path] = {}

# Parse a CSV's floats exactly as written: pandas 2's default parser can be one float32 step off,
# pandas 3's is exact and deprecates the option.
EXACT_FLOATS = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}


class TinyTransformer(L.LightningModule):
    """A 3-layer encoder learning to reverse its input features; logs loss and tokens seen."""

    def __init__(self, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=64, batch_first=True)
        self.net = nn.TransformerEncoder(layer, NUM_LAYERS, enable_nested_tensor=False)
        for module in self.net.modules():  # the encoder deep-copies one layer: make them differ
            if isinstance(module, nn.Linear):
                module.reset_parameters()
            elif isinstance(module, nn.MultiheadAttention):  # as its own initialization does
                nn.init.xavier_uniform_(module.in_proj_weight)
                nn.init.zeros_(module.in_proj_bias)
                nn.init.zeros_(module.out_proj.bias)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        (x,) = batch
        loss = (self.net(x) - x.flip(-1)).pow(2).mean()
        self.log("train/loss", loss)
        self.log("train/tokens", float((self.global_step + 1) * BATCH * SEQ))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def train(root: Path, name: str, *, lr: float, seed: int, figures: bool = True) -> Path:
    """Train one run; TensorBoard files in ``root/tb/<name>``, the CSV record in ``root/csv/<name>``.

    With ``figures`` the event file also holds the callback's images (drawn once, at the end), which
    the reader must step over.
    """
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, SEQ, WIDTH))
    loggers = [
        TensorBoardLogger(root / "tb", name=name, version=""),
        CSVLogger(root / "csv", name=name, version=""),
    ]
    trainer = L.Trainer(
        max_steps=STEPS,
        logger=loggers,
        # Room for every snapshot: tests count the logged points, which a skip under load would
        # change.
        callbacks=[
            SpectralMonitor(
                every_n_steps=5, figure_every_n_steps=None, figures=figures, max_pending=STEPS
            )
        ],
        accelerator="cpu",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(
        TinyTransformer(lr=lr, seed=seed), torch.utils.data.DataLoader(data, batch_size=BATCH)
    )
    return root / "tb" / name


def training_runs(factory: object) -> Path:
    """Two real runs (``a`` and ``b``, different learning rates and inits) under ``<root>/tb``,
    trained once per session; ``factory`` is pytest's ``tmp_path_factory``."""
    if "root" not in _RUNS:
        root = factory.mktemp("training_runs")  # type: ignore[attr-defined]
        train(root, "a", lr=3e-3, seed=0)
        train(root, "b", lr=1e-3, seed=1, figures=False)
        _RUNS["root"] = root
    return _RUNS["root"]


def logged_by_csv(root: Path, name: str) -> pd.DataFrame:
    """What the CSV logger recorded for run ``name``: columns tag, step, value."""
    wide = pd.read_csv(root / "csv" / name / "metrics.csv", **EXACT_FLOATS)
    long = wide.melt(id_vars=["step"], var_name="tag", value_name="value").dropna()
    return long[["tag", "step", "value"]].astype({"step": "int64"}).reset_index(drop=True)


def write_long_run(logdir: Path, points: int = 10_500) -> str:
    """One spectral tag with more points than TensorBoard's default reservoir keeps (10,000)."""
    tag = scalar_tag("stable_rank", 0, "Q")
    with SummaryWriter(str(logdir)) as writer:
        for step in range(points):
            writer.add_scalar(tag, 100.0 - step / 1000, step)
    return tag


def run_cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``spectral-callbacks ARGS`` as a user runs it, in a fresh interpreter."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "spectral_callbacks.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )
    done.stderr = TORCHAO_NOTICE.sub("", done.stderr)
    return done


# torchao (installed for the training stacks' tests) logs this line when it is imported on a torch
# it was not built for, and transformers imports it whenever it loads a model: not ours to print.
TORCHAO_NOTICE = re.compile(
    r"^Skipping import of cpp extensions due to incompatible torch .*\n?", re.M
)
