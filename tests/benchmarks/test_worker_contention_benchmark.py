"""benchmarks/worker_contention.py at toy size: the stand-in worker and the table (nothing is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import worker_contention  # noqa: E402

TOY = ["--layers", "1", "--width", "32", "--block", "8", "--batch", "2", "--steps", "30"]
SNAPSHOTS = 7  # the default schedule's steps below 30: 0, 1, 2, 4, 8, 16, 25


def test_each_policy_gets_a_row_and_the_worker_spends_what_it_was_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    worker_contention.main([*TOY, "--rounds", "1", "--burn-ms", "2", "--policies", "normal,drop"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["none", "normal", "drop"]
    result = worker_contention.run_once("normal", worker_contention.parse_args(TOY))
    accepted = SNAPSHOTS - result["skipped"]
    assert accepted >= 1 and len(rows) == 4
    assert 0.014 * accepted <= result["cpu"] < 0.014 * accepted + 0.05  # 14 ms each, the default


def test_a_full_bound_skips_instead_of_queueing() -> None:
    # a worker far slower than the toy steps: past the bound of two, snapshots are skipped
    result = worker_contention.run_once(
        "normal", worker_contention.parse_args([*TOY, "--burn-ms", "500"])
    )
    accepted = SNAPSHOTS - result["skipped"]
    assert result["skipped"] >= 3
    assert 0.5 * accepted <= result["cpu"] < 0.5 * accepted + 0.05


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        worker_contention.parse_args([*TOY, "--policies", "normal,fast"])
    assert "unknown ['fast']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        worker_contention.parse_args([*TOY, "--burn-ms", "0"])
    assert "--burn-ms must be > 0" in capsys.readouterr().err
