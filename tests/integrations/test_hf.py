"""The Hugging Face Trainer frontend: a tiny GPT-2 from a config, event files beside the Trainer's,
optimizer steps under gradient accumulation, resume from a Trainer checkpoint, and two processes.
"""

from __future__ import annotations

import os
import socket
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from browser import free_port
from hf_train import train
from spawn_ranks import run_session
from tiny_models import exact_stable_rank, read_scalars

from spectral_callbacks.cli.main import main as cli
from spectral_callbacks.hf import SpectralTrainerCallback
from spectral_callbacks.hf import SpectralTrainerCallback as Again
from spectral_callbacks.integrations.hf import STATE_FILE, trainer_logdir
from spectral_callbacks.monitor.engines import distributed as multi
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.names import monitor_tag, scalar_tag
from spectral_callbacks.offline.events import read_event_file
from spectral_callbacks.targets import find_targets

SCRIPT = Path(__file__).resolve().parents[1] / "hf_train.py"
Q0 = scalar_tag("stable_rank", 0, "Q")
LAYER0_Q = "transformer.h.0.attn.c_attn.weight[Q]"


def spectral_run(output_dir: Path) -> Path:
    """The one directory under ``output_dir`` whose event files hold the spectral scalars."""
    runs = {path.parent for path in output_dir.rglob("events.out.tfevents.*")}
    found = [run for run in runs if Q0 in read_scalars(run)]
    assert len(found) == 1, runs
    return found[0]


def test_gpt2_40_steps_writes_beside_the_trainer_and_the_cli_reads_it(tmp_path: Path) -> None:
    recorder = train(tmp_path, steps=40)
    run = spectral_run(tmp_path)
    assert run.parent == tmp_path / "runs"  # <output_dir>/runs/<time>_<host>, like the Trainer's
    logged = read_scalars(run)
    assert "train/loss" in logged  # the Trainer's own TensorBoard callback wrote the same run
    assert sorted(logged[Q0]) == [0, 1, 2, 10, 20, 30, 40]
    for step, value in logged[Q0].items():
        assert value == pytest.approx(exact_stable_rank(recorder.weights[step][LAYER0_Q]), rel=0.01)
    out = tmp_path / "rows.csv"
    assert cli(["export", str(tmp_path), "-o", str(out)]) == 0
    assert "stable_rank" in out.read_text()
    png = tmp_path / "rank.png"
    assert cli(["plot", str(tmp_path), "--kind", "rank-steps", "--layer", "0", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gradient_accumulation_snapshots_optimizer_steps(tmp_path: Path) -> None:
    recorder = train(tmp_path, steps=6, accumulate=4, every_n_steps=5, report_to=[])
    logged = read_scalars(spectral_run(tmp_path))
    assert sorted(logged[Q0]) == [0, 1, 2, 5, 6]  # optimizer steps, not the 24 micro-batches
    assert sorted(recorder.weights) == list(range(7))
    for step, value in logged[Q0].items():
        assert value == pytest.approx(exact_stable_rank(recorder.weights[step][LAYER0_Q]), rel=0.01)


def test_resume_from_a_trainer_checkpoint_keeps_the_compression_reference(tmp_path: Path) -> None:
    train(
        tmp_path, steps=12, save_steps=6, every_n_steps=5, logdir=tmp_path / "first", report_to=[]
    )
    assert (tmp_path / "checkpoint-12" / STATE_FILE).is_file()
    first = read_scalars(tmp_path / "first")
    train(
        tmp_path,
        steps=20,
        save_steps=6,
        every_n_steps=5,
        resume=True,
        logdir=tmp_path / "second",
        report_to=[],
    )
    second = read_scalars(tmp_path / "second")
    assert sorted(second[Q0]) == [15, 20]  # no new reference snapshot at the resumed step
    reference = first[Q0][0]
    compression = second[scalar_tag("compression", 0, "Q")]
    for step, stable_rank in second[Q0].items():
        assert compression[step] == pytest.approx(100 * (1 - stable_rank / reference), abs=1e-3)
    assert compression[20] != pytest.approx(0.0, abs=1e-2)


def test_logdir_follows_the_trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=["tensorboard"], use_cpu=True)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "env"))
    assert trainer_logdir(args) == str(tmp_path / "env")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR")
    if getattr(args, "logging_dir", None):  # transformers 4.x: set at construction, used as given
        assert Path(args.logging_dir).parent == tmp_path / "runs"
        assert trainer_logdir(args) == args.logging_dir
        return
    made = tmp_path / "runs" / f"Dec01_10-00-00_{socket.gethostname()}"
    made.mkdir(parents=True)  # what the Trainer's TensorBoardCallback made a moment ago
    assert trainer_logdir(args) == str(made)
    alone = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    own = Path(trainer_logdir(alone))  # no TensorBoardCallback to join: a fresh run directory
    assert own.parent == tmp_path / "runs" and own.name.endswith(socket.gethostname())
    assert own != made


def test_bad_arguments_are_named_at_construction() -> None:
    with pytest.raises(
        ConfigurationError, match="`worker_threads` must be None or a positive int, got 0"
    ):
        SpectralTrainerCallback(worker_threads=0)
    with pytest.raises(TypeError, match="unknown argument.*'every_n_step'"):
        Again(every_n_step=5)


# Lightning before 2.6 asks every callback whether it overrides state_dict without naming the
# Callback class, so it rejects a non-Callback itself (ValueError 'Expected a parent') before it
# calls any hook of it, and the hook named below is never reached.
LIGHTNING = tuple(int(part) for part in metadata.version("lightning").split(".")[:2])
LIGHTNING_CALLS_ANY_CALLBACK = LIGHTNING >= (2, 6)


def test_the_hugging_face_trainer_given_the_lightning_callback_names_the_right_class(
    tmp_path: Path,
) -> None:
    # before: a bare AttributeError ('SpectralMonitor' object has no attribute 'on_init_end')
    from hf_train import tiny_gpt2
    from transformers import Trainer, TrainingArguments

    from spectral_callbacks.pl import SpectralMonitor

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(
        AttributeError,
        match=r"SpectralMonitor is a Lightning callback, but a trainer called its 'on_init_end': "
        r"the Hugging Face Trainer takes spectral_callbacks.hf.SpectralTrainerCallback",
    ):
        Trainer(model=tiny_gpt2(), args=args, callbacks=[SpectralMonitor()])
    assert not hasattr(SpectralMonitor(), "no_such_attribute")  # other names: as any object


@pytest.mark.skipif(
    not LIGHTNING_CALLS_ANY_CALLBACK,
    reason="needs lightning 2.6: older releases reject a non-Callback before calling its hooks",
)
def test_a_lightning_trainer_given_the_hugging_face_callback_names_the_right_class() -> None:
    # before: a bare AttributeError ('SpectralTrainerCallback' object has no attribute 'setup',
    # then 'on_exception')
    from tiny_models import RecordingLogger, TinyGPT, quiet_trainer, token_loader

    trainer = quiet_trainer(
        max_steps=2, logger=RecordingLogger(), callbacks=[SpectralTrainerCallback()]
    )
    with pytest.raises(
        AttributeError,
        match=r"SpectralTrainerCallback is the Hugging Face Trainer's callback, but a trainer "
        r"called its '(setup|on_exception)': a Lightning Trainer takes "
        r"spectral_callbacks.pl.SpectralMonitor",
    ):
        trainer.fit(TinyGPT(), token_loader())


@pytest.mark.slow
def test_two_processes_under_torchrun_log_every_matrix_once_from_rank_zero(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        str(tmp_path),
        "--steps",
        "12",
        "--logdir",
        str(tmp_path / "tb"),
    ]
    finished = run_session(command, 300, env)
    output = finished.stdout
    assert finished.returncode == 0, output[-3000:]
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 writes; rank 1 writes nothing
    points, problem = read_event_file(files[0])
    assert problem is None
    weights = torch.load(tmp_path / "weights.pt")
    targets = find_targets(__import__("hf_train").tiny_gpt2())
    assert len(targets) == 12
    seen: dict[tuple[str, int], int] = {}
    for tag, step, _, _ in points:
        seen[(tag, step)] = seen.get((tag, step), 0) + 1
    values = {(tag, step): value for tag, step, value, _ in points}
    for target in targets:
        tag = scalar_tag("stable_rank", target.layer, target.role, target.num_layers)
        steps = sorted(step for t, step in seen if t == tag)
        assert steps == [0, 1, 2, 10, 12], target.name
        assert all(seen[(tag, step)] == 1 for step in steps)  # once each: from rank 0 only
        for step in steps:
            expected = exact_stable_rank(weights[step][target.name])
            assert values[(tag, step)] == pytest.approx(expected, rel=0.01), (target.name, step)
    owners = multi.partition(targets, world_size=2)
    for rank in (0, 1):  # each rank decomposed its share
        assert values[(monitor_tag(f"rank{rank}/matrices"), 12)] == float(owners.count(rank))
