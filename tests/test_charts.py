"""The standard charts: what they draw (lines, bars, cells, labels, values), not only that they draw."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from spectral_callbacks import charts
from spectral_callbacks.names import relative_depth

ROLES = ["Q", "K", "V", "O", "MLP_up", "MLP_down"]


def _rows(run: str, num_layers: int, steps: list[int], seed: int) -> pd.DataFrame:
    """Tidy rows of a fake run: every metric of every (layer, role) at every step, plus a loss."""
    rng = np.random.default_rng(seed)
    records = []
    for step in steps:
        for layer in range(num_layers):
            for role in ROLES:
                for metric in ("alpha", "stable_rank", "compression"):
                    records.append(
                        (
                            run,
                            step,
                            metric,
                            layer,
                            relative_depth(layer, num_layers),
                            role,
                            float(rng.uniform(0.1, 90.0)),
                            float(step),
                        )
                    )
        records.append((run, step, "train/loss", None, None, None, 5.0 - 0.01 * step + seed, step))
        records.append((run, step, "tokens", None, None, None, 1000.0 * step * (1 + seed), step))
    columns = ["run", "step", "metric", "layer", "depth", "role", "value", "wall_time"]
    frame = pd.DataFrame.from_records(records, columns=columns)
    frame["layer"] = frame["layer"].astype("Int64")
    frame["depth"] = frame["depth"].astype(float)
    return frame


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    return pd.concat([_rows("d4", 4, [0, 10, 20], 0), _rows("d6", 6, [0, 10, 20, 30], 1)])


def test_alpha_vs_depth_one_line_per_run_with_final_values(rows: pd.DataFrame) -> None:
    fig = charts.alpha_vs_depth(rows, role="K")
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["d4", "d6"]
    final = rows[
        (rows.metric == "alpha") & (rows.role == "K") & (rows.run == "d6") & (rows.step == 30)
    ]
    np.testing.assert_allclose(lines[1].get_xdata(), [i / 5 for i in range(6)])
    np.testing.assert_array_equal(lines[1].get_ydata(), final.sort_values("layer")["value"])
    assert ax.get_xlabel() == "relative depth i / (L − 1)"
    assert ax.get_ylabel().startswith("α")
    assert "α of K" in ax.get_title()


def test_rank_vs_steps_one_line_per_role_and_run_style(rows: pd.DataFrame) -> None:
    fig = charts.rank_vs_steps(rows, layer=2)
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2 * 6
    labels = [line.get_label() for line in lines]
    assert labels[:6] == [f"d4 · {g}" for g in ["Q", "K", "V", "O", "MLP↑", "MLP↓"]]
    assert {line.get_linestyle() for line in lines[:6]} != {
        line.get_linestyle() for line in lines[6:]
    }
    expected = rows[
        (rows.metric == "stable_rank")
        & (rows.layer == 2)
        & (rows.role == "MLP_down")
        & (rows.run == "d6")
    ].sort_values("step")
    np.testing.assert_array_equal(lines[-1].get_xdata(), expected["step"])
    np.testing.assert_array_equal(lines[-1].get_ydata(), expected["value"])
    assert fig.axes[0].get_xlabel() == "optimizer step"
    assert "stable rank" in fig.axes[0].get_ylabel()


def test_rank_vs_steps_single_run_labels_roles_only(rows: pd.DataFrame) -> None:
    fig = charts.rank_vs_steps(rows[rows.run == "d4"], layer=0)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == [
        "Q",
        "K",
        "V",
        "O",
        "MLP↑",
        "MLP↓",
    ]


def test_compression_by_layer_grouped_bars_per_role(rows: pd.DataFrame) -> None:
    fig = charts.compression_by_layer(rows)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert len(axes) == 2
    assert len(axes[1].patches) == 6 * 6  # 6 layers x 6 roles
    _, labels = axes[1].get_legend_handles_labels()
    assert labels == ["Q", "K", "V", "O", "MLP↑", "MLP↓"]
    expected = rows[
        (rows.metric == "compression") & (rows.run == "d6") & (rows.step == 30) & (rows.role == "Q")
    ].sort_values("layer")["value"]
    q_bars = [p.get_height() for p in axes[1].patches[:6]]
    np.testing.assert_array_equal(q_bars, expected)
    assert axes[1].get_ylabel() == "final compression (%)"
    assert axes[1].get_xlabel() == "layer"


def test_compression_computed_from_stable_rank_when_not_logged(rows: pd.DataFrame) -> None:
    ranks = rows[(rows.metric == "stable_rank") & (rows.run == "d4")]
    fig = charts.compression_by_layer(ranks)
    by_key = ranks.set_index(["step", "layer", "role"])["value"]
    first, last = by_key.loc[(0, 3, "V")], by_key.loc[(20, 3, "V")]
    v_bars = [p.get_height() for p in fig.axes[0].patches[2 * 4 : 3 * 4]]
    assert v_bars[3] == pytest.approx(100 * (1 - last / first))


def test_compression_wave_cells_hold_values(rows: pd.DataFrame) -> None:
    fig = charts.compression_wave(rows, role="O")
    panels = [ax for ax in fig.axes if ax.get_title().startswith("Compression wave")]
    assert len(panels) == 2
    mesh = panels[0].collections[0]
    cells = np.asarray(mesh.get_array()).reshape(4, 3)  # layers x steps
    expected = rows[(rows.metric == "compression") & (rows.role == "O") & (rows.run == "d4")]
    grid = expected.pivot(index="layer", columns="step", values="value").to_numpy()
    np.testing.assert_array_equal(cells, grid)
    assert panels[0].get_xlabel() == "optimizer step" and panels[0].get_ylabel() == "layer"


def test_metric_diff_against_steps_and_tokens(rows: pd.DataFrame) -> None:
    fig = charts.metric_diff(rows, "train/loss", baseline="d4")
    (line,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "d6"]
    # d6 = d4 + 1 at every shared step; step 30 lies outside the baseline's range and is left out.
    np.testing.assert_array_equal(line.get_xdata(), [0, 10, 20])
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.0, 1.0])
    assert "d4" in fig.axes[0].get_ylabel()

    fig = charts.metric_diff(rows, "train/loss", baseline="d4", x="tokens")
    (line,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "d6"]
    # d6 sees twice the tokens per step: at tokens 20000 it is at step 10, the baseline at step 20.
    np.testing.assert_array_equal(line.get_xdata(), [0, 20000])
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.0 + 0.1])
    assert fig.axes[0].get_xlabel() == "tokens"


def test_chart_errors_name_what_is_missing(rows: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match="per-layer `alpha` rows with role='MLA'"):
        charts.alpha_vs_depth(rows, role="MLA")
    with pytest.raises(ValueError, match="the baseline 'nope' is not one of the runs: d4, d6"):
        charts.metric_diff(rows, "train/loss", baseline="nope")
    with pytest.raises(ValueError, match="several .* pick one layer and role"):
        charts.metric_diff(rows, "alpha", baseline="d4")


def test_save_figure_formats(rows: pd.DataFrame, tmp_path) -> None:
    fig = charts.alpha_vs_depth(rows)
    for suffix in (".png", ".svg", ".pdf"):
        path = charts.save_figure(fig, tmp_path / f"a{suffix}")
        assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="must end in .png"):
        charts.save_figure(fig, tmp_path / "a.jpg")
