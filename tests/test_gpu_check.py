"""benchmarks/gpu_check.py on a CPU machine: its arguments, its table, its "nothing measured" exit.

The measurements need a CUDA device and run only there (``make gpu-check``); nothing here fakes one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_arguments_default_to_every_part_and_a_gpu_sized_run() -> None:
    args = gpu_check.parse_args([])
    assert args.parts == list(gpu_check.PARTS)
    assert (args.layers, args.width, args.steps) == (12, 768, 300)
    assert gpu_check.parse_args(["--parts", "svd,figures"]).parts == ["svd", "figures"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--parts", "svd,nope"], "unknown \\['nope'\\]"), (["--steps", "0"], "must be positive")],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2
    assert message.replace("\\", "") in capsys.readouterr().err


def test_budgets_fit_in_eight_minutes() -> None:
    assert set(gpu_check.BUDGETS) == set(gpu_check.PARTS)
    assert sum(gpu_check.BUDGETS.values()) <= 8 * 60 - 20  # start-up and imports to spare


def test_the_table_has_one_row_per_result_and_escapes_cells() -> None:
    rows = [gpu_check.Row("a|b", "1", "<= 2", "two\\nlines"), gpu_check.Row("c", "ok")]
    table = gpu_check.format_table(rows, "title").splitlines()
    assert table[0] == "title" and table[2] == "| check | result | target | note |"
    assert table[4] == "| a/b | 1 | <= 2 | two\\\\nlines |".replace("\\\\", "\\")
    assert table[5] == "| c | ok |  |  |" and len(table) == 6


def test_junit_failures_keep_their_first_line() -> None:
    xml = (
        '<testsuites><testsuite><testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><error message="">'
        "\\nRuntimeError: CUDA error: out of memory\\nmore</error></testcase></testsuite></testsuites>"
    ).replace("\\n", "\n")
    summary, failure = gpu_check.junit_rows(xml)
    assert summary.result == "1 passed, 1 failed"
    assert failure.check.strip() == "tests.test_cuda::test_b"
    assert failure.note == "RuntimeError: CUDA error: out of memory"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_measures_nothing_and_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA device: nothing measured"


def test_the_figure_rows_draw_every_figure() -> None:
    from spectral_callbacks.monitor.figures import draw_figures

    figures = draw_figures(gpu_check.figure_rows(), roles=("Q",))
    assert {"spectral_figures/alpha_vs_depth/Q", "spectral_figures/compression_by_layer"} <= set(
        figures
    )
