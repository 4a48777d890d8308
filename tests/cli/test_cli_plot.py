"""`spectral-callbacks plot`: every kind writes a file, and the figures hold the runs' values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_runs import NUM_LAYERS, STEPS, run_cli, training_runs

from spectral_callbacks import charts
from spectral_callbacks.cli.main import main
from spectral_callbacks.offline import differences
from spectral_callbacks.offline.events import read_runs

ROLES = ["Q", "K", "V", "O", "MLP_up", "MLP_down"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return training_runs(tmp_path_factory) / "tb"


@pytest.fixture(scope="module")
def rows(runs: Path) -> pd.DataFrame:
    return read_runs([runs], all_scalars=True).rows


def _final(rows: pd.DataFrame, run: str, metric: str, role: str) -> np.ndarray:
    chosen = rows[
        (rows.run == run) & (rows.metric == metric) & (rows.role == role) & (rows.step == STEPS)
    ]
    return chosen.dropna(subset=["layer"]).sort_values("layer").value.to_numpy()


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("alpha-depth", ["--role", "K"]),
        ("rank-steps", ["--layer", "1"]),
        ("compression", []),
        ("compression-wave", ["--role", "MLP_up"]),
        ("metric-diff", ["--metric", "train/loss", "--baseline", "a", "--x", "train/tokens"]),
    ],
)
def test_each_kind_writes_a_file(runs: Path, tmp_path: Path, kind: str, extra: list[str]) -> None:
    out = tmp_path / f"{kind}.png"
    assert main(["plot", str(runs), "--kind", kind, "-o", str(out), *extra]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_alpha_depth_content(rows: pd.DataFrame) -> None:
    ax = charts.alpha_vs_depth(rows, role="K").axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["a", "b"]
    np.testing.assert_array_equal(lines[0].get_xdata(), np.linspace(0, 1, NUM_LAYERS))
    np.testing.assert_array_equal(lines[1].get_ydata(), _final(rows, "b", "alpha", "K"))
    assert (ax.get_xlabel(), ax.get_title()) == (
        "relative depth i / (L − 1)",
        "α of K vs relative depth",
    )


def test_rank_steps_content(rows: pd.DataFrame) -> None:
    ax = charts.rank_vs_steps(rows, layer=1).axes[0]
    lines = ax.get_lines()
    assert len(lines) == 2 * len(ROLES)
    assert lines[4].get_label() == "a · MLP↑"
    expected = rows[
        (rows.run == "a")
        & (rows.metric == "stable_rank")
        & (rows.layer == 1)
        & (rows.role == "MLP_up")
    ]
    np.testing.assert_array_equal(lines[4].get_xdata(), expected.step)
    np.testing.assert_array_equal(lines[4].get_ydata(), expected.value)
    assert lines[4].get_xdata()[[0, -1]].tolist() == [0, STEPS]


def test_compression_content(rows: pd.DataFrame) -> None:
    fig = charts.compression_by_layer(rows)
    panels = [ax for ax in fig.axes if ax.get_title().startswith("Final compression")]
    assert len(panels) == 2 and all(len(ax.patches) == NUM_LAYERS * len(ROLES) for ax in panels)
    o_bars = [bar.get_height() for bar in panels[0].patches[3 * NUM_LAYERS : 4 * NUM_LAYERS]]
    np.testing.assert_array_equal(o_bars, _final(rows, "a", "compression", "O"))


def test_compression_wave_content(rows: pd.DataFrame) -> None:
    fig = charts.compression_wave(rows, role="MLP_up")
    mesh = fig.axes[0].collections[0]
    wave = rows[
        (rows.run == "a") & (rows.metric == "compression") & (rows.role == "MLP_up")
    ].dropna(subset=["layer"])
    grid = wave.pivot(index="layer", columns="step", values="value")
    np.testing.assert_array_equal(np.asarray(mesh.get_array()).reshape(grid.shape), grid.to_numpy())
    assert grid.shape[0] == NUM_LAYERS and grid.columns[0] == 0 and np.all(grid[0] == 0.0)


def test_metric_diff_content(rows: pd.DataFrame) -> None:
    ax = differences.metric_diff(rows, "train/loss", "a", x="train/tokens").axes[0]
    (line,) = [line for line in ax.get_lines() if line.get_label() == "b"]
    loss = {
        run: rows[(rows.run == run) & (rows.metric == "train/loss")].set_index("step").value
        for run in "ab"
    }
    tokens = rows[(rows.run == "b") & (rows.metric == "train/tokens")].set_index("step").value
    # Both runs see the same tokens per step, so the difference is a plain per-step difference.
    np.testing.assert_array_equal(line.get_xdata(), tokens.reindex(loss["b"].index).to_numpy())
    np.testing.assert_allclose(line.get_ydata(), (loss["b"] - loss["a"]).to_numpy(), rtol=1e-12)
    assert ax.get_xlabel() == "train/tokens" and ax.get_ylabel() == "Δ train/loss (run − a)"


def test_plot_as_a_user_with_errors(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "alpha.svg"
    done = run_cli("plot", runs / "a", runs / "b", "--kind", "alpha-depth", "-o", out)
    assert done.returncode == 0, done.stderr
    assert "<svg" in out.read_text()[:2000] and "α of Q vs relative depth" in out.read_text()

    done = run_cli(
        "plot", runs / "a", tmp_path / "missing", "--kind", "rank-steps", "-o", tmp_path / "r.pdf"
    )
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1 and f"{tmp_path / 'missing'}: no such file or directory" in line
    assert "plotted the runs that could be read (a)" in line
    assert (tmp_path / "r.pdf").read_bytes()[:4] == b"%PDF"


def test_plot_errors_in_process(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "plot",
                str(runs),
                "--kind",
                "alpha-depth",
                "--role",
                "MLA",
                "-o",
                str(tmp_path / "x.png"),
            ]
        )
        == 1
    )
    assert "per-layer `alpha` rows with role='MLA'" in capsys.readouterr().err
    assert main(["plot", str(runs), "--kind", "metric-diff", "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert (
        "needs --metric" in err and "train/loss" in err and "--baseline RUN (one of: a, b)" in err
    )
    assert main(["plot", str(runs), "--kind", "compression", "-o", str(tmp_path / "x.jpg")]) == 1
    assert "use one of .png, .svg, .pdf" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def analyzed(runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 analyzed at rest (one snapshot, step 0) beside the training runs a and b."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("analyzed")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    transformers.GPT2Model(config).save_pretrained(root / "model")
    assert main(["analyze", str(root / "model"), "--logdir", str(root / "gpt2")]) == 0
    return root / "gpt2"


def test_plot_help_reads_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = capsys.readouterr().out
    assert "%%" not in text and "final compression % by layer" in text
    assert "--x train/tokens" in text and "--x tokens" not in text
    assert "--pair RUNS PARTNERS" in text and "--smoothing W" in text


def test_compression_of_an_analyzed_model_says_what_it_left_out(
    runs: Path, analyzed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for kind in ("compression", "compression-wave"):
        out = tmp_path / f"{kind}.png"
        assert main(["plot", str(runs), str(analyzed), "--kind", kind, "-o", str(out)]) == 0
        err = capsys.readouterr().err
        assert "note: left out gpt2: one snapshot (step 0), nothing to compress against" in err
        assert f"done: {kind} of 2 of 3 runs" in err and out.stat().st_size > 5000


def test_rank_steps_draws_an_analyzed_model_as_markers(runs: Path, analyzed: Path) -> None:
    rows = read_runs([runs, analyzed]).rows
    ax = charts.rank_vs_steps(rows, layer=0).axes[0]
    markers = [line.get_marker() for line in ax.get_lines() if line.get_label().startswith("gpt2")]
    assert markers == ["o"] * 6


def test_metric_diff_against_an_analyzed_model_fails_and_says_why(
    runs: Path, analyzed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plot", str(runs), str(analyzed), "--kind", "metric-diff", "--metric", "stable_rank"]
    argv += ["--layer", "0", "--role", "Q", "--baseline", "gpt2", "-o", str(tmp_path / "d.png")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the baseline 'gpt2' has `stable_rank` at one step only (0)" in err
    assert not (tmp_path / "d.png").exists()


def test_plot_errors_name_only_what_is_missing(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "x.png")
    argv = ["plot", str(runs), "--kind", "metric-diff", "--metric", "train/loss", "-o", out]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "needs --baseline RUN (one of: a, b) or --pair RUNS PARTNERS" in err
    assert "--metric" not in err.split("needs", 1)[1]
    assert main(["plot", str(runs), "--kind", "rank-steps", "--layer", "99", "-o", out]) == 1
    assert "with layer=99; there are layers: 0, 1, 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--baseline", "a", "--smoothing", "1"])
    assert "--smoothing: must be a number in [0, 1)" in capsys.readouterr().err


def test_plot_of_a_run_without_spectral_scalars_suggests_no_flag_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "plain")) as writer:
        writer.add_scalar("train/loss", 1.0, 0)
    argv = ["plot", str(tmp_path / "plain"), "--kind", "rank-steps", "-o", str(tmp_path / "r.png")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "train with SpectralMonitor" in err and "--all-scalars" not in err
    assert main(["export", str(tmp_path / "plain"), "-o", str(tmp_path / "r.csv")]) == 1
    assert "or pass --all-scalars to export its other tags" in capsys.readouterr().err
