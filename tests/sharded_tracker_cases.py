"""A raw training loop with SpectralTracker on a fully_shard GPT-2, per rank (spawn_ranks.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
from sharded_engine_cases import batch
from sharded_models import build, full_matrix, shard
from torch.distributed.tensor import init_device_mesh

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.engines import sharded
from spectral_callbacks.targets import find_targets

K = 8
STEPS = 10
# The tracked runs' options; max_pending never lets a loaded machine skip a snapshot: the tests
# check every scheduled step.
OPTIONS = dict(
    every_n_steps=4, log_spaced_until=3, k=K, figures=False, drain_timeout=20.0, max_pending=8
)


def tracked_training(
    rank: int,
    world_size: int,
    logdir: str,
    fail_rank: int | None = None,
    fail_step: int | None = None,
    fail_in: str = "training",
) -> dict[str, Any]:
    """Train STEPS steps under the tracker (0, 1, 2, every 4, the last); rank 0 returns the full
    weights of every step (gathered by the test, not by the tracker).

    ``fail_rank`` raises at ``fail_step``: in its training step (``fail_in="training"``) or in its
    sharded SVD of that snapshot (``"svd"``, on the worker thread).
    """
    if fail_in == "svd" and rank == fail_rank:  # this rank never joins that snapshot's SVD
        decompose = sharded.ShardedEngine._decompose

        def failing(engine: Any, snapshot: Any) -> Any:
            if snapshot.step == fail_step:
                raise RuntimeError(f"planned failure on rank {rank} at step {fail_step}")
            return decompose(engine, snapshot)

        sharded.ShardedEngine._decompose = failing  # type: ignore[method-assign]
    torch.manual_seed(0)  # the same initial weights on every rank
    model, loss_of = build("gpt2", d=64)
    shard(model, "fsdp", init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    targets = find_targets(model)
    weights = {0: {target.name: full_matrix(target) for target in targets}}
    with SpectralTracker(model, logdir=logdir, **OPTIONS) as tracker:
        for step in range(1, STEPS + 1):
            if rank == fail_rank and step == fail_step and fail_in == "training":
                raise RuntimeError(f"planned failure on rank {rank} at step {step}")
            loss_of(model, *batch(rank, step, "fsdp")).backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
            weights[step] = {target.name: full_matrix(target) for target in targets}
    return {
        "state": tracker.state_dict(),
        "weights": weights if rank == 0 else None,
        "targets": [(target.name, target.layer, target.role) for target in targets],
    }


def resumed_training(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    """Train 6 steps, save a distributed checkpoint (model) and the tracker's state, then resume
    a freshly built and sharded model from them and train to step 10 under a new tracker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    mesh = init_device_mesh("cpu", (world_size,))
    found: dict[str, Any] = {}
    state: dict[str, Any] | None = None
    for run, (seed, first, last) in enumerate([(0, 1, 6), (1, 7, 10)]):
        torch.manual_seed(seed)  # the resumed model starts from other weights until it loads
        model, loss_of = build("gpt2", d=64)
        shard(model, "fsdp", mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if run == 1:
            weights = get_model_state_dict(model)
            dcp.load({"model": weights}, checkpoint_id=f"{outdir}/checkpoint")
            set_model_state_dict(model, weights)
            found["loaded"] = {t.name: full_matrix(t) for t in find_targets(model)}
        with SpectralTracker(
            model, logdir=f"{outdir}/tb{run}", state=state, start_step=first - 1, **OPTIONS
        ) as tracker:
            for step in range(first, last + 1):
                loss_of(model, *batch(rank, step, "fsdp")).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.step(step)
        state = tracker.state_dict()
        found[f"state{run}"] = state
        if run == 0:
            found["saved"] = {t.name: full_matrix(t) for t in find_targets(model)}
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{outdir}/checkpoint")
    found["targets"] = [(t.name, t.layer, t.role) for t in find_targets(model)]
    return found


def hf_callback_under_fully_shard(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    """SpectralTrainerCallback's hooks, called as the Trainer calls them, on a ``fully_shard``
    GPT-2: what accelerate's FSDP2 (``fsdp_version: 2``) hands the callbacks, the same module with
    DTensor parameters. (The Trainer itself runs FSDP only on GPUs: with ``use_cpu=True`` it
    falls back to DDP.) Rank 0 returns the engine's name and the full weights of each step."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    torch.manual_seed(0)
    model, loss_of = build("gpt2", d=64)
    shard(model, "fsdp", init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    targets = find_targets(model)
    args = TrainingArguments(output_dir=outdir, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback = SpectralTrainerCallback(
        logdir=f"{outdir}/tb",
        every_n_steps=4,
        log_spaced_until=3,
        k=K,
        figures=False,
        max_pending=8,  # never a skip under load: the test checks every scheduled step
    )
    callback.on_train_begin(args, state, control, model=model)
    assert callback.tracker is not None
    engine = type(callback.tracker._engine).__name__
    weights = {0: {target.name: full_matrix(target) for target in targets}}
    for step in range(1, 5):
        loss_of(model, *batch(rank, step, "fsdp")).backward()
        optimizer.step()
        optimizer.zero_grad()
        state.global_step = step
        callback.on_step_end(args, state, control, model=model)
        weights[step] = {target.name: full_matrix(target) for target in targets}
    callback.on_train_end(args, state, control, model=model)
    return {
        "engine": engine,
        "weights": weights if rank == 0 else None,
        "targets": [(target.name, target.layer, target.role) for target in targets],
    }
