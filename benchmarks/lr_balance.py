"""TempBalance's learning-rate balance (``lr_balance``) against the same runs without it, at CPU scale.

Two of the reference experiments, shrunk to a few minutes each on one CPU thread:

* ``lifecycle``: the example GPT (``examples/gpt.py``) in the D8 shape - 8 layers, MHA with the
  fused ``c_attn`` - at width 64, trained from scratch on the Python standard library's bytes with
  the reference schedule (AdamW β = (0.9, 0.95), weight decay 0.1 on matrices, linear warmup then
  cosine to 0.1 of the peak, as ``examples/train_gpt.py``);
* ``lora``: that GPT, first trained on one part of the standard library (once, shared by every
  run), then LoRA-fine-tuned (r = 8 on ``c_attn``, ``c_proj``, ``c_fc``) on another part.

Each arm runs the same steps with the same seeds: ``off`` (the monitor with its ESD fit, no
balancer), ``matrix`` (``LRBalance()``: one factor per watched module) and ``layer``
(``LRBalance(per="layer")``). Validation loss on held-out bytes every ``--eval-every`` steps; the
train loop's wall time (evaluation excluded) per run. Written to ``--out``: ``runs.csv`` (one row
per run), ``factors.csv`` (every logged factor), ``summary.md`` (the tables docs/lr-balance.md
quotes) and the TensorBoard runs.

    python benchmarks/lr_balance.py --out runs/lr-balance          # about 15 minutes, 1 thread
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from data import load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import LRBalance, SpectralTracker, balanced_param_groups  # noqa: E402
from spectral_callbacks.offline.events import read_runs  # noqa: E402

ARMS: dict[str, LRBalance | None] = {
    "off": None,
    "matrix": LRBalance(),
    "layer": LRBalance(per="layer"),
}
# The monitor's settings in every arm (the balancer reads the ESD α of every second snapshot).
MONITOR: dict[str, Any] = dict(
    metrics=("stable_rank", "esd_alpha"),
    every_n_steps=10,
    log_spaced_until=0,
    esd_every_n_snapshots=2,
    figures=False,
    k=16,
)


def schedule(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """``examples/train_gpt.py``'s multiplier: linear warmup, then cosine down to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Windows:
    """Seeded random windows of a byte tensor (nanoGPT's ``get_batch``)."""

    def __init__(self, data: torch.Tensor, block: int, batch: int, seed: int) -> None:
        self.data, self.block, self.batch = data, block, batch
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        high = self.data.numel() - self.block - 1
        starts = torch.randint(high, (self.batch,), generator=self.generator)
        rows = torch.stack([self.data[s : s + self.block + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = [float(model(x, y)[1]) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def train(
    model: torch.nn.Module,
    train_data: torch.Tensor,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    lr: float,
    steps: int,
    seed: int,
    balance: LRBalance | None,
    logdir: Path,
    eval_every: int,
    block: int,
    batch: int,
) -> dict[str, Any]:
    """One run: AdamW on balanced groups (the same groups in every arm), the reference schedule."""
    groups = balanced_param_groups(model, weight_decay=0.1)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: schedule(step, steps, warmup)
    )
    windows = Windows(train_data, block, batch, seed)
    tracker = SpectralTracker(
        model,
        logdir=logdir,
        lr_balance=balance,
        optimizer=optimizer if balance is not None else None,
        **MONITOR,
    )
    curve: list[tuple[int, float]] = [(0, evaluate(model, val_batches))]
    seconds = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        x, y = windows.next()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        tracker.step(step)
        seconds += time.perf_counter() - start
        if step % eval_every == 0 or step == steps:
            curve.append((step, evaluate(model, val_batches)))
    start = time.perf_counter()
    tracker.close()
    seconds += time.perf_counter() - start
    losses = [loss for _, loss in curve]
    return {
        "final_val": losses[-1],
        "best_val": min(losses),
        "train_seconds": seconds,
        "curve": curve,
    }


def lifecycle(args: argparse.Namespace, text: torch.Tensor, arm: str, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=8, n_embd=args.width, n_head=4, block_size=args.block)
    model = GPT(config)
    split = int(0.9 * text.numel())
    val = Windows(text[split:], args.block, args.batch, seed=10_000)
    val_batches = [val.next() for _ in range(args.eval_batches)]
    return train(
        model,
        text[:split],
        val_batches,
        lr=args.lr,
        steps=args.steps,
        seed=seed,
        balance=ARMS[arm],
        logdir=args.out / "lifecycle" / f"{arm}-seed{seed}",
        eval_every=args.eval_every,
        block=args.block,
        batch=args.batch,
    )


def pretrained_base(args: argparse.Namespace, text: torch.Tensor) -> dict[str, torch.Tensor]:
    """The base of the LoRA runs: the lifecycle GPT trained on the first text, once (seed 0)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_embd=args.width, n_head=4, block_size=args.block))
    optimizer = torch.optim.AdamW(
        balanced_param_groups(model, weight_decay=0.1), lr=args.lr, betas=(0.9, 0.95)
    )
    windows = Windows(text, args.block, args.batch, seed=0)
    for step in range(args.base_steps):
        for group in optimizer.param_groups:
            group["lr"] = args.lr * schedule(step, args.base_steps, max(1, args.base_steps // 10))
        x, y = windows.next()
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def lora(
    args: argparse.Namespace, base: dict[str, torch.Tensor], text: torch.Tensor, arm: str, seed: int
) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=8, n_embd=args.width, n_head=4, block_size=args.block))
    model.load_state_dict(base)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], lora_dropout=0.0
    )
    model = get_peft_model(model, config)
    split = int(0.9 * text.numel())
    val = Windows(text[split:], args.block, args.batch, seed=10_000)
    val_batches = [val.next() for _ in range(args.eval_batches)]
    return train(
        model,
        text[:split],
        val_batches,
        lr=args.lora_lr,
        steps=args.lora_steps,
        seed=seed,
        balance=ARMS[arm],
        logdir=args.out / "lora" / f"{arm}-seed{seed}",
        eval_every=args.eval_every,
        block=args.block,
        batch=args.batch,
    )


def hook_cost(args: argparse.Namespace, repeats: int = 2000) -> tuple[int, float, float]:
    """Microseconds per ``optimizer.step()`` of the lifecycle GPT's balanced groups with no
    gradients (the step itself does nothing): without the balancer's hooks and with them."""
    from spectral_callbacks.monitor.balancer import LRBalancer
    from spectral_callbacks.targets import find_targets

    model = GPT(GPTConfig(n_layer=8, n_embd=args.width, n_head=4, block_size=args.block))
    optimizer = torch.optim.AdamW(balanced_param_groups(model, weight_decay=0.1), lr=1e-3)
    balancer = LRBalancer(LRBalance(), model, list(find_targets(model)), "benchmark")
    balancer.factors = [0.7 + 0.6 * i / len(balancer.factors) for i in range(len(balancer.factors))]
    times = []
    for hooked in (False, True):
        if hooked:
            balancer.attach(optimizer)
        start = time.perf_counter()
        for _ in range(repeats):
            optimizer.step()
        times.append(1e6 * (time.perf_counter() - start) / repeats)
    balancer.detach()
    return len(optimizer.param_groups), times[0], times[1]


def spread(values: list[float]) -> str:
    """``mean ± sample standard deviation``."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4f} ± {sd:.4f}"


def summarize(runs: pd.DataFrame, factors: pd.DataFrame) -> str:
    lines = []
    for experiment, rows in runs.groupby("experiment", sort=False):
        off_seconds = rows[rows["arm"] == "off"].set_index("seed")["train_seconds"]
        lines += [
            f"### {experiment}",
            "",
            "| arm | final val loss | best val loss | train s / run | time vs off (same seed) |",
            "|---|---|---|---|---|",
        ]
        for arm, of_arm in rows.groupby("arm", sort=False):
            ratio = of_arm.set_index("seed")["train_seconds"] / off_seconds
            lines.append(
                f"| {arm} | {spread(list(of_arm['final_val']))} | {spread(list(of_arm['best_val']))}"
                f" | {statistics.fmean(of_arm['train_seconds']):.1f} | {spread(list(ratio))} |"
            )
        lines.append("")
        of_experiment = factors[factors["experiment"] == experiment]
        if not of_experiment.empty:
            lines += [
                "Factors (seed 0) by role, mean over layers [min, max], at each ESD snapshot:",
                "",
            ]
            for arm, of_arm in of_experiment[of_experiment["seed"] == 0].groupby("arm", sort=False):
                table = of_arm.groupby(["step", "role"])["value"].agg(["mean", "min", "max"])
                steps = sorted(of_arm["step"].unique())
                shown = [steps[0], steps[len(steps) // 2], steps[-1]]
                lines.append(f"{arm}:")
                lines.append("")
                roles = list(dict.fromkeys(of_arm["role"]))
                lines.append("| step | " + " | ".join(roles) + " |")
                lines.append("|---|" + "---|" * len(roles))
                for step in shown:
                    cells = [
                        f"{table.loc[(step, role), 'mean']:.2f} "
                        f"[{table.loc[(step, role), 'min']:.2f}, {table.loc[(step, role), 'max']:.2f}]"
                        for role in roles
                    ]
                    lines.append(f"| {step} | " + " | ".join(cells) + " |")
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="the runs, CSVs and summary (--smoke: a temporary one)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--experiments", nargs="+", default=["lifecycle", "lora"])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--lora-arms", nargs="+", default=["off", "matrix"], choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=250, help="lifecycle optimizer steps")
    parser.add_argument("--lora-steps", type=int, default=150)
    parser.add_argument("--base-steps", type=int, default=200, help="the LoRA base's training")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora-lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = smoke.parse_args(
        parser, argv, seeds=[0], steps=4, lora_steps=3, base_steps=3, width=32, block=16,
        batch=2, eval_every=2, eval_batches=1,
    )  # fmt: skip
    if args.out is None:
        if not args.smoke:
            parser.error("--out is required (the folder the runs and tables go to), or --smoke")
        args.out = Path(tempfile.mkdtemp(prefix="lr-balance-smoke-"))
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    # The standard library's sources in path order: the lifecycle and the LoRA base read the first
    # 2 MB, the fine-tune 2 MB from 12 MB on (other modules, the shift a fine-tune adapts to).
    everything = load_bytes(max_bytes=14_000_000)
    first, second = everything[:2_000_000], everything[12_000_000:14_000_000]
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    base = None
    for experiment in args.experiments:
        arms = args.arms if experiment == "lifecycle" else args.lora_arms
        if experiment == "lora":
            base = pretrained_base(args, first)
        for seed in args.seeds:
            for arm in arms:
                if experiment == "lifecycle":
                    result = lifecycle(args, first, arm, seed)
                else:
                    assert base is not None
                    result = lora(args, base, second, arm, seed)
                curve = result.pop("curve")
                records.append({"experiment": experiment, "arm": arm, "seed": seed, **result,
                                "curve": " ".join(f"{s}:{v:.4f}" for s, v in curve)})  # fmt: skip
                print(
                    f"[{time.perf_counter() - started:6.0f} s] {experiment} {arm} seed {seed}: "
                    f"final {result['final_val']:.4f} best {result['best_val']:.4f} "
                    f"({result['train_seconds']:.1f} s)",
                    flush=True,
                )
                pd.DataFrame(records).to_csv(args.out / "runs.csv", index=False)
    runs = pd.DataFrame(records)
    factor_rows = []
    for experiment in args.experiments:
        rows = read_runs([str(args.out / experiment)]).rows
        rows = rows[rows["metric"] == "lr_factor"]
        parts = rows["run"].str.extract(r"(?P<arm>[a-z]+)-seed(?P<seed>\d+)")
        factor_rows.append(
            rows.assign(experiment=experiment, arm=parts["arm"], seed=parts["seed"].astype(int))
        )
    factors = pd.concat(factor_rows, ignore_index=True)
    factors[["experiment", "arm", "seed", "step", "layer", "role", "value"]].to_csv(
        args.out / "factors.csv", index=False
    )
    groups, plain_us, hooked_us = hook_cost(args)
    summary = summarize(runs, factors) + (
        f"\nOptimizer step with no gradients, {groups} groups: "
        f"{plain_us:.1f} µs without the balancer's hooks, {hooked_us:.1f} µs with them "
        f"(+{hooked_us - plain_us:.1f} µs per step).\n"
    )
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
