"""The training thread under the DDP and the sharded engine on a CUDA device: two ranks on one GPU
joined by gloo, a SpectralTracker writing TensorBoard with figures (``@pytest.mark.gpu``).

Each tracker call of a rank's training thread runs inside cuda_checks.SyncDetector: sync-debug
mode's reports, every ``synchronize()`` of torch.cuda, an Event or a Stream, and every pageable or
blocking copy between host and device. The single-process engine's hooks are checked the same way
in tests/cuda/test_cuda.py.
"""

from __future__ import annotations

from pathlib import Path

import cuda_tracker_cases as cases
import pytest
from spawn_ranks import run_ranks
from tiny_models import read_scalars

from spectral_callbacks.names import scalar_tag

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("how", sorted(cases.ENGINES))
def test_no_tracker_call_waits_for_the_device_on_either_rank(how: str, tmp_path: Path) -> None:
    logdir = tmp_path / "tb"
    ranks = run_ranks(cases.tracked_on_one_gpu, 2, tmp_path, str(logdir), how, timeout=300)
    for rank in ranks:
        assert rank["engine"] == cases.ENGINES[how]
        assert rank["found"] == [], rank["found"]
    assert ranks[0]["drawn"], "rank 0 handed no figure over during the run"
    # The run was measured: every scheduled step of a layer-0 role is in rank 0's event files.
    logged = read_scalars(logdir)
    assert sorted(logged[scalar_tag("stable_rank", 0, "Q")]) == cases.SCHEDULED
