"""benchmarks/model_snapshot.py at toy size: arguments and the table (nothing is timed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import model_snapshot  # noqa: E402


def test_quick_run_prints_one_row_per_model_with_ratios_and_accuracy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = model_snapshot.main(["--smoke", "--check", "1"])
    assert table[0] == model_snapshot.HEADER
    (row,) = table[2:]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "toy" and cells[1] == "12 in 3"  # 2 layers x 6 roles; Q K V O merged
    assert cells[9].endswith("x") and cells[10].endswith("x")
    sr_cold, sr_warm = (float(v) for v in cells[11].split("/"))
    assert sr_cold < 1 and sr_warm < 1  # against float64 svdvals
    assert "best exact" in capsys.readouterr().out


def test_model_shapes_follow_the_configs() -> None:
    llama = {g.roles: (g.shape, g.count) for g in model_snapshot.model_groups("tinyllama")}
    assert llama["K V"] == ((256, 2048), 44) and llama["gate up"] == ((5632, 2048), 44)
    small = model_snapshot.merged(model_snapshot.model_groups("gpt-4x128"))
    assert [(g.shape, g.count) for g in small] == [
        ((128, 128), 16),
        ((512, 128), 4),
        ((128, 512), 4),
    ]
    gpt2 = model_snapshot.merged(model_snapshot.model_groups("gpt2"))
    assert [(g.shape, g.count) for g in gpt2] == [
        ((768, 768), 48),
        ((3072, 768), 12),
        ((768, 3072), 12),
    ]


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        model_snapshot.parse_args(["--models", "gpt5"])
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model_snapshot.parse_args(["--repeats", "0"])
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
