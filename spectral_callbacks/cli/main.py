"""Entry point of ``spectral-callbacks``: one sub-command per module of this package.

``export`` turns logged curves into tidy rows, ``plot`` draws the standard charts, ``analyze``
writes the same scalars for a model at rest, ``rank-layers`` ranks layers by ESD α and allocates
AlphaPruning's sparsity, and ``targets`` prints a model's role map. Heavy
imports (torch, transformers, matplotlib) happen inside the commands so ``--help`` is quick.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from spectral_callbacks import __version__
from spectral_callbacks.cli import analyze, export, plot, rank_layers, targets
from spectral_callbacks.cli.common import PROG, expected_errors, one_line, say


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spectral-callbacks`` with every sub-command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Export, plot and analyze the spectra of transformer weight matrices.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (export, plot, analyze, rank_layers, targets):
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; the exit status (0 ok, 1 an error reported on stderr, 2 bad usage).

    This is the one place where errors become one-line messages: the commands and the library
    raise (CommandError, the library's own errors with the argument at fault, OSError for a path),
    and only errors of the user's input are reported so; anything else is a bug and keeps its
    traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        with warnings.catch_warnings():
            # A warning of the library is a line like the errors', not a file, line and source
            # line of the library's own code (which a shell user did not write).
            warnings.showwarning = lambda message, category, *rest: say(  # type: ignore[assignment]
                args.command, "warning", one_line(message)
            )
            return int(args.func(args))
    except BrokenPipeError:
        # The reader of stdout stopped early (`export -o - | head`): not an error of ours. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as error:
        if not isinstance(error, expected_errors()):
            raise
        say(args.command, "error", one_line(error))
        return 1


if __name__ == "__main__":
    sys.exit(main())
