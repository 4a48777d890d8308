"""A tiny nanoGPT LightningModule on random tokens, and helpers the callback tests share.

The model is ``examples/gpt.py``'s GPT (nanoGPT parameter names, fused ``c_attn``), wrapped so a
test can switch on manual optimization, two optimizers or a failure at a given step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from tensorboard.backend.event_processing import event_accumulator
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks.names import scalar_tag  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402


class TinyGPT(LightningModule):
    """A small GPT on random byte tokens; ``lr`` is high so the spectra move within a few steps."""

    def __init__(
        self,
        n_layer: int = 2,
        n_embd: int = 32,
        n_head: int = 2,
        block_size: int = 16,
        lr: float = 1e-2,
        manual: bool = False,
        two_optimizers: bool = False,
        fail_at_step: int | None = None,
        interrupt_at_step: int | None = None,
        init: str = "gpt",
    ) -> None:
        super().__init__()
        self.model = GPT(
            GPTConfig(
                n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, init=init
            )
        )
        self.lr = lr
        self.automatic_optimization = not manual
        self.two_optimizers = two_optimizers
        self.fail_at_step = fail_at_step
        self.interrupt_at_step = interrupt_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.fail_at_step is not None and self.global_step == self.fail_at_step:
            raise RuntimeError(f"planned failure at step {self.global_step}")
        if self.interrupt_at_step is not None and self.global_step == self.interrupt_at_step:
            raise KeyboardInterrupt
        x, y = batch
        _, loss = self.model(x, y)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:  # several optimizers: global_step advances once per step()
            optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        if not self.two_optimizers:
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        attention = [p for n, p in self.named_parameters() if ".attn." in n]
        rest = [p for n, p in self.named_parameters() if ".attn." not in n]
        return [torch.optim.AdamW(attention, lr=self.lr), torch.optim.AdamW(rest, lr=self.lr)]


def token_loader(
    num_batches: int = 64, batch_size: int = 4, block_size: int = 16, seed: int = 0
) -> DataLoader:
    """Random byte sequences (next-token targets shifted by one)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (num_batches * batch_size, block_size + 1), generator=generator)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


#: A CPU Trainer without progress bar, summary or checkpoints (either Lightning package).
QUIET_TRAINER: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    log_every_n_steps=1,
)


def quiet_trainer(**kwargs: Any) -> Trainer:
    """A CPU Trainer without progress bar, summary or checkpoints unless asked."""
    return Trainer(**{**QUIET_TRAINER, **kwargs})


def exact_stable_rank(matrix: torch.Tensor) -> float:
    """‖W‖_F² / σ₁² in float64 with a full SVD: the reference."""
    singular = torch.linalg.svdvals(matrix.double())
    return float((singular**2).sum() / singular[0] ** 2)


def exact_compute(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """An exact compute function for tests that do not test the SVD."""
    singular = torch.linalg.svdvals(batch.double())
    return {
        "stable_rank": (singular**2).sum(-1) / singular[..., 0] ** 2,
        "spectral_norm": singular[..., 0],
    }


class WeightRecorder(Callback):
    """Copies the watched matrices at the same points as SpectralMonitor (test-only)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self._previous = -1

    def _record(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if step != self._previous:
            self.weights[step] = {t.name: self.copy(t) for t in find_targets(pl_module)}
            self._previous = step

    def copy(self, target: Any) -> torch.Tensor:
        """A float64 copy of one watched matrix."""
        return target.matrix().detach().double().clone()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._record(trainer, pl_module)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def series(self, tag: str) -> dict[int, float]:
        return {step: metrics[tag] for step, metrics in self.records if tag in metrics}


def exact_spectrum(matrix: torch.Tensor) -> tuple[float, float]:
    """(stable rank, sigma_1) of ``matrix`` by a float64 SVD."""
    singular = torch.linalg.svdvals(matrix.double())
    return float((singular**2).sum() / singular[0] ** 2), float(singular[0])


def assert_logged_exactly(
    logger: RecordingLogger,
    targets: Any,
    expected: dict[int, dict[str, tuple[float, float]]],
    num_layers: int,
) -> None:
    """Every target's logged stable rank and sigma_1 at exactly the steps of ``expected``
    (step -> name -> :func:`exact_spectrum`), each equal to it to 1e-5."""
    for target in targets:
        stable = logger.series(scalar_tag("stable_rank", target.layer, target.role, num_layers))
        sigma = logger.series(scalar_tag("spectral_norm", target.layer, target.role, num_layers))
        assert sorted(stable) == sorted(sigma) == sorted(expected), target.name
        for step in stable:
            stable_rank, sigma_1 = expected[step][target.name]
            assert stable[step] == pytest.approx(stable_rank, rel=1e-5), (target.name, step)
            assert sigma[step] == pytest.approx(sigma_1, rel=1e-5), (target.name, step)


def read_scalars(logdir: Path | str) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``logdir``: tag -> step -> value (all points kept)."""
    return _read_all(logdir, event_accumulator.SCALARS, "scalars", lambda event: event.value)


def read_histograms(logdir: Path | str) -> dict[str, dict[int, Any]]:
    """Every histogram of the event files in ``logdir``: tag -> step -> ``HistogramValue``
    (``min``, ``max``, ``num``, ``sum``, ``sum_squares``, ``bucket_limit``, ``bucket``)."""
    return _read_all(
        logdir, event_accumulator.HISTOGRAMS, "histograms", lambda event: event.histogram_value
    )


def _read_all(logdir: Path | str, kind: str, tags: str, value: Any) -> dict[str, dict[int, Any]]:
    """Every event of ``kind`` in ``logdir`` (none dropped by TensorBoard's sampling)."""
    reader = event_accumulator.EventAccumulator(str(logdir), size_guidance={kind: 0})
    reader.Reload()
    items = reader.Scalars if kind == event_accumulator.SCALARS else reader.Histograms
    return {tag: {event.step: value(event) for event in items(tag)} for tag in reader.Tags()[tags]}
