"""What the alert thresholds are chosen from: a healthy run beside the same run with a 30x lr spike.

Both runs train the demo's GPT (``examples/demo.py``'s shape and schedule: AdamW with betas
(0.9, 0.95), weight decay 0.1 on matrices, linear warmup over steps/30, cosine decay to 0.1 lr) on
the standard library's bytes, watched by a ``SpectralTracker`` with the default metrics plus the
ESD family (on every snapshot here, so its range is seen in full). The spiked run multiplies the
learning rate by ``--spike-factor`` for ``--spike-steps`` steps from ``--spike-step``.

For each run the table gives, over the snapshots from ``--after`` on, the worst case of what each
alert watches - per matrix, the largest fall of stable rank and the largest growth of σ₁ between
two snapshots at most ``--window`` steps apart, and the lowest and highest ESD α - with the loss
just before and the highest loss after the spike (or at the same steps in the healthy run), and
the alerts the tracker's default rules raised, with the first alert's step.

Run: ``.venv/bin/python benchmarks/alert_thresholds.py`` (the demo's shape, a few minutes on 2
cores); ``--quick`` for a 2-layer, 64-wide run in well under a minute.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from data import RandomWindows, load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.monitor.options import DEFAULT_METRICS  # noqa: E402


@dataclass
class Run:
    """What one training run left: the loss per step, each snapshot's metrics, the alerts."""

    losses: dict[int, float]
    snapshots: dict[int, dict[str, dict[str, float]]]  # step -> matrix -> metric -> value
    alerts: list[Any] = field(default_factory=list)
    logdir: Path | None = None


def train(
    *,
    depth: int = 8,
    width: int = 128,
    heads: int = 2,
    block_size: int = 64,
    tokens_per_step: int = 1024,
    steps: int = 300,
    lr: float = 1.5e-3,
    every_n_steps: int = 10,
    spike_step: int | None = None,
    spike_steps: int = 10,
    spike_factor: float = 30.0,
    esd: bool = True,
    logdir: Path | str | None = None,
    seed: int = 0,
    **tracker_options: Any,
) -> Run:
    """Train the demo's GPT (optionally with an lr spike); return its losses, snapshots, alerts."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=depth, n_head=heads, n_embd=width, block_size=block_size))
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 30)

    def lr_at(step: int) -> float:  # the demo's schedule (train_gpt.GPTModule.lr_factor)
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = min(1.0, (step - warmup) / max(1, steps - warmup))
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if spike_step is not None and spike_step <= step < spike_step + spike_steps:
            factor *= spike_factor
        return lr * factor

    data = RandomWindows(load_bytes(max_bytes=2_000_000), block_size=block_size, seed=seed)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=tokens_per_step // block_size))
    alerts: list[Any] = []
    metrics = (*DEFAULT_METRICS, "esd_alpha") if esd else DEFAULT_METRICS
    logdir = Path(logdir if logdir is not None else tempfile.mkdtemp(prefix="alerts-"))
    tracker = SpectralTracker(
        model,
        metrics=metrics,
        logdir=logdir,
        every_n_steps=every_n_steps,
        esd_every_n_snapshots=1,
        figures=False,
        on_alert=alerts.append,
        **tracker_options,
    )
    losses = {}
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1)
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = float(loss)
        tracker.step(step)
    tracker.close()
    return Run(losses, read_snapshots(logdir), alerts, logdir)


def read_snapshots(logdir: Path) -> dict[int, dict[str, dict[str, float]]]:
    """The logged per-matrix scalars: step -> ``L<layer>/<role>`` -> metric -> value."""
    from tensorboard.backend.event_processing import event_accumulator

    from spectral_callbacks.names import parse_tag

    reader = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.SCALARS: 0}
    )
    reader.Reload()
    snapshots: dict[int, dict[str, dict[str, float]]] = {}
    for tag in reader.Tags()["scalars"]:
        parsed = parse_tag(tag)
        if parsed is None or parsed.layer is None:
            continue
        for event in reader.Scalars(tag):
            matrix = snapshots.setdefault(event.step, {}).setdefault(
                f"L{parsed.layer}/{parsed.role}", {}
            )
            matrix[parsed.metric] = event.value
    return snapshots


def worst(run: Run, after: int, window: int) -> dict[str, float]:
    """The extremes each alert watches, over the snapshots at or after step ``after``."""
    steps = sorted(step for step in run.snapshots if step >= after)
    drop = growth = 0.0
    low, high = (math.inf, ""), (-math.inf, "")
    for i, step in enumerate(steps):
        for name, now in run.snapshots[step].items():
            alpha = now.get("esd_alpha", math.nan)
            if math.isfinite(alpha):
                low, high = (
                    min(low, (alpha, f"{name}@{step}")),
                    max(high, (alpha, f"{name}@{step}")),
                )
            for earlier in steps[:i]:
                if step - earlier > window:
                    continue
                before = run.snapshots[earlier].get(name, {})
                if before.get("stable_rank", 0) > 0:
                    drop = max(drop, 1 - now["stable_rank"] / before["stable_rank"])
                if before.get("spectral_norm", 0) > 0:
                    growth = max(growth, now["spectral_norm"] / before["spectral_norm"])
    return {
        "rank_drop": drop,
        "sigma_growth": growth,
        "esd_low": low[0],
        "esd_high": high[0],
        "esd_low_at": low[1],
        "esd_high_at": high[1],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--spike-step", type=int, default=200)
    parser.add_argument("--spike-steps", type=int, default=10)
    parser.add_argument("--spike-factor", type=float, default=30.0)
    parser.add_argument("--after", type=int, default=100, help="first step the table reads")
    parser.add_argument("--window", type=int, default=50, help="steps between compared snapshots")
    parser.add_argument("--quick", action="store_true", help="2 layers, width 64, 150 steps")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape: dict[str, Any] = {"steps": args.steps}
    if args.quick:
        shape = {"depth": 2, "width": 64, "steps": 150}
        args.spike_step, args.after = 100, 50
    runs = {
        "healthy": train(**shape),
        "spiked": train(
            **shape,
            spike_step=args.spike_step,
            spike_steps=args.spike_steps,
            spike_factor=args.spike_factor,
        ),
    }
    print(
        f"spike: lr x{args.spike_factor:g} for steps {args.spike_step}.."
        f"{args.spike_step + args.spike_steps - 1}; extremes from step {args.after}, "
        f"window {args.window} steps"
    )
    print(
        f"{'run':8} {'loss before':>11} {'max loss after':>14} {'max sr drop':>11} "
        f"{'max σ1 growth':>13} {'min ESD α':>9} {'max ESD α':>9} {'alerts':>6}  first alert"
    )
    for name, run in runs.items():
        stats = worst(run, args.after, args.window)
        before = run.losses[args.spike_step - 1]
        after = max(run.losses[s] for s in run.losses if s >= args.spike_step)
        first = min(run.alerts, key=lambda a: a.step, default=None)
        first_text = f"step {first.step}: {first.kind} {first.matrix}" if first else "-"
        print(
            f"{name:8} {before:>11.3f} {after:>14.3f} {stats['rank_drop']:>11.2f} "
            f"{stats['sigma_growth']:>13.2f} {stats['esd_low']:>9.2f} {stats['esd_high']:>9.2f} "
            f"{len(run.alerts):>6}  {first_text}"
        )
        print(f"         lowest ESD α at {stats['esd_low_at']}, highest at {stats['esd_high_at']}")
        kinds = sorted({a.kind for a in run.alerts})
        for kind in kinds:
            steps = sorted({a.step for a in run.alerts if a.kind == kind})
            print(
                f"         {kind}: {sum(a.kind == kind for a in run.alerts)} at steps {steps[:8]}"
            )


if __name__ == "__main__":
    main()
