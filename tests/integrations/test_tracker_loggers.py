"""W&B and MLflow through the loggers the tracker writes to: SpectralMonitor under Lightning logs
through the Trainer's loggers, where an ``MLFlowLogger`` (a local file store, read back with
``MlflowClient``) and an offline ``WandbLogger`` (read back with ``wandb leet inspect --json``) get
every scalar of the TensorBoard event files at the snapshot's step, 121 keys a snapshot for a
2-layer GPT, and nothing else of ours (figures and text entries are TensorBoard's only). ``SpectralTracker(writers=[...])`` in a plain loop
takes the same loggers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import TinyGPT, quiet_trainer, read_scalars, token_loader

from spectral_callbacks import SpectralMonitor, SpectralTracker
from spectral_callbacks.names import scalar_tag

Q0 = scalar_tag("stable_rank", 0, "Q")
STEPS = [0, 1, 2, 5, 10, 12]  # every_n_steps=5, log_spaced_until=3, the last step


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow and W&B without a server, telemetry or network (both skipped where not installed)."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e .[dev]")
    pytest.importorskip("wandb", reason="wandb is not installed: pip install -e .[dev]")
    for name, value in dict(
        MLFLOW_ALLOW_FILE_STORE="true",  # MLflow 3 asks for a database
        MLFLOW_DISABLE_TELEMETRY="true",
        DO_NOT_TRACK="true",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DISABLE_GIT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_CONSOLE="off",
    ).items():
        monkeypatch.setenv(name, value)


def wandb_history(save_dir: Path) -> list[dict]:
    """The history rows of the one offline W&B run under ``save_dir``, as W&B's CLI reads them."""
    (run_dir,) = (save_dir / "wandb").glob("offline-run-*")
    records = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    return [json.loads(line)["history"]["item"] for line in records if '"type":"history"' in line]


def test_lightning_mlflow_and_wandb_loggers_get_every_scalar_at_the_snapshot_step(
    tmp_path: Path, offline: None
) -> None:
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    loggers = [
        TensorBoardLogger(tmp_path / "tb", name="", version=""),
        MLFlowLogger(experiment_name="spectral", tracking_uri=store),
        WandbLogger(project="spectral", save_dir=str(tmp_path), offline=True),
    ]
    # max_pending: no scheduled step skipped on a loaded machine (the steps are compared).
    monitor = SpectralMonitor(
        every_n_steps=5, log_spaced_until=3, k=8, figures=False, max_pending=16
    )
    quiet_trainer(max_steps=12, callbacks=[monitor], logger=loggers).fit(TinyGPT(), token_loader())
    wandb.finish()

    logged = read_scalars(tmp_path / "tb")
    spectral = {tag for tag in logged if tag.startswith("spectral_")}
    client = MlflowClient(tracking_uri=store)
    run_id = loggers[1].run_id
    assert spectral <= set(client.get_run(run_id).data.metrics)
    history = client.get_metric_history(run_id, Q0)
    assert [point.step for point in history] == STEPS == sorted(logged[Q0])
    for point in history:
        assert point.value == pytest.approx(logged[Q0][point.step], rel=1e-6)
    # One snapshot: 2 layers x 6 roles x 6 metrics, the 6 x 6 means over layers, 7 health
    # scalars and 6 alert counts, the same in MLflow as in the event file.
    at_5 = {tag for tag in spectral if 5 in logged[tag]}
    assert len(at_5) == 2 * 6 * 6 + 6 * 6 + 7 + 6 == 121
    assert at_5 == {
        key
        for key in client.get_run(run_id).data.metrics
        if any(point.step == 5 for point in client.get_metric_history(run_id, key))
    }

    rows = wandb_history(tmp_path)
    assert spectral <= {key for row in rows for key in row}  # WandbLogger keeps the names
    q0 = {row["trainer/global_step"]: row[Q0] for row in rows if Q0 in row}
    assert sorted(q0) == STEPS
    for step, value in q0.items():
        assert value == pytest.approx(logged[Q0][step], rel=1e-6)
    # Exactly the scalars of the event files: log_metrics is all these loggers are given.
    assert {key for row in rows for key in row if key.startswith("spectral")} == spectral
    assert {key for key in client.get_run(run_id).data.metrics if "spectral" in key} == spectral


def test_a_plain_loop_hands_the_tracker_the_same_loggers(tmp_path: Path, offline: None) -> None:
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    store = f"file:{tmp_path / 'mlruns'}"
    mlflow_logger = MLFlowLogger(experiment_name="loop", tracking_uri=store)
    model = TinyGPT().model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = iter(token_loader())
    tracker = SpectralTracker(
        model, logdir=tmp_path / "tb", writers=[mlflow_logger], k=8, figures=False, max_pending=8
    )
    with tracker:
        for step in range(1, 5):
            x, y = next(batches)
            _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
    logged = read_scalars(tmp_path / "tb")
    history = MlflowClient(tracking_uri=store).get_metric_history(mlflow_logger.run_id, Q0)
    assert [point.step for point in history] == [0, 1, 2, 4] == sorted(logged[Q0])
    for point in history:
        assert point.value == pytest.approx(logged[Q0][point.step], rel=1e-6)


def test_keys_per_snapshot_of_gpt2_small_shape() -> None:
    # docs/callback.md: 12 layers x 6 roles x 6 metrics + 6 x 6 means + 7 health + 6 alert counts
    # per snapshot, and the first also one reference_step per matrix (72). Width does not count.
    from transformers import GPT2Config, GPT2LMHeadModel

    class Recording:
        def __init__(self) -> None:
            self.keys: list[set[str]] = []

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.keys.append(set(metrics))

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=48, n_layer=12))
    recording = Recording()
    with SpectralTracker(
        model,
        writers=[recording],
        k=8,
        figures=False,
        synchronous=True,
        roles_from_first_forward=False,
    ) as tracker:
        tracker.step(1)
        tracker.step(2)
    snapshots = [len(keys) for keys in recording.keys if Q0 in keys]
    assert snapshots == [553, 481, 481]
    assert 12 * 6 * 6 + 6 * 6 + 7 + 6 == 481 and 481 + 12 * 6 == 553
