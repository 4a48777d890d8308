"""Reading event files back into tidy rows: every point, exact values, depth, damage reported."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pandas as pd
from seeds import run_seed
from torch.utils.tensorboard import SummaryWriter

from spectral_callbacks.names import NUM_LAYERS_TAG, TIDY_COLUMNS, scalar_tag
from spectral_callbacks.offline.events import filter_rows, find_runs, read_event_file, read_runs


def _write_run(
    logdir: Path, *, num_layers: int | None = 4, steps: range = range(0, 30, 10)
) -> dict:
    """A run with every (layer, role) of two metrics, a mean, a loss; returns what was logged."""
    rng = np.random.default_rng(run_seed())  # fresh each run, replayable (tests/seeds.py)
    logged = {}
    with SummaryWriter(str(logdir)) as writer:
        if num_layers is not None:
            writer.add_scalar(NUM_LAYERS_TAG, num_layers, 0)
        for step in steps:
            for metric in ("stable_rank", "alpha"):
                for layer in (*range(4), None):
                    for role in ("Q", "MLP_down"):
                        value = float(rng.normal())
                        tag = scalar_tag(metric, layer, role)
                        writer.add_scalar(tag, value, step)
                        logged[(tag, step)] = value
            writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    return logged


def test_rows_equal_logged_values_exactly_as_float32(tmp_path: Path) -> None:
    logged = _write_run(tmp_path / "run")
    rows = read_runs([tmp_path / "run"]).rows
    assert len(rows) == len(logged)
    for row in rows.itertuples():
        layer = None if row.layer is pd.NA else int(row.layer)
        tag = scalar_tag(row.metric, layer, row.role)
        assert row.value == float(np.float32(logged[(tag, row.step)]))
    assert list(rows.columns) == list(TIDY_COLUMNS)
    per_layer = rows[rows.layer.notna()]
    np.testing.assert_allclose(per_layer.depth, per_layer.layer.astype(float) / 3)
    assert rows[rows.layer.isna()].depth.isna().all()
    assert rows.run.unique().tolist() == ["run"]


def test_long_tag_is_read_whole(tmp_path: Path) -> None:
    tag = scalar_tag("stable_rank", 0, "Q")
    with SummaryWriter(str(tmp_path)) as writer:
        for step in range(10_500):
            writer.add_scalar(tag, step * 0.5, step)
    rows = read_runs([tmp_path]).rows
    assert rows.step.tolist() == list(range(10_500))
    assert rows.value.tolist() == [step * 0.5 for step in range(10_500)]


def test_parent_of_runs_names_runs_by_relative_path(tmp_path: Path) -> None:
    _write_run(tmp_path / "d4" / "version_0")
    _write_run(tmp_path / "d6")
    runs, problems = find_runs([tmp_path])
    assert [run.name for run in runs] == ["d4/version_0", "d6"] and problems == []
    # The same run given twice under different parents: names are made unique with the parent.
    runs, _ = find_runs([tmp_path / "d4", tmp_path / "d4" / "version_0"])
    assert len({run.name for run in runs}) == 2


def test_all_scalars_keeps_other_tags_with_empty_layer_and_role(tmp_path: Path) -> None:
    _write_run(tmp_path)
    rows = read_runs([tmp_path], all_scalars=True).rows
    loss = rows[rows.metric == "train/loss"]
    assert loss.value.tolist() == [float(np.float32(1.0 / (s + 1))) for s in (0, 10, 20)]
    assert loss.layer.isna().all() and loss.role.isna().all()
    assert (rows.metric == NUM_LAYERS_TAG).sum() == 1


def test_depth_falls_back_to_max_layer_and_says_so(tmp_path: Path) -> None:
    _write_run(tmp_path, num_layers=None)
    result = read_runs([tmp_path])
    assert result.notes == [
        f"run {tmp_path.name}: no {NUM_LAYERS_TAG} scalar; depth uses max layer + 1 = 4 layers"
    ]
    assert result.rows[result.rows.layer == 3].depth.eq(1.0).all()


def test_truncated_and_corrupt_files_keep_what_was_read(tmp_path: Path) -> None:
    _write_run(tmp_path / "good")
    (event_file,) = (tmp_path / "good").iterdir()
    whole, problem = read_event_file(event_file)
    assert problem is None
    data = event_file.read_bytes()

    (tmp_path / "cut").mkdir()
    cut = tmp_path / "cut" / event_file.name
    cut.write_bytes(data[: len(data) // 2])
    points, problem = read_event_file(cut)
    assert 0 < len(points) < len(whole) and points == whole[: len(points)]
    assert problem is not None and problem.path == str(cut) and "truncated" in problem.what

    (tmp_path / "flip").mkdir()
    # Walk the records (length u64, crc u32, data, crc u32) to flip a byte inside record 40's data.
    offset = 0
    for _ in range(40):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        offset += 8 + 4 + length + 4
    flipped = bytearray(data)
    flipped[offset + 12] ^= 0xFF
    bad = tmp_path / "flip" / event_file.name
    bad.write_bytes(bytes(flipped))
    points, problem = read_event_file(bad)
    assert points == whole[: len(points)] and len(points) == 39  # record 0 is the file version
    assert problem is not None and "checksum" in problem.what


def test_problems_for_missing_empty_and_non_spectral(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with SummaryWriter(str(tmp_path / "plain")) as writer:
        writer.add_scalar("train/loss", 1.0, 0)
    result = read_runs([tmp_path / "nope", tmp_path / "empty", tmp_path / "plain"])
    whats = [(Path(p.path).name, p.what.split(" (")[0]) for p in result.problems]
    assert whats == [
        ("nope", "no such file or directory"),
        ("empty", "no TensorBoard event files"),
        ("plain", "event files hold no spectral scalars"),
    ]
    assert result.rows.empty
    # --all-scalars makes a run without spectral scalars a normal run.
    assert read_runs([tmp_path / "plain"], all_scalars=True).problems == []


def test_filters(tmp_path: Path) -> None:
    _write_run(tmp_path, steps=range(0, 50, 10))
    rows = read_runs([tmp_path], all_scalars=True).rows
    kept = filter_rows(rows, metrics=["alpha"], roles=["Q"], layers=[1, None], steps=(10, 30))
    assert sorted(kept.step.unique()) == [10, 20, 30]
    assert set(kept.metric) == {"alpha"} and set(kept.role) == {"Q"}
    assert sorted(kept.layer.fillna(-1).unique()) == [-1, 1]
    # Role and layer filters leave other scalars alone; the step range applies to everything.
    kept = filter_rows(rows, roles=["Q"], steps=(None, 10))
    assert set(kept[kept.role.isna()].metric) == {"train/loss", NUM_LAYERS_TAG}
    assert kept.step.max() == 10


def test_event_file_path_is_a_run(tmp_path: Path) -> None:
    _write_run(tmp_path / "r")
    (event_file,) = (tmp_path / "r").iterdir()
    shutil.copy(event_file, tmp_path / "copy")
    rows = read_runs([event_file]).rows
    assert rows.run.unique().tolist() == ["r"] and not rows.empty
