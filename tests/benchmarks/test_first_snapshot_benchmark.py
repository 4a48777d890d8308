"""benchmarks/first_snapshot.py at toy size: arguments, shapes and the table (the timings are not
checked here: the machine's load decides them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import first_snapshot  # noqa: E402


def test_quick_run_prints_a_row_with_the_ratios_and_calibrates_on_one_matrix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = first_snapshot.main(["--smoke"])
    assert table[0] == first_snapshot.HEADER
    (row,) = table[2:]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "toy (3 groups, 12 matrices)" and cells[1] == "1"
    first, first_warm, steady, exact = (float(cell) for cell in cells[2:6])
    assert min(first, first_warm, steady, exact) > 0
    for seconds, ratio in zip((first, first_warm, steady), cells[6:9], strict=True):
        assert float(ratio.split()[0]) == pytest.approx(seconds / exact, rel=0.01, abs=0.006)
    out = capsys.readouterr().out
    # Every candidate run of the calibration took one matrix of its group.
    counts = out.split("candidate runs on [")[1].split("]")[0].split(", ")
    assert counts and set(counts) == {"1"}


def test_the_stacks_follow_the_configs() -> None:
    qwen = [(g.shape, g.count) for g in first_snapshot.groups_of("qwen2-10x896")]
    assert qwen == [((896, 896), 20), ((128, 896), 20), ((4864, 896), 20), ((896, 4864), 10)]
    gpt2 = [(g.shape, g.count) for g in first_snapshot.groups_of("gpt2")]
    assert gpt2 == [((768, 768), 48), ((3072, 768), 12), ((768, 3072), 12)]


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        first_snapshot.parse_args(["--models", "gpt5"])
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        first_snapshot.parse_args(["--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
