"""Every example runs at a tiny size, in-process, so none of them can rot."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import analyze_pretrained
import attention_variants
import data
import demo
import pandas as pd
import pytest
import torch
import train_gpt
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing import event_accumulator

from spectral_callbacks.cli import main as cli
from spectral_callbacks.offline.events import read_runs

TINY = [
    "--depth",
    "2",
    "--width",
    "32",
    "--heads",
    "4",
    "--block-size",
    "16",
    "--tokens-per-step",
    "64",
]
QUIET = ["--no-progress", "--accelerator", "cpu", "--max-bytes", "100000"]  # skip reading 30 MB


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logdir = tmp_path_factory.mktemp("runs")
    argv = [
        *TINY,
        *QUIET,
        "--steps",
        "4",
        "--every-n-steps",
        "2",
        "--log-every-n-steps",
        "1",
        "--checkpoint",
    ]
    return train_gpt.main([*argv, "--logdir", str(logdir), "--name", "tiny", "--version", ""])


def test_train_gpt_logs_loss_tokens_and_spectra(tiny_run: Path) -> None:
    rows = read_runs([tiny_run], all_scalars=True).rows
    tokens = rows[rows["metric"] == "train/tokens"].sort_values("step")
    assert tokens["value"].tolist() == [64.0 * (step + 1) for step in tokens["step"]]
    assert len(tokens) == 4 and rows["metric"].eq("train/loss").sum() == 4
    stable_rank = rows[(rows["metric"] == "stable_rank") & (rows["layer"] == 0)]
    assert set(stable_rank["role"]) == {"Q", "K", "V", "O", "MLP_up", "MLP_down"}
    assert {0, 4} <= set(stable_rank["step"])  # the initialization and the final step


def test_train_gpt_checkpoint_rebuilds_the_trained_model(tiny_run: Path) -> None:
    (checkpoint,) = (tiny_run / "checkpoints").glob("*.ckpt")
    module = train_gpt.GPTModule.load_from_checkpoint(checkpoint, map_location="cpu")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    assert module.model.config.n_layer == 2 and module.hparams["max_steps"] == 4
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, saved[name])


def test_rank_layers_on_the_runs_checkpoint_weighs_blocks_by_parameters(
    tiny_run: Path, tmp_path: Path
) -> None:
    (checkpoint,) = (tiny_run / "checkpoints").glob("*.ckpt")
    out = tmp_path / "ranks.json"
    argv = ["rank-layers", str(checkpoint), "--arch", "train_gpt:GPTModule", "--json", str(out)]
    assert cli(argv) == 0
    ranking = json.loads(out.read_text())
    assert ranking["where"] == "fitted now" and len(ranking["matrices"]) == 2 * 6
    blocks = pd.DataFrame(ranking["blocks"]).sort_values("block_alpha")
    # A block: Q, K, V, O of 32 x 32 (the fused c_attn split in three) and MLP 128 x 32, 32 x 128.
    assert set(blocks.params) == {4 * 32 * 32 + 2 * 32 * 128}
    mean = (blocks.sparsity * blocks.params).sum() / blocks.params.sum()
    assert mean == pytest.approx(0.7, rel=1e-12)
    assert blocks.sparsity.is_monotonic_increasing
    assert blocks.sparsity.iloc[-1] > blocks.sparsity.iloc[0]


def test_train_gpt_bad_flags_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(
        MisconfigurationException, match="`--tokens-per-step` .* multiple of `--block-size`"
    ):
        train_gpt.main([*TINY[:-1], "100", "--logdir", str(tmp_path)])
    with pytest.raises(MisconfigurationException, match="`--steps` must be a positive int, got 0"):
        train_gpt.main([*TINY, "--steps", "0", "--logdir", str(tmp_path)])
    with pytest.raises(MisconfigurationException, match="multiple of `n_kv_head`.*--kv-heads"):
        train_gpt.main([*TINY, "--attention", "gqa", "--kv-heads", "3", "--logdir", str(tmp_path)])


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    module = train_gpt.GPTModule(
        train_gpt.GPTConfig(n_layer=1, n_head=1, n_embd=8), max_steps=100, warmup_steps=10
    )
    factors = [module.lr_factor(step) for step in (0, 9, 10, 55, 100, 150)]
    assert factors == pytest.approx([0.1, 1.0, 1.0, 0.55, 0.1, 0.1])


def test_module_rebuilds_from_its_hyperparameters() -> None:
    config = train_gpt.GPTConfig(n_layer=1, n_head=2, n_embd=8, attention="mla")
    module = train_gpt.GPTModule(config, lr=1e-3)
    rebuilt = train_gpt.GPTModule(**module.hparams)
    assert rebuilt.model.config == config and rebuilt.lr == 1e-3


def test_data_reads_a_user_file_and_names_bad_input(tmp_path: Path) -> None:
    text = tmp_path / "tiny.txt"
    text.write_bytes(b"hello world")
    assert bytes(data.load_bytes(text).tolist()) == b"hello world"
    with pytest.raises(FileNotFoundError, match="`text` file .*missing.txt"):
        data.load_bytes(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="not more than `block_size` \\(16\\)"):
        data.RandomWindows(data.load_bytes(text), block_size=16)


def test_same_seed_gives_the_same_windows() -> None:
    text = data.load_bytes(max_bytes=5000)
    first, second = (iter(data.RandomWindows(text, block_size=8, seed=3)) for _ in range(2))
    for _ in range(3):
        torch.testing.assert_close(next(first), next(second))


@pytest.mark.slow
def test_attention_variants_draws_loss_minus_mha(tmp_path: Path) -> None:
    argv = ["--variants", "mha", "mla", "gla4", "--depth", "1", "--width", "32", "--steps", "4"]
    argv += ["--tokens-per-step", "64", "--block-size", "16", "--every-n-steps", "2"]
    argv += ["--no-progress", "--max-bytes", "100000"]
    chart = attention_variants.main([*argv, "--accelerator", "cpu", "--logdir", str(tmp_path)])
    assert chart.stat().st_size > 0
    table = attention_variants.final_losses(tmp_path, ["mha", "mla", "gla4"])
    assert table.loc["mha", "minus mha"] == 0 and table["final loss"].notna().all()
    # Every row against the event files, read by TensorBoard's own reader.
    final = {}
    for run in ("mha", "mla", "gla4"):
        reader = event_accumulator.EventAccumulator(
            str(tmp_path / run), size_guidance={"scalars": 0}
        )
        reader.Reload()
        losses = [
            event.value for event in sorted(reader.Scalars("train/loss"), key=lambda e: e.step)
        ]
        final[run] = sum(losses[-5:]) / len(losses[-5:])
    for run, value in final.items():
        assert table.loc[run, "final loss"] == pytest.approx(value, rel=1e-6)
        assert table.loc[run, "minus mha"] == pytest.approx(
            value - final["mha"], rel=1e-6, abs=1e-9
        )
    assert table.loc["mla", "minus mha"] != 0  # the variants do not train to the same loss
    roles = set(read_runs([tmp_path / "gla4"]).rows["role"])
    assert {"Q", "KV_down", "K_rope", "K_g3", "V_g3", "O", "MLP_up"} <= roles


def test_attention_variants_trains_both_inits_and_draws_the_pairs(tmp_path: Path) -> None:
    argv = ["--variants", "mha", "mla", "--inits", "gpt", "zero_out", "--depth", "1"]
    argv += ["--width", "32", "--steps", "4", "--tokens-per-step", "64", "--block-size", "16"]
    argv += ["--no-progress", "--max-bytes", "100000", "--no-spectral", "--smoothing", "0.5"]
    chart = attention_variants.main([*argv, "--accelerator", "cpu", "--logdir", str(tmp_path)])
    assert chart == tmp_path / "init_ablation.png" and chart.stat().st_size > 0
    rows = read_runs([tmp_path], all_scalars=True).rows
    assert set(rows.run) == {"mha/gpt", "mha/zero_out", "mla/gpt", "mla/zero_out"}
    loss = rows[rows.metric == "train/loss"]
    assert loss.groupby("run").step.apply(list).tolist() == [[0, 1, 2, 3]] * 4  # every step
    tokens = rows[rows.metric == "train/tokens"].pivot(index="step", columns="run", values="value")
    assert (tokens.nunique(axis=1) == 1).all()  # the same tokens per step for every run


def test_attention_variants_refuses_a_used_logdir(tmp_path: Path) -> None:
    (tmp_path / "mha").mkdir()
    (tmp_path / "mha" / "events.out.tfevents.1").write_bytes(b"")
    with pytest.raises(MisconfigurationException, match="already holds a run"):
        attention_variants.main(["--variants", "mha", "--logdir", str(tmp_path)])


def test_analyze_pretrained_charts_a_local_model_beside_a_run(
    tmp_path: Path, tiny_run: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    transformers.GPT2Model(config).save_pretrained(tmp_path / "tiny-gpt2")
    chart = analyze_pretrained.main(
        [
            str(tmp_path / "tiny-gpt2"),
            "--run",
            str(tiny_run),
            "--logdir",
            str(tmp_path / "analyzed"),
        ]
    )
    assert chart == tmp_path / "analyzed" / "alpha_vs_depth_Q.png" and chart.stat().st_size > 0
    runs = (
        read_runs([tiny_run, tmp_path / "analyzed" / "tiny-gpt2"])
        .rows.groupby("run")["layer"]
        .max()
    )
    assert runs.to_dict() == {"tiny": 1, "tiny-gpt2": 1}


@pytest.mark.slow
def test_demo_writes_the_csv_and_every_chart(tmp_path: Path) -> None:
    argv = ["--depth", "2", "--width", "32", "--heads", "2", "--steps", "6", "--block-size", "16"]
    argv += ["--max-bytes", "100000", "--tokens-per-step", "64", "--every-n-steps", "2"]
    argv += ["--no-progress", "--output", str(tmp_path)]
    written = demo.main(argv)
    assert set(written) == {"run", "csv", *(name for name, _ in demo.CHARTS)}
    for name, _ in demo.CHARTS:
        assert written[name].stat().st_size > 0, name
    rows = pd.read_csv(written["csv"])
    assert set(rows.columns) >= {"run", "step", "metric", "layer", "depth", "role", "value"}
    assert {0, 6} <= set(rows.loc[rows["metric"] == "stable_rank", "step"])
    # a second demo in the same folder replaces the run instead of mixing two runs' points
    demo.main(argv)
    assert len(list(written["run"].glob("events.out.tfevents.*"))) == 1


def test_demo_spells_commands_for_a_venv_that_is_not_activated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "tensorboard").write_text("#!/bin/sh\n")
    (bin_dir / "tensorboard").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # make demo does not activate the venv
    assert demo.shell_command("tensorboard", "tensorboard.main") == ".venv/bin/tensorboard"
    assert (
        demo.shell_command("spectral-callbacks", "spectral_callbacks.cli")
        == ".venv/bin/python -m spectral_callbacks.cli"  # no script installed: the module
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")  # an activated venv
    assert demo.shell_command("tensorboard", "tensorboard.main") == "tensorboard"


@pytest.mark.parametrize(
    "script, module, flag",
    [
        ("tensorboard", "tensorboard.main", "--version_tb"),
        ("spectral-callbacks", "spectral_callbacks.cli", "--version"),
    ],
)
def test_the_commands_the_demo_prints_run_without_the_venv_on_path(
    script: str, module: str, flag: str
) -> None:
    command = shlex.split(demo.shell_command(script, module)) + [flag]
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (command, done.stderr)
