"""The SPECTRAL tab's routes, served by TensorBoard's own WSGI app over its multiplexer data provider.

Every view's JSON is checked against what ``spectral-callbacks export`` reads from the same event
files (``spectral_callbacks.offline.events.read_runs``, which reads the files itself, not through
TensorBoard), on two real training runs; downsampled views against a long synthetic series.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_runs import training_runs
from tab_runs import circuits_run, several_models
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from torch.utils.tensorboard import SummaryWriter
from werkzeug import test as werkzeug_test
from werkzeug import wrappers

from spectral_callbacks.chart_data import compression_rows, ordered_roles
from spectral_callbacks.charts import compression_wave
from spectral_callbacks.names import NUM_LAYERS_TAG, scalar_tag
from spectral_callbacks.offline.events import read_runs
from spectral_callbacks.tensorboard_plugin import views
from spectral_callbacks.tensorboard_plugin.plugin import SpectralPlugin

ROUTE = "/data/plugin/spectral/"


class CountingProvider:
    """The data provider, counting its calls (to see the cache work and what a view costs)."""

    def __init__(self, inner: data_provider.MultiplexerDataProvider) -> None:
        self.inner, self.reads, self.last_reads = inner, 0, 0

    def read_scalars(self, *args, **kwargs):
        self.reads += 1
        return self.inner.read_scalars(*args, **kwargs)

    def read_last_scalars(self, *args, **kwargs):
        self.last_reads += 1
        return self.inner.read_last_scalars(*args, **kwargs)

    def read_tensors(self, *args, **kwargs):  # the alerts' text entries
        return self.inner.read_tensors(*args, **kwargs)

    def calls(self) -> tuple[int, int]:
        return self.reads, self.last_reads


class Tab:
    """TensorBoard's WSGI app with only the SPECTRAL plugin, over ``logdir``."""

    def __init__(self, logdir: Path) -> None:
        # tensor_size_guidance 0: keep every point (TensorBoard's server keeps 1,000 per series).
        self.multiplexer = plugin_event_multiplexer.EventMultiplexer(
            tensor_size_guidance={"scalars": 0, "text": 0}
        )
        self.multiplexer.AddRunsFromDirectory(str(logdir))
        self.multiplexer.Reload()
        self.provider = CountingProvider(
            data_provider.MultiplexerDataProvider(self.multiplexer, str(logdir))
        )
        context = base_plugin.TBContext(logdir=str(logdir), data_provider=self.provider)
        app = application.TensorBoardWSGI([SpectralPlugin(context)])
        self.client = werkzeug_test.Client(app, wrappers.Response)

    def get(self, route: str, **params: object) -> dict:
        response = self.client.get(ROUTE + route, query_string=params)
        assert response.status_code == 200, response.get_data(as_text=True)
        return response.get_json()

    def fail(self, route: str, **params: object) -> tuple[int, str]:
        response = self.client.get(ROUTE + route, query_string=params)
        return response.status_code, response.get_data(as_text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return training_runs(tmp_path_factory) / "tb"


@pytest.fixture(scope="module")
def tab(runs: Path) -> Tab:
    return Tab(runs)


@pytest.fixture(scope="module")
def exported(runs: Path) -> pd.DataFrame:
    result = read_runs([runs], all_scalars=True)
    assert result.problems == [] and set(result.runs) == {"a", "b"}
    return result.rows


def nan_to_none(values: object) -> list:
    return [None if np.isnan(v) else float(v) for v in values]


def test_runs_lists_what_each_run_logged(tab: Tab, exported: pd.DataFrame) -> None:
    listed = {entry["run"]: entry for entry in tab.get("runs")["runs"]}
    assert set(listed) == {"a", "b"}
    for run, entry in listed.items():
        rows = exported[exported["run"] == run]
        spectral = rows[rows["layer"].notna()]
        assert entry["metrics"] == sorted(spectral["metric"].unique())
        assert set(entry["roles"]) == set(spectral["role"].unique())
        assert entry["layers"] == sorted(int(x) for x in spectral["layer"].unique())
        assert set(entry["scalars"]) == set(rows.loc[rows["role"].isna(), "metric"])


@pytest.mark.parametrize("metric", ["stable_rank", "alpha"])
def test_by_role_equals_export(tab: Tab, exported: pd.DataFrame, metric: str) -> None:
    series = tab.get("by_role", run=["a", "b"], metric=metric, layer=1)["series"]
    expected = exported[(exported["metric"] == metric) & (exported["layer"] == 1)]
    assert len(series) == expected.groupby(["run", "role"]).ngroups == 12
    for line in series:
        rows = expected[(expected["run"] == line["run"]) & (expected["role"] == line["role"])]
        rows = rows.sort_values("step", kind="stable")
        assert line["steps"] == rows["step"].tolist()
        assert line["values"] == nan_to_none(rows["value"])


def test_by_layer_equals_export_with_depth(tab: Tab, exported: pd.DataFrame) -> None:
    series = tab.get("by_layer", run="b", metric="spectral_norm", role="MLP_down")["series"]
    expected = exported[
        (exported["run"] == "b")
        & (exported["metric"] == "spectral_norm")
        & (exported["role"] == "MLP_down")
    ]
    assert [line["layer"] for line in series] == [0, 1, 2]
    for line in series:
        rows = expected[expected["layer"] == line["layer"]].sort_values("step", kind="stable")
        assert line["depth"] == rows["depth"].iloc[0] == line["layer"] / 2
        assert (line["steps"], line["values"]) == (rows["step"].tolist(), rows["value"].tolist())


def test_wave_equals_export(tab: Tab, exported: pd.DataFrame) -> None:
    wave = tab.get("wave", run="a", role="K")  # metric defaults to compression
    rows = exported[
        (exported["run"] == "a") & (exported["metric"] == "compression") & (exported["role"] == "K")
    ]
    grid = rows.pivot_table(index="layer", columns="step", values="value", aggfunc="last")
    assert wave["layers"] == [0, 1, 2]
    assert wave["steps"] == grid.columns.tolist()
    assert wave["values"] == [nan_to_none(line) for line in grid.to_numpy()]
    assert wave["low"] == wave["high"] == wave["values"]  # not downsampled: a column per step


def test_depth_profile_at_a_step_and_at_the_last(tab: Tab, exported: pd.DataFrame) -> None:
    per_layer = exported[exported["layer"].notna()]  # not the mean over layers
    alpha = per_layer[(per_layer["metric"] == "alpha") & (per_layer["role"] == "Q")]
    for step in (12, None):
        params = {"run": ["a", "b"]} | ({"step": step} if step is not None else {})
        profile = tab.get("depth", **params)
        assert profile["steps"] == sorted(alpha["step"].unique().tolist())
        for entry in profile["runs"]:
            rows = alpha[alpha["run"] == entry["run"]]
            at = (
                rows["step"].max() if step is None else rows.loc[rows["step"] <= step, "step"].max()
            )
            rows = rows[rows["step"] == at].sort_values("layer")
            assert entry["steps"] == [at] * 3
            assert entry["layers"] == [0, 1, 2] and entry["depths"] == [0.0, 0.5, 1.0]
            assert entry["values"] == rows["value"].tolist()


def test_bars_equal_the_final_export_rows(tab: Tab, exported: pd.DataFrame) -> None:
    bars = tab.get("bars", run=["a", "b"])
    for panel in bars["runs"]:
        rows = exported[(exported["run"] == panel["run"]) & (exported["metric"] == "compression")]
        rows = rows[rows["layer"].notna()]
        final = rows[rows["step"] == rows["step"].max()]
        assert panel["step"] == rows["step"].max()
        assert panel["roles"] == ["Q", "K", "V", "O", "MLP_up", "MLP_down"]
        for role, values in panel["values"].items():
            expected = final[final["role"] == role].sort_values("layer")["value"]
            assert values == expected.tolist()


def test_diff_vs_tokens_equals_interpolated_export(tab: Tab, exported: pd.DataFrame) -> None:
    body = tab.get("diff", run=["a", "b"], baseline="a", metric="train/loss", x="train/tokens")
    (line,) = body["series"]
    assert line["run"] == "b"

    def by_tokens(run: str) -> tuple[np.ndarray, np.ndarray]:
        of = exported[exported["run"] == run]
        loss = of[of["metric"] == "train/loss"].sort_values("step")
        tokens = of[of["metric"] == "train/tokens"].sort_values("step")
        x = np.interp(loss["step"], tokens["step"], tokens["value"])
        return x, loss["value"].to_numpy()

    xa, ya = by_tokens("a")
    xb, yb = by_tokens("b")
    inside = (xb >= xa.min()) & (xb <= xa.max())
    np.testing.assert_array_equal(line["x"], xb[inside])
    np.testing.assert_allclose(line["values"], yb[inside] - np.interp(xb[inside], xa, ya))


def test_diff_of_a_spectral_metric_needs_one_series(tab: Tab) -> None:
    code, text = tab.fail("diff", run=["a", "b"], baseline="a", metric="stable_rank")
    assert code == 400 and "several (layer, role) series" in text
    body = tab.get("diff", run=["a", "b"], baseline="b", metric="stable_rank", layer=0, role="V")
    assert [line["run"] for line in body["series"]] == ["a"]


@pytest.mark.parametrize(
    ("route", "params", "message"),
    [
        ("by_role", {"run": "a", "layer": "x"}, "`layer` must be an int >= 0, got 'x'"),
        ("by_layer", {}, "pass at least one `run`"),
        ("wave", {"role": "Q"}, "`run` is required"),
        ("by_role", {"run": "a", "max_points": 2}, "`max_points` must be an int >= 4"),
        (
            "diff",
            {"run": ["a", "b"], "metric": "train/loss", "baseline": "c"},
            "not one of the runs",
        ),
        (  # a run of the logdir that lacks the matrix: not "not one of the runs"
            "diff",
            {
                "run": ["a", "b"],
                "metric": "stable_rank",
                "layer": 0,
                "role": "Q_down",
                "baseline": "a",
            },
            "the baseline 'a' has no stable_rank of layer 0 Q_down; pick a baseline that logged it",
        ),
    ],
)
def test_bad_parameters_answer_400_with_what_to_pass(
    tab: Tab, route: str, params: dict, message: str
) -> None:
    code, text = tab.fail(route, **params)
    assert code == 400 and message in text


@pytest.mark.parametrize(
    ("route", "params", "message"),
    [
        ("by_role", {"run": "c"}, "`run` must be a run of this logdir (a, b), got 'c'"),
        (
            "by_layer",
            {"run": ["a", "c", "d"]},
            "`run` must be a run of this logdir (a, b), got 'c', 'd'",
        ),
        ("wave", {"run": "c"}, "`run` must be a run of this logdir (a, b), got 'c'"),
        ("depth", {"run": "../a"}, "`run` must be a run of this logdir (a, b), got '../a'"),
        ("bars", {"run": "c"}, "`run` must be a run of this logdir (a, b), got 'c'"),
        ("heads", {"run": "c"}, "`run` must be a run of this logdir (a, b), got 'c'"),
        ("by_head", {"run": "c"}, "`run` must be a run of this logdir (a, b), got 'c'"),
        (
            "by_role",
            {"run": "a", "metric": "stable_rnk"},
            "`metric` must be a metric run 'a' logged (alpha, alpha_r2, compression, ",
        ),
        ("by_layer", {"run": ["a", "b"], "metric": "nope"}, "the runs asked for logged (alpha, "),
        ("wave", {"run": "a", "metric": "loss"}, "got 'loss'"),
        ("bars", {"run": "a", "metric": "train/loss"}, "got 'train/loss'"),
        ("depth", {"run": "a", "metric": "qk_spectral_norm"}, "got 'qk_spectral_norm'"),
        (
            "heads",
            {"run": "a"},
            "`metric` must be a per-head metric (circuits=True) run 'a' logged (none), "
            "got 'qk_spectral_norm'",
        ),
        (
            "by_role",
            {"run": "a", "layer": 9},
            "`layer` must be a layer of run 'a' (0, 1, 2), got 9",
        ),
        (
            "by_role",
            {"run": ["a", "b"], "metric": "alpha", "layer": 3},
            "`layer` must be a layer of the runs asked for (0, 1, 2), got 3",
        ),
        (
            "by_layer",
            {"run": "a", "role": "q"},
            "`role` must be a role of run 'a' (K, MLP_down, MLP_up, O, Q, V), got 'q'",
        ),
        ("wave", {"run": "a", "role": "Q_cross"}, "`role` must be a role of run 'a' ("),
        ("depth", {"run": "a", "role": "KV"}, "got 'KV'"),
    ],
)
def test_an_unknown_run_metric_layer_or_role_answers_400_naming_what_was_logged(
    tab: Tab, route: str, params: dict, message: str
) -> None:
    # before: HTTP 200 with empty data ({"series": []}), the page drawing an empty chart
    code, text = tab.fail(route, **params)
    assert code == 400 and message in text, text
    assert "\n" not in text.strip()


def test_static_files_served_and_nothing_outside(tab: Tab) -> None:
    response = tab.client.get(ROUTE + "static/index.js")
    assert response.status_code == 200 and response.mimetype == "text/javascript"
    assert b"export async function render" in response.get_data()
    for path in ("static/../plugin.py", "static/%2e%2e/plugin.py", "static/missing.js"):
        assert tab.client.get(ROUTE + path).status_code == 404


def test_entry_point_names_the_plugin() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["tensorboard_plugins"]["spectral"]
    module, name = target.split(":")
    assert getattr(__import__(module, fromlist=[name]), name) is SpectralPlugin
    assert (
        "static/*.js"
        in pyproject["tool"]["setuptools"]["package-data"]["spectral_callbacks.tensorboard_plugin"]
    )


# --- a long run: downsampling and the cache ---------------------------------------------------


@pytest.fixture
def long_run(tmp_path: Path) -> Path:
    """One 3-layer run of 5,000 steps whose layer 1 Q has a spike down and up mid-run."""
    rng = np.random.default_rng(0)
    with SummaryWriter(str(tmp_path / "long")) as writer:
        writer.add_scalar(NUM_LAYERS_TAG, 3, 0)
        for step in range(5_000):
            for layer in range(3):
                value = 50.0 - step / 200 + rng.normal() * 0.1
                if layer == 1 and step == 1234:
                    value = -40.0
                if layer == 1 and step == 3210:
                    value = 140.0
                writer.add_scalar(scalar_tag("stable_rank", layer, "Q"), value, step)
    return tmp_path


def test_downsampled_lines_keep_first_last_min_max(long_run: Path) -> None:
    tab = Tab(long_run)
    rows = read_runs([long_run]).rows
    series = tab.get("by_layer", run="long", metric="stable_rank", role="Q", max_points=200)
    for line in series["series"]:
        full = rows[rows["layer"] == line["layer"]].sort_values("step")
        assert 4 <= len(line["steps"]) <= 200 < len(full)
        kept = full.set_index("step").loc[line["steps"], "value"]
        assert line["values"] == kept.tolist()  # every kept point is a real logged point
        must = {
            full["step"].iloc[0],
            full["step"].iloc[-1],
            full.loc[full["value"].idxmin(), "step"],
            full.loc[full["value"].idxmax(), "step"],
        }
        assert must <= set(line["steps"])
    spiky = series["series"][1]
    assert min(spiky["values"]) == pytest.approx(-40.0) and max(spiky["values"]) == 140.0


def test_downsampled_wave_keeps_ends_and_extremes_per_column(long_run: Path) -> None:
    tab = Tab(long_run)
    wave = tab.get("wave", run="long", metric="stable_rank", role="Q", max_columns=50)
    assert len(wave["steps"]) <= 51 and wave["steps"][0] == 0 and wave["steps"][-1] == 4_999
    layer = wave["layers"].index(1)
    assert min(wave["low"][layer]) == pytest.approx(-40.0)
    assert max(wave["high"][layer]) == 140.0
    rows = read_runs([long_run]).rows
    full = rows[rows["layer"] == 1].set_index("step")["value"]
    assert wave["values"][layer] == full.loc[wave["steps"]].tolist()


def test_unchanged_series_come_from_the_cache_and_new_points_show(long_run: Path) -> None:
    tab = Tab(long_run)
    first = tab.get("by_role", run="long", layer=2)
    reads = tab.provider.reads
    assert tab.get("by_role", run="long", layer=2) == first
    assert tab.provider.reads == reads  # a poll of an unchanged run reads nothing
    with SummaryWriter(str(long_run / "long")) as writer:  # the run goes on
        writer.add_scalar(scalar_tag("stable_rank", 2, "Q"), 7.0, 6_000)
    tab.multiplexer.Reload()
    (line,) = tab.get("by_role", run="long", layer=2, max_points=100_000)["series"]
    assert tab.provider.reads == reads + 1
    assert (line["steps"][-1], line["values"][-1]) == (6_000, 7.0)


def test_compression_not_logged_is_computed_from_stable_rank(tmp_path: Path) -> None:
    """As the CLI charts do: 100 (1 - s_t / s_0), s_0 each matrix's first snapshot."""
    with SummaryWriter(str(tmp_path / "ranks")) as writer:
        for step, scale in ((0, 1.0), (10, 0.5), (20, 0.25)):
            for layer in range(2):
                writer.add_scalar(scalar_tag("stable_rank", layer, "K"), 8.0 * scale + layer, step)
    tab = Tab(tmp_path)
    tab.get("runs")
    wave = tab.get("wave", run="ranks", role="K")
    expected = [
        [100 * (1 - (8.0 * s + layer) / (8.0 + layer)) for s in (1.0, 0.5, 0.25)]
        for layer in range(2)
    ]
    np.testing.assert_allclose(wave["values"], expected)
    bars = tab.get("bars", run="ranks")
    np.testing.assert_allclose(bars["runs"][0]["values"]["K"], [e[-1] for e in expected])
    assert bars["steps"] == [0, 10, 20]


def test_a_run_that_appears_later_is_served_without_asking_runs_first(long_run: Path) -> None:
    tab = Tab(long_run)
    code, text = tab.fail("by_role", run="later")  # not there yet: no run of the logdir
    assert code == 400 and "`run` must be a run of this logdir (long), got 'later'" in text
    with SummaryWriter(str(long_run / "later")) as writer:
        writer.add_scalar(scalar_tag("stable_rank", 0, "V"), 3.0, 0)
    tab.multiplexer.AddRunsFromDirectory(str(long_run))
    tab.multiplexer.Reload()
    (line,) = tab.get("by_role", run="later")["series"]
    assert (line["role"], line["steps"], line["values"]) == ("V", [0], [3.0])


def test_each_view_costs_one_read_cold_and_one_check_warm(long_run: Path) -> None:
    """Each provider call is a round trip (~40 ms to TensorBoard's Rust data server): a view
    reads what it lacks in one call, and a poll of an unchanged run only checks last points."""
    tab = Tab(long_run)
    tab.get("runs")

    def cost(route: str, **params: object) -> tuple[int, int]:
        before = tab.provider.calls()
        tab.get(route, run="long", **params)
        return tuple(now - then for now, then in zip(tab.provider.calls(), before, strict=True))

    assert cost("by_layer") == (1, 0)  # (read_scalars, read_last_scalars): nothing to check yet
    assert cost("by_layer") == (0, 1)
    assert cost("by_role", layer=1) == (0, 1)  # layer 1 Q was read by by_layer
    assert cost("depth", metric="stable_rank") == (0, 1)  # the last points say all is current
    assert cost("bars", metric="stable_rank", step=100) == (0, 1)
    assert cost("wave", metric="stable_rank", role="Q") == (0, 1)


def test_serving_logged_compression_does_not_import_torch(tmp_path: Path) -> None:
    """torch takes ~1 s to import: the tab's server needs it only to compute compression."""
    with SummaryWriter(str(tmp_path / "run")) as writer:
        for step in range(3):
            for layer in range(2):
                writer.add_scalar(scalar_tag("compression", layer, "Q"), 10.0 * step, step)
    script = textwrap.dedent(
        f"""
        import sys
        from tensorboard.backend import application
        from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
        from tensorboard.plugins import base_plugin
        from werkzeug import test, wrappers
        from spectral_callbacks.tensorboard_plugin.plugin import SpectralPlugin

        multiplexer = plugin_event_multiplexer.EventMultiplexer()
        multiplexer.AddRunsFromDirectory({str(tmp_path)!r})
        multiplexer.Reload()
        provider = data_provider.MultiplexerDataProvider(multiplexer, {str(tmp_path)!r})
        context = base_plugin.TBContext(data_provider=provider)
        client = test.Client(application.TensorBoardWSGI([SpectralPlugin(context)]), wrappers.Response)
        for route in ("runs", "wave?run=run", "bars?run=run", "by_layer?run=run&metric=compression"):
            assert client.get("/data/plugin/spectral/" + route).status_code == 200, route
        print("torch" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stdout + done.stderr


# --- runs of different models: stacks, experts, one snapshot, alerts ---------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    return several_models(tmp_path_factory)


@pytest.fixture(scope="module")
def models_tab(models: tuple[Path, list]) -> Tab:
    tab = Tab(models[0])
    tab.get("runs")
    return tab


@pytest.fixture(scope="module")
def models_exported(models: tuple[Path, list]) -> pd.DataFrame:
    return read_runs([models[0]], all_scalars=True).rows


def _line_of(rows: pd.DataFrame) -> tuple[list, list]:
    rows = rows.sort_values("step", kind="stable")
    return rows["step"].tolist(), nan_to_none(rows["value"])


def test_a_layer_of_one_stack_is_that_stacks_layer(
    models_tab: Tab, models_exported: pd.DataFrame
) -> None:
    # before: layer 0 of the encoder and of the decoder were one series per role (8 points)
    rows = models_exported[
        (models_exported["run"] == "2-t5")
        & (models_exported["metric"] == "stable_rank")
        & (models_exported["layer"] == 0)
    ]
    for stack in ("enc", "dec"):
        series = models_tab.get("by_role", run="2-t5", layer=0, stack=stack)["series"]
        of_stack = rows[rows["stack"] == stack]
        assert [line["role"] for line in series] == ordered_roles(of_stack["role"].unique())
        assert ("Q_cross" in {line["role"] for line in series}) == (stack == "dec")
        for line in series:
            expected = _line_of(of_stack[of_stack["role"] == line["role"]])
            assert (line["steps"], line["values"]) == expected
    # a model with one stack is in either stack: the decoder-only run beside the T5 decoder
    both = models_tab.get("by_layer", run=["1-gpt2", "2-t5"], role="Q", stack="dec")["series"]
    assert [(line["run"], line["layer"]) for line in both] == [
        ("1-gpt2", 0), ("1-gpt2", 1), ("1-gpt2", 2), ("2-t5", 0), ("2-t5", 1), ("2-t5", 2)
    ]  # fmt: skip
    assert [line["depth"] for line in both[3:]] == [0.0, 0.5, 1.0]


def test_the_depth_profile_has_a_curve_per_stack_with_depth_within_it(
    models_tab: Tab, models_exported: pd.DataFrame
) -> None:
    profile = models_tab.get("depth", run=["1-gpt2", "2-t5"])  # alpha of Q at the last step
    assert [(p["run"], p["stack"]) for p in profile["runs"]] == [
        ("1-gpt2", ""),
        ("2-t5", "enc"),
        ("2-t5", "dec"),
    ]
    alpha = models_exported[
        (models_exported["metric"] == "alpha")
        & (models_exported["role"] == "Q")
        & models_exported["layer"].notna()
    ]
    for entry in profile["runs"]:
        rows = alpha[(alpha["run"] == entry["run"]) & (alpha["stack"] == entry["stack"])]
        rows = rows[rows["step"] == rows["step"].max()].sort_values("layer")
        layers = len(rows)
        assert entry["layers"] == list(range(layers))  # 2 encoder blocks, 3 decoder blocks
        assert entry["depths"] == [i / (layers - 1) for i in range(layers)]
        assert entry["values"] == rows["value"].tolist()


def test_a_role_of_experts_is_its_mean_with_the_min_and_max_beside_it(
    models_tab: Tab, models_exported: pd.DataFrame
) -> None:
    # before: the mean, min and max were three roles ("MLP_up/mean", ...) and took spare colours
    (entry,) = [e for e in models_tab.get("runs")["runs"] if e["run"] == "3-mixtral"]
    assert not [role for role in entry["roles"] if "/" in role]
    assert set(entry["expert_roles"]) >= {"MLP_up", "MLP_down"}
    assert entry["role_colors"]["MLP_up"] == "#9467bd"  # the CLI's MLP_up colour
    rows = models_exported[
        (models_exported["run"] == "3-mixtral")
        & (models_exported["metric"] == "stable_rank")
        & (models_exported["layer"] == 1)
    ]
    series = models_tab.get("by_role", run="3-mixtral", layer=1)["series"]
    for line in series:
        if line["role"] not in entry["expert_roles"]:
            assert "low" not in line
            continue
        role = line["role"]
        for key, aggregate in (("values", "mean"), ("low", "min"), ("high", "max")):
            steps, values = _line_of(rows[rows["role"] == f"{role}/{aggregate}"])
            assert (line["steps"], line[key]) == (steps, values), (role, aggregate)
        assert all(
            lo <= m <= hi
            for lo, m, hi in zip(line["low"], line["values"], line["high"], strict=True)
        )
    bars = models_tab.get("bars", run="3-mixtral", metric="stable_rank")["runs"][0]
    last = rows["step"].max()
    for role, spread in bars["spread"].items():
        at = rows[rows["step"] == last]
        assert spread["high"][1] == at.loc[at["role"] == f"{role}/max", "value"].item()
        assert spread["low"][1] == at.loc[at["role"] == f"{role}/min", "value"].item()


def test_one_snapshot_has_no_compression_and_says_why_as_the_command_line_does(
    models_tab: Tab, models_exported: pd.DataFrame
) -> None:
    analyzed = models_exported[models_exported["run"] == "4-analyzed"]
    reason = compression_rows(analyzed, allow_none=True)[1]["4-analyzed"]
    assert reason == "one snapshot (step 0), nothing to compress against"
    # the command line says the same (before: "compression-wave needs per-layer `stable_rank`
    # rows; the rows hold: nothing", of a run that holds them)
    with pytest.raises(ValueError, match=re.escape(f"no run to draw — 4-analyzed: {reason}")):
        compression_wave(analyzed)
    wave = models_tab.get("wave", run="4-analyzed")
    assert (wave["steps"], wave["left_out"]) == ([], reason)
    (panel,) = models_tab.get("bars", run="4-analyzed")["runs"]
    assert (panel["layers"], panel["left_out"]) == ([], reason)
    # its metrics are one point per matrix (drawn as markers by the page)
    series = models_tab.get("by_role", run="4-analyzed", layer=0)["series"]
    assert series and all(line["steps"] == [0] for line in series)


def test_alerts_lists_each_runs_alerts_newest_first(
    models: tuple[Path, list], models_tab: Tab
) -> None:
    raised = models[1]
    assert [(a.step, a.kind, a.matrix) for a in raised] == [
        (2, "sigma_growth", "linear1.weight"),
        (3, "sigma_growth", "linear2.weight"),
    ]
    answer = {
        e["run"]: e
        for e in models_tab.get("alerts", run=["5-alerts", "1-gpt2", "4-analyzed"])["runs"]
    }
    alerts = answer["5-alerts"]
    assert (alerts["counted"], alerts["total"], alerts["counts"]["sigma_growth"]) == (True, 2, 2)
    rows = alerts["alerts"]
    assert [(r["step"], r["kind"], r["matrix"], r["layer"], r["role"]) for r in rows] == [
        (a.step, a.kind, a.matrix, a.layer, a.role) for a in reversed(raised)
    ]
    for row, alert in zip(rows, reversed(raised), strict=True):
        assert row["value"] == pytest.approx(alert.value, rel=1e-3)  # the table's 4 digits
        assert (row["threshold"], row["since_step"]) == (alert.threshold, alert.since_step)
    # a healthy run counts none; analyze's output counts nothing (no alert rules ran)
    assert (answer["1-gpt2"]["counted"], answer["1-gpt2"]["total"]) == (True, 0)
    assert answer["1-gpt2"]["alerts"] == []
    assert (answer["4-analyzed"]["counted"], answer["4-analyzed"]["alerts"]) == (False, [])
    (alone,) = models_tab.get("alerts", run="4-analyzed")["runs"]  # no run with alert counts
    assert (alone["counted"], alone["total"]) == (False, 0)


def test_a_baseline_of_one_snapshot_is_no_curve_and_the_answer_says_so(models_tab: Tab) -> None:
    # before: 400 ("... at one step only ..."), a request the page sent by default and on every
    # poll once analyze's output was the first ticked run with the series
    params = {"run": ["4-analyzed", "1-gpt2"], "metric": "alpha", "layer": 0, "role": "Q"}
    body = models_tab.get("diff", baseline="4-analyzed", **params)
    assert body["series"] == []
    assert body["left_out"] == (
        "the baseline '4-analyzed' has `alpha` at one step only (0): a difference needs a "
        "baseline curve; pick a trained run as the baseline"
    )
    (line,) = models_tab.get("diff", baseline="1-gpt2", **params)["series"]
    assert (line["run"], line["x"]) == ("4-analyzed", [0.0])  # one point against a curve
    assert models_tab.get("diff", baseline="1-gpt2", **params)["left_out"] is None


def test_every_role_of_a_t5_and_of_a_mixtral_has_a_colour_of_its_own(models_tab: Tab) -> None:
    # before: K_cross, Q_cross and Router took the same spare colour (C9), V_cross and MLP_gate C7
    for entry in models_tab.get("runs")["runs"]:
        colors = entry["role_colors"]
        assert len(set(colors.values())) == len(colors), (entry["run"], colors)


def test_importing_the_tab_does_not_import_matplotlib() -> None:
    # The tab's server shapes its charts with chart_data (no matplotlib): a fresh interpreter.
    root = str(Path(__file__).resolve().parents[1])
    code = (
        "import sys, spectral_callbacks.tensorboard_plugin\n"
        "from spectral_callbacks.tensorboard_plugin import plugin, source, views\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# --- a run with per-head circuits ------------------------------------------------------------


@pytest.fixture(scope="module")
def circuits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return circuits_run(tmp_path_factory.mktemp("circuits") / "tb" / "gqa").parent


def test_a_circuit_metric_is_its_heads_mean_with_the_min_and_max_beside_it(
    circuits: Path,
) -> None:
    # before: "Metric vs step" drew qk_spectral_norm as one zig-zag line of the role "heads",
    # each head and their mean in turn (40 points for 8 steps), and /runs listed "heads" among
    # the roles logged over experts
    tab = Tab(circuits)
    (entry,) = tab.get("runs")["runs"]
    assert (entry["expert_roles"], entry["head_roles"]) == ([], ["heads"])
    rows = read_runs([circuits]).rows
    heads = rows[(rows["metric"] == "qk_spectral_norm") & rows["head"].notna()]
    steps = sorted(int(step) for step in heads["step"].unique())
    assert len(steps) == 8 and heads["head"].nunique() == 4
    by_role = tab.get("by_role", run="gqa", metric="qk_spectral_norm", layer=1)["series"]
    by_layer = tab.get("by_layer", run="gqa", metric="qk_spectral_norm", role="heads")["series"]
    # the tab reads a layer's heads through their mean, min and max; from every head's own
    # rows as well (what export gives) the view is the same
    every_head = views.curves_by_role(rows, ["gqa"], "qk_spectral_norm", 1, 2_000)
    assert [line["role"] for line in by_role] == [line["role"] for line in every_head] == ["heads"]
    assert [line["layer"] for line in by_layer] == [0, 1, 2]
    lines = [(1, by_role[0]), (1, every_head[0]), *((line["layer"], line) for line in by_layer)]
    for layer, line in lines:
        of_layer = heads[heads["layer"] == layer].groupby("step")["value"]
        assert line["steps"] == steps  # one point per step
        np.testing.assert_allclose(line["values"], of_layer.mean(), rtol=1e-6)
        assert line["low"] == of_layer.min().tolist() and line["high"] == of_layer.max().tolist()
        assert line["over"] == "heads"
    (panel,) = tab.get("bars", run="gqa", metric="qk_spectral_norm")["runs"]
    assert panel["roles"] == ["heads"] and panel["spread"]["heads"]["over"] == "heads"
    last = heads[heads["step"] == steps[-1]].groupby("layer")["value"]
    assert panel["spread"]["heads"]["high"] == last.max().tolist()


def test_a_stack_or_a_heads_layer_no_run_logged_answers_400(
    models_tab: Tab, circuits: Path
) -> None:
    code, text = models_tab.fail("by_role", run="2-t5", stack="vision")
    assert (
        code == 400 and ("`stack` must be a stack of run '2-t5' (dec, enc), got 'vision'") in text
    )
    # a run of one stack is in every stack: no error for it
    assert models_tab.get("by_role", run="1-gpt2", stack="vision")["series"]
    circuits_tab = Tab(circuits)
    code, text = circuits_tab.fail("by_head", run="gqa", layer=3)
    assert code == 400 and ("`layer` must be a layer of run 'gqa' (0, 1, 2), got 3") in text
    # values each logged, not together: an empty view (the page says "no qk_spectral_norm of
    # Q"), not an error, as the page asks while its role select still stands on Q
    series = circuits_tab.get("by_layer", run="gqa", metric="qk_spectral_norm", role="Q")
    assert series == {"series": []}
