"""``spectral-callbacks export``: logged curves of one or more runs as tidy rows in a file.

Example::

    spectral-callbacks export runs/d8 -o d8.csv --metric stable_rank --role Q --steps 0:1000
    spectral-callbacks export runs -o - --all-scalars | head
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd

from spectral_callbacks.cli.common import (
    CommandError,
    add_logdirs,
    layer_choice,
    read,
    report_problems,
    say,
    step_range,
)
from spectral_callbacks.messages import count
from spectral_callbacks.offline.events import NO_SPECTRAL_SCALARS, filter_rows

FORMATS = {
    ".csv": "CSV",
    ".parquet": "Parquet",
    ".pq": "Parquet",
    ".json": "JSON",
    ".jsonl": "JSON lines",
}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="export logged spectral scalars as tidy rows (CSV, Parquet, JSON)",
        description="Export every spectral scalar of one or more runs as tidy rows: run, step, "
        "metric, layer, depth, role, value, wall_time. Every logged point is kept.",
        epilog="examples:\n  spectral-callbacks export runs/d8 -o d8.parquet\n"
        "  spectral-callbacks export runs -o - --metric alpha --role Q --layer 0 --layer mean\n"
        "  spectral-callbacks export runs/d8 -o all.csv --all-scalars --steps 0:2000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_logdirs(parser)
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="output file; the format comes from the extension (.csv, .parquet, .pq, .json, "
        ".jsonl), '-' writes CSV to stdout",
    )
    add_filters(parser)
    parser.add_argument(
        "--all-scalars",
        action="store_true",
        help="also export the runs' other scalars (loss, tokens, spectral_monitor/...), with the "
        "tag as metric and layer, depth and role empty",
    )
    parser.set_defaults(func=run)


def add_filters(parser: argparse.ArgumentParser) -> None:
    """``--metric``, ``--role``, ``--layer``, ``--steps`` (each repeatable but --steps)."""
    parser.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="keep this metric (repeatable), e.g. stable_rank",
    )
    parser.add_argument(
        "--role",
        action="append",
        metavar="ROLE",
        help="keep this role (repeatable): Q, K, V, O, MLP_up, MLP_down, ...",
    )
    parser.add_argument(
        "--layer",
        action="append",
        type=layer_choice,
        metavar="N",
        help="keep this layer index (repeatable); 'mean' keeps the mean over layers",
    )
    parser.add_argument(
        "--steps", type=step_range, metavar="FIRST:LAST", help="keep steps FIRST <= step <= LAST"
    )


def output_format(output: str) -> str:
    """The format name of ``-o`` (``-`` is CSV on stdout), or a CommandError naming the choices."""
    if output == "-":
        return "CSV"
    if Path(output).is_dir():
        raise CommandError(
            f"-o {output}: a directory; give a file in it, e.g. -o {Path(output) / 'spectra.csv'}"
        )
    suffix = Path(output).suffix.lower()
    if suffix not in FORMATS:
        raise CommandError(
            f"-o {output}: "
            + (f"unknown extension {suffix!r}" if suffix else "no extension")
            + "; use one of "
            f"{', '.join(FORMATS)} or '-' for CSV on stdout"
        )
    return FORMATS[suffix]


def write_rows(rows: pd.DataFrame, output: str) -> None:
    """Write tidy rows to ``output`` in the format of its extension."""
    kind = output_format(output)
    if output == "-":
        rows.to_csv(sys.stdout, index=False)
        return
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "CSV":
        rows.to_csv(path, index=False)
    elif kind == "Parquet":
        rows.to_parquet(path, index=False)
    else:
        rows.to_json(path, orient="records", lines=kind == "JSON lines", indent=None)


def run(args: argparse.Namespace) -> int:
    output_format(args.output)  # a bad extension fails before minutes of reading
    result = read("export", args.logdir, all_scalars=args.all_scalars)
    result.problems = [
        dataclasses.replace(
            problem, todo=f"{problem.todo}, or pass --all-scalars to export its other tags"
        )
        if problem.what.startswith(NO_SPECTRAL_SCALARS)
        else problem
        for problem in result.problems
    ]
    rows = filter_rows(
        result.rows, metrics=args.metric, roles=args.role, layers=args.layer, steps=args.steps
    )
    where = "stdout" if args.output == "-" else args.output
    if rows.empty:
        outcome = "nothing was exported"
        if not result.problems:
            raise CommandError(
                f"the filters left no rows of {len(result.rows)}; {describe(result.rows)}"
            )
    else:
        write_rows(rows, args.output)
        found, runs = count(len(rows), "row"), count(rows["run"].nunique(), "run")
        outcome = f"exported the {found} that could be read ({runs}) to {where}"
    if result.problems:
        return report_problems("export", result, outcome)
    say("export", "done", f"{found} of {runs} to {where}")
    return 0


def describe(rows: pd.DataFrame) -> str:
    """What the rows hold, to help a user fix filters that match nothing."""
    if rows.empty:
        return "the runs hold no rows"
    layers = rows["layer"].dropna()
    span = f"layers {int(layers.min())}-{int(layers.max())}, " if not layers.empty else ""
    return (
        f"the runs hold metrics {', '.join(sorted(rows['metric'].unique()))}; roles "
        f"{', '.join(sorted(rows['role'].dropna().unique()))}; {span}steps "
        f"{rows['step'].min()}-{rows['step'].max()}"
    )
