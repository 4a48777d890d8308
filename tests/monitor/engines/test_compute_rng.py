"""Observing must not change the run: the compute draws from its own generators, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from gpt import GPT, GPTConfig
from lightning.pytorch import Callback, seed_everything
from tiny_models import RecordingLogger, TinyGPT, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.snapshot import ShapeGroup


def _dropout_gpt() -> TinyGPT:
    module = TinyGPT()
    module.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.1))
    return module


def _shuffled_loader() -> DataLoader:
    tokens = torch.randint(0, 256, (64, 17))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, shuffle=True)


def _train(callbacks: list[Callback], max_steps: int = 40, **fit: Any) -> dict[str, torch.Tensor]:
    seed_everything(0, verbose=False)
    model, loader = _dropout_gpt(), _shuffled_loader()
    trainer = quiet_trainer(max_steps=max_steps, logger=RecordingLogger(), callbacks=callbacks)
    trainer.fit(model, loader, **fit)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _randomized_monitor(**kwargs: Any) -> SpectralMonitor:
    # Width 32 would choose the exact Gram path, which draws nothing: force the randomized one.
    return SpectralMonitor(
        svd_method="randomized", every_n_steps=5, figures=False, max_pending=8, **kwargs
    )


def test_weights_are_bit_identical_with_and_without_the_monitor() -> None:
    without = _train([])
    monitor = _randomized_monitor()
    observed = _train([monitor])
    # The monitor did draw: its generator moved off its seed.
    fresh = torch.Generator().manual_seed(0).get_state()
    assert not torch.equal(monitor.tracker.compute.state_dict()["generators"]["cpu"], fresh)
    assert without.keys() == observed.keys()
    for name in without:
        assert torch.equal(without[name], observed[name]), name


def test_a_restored_compute_continues_the_same_random_stream() -> None:
    batch = torch.randn(3, 48, 40, generator=torch.Generator().manual_seed(1))
    group = ShapeGroup("48x40/float32/cpu", ())
    first = SpectrumCompute(k=4, method="randomized", warm_start=False, seed=7)
    first(group, batch)
    state = first.state_dict()
    expected = first(group, batch)["spectral_norm"]
    resumed = SpectrumCompute(k=4, method="randomized", warm_start=False)
    resumed.load_state_dict(state)
    assert resumed.seed == 7
    assert torch.equal(resumed(group, batch)["spectral_norm"], expected)
    # A different stream gives different (if close) values: the comparison above can fail.
    other = SpectrumCompute(k=4, method="randomized", warm_start=False, seed=8)
    assert not torch.equal(other(group, batch)["spectral_norm"], expected)


class _GeneratorAtStart(Callback):
    """Reads the monitor's compute state when training starts (after a checkpoint is restored)."""

    def __init__(self, monitor: SpectralMonitor) -> None:
        self.monitor = monitor
        self.state: dict[str, Any] | None = None

    def on_train_start(self, *args: Any) -> None:
        self.state = self.monitor.tracker.compute.state_dict()


def test_a_resumed_fit_continues_the_compute_generator_from_the_checkpoint(tmp_path: Path) -> None:
    first = _randomized_monitor()
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(max_steps=12, logger=RecordingLogger(), callbacks=[first])
    trainer.fit(_dropout_gpt(), _shuffled_loader())
    checkpoint = tmp_path / "step12.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["callbacks"][first.state_key]["compute"]
    assert torch.equal(
        saved["generators"]["cpu"], first.tracker.compute.state_dict()["generators"]["cpu"]
    )

    second = _randomized_monitor()
    at_start = _GeneratorAtStart(second)
    _train([second, at_start], max_steps=24, ckpt_path=str(checkpoint))
    assert at_start.state is not None
    assert torch.equal(at_start.state["generators"]["cpu"], saved["generators"]["cpu"])
    # ... and it went on drawing from there.
    assert not torch.equal(
        second.tracker.compute.state_dict()["generators"]["cpu"], saved["generators"]["cpu"]
    )
