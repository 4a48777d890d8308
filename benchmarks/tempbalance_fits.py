"""TempBalance's α fit (median x_min, Hill) beside WeightWatcher's (x_min scan) on one model.

The 24 watched matrices (Q, K, V, O, MLP up and down of 4 blocks) of a GPT-2 of 4 layers x 256,
fresh from its config (seed 0) and after ``--steps`` AdamW steps on the standard library's bytes:
the range of each fit's α, their Spearman rank correlation, and the largest difference of the
factors each gives in the band ``[0.7, 1.3]`` (TempBalance's linear map).

Run: ``python benchmarks/tempbalance_fits.py`` (the 200 training steps take several minutes on a loaded
2-core CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
from data import load_bytes  # noqa: E402

from spectral_callbacks.functional.balance import tempbalance_factors  # noqa: E402
from spectral_callbacks.functional.esd import esd_eigenvalues, esd_fit, esd_fit_median  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx, ry = x.argsort().argsort().double(), y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def report(name: str, model: torch.nn.Module) -> None:
    targets = find_targets(model)
    evals = [esd_eigenvalues(t.matrix().detach()) for t in targets]
    median = torch.stack([esd_fit_median(e).alpha for e in evals])
    scan = torch.stack([esd_fit(e).alpha for e in evals])
    gap = (tempbalance_factors(median) - tempbalance_factors(scan)).abs().max()
    print(
        f"| {name} | {len(targets)} | {median.min():.1f}-{median.max():.1f} | "
        f"{scan.min():.1f}-{scan.max():.1f} | {spearman(median, scan):.2f} | {gap:.2f} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=200)
    args = smoke.parse_args(parser, argv, steps=1)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=256
    )
    model = transformers.GPT2LMHeadModel(config)
    print(
        "| model | matrices | α median fit | α xmin scan | Spearman | max factor gap in [0.7, 1.3] |"
    )
    print("|---|---|---|---|---|---|")
    report("GPT-2 4 x 256, fresh", model)
    text = load_bytes(max_bytes=500_000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        starts = torch.randint(0, len(text) - 129, (8,), generator=generator).tolist()
        batch = torch.stack([text[s : s + 128] for s in starts]).long()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report(f"GPT-2 4 x 256, {args.steps} AdamW steps", model)


if __name__ == "__main__":
    main()
