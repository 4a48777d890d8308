"""What each rank runs for tests/cuda/test_cuda_ranks.py: two ranks on the one GPU (gloo), a
SpectralTracker writing TensorBoard with figures (rank 0), every tracker call on the training
thread inside the trap of cuda_checks.SyncDetector.

``how="ddp"``: whole weights, the same on both ranks, so the tracker picks the DistributedEngine
(each rank its share, the results to rank 0 over gloo). ``how="sharded"``: every block's weight a
``Shard(0)`` DTensor on a CUDA mesh (GPT-NeoX's per-head fused ``query_key_value`` among them, whose
roles' rows are scattered over a shard), so it picks the ShardedEngine. Between steps every weight
moves in place on the training stream: the trap is about the tracker's calls, not about a loss
(and the tiny model's forward makes its positions on the CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from sharded_models import TinyTPGPT
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor import dashboards
from spectral_callbacks.monitor.engines import distributed

STEPS = 12
# Snapshots at 0, 1, 2, 4, 8, 12; figures due from the result of step 4 on, and at the end.
OPTIONS = dict(every_n_steps=4, log_spaced_until=3, k=8, figure_every_n_steps=4, drain_timeout=60.0)
SCHEDULED = [0, 1, 2, 4, 8, 12]
# Under DDP a result travels max_pending - 1 scheduled points after its snapshot: 2 sends each at
# the next point, so rank 0 logs (and draws) during the run, not only at its end.
MAX_PENDING = {"ddp": 2, "sharded": 8}
ENGINES = {"ddp": "DistributedEngine", "sharded": "ShardedEngine"}  # what the tracker must pick


def one_gpu_model(how: str, world_size: int, device: str) -> nn.Module:
    """The same weights on every rank; with ``how="sharded"`` the blocks' Linear weights become
    ``Shard(0)`` DTensors (each rank keeps its rows of its own full copy: no communication)."""
    torch.manual_seed(0)
    model = TinyTPGPT(d=64, fused=True).to(device)
    if how == "sharded":
        mesh = init_device_mesh(device, (world_size,))
        for block in model.layers:
            for module in block.modules():
                if isinstance(module, nn.Linear):
                    whole = module.weight.detach()
                    module.weight = nn.Parameter(
                        distribute_tensor(whole, mesh, [Shard(0)], src_data_rank=None)
                    )
    return model


def move_weights(model: nn.Module, step: int, device: str) -> None:
    """An update on the training stream: every (local) weight moves by the same seeded noise."""
    generator = torch.Generator(device=device).manual_seed(step)
    with torch.no_grad():
        for parameter in model.parameters():
            local = parameter.to_local() if isinstance(parameter, DTensor) else parameter
            noise = torch.randn(local.shape, device=device, generator=generator)
            local.add_(noise, alpha=1e-2)


def tracked_on_one_gpu(
    rank: int, world_size: int, logdir: str, how: str, device: str = "cuda"
) -> dict[str, Any]:
    """Train STEPS steps under the tracker; what the trap found on this rank's training thread,
    the engine the tracker chose and the steps whose figures were handed over.

    ``device="cpu"`` runs the same on the host (tests/cuda/test_cuda_checks.py: the helper itself works
    before a GPU runs it; the trap then has no device to catch).
    """
    from cuda_checks import SyncDetector

    if device == "cuda":
        torch.cuda.set_device(0)
    # Every scheduled step must be logged: a result not done at its point waits for it (polling
    # its events, never a device wait) instead of being sent as missing, as in tests/ddp_train.py.
    distributed.DUE_WAIT_SECONDS = 20.0
    drawn: list[int] = []
    draw = dashboards.LiveFigures.draw

    def counted_draw(self: Any, experiments: Any, rows: Any, step: int) -> None:
        drawn.append(step)
        draw(self, experiments, rows, step)

    dashboards.LiveFigures.draw = counted_draw  # type: ignore[method-assign]
    model = one_gpu_model(how, world_size, device)
    detector = SyncDetector()
    with detector.active():
        # The tracker's construction snapshots step 0. The sharded engine's construction reads
        # each piece's global indices back to the host once (shards.local_indices): a one-off
        # at fit start, so that case checks the steps and the end only.
        construction = detector.checking("construction")
        with construction if how == "ddp" else contextlib.nullcontext():
            tracker = SpectralTracker(model, logdir=logdir, max_pending=MAX_PENDING[how], **OPTIONS)
        for step in range(1, STEPS + 1):
            move_weights(model, step, device)
            with detector.checking(f"step {step}"):
                tracker.step(step)
        with detector.checking("close"):
            tracker.close()
    return {
        "found": detector.found,
        "engine": type(tracker._engine).__name__,
        "drawn": drawn,
    }
