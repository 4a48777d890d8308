"""`spectral-callbacks export` on event files of real short training runs, as a user runs it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cli_runs import EXACT_FLOATS, STEPS, logged_by_csv, run_cli, training_runs, write_long_run

from spectral_callbacks.cli.main import main
from spectral_callbacks.names import (
    REFERENCE_STEP,
    TIDY_COLUMNS,
    parse_tag,
    reference_step_tag,
    scalar_tag,
)

COLUMNS = list(TIDY_COLUMNS)  # the order docs/cli.md states (tests/test_names.py checks that)
# An event file of a 2-layer GPT written by the callback before stacks and experts were named
# (commit 7163730, figures off, 30 steps): what users already have on disk must still read.
BEFORE_STACKS = Path(__file__).parents[1] / "data" / "run-before-stacks"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return training_runs(tmp_path_factory)


def _tag(row: pd.Series) -> str:
    if pd.isna(row["role"]):
        return row["metric"]
    if row["metric"] == REFERENCE_STEP:
        return reference_step_tag(int(row["layer"]), row["role"])
    return scalar_tag(
        row["metric"], None if pd.isna(row["layer"]) else int(row["layer"]), row["role"]
    )


def test_export_equals_logged_values_for_every_tag_and_long_runs_whole(
    runs: Path, tmp_path: Path
) -> None:
    tag = write_long_run(tmp_path / "long")
    out = tmp_path / "all.csv"
    done = run_cli("export", runs / "tb", tmp_path / "long", "-o", out, "--all-scalars")
    assert done.returncode == 0, done.stderr
    rows = pd.read_csv(out, **EXACT_FLOATS)
    assert list(rows.columns) == COLUMNS
    assert set(rows.run) == {"a", "b", "long"}

    for run in ("a", "b"):
        exported = rows[rows.run == run].copy()
        exported["tag"] = exported.apply(_tag, axis=1)
        logged = logged_by_csv(runs, run)
        logged = logged[logged.tag != "epoch"]  # TensorBoard gets it too, but it is not the point
        merged = logged.merge(exported, on=["tag", "step"], how="left", suffixes=("_logged", ""))
        assert merged.value.notna().all(), merged[merged.value.isna()].head()
        # Event files store float32: the export is the logged value rounded to float32, exactly.
        np.testing.assert_array_equal(
            merged.value.to_numpy(), merged.value_logged.to_numpy().astype(np.float32)
        )
        spectral = exported[exported.role.notna()]
        logged_spectral = logged[logged.tag.map(parse_tag).notna()]
        assert len(spectral) == len(logged_spectral) > 0  # nothing more, nothing less
        assert spectral.step.max() == STEPS
        per_layer = spectral[spectral.layer.notna()]
        np.testing.assert_array_equal(per_layer.depth, per_layer.layer / 2)  # L = 3

    long = rows[rows.run == "long"]
    assert len(long) == 10_500 and long.step.tolist() == list(range(10_500))
    assert (long.apply(_tag, axis=1) == tag).all()
    np.testing.assert_array_equal(long.value, (100.0 - np.arange(10_500) / 1000).astype(np.float32))
    assert done.stderr.strip().endswith(
        f"10500 rows of 3 runs to {out}".replace("10500", str(len(rows)))
    )


def test_export_reads_the_reference_steps_as_a_per_matrix_metric(
    runs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "refs.csv"
    assert main(["export", str(runs / "tb" / "a"), "-o", str(out), "--metric", REFERENCE_STEP]) == 0
    rows = pd.read_csv(out)
    # Every matrix of the 3-layer encoder is defined at step 0: one row each, value 0, at step 0.
    assert len(rows) == 3 * 6 and set(rows.role) == {"Q", "K", "V", "O", "MLP_up", "MLP_down"}
    assert (rows.step == 0).all() and (rows.value == 0).all()
    np.testing.assert_array_equal(rows.depth, rows.layer / 2)


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json", ".jsonl"])
def test_formats_round_trip(runs: Path, tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"rows{suffix}"
    assert main(["export", str(runs / "tb" / "a"), "-o", str(out)]) == 0
    reader = {".csv": pd.read_csv, ".parquet": pd.read_parquet}.get(suffix)
    rows = reader(out) if reader else pd.read_json(out, lines=suffix == ".jsonl")
    assert list(rows.columns) == COLUMNS and (rows.run == "a").all()
    assert set(rows.metric) == {
        "stable_rank",
        "alpha",
        "alpha_r2",
        "spectral_norm",
        "frobenius_norm",
        "compression",
        REFERENCE_STEP,  # spectral_monitor/reference_step/L<l>/<role>, read back per matrix
    }
    assert rows.value.notna().sum() > 0 and len(rows) == len(rows.drop_duplicates(COLUMNS[:8]))


def test_stdout_and_filters(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "export",
        str(runs / "tb"),
        "-o",
        "-",
        "--metric",
        "alpha",
        "--role",
        "Q",
        "--layer",
        "1",
        "--layer",
        "mean",
        "--steps",
        "5:20",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = pd.read_csv(pd.io.common.StringIO(captured.out))
    assert set(rows.metric) == {"alpha"} and set(rows.role) == {"Q"}
    assert set(rows.layer.fillna(-1)) == {1, -1}
    assert rows.step.between(5, 20).all() and set(rows.run) == {"a", "b"}
    assert "rows of 2 runs to stdout" in captured.err


def test_usage_errors_in_process(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(runs / "tb"), "-o", str(tmp_path / "rows.xlsx")]) == 1
    assert "unknown extension '.xlsx'; use one of .csv, .parquet" in capsys.readouterr().err
    assert main(["export", str(runs / "tb"), "-o", "-", "--role", "nope"]) == 1
    err = capsys.readouterr().err
    assert "the filters left no rows" in err and "roles K, MLP_down, MLP_up, O, Q, V" in err
    with pytest.raises(SystemExit):
        main(["export", str(runs), "-o", "-", "--steps", "9"])
    assert "must be FIRST:LAST" in capsys.readouterr().err


def _record_offset(data: bytes, index: int) -> int:
    """Byte offset of record ``index`` of an event file (length u64, crc u32, data, crc u32)."""
    offset = 0
    for _ in range(index):
        offset += 8 + 4 + int.from_bytes(data[offset : offset + 8], "little") + 4
    return offset


def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("spectral-callbacks export: error: ")
    return lines[0]


def test_bad_input_one_line_each_and_partial_export(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.csv"
    good = runs / "tb" / "a"

    done = run_cli("export", good, tmp_path / "missing", "-o", out)
    line = _one_error_line(done.stderr)
    assert done.returncode == 1
    assert f"{tmp_path / 'missing'}: no such file or directory; give the log directory" in line
    exported = len(pd.read_csv(out))
    assert f"exported the {exported} rows that could be read (1 run) to {out}" in line

    (tmp_path / "empty").mkdir()
    done = run_cli("export", tmp_path / "empty", "-o", tmp_path / "none.csv")
    line = _one_error_line(done.stderr)
    assert (
        done.returncode == 1
        and "no TensorBoard event files" in line
        and "nothing was exported" in line
    )
    assert not (tmp_path / "none.csv").exists()

    plain = tmp_path / "plain"
    shutil.copytree(good, plain)
    for event_file in plain.glob("events.out.tfevents.*"):  # keep only the first record of each
        data = event_file.read_bytes()
        event_file.write_bytes(data[: 8 + 4 + int.from_bytes(data[:8], "little") + 4])
    done = run_cli("export", plain, "-o", tmp_path / "none.csv")
    line = _one_error_line(done.stderr)
    assert f"{plain}: event files hold no spectral scalars" in line and "SpectralMonitor" in line

    cut = tmp_path / "cut"
    shutil.copytree(good, cut)
    # the scalars' file, not the figure process's own `.spectral_figures` file beside it
    (event_file,) = [
        f for f in cut.glob("events.out.tfevents.*") if f.suffix != ".spectral_figures"
    ]
    data = event_file.read_bytes()
    event_file.write_bytes(data[: _record_offset(data, 100) + 20])  # in record 100's payload
    done = run_cli("export", cut, "-o", out)
    line = _one_error_line(done.stderr)
    assert done.returncode == 1
    assert f"{event_file}: damaged event file (truncated record) after" in line
    partial = pd.read_csv(out)
    assert f"exported the {len(partial)} rows that could be read" in line
    assert main(["export", str(good), "-o", str(tmp_path / "whole.csv")]) == 0
    whole = pd.read_csv(tmp_path / "whole.csv")
    assert 0 < len(partial) < len(whole)
    key = ["step", "metric", "layer", "role"]
    same = partial.merge(whole, on=key, how="left", suffixes=("", "_whole"))
    np.testing.assert_array_equal(same.value, same.value_whole)  # what was read is right

    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (event_file,) = sorted(corrupt.glob("events.out.tfevents.*"))[-1:]
    data = bytearray(event_file.read_bytes())
    data[-10] ^= 0xFF  # inside the last record's payload
    event_file.write_bytes(bytes(data))
    done = run_cli("export", corrupt, "-o", out)
    line = _one_error_line(done.stderr)
    assert done.returncode == 1 and "damaged event file (checksum mismatch)" in line


def test_missing_parent_directories_of_the_output_are_created(runs: Path, tmp_path: Path) -> None:
    # docs/cli.md: a missing parent is created (as `analyze --logdir` creates its directory);
    # a path whose parent is a file is still a one-line error
    out = tmp_path / "new" / "deeper" / "rows.csv"
    assert main(["export", str(runs / "tb" / "a"), "-o", str(out)]) == 0
    assert len(pd.read_csv(out)) > 0
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["export", str(runs / "tb" / "a"), "-o", str(blocker / "rows.csv")]) == 1


def test_a_run_logged_before_stacks_and_experts_were_named_still_exports_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "old.csv"
    assert main(["export", str(BEFORE_STACKS), "-o", str(out)]) == 0
    rows = pd.read_csv(out, keep_default_na=False)
    assert list(rows.columns) == COLUMNS and len(rows) > 0
    per_layer = rows[rows.layer != ""]
    assert set(per_layer["stack"]) == {""} and set(rows["expert"]) == {""}  # one stack, no experts
    assert set(per_layer.role) == {"Q", "K", "V", "O", "MLP_up", "MLP_down"}
    assert set(per_layer.layer.astype(int)) == {0, 1}
    assert set(per_layer.depth.astype(float)) == {0.0, 1.0}
    assert set(rows.step) >= {0, 30} and {"stable_rank", "alpha"} <= set(rows.metric)
    chart = tmp_path / "alpha.png"
    assert main(["plot", str(BEFORE_STACKS), "--kind", "alpha-depth", "-o", str(chart)]) == 0
    assert chart.stat().st_size > 10_000


def test_one_run_is_counted_as_one_run(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = str(runs / "tb" / "a")
    out = tmp_path / "rows.csv"
    assert main(["export", one, "-o", str(out)]) == 0
    assert capsys.readouterr().err.strip().endswith(f"rows of 1 run to {out}")
    assert main(["export", one, "-o", "-", "--steps", "0:0", "--metric", "alpha", "--layer", "0",
                 "--role", "Q"]) == 0  # fmt: skip
    assert capsys.readouterr().err.strip().endswith("done: 1 row of 1 run to stdout")
    chart = tmp_path / "bars.png"
    assert main(["plot", one, "--kind", "compression", "-o", str(chart)]) == 0
    assert capsys.readouterr().err.strip().endswith(f"compression of 1 of 1 run to {chart}")


def test_an_output_directory_or_a_name_without_extension_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: "-o some_dir: unknown extension '(none)'"
    assert main(["export", str(tmp_path), "-o", str(tmp_path)]) == 1
    error = capsys.readouterr().err
    assert (
        f"-o {tmp_path}: a directory; give a file in it, e.g. -o {tmp_path / 'spectra.csv'}"
        in error
    )
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "spectra")]) == 1
    error = capsys.readouterr().err
    assert "spectra: no extension; use one of .csv" in error and "(none)" not in error
