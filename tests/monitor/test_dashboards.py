"""The custom-scalars layout as TensorBoard reads it, and the TensorBoard figures: exact tag matches
(roles that share prefixes), at most five lines a chart, sections collapsed but the first, no chart
that is all NaN; and the default metrics are defined on the default settings."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch.utils.tensorboard import SummaryWriter

from spectral_callbacks import tensorboard_adapter
from spectral_callbacks.integrations.lightning import DEFAULT_METRICS
from spectral_callbacks.monitor import dashboards, figures
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.names import MatrixLabel, scalar_tag

# Roles whose names are prefixes of others: K of KV, K_rope, K_g0, K_A; Q of Q_A; V of V_g0.
PREFIX_ROLES = ("Q", "Q_A", "K", "KV", "K_rope", "K_g0", "K_A", "V", "V_g0", "O")
METRICS = ("stable_rank", "alpha")


def targets_of(roles: tuple[str, ...], num_layers: int) -> list[MatrixLabel]:
    return [
        MatrixLabel(f"{layer}.{role}", layer=layer, num_layers=num_layers, role=role)
        for layer in range(num_layers)
        for role in roles
    ]


def every_tag(roles: tuple[str, ...], num_layers: int, metrics=METRICS) -> list[str]:
    per_layer = [
        scalar_tag(metric, layer, role, num_layers)
        for metric in metrics
        for layer in range(num_layers)
        for role in roles
    ]
    return per_layer + [scalar_tag(metric, None, role) for metric in metrics for role in roles]


def shown_by(chart: layout_pb2.Chart, tags: list[str]) -> list[str]:
    """The tags TensorBoard draws in ``chart``: its frontend joins the patterns as ``(a)|(b)`` and
    the custom_scalars plugin keeps the tags that ``re.match`` it (custom_scalars_plugin.py)."""
    joined = "|".join(f"({pattern})" for pattern in chart.multiline.tag)
    return [tag for tag in tags if re.match(joined, tag)]


def charts_of(layout: layout_pb2.Layout, title: str) -> dict[str, layout_pb2.Chart]:
    [category] = [category for category in layout.category if category.title == title]
    return {chart.title: chart for chart in category.chart}


def test_each_chart_shows_exactly_its_tags_when_roles_share_prefixes() -> None:
    num_layers = 3
    layout = dashboards.custom_scalars_layout(targets_of(PREFIX_ROLES, num_layers), METRICS)
    tags = every_tag(PREFIX_ROLES, num_layers)
    for metric in METRICS:
        by_role = charts_of(layout, f"spectral {metric} by role")
        for role in PREFIX_ROLES:
            expected = [scalar_tag(metric, layer, role, num_layers) for layer in range(3)]
            expected.append(scalar_tag(metric, None, role))  # the mean: never K_rope's mean in K's
            assert shown_by(by_role[role], tags) == expected, role
        by_layer = charts_of(layout, f"spectral {metric} by layer")
        for layer in range(num_layers):
            charts = [
                chart for title, chart in by_layer.items() if title.startswith(f"L{layer:02d}")
            ]
            shown = [tag for chart in charts for tag in shown_by(chart, tags)]
            assert shown == [scalar_tag(metric, layer, role, num_layers) for role in PREFIX_ROLES]


def test_a_pattern_is_the_escaped_tag_anchored_at_both_ends() -> None:
    pattern = dashboards.tag_pattern("spectral_alpha/L00/K.x")
    assert pattern == r"^spectral_alpha/L00/K\.x$"
    assert re.match(pattern, "spectral_alpha/L00/K.x")
    assert not re.match(pattern, "spectral_alpha/L00/KAx")  # '.' is escaped
    assert not re.match(pattern, "spectral_alpha/L00/K.x_rope")  # anchored at the end


@pytest.mark.parametrize("num_layers", [1, 4, 8, 24])
def test_charts_hold_at_most_five_lines_and_every_line_is_somewhere(num_layers: int) -> None:
    roles = ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    layout = dashboards.custom_scalars_layout(targets_of(roles, num_layers), METRICS)
    tags = every_tag(roles, num_layers)
    for category in layout.category:
        for chart in category.chart:
            assert 1 <= len(chart.multiline.tag) <= dashboards.MAX_LINES, chart.title
    for metric in METRICS:
        by_layer = charts_of(layout, f"spectral {metric} by layer")
        by_role = charts_of(layout, f"spectral {metric} by role")
        in_layer_charts = [t for chart in by_layer.values() for t in shown_by(chart, tags)]
        assert sorted(in_layer_charts) == sorted(
            scalar_tag(metric, layer, role, num_layers)
            for layer in range(num_layers)
            for role in roles
        )
        for role in roles:
            charts = [chart for title, chart in by_role.items() if title.split()[0] == role]
            lines = [tag for chart in charts for tag in shown_by(chart, tags)]
            mean = scalar_tag(metric, None, role)
            assert lines.count(mean) == len(charts)  # every chart of a role keeps its mean
            assert [t for t in lines if t != mean] == [
                scalar_tag(metric, layer, role, num_layers) for layer in range(num_layers)
            ]
    if num_layers == 8:  # six roles: attention and MLP apart; eight layers: 4 + 4, each + mean
        assert list(charts_of(layout, "spectral alpha by layer"))[:2] == [
            "L00 Q K V O",
            "L00 MLP_up MLP_down",
        ]
        assert list(charts_of(layout, "spectral alpha by role"))[:2] == ["Q L00-L03", "Q L04-L07"]


def test_only_the_first_section_starts_open() -> None:
    layout = dashboards.custom_scalars_layout(targets_of(("Q", "K"), 2), METRICS)
    assert [category.closed for category in layout.category] == [False, True, True, True]
    assert layout.category[0].title == "spectral stable_rank by layer"


def test_lines_charts_and_sections_without_a_finite_value_are_left_out() -> None:
    targets = targets_of(("Q", "K"), 2)
    finite = {scalar_tag("stable_rank", 0, "Q"), scalar_tag("stable_rank", None, "Q")}
    layout = dashboards.custom_scalars_layout(targets, METRICS, finite=finite)
    assert [category.title for category in layout.category] == [
        "spectral stable_rank by layer",
        "spectral stable_rank by role",
    ]
    [layer_chart] = layout.category[0].chart
    [role_chart] = layout.category[1].chart
    assert (layer_chart.title, list(layer_chart.multiline.tag)) == (
        "L00",
        [dashboards.tag_pattern(scalar_tag("stable_rank", 0, "Q"))],
    )
    assert role_chart.title == "Q" and len(role_chart.multiline.tag) == 2
    assert dashboards.custom_scalars_layout(targets, METRICS, finite=set()).category == []


class RecordingWriter:
    """A writer without ``_get_file_writer``: the layout comes through ``add_custom_scalars``."""

    def __init__(self) -> None:
        self.layouts: list[dict] = []

    def add_custom_scalars(self, layout: dict) -> None:
        self.layouts.append(layout)


def test_layout_is_rewritten_only_when_a_chart_gains_a_finite_line() -> None:
    targets = targets_of(("Q", "K"), 2)
    writer = dashboards.LayoutWriter(targets, ("stable_rank", "energy_rank_90"))
    recorder = RecordingWriter()
    step0 = {tag: 3.0 for tag in every_tag(("Q", "K"), 2, ("stable_rank",))}
    step0.update({tag: math.nan for tag in every_tag(("Q", "K"), 2, ("energy_rank_90",))})
    step0["spectral_monitor/svd_ms"] = 1.0  # not a chart of the layout
    assert writer.update([recorder], step0)
    assert not writer.update([recorder], step0)  # nothing new: no second write
    [first] = recorder.layouts
    assert set(first) == {"spectral stable_rank by layer", "spectral stable_rank by role"}
    later = {
        scalar_tag("energy_rank_90", 1, "K"): 12.0,
        scalar_tag("energy_rank_90", 0, "K"): math.inf,
    }
    assert writer.update([recorder], later)
    assert recorder.layouts[-1]["spectral energy_rank_90 by layer"] == {
        "L01": ["Multiline", [dashboards.tag_pattern(scalar_tag("energy_rank_90", 1, "K"))]]
    }


def test_layout_written_to_a_summary_writer_reads_back_with_closed_sections(tmp_path) -> None:
    layout = dashboards.custom_scalars_layout(targets_of(("Q", "KV"), 2), METRICS)
    with SummaryWriter(str(tmp_path)) as writer:
        tensorboard_adapter.add_layout([writer], layout)
    reader = event_accumulator.EventAccumulator(str(tmp_path))
    reader.Reload()
    [event] = reader.Tensors("custom_scalars__config__")
    read = layout_pb2.Layout()
    read.ParseFromString(event.tensor_proto.string_val[0])
    assert read == layout
    assert [category.closed for category in read.category] == [False, True, True, True]


def test_figures_leave_out_a_metric_that_is_all_nan() -> None:
    rows = pd.DataFrame(
        [
            ("run", step, metric, layer, layer / 2, "Q", value, 0.0)
            for step in (0, 10)
            for layer in range(3)
            for metric, value in (("alpha", math.nan), ("stable_rank", 5.0 + step))
        ],
        columns=["run", "step", "metric", "layer", "depth", "role", "value", "wall_time"],
    )
    drawn = figures.draw_figures(rows)
    assert set(drawn) == {"spectral_figures/stable_rank_vs_steps/L00"}
    rows.loc[(rows["metric"] == "alpha") & (rows["layer"] == 1), "value"] = 0.4
    assert "spectral_figures/alpha_vs_depth/Q" in figures.draw_figures(rows)


def test_every_default_metric_is_defined_on_default_settings() -> None:
    # Fresh Gaussian matrices wider than the default k=32 (a flat spectrum, like an initialized
    # layer): 90 % of the energy lies far beyond the top 32, so energy_rank_90 is unknown (NaN).
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(3, 128, 96, generator=generator)
    values = SpectrumCompute()(SimpleNamespace(key="g"), batch)
    for metric in DEFAULT_METRICS:
        if metric == "compression":  # derived from stable_rank by the reporter
            continue
        assert torch.isfinite(values[metric]).all(), metric
    assert values["energy_rank_90"].isnan().all()  # why it is not a default


def test_tensorboards_custom_scalars_plugin_serves_exactly_each_charts_tags(tmp_path) -> None:
    # TensorBoard's own backend: the plugin's /layout and /scalars routes (their *_impl methods)
    # over the event file, with the frontend's (a)|(b) join of a chart's patterns.
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin
    from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

    targets = targets_of(PREFIX_ROLES, 2)
    tags = every_tag(PREFIX_ROLES, 2, ("alpha",))
    with SummaryWriter(str(tmp_path / "run")) as writer:
        for tag in tags:
            writer.add_scalar(tag, 1.0, 0)
        tensorboard_adapter.add_layout(
            [writer], dashboards.custom_scalars_layout(targets, ("alpha",))
        )
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    plugins: dict = {}
    tb_context = base_plugin.TBContext(
        logdir=str(tmp_path),
        data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(tmp_path)),
        multiplexer=multiplexer,
        plugin_name_to_instance=plugins,
    )
    plugins["scalars"] = ScalarsPlugin(tb_context)
    plugin = CustomScalarsPlugin(tb_context)
    request = context.RequestContext()
    layout = json.loads(plugin.layout_impl(request, ""))  # the route's JSON body
    assert [(c["title"], c.get("closed", False)) for c in layout["category"]] == [
        ("spectral alpha by layer", False),
        ("spectral alpha by role", True),
    ]
    served = []
    for category in layout["category"]:
        for chart in category["chart"]:
            joined = "|".join(f"({pattern})" for pattern in chart["multiline"]["tag"])
            got = sorted(plugin.scalars_impl(request, "run", joined, "")["tag_to_events"])
            expected = sorted(
                t for t in tags if dashboards.tag_pattern(t) in chart["multiline"]["tag"]
            )
            assert got == expected, chart["title"]
            served += got
    assert sorted(served) == sorted(tags + [t for t in tags if "/mean/" not in t])
