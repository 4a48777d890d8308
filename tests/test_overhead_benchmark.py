"""benchmarks/overhead.py at toy size: the worker's CPU seconds and the table (nothing is timed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import overhead  # noqa: E402

TOY = ["--layers", "1", "--width", "32", "--block", "8", "--batch", "2", "--steps", "30"]


def _toy_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overhead.add_model_arguments(parser)
    return parser.parse_args(TOY)


def test_the_worker_cpu_is_the_worker_threads_own(tmp_path: Path) -> None:
    default = overhead.run_once("default", _toy_args(), str(tmp_path))
    # The default schedule: 0, 1, 2, 4, 8, 16, 25 and the last, 30; on a loaded machine a snapshot
    # due while two are still pending is skipped (and counted), not queued.
    assert default["snapshots"] + default["skipped"] == 8 and default["snapshots"] >= 1
    assert 0 < default["worker_cpu"] < default["cpu"]  # a part of the process's CPU seconds
    synchronous = overhead.run_once("synchronous", _toy_args(), str(tmp_path))
    assert synchronous["snapshots"] == 8 and synchronous["worker_cpu"] == 0  # no worker thread


def test_the_table_gives_each_variant_its_worker_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    overhead.main([*TOY, "--rounds", "1", "--variants", "default,synchronous"])
    out = capsys.readouterr().out
    rows = {
        row.split("|")[1].strip(): row.split("|")[-2].strip()
        for row in out.splitlines()
        if row.startswith("| ") and "variant" not in row
    }
    assert rows["none"] == rows["synchronous"] == "0.00"
    assert float(rows["default"]) > 0
    assert "default: each worker CPU second cost training" in out
    assert "synchronous: each worker CPU second" not in out
