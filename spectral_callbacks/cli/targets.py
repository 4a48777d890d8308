"""``spectral-callbacks targets``: which matrices of a model are watched, as which role.

Example::

    spectral-callbacks targets ./gpt2
    spectral-callbacks targets last.ckpt --arch train_gpt:GPTModule
"""

from __future__ import annotations

import argparse

from spectral_callbacks.cli.analyze import ARCH_HELP, BASE_HELP, MODEL_HELP


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "targets",
        help="print a model's role map (layer, role, parameter, shape)",
        description="Print the matrices find_targets maps in a model: layer, role, parameter and "
        "shape, and the 2-D weights left out with the reason.",
        epilog="examples:\n  spectral-callbacks targets ./gpt2\n"
        "  spectral-callbacks targets weights.safetensors --arch hf:./bert_config",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--arch", metavar="HINT", help=ARCH_HELP)
    parser.add_argument("--base", metavar="DIR", help=BASE_HELP)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spectral_callbacks.offline.loading import load_model
    from spectral_callbacks.targets import find_targets, format_targets

    print(format_targets(find_targets(load_model(args.model, args.arch, args.base))))
    return 0
