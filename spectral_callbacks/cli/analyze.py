"""``spectral-callbacks analyze``: the spectral metrics of a saved or pretrained model.

The metrics are written as the scalars a training run logs (at ``--step``, default 0), so
``spectral-callbacks plot`` puts the model beside training runs; a layer x role table is printed.

Example::

    spectral-callbacks analyze ./gpt2 --logdir runs/gpt2
    spectral-callbacks analyze last.ckpt --arch train_gpt:GPTModule --logdir runs/d8_final --step 10000
    spectral-callbacks plot runs/d8 runs/gpt2 --kind alpha-depth -o alpha.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spectral_callbacks.cli.common import CommandError, say
from spectral_callbacks.messages import count

if TYPE_CHECKING:  # pandas and rich are imported when the command runs, not for --help
    import pandas as pd
    from rich.progress import Progress

MODEL_HELP = (
    "a Hugging Face model directory (config.json + *.safetensors or pytorch_model.bin), a PEFT "
    "adapter directory (adapter_config.json + adapter_model.safetensors, with --base), a "
    "Lightning checkpoint (.ckpt) or a state_dict file (.pt, .pth, .bin, .safetensors)"
)
BASE_HELP = (
    "the base model directory of a PEFT adapter directory (default: the adapter config's "
    "base_model_name_or_path, if a local directory)"
)
EXAMPLE_INPUT_HELP = (
    "read the roles from one forward of the model on this input: 'auto' builds token ids (and "
    "pixel values, decoder ids) from the model's config; a path reads a batch saved with "
    "torch.save (a tensor, a tuple of arguments or a dict of keyword arguments). Default: the "
    "name rules alone"
)
ARCH_HELP = (
    "architecture of a .ckpt or state_dict: hf:CONFIG_DIR (a Hugging Face config) or "
    "module:Class (an import path; a LightningModule is rebuilt from the checkpoint's "
    "hyper_parameters)"
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "analyze",
        help="compute the spectral metrics of a saved or pretrained model into event files",
        description="Compute the spectral metrics of every Q/K/V/O/MLP matrix of a model at rest "
        "and write them as the scalars a training run logs, so plot can compare it with runs.",
        epilog="examples:\n  spectral-callbacks analyze ./gpt2 --logdir runs/gpt2\n"
        "  spectral-callbacks analyze last.ckpt --arch train_gpt:GPTModule --logdir runs/final\n"
        "  spectral-callbacks analyze weights.pt --arch hf:./gpt2_config --logdir runs/w --step 500\n"
        "  spectral-callbacks analyze ./lora_adapter --base ./llama --logdir runs/lora",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument(
        "--logdir", required=True, metavar="DIR", help="where to write the event file"
    )
    parser.add_argument(
        "--step",
        type=int,
        default=0,
        metavar="N",
        help="the step the scalars are logged at (default 0)",
    )
    parser.add_argument("--arch", metavar="HINT", help=ARCH_HELP)
    parser.add_argument("--base", metavar="DIR", help=BASE_HELP)
    parser.add_argument("--example-input", metavar="SPEC", help=EXAMPLE_INPUT_HELP)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the randomized SVD, so the same model gives the same numbers (default 0)",
    )
    parser.add_argument(
        "--method",
        default="auto",
        choices=["auto", "randomized", "subspace", "gram", "svdvals"],
        help="SVD method of spectral_metrics: auto (default, what the callback uses), or an exact "
        "one, gram or svdvals, for a model at rest where time matters less",
    )
    parser.add_argument(
        "--esd",
        action="store_true",
        help="also fit the ESD family (esd_alpha, esd_ks_distance, esd_xmin, esd_tail_size: "
        "WeightWatcher's power-law fit of every eigenvalue), which rank-layers reads from the "
        "written run",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from spectral_callbacks.offline.analysis import (
        DESCRIPTION_COLUMNS,
        analyze_model,
        check_logdir,
        write_scalars,
    )
    from spectral_callbacks.offline.loading import load_model

    if args.step < 0:
        raise CommandError(f"--step must be a non-negative int, got {args.step}")
    check_logdir(args.logdir)  # before minutes of analysis
    model = load_model(args.model, args.arch, args.base)
    batch = None if args.example_input is None else read_example_input(model, args.example_input)
    with _ProgressBar() as advance:
        generator = torch.Generator().manual_seed(args.seed)
        rows, num_layers = analyze_model(
            model,
            progress=advance,
            example_input=batch,
            generator=generator,
            method=args.method,
            esd=args.esd,
        )
    written = write_scalars(rows, num_layers, args.logdir, step=args.step)
    print_table(rows, title=f"{args.model}: stable rank / α by layer and role (step {args.step})")
    metrics = rows.columns.difference(list(DESCRIPTION_COLUMNS))
    unknown = rows[metrics].isna().sum()
    if unknown.any():
        left_out = ", ".join(
            f"{metric} ({count} of {len(rows)})" for metric, count in unknown[unknown > 0].items()
        )
        say(
            "analyze",
            "note",
            f"not written, NaN (unknown within the top k, or non-finite weights): {left_out}",
        )
    say("analyze", "roles", roles_from(rows["source"].tolist()))
    say(
        "analyze",
        "done",
        f"{count(len(rows), 'matrix', 'matrices')} of {_layers(rows)} written to "
        f"{args.logdir} ({count(len(written), 'scalar')})",
    )
    return 0


def read_example_input(model: Any, spec: str) -> Any:
    """``--example-input``'s batch for ``model``; a CommandError naming the option otherwise."""
    from spectral_callbacks.offline.example_input import ExampleInputError, example_input

    try:
        return example_input(model, spec)
    except ExampleInputError as error:
        raise CommandError(str(error)) from error


def roles_from(sources: list[str]) -> str:
    """``"from data flow 12, names 2"``; or that the names alone gave them, and how to do better.

    >>> roles_from(["data flow", "data flow", "names"])
    'from data flow 2, names 1'
    >>> roles_from(["names"])
    'from the names alone (--example-input auto reads them from a forward of the model)'
    """
    if set(sources) == {"names"}:
        return "from the names alone (--example-input auto reads them from a forward of the model)"
    tally = {source: sources.count(source) for source in dict.fromkeys(sources)}
    return "from " + ", ".join(f"{source} {number}" for source, number in tally.items())


def _layers(rows: pd.DataFrame) -> str:
    """ "3 layers", or per stack where there are several: "5 layers (enc 2, dec 3)"."""
    per_stack = rows.groupby(rows["stack"].fillna(""), sort=False)["layer"].nunique()
    total = count(int(per_stack.sum()), "layer")
    if len(per_stack) == 1:
        return total
    return f"{total} ({', '.join(f'{stack} {n}' for stack, n in per_stack.items())})"


class _ProgressBar:
    """A rich progress bar over matrices on a terminal's stderr; a no-op elsewhere."""

    def __enter__(self) -> Callable[[int], None]:
        self._progress: Progress | None = None
        if not sys.stderr.isatty():
            return lambda done: None
        from rich.console import Console
        from rich.progress import Progress

        self._progress = Progress(console=Console(stderr=True), transient=True)
        self._progress.start()
        task = self._progress.add_task("analyzing matrices", total=None)
        progress = self._progress
        return lambda done: progress.advance(task, done)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def print_table(rows: pd.DataFrame, title: str) -> None:
    """A (stack,) layer x role table of ``stable rank / α`` on stdout.

    A model with several stacks (T5's encoder and decoder) gets a stack column, so one stack's
    layer never hides another's; a layer's experts are one cell, their mean with the min and max
    over the experts in brackets, as ``targets`` and ``rank-layers`` print them.
    """
    from rich.console import Console
    from rich.table import Table

    from spectral_callbacks.chart_data import role_glyph
    from spectral_callbacks.names import role_sort_key

    rows = rows.assign(stack=rows["stack"].fillna(""))
    stacks = list(rows["stack"].unique())  # in the model's order (encoder before decoder)
    roles = sorted(rows["role"].unique(), key=role_sort_key)
    experts = bool(rows["expert"].notna().any())
    table = Table(title=title + (" (experts: mean (min-max))" if experts else ""))
    if len(stacks) > 1:
        table.add_column("stack")
    table.add_column("layer", justify="right")
    for role in roles:
        table.add_column(role_glyph(role), justify="right")
    cells = {key: group for key, group in rows.groupby(["stack", "layer", "role"])}
    for stack in stacks:
        for layer in sorted(rows.loc[rows["stack"] == stack, "layer"].unique()):
            row = [stack] if len(stacks) > 1 else []
            row.append(str(layer))
            for role in roles:
                cell = cells.get((stack, layer, role))
                row.append("" if cell is None else _cell(cell))
            table.add_row(*row)
    width = 14 if not experts else 30
    Console(width=max(100, width * (len(roles) + 1) + 8)).print(table)


def _cell(matrices: pd.DataFrame) -> str:
    """``stable rank / α`` of one matrix, or of a layer's experts: mean (min-max) of each."""
    if len(matrices) == 1:
        return f"{matrices['stable_rank'].iloc[0]:.1f} / {matrices['alpha'].iloc[0]:.2f}"
    sr, alpha = matrices["stable_rank"], matrices["alpha"]
    return (
        f"{sr.mean():.1f} ({sr.min():.1f}-{sr.max():.1f}) / "
        f"{alpha.mean():.2f} ({alpha.min():.2f}-{alpha.max():.2f})"
    )
