"""Does ``logit_growth`` warn before a run whose attention logits grow by themselves diverges?

The small-scale proxy of attention-logit growth (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities", section 3.1): a small pre-LN transformer without
QK-norm, trained at a high constant learning rate, grows its attention logits until the attention
is one-hot (attention entropy collapse) and its loss suffers; the same model with QK-norm
(LayerNorm on each head's queries and keys, Dehghani et al. 2023) does not. Nothing is injected:
the example GPT (examples/gpt.py, MHA, pre-LN, no biases) is trained on the standard library's
bytes (examples/data.py) with AdamW at a constant learning rate (no warmup unless ``--warmup``),
no weight decay, no z-loss, and the same run is repeated with QK-norm, for each learning rate,
shape and seed asked.

Each run has ``SpectralTracker(circuits=True)`` on with the default ``AlertRules()`` (a snapshot
every ``--every`` steps). At each snapshot step a forward hook on every attention module measures,
on one fixed batch, each head's max |logit| over causal pairs (through the module's own ``qkv``,
QK-norm included, times the module's ``scaling``, the scale its SDPA call applies) and the same
divided by ‖xᵢ‖‖xⱼ‖ (x the attention's input): the benchmark adds these forwards, the tracker never
does. Beside them: the logged weight-only values, ``qk_spectral_norm`` and the bound the layer has
(``qk_logit_bound`` without QK-norm, ``qk_norm_logit_bound`` with it).

Printed, per run: the measured max |logit| and the logged values at step ``after_step`` and at
the end, and the largest measured max |logit| / (‖xᵢ‖‖xⱼ‖) over ``qk_logit_bound``; the first
``logit_growth`` alert; the rule replayed by :class:`AlertWatch` on the measured max |logit| in
place of the logged value, and on the logged values armed from step 0; the step the loss diverges
(the first step after ``--settle`` whose loss is not finite or exceeds ``--diverge-factor`` times
the lowest loss before it) and the step it falls behind the QK-norm run (its mean over the last 20
steps ``--gap`` nats above that run's), each with its lead time after the first alert; the lowest
and the final loss (mean of the last 20 steps). Then the trace of the first pair of runs.

Run: ``python benchmarks/logit_growth_lead_time.py`` (six runs of 300 steps; the table and its
reading are in docs/callback.md, Attention heads).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import smoke  # noqa: E402
from attention import MultiHeadAttention  # noqa: E402
from data import load_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

from spectral_callbacks.monitor.alerts import Alert, AlertRules, AlertWatch  # noqa: E402
from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.names import MatrixLabel, parse_tag  # noqa: E402


class QKNormAttention(MultiHeadAttention):
    """The example MHA with QK-norm: a LayerNorm over each head's query and key channels (no
    shift), applied before the dot product, as Wortsman et al. and Dehghani et al. do."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.q_norm = nn.LayerNorm(config.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(config.head_dim, bias=False)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv(x)  # (B, T, h, d)
        return self.q_norm(q), self.k_norm(k), v


class Recorder:
    """A writer keeping every logged scalar by step."""

    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def measured_logits(model: GPT, batch: Tensor) -> dict[tuple[int, int], tuple[float, float]]:
    """(layer, head) -> (max |logit|, max |logit| / (‖xᵢ‖‖xⱼ‖)) over the causal pairs of
    ``batch``, the logits recomputed from each attention module's input by a forward hook."""
    found: dict[tuple[int, int], tuple[float, float]] = {}
    handles = []
    for layer, block in enumerate(model.transformer.h):

        def hook(module, inputs, output, layer=layer):  # noqa: ANN001, ARG001
            x = inputs[0]  # (B, T, d)
            q, k, _ = module.qkv(x)  # (B, T, h, d_h); mha has no rotary channels
            logits = torch.einsum("bihd,bjhd->bhij", q, k).abs() * module.scaling  # (B, h, T, T)
            norms = x.norm(dim=-1)  # (B, T)
            per_unit = logits / (norms[:, None, :, None] * norms[:, None, None, :])
            T = logits.size(-1)
            future = ~torch.ones(T, T, dtype=torch.bool).tril()
            peak = logits.masked_fill(future, 0).amax(dim=(0, 2, 3))  # (h,)
            peak_unit = per_unit.masked_fill(future, 0).amax(dim=(0, 2, 3))
            for head, pair in enumerate(zip(peak.tolist(), peak_unit.tolist(), strict=True)):
                found[(layer, head)] = pair

        handles.append(block.attn.register_forward_hook(hook))
    with torch.no_grad():
        model(batch)
    for handle in handles:
        handle.remove()
    return found


@dataclass
class Run:
    """What one training run measured and logged."""

    losses: list[float] = field(default_factory=list)
    #: step -> (layer, head) -> (max |logit|, per unit input norms)
    measured: dict[int, dict[tuple[int, int], tuple[float, float]]] = field(default_factory=dict)
    #: step -> metric -> (layer, head) -> value, for the per-head QK values
    logged: dict[int, dict[str, dict[tuple[int, int], float]]] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    seconds: float = 0.0


QK_METRICS = ("qk_spectral_norm", "qk_logit_bound", "qk_norm_logit_bound")


def train(lr: float, shape: tuple[int, int, int], seed: int, qk_norm: bool,
          args: argparse.Namespace, text: Tensor) -> Run:  # fmt: skip
    """One run at the constant ``lr`` (after a linear warmup over ``--warmup`` steps, none by
    default): AdamW, betas (0.9, 0.95), no weight decay."""
    layers, width, heads = shape
    torch.manual_seed(seed)
    config = GPTConfig(n_layer=layers, n_head=heads, n_embd=width, block_size=args.block)
    model = GPT(config)
    if qk_norm:
        for block in model.transformer.h:
            block.attn = QKNormAttention(config)
        model.reset_parameters()  # the same initialization scheme, residual scaling included
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    fixed = torch.stack([text[i : i + args.block] for i in range(0, 4 * args.block, args.block)])
    writer, run = Recorder(), Run()
    start = time.perf_counter()
    tracker = SpectralTracker(
        model,
        writers=[writer],
        circuits=True,
        synchronous=True,
        figures=False,
        every_n_steps=args.every,
        log_spaced_until=0,
        alerts=AlertRules(),
        on_alert=run.alerts.append,
        start_step=0,
    )
    run.measured[0] = measured_logits(model, fixed.long())
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, step / args.warmup) if args.warmup else lr
        starts = torch.randint(0, len(text) - args.block - 1, (args.batch,), generator=generator)
        chunk = torch.stack([text[s : s + args.block + 1] for s in starts.tolist()]).long()
        _, loss = model(chunk[:, :-1], chunk[:, 1:])
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        run.losses.append(loss.item())
        if step % args.every == 0:
            run.measured[step] = measured_logits(model, fixed.long())
        tracker.step(step)
    tracker.close()
    run.seconds = time.perf_counter() - start
    for step, scalars in writer.logged.items():
        for tag, value in scalars.items():
            parsed = parse_tag(tag)
            if parsed is not None and parsed.head is not None and parsed.metric in QK_METRICS:
                per_head = run.logged.setdefault(step, {}).setdefault(parsed.metric, {})
                per_head[(parsed.layer or 0, parsed.head)] = value
    return run


def layer_max(values: dict[tuple[int, int], float]) -> dict[int, float]:
    """layer -> max over its heads."""
    out: dict[int, float] = {}
    for (layer, _), value in values.items():
        out[layer] = max(value, out.get(layer, -math.inf))
    return out


def replay(
    series: dict[int, dict[tuple[int, int], dict[str, float]]], rules: AlertRules
) -> int | None:
    """The first step at which :class:`AlertWatch` with ``rules`` raises ``logit_growth`` on each
    snapshot's per-head rows ``series[step][(layer, head)]`` (metric -> value): the rule itself,
    replayed on other numbers (the measured max |logit| read as ``qk_spectral_norm``) or with
    other rules."""
    heads = {key for values in series.values() for key in values}
    labels = {
        key: MatrixLabel(f"L{key[0]}H{key[1]}", key[0], "heads", head=key[1],
                         attention_layer=f"L{key[0]}")
        for key in heads
    }  # fmt: skip
    watch = AlertWatch(list(labels.values()), rules)
    for step in sorted(series):
        rows = {labels[key].name: row for key, row in series[step].items()}
        if any(alert.kind == "logit_growth" for alert in watch.check(step, rows)):
            return step
    return None


def divergence_step(losses: list[float], settle: int, factor: float) -> int | None:
    """The first step after ``settle`` whose loss is not finite or exceeds ``factor`` times the
    lowest loss of the steps before it (``losses[i]`` is step ``i + 1``'s)."""
    for i in range(settle, len(losses)):
        if not math.isfinite(losses[i]) or losses[i] > factor * min(losses[:i]):
            return i + 1
    return None


def behind_step(losses: list[float], twin: list[float], settle: int, gap: float) -> int | None:
    """The first step after ``settle`` at which the mean loss of the last 20 steps exceeds the
    same mean of ``twin`` (the QK-norm run, same data order) by more than ``gap`` nats."""
    for step in range(max(settle, 20), len(losses) + 1):
        mine, theirs = losses[step - 20 : step], twin[step - 20 : step]
        if not math.isfinite(sum(mine)) or sum(mine) / 20 - sum(theirs) / 20 > gap:
            return step
    return None


def peak(values: dict[tuple[int, int], float] | None) -> float:
    return max(values.values()) if values else math.nan


def summary_row(name: str, lr: float, shape: tuple[int, int, int], seed: int, run: Run,
                twin: Run | None, args: argparse.Namespace) -> str:  # fmt: skip
    """One run's row; ``twin``: the same run with QK-norm (``None`` for that run itself)."""
    rules = AlertRules()
    last = max(run.measured)
    early = min((s for s in run.measured if s >= rules.after_step), default=last)
    bound = "qk_norm_logit_bound" if name == "QK-norm" else "qk_logit_bound"
    cells = []
    for step in (early, last):
        logged = run.logged.get(step, {})
        measured = {key: v[0] for key, v in run.measured[step].items()}
        cells.append(
            f"{peak(measured):.3g} / {peak(logged.get('qk_spectral_norm')):.3g} / "
            f"{peak(logged.get(bound)):.3g}"
        )
    unit_ratio = max(
        v[1] / run.logged[s]["qk_logit_bound"][key]
        for s, per_head in run.measured.items()
        for key, v in per_head.items()
        if "qk_logit_bound" in run.logged.get(s, {})
    ) if name != "QK-norm" else math.nan  # fmt: skip
    measured_rows = {
        step: {key: {"qk_spectral_norm": v[0]} for key, v in per_head.items()}
        for step, per_head in run.measured.items()
    }
    logged_rows: dict[int, dict[tuple[int, int], dict[str, float]]] = {}
    for step, by_metric in run.logged.items():
        for metric, per_head in by_metric.items():
            for key, value in per_head.items():
                logged_rows.setdefault(step, {}).setdefault(key, {})[metric] = value
    first = min((a.step for a in run.alerts if a.kind == "logit_growth"), default=None)
    kinds: dict[str, int] = {}
    for alert in run.alerts:
        kinds[alert.kind] = kinds.get(alert.kind, 0) + 1
    diverged = divergence_step(run.losses, args.settle, args.diverge_factor)
    lead = diverged - first if diverged is not None and first is not None else None
    behind = None if twin is None else behind_step(run.losses, twin.losses, args.settle, args.gap)
    behind_lead = behind - first if behind is not None and first is not None else None
    final = sum(run.losses[-20:]) / len(run.losses[-20:])
    alerts = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"
    layers, width, heads = shape
    return (
        f"| {layers} x {width}, {heads} heads | {lr:g} | {seed} | {name} | {early}: {cells[0]} | "
        f"{last}: {cells[1]} | {unit_ratio:.2f} | {first} | {replay(measured_rows, rules)} | "
        f"{replay(logged_rows, dataclasses.replace(rules, after_step=0))} | "
        f"{diverged} | {lead} | {'-' if twin is None else behind} | "
        f"{'-' if twin is None else behind_lead} | {alerts} | {min(run.losses):.2f} / {final:.2f} | "
        f"{run.seconds:.0f} |"
    )


def trace(name: str, run: Run, every: int) -> None:
    """The run over training: loss, each head's measured max |logit| and logged values."""
    bound = "qk_norm_logit_bound" if name == "QK-norm" else "qk_logit_bound"
    heads = sorted(run.measured[0])
    labels = " | ".join(f"L{layer}H{head}" for layer, head in heads)
    print(f"\n{name}: per head, measured max |logit| / logged qk_spectral_norm / logged {bound}")
    print(f"| step | loss (mean of the last {every}) | {labels} | logit_growth alerts |")
    print("|---|---|" + "---|" * len(heads) + "---|")
    alerts = {a.step: a for a in run.alerts if a.kind == "logit_growth"}
    for step in sorted(run.measured):
        if step % every and step not in alerts and step != max(run.measured):
            continue
        window = run.losses[max(0, step - every) : step] or [math.nan]
        logged = run.logged.get(step, {})
        cells = " | ".join(
            f"{run.measured[step][key][0]:.3g} / {logged.get('qk_spectral_norm', {}).get(key, math.nan):.3g}"
            f" / {logged.get(bound, {}).get(key, math.nan):.3g}"
            for key in heads
        )
        said = alerts[step].describe().split(": ", 1)[1] if step in alerts else ""
        print(f"| {step} | {sum(window) / len(window):.2f} | {cells} | {said} |")


def parse_list(kind: type, text: str) -> list:
    return [kind(part) for part in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lrs", default="0.1,0.03,0.003", help="constant learning rates")
    parser.add_argument(
        "--shapes", default="2x128x2", help="layers x width x heads, comma-separated"
    )
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=5, help="snapshot every this many steps")
    parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps (0: none)")
    parser.add_argument("--settle", type=int, default=50, help="steps before divergence counts")
    parser.add_argument("--diverge-factor", type=float, default=2.0)
    parser.add_argument(
        "--gap", type=float, default=0.15, help="nats behind the QK-norm run that count"
    )
    parser.add_argument("--trace-every", type=int, default=25, help="trace rows every N steps")
    args = smoke.parse_args(
        parser, argv, lrs="0.1", shapes="1x32x2", block=16, batch=2, steps=12, every=2,
        settle=2, trace_every=4,
    )  # fmt: skip
    torch.set_num_threads(1)
    text = load_bytes(max_bytes=2_000_000)
    try:
        lrs, seeds = parse_list(float, args.lrs), parse_list(int, args.seeds)
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    except ValueError as error:
        parser.error(f"--lrs, --seeds and --shapes take comma-separated numbers ({error})")
    if any(len(shape) != 3 for shape in shapes):
        parser.error(f"--shapes: each is layers x width x heads, e.g. 2x128x2; got {args.shapes!r}")
    runs = []
    for shape in shapes:
        for lr in lrs:
            for seed in seeds:
                for name, qk_norm in (("no QK-norm", False), ("QK-norm", True)):
                    run = train(lr, shape, seed, qk_norm, args, text)  # type: ignore[arg-type]
                    print(f"{shape} lr {lr:g} seed {seed} {name}: {run.seconds:.0f} s",
                          file=sys.stderr)  # fmt: skip
                    runs.append((name, lr, shape, seed, run))
    rules = AlertRules()
    print(
        f"{args.steps} steps, batch {args.batch} x {args.block} bytes, AdamW constant lr "
        f"(warmup {args.warmup} steps, no weight decay), snapshots every {args.every}; "
        "AlertRules() defaults "
        f"(logit_growth {rules.logit_growth:g}x within {rules.window} steps, from step "
        f"{rules.after_step}); divergence: loss > {args.diverge_factor:g}x its lowest so far "
        f"after step {args.settle}, or not finite; behind: mean loss of the last 20 steps "
        f"> the QK-norm run's + {args.gap:g}"
    )
    columns = [
        "shape", "lr", "seed", "run",
        "measured max \\|logit\\| / qk_spectral_norm / bound, at step",
        "the same at the end", "max measured per unit norms / qk_logit_bound",
        "first logit_growth", "the rule read on the measured max \\|logit\\|",
        "the rule from step 0", "loss diverges", "lead time", "loss behind the QK-norm run",
        "lead time", "alerts", "min / final loss", "s",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for i, (name, lr, shape, seed, run) in enumerate(runs):
        twin = runs[i + 1][4] if name == "no QK-norm" else None
        print(summary_row(name, lr, shape, seed, run, twin, args))
    for name, _, _, _, run in runs[:2]:
        trace(name, run, args.trace_every)


if __name__ == "__main__":
    main()
