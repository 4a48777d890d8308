"""A run logged with circuits=True read back: export's head column, the heads plot kinds."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from gpt import GPT, GPTConfig

from spectral_callbacks import charts
from spectral_callbacks.cli.main import main
from spectral_callbacks.monitor.tracker import SpectralTracker
from spectral_callbacks.offline.events import read_runs


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    logdir = tmp_path_factory.mktemp("runs") / "gqa"
    model = GPT(
        GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=16, attention="gqa")
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = SpectralTracker(
        model, logdir=logdir, circuits=True, synchronous=True, figures=False, every_n_steps=2
    )
    tracker.begin(0)
    for step in range(1, 5):
        idx = torch.randint(0, 256, (4, 16))
        model(idx, idx)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    return logdir


def test_export_reads_each_heads_value_with_its_head(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.csv"
    assert main(["export", str(run), "-o", str(out)]) == 0
    rows = pd.read_csv(out)
    heads = rows[rows["role"] == "heads"]
    assert sorted(heads["head"].dropna().astype(int).unique()) == [0, 1, 2, 3]
    assert set(heads["metric"]) == {
        "qk_spectral_norm",
        "qk_logit_bound",  # the example GQA: no biases, no RoPE, its scale declared
        "qk_stable_rank",
        "ov_spectral_norm",
        "ov_stable_rank",
    }
    assert rows.loc[rows["role"] == "Q", "head"].isna().all()
    last = heads[(heads["step"] == heads["step"].max()) & (heads["metric"] == "qk_spectral_norm")]
    per_layer_max = last.groupby("layer")["value"].max()
    logged_max = rows[(rows["role"] == "heads/max") & (rows["metric"] == "qk_spectral_norm")]
    logged_max = logged_max[logged_max["step"] == heads["step"].max()].set_index("layer")["value"]
    np.testing.assert_allclose(per_layer_max.sort_index(), logged_max.sort_index())


def test_the_heads_heatmap_shows_each_layer_and_head_at_the_last_step(run: Path) -> None:
    rows = read_runs([run]).rows
    grid, step = charts.head_grid(rows)
    assert step == 4 and grid.shape == (3, 4)
    fig = charts.heads_by_layer(rows)
    [mesh] = fig.axes[0].collections
    np.testing.assert_allclose(np.asarray(mesh.get_array()).reshape(3, 4), grid.to_numpy())
    assert "step 4" in fig.axes[0].get_title()


def test_the_head_lines_of_one_layer_and_the_plot_kinds(run: Path, tmp_path: Path) -> None:
    rows = read_runs([run]).rows
    fig = charts.heads_vs_steps(rows, layer=1, metric="ov_stable_rank")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["H00", "H01", "H02", "H03"]
    want = rows[(rows["metric"] == "ov_stable_rank") & (rows["layer"] == 1) & (rows["head"] == 2)]
    np.testing.assert_allclose(lines[2].get_ydata(), want.sort_values("step")["value"])
    for kind in ("heads", "head-steps"):
        out = tmp_path / f"{kind}.png"
        assert main(["plot", str(run), "--kind", kind, "-o", str(out)]) == 0
        assert out.stat().st_size > 0
    with pytest.raises(ValueError, match="no per-head 'alpha'; train with circuits=True"):
        charts.heads_by_layer(rows, metric="alpha")


def test_the_tabs_heads_views_read_the_same_values(run: Path) -> None:
    from spectral_callbacks.tensorboard_plugin import views

    rows = read_runs([run]).rows.assign(run="gqa")
    grid, step = charts.head_grid(rows)
    body = views.heads_by_layer(rows, ["gqa"], "qk_spectral_norm", None)
    [panel] = body["runs"]
    assert (panel["step"], panel["layers"], panel["heads"]) == (step, [0, 1, 2], [0, 1, 2, 3])
    np.testing.assert_allclose(panel["values"], grid.to_numpy())
    early = views.heads_by_layer(rows, ["gqa"], "qk_spectral_norm", 3)["runs"][0]
    assert early["step"] == 2  # the latest snapshot at or before step 3 (snapshots 0, 1, 2, 4)
    series = views.curves_by_head(rows, ["gqa"], "qk_spectral_norm", 2, 100)
    assert [s["head"] for s in series] == [0, 1, 2, 3]
    want = rows[(rows["metric"] == "qk_spectral_norm") & (rows["layer"] == 2) & (rows["head"] == 1)]
    np.testing.assert_allclose(series[1]["values"], want.sort_values("step")["value"])


def _tidy_rows_example() -> str:
    """The pandas example of docs/cli.md's "Tidy rows" section."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = text.split("## Tidy rows", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    return code


def test_the_docs_pandas_example_reads_each_heads_rows_by_its_column(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # before: a user following the docs' attribute style wrote rows.head.notna(), which is
    # DataFrame.head (the method), not the head column, and failed
    code = _tidy_rows_example()
    attributes = re.findall(r"\brows\.(\w+)\b(?!\()", code)
    assert attributes == [], f"docs/cli.md reads columns as attributes: {attributes}"
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run), "-o", "runs.parquet"]) == 0
    scope: dict[str, object] = {}
    exec(compile(code, "docs/cli.md", "exec"), scope)  # noqa: S102 - the documented example
    heads = scope["heads"]
    assert isinstance(heads, pd.DataFrame) and len(heads) > 0
    assert heads["head"].notna().all() and set(heads["metric"]) == {"qk_spectral_norm"}
    assert set(heads["head"]) == {0, 1, 2, 3}
