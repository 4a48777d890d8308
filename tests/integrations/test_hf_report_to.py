"""The Hugging Face Trainer's ``report_to`` trackers get the spectra, read back offline with each
tracker's own reader: MLflow from a local file store (``MlflowClient.get_metric_history``), W&B
from an offline run (``wandb leet inspect --json``, its command for reading a run's log). Each
at the Trainer's steps, with the values of the TensorBoard event files, and no second copy in them.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hf_train import train
from tiny_models import read_scalars

from spectral_callbacks.names import scalar_tag

Q0 = scalar_tag("stable_rank", 0, "Q")
# Every scheduled step of a 12-step run with every_n_steps=5 (log_spaced_until=3: 1 and 2).
STEPS = [0, 1, 2, 5, 10, 12]
RUN = dict(steps=12, every_n_steps=5, attach=True, figures=False)


def spectral_scalars(output_dir: Path) -> dict[str, dict[int, float]]:
    """The scalars of the one run directory whose event files hold the spectra."""
    runs = {path.parent for path in output_dir.rglob("events.out.tfevents.*")}
    found = [read_scalars(run) for run in runs]
    spectral = [scalars for scalars in found if Q0 in scalars]
    assert len(spectral) == 1, runs
    return spectral[0]


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local MLflow file store in ``tmp_path`` and experiment ``spectral`` (no server, no network)."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e .[dev]")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database
    # Named, so MLflowCallback sets it in this store (not an experiment id cached by a test before).
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "spectral")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    # MLflowCallback logs asynchronously, and MLflow's queue writes batches on 10 threads: two
    # batches that create a metric's file in the file store at once lose one of them ("[Errno 17]
    # File exists", an ERROR line in its log). One thread writes them in order.
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")
    return store


# Inline, a snapshot's results are read at the next optimizer step; on a worker thread a few
# steps later: either way each value is stored at the step it measures.
@pytest.mark.parametrize("synchronous", [True, False], ids=["inline", "worker"])
def test_mlflow_file_store_gets_every_scalar_at_the_trainers_steps(
    tmp_path: Path, mlflow_store: Path, synchronous: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    train(tmp_path, report_to=["tensorboard", "mlflow"], synchronous=synchronous, **RUN)
    mlflow.flush_async_logging()  # MLflowCallback logs with synchronous=False (MLflow >= 2.8)
    # A batch MLflow failed to write is an ERROR in its log, not an exception.
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    client = MlflowClient()
    experiment = client.get_experiment_by_name("spectral")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the Trainer's run: the last snapshot did not open one of its own
    run_id = runs[0].info.run_id
    logged = spectral_scalars(tmp_path)
    spectral_tags = {tag for tag in logged if tag.startswith("spectral_")}
    assert spectral_tags <= set(runs[0].data.metrics)  # every scalar of the event files
    assert "loss" in runs[0].data.metrics  # beside the Trainer's own
    history = client.get_metric_history(run_id, Q0)
    assert [point.step for point in history] == STEPS == sorted(logged[Q0])
    for point in history:
        assert point.value == pytest.approx(logged[Q0][point.step], rel=1e-6)
    alpha = scalar_tag("alpha", 1, "MLP_down")
    assert {p.step: p.value for p in client.get_metric_history(run_id, alpha)} == pytest.approx(
        logged[alpha], rel=1e-6
    )
    # The Trainer's TensorBoardCallback wrote its own scalars, and no second copy of ours.
    assert "train/loss" in logged
    assert not [tag for tag in logged if "spectral" in tag and not tag.startswith("spectral_")]


def test_wandb_offline_run_gets_every_scalar_at_the_trainers_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb", reason="wandb is not installed: pip install -e .[dev]")
    for name, value in dict(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp_path),
        WANDB_PROJECT="spectral",
        WANDB_DISABLE_GIT="true",
        WANDB_DISABLE_CODE="true",
        WANDB_CONSOLE="off",
        WANDB_WATCH="false",
    ).items():
        monkeypatch.setenv(name, value)
    train(tmp_path, report_to=["wandb"], synchronous=False, **RUN)
    wandb.finish()  # the Trainer leaves the run open; finishing it closes its log

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).parent / "wandb"
    records = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.splitlines()
    rows = [json.loads(line)["history"]["item"] for line in records if '"type":"history"' in line]
    logged = spectral_scalars(tmp_path)
    keys = {key for row in rows for key in row}
    # WandbCallback names every key of the Trainer's logs train/<key> (train/loss likewise).
    assert {f"train/{tag}" for tag in logged if tag.startswith("spectral_")} <= keys
    q0 = {row["train/global_step"]: row[f"train/{Q0}"] for row in rows if f"train/{Q0}" in row}
    assert sorted(q0) == STEPS == sorted(logged[Q0])
    for step, value in q0.items():
        assert value == pytest.approx(logged[Q0][step], rel=1e-6)


def test_a_run_stopped_by_another_callback_keeps_its_last_snapshot_out_of_mlflow(
    tmp_path: Path, mlflow_store: Path
) -> None:
    # Early stopping decides after our on_step_end: the last snapshot is taken at on_train_end,
    # after MLflowCallback ended its run, so it goes to the event files only (no stray run).
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import TrainerCallback

    class StopAtFive(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = state.global_step == 5

    train(
        tmp_path,
        report_to=["mlflow"],
        extra_callbacks=[StopAtFive()],
        synchronous=True,
        **{**RUN, "steps": 20},
    )
    mlflow.flush_async_logging()
    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("spectral").experiment_id])
    history = client.get_metric_history(run.info.run_id, Q0)
    assert [point.step for point in history] == [0, 1, 2]
    assert sorted(spectral_scalars(tmp_path)[Q0]) == [0, 1, 2, 5]


def test_report_to_without_attach_says_how_and_where_the_event_files_are(
    tmp_path: Path, mlflow_store: Path
) -> None:
    with pytest.warns(UserWarning, match=r"report_to=\['mlflow'\] gets the Trainer's logs but not"):
        train(tmp_path, report_to=["mlflow"], **{**RUN, "attach": False, "steps": 2})


def test_the_event_file_directory_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    logger = logging.getLogger("spectral_callbacks")
    propagate = logger.propagate
    logger.propagate = True  # caplog listens at the root
    try:
        with caplog.at_level(logging.INFO, logger="spectral_callbacks"):
            train(tmp_path, report_to="none", **{**RUN, "attach": False, "steps": 2})
    finally:
        logger.propagate = propagate
    said = [
        r.getMessage() for r in caplog.records if "TensorBoard event files in" in r.getMessage()
    ]
    assert len(said) == 1
    (run,) = {path.parent for path in tmp_path.rglob("events.out.tfevents.*")}
    assert f"event files in {run} (tensorboard --logdir {run})" in said[0]


def test_attach_names_a_wrong_trainer_and_adds_itself_once(tmp_path: Path) -> None:
    from hf_train import samples, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback
    from spectral_callbacks.monitor.options import ConfigurationError

    callback = SpectralTrainerCallback()
    with pytest.raises(
        ConfigurationError, match=r"`trainer` must be a transformers.Trainer .*got 'trainer'"
    ):
        callback.attach("trainer")
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=samples(4))
    assert callback.attach(trainer) is callback
    callback.attach(trainer)  # again: still once in the Trainer's callbacks
    assert trainer.callback_handler.callbacks.count(callback) == 1
