"""DeepSpeed ZeRO with the Hugging Face Trainer, two CPU processes (DeepSpeed's CPU accelerator,
gloo): stages 1 and 2 keep every weight whole on every rank, and the callback logs each scheduled
step's spectrum equal to the float64 SVD of the weights; stage 3 is refused at on_train_begin.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from browser import free_port
from spawn_ranks import run_session
from tiny_models import exact_stable_rank, read_scalars

from spectral_callbacks.names import scalar_tag

pytest.importorskip("deepspeed", reason="deepspeed is not installed: pip install -e .[dev]")
pytestmark = pytest.mark.slow  # three 2-process DeepSpeed runs, ~1 min each

SCRIPT = Path(__file__).resolve().parents[1] / "deepspeed_train.py"
Q0 = scalar_tag("stable_rank", 0, "Q")


def zero_run(tmp_path: Path, stage: int) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(SCRIPT), str(tmp_path), str(stage)]
    finished = run_session(command, 400, env)
    return finished.returncode, finished.stdout


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_1_and_2_log_the_exact_spectrum_of_whole_weights(
    tmp_path: Path, stage: int
) -> None:
    returncode, output = zero_run(tmp_path, stage)
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):  # DeepSpeed's ZeRO optimizer, and the whole 32 x 96 c_attn on each rank
        assert (
            f"rank {rank}: DeepSpeedZeroOptimizer, ZeRO stage {stage}, c_attn holds 3072" in output
        )
    logged = read_scalars(tmp_path / "spectral")
    weights = torch.load(tmp_path / "weights.pt")
    assert sorted(logged[Q0]) == [0, 1, 2, 5, 6]
    for step, value in logged[Q0].items():
        exact = exact_stable_rank(weights[step]["transformer.h.0.attn.c_attn.weight[Q]"])
        assert value == pytest.approx(exact, rel=0.01)


def test_zero_stage_3_is_refused_when_training_begins(tmp_path: Path) -> None:
    returncode, output = zero_run(tmp_path, 3)
    assert returncode != 0
    assert "SpectralTrainerCallback cannot watch a model trained with DeepSpeed ZeRO-3" in output
    assert "fully_shard" in output
