"""benchmarks/gpu_check.py on a CPU machine: its arguments, its table, its "nothing measured" exit.

The measurements need a CUDA device and run only there (``make gpu-check``); nothing here fakes one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
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


def test_a_stopped_test_run_keeps_what_it_finished_and_each_failure_reason() -> None:
    output = (
        "tests/cuda/test_cuda.py::test_a PASSED   [ 50%]\n"
        "tests/cuda/test_cuda.py::test_b FAILED   [100%]\n"
        "tests/cuda/test_cuda.py::test_c "  # killed at the budget while test_c ran
    )
    summary, failure = gpu_check.verbose_rows(
        output
        + "\nFAILED tests/cuda/test_cuda.py::test_b - RuntimeError: CUDA error: out of memory\n"
    )
    assert summary.result == "1 passed, 1 failed"
    assert failure.check.strip() == "tests/cuda/test_cuda.py::test_b"
    assert failure.note == "RuntimeError: CUDA error: out of memory"
    (only,) = gpu_check.verbose_rows(output.replace("FAILED", "PASSED"))
    assert only.result == "2 passed, 0 failed"


def test_the_gpu_test_files_are_the_ones_with_gpu_tests() -> None:
    names = {path.name for path in gpu_check.gpu_test_files()}
    assert {
        "test_cuda.py",
        "test_cuda_hf.py",
        "test_cuda_paths.py",
        "test_cuda_ranks.py",
        "test_cuda_sharded.py",
        "test_svd.py",
        "test_snapshot.py",
    } <= names
    assert "test_metrics.py" not in names


def test_the_table_is_written_row_by_row(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # Parts emit rows as they finish: what a part printed survives a later part that is killed.
    printed: list[str] = []
    gpu_check_rows = [gpu_check.Row("first", "1"), gpu_check.Row("second", "2")]

    def emit_two(budget: float, emit) -> list:
        for row in gpu_check_rows:
            emit(row)
            printed.append(capsys.readouterr().out)
        return gpu_check_rows

    monkeypatch.setattr(gpu_check, "run_gpu_tests", emit_two)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake")
    assert gpu_check.main(["--parts", "tests"]) == 0
    assert "| first | 1 |" in printed[0] and "| second | 2 |" in printed[1]


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
    # Every kind of figure draw_figures draws for a role: none left out for lack of a metric.
    assert sorted(figures) == [
        "spectral_figures/alpha_vs_depth/Q",
        "spectral_figures/compression_by_layer",
        "spectral_figures/compression_wave/Q",
        "spectral_figures/stable_rank_vs_steps/L00",
    ]


def test_every_gpu_test_file_runs_and_the_stream_and_memory_tests_first() -> None:
    runs = gpu_check.gpu_test_runs()
    files = {path.relative_to(gpu_check.ROOT).as_posix() for path in gpu_check.gpu_test_files()}
    assert {name for name, _ in runs} == files and "tests/cuda/test_cuda_targets.py" in files
    assert runs[0] == ("tests/cuda/test_cuda.py", gpu_check.FIRST[1])
    # Each run keeps a share of the tests' budget whatever the runs before it took.
    assert gpu_check.RESERVED_PER_RUN * len(runs) < gpu_check.BUDGETS["tests"]
