"""The three figures of "The Spectral Lifecycle of Transformer Training" (arXiv:2604.22778), one command each.

    python examples/reproduce.py lifecycle                 # trains a D8-like run at CPU size
    python examples/reproduce.py alpha-depth --pretrained models/gpt2 models/pythia-160m
    python examples/reproduce.py init-ablation             # 9 variants x 2 inits at CPU size
    python examples/reproduce.py lifecycle --scale reference --accelerator gpu   # the study's sizes
    python examples/reproduce.py lifecycle --runs runs/d8/version_0   # draw an existing run

Figures:

* ``lifecycle`` - (a) layer-0 stable rank by matrix type (Q, K, V, O, MLP↑, MLP↓) vs step;
  (b) final compression % by layer x type. One run (trained, or ``--runs DIR``).
* ``alpha-depth`` - α of the Q projection vs relative depth i/(L-1), y 0.1-0.6: (a) custom D8 /
  D12 / D16-like runs (trained, or ``--runs DIR ...``), (b) GPT-2 models, (c) Pythia (GPT-NeoX)
  models, both from local model directories given with ``--pretrained`` (there is no model hub
  here: without them the panel says so), analyzed with ``spectral-callbacks analyze``.
* ``init-ablation`` - per attention variant, ``train/loss`` of the ``zero_out`` init minus the
  ``gpt`` init (same variant, seed and data order) vs training tokens, nine curves (trained by
  ``attention_variants.py --inits gpt zero_out``, or ``--runs DIR`` holding ``<variant>/<init>``).

Each writes ``<out>/<figure>.png`` and ``<out>/<figure>.csv``: exactly the plotted numbers as tidy
rows ``panel, series, x, y``. Trained runs go to ``<out>/runs/<figure>``; the lifecycle and
alpha-depth runs also log the ESD family (every 10th snapshot), so ``spectral-callbacks
rank-layers <out>/runs/lifecycle/D8`` ranks their layers. ``--scale`` picks the sizes of
``SCALES``: ``cpu`` (default, minutes on 2 cores), ``reference`` (the study's width 768 and 10K
steps, for a GPU) or ``tiny`` (seconds, for tests).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import attention_variants
import pandas as pd
import train_gpt
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from matplotlib.figure import Figure

from spectral_callbacks import charts
from spectral_callbacks.cli import main as cli
from spectral_callbacks.offline import differences
from spectral_callbacks.offline.events import read_runs

FIGURES = ("lifecycle", "alpha-depth", "init-ablation")
ALPHA_RANGE = (0.1, 0.6)  # the study's y range of the α-vs-depth figure
INIT_PAIR = ("{variant}/zero_out", "{variant}/gpt")  # zero_out minus gpt, per variant
# How the study writes each variant in its legend.
VARIANT_LABELS = {
    "mha": "MHA",
    "mqa": "MQA",
    "gqa": "GQA",
    "mla": "MLA",
    "mfa": "MFA",
    "tpa": "TPA",
    "gla2": "GLA-2",
    "gla4": "GLA-4",
    "gta": "GTA",
}
# Which panel of alpha-depth a pretrained model goes to, by its config's model_type.
PRETRAINED_PANELS = {"gpt2": "GPT-2", "gpt_neox": "Pythia"}


@dataclass(frozen=True)
class Scale:
    """The sizes one figure trains at. ``depths`` has one entry per run (alpha-depth: three)."""

    depths: tuple[int, ...]
    width: int
    heads: int
    block_size: int
    tokens_per_step: int
    steps: int
    lr: float
    every_n_steps: int = 25  # SpectralMonitor's snapshot interval (log-spaced steps come on top)
    max_bytes: int | None = 4_000_000  # 4 MB of text is plenty for CPU runs and reads in a second
    smoothing: float = 0.0  # EMA weight of the init-ablation curves


# cpu: sized to finish in minutes on 2 loaded cores; reference: the study's D8/D12/D16 at width
# 768 and 10K steps (64 x 1024 = 65,536 tokens per step: ~655M tokens; the study does not give its
# batch, so this is this project's choice); tiny: seconds, for the tests.
SCALES: dict[str, dict[str, Scale]] = {
    "lifecycle": {
        "tiny": Scale((2,), 32, 2, 16, 64, 6, 2e-3, every_n_steps=2, max_bytes=100_000),
        "cpu": Scale((8,), 128, 2, 64, 1024, 500, 1.5e-3, every_n_steps=20),
        "reference": Scale((8,), 768, 12, 1024, 65536, 10_000, 6e-4, max_bytes=None),
    },
    "alpha-depth": {
        "tiny": Scale((2, 3, 4), 32, 2, 16, 64, 4, 2e-3, every_n_steps=2, max_bytes=100_000),
        "cpu": Scale((8, 12, 16), 64, 2, 64, 1024, 200, 3e-3, every_n_steps=100),
        "reference": Scale((8, 12, 16), 768, 12, 1024, 65536, 10_000, 6e-4, max_bytes=None),
    },
    "init-ablation": {
        "tiny": Scale((1,), 32, 4, 16, 64, 6, 2e-3, max_bytes=100_000, smoothing=0.5),
        "cpu": Scale((2,), 64, 4, 64, 1024, 200, 3e-3, smoothing=0.9),
        "reference": Scale((8,), 768, 12, 1024, 65536, 5_000, 6e-4, max_bytes=None, smoothing=0.9),
    },
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("figure", choices=FIGURES, help="which figure")
    parser.add_argument(
        "--scale", choices=("tiny", "cpu", "reference"), default="cpu", help="sizes (see SCALES)"
    )
    parser.add_argument(
        "--runs",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="draw these existing runs instead of training (lifecycle: one run; alpha-depth: the "
        "custom runs; init-ablation: a directory holding <variant>/<init> runs)",
    )
    parser.add_argument(
        "--pretrained",
        nargs="+",
        type=Path,
        default=[],
        metavar="DIR",
        help="alpha-depth: local Hugging Face model directories (GPT-2 and GPT-NeoX/Pythia)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANT_LABELS),
        choices=list(VARIANT_LABELS),
        help="init-ablation: the attention variants (default: all nine)",
    )
    parser.add_argument("--out", type=Path, default=Path("figures"), help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="override the scale's steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu, auto")
    parser.add_argument("--text", type=Path, default=None, help="train on this text file")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine 2 threads ran 4x "
        "slower, spinning while the other thread waited for a core)",
    )
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    return parser


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    """Train (or read) what the figure needs, draw it; return the PNG and CSV paths."""
    args = build_parser().parse_args(argv)
    scale = SCALES[args.figure][args.scale]
    if args.steps is not None:
        if args.steps < 1:
            raise MisconfigurationException(f"`--steps` must be a positive int, got {args.steps}")
        scale = Scale(**{**scale.__dict__, "steps": args.steps})
    if args.runs is not None and args.figure == "lifecycle" and len(args.runs) != 1:
        raise MisconfigurationException(f"lifecycle draws one run; `--runs` got {len(args.runs)}")
    if args.pretrained and args.figure != "alpha-depth":
        raise MisconfigurationException("`--pretrained` is for the alpha-depth figure only")
    started = time.perf_counter()
    runs = args.runs or train(args, scale)
    if args.figure == "lifecycle":
        fig = draw_lifecycle(read_runs(runs).rows)
    elif args.figure == "alpha-depth":
        pretrained = analyze_pretrained(args.pretrained, args.out / "runs" / "pretrained")
        fig = draw_alpha_depth(read_runs(runs).rows, pretrained)
    else:
        rows = read_runs(runs, all_scalars=True).rows
        fig = draw_init_ablation(rows, args.variants, scale.smoothing)
    png, csv = args.out / f"{args.figure}.png", args.out / f"{args.figure}.csv"
    charts.save_figure(fig, png)
    charts.plotted_values(fig).to_csv(csv, index=False)
    print(f"[reproduce] {args.figure}: {png} and {csv} in {time.perf_counter() - started:.0f} s")
    return png, csv


# --- training --------------------------------------------------------------------------------


def _common(args: argparse.Namespace, scale: Scale) -> list[str]:
    """Flags every training run of a figure shares (train_gpt.py and attention_variants.py)."""
    return [
        *("--width", str(scale.width), "--heads", str(scale.heads)),
        *("--block-size", str(scale.block_size), "--tokens-per-step", str(scale.tokens_per_step)),
        *("--steps", str(scale.steps), "--lr", str(scale.lr), "--seed", str(args.seed)),
        *("--every-n-steps", str(scale.every_n_steps), "--accelerator", args.accelerator),
        "--progress" if args.progress else "--no-progress",
        *(["--max-bytes", str(scale.max_bytes)] if scale.max_bytes else []),
        *(["--text", str(args.text)] if args.text else []),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]


def train(args: argparse.Namespace, scale: Scale) -> list[Path]:
    """Train the runs of ``args.figure``; return the directories to read."""
    logdir = args.out / "runs" / args.figure
    if logdir.exists() and any(logdir.iterdir()):
        raise MisconfigurationException(
            f"{logdir} already holds runs; pass a fresh `--out`, or draw them with `--runs`"
        )
    if args.figure == "init-ablation":
        flags = [*_common(args, scale), "--depth", str(scale.depths[0]), "--no-spectral"]
        flags += ["--variants", *args.variants, "--inits", "gpt", "zero_out"]
        attention_variants.train_variants(
            attention_variants.build_parser().parse_args([*flags, "--logdir", str(logdir)])
        )
        return [logdir]
    runs = []
    for depth in scale.depths:
        name = f"D{depth}"
        print(f"[reproduce] training {name} (width {scale.width}, {scale.steps} steps)", flush=True)
        runs.append(
            train_gpt.main(
                [*_common(args, scale), "--depth", str(depth), "--esd", "--logdir", str(logdir)]
                + ["--name", name, "--version", ""]
            )
        )
    return runs


def analyze_pretrained(models: list[Path], logdir: Path) -> dict[str, pd.DataFrame]:
    """Analyze each local model directory; return its tidy rows per alpha-depth panel.

    Raises:
        MisconfigurationException: a directory without ``config.json``, a model type that is
            neither GPT-2 nor GPT-NeoX, or a model ``spectral-callbacks analyze`` cannot read.
    """
    frames: dict[str, list[pd.DataFrame]] = {panel: [] for panel in PRETRAINED_PANELS.values()}
    for model in models:
        config = model / "config.json"
        if not config.is_file():
            raise MisconfigurationException(
                f"`--pretrained {model}` holds no config.json; give a local Hugging Face model "
                "directory (e.g. written by save_pretrained)"
            )
        model_type = json.loads(config.read_text()).get("model_type")
        if model_type not in PRETRAINED_PANELS:
            raise MisconfigurationException(
                f"`--pretrained {model}` is a {model_type!r} model; alpha-depth has panels for "
                f"{', '.join(PRETRAINED_PANELS)} (GPT-2, Pythia)"
            )
        target = logdir / model.name
        if cli(["analyze", str(model), "--logdir", str(target)]) != 0:
            raise MisconfigurationException(f"`spectral-callbacks analyze {model}` failed (above)")
        rows = read_runs([target]).rows
        frames[PRETRAINED_PANELS[model_type]].append(rows.assign(run=model.name))
    return {panel: pd.concat(parts) for panel, parts in frames.items() if parts}


# --- drawing ---------------------------------------------------------------------------------


def draw_lifecycle(rows: pd.DataFrame) -> Figure:
    """(a) layer-0 stable rank by matrix type vs step; (b) final compression % by layer x type."""
    runs = rows["run"].unique()
    if len(runs) != 1:
        raise MisconfigurationException(f"lifecycle draws one run, got {len(runs)}: {list(runs)}")
    fig = Figure(figsize=(13.0, 4.6), layout="constrained")
    rank_ax, compression_ax = fig.subplots(1, 2, width_ratios=(1.0, 1.25))
    charts.rank_vs_steps(rows, layer=0, ax=rank_ax)
    rank_ax.set_title(f"(a) layer 0: stable rank by matrix type — {runs[0]}")
    charts.compression_by_layer(rows, ax=compression_ax)
    compression_ax.set_title("(b) final compression by layer × type")
    return fig


def draw_alpha_depth(custom: pd.DataFrame, pretrained: dict[str, pd.DataFrame]) -> Figure:
    """α of Q vs relative depth: (a) custom runs, (b) GPT-2, (c) Pythia; y 0.1-0.6 by default."""
    # Runs in natural order (D8, D12, D16), whatever order the directories were read in.
    natural = {run: _natural_key(run) for run in custom["run"].unique()}
    custom = custom.sort_values("run", key=lambda runs: runs.map(natural), kind="stable")
    fig = Figure(figsize=(14.0, 4.4), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    panels = [("(a) custom runs", custom)]
    panels += [
        (f"({letter}) {name}", pretrained.get(name))
        for letter, name in zip("bc", ("GPT-2", "Pythia"), strict=True)
    ]
    for ax, (title, rows) in zip(axes, panels, strict=True):
        if rows is None:
            ax.set_title(title)
            ax.text(
                0.5,
                0.5,
                "no pretrained models given\n(--pretrained DIR ...)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="0.4",
            )
            ax.set_xlim(-0.05, 1.05)
            ax.set_ylim(*ALPHA_RANGE)
            ax.set_xlabel("relative depth i / (L − 1)")
            ax.grid(alpha=0.3)
            continue
        charts.alpha_vs_depth(rows, role="Q", ax=ax, ylim=ALPHA_RANGE, title=title)
    return fig


def _natural_key(name: str) -> tuple:
    """Sort key that orders the numbers inside a name by value: D8 < D12 < D16."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def draw_init_ablation(rows: pd.DataFrame, variants: list[str], smoothing: float) -> Figure:
    """Per variant, loss of the zero_out init minus the gpt init vs tokens (one curve each)."""
    order = {
        f"{variant}/{init}": i for i, variant in enumerate(variants) for init in ("zero_out", "gpt")
    }
    rows = rows[rows["run"].isin(order)].sort_values(
        "run", key=lambda runs: runs.map(order), kind="stable"
    )
    fig = differences.metric_diff(
        rows, "train/loss", pair=INIT_PAIR, x="train/tokens", smoothing=smoothing
    )
    ax = fig.axes[0]
    for line in ax.get_lines():
        line.set_label(VARIANT_LABELS.get(str(line.get_label()), line.get_label()))
    ax.legend(title="variant", fontsize="small", ncols=3)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("Δ loss (zero_out init − gpt init)")
    ax.set_title(
        "Initialization ablation across attention variants"
        + (f" (EMA {smoothing:g})" if smoothing else "")
    )
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
