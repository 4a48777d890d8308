"""The table of docs/training-configurations.md: every cell of the training-configuration matrix
(tests/training_configurations.py: CELLS, and PENDING: the cells that take minutes to fail today)
trained with and without the monitor and checked, one
row each: exact, refused at construction (with its one line) or failing (with what failed).

Run: python benchmarks/training_configurations.py [--only SUBSTRING]   (CPU, one torch thread)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
import smoke  # noqa: E402
from training_configurations import CELLS, PENDING, Cell, Outcome, run_cell  # noqa: E402

RESULT = {"exact": "exact", "refused": "refused", "failed": "**fails**"}


def row(cell: Cell, outcome: Outcome, seconds: float) -> str:
    precision = cell.precision + (", a step skipped" if cell.skip else "")
    if outcome.status == "exact":
        what = f"{outcome.watched} matrices, every scheduled step"
    else:
        what = outcome.detail.replace("|", "\\|")
    cells = [
        cell.frontend,
        cell.model,
        precision,
        "-" if cell.compile == "none" else cell.compile,
        "-" if cell.checkpointing == "none" else cell.checkpointing,
        "-" if cell.adapter == "none" else cell.adapter,
        RESULT[outcome.status],
        what,
        f"{seconds:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--only", default="", help="run the cells whose id contains this")
    # --smoke: one cell (its id is unique), both of its runs and every check.
    options = smoke.parse_args(parser, argv, only="plain-llama-bf16-true")
    torch.set_num_threads(1)
    logging.getLogger("spectral_callbacks").setLevel(logging.WARNING)
    for noisy in (
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "transformers",
        "DeepSpeed",
    ):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    print(
        "| frontend | model | precision | compile | checkpointing | adapter | monitor "
        "| what it did | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for cell in CELLS + PENDING:
        if options.only not in cell.id:
            continue
        if cell.needs is not None:
            print(f"| {cell.id} | needs {cell.needs} (not installed): not run |")
            continue
        start = time.perf_counter()
        # The Hugging Face Trainer prints its own summary: the table alone goes to stdout.
        with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()):
            outcome = run_cell(cell, Path(root))
        failed += outcome.status == "failed"
        print(row(cell, outcome, time.perf_counter() - start), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
