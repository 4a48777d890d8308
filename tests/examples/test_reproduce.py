"""``examples/reproduce.py``: each figure at a tiny size writes its PNG and the CSV of what it plots."""

from __future__ import annotations

import json
from pathlib import Path

import attention_variants
import numpy as np
import pandas as pd
import pytest
import reproduce
import train_gpt
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from spectral_callbacks import charts
from spectral_callbacks.cli import main as cli
from spectral_callbacks.monitor.alerts import ALERT_KINDS
from spectral_callbacks.offline.events import read_runs

GLYPHS = ["Q", "K", "V", "O", "MLP↑", "MLP↓"]
ROLE_OF = {"MLP↑": "MLP_up", "MLP↓": "MLP_down"}


def _written(png: Path, csv: Path) -> pd.DataFrame:
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    return pd.read_csv(csv)


def _panel(fig, prefix: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(prefix)]
    return ax


def _labelled_lines(ax) -> list:
    return [line for line in ax.get_lines() if not str(line.get_label()).startswith("_")]


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    out = tmp_path_factory.mktemp("lifecycle")
    png, csv = reproduce.main(["lifecycle", "--scale", "tiny", "--out", str(out)])
    return png, csv, out / "runs" / "lifecycle" / "D2"


def test_lifecycle_panels_series_and_values(lifecycle: tuple[Path, Path, Path]) -> None:
    png, csv, run = lifecycle
    table = _written(png, csv)
    rows = read_runs([run]).rows
    fig = reproduce.draw_lifecycle(rows)
    ranks = _panel(fig, "(a) layer 0: stable rank by matrix type")
    assert [line.get_label() for line in _labelled_lines(ranks)] == GLYPHS
    assert ranks.get_xlabel() == "optimizer step" and "stable rank" in ranks.get_ylabel()
    bars = _panel(fig, "(b) final compression by layer × type")
    assert [c.get_label() for c in bars.containers] == GLYPHS and len(bars.patches) == 6 * 2
    pd.testing.assert_frame_equal(table, charts.plotted_values(fig))  # the CSV is the figure
    # ... and the figure is the logged run: layer-0 stable rank per step, final compression.
    for glyph in GLYPHS:
        role = ROLE_OF.get(glyph, glyph)
        logged = rows[(rows.metric == "stable_rank") & (rows.layer == 0) & (rows.role == role)]
        drawn = table[table.panel.str.startswith("(a)") & (table.series == glyph)]
        np.testing.assert_array_equal(drawn.x, logged.step)
        np.testing.assert_allclose(drawn.y, logged.value, rtol=1e-12)
        final = rows[(rows.metric == "compression") & (rows.role == role) & rows.layer.notna()]
        final = final[final.step == final.step.max()].sort_values("layer")
        drawn = table[table.panel.str.startswith("(b)") & (table.series == glyph)]
        np.testing.assert_array_equal(drawn.x, final.layer.astype(float))
        np.testing.assert_allclose(drawn.y, final.value, rtol=1e-12)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A tiny GPT-2 and a tiny GPT-NeoX (Pythia's architecture) saved as local model directories."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("pretrained")
    gpt2 = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=32, vocab_size=64)
    transformers.GPT2Model(gpt2).save_pretrained(root / "tiny-gpt2")
    neox = transformers.GPTNeoXConfig(
        num_hidden_layers=4,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=64,
        max_position_embeddings=32,
    )
    transformers.GPTNeoXModel(neox).save_pretrained(root / "tiny-pythia")
    return [root / "tiny-gpt2", root / "tiny-pythia"]


def test_alpha_depth_three_panels_with_pretrained_models(
    tmp_path: Path, pretrained: list[Path]
) -> None:
    argv = ["alpha-depth", "--scale", "tiny", "--out", str(tmp_path), "--pretrained"]
    png, csv = reproduce.main([*argv, *map(str, pretrained)])
    table = _written(png, csv)
    custom = read_runs([tmp_path / "runs" / "alpha-depth"]).rows
    analyzed = {
        model.name: read_runs([tmp_path / "runs" / "pretrained" / model.name]).rows
        for model in pretrained
    }
    panels = {"(a) custom runs": ["D2", "D3", "D4"], "(b) GPT-2": ["tiny-gpt2"]}
    panels["(c) Pythia"] = ["tiny-pythia"]
    assert sorted(table.panel.unique()) == sorted(panels)
    for panel, series in panels.items():
        drawn = table[table.panel == panel]
        assert list(drawn.series.unique()) == series
        for run in series:
            rows = analyzed.get(run, custom)
            alpha = rows[(rows.run == run) & (rows.metric == "alpha") & (rows.role == "Q")]
            alpha = alpha[alpha.layer.notna()]
            alpha = alpha[alpha.step == alpha.step.max()].sort_values("layer")
            points = drawn[drawn.series == run]
            num_layers = len(alpha)
            np.testing.assert_allclose(points.x, np.arange(num_layers) / (num_layers - 1))
            np.testing.assert_allclose(points.y, alpha.value, rtol=1e-12)
    fig = reproduce.draw_alpha_depth(
        custom, reproduce.analyze_pretrained(pretrained, tmp_path / "again")
    )
    assert len(fig.axes) == 3
    for ax in fig.axes:
        assert ax.get_ylim() == reproduce.ALPHA_RANGE and ax.get_xlim() == (-0.05, 1.05)
        assert ax.get_xlabel() == "relative depth i / (L − 1)"
    pd.testing.assert_frame_equal(table, charts.plotted_values(fig))


def test_alpha_depth_without_pretrained_models_says_so() -> None:
    custom = pd.DataFrame(
        {
            "run": "D2",
            "step": 4,
            "metric": "alpha",
            "layer": pd.array([0, 1], dtype="Int64"),
            "depth": [0.0, 1.0],
            "role": "Q",
            "value": [0.7, 0.2],
            "wall_time": 0.0,
        }
    )
    fig = reproduce.draw_alpha_depth(custom, {})
    for ax in fig.axes[1:]:
        assert not ax.get_lines()
        assert [t.get_text() for t in ax.texts] == [
            "no pretrained models given\n(--pretrained DIR ...)"
        ]
    assert [t.get_text() for t in fig.axes[0].texts] == ["1 point outside 0.1–0.6 (α 0.70…0.70)"]
    assert fig.axes[0].get_title() == "(a) custom runs"


def test_pretrained_directories_are_checked(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException, match="holds no config.json"):
        reproduce.analyze_pretrained([tmp_path], tmp_path / "out")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(
        MisconfigurationException,
        match="is a 'llama' model; alpha-depth has panels for gpt2, gpt_neox",
    ):
        reproduce.analyze_pretrained([tmp_path], tmp_path / "out")
    with pytest.raises(MisconfigurationException, match="`--pretrained` is for the alpha-depth"):
        reproduce.main(["lifecycle", "--pretrained", str(tmp_path)])


def test_init_ablation_one_curve_per_variant_equal_to_the_paired_difference(
    tmp_path: Path,
) -> None:
    variants = ["mha", "mla", "gla4"]
    argv = ["init-ablation", "--scale", "tiny", "--out", str(tmp_path), "--variants", *variants]
    png, csv = reproduce.main(argv)
    table = _written(png, csv)
    assert list(table.series.unique()) == ["MHA", "MLA", "GLA-4"]
    rows = read_runs([tmp_path / "runs" / "init-ablation"], all_scalars=True).rows
    weight = reproduce.SCALES["init-ablation"]["tiny"].smoothing
    for variant, label in zip(variants, ["MHA", "MLA", "GLA-4"], strict=True):
        loss = {
            init: rows[(rows.run == f"{variant}/{init}") & (rows.metric == "train/loss")]
            .set_index("step")
            .value
            for init in ("zero_out", "gpt")
        }
        raw = (loss["zero_out"] - loss["gpt"]).to_numpy()  # same tokens per step: same x
        expected, last = [], 0.0
        for count, value in enumerate(raw, start=1):  # TensorBoard's EMA
            last = last * weight + (1 - weight) * value
            expected.append(last / (1 - weight**count))
        drawn = table[table.series == label]
        tokens = rows[(rows.run == f"{variant}/gpt") & (rows.metric == "train/tokens")]
        np.testing.assert_array_equal(drawn.x, tokens.sort_values("step").value)
        np.testing.assert_allclose(drawn.y, expected, rtol=1e-9, atol=1e-12)
        assert np.any(raw != 0)  # the inits really differ
    fig = reproduce.draw_init_ablation(rows, variants, weight)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "training tokens" and "zero_out init − gpt init" in ax.get_ylabel()
    assert len(_labelled_lines(ax)) == 3
    pd.testing.assert_frame_equal(table, charts.plotted_values(fig))


def test_init_ablation_defaults_to_the_nine_variants() -> None:
    args = reproduce.build_parser().parse_args(["init-ablation"])
    assert args.variants == ["mha", "mqa", "gqa", "mla", "mfa", "tpa", "gla2", "gla4", "gta"]


@pytest.mark.parametrize("figure", reproduce.FIGURES)
def test_reference_scale_parses_to_the_studys_sizes(figure: str, tmp_path: Path) -> None:
    args = reproduce.build_parser().parse_args(
        [figure, "--scale", "reference", "--accelerator", "gpu"]
    )
    scale = reproduce.SCALES[figure][args.scale]
    assert scale.width == 768 and scale.steps == (5_000 if figure == "init-ablation" else 10_000)
    flags = reproduce._common(args, scale)
    if figure == "init-ablation":
        parsed = attention_variants.build_parser().parse_args(
            [*flags, "--depth", "8", "--inits", "gpt", "zero_out", "--logdir", str(tmp_path)]
        )
        assert (parsed.width, parsed.steps, parsed.accelerator) == (768, 5_000, "gpu")
        return
    for depth in scale.depths:
        config = train_gpt.check_args(
            train_gpt.build_parser().parse_args([*flags, "--depth", str(depth)])
        )
        assert (config.n_layer, config.n_embd, config.n_head) == (depth, 768, 12)
    assert scale.depths == ((8,) if figure == "lifecycle" else (8, 12, 16))
    assert scale.tokens_per_step == 65_536 and scale.max_bytes is None


def test_a_used_output_directory_is_refused(lifecycle: tuple[Path, Path, Path]) -> None:
    _, csv, _ = lifecycle
    with pytest.raises(MisconfigurationException, match="already holds runs; pass a fresh `--out`"):
        reproduce.main(["lifecycle", "--scale", "tiny", "--out", str(csv.parent)])


def test_existing_runs_are_drawn_without_training(
    lifecycle: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    png, csv, run = lifecycle
    again = reproduce.main(["lifecycle", "--runs", str(run), "--out", str(tmp_path)])
    pd.testing.assert_frame_equal(pd.read_csv(again[1]), pd.read_csv(csv))
    assert not (tmp_path / "runs").exists()


def test_the_lifecycle_run_counts_alerts_and_rank_layers_reads_its_esd(
    lifecycle: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, _, run = lifecycle
    rows = read_runs([run], all_scalars=True).rows
    counts = rows[rows.metric.str.startswith("spectral_alerts/")]
    assert set(counts.metric) == {f"spectral_alerts/{kind}" for kind in ALERT_KINDS}
    assert (counts.value == 0).all()  # logged at every snapshot, none raised
    out = tmp_path / "ranks.json"
    assert cli(["rank-layers", str(run), "--sparsity", "0.6", "--json", str(out)]) == 0
    ranking = json.loads(out.read_text())
    esd = rows[(rows.metric == "esd_alpha") & rows.layer.notna()]
    assert ranking["where"] == f"logged at step {esd.step.max()}"
    matrices = pd.DataFrame(ranking["matrices"])
    assert len(matrices) == 2 * 6 and matrices["alpha"].is_monotonic_increasing
    assert matrices["rank"].tolist() == list(range(1, 13))
    blocks = pd.DataFrame(ranking["blocks"]).sort_values("block_alpha")
    mean = (blocks.sparsity * blocks.params).sum() / blocks.params.sum()
    assert mean == pytest.approx(0.6, rel=1e-12)
    assert blocks.sparsity.is_monotonic_increasing and blocks.sparsity.iloc[-1] > 0.6
