"""What each rank runs for tests/monitor/engines/test_sharded_updates.py: a raw training loop with
``SpectralTracker`` on a small Llama-layout GPT sharded by FSDP2 (``fully_shard`` per block),
tensor parallelism (``parallelize_module``) or both on a 2-D (dp, tp) mesh (``fsdp-tp``: tensor
parallel blocks under ``fully_shard`` over dp), dense, with PEFT LoRA / DoRA adapters, or with
``delta="first"``; rank 0 returns the full effective matrices and updates of every scheduled step,
formed in float64 by the test from ``full_tensor()`` of the base and the factors. Under NCCL each
rank's model lives on its GPU (``spawn_ranks`` made it current)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from sharded_engine_cases import batch
from sharded_models import TinyTPGPT, blocks, full_matrix
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from spectral_callbacks import SpectralTracker

K = 8
STEPS = 4
SCHEDULED = [0, 1, 2, 4]  # OPTIONS' schedule over STEPS: 0, 1, 2, every 4, the last
OPTIONS = dict(
    every_n_steps=4, log_spaced_until=3, k=K, figures=False, drain_timeout=20.0, max_pending=8
)
ADAPTED = ["q_proj", "v_proj", "o_proj", "down_proj"]  # rows and (under TP) columns splits
# FSDP2 over tensor parallelism splits a row-parallel base in tiles, where an adapter is refused:
# there the column-parallel ones (whole rows on every rank) are adapted.
ADAPTED_IN_ROWS = ["q_proj", "v_proj", "up_proj"]


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_of(how: str, world_size: int) -> Any:
    """A 1-D mesh of every rank, or for ``fsdp-tp`` a (dp, tp) mesh with tp = 2."""
    if how == "fsdp-tp":
        return init_device_mesh(device().type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device().type, (world_size,))


def data(rank: int, step: int, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch on its device: one per data-parallel rank (under ``fsdp-tp`` the two
    tensor-parallel ranks of a dp rank share it)."""
    if how == "fsdp-tp":
        rank, how = rank // 2, "fsdp"
    return tuple(t.to(device()) for t in batch(rank, step, how))  # type: ignore[return-value]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor in float64 (a training-group collective for a DTensor: test-only)."""
    whole = tensor.detach().full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    return whole.to("cpu", torch.float64, copy=True)


def build(kind: str, d: int = 64, rank: int = 4, adapted: list[str] = ADAPTED) -> nn.Module:
    """The model, unsharded, on this rank's device: a 2-layer Llama-layout GPT of width ``d``,
    with PEFT LoRA (or DoRA) adapters of rank ``rank`` on ``adapted`` (random ``B``, so the
    update is non-zero from step 0) for ``lora`` / ``dora``."""
    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = TinyTPGPT(d=d, fused=False).to(device())
    if kind in ("lora", "dora"):
        import peft

        config = peft.LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=adapted,
            init_lora_weights=False,
            use_dora=kind == "dora",
        )
        model = peft.get_peft_model(model, config)
    return model


def shard(model: nn.Module, how: str, mesh: Any) -> None:
    """``fsdp``: ``fully_shard`` per block and the root. ``tp``: Q/K/V/up column-parallel and
    O/down row-parallel; an adapted layer's base as its plain layer would be, its ``B`` column-
    parallel beside a column-parallel base (``A`` replicated) and its ``A`` row-parallel beside a
    row-parallel base (``B`` replicated): the layer's output is then what it is unsharded.
    ``fsdp-tp``: ``tp`` over the mesh's ``tp`` dimension, then ``fsdp`` over its ``dp`` one."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if how == "fsdp-tp":
        shard(model, "tp", mesh["tp"])
        shard(model, "fsdp", mesh["dp"])
        return
    if how == "fsdp":
        for block in blocks(inner):
            fully_shard_block(block, mesh)
        fully_shard_block(model, mesh)
        return
    for block in blocks(inner):
        plan: dict[str, Any] = {}
        for path, style in (
            ("attention.q_proj", "col"),
            ("attention.k_proj", "col"),
            ("attention.v_proj", "col"),
            ("attention.o_proj", "row"),
            ("mlp.up_proj", "col"),
            ("mlp.down_proj", "row"),
        ):
            layer = block.get_submodule(path)
            parallel = ColwiseParallel() if style == "col" else RowwiseParallel()
            if hasattr(layer, "base_layer"):  # a PEFT LoRA layer
                plan[f"{path}.base_layer"] = parallel
                factor = "lora_B" if style == "col" else "lora_A"
                for name in getattr(layer, factor):
                    plan[f"{path}.{factor}.{name}"] = (
                        ColwiseParallel() if style == "col" else RowwiseParallel()
                    )
            else:
                plan[path] = parallel
        parallelize_module(block, mesh, plan)


def fully_shard_block(module: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)


def effective(target: Any) -> dict[str, Any]:
    """The target's whole effective matrix ``weight`` and its ``update`` (``None`` for a dense
    target), float64: ``W_0 + s B A`` (DoRA: rows scaled to the magnitude), ``W_t - W_ref`` for
    ``delta=``; an adapted target's ``factors`` ``(W_0, s B, A, g)`` too."""
    layer = getattr(target, "layer_module", None)
    if layer is None:
        weight = full_matrix(target).cpu()
        reference = getattr(target, "reference", None)
        if reference is None:
            return {"weight": weight, "update": None}
        reference = target.rows.take(full(reference))
        return {"weight": weight, "update": weight - reference, "base": reference}
    base = target.rows.take(full(target.parameter))
    (name,) = target.adapters
    up = layer.scaling[name] * full(layer.lora_B[name].weight)
    down = full(layer.lora_A[name].weight)
    weight = base + up @ down
    g = None
    if name in layer.lora_magnitude_vector:
        g = full(layer.lora_magnitude_vector[name].weight)
        weight = (g / torch.linalg.vector_norm(weight, dim=1))[:, None] * weight
    return {"weight": weight, "update": up @ down, "base": base, "factors": (base, up, down, g)}


def one_process_bytes(kind: str, how: str) -> int:
    """The bytes one process's budget counts for a whole snapshot of the same model, unsharded
    (``budget.plan_snapshot``: the copies, the largest working set, the kept subspaces): what
    ``max_snapshot_bytes`` must hold for one process to take it at once."""
    from spectral_callbacks.monitor.engines.budget import plan_snapshot
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.snapshot import group_by_shape
    from spectral_callbacks.targets import find_targets

    groups = group_by_shape(find_targets(build(kind, adapted=adapted_for(how)).cpu()))
    plan = plan_snapshot(groups, SpectrumCompute(K), None)
    return sum(plan.copies.values()) + max(plan.working.values()) + plan.kept


def adapted_for(how: str) -> list[str]:
    return ADAPTED_IN_ROWS if how == "fsdp-tp" else ADAPTED


def tracked(
    rank: int, world_size: int, how: str, kind: str, logdir: str, measure: bool = False
) -> dict[str, Any]:
    """Train STEPS steps under the tracker; rank 0 returns the effective matrices and updates of
    every scheduled step, the targets, and each rank's split of each target. ``measure``: the
    snapshots run inline (``synchronous=True``), each ``tracker.step`` inside
    :class:`~tensor_memory.AllocationPeak`, its peak returned in ``peaks``, with the bytes of this
    rank's local shards of the watched matrices (``local_bytes``)."""
    from tensor_memory import AllocationPeak

    model = build(kind, adapted=adapted_for(how))
    shard(model, how, mesh_of(how, world_size))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    options: dict[str, Any] = {"delta": "first"} if kind == "delta" else {}
    if measure:
        options["synchronous"] = True
    seen: dict[int, dict[str, tuple]] = {}
    peaks: dict[int, int] = {}
    with SpectralTracker(model, logdir=logdir, **OPTIONS, **options) as tracker:
        targets = tracker.targets
        seen[0] = {target.name: effective(target) for target in targets}
        for step in range(1, STEPS + 1):
            loss = model(*data(rank, step, how))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if measure:
                with AllocationPeak(device()) as peak:
                    tracker.step(step)
                peaks[step] = peak.peak
            else:
                tracker.step(step)
            if step in SCHEDULED:
                seen[step] = {target.name: effective(target) for target in targets}
        engine = tracker._engine
        splits = {p.target.name: p.split for g in engine.groups.values() for p in g.pieces}
    local = {t.parameter.to_local() for t in targets if isinstance(t.parameter, DTensor)}
    return {
        "local_bytes": sum(t.numel() * t.element_size() for t in local),
        "one_process_bytes": one_process_bytes(kind, how) if measure else None,
        "targets": [(t.name, t.layer, t.role, t.has_update) for t in targets],
        "seen": seen if rank == 0 else None,
        "splits": splits,
        "state": tracker.state_dict(),
        "peaks": peaks,
    }


CASES = [
    ("fsdp", "dense"),
    ("fsdp", "lora"),
    ("fsdp", "dora"),
    ("fsdp", "delta"),
    ("tp", "dense"),
    ("tp", "lora"),
    ("tp", "delta"),
]


# On 4 ranks: each strategy x {dense, LoRA, delta}, tensor parallelism on a 1-D mesh of 4 and
# FSDP2 over it on a 2 x 2 mesh (its row-parallel weights in tiles).
CASES_ON_4 = [
    (how, kind) for how in ("fsdp", "tp", "fsdp-tp") for kind in ("dense", "lora", "delta")
]


def tracked_all(
    rank: int, world_size: int, logroot: str, cases: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """Every case of ``cases`` (default ``CASES``) in one group of processes (each its own
    logdir); with ``cases`` also ``memory-*``: FSDP2 dense and with LoRA (and on 4 ranks FSDP2
    over TP) inline, measured, and on 4 ranks ``tiles``: what a LoRA adapter on a base split in
    tiles (``fsdp-tp``'s row-parallel O and MLP down) is told."""
    found = {
        f"{how}-{kind}": tracked(rank, world_size, how, kind, f"{logroot}/{how}-{kind}")
        for how, kind in (cases or CASES)
    }
    if cases is not None:
        measured = [("fsdp", "dense"), ("fsdp", "lora")]
        if world_size == 4:
            measured.append(("fsdp-tp", "dense"))
            found["tiles"] = refused(rank, world_size, "fsdp-tp", "lora", ADAPTED)
        for how, kind in measured:
            logdir = f"{logroot}/memory-{how}-{kind}"
            found[f"memory-{how}-{kind}"] = tracked(rank, world_size, how, kind, logdir, True)
    return found


def refused(rank: int, world_size: int, how: str, kind: str, adapted: list[str] = ADAPTED) -> str:
    """What building a tracker on the sharded model says (one line), or ``"no error"``."""
    model = build(kind, adapted=adapted)
    shard(model, how, mesh_of(how, world_size))
    try:
        SpectralTracker(model, logdir=tempfile.mkdtemp(), **OPTIONS).close(0)
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return f"{type(error).__name__}: {error}"
    return "no error"


def circuits_refused(rank: int, world_size: int, how: str) -> list[str]:
    """``circuits=True`` on a sharded model: the warnings it gives, and the targets watched."""
    import warnings

    model = build("dense")
    shard(model, how, init_device_mesh("cpu", (world_size,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tracker = SpectralTracker(model, logdir=tempfile.mkdtemp(), circuits=True, **OPTIONS)
        except Exception as error:  # noqa: BLE001 - the message is what the test reads
            return [f"{type(error).__name__}: {error}"]
        names = [target.name for target in tracker.targets]
        tracker.close(0)
    return [str(w.message) for w in caught] + [f"targets: {len(names)}"]


def resumed(rank: int, world_size: int, how: str, kind: str, outdir: str) -> dict[str, Any]:
    """Train 2 steps, save a distributed checkpoint of the model and the tracker's state, then
    resume a freshly built and sharded model from them and train to step 4 under a new tracker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    mesh = init_device_mesh("cpu", (world_size,))
    found: dict[str, Any] = {}
    state: dict[str, Any] | None = None
    options: dict[str, Any] = {"delta": "first"} if kind == "delta" else {}
    for run, (first, last) in enumerate([(1, 2), (3, 4)]):
        model = build(kind)
        if run == 1:  # the resumed model starts from other weights until it loads
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.5)
        shard(model, how, mesh)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if run == 1:
            weights = get_model_state_dict(model)
            dcp.load({"model": weights}, checkpoint_id=f"{outdir}/checkpoint")
            set_model_state_dict(model, weights)
        with SpectralTracker(
            model, logdir=f"{outdir}/tb{run}", state=state, start_step=first - 1, **OPTIONS,
            **options,
        ) as tracker:  # fmt: skip
            if run == 0:
                found["step0"] = {t.name: effective(t) for t in tracker.targets}
            for step in range(first, last + 1):
                model(*batch(rank, step, how)).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.step(step)
            found[f"last{run}"] = {t.name: effective(t) for t in tracker.targets}
        state = tracker.state_dict()
        found[f"state{run}"] = state
        if run == 0:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{outdir}/checkpoint")
        found["targets"] = [(t.name, t.layer, t.role) for t in tracker.targets]
    if rank != 0:
        found.pop("step0"), found.pop("last0"), found.pop("last1")
    return found
