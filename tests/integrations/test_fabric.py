"""Lightning Fabric with sharded weights: ``ModelParallelStrategy`` with ``fully_shard`` per block
(FSDP2), 2 CPU processes with gloo, SpectralTracker in the Fabric loop logging to
``fabric.loggers``: every logged value matches a float64 SVD of the full matrix the script gathers
with ``full_tensor()`` at every scheduled step.

Fabric's ``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy`` refuse the CPU in Fabric itself, so
they have no CPU run here (docs/distributed.md, "Frontends"; a ``gpu``-marked run in
tests/integrations/test_gpu_frontends.py).

The script runs in a subprocess of its own session (Fabric re-runs it per rank), so a timeout
kills every rank: a test never hangs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from sharded_models import exact_metrics
from spawn_ranks import run_session
from tiny_models import read_scalars

from spectral_callbacks.names import monitor_tag, scalar_tag

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "fabric_train.py"
SCHEDULED = [0, 1, 2, 4, 8, 10]  # fabric_train.py: 0, 1, 2, every 4, the last
K = 8
# ‖W‖_F is exact (an all-reduce of the shards' squares); σ₁ and the top k come from the sharded
# randomized block Krylov SVD, within the accuracy docs/distributed.md states for it.
TOLERANCE = {
    "frobenius_norm": dict(rel=1e-5),
    "stable_rank": dict(rel=0.01),
    "spectral_norm": dict(rel=0.01),
    "alpha": dict(abs=0.02),
}


def test_fabric_model_parallel_logs_the_exact_spectrum_of_every_full_matrix(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)  # never inherit a rank from an outer launcher
    finished = run_session([sys.executable, str(SCRIPT), str(tmp_path)], 300, env)
    assert finished.returncode == 0, finished.stdout[-3000:]
    saved = torch.load(tmp_path / "weights.pt")
    weights, targets = saved["weights"], saved["targets"]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert len(targets) == 12
    for layer, role in targets:
        for metric in ("stable_rank", "spectral_norm", "frobenius_norm", "alpha"):
            logged = scalars[scalar_tag(metric, layer, role)]
            assert sorted(logged) == SCHEDULED, (metric, layer, role)
            for step in SCHEDULED:
                truth = exact_metrics(weights[step][layer, role], K)[metric]
                tolerance = TOLERANCE[metric]
                assert logged[step] == pytest.approx(truth, **tolerance), (
                    metric,
                    layer,
                    role,
                    step,
                )
        assert weights[10][layer, role].ne(weights[0][layer, role]).any()  # it trained
    assert set(scalars[monitor_tag("skipped")].values()) == {0.0}
