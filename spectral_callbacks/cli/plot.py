"""``spectral-callbacks plot``: the standard charts of one or more runs, written to a file.

Example::

    spectral-callbacks plot runs/d8 runs/d12 runs/gpt2 --kind alpha-depth --role Q -o alpha.png
    spectral-callbacks plot runs/d8 --kind heads --metric qk_spectral_norm --steps 0:500 -o heads.png
    spectral-callbacks plot runs --kind metric-diff --metric train/loss --baseline mha --x train/tokens -o diff.pdf
    spectral-callbacks plot runs/ablation --kind metric-diff --metric train/loss \
        --pair '{variant}/zero_out' '{variant}/gpt' --x train/tokens --smoothing 0.9 -o init.png
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import pandas as pd

from spectral_callbacks.cli.common import (
    CommandError,
    add_logdirs,
    layer_choice,
    read,
    report_problems,
    say,
    smoothing_weight,
    step_range,
)
from spectral_callbacks.messages import count
from spectral_callbacks.offline.events import filter_rows

if TYPE_CHECKING:  # matplotlib is imported when a chart is drawn, not for --help
    from matplotlib.figure import Figure

KINDS = {
    "alpha-depth": "alpha of --role (default Q) vs relative depth i/(L-1), one line per run",
    "rank-steps": "--metric (default stable_rank) of --layer (default 0) vs step, one line per role",
    "compression": "final compression % by layer, grouped bars per role, a panel per run",
    "compression-wave": "heatmap layer x step of --role's (default Q) compression, a panel per run",
    "update-rank": "an adapter's update: rank holding 90 % of ||dW||_F^2 beside r, per layer and role",
    "layer-steps": "--metric (default update_stable_rank) of --role (default Q) vs step, one line "
    "per layer",
    "metric-diff": "--metric of each run minus the --baseline run (or minus its --pair partner), "
    "vs step or --x",
    "heads": "heatmap layer x head of a circuit --metric (default qk_spectral_norm) at the last "
    "step (of --steps), a panel per run (circuits=True)",
    "head-steps": "a circuit --metric (default qk_spectral_norm) of each head of --layer "
    "(default 0) vs step",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plot",
        help="draw the standard charts (alpha-depth, rank-steps, compression, ...)",
        description="Draw one of the standard charts of spectral training dynamics from the "
        "event files of one or more runs.\n\nkinds:\n"
        + "\n".join(f"  {kind:17} {text}" for kind, text in KINDS.items()),
        epilog="examples:\n  spectral-callbacks plot runs/d8 runs/gpt2 --kind alpha-depth -o alpha.png\n"
        "  spectral-callbacks plot runs/d8 --kind rank-steps --layer 0 -o rank.svg\n"
        "  spectral-callbacks plot runs --kind metric-diff --metric train/loss --baseline mha "
        "--x train/tokens -o diff.pdf\n"
        "  spectral-callbacks plot runs/ablation --kind metric-diff --metric train/loss "
        "--pair '{variant}/zero_out' '{variant}/gpt' --x train/tokens --smoothing 0.9 -o init.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_logdirs(parser)
    parser.add_argument("--kind", required=True, choices=list(KINDS), help="which chart")
    parser.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="FILE.png, .svg or .pdf"
    )
    parser.add_argument(
        "--role", metavar="ROLE", help="role of alpha-depth / compression-wave (default Q)"
    )
    parser.add_argument(
        "--layer",
        type=layer_choice,
        metavar="N",
        help="layer of rank-steps and head-steps (default 0), of metric-diff",
    )
    parser.add_argument(
        "--metric",
        metavar="NAME",
        help="metric of rank-steps (default stable_rank); the scalar of metric-diff, a tag such "
        "as train/loss or a spectral metric with --layer and --role",
    )
    reference = parser.add_mutually_exclusive_group()
    reference.add_argument(
        "--baseline", metavar="RUN", help="metric-diff: the run subtracted from the others"
    )
    reference.add_argument(
        "--pair",
        nargs=2,
        metavar=("RUNS", "PARTNERS"),
        help="metric-diff: subtract from each run named like RUNS its partner named like PARTNERS; "
        "{name} placeholders match a name part without '/' and fill the partner, e.g. "
        "--pair '{variant}/zero_out' '{variant}/gpt' (one curve per variant)",
    )
    parser.add_argument(
        "--smoothing",
        type=smoothing_weight,
        default=0.0,
        metavar="W",
        help="metric-diff: TensorBoard's EMA smoothing of each difference, W in [0, 1) "
        "(default 0: none)",
    )
    parser.add_argument(
        "--x",
        default="step",
        metavar="SCALAR",
        help="metric-diff: x axis, 'step' (default) or the tag of another scalar such as "
        "train/tokens; runs are aligned by interpolation",
    )
    parser.add_argument("--steps", type=step_range, metavar="FIRST:LAST", help="only these steps")
    parser.set_defaults(func=run)


def draw(rows: pd.DataFrame, args: argparse.Namespace) -> Figure:
    """The figure of ``args.kind`` from ``rows``; chart errors become CommandErrors."""
    from spectral_callbacks import charts
    from spectral_callbacks.offline import differences

    try:
        if args.kind == "alpha-depth":
            return charts.alpha_vs_depth(rows, role=args.role or "Q")
        if args.kind == "rank-steps":
            return charts.rank_vs_steps(
                rows,
                layer=0 if args.layer is None else args.layer,
                metric=args.metric or "stable_rank",
            )
        if args.kind == "compression":
            return charts.compression_by_layer(rows)
        if args.kind == "compression-wave":
            return charts.compression_wave(rows, role=args.role or "Q")
        if args.kind == "update-rank":
            return charts.update_rank_vs_r(rows)
        if args.kind == "heads":
            return charts.heads_by_layer(rows, metric=args.metric or "qk_spectral_norm")
        if args.kind == "head-steps":
            return charts.heads_vs_steps(
                rows,
                layer=0 if args.layer is None else args.layer,
                metric=args.metric or "qk_spectral_norm",
            )
        if args.kind == "layer-steps":
            return charts.metric_vs_steps_by_layer(
                rows, role=args.role or "Q", metric=args.metric or "update_stable_rank"
            )
        missing = [
            what
            for what, absent in (
                (
                    "--metric NAME (one of the runs' scalars: "
                    f"{', '.join(sorted(rows.loc[rows['role'].isna(), 'metric'].unique())) or 'none'})",
                    args.metric is None,
                ),
                (
                    f"--baseline RUN (one of: {', '.join(rows['run'].unique())}) or --pair RUNS "
                    "PARTNERS",
                    args.baseline is None and args.pair is None,
                ),
            )
            if absent
        ]
        if missing:
            raise CommandError(f"--kind metric-diff needs {' and '.join(missing)}")
        return differences.metric_diff(
            rows,
            args.metric,
            args.baseline,
            pair=tuple(args.pair) if args.pair else None,
            x=args.x,
            layer=args.layer,
            role=args.role,
            smoothing=args.smoothing,
        )
    except ValueError as error:
        raise CommandError(f"--kind {args.kind}: {error}") from None


def run(args: argparse.Namespace) -> int:
    from spectral_callbacks.charts import FIGURE_FORMATS, save_figure

    if not args.output.lower().endswith(FIGURE_FORMATS):
        raise CommandError(
            f"-o {args.output}: the chart format comes from the extension; use one of "
            f"{', '.join(FIGURE_FORMATS)}"
        )
    result = read("plot", args.logdir, all_scalars=args.kind == "metric-diff")
    rows = filter_rows(result.rows, steps=args.steps)
    if rows.empty:
        if result.problems:
            return report_problems("plot", result, "nothing to plot")
        raise CommandError(f"no rows in {', '.join(args.logdir)} between steps {args.steps}")
    try:
        figure = draw(rows, args)
    except CommandError as error:
        if not result.problems:
            raise
        say("plot", "error", str(error))
        return report_problems("plot", result, "nothing was plotted")
    save_figure(figure, args.output)
    left_out: dict[str, str] = getattr(figure, "left_out", {})
    for run, reason in left_out.items():
        say("plot", "note", f"left out {run}: {reason}")
    for run, reason in getattr(figure, "fell_back", {}).items():
        say("plot", "note", f"{run}: {reason}")
    if result.problems:
        runs = ", ".join(rows["run"].unique())
        return report_problems(
            "plot", result, f"plotted the runs that could be read ({runs}) to {args.output}"
        )
    drawn = rows["run"].nunique() - len(left_out)
    total = count(rows["run"].nunique(), "run")
    say("plot", "done", f"{args.kind} of {drawn} of {total} to {args.output}")
    return 0
