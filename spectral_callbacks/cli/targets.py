"""``spectral-callbacks targets``: which matrices of a model are watched, as which role.

Example::

    spectral-callbacks targets ./gpt2
    spectral-callbacks targets last.ckpt --arch train_gpt:GPTModule
    spectral-callbacks targets ./llama --example-input auto   # roles read from a forward
"""

from __future__ import annotations

import argparse

from spectral_callbacks.cli.analyze import (
    ARCH_HELP,
    BASE_HELP,
    EXAMPLE_INPUT_HELP,
    MODEL_HELP,
    read_example_input,
    roles_from,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "targets",
        help="print a model's role map (layer, role, parameter, shape)",
        description="Print the matrices find_targets maps in a model: layer, role, parameter and "
        "shape, and the 2-D weights left out with the reason.",
        epilog="examples:\n  spectral-callbacks targets ./gpt2\n"
        "  spectral-callbacks targets weights.safetensors --arch hf:./bert_config\n"
        "  spectral-callbacks targets ./llama --example-input auto",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--arch", metavar="HINT", help=ARCH_HELP)
    parser.add_argument("--base", metavar="DIR", help=BASE_HELP)
    parser.add_argument("--example-input", metavar="SPEC", help=EXAMPLE_INPUT_HELP)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spectral_callbacks.offline.loading import load_model
    from spectral_callbacks.targets import find_targets, format_targets

    model = load_model(args.model, args.arch, args.base)
    batch = None if args.example_input is None else read_example_input(model, args.example_input)
    targets = find_targets(model) if batch is None else find_targets(model, example_input=batch)
    print(format_targets(targets))  # with a "from" column where a forward gave roles
    sources = [targets.sources.get(t.name, "names") for t in targets]
    if set(sources) <= {"names"}:
        print("roles " + roles_from(sources))
    return 0
