"""The training-configuration matrix (tests/training_configurations.py): each cell a test.

Every cell trains a tiny biased model with and without the monitor; it passes when the run with
the monitor computes exactly what it computes without it (the same loss at every step), every
scheduled step is logged and each logged stable rank and σ₁ equals a float64 SVD of the matrix
the layer computes, or when the monitor refuses the configuration at construction in one line.
docs/training-configurations.md is the same cells as a table (benchmarks/training_configurations.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from training_configurations import CELLS, PENDING, Cell, check_refusal, run_cell


def _param(cell: Cell) -> object:
    marks = [pytest.mark.slow] if cell.slow else []
    if cell.known is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=cell.known))
    return pytest.param(cell, id=cell.id, marks=marks)


@pytest.mark.parametrize("cell", [_param(cell) for cell in CELLS])
def test_cell_is_exact_or_refused_in_one_line(cell: Cell, tmp_path: Path) -> None:
    if cell.needs is not None:
        pytest.skip(f"needs {cell.needs}")
    outcome = run_cell(cell, tmp_path)
    if cell.refused is not None:
        assert outcome.status == "refused", outcome
        assert check_refusal(cell, outcome.detail) == []
        return
    assert outcome.status == "exact", outcome.detail
    assert outcome.watched > 0


def test_cells_cover_every_value_of_every_axis_with_each_frontend() -> None:
    from training_configurations import ADAPTERS, CHECKPOINTING, FRONTENDS, PRECISIONS

    frontend_only = {"hf": "hf", "configure_model": "lightning"}
    declared = CELLS + PENDING  # PENDING: declared, shown in the table, too slow to fail today
    for frontend in FRONTENDS:
        mine = [cell for cell in declared if cell.frontend == frontend]
        for axis, values in (
            ("precision", PRECISIONS),
            ("checkpointing", CHECKPOINTING),
            ("adapter", ADAPTERS),
        ):
            assert {getattr(cell, axis) for cell in mine} == set(values), (frontend, axis)
        compiles = {cell.compile for cell in mine} - {"none"}
        assert compiles, frontend
        assert all(frontend_only.get(how, frontend) == frontend for how in compiles)
    assert len({cell.id for cell in declared}) == len(declared)


def test_a_cell_names_a_bad_axis_value() -> None:
    with pytest.raises(ValueError, match="Cell `precision` must be one of .* got 'fp8'"):
        Cell("plain", precision="fp8")
