"""DeepSpeed ZeRO with the Hugging Face Trainer, two CPU processes (DeepSpeed's CPU accelerator,
gloo): stages 1 and 2 keep every weight whole on every rank, stage 3 partitions them and each
snapshot gathers them block by block (``deepspeed.zero.GatheredParameters``); at every stage the
callback logs each scheduled step's spectrum equal to the float64 SVD of the weights; under stage 3
with PEFT LoRA too, of the effective weight ``W_0 + s B A`` and of the update ``s B A``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from browser import free_port
from sharded_models import exact_metrics
from spawn_ranks import run_session
from tiny_models import exact_stable_rank, read_scalars

from spectral_callbacks.names import scalar_tag

pytest.importorskip("deepspeed", reason="deepspeed is not installed: pip install -e .[dev]")
pytestmark = pytest.mark.slow  # four 2-process DeepSpeed runs, ~1 min each

SCRIPT = Path(__file__).resolve().parents[1] / "deepspeed_train.py"
Q0 = scalar_tag("stable_rank", 0, "Q")


def zero_run(tmp_path: Path, stage: int, *extra: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), str(SCRIPT), str(tmp_path), str(stage), *extra]
    finished = run_session(command, 400, env)
    return finished.returncode, finished.stdout


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_log_the_exact_spectrum_of_whole_weights(tmp_path: Path, stage: int) -> None:
    returncode, output = zero_run(tmp_path, stage)
    assert returncode == 0, output[-3000:]
    # DeepSpeed's ZeRO optimizer; stages 1-2 keep the whole 32 x 96 c_attn on each rank, stage 3
    # an empty placeholder (the snapshot gathers it with deepspeed.zero.GatheredParameters)
    optimizer = "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
    held = 0 if stage == 3 else 3072
    for rank in (0, 1):
        assert f"rank {rank}: {optimizer}, ZeRO stage {stage}, c_attn holds {held} values" in output
    logged = read_scalars(tmp_path / "spectral")
    weights = torch.load(tmp_path / "weights.pt")  # gathered by the test (hf_train.py)
    assert sorted(logged[Q0]) == [0, 1, 2, 5, 6]
    for step, value in logged[Q0].items():
        exact = exact_stable_rank(weights[step]["transformer.h.0.attn.c_attn.weight[Q]"])
        assert value == pytest.approx(exact, rel=0.01)


def test_zero3_lora_logs_the_exact_spectrum_and_update_of_the_effective_weights(
    tmp_path: Path,
) -> None:
    returncode, output = zero_run(tmp_path, 3, "lora")
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):  # the base is partitioned: an empty placeholder on each rank
        assert f"rank {rank}: DeepSpeedZeroOptimizer_Stage3, ZeRO stage 3, c_attn holds 0" in output
    logged = read_scalars(tmp_path / "spectral")
    weights = torch.load(tmp_path / "weights.pt")  # W0 + s B A from GatheredParameters (hf_train)
    names = [name for name in weights[0] if name.endswith("c_attn.base_layer.weight[Q]")]
    assert len(names) == 2  # blocks 0 and 1, adapted
    for layer, name in enumerate(sorted(names)):
        for metric in (
            "stable_rank",
            "spectral_norm",
            "update_stable_rank",
            "update_spectral_norm",
        ):
            values = logged[scalar_tag(metric, layer, "Q")]
            assert sorted(values) == [0, 1, 2, 5, 6], metric
            for step, value in values.items():
                key = f"{name}:update" if metric.startswith("update_") else name
                exact = exact_metrics(weights[step][key], 8)[metric.removeprefix("update_")]
                assert value == pytest.approx(exact, rel=1e-4), (metric, layer, step)
