"""A short sharded Fabric loop (CPU, gloo, 2 processes) with SpectralTracker, for
tests/integrations/test_fabric.py.

``python tests/fabric_train.py OUTDIR``

Lightning Fabric's ``ModelParallelStrategy`` (``data_parallel_size=2``) with a ``parallelize_fn``
that applies ``fully_shard`` (FSDP2) per block of Hugging Face's GPT-2 and to the root, the biases
non-zero as a checkpoint's are. The tracker is built on the module ``fabric.setup_module``
returns and logs to ``fabric.loggers``. Fabric re-runs this script once per extra rank, so it must
be a file. At every step the script gathers every watched matrix (``full_tensor()``, a test-only
collective on every rank) and rank 0 saves them to ``OUTDIR/weights.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from lightning.fabric.strategies import ModelParallelStrategy

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


def gathered(model: torch.nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """Every watched matrix in float64 by (layer, role), gathered with ``full_tensor()``."""
    return {(t.layer, t.role): full_matrix(t) for t in find_targets(model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share a small machine
    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1),
        loggers=TensorBoardLogger(args.outdir, name="tb", version=0),
    )
    fabric.launch()
    model, loss_of = gpt2_with_biases()
    module = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-2))
    weights = {}
    with SpectralTracker(module, writers=fabric.loggers, start_step=0, **OPTIONS) as tracker:
        weights[0] = gathered(model)
        for step in range(1, STEPS + 1):
            fabric.backward(loss_of(module, *batch(fabric.global_rank, step, "fsdp")))
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
            weights[step] = gathered(model)
        targets = [(t.layer, t.role) for t in tracker.targets]
    if fabric.global_rank == 0:
        torch.save({"weights": weights, "targets": targets}, args.outdir / "weights.pt")


if __name__ == "__main__":
    main()
