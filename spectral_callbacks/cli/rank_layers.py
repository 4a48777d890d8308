"""``spectral-callbacks rank-layers``: layers ranked by ESD α and AlphaPruning's sparsity per block.

The α come from a run's event files (the latest step that logged ``esd_alpha``, so a live run gives
its newest snapshot) or from a model at rest (every watched matrix's ESD fitted here, as
``analyze`` loads it). See ``spectral_callbacks.offline.ranking`` for the method.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from spectral_callbacks.cli.analyze import ARCH_HELP, BASE_HELP
from spectral_callbacks.cli.common import CommandError, read_whole, say
from spectral_callbacks.messages import count

if TYPE_CHECKING:
    import pandas as pd


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "rank-layers",
        help="rank layers by ESD α and allocate a sparsity per block (AlphaPruning)",
        description="Rank every watched matrix by its ESD α (WeightWatcher's fit) and give each "
        "block the sparsity AlphaPruning allocates for a target sparsity.",
        epilog="examples:\n  spectral-callbacks rank-layers runs/d8 --sparsity 0.7\n"
        "  spectral-callbacks rank-layers runs/lora --lora --energy 0.95\n"
        "  spectral-callbacks rank-layers ./gpt2 --csv ranks.csv --chart ranks.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source",
        metavar="RUN_OR_MODEL",
        help="a run's log directory (its latest step with esd_alpha) or a model, as for analyze",
    )
    parser.add_argument("--sparsity", type=float, default=0.7, help="target sparsity (0.7)")
    parser.add_argument(
        "--epsilon", type=float, default=0.2, help="half-width of the ratio band (0.2)"
    )
    parser.add_argument("--csv", metavar="FILE", help="write the per-matrix table as CSV")
    parser.add_argument("--json", metavar="FILE", help="write matrices and blocks as JSON")
    parser.add_argument("--chart", metavar="PNG", help="draw block α and sparsity as bars")
    lora = parser.add_argument_group("LoRA ranks (--lora: a run of a PEFT LoRA fine-tune)")
    lora.add_argument(
        "--lora",
        action="store_true",
        help="instead: the energy rank of each adapted module's update, the r it needs and a "
        "rank_pattern / alpha_pattern for peft.LoraConfig",
    )
    lora.add_argument(
        "--energy", type=float, default=0.9, help="energy kept by the suggested r (0.9)"
    )
    lora.add_argument(
        "--round-to",
        type=int,
        default=None,
        metavar="STEP",
        help="round the suggested r up to a multiple of STEP (default: a power of two)",
    )
    parser.add_argument("--arch", metavar="HINT", help=ARCH_HELP)
    parser.add_argument("--base", metavar="DIR", help=BASE_HELP)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spectral_callbacks.offline.ranking import (
        RankingError,
        block_sparsity,
        check_allocation,
        rank_matrices,
    )

    if args.lora:
        from spectral_callbacks.cli import lora_ranks

        return lora_ranks.run(args)
    try:
        check_allocation(args.sparsity, args.epsilon)  # before a model is loaded, not after
        rows, where = matrix_alphas(args.source, args.arch, args.base)
        blocks = block_sparsity(rows, args.sparsity, args.epsilon)
    except RankingError as error:
        flag = {"sparsity": "--sparsity", "epsilon": "--epsilon"}.get(error.argument or "")
        raise CommandError(f"{error}" + (f" (set with {flag})" if flag else "")) from error
    ranked = rank_matrices(rows).merge(blocks[["stack", "layer", "block_alpha", "sparsity"]],
                                       on=["stack", "layer"], how="left")  # fmt: skip
    print_ranking(ranked, blocks, f"{args.source}: ESD α ({where})")
    if args.csv:
        ranked.to_csv(args.csv, index=False)
    if args.json:
        import json

        Path(args.json).write_text(
            json.dumps(
                {
                    "source": args.source,
                    "where": where,
                    "target_sparsity": args.sparsity,
                    "epsilon": args.epsilon,
                    "matrices": ranked.to_dict(orient="records"),
                    "blocks": blocks.to_dict(orient="records"),
                },
                indent=1,
                default=float,
            )
        )
    if args.chart:
        draw_chart(blocks, args.chart, f"{Path(args.source).name} ({where}): target sparsity "
                   f"{args.sparsity}")  # fmt: skip
    weights = blocks["params"].astype(float)
    mean = float((blocks["sparsity"] * weights).sum() / weights.sum())
    matrices = count(len(ranked), "matrix", "matrices")
    labelled = int((ranked["warning"] != "").sum())
    say("rank-layers", "done", f"{matrices}, {count(len(blocks), 'block')}; weighted mean "
        f"sparsity {mean:.4f} (target {args.sparsity}); {labelled} of {len(ranked)} with α "
        "outside WeightWatcher's 2-6")  # fmt: skip
    return 0


def matrix_alphas(source: str, arch: str | None, base: str | None) -> tuple[pd.DataFrame, str]:
    """One row per matrix ``stack, layer, role, alpha, params``, and where the α came from."""
    from spectral_callbacks.offline.events import find_runs

    if not Path(source).exists():  # before the model loader's message, which names models only
        raise CommandError(
            f"{source}: no such file or directory; give a run's log directory, a Hugging Face "
            "model directory, a .ckpt or a state_dict file"
        )
    runs, _ = find_runs([source]) if Path(source).is_dir() else ([], [])
    if runs:
        return _from_run(source)
    return _from_model(source, arch, base), "fitted now"


def _from_run(source: str) -> tuple[pd.DataFrame, str]:
    # A damaged file may end inside a snapshot: a ranking of part of one would allocate the
    # sparsity over part of the model, so the damage is the error, not the α it hid.
    result = read_whole("rank-layers", source, "nothing was ranked")
    rows = result.rows
    rows = rows[(rows["metric"] == "esd_alpha") & rows["layer"].notna()]
    if "expert" in rows:
        rows = rows[rows["expert"].isna()]
    if rows.empty:
        raise CommandError(
            f"{source}: the run logged no esd_alpha; train with metrics=[..., 'esd_alpha'] "
            "(docs/metrics.md), write a model's with `analyze MODEL --esd`, or pass the model "
            "directory or checkpoint itself"
        )
    if rows["run"].nunique() > 1:
        raise CommandError(
            f"{source}: holds {rows['run'].nunique()} runs ({', '.join(sorted(rows['run'].unique()))}); "
            "give one run's directory"
        )
    step = int(rows["step"].max())
    last = int(result.rows["step"].max())  # the run's last logged step, of any metric
    if step < last:
        say("rank-layers", "warning", f"the run's last esd_alpha is at step {step}, not at its "
            f"last step {last}: the ranking reads the weights of step {step}")  # fmt: skip
    latest = rows[rows["step"] == step]
    say("rank-layers", "note", "a run does not record matrix sizes: every block weighs the same "
        "in the target mean; rank a checkpoint for parameter weights")  # fmt: skip
    out = latest.assign(stack=latest["stack"].fillna(""), alpha=latest["value"], params=1)
    out = out.groupby(["stack", "layer", "role"], as_index=False).agg(
        alpha=("alpha", "last"), params=("params", "first")
    )
    out["layer"] = out["layer"].astype(int)
    return out, f"logged at step {step}"


def _from_model(source: str, arch: str | None, base: str | None) -> pd.DataFrame:
    from spectral_callbacks.offline.analysis import analyze_model
    from spectral_callbacks.offline.loading import load_model

    model = load_model(source, arch, base)
    rows, _ = analyze_model(model, esd=True, k=1)
    stack = rows["stack"].fillna("")
    params = rows["shape"].map(lambda text: math.prod(int(n) for n in text.split("x")))
    return rows.assign(stack=stack, alpha=rows["esd_alpha"], params=params)[
        ["stack", "layer", "role", "alpha", "params"]
    ]


def print_ranking(ranked: pd.DataFrame, blocks: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    stacks = bool(ranked["stack"].ne("").any())  # a column only for models with several
    table = Table(title=title)
    for column in ("rank", *(("stack",) if stacks else ()), "layer", "role", "ESD α"):
        table.add_column(column, justify="right")
    table.add_column("WeightWatcher", no_wrap=True)  # its label of the α
    for column in ("block α", "block sparsity"):
        table.add_column(column, justify="right")
    for r in ranked.itertuples(index=False):
        where = (r.stack or "-",) if stacks else ()
        table.add_row(str(r.rank), *where, str(r.layer), r.role, f"{r.alpha:.3f}", r.warning,
                      f"{r.block_alpha:.3f}", f"{r.sparsity:.3f}")  # fmt: skip
    # Off a terminal (a pipe, a file) rich would assume 80 columns and cut the headers.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def draw_chart(blocks: pd.DataFrame, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{s + '/' if s else ''}L{layer:02d}"
        for s, layer in zip(blocks["stack"], blocks["layer"], strict=True)
    ]
    figure, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(6, 0.5 * len(labels) + 2), 6), sharex=True
    )
    top.bar(labels, blocks["block_alpha"], color="tab:blue")
    top.set_ylabel("block mean ESD α")
    top.set_title(title)
    bottom.bar(labels, blocks["sparsity"], color="tab:orange")
    weights = blocks["params"].astype(float)
    mean = float((blocks["sparsity"] * weights).sum() / weights.sum())
    bottom.axhline(
        mean, color="black", linestyle="--", linewidth=1, label=f"weighted mean {mean:.3f}"
    )
    bottom.set_ylabel("AlphaPruning sparsity")
    bottom.set_xlabel("block")
    bottom.legend(loc="lower right")
    for label in bottom.get_xticklabels():
        label.set_rotation(90 if len(labels) > 16 else 0)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
