"""Train attention variants on the same bytes and chart each one's loss minus MHA's against tokens.

Every variant trains with the same seed, the same data order and the same tokens per step, each
into ``<logdir>/<variant>``, with ``SpectralMonitor`` watching its (variant-specific) matrices, and
the loss logged at every step. Then ``spectral-callbacks plot --kind metric-diff`` draws
``train/loss`` of each run minus the MHA run against ``train/tokens``, as in the attention-variant
studies of arXiv:2604.22778. Because the data order is shared, most of the batch-to-batch noise
cancels in the difference.

With two ``--inits`` (e.g. ``gpt zero_out``) every variant trains once per initialization, into
``<logdir>/<variant>/<init>``, from the same seed and data order, and the chart is the paired
difference per variant, second init minus first (``--pair '{variant}/zero_out' '{variant}/gpt'``):
the initialization ablation.

    python examples/attention_variants.py --logdir runs/variants --steps 300
    python examples/attention_variants.py --inits gpt zero_out --logdir runs/ablation --steps 300
    python examples/attention_variants.py --variants mha gqa mla gla2 --depth 8 --width 768 --steps 5000 --accelerator gpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import train_gpt
from attention import ATTENTION_CLASSES
from gpt import INITS
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
        "--inits",
        nargs="+",
        default=["gpt"],
        choices=INITS,
        metavar="INIT",
        help=f"one init ({', '.join(INITS)}): each variant minus mha; two: per variant, the second "
        "init minus the first (default: gpt)",
    )
    parser.add_argument(
        "--logdir", type=Path, default=Path("runs/variants"), help="one run per variant below it"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="chart file (default <logdir>/loss_vs_mha.png, with two inits <logdir>/init_ablation.png)",
    )
    parser.add_argument(
        "--smoothing", type=float, default=0.0, help="EMA weight in [0, 1) of the chart's curves"
    )
    parser.add_argument(
        "--no-spectral", action="store_true", help="train without SpectralMonitor (faster)"
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


def train_variants(args: argparse.Namespace) -> list[str]:
    """Train every (variant, init) of ``args`` with one seed and data order; return the run names.

    Runs are named ``<variant>`` with one init, ``<variant>/<init>`` with several.

    Raises:
        MisconfigurationException: a run directory already holds a run, or an init is repeated.
    """
    if len(set(args.inits)) != len(args.inits):
        raise MisconfigurationException(f"`--inits` must not repeat an init, got {args.inits}")
    shared = [
        *("--depth", str(args.depth), "--width", str(args.width), "--heads", str(args.heads)),
        *("--steps", str(args.steps), "--tokens-per-step", str(args.tokens_per_step)),
        *("--block-size", str(args.block_size), "--lr", str(args.lr), "--seed", str(args.seed)),
        *("--accelerator", args.accelerator, "--every-n-steps", str(args.every_n_steps)),
        # Every step: a difference of two curves sampled every N steps aliases the batch noise.
        *("--log-every-n-steps", "1"),
        "--progress" if args.progress else "--no-progress",
        *(["--no-spectral"] if args.no_spectral else []),
        *(["--text", str(args.text)] if args.text else []),
        *(["--max-bytes", str(args.max_bytes)] if args.max_bytes else []),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]
    names = [
        variant if len(args.inits) == 1 else f"{variant}/{init}"
        for variant in args.variants
        for init in args.inits
    ]
    for name in names:
        run_dir = args.logdir / name
        if run_dir.exists() and any(run_dir.iterdir()):
            raise MisconfigurationException(
                f"{run_dir} already holds a run; pass a fresh `--logdir` so runs are not mixed"
            )
    for name in names:
        variant, _, init = name.partition("/")
        print(f"[attention_variants] training {name}", flush=True)
        train_gpt.main(
            [
                *shared,
                *("--attention", variant, "--init", init or args.inits[0]),
                *("--logdir", str(args.logdir), "--name", name, "--version", ""),
            ]
        )
    return names


def plot_command(args: argparse.Namespace, output: Path) -> list[str]:
    """The ``spectral-callbacks plot`` arguments of the chart: vs MHA, or the init pairs."""
    plot = ["plot", str(args.logdir), "--kind", "metric-diff", "--metric", "train/loss"]
    if len(args.inits) == 1:
        plot += ["--baseline", BASELINE]
    else:
        first, second = args.inits[:2]
        plot += ["--pair", f"{{variant}}/{second}", f"{{variant}}/{first}"]
    return plot + ["--x", "train/tokens", "--smoothing", str(args.smoothing), "-o", str(output)]


def main(argv: list[str] | None = None) -> Path:
    """Train every requested variant, draw the metric-diff chart, print a table; return the chart."""
    args = build_parser().parse_args(argv)
    if len(args.inits) == 1 and BASELINE not in args.variants:
        raise MisconfigurationException(
            f"`--variants` must include the baseline {BASELINE!r}, got {args.variants}"
        )
    if len(args.inits) > 2:
        raise MisconfigurationException(
            f"`--inits` takes one init or a pair to compare, got {len(args.inits)}"
        )
    default = "loss_vs_mha.png" if len(args.inits) == 1 else "init_ablation.png"
    output = args.output or args.logdir / default
    names = train_variants(args)
    plot = plot_command(args, output)
    if cli(plot) != 0:
        raise RuntimeError(f"`spectral-callbacks {' '.join(plot)}` failed; its message is above")
    if len(args.inits) == 1:
        print(final_losses(args.logdir, names).to_string(float_format=lambda v: f"{v:+.4f}"))
    print(f"chart: {output}\ntensorboard --logdir {args.logdir}")
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
