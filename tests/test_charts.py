"""The standard charts: what they draw (lines, bars, cells, labels, values), not only that they draw."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from spectral_callbacks import chart_data, charts
from spectral_callbacks.names import TIDY_COLUMNS, relative_depth
from spectral_callbacks.offline import differences

ROLES = ["Q", "K", "V", "O", "MLP_up", "MLP_down"]


def _figure_text(fig) -> str:
    """The figure-level texts (its supxlabel among them): Figure.get_supxlabel is matplotlib 3.8+."""
    return "\n".join(text.get_text() for text in fig.texts)


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
    fig = differences.metric_diff(rows, "train/loss", baseline="d4")
    (line,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "d6"]
    # d6 = d4 + 1 at every shared step; step 30 lies outside the baseline's range and is left out.
    np.testing.assert_array_equal(line.get_xdata(), [0, 10, 20])
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.0, 1.0])
    assert "d4" in fig.axes[0].get_ylabel()

    fig = differences.metric_diff(rows, "train/loss", baseline="d4", x="tokens")
    (line,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "d6"]
    # d6 sees twice the tokens per step: at tokens 20000 it is at step 10, the baseline at step 20.
    np.testing.assert_array_equal(line.get_xdata(), [0, 20000])
    np.testing.assert_allclose(line.get_ydata(), [1.0, 1.0 + 0.1])
    assert fig.axes[0].get_xlabel() == "tokens"


def test_chart_errors_name_what_is_missing(rows: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match="per-layer `alpha` rows with role='MLA'"):
        charts.alpha_vs_depth(rows, role="MLA")
    with pytest.raises(ValueError, match="the baseline 'nope' is not one of the runs: d4, d6"):
        differences.metric_diff(rows, "train/loss", baseline="nope")
    with pytest.raises(ValueError, match="several .* pick one layer and role"):
        differences.metric_diff(rows, "alpha", baseline="d4")


def test_save_figure_formats(rows: pd.DataFrame, tmp_path) -> None:
    fig = charts.alpha_vs_depth(rows)
    for suffix in (".png", ".svg", ".pdf"):
        path = charts.save_figure(fig, tmp_path / f"a{suffix}")
        assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="must end in .png"):
        charts.save_figure(fig, tmp_path / "a.jpg")


def _loss_run(run: str, losses: list[float], tokens_per_step: float) -> pd.DataFrame:
    """Tidy rows of a run logging ``train/loss`` and ``train/tokens`` at steps 0, 1, 2, ..."""
    records = []
    for step, loss in enumerate(losses):
        records.append((run, step, "train/loss", None, None, None, loss, float(step)))
        records.append(
            (run, step, "train/tokens", None, None, None, tokens_per_step * step, float(step))
        )
    frame = pd.DataFrame.from_records(
        records, columns=["run", "step", "metric", "layer", "depth", "role", "value", "wall_time"]
    )
    return frame.astype({"layer": "Int64", "depth": float})


@pytest.fixture(scope="module")
def pairs() -> pd.DataFrame:
    """Two variants, each zero_out = gpt + a known offset (0.3 for mha, -0.1 for mla)."""
    rng = np.random.default_rng(1)
    mha = list(5.0 - 0.1 * np.arange(12) + rng.normal(0, 0.05, 12))
    mla = list(4.0 - 0.05 * np.arange(12) + rng.normal(0, 0.05, 12))
    return pd.concat(
        [
            _loss_run("mha/gpt", mha, 100.0),
            _loss_run("mha/zero_out", [v + 0.3 for v in mha], 100.0),
            _loss_run("mla/zero_out", [v - 0.1 for v in mla], 200.0),
            _loss_run("mla/gpt", mla, 200.0),
            _loss_run("tpa/zero_out", mla, 100.0),  # no partner: left out, said
        ]
    )


def test_pairing_recovers_the_known_differences(pairs: pd.DataFrame) -> None:
    fig = differences.metric_diff(
        pairs, "train/loss", pair=("{variant}/zero_out", "{variant}/gpt"), x="train/tokens"
    )
    lines = {
        line.get_label(): line
        for line in fig.axes[0].get_lines()
        if not line.get_label().startswith("_")  # the unlabelled zero line
    }
    assert list(lines) == ["mha", "mla"]
    np.testing.assert_allclose(lines["mha"].get_ydata(), 0.3, atol=1e-12)
    np.testing.assert_allclose(lines["mla"].get_ydata(), -0.1, atol=1e-12)
    np.testing.assert_array_equal(lines["mla"].get_xdata(), 200.0 * np.arange(12))
    assert fig.left_out == {"tpa/zero_out": "no partner run named like '{variant}/gpt'"}
    assert "left out — tpa/zero_out" in _figure_text(fig)


def test_pairing_errors_say_what_to_write(pairs: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match=r"needs a \{name\} placeholder"):
        differences.pair_runs(["a"], "zero_out", "gpt")
    with pytest.raises(ValueError, match=r"uses \['init'\], which '\{variant\}/zero_out' does not"):
        differences.pair_runs(["a"], "{variant}/zero_out", "{variant}/{init}")
    with pytest.raises(ValueError, match="no run is named like 'x/{v}'; the runs are: a, b"):
        differences.pair_runs(["a", "b"], "x/{v}", "y/{v}")
    with pytest.raises(ValueError, match="either a baseline run or a pair"):
        differences.metric_diff(pairs, "train/loss", "mha/gpt", pair=("{v}/zero_out", "{v}/gpt"))


def test_smoothing_is_tensorboards_debiased_ema(pairs: pd.DataFrame) -> None:
    weight = 0.8
    fig = differences.metric_diff(
        pairs, "train/loss", pair=("{variant}/zero_out", "{variant}/gpt"), smoothing=weight
    )
    (mha,) = [line for line in fig.axes[0].get_lines() if line.get_label() == "mha"]
    np.testing.assert_allclose(mha.get_ydata(), 0.3, atol=1e-12)  # a constant stays constant
    raw = np.array([1.0, 0.0, 2.0, 4.0])
    expected, last = [], 0.0
    for count, value in enumerate(raw, start=1):  # TensorBoard's smoothing, written out
        last = last * weight + (1 - weight) * value
        expected.append(last / (1 - weight**count))
    np.testing.assert_allclose(differences.ema(raw, weight), expected)
    with pytest.raises(ValueError, match=r"smoothing weight must be in \[0, 1\), got 1.0"):
        differences.metric_diff(
            pairs, "train/loss", pair=("{v}/zero_out", "{v}/gpt"), smoothing=1.0
        )


def _analyzed(rows: pd.DataFrame) -> pd.DataFrame:
    """A model analyzed at rest: only step 0 of the stable rank, no compression."""
    at_rest = rows[(rows.run == "d4") & (rows.step == 0) & (rows.metric == "stable_rank")]
    return at_rest.assign(run="gpt2")


def test_single_point_runs_are_markers_not_invisible_lines(rows: pd.DataFrame) -> None:
    fig = charts.rank_vs_steps(pd.concat([rows[rows.run == "d4"], _analyzed(rows)]), layer=0)
    lines = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("gpt2")]
    assert len(lines) == 6 and all(line.get_marker() == "o" for line in lines)
    assert all(len(line.get_xdata()) == 1 for line in lines)
    others = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("d4")]
    assert all(line.get_marker() in (None, "None", "") for line in others)


def test_compression_leaves_out_a_single_snapshot_run_and_says_why(rows: pd.DataFrame) -> None:
    both = pd.concat([rows[rows.run == "d4"], _analyzed(rows)])
    for fig in (charts.compression_by_layer(both), charts.compression_wave(both, role="Q")):
        assert fig.left_out == {"gpt2": "one snapshot (step 0), nothing to compress against"}
        assert "gpt2: one snapshot (step 0)" in _figure_text(fig)
        assert len([ax for ax in fig.axes if ax.get_title().endswith("— d4")]) == 1


def test_compression_from_stable_rank_starts_at_the_first_finite_snapshot(
    rows: pd.DataFrame,
) -> None:
    ranks = rows[(rows.metric == "stable_rank") & (rows.run == "d4")].copy()
    zero_at_init = (ranks.step == 0) & (ranks.role == "O")
    ranks.loc[zero_at_init, "value"] = np.nan  # a zero-initialised O: no stable rank at step 0
    computed, left_out = charts.compression_rows(ranks)
    o = computed[(computed.role == "O") & (computed.layer == 1)].set_index("step")["value"]
    sr = ranks[(ranks.role == "O") & (ranks.layer == 1)].set_index("step")["value"]
    assert np.isnan(o[0]) and o[10] == pytest.approx(0.0) and not left_out
    assert o[20] == pytest.approx(100 * (1 - sr[20] / sr[10]))


def test_metric_diff_against_a_single_point_baseline_is_an_error(rows: pd.DataFrame) -> None:
    losses = rows[rows.metric == "train/loss"]
    single = losses[(losses.run == "d4") & (losses.step == 0)].assign(run="at-rest")
    with pytest.raises(ValueError, match="baseline 'at-rest' has `train/loss` at one step only"):
        differences.metric_diff(pd.concat([losses, single]), "train/loss", baseline="at-rest")


def test_selection_errors_list_the_layers_and_roles_that_exist(rows: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match="with layer=99; there are layers: 0, 1, 2, 3, 4, 5"):
        charts.rank_vs_steps(rows, layer=99)
    with pytest.raises(ValueError, match="roles: K, MLP_down, MLP_up, O, Q, V"):
        charts.alpha_vs_depth(rows, role="MLA")


def test_plotted_values_are_the_lines_and_bars(rows: pd.DataFrame) -> None:
    fig = charts.compression_by_layer(rows[rows.run == "d6"])
    table = charts.plotted_values(fig)
    final = rows[(rows.metric == "compression") & (rows.run == "d6") & (rows.step == 30)]
    expected = final.set_index(["role", "layer"])["value"]
    assert len(table) == 36
    for row in table.itertuples():
        role = {"MLP↑": "MLP_up", "MLP↓": "MLP_down"}.get(row.series, row.series)
        assert row.y == expected[(role, int(row.x))]


def test_final_charts_say_when_nan_makes_them_fall_back_to_an_earlier_step() -> None:
    # Weights turned NaN after step 50: the final charts draw step 50's values and say so
    # (before, groupby().last() skipped the NaN silently and kept step 80 as the step).
    records = []
    for step, value in ((0, 0.3), (50, 0.4), (80, float("nan"))):
        for layer in (0, 1):
            for metric, scale in (("alpha", 1.0), ("compression", 100.0)):
                records.append(
                    (
                        "nanrun",
                        step,
                        metric,
                        "",
                        layer,
                        layer / 1,
                        "Q",
                        None,
                        None,
                        value * scale,
                        0.0,
                    )
                )
    rows = pd.DataFrame.from_records(records, columns=list(TIDY_COLUMNS))
    for fig in (charts.alpha_vs_depth(rows), charts.compression_by_layer(rows)):
        assert "step 80" in fig.fell_back["nanrun"] and "(50-50)" in fig.fell_back["nanrun"]
        assert "earlier step" in _figure_text(fig)
    [line] = charts.alpha_vs_depth(rows).axes[0].get_lines()
    assert list(line.get_ydata()) == [0.4, 0.4]
    finite = rows[rows["step"] < 80]
    assert not getattr(charts.alpha_vs_depth(finite), "fell_back", {})


def _without(rows: pd.DataFrame, run: str, role: str) -> pd.DataFrame:
    return rows[~((rows.run == run) & (rows.role == role))]


def test_alpha_vs_depth_names_a_run_without_the_role() -> None:
    # before: the run without Q was dropped silently and the CLI counted it as drawn
    rows = pd.concat([_rows("a", 4, [0, 10], 0), _without(_rows("b", 4, [0, 10], 1), "b", "Q")])
    fig = charts.alpha_vs_depth(rows, role="Q")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a"]
    assert fig.left_out == {"b": "no alpha of Q"}  # type: ignore[attr-defined]


def test_compression_wave_names_every_run_without_the_role() -> None:
    # before: two of four runs lacked K, one was named, and "3 of 4" were said to be drawn
    rows = pd.concat(
        [
            _rows("a", 3, [0, 10], 0),
            _rows("b", 3, [0, 10], 1),
            _without(_rows("c", 3, [0, 10], 2), "c", "K"),
            _without(_rows("d", 3, [0, 10], 3), "d", "K"),
        ]
    )
    fig = charts.compression_wave(rows, role="K")
    panels = [ax for ax in fig.axes if ax.get_title().startswith("Compression wave")]
    assert len(panels) == 2
    assert fig.left_out == {"c": "no compression of K", "d": "no compression of K"}  # type: ignore[attr-defined]


def test_heatmaps_put_layer_0_at_the_top_as_the_tab_does(rows: pd.DataFrame) -> None:
    panel = [a for a in charts.compression_wave(rows).axes if a.get_title()][0]
    bottom, top = panel.get_ylim()
    assert bottom > top  # the y axis runs downwards: L0 on the first row


def test_compression_bars_leave_no_gap_for_a_role_a_run_lacks() -> None:
    # before: the panel of the run without V kept a gap and a legend entry for it
    rows = pd.concat([_rows("a", 3, [0, 10], 0), _without(_rows("b", 3, [0, 10], 1), "b", "V")])
    ax = [a for a in charts.compression_by_layer(rows).axes if a.get_title()][1]
    _, labels = ax.get_legend_handles_labels()
    assert labels == ["Q", "K", "O", "MLP↑", "MLP↓"]
    assert len(ax.patches) == 3 * 5
    lefts = sorted(p.get_x() for p in ax.patches)
    widths = {round(p.get_width(), 9) for p in ax.patches}
    assert len(widths) == 1 and widths.pop() == pytest.approx(0.8 / 5)  # five bars fill a group
    assert ax.patches[0].get_facecolor()[:3] == pytest.approx((0x1F / 255, 0x77 / 255, 0xB4 / 255))
    assert lefts[0] == pytest.approx(-0.4)


def test_rank_steps_legend_sits_outside_the_curves(rows: pd.DataFrame) -> None:
    fig = charts.rank_vs_steps(rows, layer=0)  # 2 runs x 6 roles: a 12-entry legend
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent()), "the legend covers the curves"


def test_a_long_rank_steps_legend_stays_inside_the_figure() -> None:
    # before: 6 runs x 6 roles, one column of 36 entries, ran past the figure's bottom (the last
    # runs' entries cut off) and constrained_layout collapsed the axes
    rows = pd.concat([_rows(f"run{i}", 2, [0, 10], i) for i in range(6)])
    fig = charts.rank_vs_steps(rows, layer=0)
    ax = fig.axes[0]
    fig.draw_without_rendering()  # lays the figure out as saving it does
    legend, figure = ax.get_legend().get_window_extent(), fig.bbox
    assert len(ax.get_legend().get_texts()) == 36
    assert figure.y0 <= legend.y0 and legend.y1 <= figure.y1, (legend, figure)
    assert legend.x1 <= figure.x1 and not legend.overlaps(ax.get_window_extent())
    assert ax.get_window_extent().width > 4 * fig.dpi  # the axes keep their width (6.5-inch figure)


def test_metric_diff_of_a_spectral_metric_names_layer_and_role(rows: pd.DataFrame) -> None:
    curves = differences.diff_curves(rows, "stable_rank", "d4", layer=1, role="K")
    assert "layer 1" in curves.title and "K" in curves.title
    assert "layer 1" in curves.ylabel and "K" in curves.ylabel


def _expert_rows(seed: int) -> pd.DataFrame:
    """A run of 3 layers: Q a lone matrix, MLP_up 4 experts in each layer; fresh random values."""
    rng = np.random.default_rng(seed)
    records = []
    for step in (0, 10, 20):
        for layer in range(3):
            for metric in ("alpha", "stable_rank", "compression"):
                depth = relative_depth(layer, 3)
                records.append(("m", step, metric, "", layer, depth, "Q", None, rng.uniform(1, 9)))
                for expert in range(4):
                    value = rng.uniform(1, 9)
                    records.append(("m", step, metric, "", layer, depth, "MLP_up", expert, value))
    columns = ["run", "step", "metric", "stack", "layer", "depth", "role", "expert", "value"]
    frame = pd.DataFrame.from_records(records, columns=columns).assign(wall_time=0.0)
    return frame.astype({"layer": "Int64", "expert": "Int64"})


def _as_logged(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows as export reads a default run: each layer's experts as mean/min/max scalars."""
    experts = rows[rows.expert.notna()]
    keys = ["run", "step", "metric", "stack", "layer", "depth", "role"]
    stats = experts.groupby(keys)["value"].agg(["mean", "min", "max"]).reset_index()
    logged = stats.melt(id_vars=keys, var_name="aggregate", value_name="value")
    logged = logged.assign(
        role=logged.role + "/" + logged["aggregate"], expert=pd.NA, wall_time=0.0
    )
    both = pd.concat([rows[rows.expert.isna()], logged.drop(columns="aggregate")])
    return both.astype({"layer": "Int64", "expert": "Int64"})


@pytest.mark.parametrize("form", ["each expert", "logged aggregates", "both"])
def test_an_expert_role_is_drawn_as_its_mean_within_a_min_max_band(form: str) -> None:
    rows = _expert_rows(seed=3)
    experts = rows[rows.expert.notna()]
    drawn = {
        "each expert": rows,
        "logged aggregates": _as_logged(rows),
        "both": pd.concat([_as_logged(rows), experts]),
    }[form]
    final = experts[(experts.metric == "alpha") & (experts.step == 20)].groupby("layer")["value"]
    fig = charts.alpha_vs_depth(drawn, role="MLP_up")
    ax = fig.axes[0]
    by_label = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert sorted(by_label) == ["m", "m max", "m min"]  # one line, not one per expert
    np.testing.assert_allclose(by_label["m"], final.mean().to_numpy())
    np.testing.assert_allclose(by_label["m min"], final.min().to_numpy())
    np.testing.assert_allclose(by_label["m max"], final.max().to_numpy())
    assert len(ax.collections) == 1  # the shaded band
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["m", "min–max over experts"]

    fig = charts.rank_vs_steps(drawn, layer=1)
    table = charts.plotted_values(fig)
    layer1 = experts[(experts.metric == "stable_rank") & (experts.layer == 1)].groupby("step")
    for series, expected in (("MLP↑", layer1.value.mean()), ("MLP↑ min", layer1.value.min())):
        got = table[table.series == series].set_index("x")["y"]
        np.testing.assert_allclose(got.to_numpy(), expected.to_numpy())
    q = rows[(rows.metric == "stable_rank") & (rows.layer == 1) & (rows.role == "Q")]
    np.testing.assert_allclose(table[table.series == "Q"]["y"], q.sort_values("step")["value"])
    assert "Q min" not in set(table.series)  # a lone matrix has no band

    fig = charts.compression_by_layer(drawn)
    ax = [a for a in fig.axes if a.get_title()][0]
    compression = experts[(experts.metric == "compression") & (experts.step == 20)]
    bars = charts.plotted_values(fig)
    mlp = bars[bars.series == "MLP↑"].set_index("x")["y"].sort_index()
    np.testing.assert_allclose(mlp, compression.groupby("layer")["value"].mean())
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["Q", "MLP↑", "min–max over experts"]
    (whiskers,) = ax.collections
    spans = sorted((seg[0][1], seg[1][1]) for seg in whiskers.get_segments())
    expected = compression.groupby("layer")["value"].agg(["min", "max"]).to_numpy()
    np.testing.assert_allclose(sorted(map(tuple, expected)), spans)


def _two_stack_rows(seed: int) -> pd.DataFrame:
    """A T5-like run: encoder and decoder of 2 layers each, Q (and Q_cross in the decoder), with
    stable rank and compression at steps 0, 10, 20: every layer number is in both stacks."""
    rng = np.random.default_rng(seed)
    records = []
    for step in (0, 10, 20):
        for stack, roles in (("enc", ("Q",)), ("dec", ("Q", "Q_cross"))):
            for layer in range(2):
                for role in roles:
                    for metric in ("stable_rank", "compression"):
                        value = rng.uniform(1, 9)
                        depth = relative_depth(layer, 2)
                        records.append(("t5", step, metric, stack, layer, depth, role, value))
    columns = ["run", "step", "metric", "stack", "layer", "depth", "role", "value"]
    frame = pd.DataFrame.from_records(records, columns=columns)
    return frame.assign(expert=pd.NA, wall_time=0.0).astype({"layer": "Int64", "expert": "Int64"})


def test_charts_of_a_two_stack_run_keep_its_encoder_and_decoder_apart() -> None:
    rows = _two_stack_rows(seed=5)
    last = rows[rows.step == 20].set_index(["stack", "layer", "role", "metric"])["value"]

    drawn = charts.plotted_values(charts.rank_vs_steps(rows, layer=0))
    lines = {series: group.set_index("x")["y"] for series, group in drawn.groupby("series")}
    assert set(lines) == {"t5 · enc · Q", "t5 · dec · Q", "t5 · dec · Q_cross"}
    for stack, role in (("enc", "Q"), ("dec", "Q"), ("dec", "Q_cross")):
        assert lines[f"t5 · {stack} · {role}"][20.0] == last[(stack, 0, role, "stable_rank")]

    bars = charts.plotted_values(charts.compression_by_layer(rows))
    assert set(bars.panel) == {
        f"Final compression by layer — t5 · {stack}" for stack in ("enc", "dec")
    }
    for row in bars.itertuples():
        stack = row.panel.rsplit(" · ", 1)[1]
        role = {"Q": "Q", "Q_cross": "Q_cross"}[row.series]
        assert row.y == last[(stack, int(row.x), role, "compression")]

    wave = charts.compression_wave(rows, role="Q")
    assert [ax.get_title() for ax in wave.axes if ax.get_title()] == [
        f"Compression wave of Q — t5 · {stack}" for stack in ("enc", "dec")
    ]
    for ax in (ax for ax in wave.axes if ax.get_title()):
        stack = ax.get_title().rsplit(" · ", 1)[1]
        cells = ax.collections[0].get_array().reshape(2, 3)  # layers x steps
        assert cells[0, -1] == last[(stack, 0, "Q", "compression")]

    steps = charts.plotted_values(
        charts.metric_vs_steps_by_layer(rows, role="Q", metric="stable_rank")
    )
    assert set(steps.series) == {"enc L0", "enc L1", "dec L0", "dec L1"}


def _update_rows(r: float) -> pd.DataFrame:
    """An adapted model's last step: update_energy_rank_90 at most r, and the adapter's r."""
    records = []
    for layer in range(3):
        for i, role in enumerate(ROLES):
            for metric, value in (
                ("update_energy_rank_90", 2.0 + (layer + i) % 6),
                ("update_rank", r),
            ):
                records.append(("a", 10, metric, layer, relative_depth(layer, 3), role, value, 0.0))
    columns = ["run", "step", "metric", "layer", "depth", "role", "value", "wall_time"]
    return pd.DataFrame.from_records(records, columns=columns)


def _legend_beside(fig) -> bool:  # type: ignore[no-untyped-def]
    """The legend lies right of the axes: it covers no curve, bar or tick label."""
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    return legend.x0 >= ax.get_window_extent().x1


def test_titles_axes_and_legends_cover_nothing_and_say_no_word_twice(rows: pd.DataFrame) -> None:
    # before: "rank holding 90 % of of layer 0", the update-rank axis to 10 for r = 8 with its
    # legend over the top tick, and rank-steps legends over the curves
    energy = rows[rows.metric == "stable_rank"].assign(metric="energy_rank_90")
    fig = charts.rank_vs_steps(energy[energy.run == "d4"], layer=0, metric="energy_rank_90")
    assert fig.axes[0].get_title() == "rank holding 90 % of ‖W‖² of layer 0 vs steps"
    assert _legend_beside(fig)
    fig = charts.update_rank_vs_r(_update_rows(8.0))
    assert fig.axes[0].get_ylim()[1] <= 8.5 and _legend_beside(fig)


def test_every_surface_orders_roles_alike() -> None:
    # before: charts and the tab put the six canonical roles first and the rest alphabetically
    # (K_cross before Q_cross, MLP_gate after MLP_down); the tables followed the role map's order
    from spectral_callbacks.names import role_sort_key

    found = ["MLP_down", "MLP_up", "MLP_gate", "O_cross", "Q_cross", "K_cross", "V", "Q"]
    ordered = chart_data.ordered_roles(found)
    assert ordered == sorted(found, key=role_sort_key)
    assert ordered == ["Q", "V", "Q_cross", "K_cross", "O_cross", "MLP_gate", "MLP_up", "MLP_down"]


def test_every_chart_orders_stacks_alike() -> None:
    # before: charts took a run's stacks in first-seen order, which is the tags' alphabetical
    # order (dec before enc), while the tab put enc first
    records = [
        ("t5", 0, "alpha", stack, layer, relative_depth(layer, 2), "Q", 1.0 + layer, 0.0)
        for stack in ("dec", "enc", "top")
        for layer in range(2)
    ]
    columns = ["run", "step", "metric", "stack", "layer", "depth", "role", "value", "wall_time"]
    rows = pd.DataFrame.from_records(records, columns=columns)
    assert [stack for _, stack, _ in chart_data.run_panels(rows)] == ["enc", "dec", "top"]
    fig = charts.alpha_vs_depth(rows)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert [label.split(" ")[-1] for label in labels] == ["enc", "dec", "top"], labels


def test_a_circuit_metric_is_drawn_as_its_heads_mean_within_a_band_named_over_heads(
    tmp_path,
) -> None:
    # before: the band around a layer's heads was labelled "min–max over experts"
    from tab_runs import circuits_run

    from spectral_callbacks.offline.events import read_runs

    rows = read_runs([circuits_run(tmp_path / "gqa")]).rows
    heads = rows[(rows["metric"] == "qk_spectral_norm") & rows["head"].notna()]
    of_layer = heads[heads["layer"] == 1].groupby("step")["value"]
    fig = charts.rank_vs_steps(rows, layer=1, metric="qk_spectral_norm")
    table = charts.plotted_values(fig)
    assert sorted(set(table.series)) == ["heads", "heads max", "heads min"]
    mean = table[table.series == "heads"].set_index("x")["y"]
    assert mean.index.tolist() == of_layer.mean().index.tolist()  # one point per step
    np.testing.assert_allclose(mean, of_layer.mean(), rtol=1e-6)
    np.testing.assert_array_equal(table[table.series == "heads min"]["y"], of_layer.min())
    np.testing.assert_array_equal(table[table.series == "heads max"]["y"], of_layer.max())
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["heads", "min–max over heads"]
