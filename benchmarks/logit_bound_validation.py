"""Does the logged QK bound follow the real attention logits, and does ``logit_growth`` warn?

The reference GPT (examples/gpt.py, MHA, no QK-norm) is trained three times on the standard
library's bytes with the demo's optimizer and schedule: at the demo's learning rate (healthy), the
same run with the learning rate multiplied 30x for 10 steps at step 200 (as
benchmarks/alert_thresholds.py spikes its runs), and at a high peak learning rate throughout. Both run ``SpectralTracker(circuits=True)`` (snapshots every ``--every`` steps) with
the default ``AlertRules``. At every step a forward hook on each attention module records the
true max |logit| of each head on one fixed batch (its input, through the module's own ``qkv`` and
RoPE, scaled as its SDPA scales, causal positions only), beside the logged bound
``qk_spectral_norm`` (per unit input norms).

Printed:

* the Spearman correlation of the logged bound with the measured max |logit|, over heads x
  scheduled steps, per run (and pooled);
* the step the loss spikes (the first step after ``--warmup`` whose loss exceeds
  ``--spike-factor`` times the lowest loss so far) and the first ``logit_growth`` alert;
* the alerts of each kind on each run (the healthy run should raise none).

Run: ``python benchmarks/logit_bound_validation.py`` (a few minutes on a shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import smoke  # noqa: E402
from attention import apply_rope  # noqa: E402
from data import load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks.monitor.alerts import ALERT_KINDS, AlertRules  # noqa: E402
from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.names import parse_tag  # noqa: E402


class Recorder:
    """A writer keeping every logged scalar by step."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def max_logits(model: GPT, batch: torch.Tensor) -> dict[tuple[int, int], float]:
    """(layer, head) -> the max |q_i . k_j| * scale over causal (i, j) of ``batch``, read from each
    attention module's input by a forward hook."""
    found: dict[tuple[int, int], float] = {}
    handles = []
    for layer, block in enumerate(model.transformer.h):
        attn = block.attn

        def hook(module, inputs, output, layer=layer):  # noqa: ANN001, ARG001
            q, k, _ = module.qkv(inputs[0])  # (B, T, h, d)
            q, k = apply_rope(q, module.rope_dim), apply_rope(k, module.rope_dim)
            logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(q.size(-1))
            T = logits.size(-1)
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            peak = logits.abs().masked_fill(~causal, 0).amax(dim=(0, 2, 3))  # (h,)
            for head, value in enumerate(peak.tolist()):
                found[(layer, head)] = value

        handles.append(attn.register_forward_hook(hook))
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    return found


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(t), dtype=torch.float64)
        for value in t.unique():  # ties: their mean rank
            tied = t == value
            r[tied] = r[tied].mean()
        return r

    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def train(
    lr: float, args: argparse.Namespace, text: torch.Tensor, burst: bool = False
) -> dict[str, object]:
    """One run with the demo's optimizer and schedule (AdamW, betas (0.9, 0.95), weight decay 0.1
    on matrices, linear warmup over steps / 30, cosine decay to 0.1 lr); ``burst``: the learning
    rate times ``--burst-factor`` for ``--burst-steps`` steps from ``--burst-step``."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        n_layer=args.layers, n_head=args.heads, n_embd=args.width, block_size=args.block
    )
    model = GPT(config)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, args.steps // 30)

    def lr_at(step: int) -> float:  # benchmarks/alert_thresholds.py's (the demo's) schedule
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
            factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if burst and args.burst_step <= step < args.burst_step + args.burst_steps:
            factor *= args.burst_factor
        return lr * factor

    generator = torch.Generator().manual_seed(args.seed)
    fixed = torch.stack([text[i : i + args.block] for i in range(0, 4 * args.block, args.block)])
    writer = Recorder()
    tracker = SpectralTracker(
        model,
        writers=[writer],
        circuits=True,
        synchronous=True,
        figures=False,
        every_n_steps=args.every,
        log_spaced_until=0,
        alerts=AlertRules(),
        start_step=0,
    )
    measured = {0: max_logits(model, fixed.long())}
    losses = []
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step - 1)
        starts = torch.randint(0, len(text) - args.block - 1, (args.batch,), generator=generator)
        chunk = torch.stack([text[s : s + args.block + 1] for s in starts.tolist()]).long()
        _, loss = model(chunk[:, :-1], chunk[:, 1:])
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        measured[step] = max_logits(model, fixed.long())
        tracker.step(step)
    tracker.close()
    bounds, logits = [], []
    first_alert = None
    for step, scalars in sorted(writer.logged.items()):
        for tag, value in scalars.items():
            parsed = parse_tag(tag)
            if (
                parsed is not None
                and parsed.head is not None
                and parsed.metric == "qk_spectral_norm"
            ):
                bounds.append(value)
                logits.append(measured[step][(parsed.layer, parsed.head)])
        if first_alert is None and scalars.get("spectral_alerts/logit_growth", 0) > 0:
            first_alert = step
    last = writer.logged[max(writer.logged)]
    alerts = {kind: int(last.get(f"spectral_alerts/{kind}", 0)) for kind in ALERT_KINDS}
    spike = None
    for i, loss in enumerate(losses):
        step = i + 1
        if step > args.warmup and loss > args.spike_factor * min(losses[:i]):
            spike = step
            break
    growth = max_growth(writer, args)
    return {
        "bounds": bounds,
        "logits": logits,
        "spike": spike,
        "first_alert": first_alert,
        "alerts": alerts,
        "final_loss": losses[-1],
        "min_loss": min(losses),
        "growth": growth,
    }


def max_growth(writer: Recorder, args: argparse.Namespace) -> float:
    """The largest factor by which a layer's max-over-heads bound exceeded its lowest value in the
    previous ``window`` steps (from ``after_step`` on, as the rule reads it): the number a
    ``logit_growth`` threshold is chosen against."""
    rules = AlertRules()
    per_layer: dict[int, list[tuple[int, float]]] = {}
    for step, scalars in sorted(writer.logged.items()):
        for tag, value in scalars.items():
            parsed = parse_tag(tag)
            if (
                parsed is not None
                and parsed.metric == "qk_spectral_norm"
                and parsed.aggregate == "max"
            ):
                per_layer.setdefault(parsed.layer or 0, []).append((step, value))
    worst = 1.0
    for series in per_layer.values():
        for step, value in series:
            if step < rules.after_step:
                continue
            earlier = [
                v for s, v in series if step - rules.window <= s < step and s >= rules.after_step
            ]
            if earlier:
                worst = max(worst, value / min(earlier))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=5, help="snapshot every this many steps")
    parser.add_argument("--healthy-lr", type=float, default=1.5e-3, help="the demo's peak lr")
    parser.add_argument("--high-lr", type=float, default=3e-2, help="the high-lr run's peak lr")
    parser.add_argument("--burst-step", type=int, default=200)
    parser.add_argument("--burst-steps", type=int, default=10)
    parser.add_argument("--burst-factor", type=float, default=30.0)
    parser.add_argument("--warmup", type=int, default=50, help="steps before a spike counts")
    parser.add_argument("--spike-factor", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0)
    args = smoke.parse_args(
        parser, argv, layers=2, width=64, block=16, batch=2, steps=30, burst_step=20,
        burst_steps=3, warmup=5,
    )  # fmt: skip
    torch.set_num_threads(1)
    text = load_bytes(max_bytes=2_000_000)
    runs = (
        ("healthy", args.healthy_lr, False),
        (f"lr x{args.burst_factor:g} at {args.burst_step}", args.healthy_lr, True),
        ("high lr", args.high_lr, False),
    )
    results = {}
    for name, lr, burst in runs:
        start = time.perf_counter()
        results[name] = train(lr, args, text, burst)
        print(f"{name} (lr {lr:g}): {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(
        f"{args.layers} layers x {args.width}, {args.heads} heads, {args.steps} steps, "
        f"snapshots every {args.every}; AlertRules() defaults"
    )
    print(
        "| run | lr | Spearman(bound, max logit) | loss spike step | first logit_growth step "
        "| max growth in window | alerts | min / final loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, lr, _ in runs:
        r = results[name]
        alerts = ", ".join(f"{k} {v}" for k, v in r["alerts"].items() if v) or "none"
        print(
            f"| {name} | {lr:g} | {spearman(r['bounds'], r['logits']):.3f} | {r['spike']} | "
            f"{r['first_alert']} | {r['growth']:.2f} | {alerts} | "
            f"{r['min_loss']:.2f} / {r['final_loss']:.2f} |"
        )
    pooled_bounds = [b for r in results.values() for b in r["bounds"]]  # type: ignore[attr-defined]
    pooled_logits = [x for r in results.values() for x in r["logits"]]  # type: ignore[attr-defined]
    print(f"pooled Spearman over every run: {spearman(pooled_bounds, pooled_logits):.3f}")


if __name__ == "__main__":
    main()
