"""Train attention variants on the same bytes and chart each one's loss minus MHA's against tokens.

Every variant trains with the same seed, the same data order and the same tokens per step, each
into ``<logdir>/<variant>``, with ``SpectralMonitor`` watching its (variant-specific) matrices. Then
``spectral-callbacks plot --kind metric-diff`` draws ``train/loss`` of each run minus the MHA run
against ``train/tokens``, as in the attention-variant studies of arXiv:2604.22778. Because the data
order is shared, most of the batch-to-batch noise cancels in the difference.

    python examples/attention_variants.py --logdir runs/variants --steps 300
    python examples/attention_variants.py --variants mha gqa mla gla2 --depth 8 --width 768 --steps 5000 --accelerator gpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import train_gpt
from attention import ATTENTION_CLASSES
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from spectral_callbacks.cli import main as cli
from spectral_callbacks.offline.events import read_runs

BASELINE = "mha"
# The order of the comparison: the baseline, K/V-head sharing, then the latent and factored ones.
VARIANTS = ("mha", "mqa", "gqa", "mla", "gla2", "gla4", "gta", "mfa", "tpa")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=sorted(ATTENTION_CLASSES)
    )
    parser.add_argument(
        "--logdir", type=Path, default=Path("runs/variants"), help="one run per variant below it"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="chart file (default <logdir>/loss_vs_mha.png)"
    )
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument(
        "--heads", type=int, default=4, help="a multiple of 4 so gla4 can split them"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text", type=Path, default=None, help="a text file (default: Python's stdlib)"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=None, help="use only the first bytes of the text"
    )
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--every-n-steps", type=int, default=25, help="SpectralMonitor snapshot interval"
    )
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return parser


def final_losses(logdir: Path, runs: list[str], last: int = 5) -> pd.DataFrame:
    """Mean ``train/loss`` of each run over its ``last`` logged points, and its difference to MHA."""
    rows = read_runs([logdir], all_scalars=True).rows
    loss = rows[rows["metric"] == "train/loss"].sort_values("step")
    table = pd.DataFrame(
        {"final loss": [loss.loc[loss["run"] == run, "value"].tail(last).mean() for run in runs]},
        index=runs,
    )
    if BASELINE in table.index:
        table[f"minus {BASELINE}"] = table["final loss"] - table.loc[BASELINE, "final loss"]
    return table


def main(argv: list[str] | None = None) -> Path:
    """Train every requested variant, draw the metric-diff chart, print a table; return the chart."""
    args = build_parser().parse_args(argv)
    if BASELINE not in args.variants:
        raise MisconfigurationException(
            f"`--variants` must include the baseline {BASELINE!r}, got {args.variants}"
        )
    output = args.output or args.logdir / "loss_vs_mha.png"
    shared = [
        *("--depth", str(args.depth), "--width", str(args.width), "--heads", str(args.heads)),
        *("--steps", str(args.steps), "--tokens-per-step", str(args.tokens_per_step)),
        *("--block-size", str(args.block_size), "--lr", str(args.lr), "--seed", str(args.seed)),
        *("--accelerator", args.accelerator, "--every-n-steps", str(args.every_n_steps)),
        *("--log-every-n-steps", str(max(1, min(10, args.steps // 20)))),
        "--progress" if args.progress else "--no-progress",
        *(["--text", str(args.text)] if args.text else []),
        *(["--max-bytes", str(args.max_bytes)] if args.max_bytes else []),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]
    for variant in args.variants:
        run_dir = args.logdir / variant
        if run_dir.exists() and any(run_dir.iterdir()):
            raise MisconfigurationException(
                f"{run_dir} already holds a run; pass a fresh `--logdir` so runs are not mixed"
            )
        print(f"[attention_variants] training {variant}", flush=True)
        train_gpt.main(
            [
                *shared,
                "--attention",
                variant,
                "--logdir",
                str(args.logdir),
                "--name",
                variant,
                "--version",
                "",
            ]
        )
    plot = ["plot", str(args.logdir), "--kind", "metric-diff", "--metric", "train/loss"]
    plot += ["--baseline", BASELINE, "--x", "train/tokens", "-o", str(output)]
    if cli(plot) != 0:
        raise RuntimeError(f"`spectral-callbacks {' '.join(plot)}` failed; its message is above")
    print(final_losses(args.logdir, args.variants).to_string(float_format=lambda v: f"{v:+.4f}"))
    print(f"chart: {output}\ntensorboard --logdir {args.logdir}")
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
