"""The frontends whose flat-partitioned strategies refuse the CPU, on 2 CUDA devices with NCCL
(``@pytest.mark.gpu``, and skipped with fewer than two GPUs): Lightning's ``FSDPStrategy`` and
``DeepSpeedStrategy(stage=3)`` (tests/lightning_partitioned_train.py), the Hugging Face
Trainer's ``fsdp=`` (FSDP1 through accelerate, tests/hf_train.py ``--fsdp`` under torchrun), and
Fabric's ``FSDPStrategy`` and ``DeepSpeedStrategy(stage=3)`` (tests/fabric_train.py).

Every logged stable rank, σ₁ and ‖W‖_F of every watched matrix at every scheduled step is checked
against a float64 SVD of the matrix the script gathers with the strategy's own public API
(``summon_full_params``, ``GatheredParameters``). The same strategies run on the CPU where they
can: FSDP1 in a raw loop (tests/integrations/test_fsdp1.py), the Trainer's ``deepspeed=`` ZeRO-3
(tests/integrations/test_deepspeed.py).
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
from tiny_models import read_scalars

from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import find_targets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    ),
]
TESTS = Path(__file__).resolve().parents[1]
METRICS = ("stable_rank", "spectral_norm", "frobenius_norm")


def _environment() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # never inherit a rank from an outer launcher
    return env


def _check(scalars: dict, weights: dict, targets: list, scheduled: list[int], k: int) -> None:
    """Every watched matrix's metrics at every scheduled step against float64 (1e-4: the gathered
    engine decomposes whole matrices, as one process does)."""
    assert len(targets) == 12
    for target in targets:
        for metric in METRICS:
            logged = scalars[scalar_tag(metric, target.layer, target.role)]
            assert sorted(logged) == scheduled, (metric, target.name)
            for step in scheduled:
                truth = exact_metrics(weights[step][target.name].double().cpu(), k)[metric]
                assert logged[step] == pytest.approx(truth, rel=1e-4), (metric, target.name, step)
        assert weights[scheduled[-1]][target.name].ne(weights[0][target.name]).any()


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_lightning_partitioned_strategies_log_the_exact_spectrum_of_every_gathered_matrix(
    tmp_path: Path, strategy: str
) -> None:
    sys.path.insert(0, str(TESTS))
    import lightning_partitioned_train as script

    command = [sys.executable, str(Path(script.__file__)), str(tmp_path), strategy]
    finished = run_session(command, 600, _environment())
    assert finished.returncode == 0, finished.stdout[-3000:]
    weights = torch.load(tmp_path / "weights.pt")
    targets = find_targets(script.GPT2Module())
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    _check(scalars, weights, targets, [0, 1, 2, 4, 8, 10], script.K)


def test_hugging_face_trainer_fsdp_logs_the_exact_spectrum_of_every_gathered_matrix(
    tmp_path: Path,
) -> None:
    import hf_train

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), hf_train.__file__, str(tmp_path)]
    command += ["--steps", "12", "--logdir", str(tmp_path / "tb"), "--fsdp"]
    finished = run_session(command, 600, _environment())
    assert finished.returncode == 0, finished.stdout[-3000:]
    weights = {  # the names as the unwrapped model's, whichever module the recorder was handed
        step: {name.replace("_fsdp_wrapped_module.", ""): w for name, w in found.items()}
        for step, found in torch.load(tmp_path / "weights.pt").items()
    }
    targets = find_targets(hf_train.tiny_gpt2())
    scalars = read_scalars(tmp_path / "tb")
    _check(scalars, weights, targets, [0, 1, 2, 10, 12], hf_train.OPTIONS["k"])


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_fabric_partitioned_strategies_log_the_exact_spectrum_of_every_gathered_matrix(
    tmp_path: Path, strategy: str
) -> None:
    import fabric_train

    command = [sys.executable, fabric_train.__file__, str(tmp_path), strategy]
    finished = run_session(command, 600, _environment())
    assert finished.returncode == 0, finished.stdout[-3000:]
    saved = torch.load(tmp_path / "weights.pt")
    scheduled = [0, 1, 2, 4, 8, 10]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert len(saved["targets"]) == 12
    for layer, role in saved["targets"]:
        for metric in METRICS:
            logged = scalars[scalar_tag(metric, layer, role)]
            assert sorted(logged) == scheduled, (metric, layer, role)
            for step in scheduled:
                truth = exact_metrics(saved["weights"][step][layer, role], fabric_train.K)[metric]
                assert logged[step] == pytest.approx(truth, rel=1e-4), (metric, layer, role, step)
