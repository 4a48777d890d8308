"""What the alert thresholds are chosen from: healthy runs beside the same runs with a 30x lr spike.

Training (``--shape``): the demo's GPT (``examples/demo.py``: D8 x 128, 300 steps, a snapshot
every 10) or the reference lifecycle run of ``examples/reproduce.py`` at its CPU scale (D8 x 128,
500 steps, a snapshot every 20), with their schedule (AdamW with betas (0.9, 0.95), weight decay
0.1 on matrices, linear warmup, cosine decay to 0.1 lr) on the standard library's bytes, watched
by a ``SpectralTracker`` with the default metrics plus the ESD family (on every snapshot here, so
its range is seen in full). The spiked run multiplies the learning rate by ``--spike-factor`` for
``--spike-steps`` steps from ``--spike-step``.

For each run the table gives, over the snapshots from ``--after`` on, the worst case of what each
alert watches - per matrix, the largest fall of stable rank and the largest growth of σ₁ between
two snapshots at most ``--window`` steps apart, and the lowest and highest ESD α - with the loss
just before and the highest loss after the spike (or at the same steps in the healthy run), and
the alerts the tracker's default rules raised, with the first alert's step.

Logged runs (``--runs DIR ...``, e.g. ``examples/reproduce.py``'s ``figures/runs/lifecycle/D8`` or
the demo's ``demo_output/runs/d8-demo``): the alerts the run raised while training (its
``spectral_alerts/<kind>`` counts), the default rules replayed over its logged snapshots, and what
WeightWatcher's ESD band (α < 2 or > 6) would have raised: from ``--after`` on, and on the run's
last ESD snapshot only (its trained weights, as ``analyze`` would read them).

Run: ``.venv/bin/python benchmarks/alert_thresholds.py`` (the demo's shape, a few minutes on 2
cores); ``--shape lifecycle`` for the reference run's; ``--quick`` for a 2-layer, 64-wide run in
well under a minute; ``--runs DIR ...`` to read logged runs instead of training.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import smoke  # noqa: E402
from data import RandomWindows, load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.monitor.alerts import ALERT_KINDS, Alert, AlertRules, AlertWatch  # noqa: E402
from spectral_callbacks.monitor.options import DEFAULT_METRICS  # noqa: E402

#: WeightWatcher's labels: α < 2 "over-trained", α > 6 "under-trained".
WEIGHTWATCHER_BAND = {"esd_alpha_low": 2.0, "esd_alpha_high": 6.0}

#: The trained shapes: (training options, first spiked step, first step the table reads).
SHAPES: dict[str, tuple[dict[str, Any], int, int]] = {
    # examples/demo.py: warmup over steps / 30.
    "demo": ({"steps": 300, "every_n_steps": 10}, 200, 100),
    # examples/reproduce.py lifecycle at --scale cpu: train_gpt.py's warmup, 5 % of the steps.
    "lifecycle": ({"steps": 500, "every_n_steps": 20, "warmup": 25}, 300, 100),
    "quick": ({"depth": 2, "width": 64, "steps": 150}, 100, 50),
}


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
    warmup: int | None = None,
    every_n_steps: int = 10,
    spike_step: int | None = None,
    spike_steps: int = 10,
    spike_factor: float = 30.0,
    esd: bool = True,
    logdir: Path | str | None = None,
    seed: int = 0,
    **tracker_options: Any,
) -> Run:
    """Train the demo's GPT (optionally with an lr spike); return its losses, snapshots, alerts.

    ``warmup`` steps of linear warmup (default ``steps // 30``, the demo's).
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=depth, n_head=heads, n_embd=width, block_size=block_size))
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 30) if warmup is None else warmup

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
        losses[step] = loss.item()
        tracker.step(step)
    tracker.close()
    return Run(losses, read_snapshots(logdir), alerts, logdir)


def read_logged(logdir: Path | str) -> tuple[dict[int, dict[str, dict[str, float]]], dict]:
    """A run's logged per-matrix scalars (step -> ``L<layer>/<role>``, ``<stack>/L<layer>/<role>``
    where the model has stacks -> metric -> value) and its last ``spectral_alerts/<kind>`` counts."""
    from spectral_callbacks.offline.events import read_runs

    rows = read_runs([logdir], all_scalars=True).rows
    counts = {}
    for kind in ALERT_KINDS:
        logged = rows[rows["metric"] == f"spectral_alerts/{kind}"].sort_values("step")
        if not logged.empty:
            counts[kind] = int(logged["value"].iloc[-1])
    per_matrix = rows[rows["layer"].notna() & rows["expert"].isna()]
    per_matrix = per_matrix[~per_matrix["role"].str.contains("/")]  # not an experts' aggregate
    snapshots: dict[int, dict[str, dict[str, float]]] = {}
    for row in per_matrix.itertuples(index=False):
        stack = row.stack if isinstance(row.stack, str) and row.stack else ""
        name = f"{stack + '/' if stack else ''}L{int(row.layer)}/{row.role}"
        snapshots.setdefault(int(row.step), {}).setdefault(name, {})[row.metric] = row.value
    return snapshots, counts


def read_snapshots(logdir: Path | str) -> dict[int, dict[str, dict[str, float]]]:
    """The logged per-matrix scalars: step -> ``L<layer>/<role>`` -> metric -> value."""
    return read_logged(logdir)[0]


def replay(
    snapshots: dict[int, dict[str, dict[str, float]]], rules: AlertRules | None = None
) -> list[Alert]:
    """The alerts ``rules`` (default: the tracker's) raise over logged snapshots, read in step
    order as the tracker reads each snapshot's results while training."""
    names = sorted({name for matrices in snapshots.values() for name in matrices})
    targets = []
    for name in names:
        layer, role = name.split("/")[-2:]
        targets.append(SimpleNamespace(name=name, layer=int(layer[1:]), role=role))
    watch = AlertWatch(targets, rules or AlertRules())
    return [alert for step in sorted(snapshots) for alert in watch.check(step, snapshots[step])]


def worst(run: Run, after: int, window: int) -> dict[str, Any]:
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


def band_alerts(snapshots: dict[int, dict[str, dict[str, float]]], after: int) -> dict[str, Any]:
    """What WeightWatcher's band (α < 2 or > 6) raises from step ``after`` on, and how many
    matrices lie outside it on the last snapshot that carries the ESD."""
    alerts = replay(snapshots, AlertRules(**WEIGHTWATCHER_BAND, after_step=after))
    band = [a for a in alerts if a.kind.startswith("esd_alpha")]
    with_esd = [step for step in sorted(snapshots) if any(
        math.isfinite(v.get("esd_alpha", math.nan)) for v in snapshots[step].values()
    )]  # fmt: skip
    outside, total, last = 0, 0, None
    if with_esd:
        last = with_esd[-1]
        alphas = [v["esd_alpha"] for v in snapshots[last].values() if "esd_alpha" in v]
        finite = [a for a in alphas if math.isfinite(a)]
        total, outside = len(finite), sum(not 2.0 <= a <= 6.0 for a in finite)
    return {"alerts": band, "last_esd_step": last, "outside": outside, "matrices": total}


def first_text(alerts: list[Alert]) -> str:
    first = min(alerts, key=lambda a: a.step, default=None)
    return f"step {first.step}: {first.kind} {first.matrix}" if first else "-"


def read_runs_table(logdirs: list[str], after: int) -> None:
    """The alerts of logged runs: while training, replayed at the defaults, and the ESD band."""
    from spectral_callbacks.offline.events import find_runs

    runs, problems = find_runs(logdirs)
    for problem in problems:
        print(f"skipped: {problem}")
    print(
        f"{'run':28} {'snapshots':>9} {'last':>5} {'logged':>6} {'replayed':>8}  "
        f"{'first replayed alert':24} {'ESD α from ' + str(after):>16} {'band from ' + str(after):>14}"
        f" {'outside 2-6 at last ESD':>24}"
    )
    for found in runs:
        snapshots, counts = read_logged(found.directory)
        replayed = replay(snapshots)
        stats = worst(Run({}, snapshots), after, AlertRules().window)
        band = band_alerts(snapshots, after)
        alpha = (
            f"{stats['esd_low']:.2f}-{stats['esd_high']:.2f}"
            if math.isfinite(stats["esd_low"])
            else "no ESD"
        )
        last = (
            f"{band['outside']} of {band['matrices']} (step {band['last_esd_step']})"
            if band["last_esd_step"] is not None
            else "-"
        )
        logged = str(sum(counts.values())) if counts else "none"
        print(
            f"{found.name:28} {len(snapshots):>9} {max(snapshots, default=0):>5} {logged:>6} "
            f"{len(replayed):>8}  {first_text(replayed):24} {alpha:>16} "
            f"{len(band['alerts']):>14} {last:>24}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo", help="what to train")
    parser.add_argument("--steps", type=int, default=None, help="override the shape's steps")
    parser.add_argument("--spike-step", type=int, default=None, help="default: the shape's")
    parser.add_argument("--spike-steps", type=int, default=10)
    parser.add_argument("--spike-factor", type=float, default=30.0)
    parser.add_argument("--after", type=int, default=None, help="first step the table reads")
    parser.add_argument("--window", type=int, default=50, help="steps between compared snapshots")
    parser.add_argument("--quick", action="store_true", help="--shape quick: 2 x 64, 150 steps")
    parser.add_argument("--runs", nargs="+", metavar="DIR", help="read logged runs, train nothing")
    parser.add_argument("--threads", type=int, default=1)
    args = smoke.parse_args(
        parser, argv, quick=True, steps=30, spike_step=15, spike_steps=3, after=5, window=10
    )
    torch.set_num_threads(args.threads)
    options, spike_step, after = SHAPES["quick" if args.quick else args.shape]
    after = after if args.after is None else args.after
    if args.runs:
        read_runs_table(args.runs, after)
        return
    spike_step = spike_step if args.spike_step is None else args.spike_step
    shape = {**options, **({"steps": args.steps} if args.steps else {})}
    runs = {
        "healthy": train(**shape),
        "spiked": train(
            **shape,
            spike_step=spike_step,
            spike_steps=args.spike_steps,
            spike_factor=args.spike_factor,
        ),
    }
    print(
        f"shape {'quick' if args.quick else args.shape} {shape}; spike: lr x{args.spike_factor:g}"
        f" for steps {spike_step}..{spike_step + args.spike_steps - 1} (the first spiked update "
        f"is step {spike_step + 1}); extremes from step {after}, window {args.window} steps"
    )
    print(
        f"{'run':8} {'loss before':>11} {'max loss after':>14} {'max sr drop':>11} "
        f"{'max σ1 growth':>13} {'min ESD α':>9} {'max ESD α':>9} {'alerts':>6}  first alert"
    )
    for name, run in runs.items():
        stats = worst(run, after, args.window)
        before = run.losses[spike_step]
        later = max(run.losses[s] for s in run.losses if s > spike_step)
        print(
            f"{name:8} {before:>11.3f} {later:>14.3f} {stats['rank_drop']:>11.2f} "
            f"{stats['sigma_growth']:>13.2f} {stats['esd_low']:>9.2f} {stats['esd_high']:>9.2f} "
            f"{len(run.alerts):>6}  {first_text(run.alerts)}"
        )
        print(f"         lowest ESD α at {stats['esd_low_at']}, highest at {stats['esd_high_at']}")
        for kind in sorted({a.kind for a in run.alerts}):
            steps = sorted({a.step for a in run.alerts if a.kind == kind})
            print(
                f"         {kind}: {sum(a.kind == kind for a in run.alerts)} at steps {steps[:8]}"
            )
        band = band_alerts(run.snapshots, after)
        print(
            f"         WeightWatcher's band (2, 6) from step {after}: {len(band['alerts'])} "
            f"alerts; outside it at the last step: {band['outside']} of {band['matrices']}"
        )


if __name__ == "__main__":
    main()
