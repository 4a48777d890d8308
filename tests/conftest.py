"""Shared test setup: examples/ is importable, one torch thread, GPU tests skip without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# One intra-op thread per process: the callback's worker thread and the training thread would
# otherwise oversubscribe CI's two cores, and small-matrix tests gain nothing from more.
torch.set_num_threads(1)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if (
            item.get_closest_marker("gpu") is not None
        ):  # the marker, not a keyword: a folder named gpu is one
            item.add_marker(skip_gpu)
