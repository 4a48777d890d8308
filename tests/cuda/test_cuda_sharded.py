"""The sharded engine on a CUDA device: 2 ranks on one GPU joined by gloo (``@pytest.mark.gpu``).

What each would catch: a tensor made on the CPU beside CUDA shards (the run fails at its first
snapshot), a host-device copy or sync on the training thread in ``offer`` (a scattered role's
indices moved at each snapshot), and a worker on training's stream (its results wait behind a
busy training stream).
"""

from __future__ import annotations

import pytest
import sharded_engine_cases as cases
import torch
from sharded_models import exact_metrics
from spawn_ranks import run_ranks

from spectral_callbacks.targets import Rows

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return run_ranks(cases.cuda_engine, 2, tmp_path_factory.mktemp("cuda_engine"), timeout=300)


def test_every_sharded_matrix_on_cuda_matches_the_exact_svd(ranks) -> None:
    fulls = ranks[0]["fulls"]
    expected = {"rows": fulls["rows"], "cols": fulls["cols"]}
    for index, role in enumerate("QKV"):
        rows = Rows(start=10 * index, stop=10 * (index + 1), groups=5)
        expected[f"fused[{role}]"] = rows.take(fulls["fused"])
    for rank in ranks:
        assert rank["metrics"] is not None  # the first CUDA snapshot did not fail
        for name, full in expected.items():
            truth = exact_metrics(full.double(), cases.K)
            got = rank["metrics"][name]
            assert got["stable_rank"] == pytest.approx(truth["stable_rank"], rel=0.01), name
            assert got["frobenius_norm"] == pytest.approx(truth["frobenius_norm"], rel=1e-5)


def test_offer_and_collect_neither_wait_nor_move_data_between_host_and_device(ranks) -> None:
    # syncs: cuda_checks.SyncDetector on offer and collect (sync-debug mode, synchronize() calls,
    # pageable or blocking copies); traffic: any host-device move in offer.
    for rank in ranks:
        assert rank["syncs"] == [] and rank["traffic"] == []


def test_the_sharded_svd_runs_on_its_own_stream_beside_a_busy_training_stream(ranks) -> None:
    for rank in ranks:
        assert rank["own_stream"]
        # The results came while training's stream was still asleep (3 s after the copy).
        assert rank["busy_while_collected"], rank["collect_seconds"]
