"""The randomized SVD's stopping rule along real training runs, against float64 exact SVD.

A small GPT (width 256, so the randomized path runs; forced with ``svd_method="randomized"``) is
trained with ``SpectralMonitor`` on its default warm starts; the weights are recorded at every
scheduled step and every logged ``stable_rank`` and ``alpha`` is compared with float64
``torch.linalg.svdvals`` of those weights: stable rank within 1 %, alpha within 0.02 (docs/metrics.md,
One matrix: accuracy and speed). One run has a deliberate loss spike: the learning rate jumps 30x mid-run, so the top
subspace rotates between two snapshots and a warm start faces real movement.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from tiny_models import RecordingLogger, TinyGPT, WeightRecorder, quiet_trainer, token_loader

from spectral_callbacks.functional import powerlaw_alpha
from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import find_targets

K = 32


class LearningRateJump(Callback):
    """Multiplies every learning rate by ``factor`` once, before optimizer step ``at_step``."""

    def __init__(self, at_step: int, factor: float) -> None:
        self.at_step, self.factor = at_step, factor

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any
    ) -> None:
        if trainer.global_step == self.at_step:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.factor


def _exact(matrix: torch.Tensor) -> tuple[float, float]:
    singular = torch.linalg.svdvals(matrix.double())
    stable_rank = float((singular**2).sum() / singular[0] ** 2)
    return stable_rank, float(powerlaw_alpha(singular[:K])[0])


@pytest.mark.parametrize("lr_jump", [None, 30.0], ids=["steady", "loss_spike"])
def test_every_scheduled_step_and_matrix_matches_float64_svd(lr_jump: float | None) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_embd=256, n_head=4, block_size=16, lr=2e-3)
    logger, recorder = RecordingLogger(), WeightRecorder()
    monitor = SpectralMonitor(
        metrics=("stable_rank", "alpha"),
        every_n_steps=3,
        log_spaced_until=0,
        svd_method="randomized",
        figures=False,
        synchronous=True,  # every scheduled step is computed, in order, each warm from the last
    )
    callbacks: list[Callback] = [monitor, recorder]
    if lr_jump is not None:
        callbacks.append(LearningRateJump(at_step=12, factor=lr_jump))
    trainer = quiet_trainer(max_steps=24, logger=logger, callbacks=callbacks)
    trainer.fit(model, token_loader(num_batches=24, batch_size=8))

    checked = 0
    for target in find_targets(model):
        tags = {
            m: scalar_tag(m, target.layer, target.role, target.num_layers)
            for m in ("stable_rank", "alpha")
        }
        stable_ranks, alphas = logger.series(tags["stable_rank"]), logger.series(tags["alpha"])
        assert sorted(stable_ranks) == list(range(0, 25, 3)), target.name
        for step, value in stable_ranks.items():
            exact_sr, exact_alpha = _exact(recorder.weights[step][target.name])
            assert value == pytest.approx(exact_sr, rel=0.01), (target.name, step)
            assert alphas[step] == pytest.approx(exact_alpha, abs=0.02), (target.name, step)
            checked += 1
    assert checked == 12 * 9  # 2 layers x 6 roles, 9 scheduled steps
