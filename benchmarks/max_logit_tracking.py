"""How well the weight-only QK values track the measured max logit over training.

A small transformer without QK-norm (written-out attention, biased projections, scale 1/sqrt(d_h)
as a `* c` on the logits) trained with AdamW at a high constant learning rate on an induction task
(a random half sequence, then repeated). Each attention hands the maxima of the logits it computes
anyway (``scores.amax(-1)``, what FlexAttention's ``AuxOutput.max_scores`` holds) to
``SpectralTracker.observe_max_logits``; the tracker logs ``max_logit`` beside ``qk_logit_bound``
and ``qk_spectral_norm`` per head at each snapshot. Printed per snapshot: the loss, the largest
measured ``max_logit`` and ``qk_logit_bound`` over heads, and the spread over heads of
``max_logit / qk_logit_bound`` (the product of the inputs' norms the logit reached, per unit
bound); then the Spearman rank correlation between the two over every (head, snapshot) and over
the heads at the last snapshot.

Run: ``python benchmarks/max_logit_tracking.py`` (about a minute on a shared 2-core CPU);
``--smoke``: a few steps.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402

from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.names import parse_tag  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(width, width) for _ in range(4)
        )
        self.num_heads, self.width = heads, width
        self.scaling = (width // heads) ** -0.5
        self.tracker: SpectralTracker | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, T, self.num_heads, -1).transpose(1, 2)  # (B, H, T, d_h)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        scores = ((q @ k.transpose(-1, -2)) * self.scaling).masked_fill(~causal, -math.inf)
        if self.tracker is not None:  # the maxima of the logits computed here anyway
            self.tracker.observe_max_logits(self, scores.amax(-1))
        y = torch.softmax(scores, dim=-1) @ v  # (B, H, T, d_h)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.width))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Model(torch.nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, length: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(0.02 * torch.randn(length, width))
        self.blocks = torch.nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> torch.Tensor:
        return torch.tensor(values).argsort().argsort().double()

    ra, rb = ranks(a), ranks(b)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=64)
    args = smoke.parse_args(parser, argv, steps=6, every=2, width=32)
    torch.set_num_threads(1)
    logging.getLogger("spectral_callbacks").setLevel(logging.WARNING)
    torch.manual_seed(0)
    vocab, half, batch = 64, 16, 16
    model = Model(vocab, args.width, heads=4, layers=2, length=2 * half)
    writer = Recorder()
    with tempfile.TemporaryDirectory():
        tracker = SpectralTracker(
            model, writers=[writer], circuits=True, synchronous=True, figures=False,
            every_n_steps=args.every, metrics=["stable_rank"], exclude=["position"],
        )  # fmt: skip
        for block in model.blocks:
            block.attn.tracker = tracker
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        losses: dict[int, float] = {}
        for step in range(1, args.steps + 1):
            prefix = torch.randint(0, vocab, (batch, half))
            tokens = torch.cat([prefix, prefix], dim=1)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits[:, half - 1 :].reshape(-1, vocab), tokens[:, half:].reshape(-1)
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[step] = loss.item()
            tracker.step(step)
        tracker.close()
    per_step: dict[int, dict[str, dict[tuple[int, int], float]]] = {}
    for step, scalars in writer.logged.items():
        for tag, value in scalars.items():
            parsed = parse_tag(tag)
            if parsed is not None and parsed.head is not None:
                key = (parsed.layer or 0, parsed.head)
                per_step.setdefault(step, {}).setdefault(parsed.metric, {})[key] = value
    print(
        "| step | loss | max max_logit | max qk_logit_bound | max_logit / qk_logit_bound (heads) |"
    )
    print("|---|---|---|---|---|")
    every_measured: list[float] = []
    every_bound: list[float] = []
    last: tuple[list[float], list[float]] = ([], [])
    for step in sorted(per_step):
        measured = per_step[step].get("max_logit", {})
        bounds = per_step[step].get("qk_logit_bound", {})
        heads = sorted(set(measured) & set(bounds))
        if not heads:
            continue
        ratios = [measured[h] / bounds[h] for h in heads]
        every_measured += [measured[h] for h in heads]
        every_bound += [bounds[h] for h in heads]
        last = ([measured[h] for h in heads], [bounds[h] for h in heads])
        loss = losses.get(step, math.nan)
        print(
            f"| {step} | {loss:.3f} | {max(measured.values()):.2f} | {max(bounds.values()):.3f} "
            f"| {min(ratios):.1f}-{max(ratios):.1f} |"
        )
    if len(every_measured) > 2:
        print(
            f"\nSpearman(max_logit, qk_logit_bound): every (head, snapshot) "
            f"{spearman(every_measured, every_bound):.2f}; heads at the last snapshot "
            f"{spearman(*last):.2f}"
        )


if __name__ == "__main__":
    main()
