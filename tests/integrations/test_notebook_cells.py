"""A notebook's cells in one process (docs/callback.md, Jupyter): a Lightning fit, the same cell
run again, a fit interrupted as the kernel's interrupt does (SIGINT to the process while the cell
runs), the cell again. Each fit starts afresh, logs every scheduled step into its own version, and
an interrupted one keeps what it logged.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import TensorBoardLogger
from tiny_models import TinyGPT, quiet_trainer, read_scalars, token_loader

from spectral_callbacks import SpectralMonitor
from spectral_callbacks.names import scalar_tag

Q0 = scalar_tag("stable_rank", 0, "Q")


class InterruptedGPT(TinyGPT):
    """Jupyter's "interrupt the kernel": SIGINT to the kernel process during a training step."""

    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return super().training_step(batch, batch_idx)


def fit_cell(root: Path, monitor: SpectralMonitor, interrupt_at_step: int | None = None) -> Path:
    """One run of the cell: a new logger and Trainer, the given callback; the run's directory."""
    logger = TensorBoardLogger(root, name="nb")
    trainer = quiet_trainer(max_steps=12, callbacks=[monitor], logger=logger)
    model = TinyGPT() if interrupt_at_step is None else InterruptedGPT(interrupt_at_step)
    trainer.fit(model, token_loader())
    return Path(logger.log_dir)


def test_rerun_and_interrupted_fit_cells_each_start_afresh(tmp_path: Path) -> None:
    # max_pending: no scheduled step skipped on a loaded machine (the steps are compared)
    monitor = SpectralMonitor(
        every_n_steps=5, log_spaced_until=3, k=8, figures=False, max_pending=16
    )
    first = fit_cell(tmp_path, monitor)
    again = fit_cell(tmp_path, monitor)  # the same cell run again, the same callback object
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
            fit_cell(tmp_path, monitor, interrupt_at_step=7)
        # Lightning's shutdown leaves the process's SIGINT handler as it was: the next works
        assert signal.getsignal(signal.SIGINT) is previous
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupted = tmp_path / "nb" / "version_2"
    after = fit_cell(tmp_path, monitor)
    assert [run.name for run in (first, again, after)] == ["version_0", "version_1", "version_3"]
    for run in (first, again, after):
        assert sorted(read_scalars(run)[Q0]) == [0, 1, 2, 5, 10, 12]
    assert sorted(read_scalars(interrupted)[Q0]) == [0, 1, 2, 5]
    # a new compression reference each fit: step 0 of each run compresses nothing
    for run in (first, again, after):
        assert read_scalars(run)[scalar_tag("compression", 0, "Q")][0] == pytest.approx(0.0)
