"""docs/distributed.md's table: each sharding strategy x kind of watched matrix, exact or refused,
and the bytes a rank moves per snapshot against the watched matrices' bytes, measured on N local
gloo processes.

Each function of ``ROWS`` runs its strategies on a gloo group of its own and returns ``Row``s.
``sharded_rows``: FSDP2 (``fully_shard`` per block and the root) and tensor parallelism (Q/K/V/up
column-parallel, O/down row-parallel; an adapter's ``B`` column-parallel beside a column-parallel
base, its ``A`` row-parallel beside a row-parallel one), each with the watched matrices ``dense``,
with PEFT ``LoRA`` adapters (r = 16 on Q, V, O and MLP down) and with ``delta="first"``, on the
Llama-layout GPT of tests/sharded_update_cases.py (2 layers of width ``--width``). It takes a cold
snapshot at step 0 and warm ones after each of 3 AdamW steps through the ``ShardedEngine`` the
tracker builds (k = 32, Krylov blocks in bfloat16); ``exact`` means every stable rank is within 1 %
of the float64 SVD of the whole effective matrix, gathered here by ``full_tensor()``. Each training
step (forward, backward, the optimizer's step; 4 x 16 tokens a rank) runs under
:class:`CollectiveBytes`, which counts the bytes of every collective the strategy issues (FSDP2's
all-gathers and reduce-scatters, tensor parallelism's all-reduces) and is checked against the
number of collectives torch's ``CommDebugMode`` counts in the same step.

``partitioned_rows``: FSDP1 (``FullyShardedDataParallel``, one unit per block,
``use_orig_params=True``) and DeepSpeed ZeRO-3, gathered unit by unit (``monitor/engines/
partitioned.py``), on a GPT-2 of 2 blocks of width ``--width``. FSDP1 x {dense, delta} runs a real
tracker and *measures* the bytes with :class:`CollectiveBytes` during one snapshot and during one
training step (``strategy's own KB/step``: its all-gathers, forward and backward gather every unit;
the note adds its reduce-scatters); ZeRO-3 is not run here
(DeepSpeed's CPU accelerator JIT-builds an extension, minutes): its bytes are *counted* from the
``ds_numel`` of the parameters each block's gather holds, and its own traffic as 2 gathers of every
parameter. Their ``exact`` cites tests/integrations/test_fsdp1.py (FSDP1 dense, delta and LoRA) and
test_deepspeed.py (ZeRO-3 dense, delta and LoRA under the Hugging Face Trainer). LoRA (PEFT, r = 4
on Q, K, V, O and MLP down): each adapted layer's snapshot copies its frozen base inside the gather
(whole only there) with its factors; the note gives those bytes.

Columns: ``moved KB`` (sharded rows: the payload a rank put into all-reduces per warm snapshot, the
mean of the warm ones; gathered rows: what a rank receives in the snapshot's all-gathers);
``watched MB`` (the whole watched matrices, float32: what gathering them would move); ``moved %``;
``strategy's own KB/step`` (what a rank sends in one training step's collectives, counted as a ring
sends them: ``(N - 1) / N`` of an all-gather's output or a reduce-scatter's input, ``2 (N - 1) / N``
of an all-reduce's tensor; the sharded rows compare it with the snapshot's payload counted the same
way, which at 2 ranks is the payload itself); the note of a LoRA row gives what its adapters add
per snapshot (the factors, ``r (m + n)`` floats per adapted matrix, and the bases' norms).

::

    python benchmarks/distributed_table.py                       # width 512, 2 ranks
    python benchmarks/distributed_table.py --width 1024 --world-size 4
    python benchmarks/distributed_table.py --rows partitioned        # FSDP1 and ZeRO-3 only
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(Path(__file__).parent)]
import smoke  # noqa: E402

KINDS = ("dense", "lora", "delta")
CADENCE = 25  # the docs' reference cadence of a gathered strategy: a snapshot every 25 steps


def measure(rank: int, world_size: int, strategy: str, kind: str, args: Any) -> dict[str, Any]:
    """One strategy x kind: bytes per snapshot and whether every value is exact."""
    import sharded_update_cases as cases
    from sharded_engine_cases import batch
    from torch.distributed.tensor import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from spectral_callbacks.functional import metrics_from_spectrum
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.engines.sharded import ShardedEngine, svd_group
    from spectral_callbacks.monitor.options import MonitorOptions
    from spectral_callbacks.targets import find_targets
    from spectral_callbacks.targets.delta import with_references

    model = cases.build(kind, d=args.width, rank=args.rank)
    how = "fsdp" if strategy == "fsdp2" else "tp"
    cases.shard(model, how, init_device_mesh("cpu", (world_size,)))
    targets = list(find_targets(model))
    if kind == "delta":
        targets = with_references(targets, "first", "benchmark")
    engine = ShardedEngine(
        targets,
        SpectrumCompute(args.k),
        MonitorOptions(synchronous=True),
        group=svd_group(timeout_seconds=600),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sent, adapters, traffic, exact = [], [], [], True
    for step in range(args.steps + 1):
        if step:  # training's own collectives: forward, backward and the optimizer's step
            with CommDebugMode() as debug, CollectiveBytes(world_size) as training:
                model(*batch(rank, step, how)).backward()
                optimizer.step()
                optimizer.zero_grad()
            if training.calls != debug.get_total_counts():  # both see the same collectives
                raise RuntimeError(
                    f"{training.calls} collectives counted, CommDebugMode saw "
                    f"{debug.get_total_counts()}"
                )
            traffic.append(training.sent)
        engine.offer(step)
        wholes = {t.name: cases.effective(t)["weight"] for t in targets}  # collectives: all ranks
        (result,) = engine.collect()
        sent.append(result.sent_bytes)
        adapters.append(result.factor_bytes)
        for name, whole in wholes.items():
            S = torch.linalg.svdvals(whole)[: args.k]
            truth = float(metrics_from_spectrum(S, (whole**2).sum())["stable_rank"])
            exact &= abs(result.metrics[name]["stable_rank"] / truth - 1) < 0.01
    engine.close()
    watched = sum(t.shape[0] * t.shape[1] * 4 for t in targets)
    return {
        "watched": watched,
        "sent": sent,
        "adapters": adapters,
        "exact": exact,
        "traffic": traffic,
        "tokens": batch(rank, 1, how)[0].numel(),
    }


class Row(NamedTuple):
    """One row of the table: bytes per rank per snapshot, measured ("" where not measured)."""

    strategy: str
    kind: str
    status: str  # "exact" or "refused"
    why: str
    moved_bytes: float | str  # what a rank sends per warm snapshot
    watched_bytes: float | str  # the watched matrices, whole (what gathering them would move)
    strategy_bytes_per_step: float | str  # the strategy's own traffic per training step


def _sharded_rank(rank: int, world_size: int, store: str, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    rows = []
    for strategy in ("fsdp2", "tp"):
        for kind in KINDS:
            try:
                row = measure(rank, world_size, strategy, kind, args)
            except Exception as error:  # noqa: BLE001 - a refusal is a row of the table
                row = {"refused": f"{type(error).__name__}: {error}"}
            rows.append((strategy, kind, row))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()
    os._exit(0)  # skip teardown: nothing is left to flush


def _on_ranks(rank_main: Callable[..., None], world_size: int, args: argparse.Namespace) -> Any:
    """Run ``rank_main(rank, world_size, store, args, out)`` on ``world_size`` spawned processes;
    what rank 0 saved to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        context = multiprocessing.get_context("spawn")
        processes = [
            context.Process(target=rank_main, args=(r, world_size, store, args, out))
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if not os.path.exists(out):
            sys.exit("a rank failed; see its traceback above")
        return torch.load(out, weights_only=False)


def sharded_rows(world_size: int, width: int, smoke: bool) -> list[Row]:
    """FSDP2 and tensor parallelism x {dense, LoRA, delta}, measured on ``world_size`` processes."""
    args = argparse.Namespace(
        width=width, rank=4 if smoke else 16, k=8 if smoke else 32, steps=1 if smoke else 3
    )
    measured = _on_ranks(_sharded_rank, world_size, args)
    rows = []
    for strategy, kind, row in measured:
        name = {"fsdp2": "FSDP2", "tp": "tensor parallel"}[strategy]
        label = {"dense": "dense", "lora": "LoRA", "delta": "delta"}[kind]
        if "refused" in row:
            rows.append(Row(name, label, "refused", row["refused"], "", "", ""))
            continue
        warm = sum(row["sent"][1:]) / max(len(row["sent"]) - 1, 1)
        per_step = _mean_traffic(row["traffic"])
        # the snapshot's all-reduce payload as the bytes a ring sends, as the step's are counted
        on_wire = 2 * (world_size - 1) / world_size * warm
        why = _cadence(on_wire, sum(per_step.values()), "measured", "collectives")
        if "all_gather" in per_step:  # FSDP2: comparable with the gathered strategies' notes
            why += f"; {on_wire / per_step['all_gather']:.2f} of its all-gathers alone"
        why += "; the step's " + ", ".join(
            f"{kind.replace('_', '-')}s {size / 1e3:.0f} KB" for kind, size in per_step.items()
        )
        if strategy == "tp":  # activations: the more tokens a step, the more they move
            why += f" at {row['tokens']} tokens a step"
        if kind == "lora":
            why += f"; adapters' factors {row['adapters'][0] / 1e3:.1f} KB"
        status = "exact" if row["exact"] else "NOT EXACT"
        rows.append(Row(name, label, status, why, warm, row["watched"], sum(per_step.values())))
    return rows


def _mean_traffic(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """The bytes of each kind of collective one training step sent, the mean over ``steps``."""
    kinds = sorted({kind for step in steps for kind in step})
    return {kind: sum(step.get(kind, 0.0) for step in steps) / len(steps) for kind in kinds}


class CollectiveBytes(TorchDispatchMode):
    """Counts, per kind, the bytes this rank sends through the collectives run meanwhile: the
    ``c10d`` ops ``torch.distributed``'s functions dispatch (FSDP1's and FSDP2's all-gathers and
    reduce-scatters) and the functional collectives DTensor issues (tensor parallelism's
    all-reduces), the ops torch's ``CommDebugMode`` counts (it counts calls, not bytes; ``calls``
    here is the same count). A ring algorithm over N ranks sends ``(N - 1) / N`` of an all-gather's
    output or a reduce-scatter's input and ``2 (N - 1) / N`` of an all-reduce's tensor.

    Every collective counted must be on a group of ``world_size`` ranks (these benchmarks have one
    mesh dimension). DTensor operations are let through (``NotImplemented``) so that they run as
    the collectives they lower to, which are then counted.
    """

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.share = (world_size - 1) / world_size
        self.sent: dict[str, float] = {}
        self.calls = 0
        c10d, functional = torch.ops.c10d, torch.ops._c10d_functional
        # op -> (kind, which tensors it moves: "output" the op's first argument or its result,
        # "input" its input tensors)
        self.ops: dict[Any, tuple[str, str]] = {
            c10d.allgather_: ("all_gather", "output"),
            c10d._allgather_base_: ("all_gather", "output"),
            c10d.allgather_into_tensor_coalesced_: ("all_gather", "output"),
            c10d.reduce_scatter_: ("reduce_scatter", "input"),
            c10d._reduce_scatter_base_: ("reduce_scatter", "input"),
            c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", "input"),
            c10d.allreduce_: ("all_reduce", "input"),
            c10d.allreduce_coalesced_: ("all_reduce", "input"),
            functional.all_gather_into_tensor: ("all_gather", "output"),
            functional.all_gather_into_tensor_coalesced: ("all_gather", "output"),
            functional.reduce_scatter_tensor: ("reduce_scatter", "input"),
            functional.reduce_scatter_tensor_coalesced: ("reduce_scatter", "input"),
            functional.all_reduce: ("all_reduce", "input"),
            functional.all_reduce_coalesced: ("all_reduce", "input"),
        }

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            return NotImplemented  # let DTensor lower it; its collectives come back here
        out = func(*args, **(kwargs or {}))
        counted = self.ops.get(getattr(func, "_overloadpacket", None))
        if counted is not None:
            kind, moved = counted
            c10d_op = func.namespace == "c10d"  # in place: (outputs, inputs, group, ...)
            if moved == "output":
                tensors = args[0] if c10d_op else out
            else:
                tensors = args[1] if c10d_op and kind == "reduce_scatter" else args[0]
            size = sum(
                t.numel() * t.element_size() for t in tree_leaves(tensors) if torch.is_tensor(t)
            )
            factor = 2 * self.share if kind == "all_reduce" else self.share
            self.sent[kind] = self.sent.get(kind, 0.0) + factor * size
            self.calls += 1
        return out

    @property
    def total(self) -> float:
        return sum(self.sent.values())


def gpt2(width: int, layers: int) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=width, n_layer=layers, n_head=4)
    model = GPT2LMHeadModel(config)
    return model, lambda held, tokens: held(tokens, labels=tokens).loss


def fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA, r = 4, on every ``c_attn`` and ``c_proj`` (Q, K, V, O and MLP down); random
    ``B``, so the update is non-zero from the first snapshot."""
    import peft

    config = peft.LoraConfig(
        r=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def fsdp1_rows(rank: int, world_size: int, args: argparse.Namespace, logdir: str) -> list[Row]:
    """FSDP1 x {dense, delta, LoRA}: a real tracker, bytes measured."""
    from spectral_callbacks import SpectralTracker

    rows = []
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(rank))
    for kind, options in (("dense", {}), ("delta", {"delta": "first"}), ("LoRA", {})):
        model, loss_of = gpt2(args.width, args.layers)
        if kind == "LoRA":
            model = with_lora(model)
        held = fsdp1(model)
        optimizer = torch.optim.AdamW([p for p in held.parameters() if p.requires_grad], lr=1e-3)
        tracker = SpectralTracker(
            held, logdir=f"{logdir}/{kind}", figures=False, every_n_steps=1, start_step=None,
            **options,
        )  # fmt: skip
        tracker.begin(0)  # step 0's snapshot: the cold one (measured below: a later, warm one)
        with CollectiveBytes(world_size) as step:
            loss_of(held, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        with CollectiveBytes(world_size) as snapshot:
            tracker.step(1)
        tracker.close()
        watched = sum(t.shape[0] * t.shape[1] * t.parameter.element_size() for t in tracker.targets)
        moved, per_step = snapshot.sent["all_gather"], step.sent["all_gather"]
        note = _cadence(moved, per_step, "measured")
        note += f"; the step's reduce-scatters {step.sent['reduce_scatter'] / 1e3:.0f} KB besides"
        if kind == "LoRA":
            note += _adapted_copies(tracker.targets)
        rows.append(Row("FSDP1", kind, "exact", note, moved, watched, per_step))
    return rows


def zero3_rows(rank: int, world_size: int, args: argparse.Namespace, logdir: str) -> list[Row]:
    """ZeRO-3: the units' bytes counted from the ``ds_numel`` DeepSpeed sets (not run here)."""
    from spectral_callbacks.monitor.engines.partitioned import Zero3Gathering, held_in_gathers
    from spectral_callbacks.targets import find_targets

    rows = []
    for kind in ("dense", "delta", "LoRA"):
        model, _ = gpt2(args.width, args.layers)
        if kind == "LoRA":
            model = with_lora(model)
        for number, parameter in enumerate(model.parameters()):  # DeepSpeed's documented marks
            parameter.ds_id, parameter.ds_status = number, "NOT_AVAILABLE"
            parameter.ds_numel, parameter.ds_shape = parameter.numel(), parameter.shape
        targets = held_in_gathers(find_targets(model))  # as the tracker holds them
        units = Zero3Gathering(model).units(targets)
        moved = sum(unit.gathered_bytes for unit in units) * (world_size - 1) // world_size
        watched = sum(t.shape[0] * t.shape[1] * t.parameter.element_size() for t in targets)
        every = sum(p.numel() * p.element_size() for p in model.parameters())
        per_step = 2 * every * (world_size - 1) // world_size  # forward + backward gathers
        note = _cadence(moved, per_step, "counted from ds_numel")
        if kind == "LoRA":
            note = "the same path as FSDP1 LoRA's; " + note
            note += _adapted_copies(targets)
        rows.append(Row("ZeRO-3", kind, "exact", note, float(moved), watched, per_step))
    return rows


def _cadence(moved: float, per_step: float, how: str, what: str = "all-gathers") -> str:
    """The note of a row: one snapshot's bytes against the strategy's own ``what`` per step."""
    return (
        f"{how}; one snapshot = {moved / per_step:.2f} of one step's {what}, "
        f"{moved / (CADENCE * per_step):.3f} of {CADENCE} steps'"
    )


def _adapted_copies(targets: Sequence[Any]) -> str:
    """What the adapted matrices' snapshots copy inside the gathers, all ranks together: each
    frozen base (whole only there) and its factors."""
    copied = sum(t.snapshot_bytes() for t in targets if t.adapter_layer() is not None)
    return f"; adapted bases copied in the gather with their factors: {copied / 1e3:.0f} KB"


def _partitioned_rank(rank: int, world_size: int, store: str, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    rows = fsdp1_rows(rank, world_size, args, f"{out}.tb") + zero3_rows(
        rank, world_size, args, f"{out}.tb"
    )
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()
    os._exit(0)  # skip teardown: nothing is left to flush


def partitioned_rows(world_size: int, width: int, smoke: bool) -> list[Row]:
    """FSDP1 and ZeRO-3 x {dense, delta, LoRA}: gathered unit by unit (FSDP1 measured by
    counting its all-gathers, ZeRO-3 counted from ``ds_numel``), on a GPT-2 of 2 blocks."""
    args = argparse.Namespace(width=width, layers=2)
    return list(_on_ranks(_partitioned_rank, world_size, args))


ROWS: list[Callable[[int, int, bool], list[Row]]] = [sharded_rows, partitioned_rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=[rows_of.__name__.removesuffix("_rows") for rows_of in ROWS],
        default=[rows_of.__name__.removesuffix("_rows") for rows_of in ROWS],
        help="which strategy families to measure (default: all)",
    )
    args = smoke.parse_args(parser, argv, width=64)
    chosen = [rows_of for rows_of in ROWS if rows_of.__name__.removesuffix("_rows") in args.rows]
    rows = [row for rows_of in chosen for row in rows_of(args.world_size, args.width, args.smoke)]
    print(f"{args.world_size} gloo processes, width {args.width}; bytes per rank per snapshot")
    print("| strategy | watched | exact / refused | moved KB | watched MB | moved % | "
          "strategy's own KB/step | note |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        moved = f"{row.moved_bytes / 1e3:.0f}" if isinstance(row.moved_bytes, float) else ""
        watched = row.watched_bytes
        size = f"{watched / 1e6:.2f}" if isinstance(watched, int | float) else ""
        share = (
            f"{100 * row.moved_bytes / watched:.1f}"
            if isinstance(row.moved_bytes, float) and isinstance(watched, int | float)
            else ""
        )
        own = row.strategy_bytes_per_step
        own_text = f"{own / 1e3:.0f}" if isinstance(own, int | float) else ""
        print(
            f"| {row.strategy} | {row.kind} | {row.status} | {moved} | {size} | {share} | "
            f"{own_text} | {row.why} |"
        )


if __name__ == "__main__":
    main()
