"""One model, one data stream, one seed through every frontend: the same scalars at the same steps.

Plain loop (``SpectralTracker``), Lightning Fabric (``SpectralTracker`` with ``fabric.loggers``),
``lightning.pytorch`` and ``pytorch_lightning`` (``SpectralMonitor``) and the Hugging Face Trainer
(``SpectralTrainerCallback``) train the same tiny GPT with the same AdamW on the same batches, in
order. ``svd_method="gram"`` is exact and deterministic, so every frontend must log the same
values (to 1e-6), and they must match a float64 SVD of the weights at each scheduled step.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gpt import GPT, GPTConfig
from tensorboard.backend.event_processing import event_accumulator
from tiny_models import QUIET_TRAINER, RecordingLogger, exact_stable_rank, read_scalars
from torch import nn

from spectral_callbacks import SpectralMonitor, SpectralTracker
from spectral_callbacks.names import MONITOR_SECTION, parse_tag, scalar_tag
from spectral_callbacks.targets import find_targets

STEPS, BATCH, BLOCK, LR = 12, 4, 16, 1e-2
SCHEDULED = [0, 1, 2, 5, 10, 12]  # every 5, powers of two below 3, and the last step
OPTIONS: dict[str, Any] = dict(
    metrics=("stable_rank", "alpha", "spectral_norm", "frobenius_norm", "compression"),
    svd_method="gram",
    k=8,
    every_n_steps=5,
    log_spaced_until=3,
    figures=False,
    # Room for every scheduled step, so which steps are logged cannot depend on the worker's speed
    # on a loaded machine (with the default of 2, step 2 was once skipped while 0 and 1 ran).
    max_pending=16,
)


class TinyLM(nn.Module):
    """examples/gpt.py's GPT with the Hugging Face calling convention (``input_ids``, ``labels``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, loss = self.gpt(input_ids, labels)
        return {"loss": loss, "logits": logits}


_INITIAL: dict[str, TinyLM] = {}


def fresh_model() -> TinyLM:
    """The same initial weights every time."""
    if "model" not in _INITIAL:
        torch.manual_seed(0)
        _INITIAL["model"] = TinyLM()
    return copy.deepcopy(_INITIAL["model"])


def samples() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (STEPS * BATCH, BLOCK + 1), generator=generator)
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in tokens]


class InOrder(torch.utils.data.IterableDataset):
    """The samples in order, for the Hugging Face Trainer: it batches an iterable dataset as it
    comes, where a map-style one is shuffled (in every release; ``train_sampling_strategy``, which
    can turn that off, is in neither 4.x nor 5.0)."""

    def __iter__(self):
        return iter(samples())


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(samples(), batch_size=BATCH, shuffle=False)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def spectral(records: list[tuple[int | None, dict[str, float]]]) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of the per-layer and mean spectral scalars (not the health ones)."""
    return {
        (tag, int(step)): value
        for step, metrics in records
        for tag, value in metrics.items()
        if parse_tag(tag) is not None and step is not None
    }


def from_events(logdir: Path) -> dict[tuple[str, int], float]:
    return spectral(
        [
            (step, {tag: value})
            for tag, series in read_scalars(logdir).items()
            for step, value in series.items()
        ]
    )


def weights_of(model: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    return {(t.layer, t.role): t.matrix().detach().double().clone() for t in find_targets(model)}


# --- the frontends ------------------------------------------------------------------------------


def plain_loop() -> tuple[dict, dict[int, dict]]:
    model, writer = fresh_model(), RecordingLogger()
    optimizer = adamw(model)
    weights = {0: weights_of(model)}
    with SpectralTracker(model, writers=[writer], **OPTIONS) as tracker:
        for step, batch in enumerate(loader(), start=1):
            model(**batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
            weights[step] = weights_of(model)
    return spectral(writer.records), weights


def fabric_loop(root: Path) -> dict:
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import TensorBoardLogger

    fabric = Fabric(
        accelerator="cpu", devices=1, loggers=TensorBoardLogger(root, name="fabric", version="")
    )
    model = fresh_model()
    model, optimizer = fabric.setup(model, adamw(model))
    tracker = SpectralTracker(model, writers=fabric.loggers, **OPTIONS)
    for step, batch in enumerate(loader(), start=1):
        fabric.backward(model(**batch)["loss"])
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    return from_events(root / "fabric")


def lightning_module(package: Any) -> Any:
    """A LightningModule of ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)."""

    class Lit(package.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = fresh_model()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.lm(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self)

    return Lit()


def trainer_options() -> dict[str, Any]:
    return dict(QUIET_TRAINER, max_steps=STEPS)


def lightning_fit() -> dict:
    import lightning.pytorch as lp

    logger = RecordingLogger()
    trainer = lp.Trainer(logger=logger, callbacks=[SpectralMonitor(**OPTIONS)], **trainer_options())
    trainer.fit(lightning_module(lp), loader())
    return spectral(logger.records)


def pytorch_lightning_fit(root: Path) -> dict:
    import pytorch_lightning as pl

    import spectral_callbacks.pl

    logger = pl.loggers.TensorBoardLogger(root, name="pl", version="")
    callback = spectral_callbacks.pl.SpectralMonitor(**OPTIONS)
    trainer = pl.Trainer(logger=logger, callbacks=[callback], **trainer_options())
    trainer.fit(lightning_module(pl), loader())
    return from_events(root / "pl")


def hf_train(root: Path) -> dict:
    from transformers import Trainer, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    args = TrainingArguments(
        output_dir=str(root / "hf_out"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        max_grad_norm=0.0,  # no clipping: Lightning and the plain loop do not clip either
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    callback = SpectralTrainerCallback(logdir=root / "hf", **OPTIONS)
    Trainer(model=fresh_model(), args=args, train_dataset=InOrder(), callbacks=[callback]).train()
    return from_events(root / "hf")


# --- the tests ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_frontend_logs_the_same_scalars_at_the_same_steps_as_exact_svd(
    tmp_path: Path,
) -> None:
    reference, weights = plain_loop()
    runs = {
        "fabric": fabric_loop(tmp_path),
        "lightning.pytorch": lightning_fit(),
        "pytorch_lightning": pytorch_lightning_fit(tmp_path),
        "hf.Trainer": hf_train(tmp_path),
    }
    tag = scalar_tag("stable_rank", 1, "MLP_down")
    assert sorted(step for t, step in reference if t == tag) == SCHEDULED
    for name, logged in runs.items():
        assert logged.keys() == reference.keys(), name
        for key, value in reference.items():
            assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-6), (name, key)
    for (tag, step), value in reference.items():
        parsed = parse_tag(tag)
        assert parsed is not None
        if parsed.metric == "stable_rank" and parsed.layer is not None:
            expected = exact_stable_rank(weights[step][(parsed.layer, parsed.role)])
            assert value == pytest.approx(expected, rel=0.01), (tag, step)
    # and the values moved: a test of a constant would not tell the frontends apart
    assert reference[(tag, 12)] != pytest.approx(reference[(tag, 0)], rel=1e-3)


def test_pytorch_lightning_trainer_fits_and_logs(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    import spectral_callbacks.pl

    logger = pl.loggers.TensorBoardLogger(tmp_path, name="pl", version="")
    options = dict(trainer_options(), max_steps=4)
    # max_pending covers every scheduled step (0, 1, 2, 4): with the default 2, a loaded machine
    # can still be decomposing steps 0 and 1 when step 2 is due, and skip it (by design, counted).
    monitor = spectral_callbacks.pl.SpectralMonitor(max_pending=8)
    trainer = pl.Trainer(logger=logger, callbacks=[monitor], **options)
    trainer.fit(lightning_module(pl), loader())
    logged = from_events(tmp_path / "pl")
    assert sorted(step for tag, step in logged if tag == scalar_tag("alpha", 0, "Q")) == [
        0,
        1,
        2,
        4,
    ]
    reader = event_accumulator.EventAccumulator(str(tmp_path / "pl"))
    reader.Reload()
    assert f"{MONITOR_SECTION}/num_layers" in reader.Tags()["scalars"]


def test_each_lightning_class_is_a_callback_of_its_own_package_and_pickles() -> None:
    import lightning.pytorch as lp
    import pytorch_lightning as pl

    import spectral_callbacks.pl

    assert isinstance(SpectralMonitor(), lp.Callback) and not isinstance(
        SpectralMonitor(), pl.Callback
    )
    other = spectral_callbacks.pl.SpectralMonitor(every_n_steps=7)
    assert isinstance(other, pl.Callback) and not isinstance(other, lp.Callback)
    assert pickle.loads(pickle.dumps(other)).options.every_n_steps == 7
    assert type(pickle.loads(pickle.dumps(SpectralMonitor()))) is SpectralMonitor


def test_the_core_imports_no_framework_and_each_frontend_only_its_own() -> None:
    # (`lightning.pytorch` itself imports transformers when it is installed, through torchmetrics'
    # BERTScore, and transformers imports peft when that is installed, so only the core can
    # promise it; SpectralMonitor needs Lightning anyway.)
    code = (
        "import sys, spectral_callbacks; spectral_callbacks.SpectralTracker; "
        "found = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'peft') "
        "if m in sys.modules]; "
        "assert not found, found; "
        "import spectral_callbacks.pl; assert 'lightning' not in sys.modules, 'lightning'; "
        "import spectral_callbacks.hf; assert 'transformers' in sys.modules"
    )
    finished = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
