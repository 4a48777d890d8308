"""A short sharded Fabric loop (CPU, gloo, 2 processes) with SpectralTracker, for
tests/integrations/test_fabric.py.

``python tests/fabric_train.py OUTDIR [model_parallel|fsdp|deepspeed]``

Hugging Face's GPT-2, the biases non-zero as a checkpoint's are, under one of Lightning Fabric's
strategies on 2 processes:

* ``model_parallel`` (the default; CPU, gloo): ``ModelParallelStrategy`` (``data_parallel_size=2``)
  with a ``parallelize_fn`` that applies ``fully_shard`` (FSDP2) per block and to the root;
* ``fsdp`` (2 CUDA devices): ``FSDPStrategy`` (FSDP1, one unit per block, ``use_orig_params=True``);
* ``deepspeed`` (2 CUDA devices): ``DeepSpeedStrategy(stage=3)``.

Fabric refuses the last two on the CPU. The tracker is built on the module Fabric's setup returns
and logs to ``fabric.loggers``. Fabric re-runs this script once per extra rank, so it must be a
file. At every step the script gathers every watched matrix with the strategy's own public API
(``full_tensor()``, ``summon_full_params``, ``GatheredParameters``: test-only collectives on every
rank) and rank 0 saves them in float64 to ``OUTDIR/weights.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from partitioned_cases import gpt2_with_biases  # noqa: E402
from sharded_engine_cases import batch  # noqa: E402
from sharded_models import full_matrix, shard  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402

STEPS = 10
K = 8  # snapshots at 0, 1, 2, every 4 steps and the last
OPTIONS = dict(every_n_steps=4, log_spaced_until=3, k=K, figures=False, max_pending=8)


def parallelize(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``fully_shard`` per block and the root over the data-parallel mesh."""
    shard(model, "fsdp", mesh["data_parallel"])
    return model


def gathered(
    module: torch.nn.Module, model: torch.nn.Module
) -> dict[tuple[int, str], torch.Tensor]:
    """Every watched matrix of ``model`` (inside Fabric's ``module``) in float64 on the CPU by
    (layer, role), gathered with the strategy's own public API."""
    with _whole(module, model):
        return {(t.layer, t.role): full_matrix(t).cpu() for t in find_targets(model)}


def _whole(module: torch.nn.Module, model: torch.nn.Module) -> contextlib.AbstractContextManager:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        # every FSDP1 unit inside Fabric's module, the root included
        return FullyShardedDataParallel.summon_full_params(module, writeback=False)
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
    return contextlib.nullcontext()  # DTensors: full_matrix gathers them with full_tensor()


def fabric_for(strategy: str, outdir: Path) -> Fabric:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    strategies = {
        "model_parallel": lambda: ModelParallelStrategy(
            parallelize, data_parallel_size=2, tensor_parallel_size=1
        ),
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={GPT2Block}, use_orig_params=True),
        "deepspeed": lambda: DeepSpeedStrategy(stage=3),
    }
    return Fabric(
        accelerator="cpu" if strategy == "model_parallel" else "cuda",
        devices=2,
        strategy=strategies[strategy](),
        loggers=TensorBoardLogger(outdir, name="tb", version=0),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument(
        "strategy",
        nargs="?",
        default="model_parallel",
        choices=["model_parallel", "fsdp", "deepspeed"],
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share a small machine
    fabric = fabric_for(args.strategy, args.outdir)
    fabric.launch()
    model, loss_of = gpt2_with_biases()
    if args.strategy == "model_parallel":
        module = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-2))
    else:  # DeepSpeed sets both up together; FSDP1 with use_orig_params=True allows it
        module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    weights = {}
    with SpectralTracker(module, writers=fabric.loggers, start_step=0, **OPTIONS) as tracker:
        weights[0] = gathered(module, model)
        for step in range(1, STEPS + 1):
            tokens, targets = (t.to(fabric.device) for t in batch(fabric.global_rank, step, "fsdp"))
            fabric.backward(loss_of(module, tokens, targets))
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
            weights[step] = gathered(module, model)
        targets = [(t.layer, t.role) for t in tracker.targets]
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "targets": targets}, args.outdir / "weights.pt")


if __name__ == "__main__":
    main()
