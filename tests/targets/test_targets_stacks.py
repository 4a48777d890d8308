"""Several stacks of blocks: encoder-decoder and two-tower models, numbered within each stack,
cross-attention under its own roles (tiny models built from transformers configs, no hub)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from hf_models import bart, clip, mbart, siglip, t5, vision_encoder_decoder, whisper

from spectral_callbacks.names import parse_tag
from spectral_callbacks.targets import TargetWarning, find_targets, format_targets

transformers = pytest.importorskip("transformers")

SELF = ("Q", "K", "V", "O")
CROSS = ("Q_cross", "K_cross", "V_cross", "O_cross")


# (builder, {stack: (layers, roles every layer has)})
ENCODER_DECODER = {
    "t5": t5,
    "bart": bart,
    "mbart": mbart,
    "whisper": whisper,
    "vision-encoder-decoder": vision_encoder_decoder,
}
TWO_TOWERS = {"clip": clip, "siglip": siglip}


def _find(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)  # no gaps, nothing unmapped
        return find_targets(model)


@pytest.mark.parametrize("name", sorted(ENCODER_DECODER))
def test_encoder_and_decoder_are_stacks_and_the_decoder_has_cross_attention(name):
    targets = _find(ENCODER_DECODER[name]())
    layers = {(t.stack, t.layer, t.num_layers) for t in targets}
    assert layers == {("enc", 0, 2), ("enc", 1, 2), ("dec", 0, 3), ("dec", 1, 3), ("dec", 2, 3)}
    for stack, roles in (("enc", SELF + ("MLP_up", "MLP_down")), ("dec", SELF + CROSS)):
        for layer in range(2 if stack == "enc" else 3):
            found = {t.role for t in targets if (t.stack, t.layer) == (stack, layer)}
            assert set(roles) <= found, (stack, layer, found)
    assert not any(t.role.endswith("_cross") for t in targets if t.stack == "enc")
    assert [t.depth for t in targets if t.stack == "dec" and t.role == "Q_cross"] == [0, 0.5, 1]
    assert "enc 2 layers, dec 3 layers" in format_targets(targets)


def test_t5_relative_attention_bias_stays_an_embedding():
    targets = _find(t5())
    reasons = {s.parameter_name: s.reason for s in targets.skipped}
    bias = [name for name in reasons if "relative_attention_bias" in name]
    assert bias and all(reasons[name] == "embedding" for name in bias)


def test_cross_attention_matrices_are_the_weights_the_decoder_multiplies_by():
    model = t5()
    cross = {t.role: t for t in _find(model) if t.stack == "dec" and t.layer == 1}
    attention = model.decoder.block[1].layer[1].EncDecAttention
    for role, linear in zip(
        CROSS, (attention.q, attention.k, attention.v, attention.o), strict=True
    ):
        assert cross[role].matrix().data_ptr() == linear.weight.data_ptr()
    model = vision_encoder_decoder()
    cross = {t.role: t for t in _find(model) if t.stack == "dec" and t.layer == 2}
    attention = model.decoder.transformer.h[2].crossattention
    k, v = attention.c_attn.weight.t().chunk(2)  # Conv1D stores (in, out); rows [k; v]
    assert torch.equal(cross["Q_cross"].matrix(), attention.q_attn.weight.t())
    assert torch.equal(cross["K_cross"].matrix(), k) and torch.equal(cross["V_cross"].matrix(), v)


@pytest.mark.parametrize("name", sorted(TWO_TOWERS))
def test_text_and_vision_towers_are_stacks(name):
    targets = _find(TWO_TOWERS[name]())
    layers = {(t.stack, t.layer, t.num_layers) for t in targets}
    expected = {("text", i, 3) for i in range(3)} | {("vision", i, 2) for i in range(2)}
    if name == "siglip":  # its attention-pooling head is a block outside both lists of blocks
        expected.add(("top", 0, 1))
        head = [t for t in targets if t.stack == "top"]
        assert all(t.parameter_name.startswith("vision_model.head.") for t in head)
    assert layers == expected
    assert {t.role for t in targets} >= {*SELF, "MLP_up", "MLP_down"}


def test_logged_names_carry_the_stack_only_where_there_are_several():
    from spectral_callbacks.monitor.reporting import Reporter

    targets = _find(t5())
    values = {t.name: {"stable_rank": float(i)} for i, t in enumerate(targets)}
    scalars = Reporter(targets, ("stable_rank",)).scalars(0, values)
    assert "spectral_stable_rank/dec/L02/Q_cross" in scalars
    assert "spectral_stable_rank/enc/L01/MLP_down" in scalars
    assert "spectral_stable_rank/dec/mean/Q" in scalars
    parsed = {parse_tag(tag) for tag in scalars}
    assert {p.stack for p in parsed} == {"enc", "dec"}
    # one tag per matrix: nothing of the encoder overwrote the decoder's
    assert len([p for p in parsed if p.layer is not None]) == len(targets)


@pytest.mark.parametrize("experts", ["aggregate", "each"])
def test_expert_scalars_are_the_mean_min_and_max_over_a_layers_experts(experts):
    from spectral_callbacks.monitor.reporting import Reporter
    from spectral_callbacks.names import MatrixLabel, scalar_tag

    generator = torch.Generator().manual_seed(0)
    targets = [
        MatrixLabel(name=f"h.{layer}.{role}.e{e}", layer=layer, num_layers=2, role=role, expert=e)
        for layer in range(2)
        for role in ("MLP_up", "MLP_down")
        for e in range(4)
    ]
    ranks = torch.rand(len(targets), generator=generator, dtype=torch.float64) * 10 + 1
    values = {t.name: {"stable_rank": float(r)} for t, r in zip(targets, ranks, strict=True)}
    scalars = Reporter(targets, ("stable_rank",), experts=experts).scalars(0, values)
    for layer in range(2):
        for role in ("MLP_up", "MLP_down"):
            mine = [
                values[t.name]["stable_rank"] for t in targets if (t.layer, t.role) == (layer, role)
            ]
            tag = lambda aggregate: scalar_tag("stable_rank", layer, role, 2, aggregate=aggregate)  # noqa: B023, E731
            assert scalars[tag("mean")] == pytest.approx(sum(mine) / 4, rel=1e-12)
            assert scalars[tag("min")] == min(mine) and scalars[tag("max")] == max(mine)
    each = {t.name: scalar_tag("stable_rank", t.layer, t.role, 2, expert=t.expert) for t in targets}
    if experts == "each":
        assert all(scalars[tag] == values[name]["stable_rank"] for name, tag in each.items())
    else:
        assert not set(each.values()) & set(scalars)


def test_the_dashboard_layout_draws_each_stacks_logged_tags():
    from spectral_callbacks.monitor.dashboards import custom_scalars_layout
    from spectral_callbacks.monitor.reporting import Reporter

    targets = _find(t5())
    values = {t.name: {"stable_rank": 1.0} for t in targets}
    logged = Reporter(targets, ("stable_rank",)).scalars(0, values)
    layout = custom_scalars_layout(targets, ("stable_rank",), finite=set(logged))
    drawn = {
        re.sub(r"\\(.)", r"\1", pattern.removeprefix("^").removesuffix("$"))
        for category in layout.category
        for chart in category.chart
        for pattern in chart.multiline.tag
    }
    titles = [category.title for category in layout.category]
    assert "spectral stable_rank dec by layer" in titles
    assert "spectral stable_rank enc by role" in titles
    assert drawn == set(logged)  # every logged tag drawn, none that is never logged


def test_an_analyzed_model_has_relative_depth_within_each_stack(tmp_path):
    from spectral_callbacks.offline.analysis import analyze_model, write_scalars
    from spectral_callbacks.offline.events import read_runs

    rows, num_layers = analyze_model(t5())  # 2 encoder layers, 3 decoder layers
    assert num_layers == 3
    tags = write_scalars(rows, num_layers, tmp_path)
    assert {"spectral_monitor/num_layers/enc", "spectral_monitor/num_layers/dec"} <= set(tags)
    read = read_runs([tmp_path]).rows
    depth = read[read.layer.notna()].groupby(["stack", "layer"])["depth"].unique()
    assert {key: list(value) for key, value in depth.items()} == {
        ("dec", 0): [0.0], ("dec", 1): [0.5], ("dec", 2): [1.0],
        ("enc", 0): [0.0], ("enc", 1): [1.0],
    }  # fmt: skip
