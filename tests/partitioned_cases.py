"""Raw training loops with SpectralTracker on FSDP1 (``FullyShardedDataParallel``, one unit per
GPT-2 block, ``use_orig_params=True``, on the CPU), per rank (spawn_ranks.run_ranks).

Each rank returns what the test checks; the full weights of every step are gathered *by the test*
with FSDP1's own ``summon_full_params``, never by the tracker.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from sharded_engine_cases import batch
from sharded_models import build

from spectral_callbacks import SpectralTracker
from spectral_callbacks.targets import find_targets

K = 8
R = 4  # the LoRA rank
STEPS = 10
D = 64
# Every scheduled step is checked, so max_pending never lets a loaded machine skip one.
OPTIONS = dict(
    every_n_steps=4, log_spaced_until=3, k=K, figures=False, drain_timeout=20.0, max_pending=8
)


def gpt2_with_biases(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """The tiny GPT-2 of sharded_models with non-zero biases, as a checkpoint's are."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    model, loss_of = build("gpt2", d=D)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.02)
    return model, loss_of


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA (rank ``R``) on every attention and MLP ``c_proj`` and the fused ``c_attn``
    (Conv1D bases: ``fan_in_fan_out``), random ``B`` so the update is non-zero from step 0; the
    MLP's ``c_fc`` stays dense."""
    import peft

    config = peft.LoraConfig(
        r=R,
        lora_alpha=2 * R,
        target_modules=["c_attn", "c_proj"],
        fan_in_fan_out=True,
        init_lora_weights=False,
    )
    return peft.get_peft_model(model, config)


def fsdp1(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP1 as accelerate and the Hugging Face Trainer wrap GPT-2: one unit per block, on
    ``device`` (the CPU, or this rank's GPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
        device_id=device,
        use_orig_params=True,
    )


def here() -> torch.device:
    """This rank's device: its GPU under NCCL (``spawn_ranks`` made it current), else the CPU."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gathered_weights(wrapped: torch.nn.Module, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every watched matrix in float64 by (layer, role), gathered with FSDP1's public
    ``summon_full_params``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        return {
            (t.layer, t.role): t.matrix().to("cpu", torch.float64, copy=True)
            for t in find_targets(model)
        }


def gathered_effective(
    wrapped: torch.nn.Module, model: torch.nn.Module
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Every watched matrix in float64 by (layer, role), from parameters gathered with FSDP1's
    public ``summon_full_params``: ``weight``, the effective ``W_0 + s B A`` of an adapted one
    (formed here from the base and the factors), and its ``update`` ``s B A``."""
    from dataclasses import replace

    from torch.distributed.fsdp import FullyShardedDataParallel

    found = {}
    with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
        for target in find_targets(model):
            layer = getattr(target, "layer_module", None)
            base = target.rows.take(target.parameter.detach()).to("cpu", torch.float64, copy=True)
            if layer is None:
                found[target.layer, target.role] = {"weight": base.clone()}
                continue
            (name,) = target.adapters
            rows = replace(target.rows, transposed=False)  # B's rows: the output's
            up = layer.scaling[name] * rows.take(layer.lora_B[name].weight.detach()).double()
            update = (up @ layer.lora_A[name].weight.detach().double()).cpu()
            found[target.layer, target.role] = {"weight": base + update, "update": update}
    return found


def tracked_fsdp1(
    rank: int,
    logdir: str,
    wrap: bool = True,
    options: dict[str, Any] | None = None,
    steps: tuple[int, int] = (1, STEPS),
    state: dict[str, Any] | None = None,
    checkpoint: str | None = None,
    lora: bool = False,
    measure: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` under the tracker (0, 1, 2, every 4, the last), FSDP1-wrapped (``wrap``)
    or as the same model on every rank with no wrapper (the single-process reference: each rank
    trains as one process would); every rank trains on the same batches, so both follow one
    process's trajectory. ``checkpoint``: saved there (FSDP1's full state dict) after a first run,
    loaded from it before a resumed one (``state``: the tracker's state to resume from).
    ``lora``: PEFT LoRA adapters (:func:`with_lora`) trained, the base frozen; the weights are
    then the effective ones (:func:`gathered_effective`). ``measure``: each ``tracker.step`` runs
    inside :class:`~tensor_memory.AllocationPeak` (with ``synchronous=True`` the whole snapshot,
    its gathers and its SVD, run in that call) and the peaks are returned as ``peaks``."""
    from tensor_memory import AllocationPeak
    from torch.distributed.fsdp import FullyShardedDataParallel

    device = here()
    model, loss_of = gpt2_with_biases()
    if state is not None and checkpoint is not None:
        model.load_state_dict(torch.load(checkpoint))
    if lora:
        model = with_lora(model)
    held = fsdp1(model, device) if wrap else model.to(device)
    optimizer = torch.optim.AdamW([p for p in held.parameters() if p.requires_grad], lr=1e-2)
    first, last = steps
    gathered = gathered_effective if lora else gathered_weights
    weights: dict[int, Any] = {}
    peaks: dict[int, int] = {}
    with SpectralTracker(
        held, logdir=logdir, state=state, start_step=first - 1, **OPTIONS, **(options or {})
    ) as tracker:
        # the delta= references this rank keeps (released at the end of the run), by name
        references = {
            t.name: t.reference.numel() * t.reference.element_size()
            for t in tracker.targets
            if getattr(t, "reference", None) is not None
        }
        weights[first - 1] = gathered(held, model) if wrap else None
        for step in range(first, last + 1):
            loss_of(held, *(t.to(device) for t in batch(0, step, "fsdp"))).backward()
            optimizer.step()
            optimizer.zero_grad()
            if measure:
                with AllocationPeak(device) as peak:
                    tracker.step(step)
                peaks[step] = peak.peak
            else:
                tracker.step(step)
            weights[step] = gathered(held, model) if wrap else None
    if state is None and checkpoint is not None:
        # Through summon_full_params: FSDP1's FULL_STATE_DICT with CPU offload segfaults on the
        # CPU here (torch 2.13, in its post-state-dict hook).
        with FullyShardedDataParallel.summon_full_params(held, writeback=False):
            full = {
                name.replace("_fsdp_wrapped_module.", ""): value.cpu().clone()
                for name, value in model.state_dict().items()
            }
        if rank == 0:
            torch.save(full, checkpoint)
    return {
        "state": tracker.state_dict(),
        "weights": weights if rank == 0 else None,
        "targets": [(t.layer, t.role) for t in tracker.targets],
        "references": references,
        # every watched matrix's name, (m, n) and element size, in target order
        "shapes": [(t.name, t.shape, t.parameter.element_size()) for t in tracker.targets],
        "peaks": peaks,
        # what the budget counts for each adapted matrix's snapshot, and its parts' sizes
        "adapted": {
            (t.layer, t.role): (t.snapshot_bytes(), t.shape, t.parameter.element_size())
            for t in tracker.targets
            if t.adapter_layer() is not None
        },
    }


def refusals(rank: int) -> dict[str, str]:
    """What each FSDP1 wrapping the tracker cannot gather says (or ``"accepted"``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from spectral_callbacks.monitor.options import ConfigurationError

    said = {}
    for use_orig_params in (False, True):
        model, loss_of = gpt2_with_biases()
        wrapped = FullyShardedDataParallel(model, device_id=here(), use_orig_params=use_orig_params)
        loss_of(wrapped, *(t.to(here()) for t in batch(rank, 1, "fsdp"))).backward()  # it trains
        for held, what in ((wrapped, "wrapper"), (model, "inside")):
            try:
                SpectralTracker(held, figures=False, logdir=None, writers=[_Discard()]).close()
            except ConfigurationError as error:
                said[f"{what}, use_orig_params={use_orig_params}"] = str(error)
            else:
                said[f"{what}, use_orig_params={use_orig_params}"] = "accepted"
    return said


def outer_unit(rank: int, world_size: int = 2) -> dict[str, Any]:
    """What the tracker watches, or says, when handed the module inside FSDP1's root wrapper (as
    Lightning's ``FSDPStrategy`` and the Hugging Face Trainer hand their callbacks), with the
    blocks wrapped in units of their own (the root holds only the embeddings and the final norm)
    or with only the attention wrapped (the root holds the MLP's matrices); and handed the wrapper.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Block

    from spectral_callbacks.monitor.options import ConfigurationError

    found: dict[str, Any] = {}
    for policy in (GPT2Block, GPT2Attention):
        model, loss_of = gpt2_with_biases()
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({policy}),
            device_id=here(),
            use_orig_params=True,
        )
        loss_of(wrapped, *(t.to(here()) for t in batch(rank, 1, "fsdp"))).backward()
        for held, what in ((wrapped, "wrapper"), (model, "inside")):
            try:
                tracker = SpectralTracker(held, figures=False, logdir=None, writers=[_Discard()])
            except ConfigurationError as error:
                found[policy.__name__, what] = str(error)
            else:
                found[policy.__name__, what] = sorted((t.layer, t.role) for t in tracker.targets)
                tracker.close()
    return found


class _Discard:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


def fsdp1_runs(rank: int, world_size: int, outdir: str) -> dict[str, Any]:
    """Everything the FSDP1 tests check, on one group of ranks (a spawn costs more than a run):
    a tracked run with ``delta="first"`` within a budget that holds one gathered unit and this
    rank's share; the same run inline with its allocations measured; the model with LoRA adapters;
    a budget one byte too small; a run resumed from a checkpoint (both with ``delta="first"``); the
    wrappings that are refused. (The single-process run of the same model is the test's own
    process: ``single_process_run``.)
    """
    from spectral_callbacks.monitor.options import ConfigurationError

    found: dict[str, Any] = {"refusals": refusals(rank), "outer_unit": outer_unit(rank)}
    # The bytes a snapshot holds on this rank, as the budget counts them: the refusal of the
    # smallest budget that holds the largest matrix alone says them (each of the <= 4 ranks owns
    # one of the 4 MLP matrices, the costliest, so every rank's share and unit exceed it and
    # every rank refuses; a rank that went on would hang in the gather).
    try:
        tracked_fsdp1(rank, f"{outdir}/never", options=dict(max_snapshot_bytes=1), steps=(1, 0))
    except ConfigurationError as error:
        one = int(str(error).split("to at least ")[1].split(",")[0])
    try:
        tracked_fsdp1(rank, f"{outdir}/never", options=dict(max_snapshot_bytes=one), steps=(1, 0))
    except ConfigurationError as error:
        said = str(error)
        found["need"] = int(said.split("at once (")[1].split(" bytes")[0])
        found["unit"] = int(re.search(r"(\d+) bytes of them one gathered unit", said)[1])
    need = torch.tensor([found["need"]])
    torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)  # the largest share
    budget = int(need)
    found["budget"] = budget
    try:  # every rank refuses its own need less one byte (a rank that went on would hang)
        tracked_fsdp1(rank, f"{outdir}/never", options=dict(max_snapshot_bytes=found["need"] - 1))
    except ConfigurationError as error:
        found["too_small"] = str(error)
    options = dict(delta="first", max_snapshot_bytes=budget)
    found["fsdp1"] = tracked_fsdp1(rank, f"{outdir}/fsdp1", options=options)
    found["memory"] = tracked_fsdp1(
        rank,
        f"{outdir}/memory",
        options=dict(options, synchronous=True),
        steps=(1, 4),
        measure=True,
    )
    found["lora"] = tracked_fsdp1(rank, f"{outdir}/lora", lora=True)
    checkpoint = f"{outdir}/checkpoint.pt"
    delta = dict(delta="first")
    first = tracked_fsdp1(
        rank, f"{outdir}/first", options=delta, steps=(1, 6), checkpoint=checkpoint
    )
    torch.distributed.barrier()  # rank 0 has saved the checkpoint
    found["first"] = first
    found["resumed"] = tracked_fsdp1(
        rank,
        f"{outdir}/resumed",
        options=delta,
        steps=(7, STEPS),
        state=first["state"],
        checkpoint=checkpoint,
    )
    return found


def single_process_run(outdir: str) -> None:
    """The same model, unwrapped, in the calling process (no process group: the single-process
    engine), trained on the batches every FSDP1 rank trains on, logged to ``outdir/single``."""
    tracked_fsdp1(0, f"{outdir}/single", wrap=False, options=dict(delta="first"))
