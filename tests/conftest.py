"""Shared test setup: the helper modules of tests/ and examples/ are importable from every test
folder, one torch thread, GPU tests skip without a GPU, torch's float32 precision put back after a
test that sets it, the package's logger as it was after every test, and each test's ``random``
module seeded with the run's fresh seed, printed in the header and by a failing test
(``tests/seeds.py``)."""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

# One intra-op thread per process: the callback's worker thread and the training thread would
# otherwise oversubscribe CI's two cores, and small-matrix tests gain nothing from more.
torch.set_num_threads(1)

# The tests sit in folders that mirror the package; the helpers they share (tiny_models.py, the
# scripts run in subprocesses, the *_cases.py that spawned ranks import by name) stay in tests/.
TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(EXAMPLES))

from seeds import SEED_VARIABLE, run_seed  # noqa: E402 - tests/ is on the path from here on


def pytest_report_header() -> str:
    return f"random seed: {SEED_VARIABLE}={run_seed()} (fixed by setting it)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if (
            item.get_closest_marker("gpu") is not None
        ):  # the marker, not a keyword: a folder named gpu is one
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seeded_random() -> Iterator[int]:
    """Python's ``random`` seeded with the run's seed before each test, so a test's
    ``random.randrange(2**31)`` draws are new each run, the same whether the test runs alone or in
    the suite, and replayable from the seed a failure prints; the module's state put back after."""
    state = random.getstate()
    random.seed(run_seed())
    yield run_seed()
    random.setstate(state)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report names the seed of its ``random`` draws and how to replay them."""
    report = yield
    if report.failed:
        replay = f"{SEED_VARIABLE}={run_seed()} pytest '{item.nodeid}' replays its draws"
        report.sections.append(("random seed", replay))
    return report


@pytest.fixture(autouse=True)
def restored_package_logger() -> Iterator[None]:
    """The "spectral_callbacks" logger's level, propagation and handlers put back after each test:
    a benchmark's main() run in-process sets its level to WARNING, and every later test that reads
    an INFO note through caplog then saw none (the full suite failed where the test alone passed)."""
    logger = logging.getLogger("spectral_callbacks")
    saved = (logger.level, logger.propagate, list(logger.handlers), logger.disabled)
    yield
    logger.setLevel(saved[0])
    logger.propagate, logger.handlers[:], logger.disabled = saved[1], saved[2], saved[3]


@pytest.fixture
def restored_fp32_precision() -> Iterator[None]:
    """Put torch's float32 precision settings back as they were (they are process-global): the
    new API's (torch >= 2.9), or the legacy flags where it is absent."""
    if not hasattr(torch.backends, "fp32_precision"):
        legacy = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        precision = torch.get_float32_matmul_precision()
        yield
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy
        torch.set_float32_matmul_precision(precision)
        return
    saved = [
        (torch.backends, torch.backends.fp32_precision),
        (torch.backends.cuda.matmul, torch.backends.cuda.matmul.fp32_precision),
        (torch.backends.cudnn, torch.backends.cudnn.fp32_precision),
    ]
    yield
    for backend, value in saved:  # the generic one first: setting it resets the others
        backend.fp32_precision = value
    # Both APIs agree again: the legacy reads other libraries make work again.
    assert torch.get_float32_matmul_precision() in ("highest", "high", "medium")
