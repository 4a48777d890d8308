"""What the sub-commands share: one-line errors, reading runs with their problems, step ranges."""

from __future__ import annotations

import argparse
import sys

from spectral_callbacks.offline.events import ReadResult, read_runs

PROG = "spectral-callbacks"


class CommandError(Exception):
    """A user error a sub-command reports as one line on stderr, exiting with status 1."""


#: The option of each library argument an error may be about (``AnalysisError.argument``).
OPTIONS = {"arch": "--arch HINT", "logdir": "--logdir DIR", "base": "--base DIR"}


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that come from the user's input, reported as one line; anything else is a bug.

    Imported when an error happens: the modules that raise them are loaded by then, and
    ``--help`` stays quick.
    """
    from spectral_callbacks.offline.loading import AnalysisError
    from spectral_callbacks.offline.ranking import RankingError
    from spectral_callbacks.targets import TargetError

    return (CommandError, AnalysisError, RankingError, TargetError, OSError)


def one_line(error: BaseException) -> str:
    """The message of an expected error on one line, with the option to change where it has one.

    >>> one_line(FileNotFoundError(2, "No such file or directory", "runs/x.csv"))
    'runs/x.csv: No such file or directory; check the path'
    """
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}; check the path"
    message = " ".join(str(error).split()) or type(error).__name__
    option = OPTIONS.get(getattr(error, "argument", None) or "")
    return f"{message} (set with {option})" if option else message


def say(command: str, kind: str, message: str) -> None:
    """Print one ``spectral-callbacks <command>: <kind>: <message>`` line on stderr."""
    print(f"{PROG} {command}: {kind}: {message}", file=sys.stderr)


def read(command: str, logdirs: list[str], *, all_scalars: bool) -> ReadResult:
    """Read runs for ``command``, printing notes; problems are left to the caller to report."""
    result = read_runs(logdirs, all_scalars=all_scalars, progress=sys.stderr.isatty())
    for note in result.notes:
        say(command, "note", note)
    return result


def report_problems(command: str, result: ReadResult, outcome: str) -> int:
    """One error line per problem, the last one saying what was still done; the exit status."""
    for index, problem in enumerate(result.problems):
        last = index == len(result.problems) - 1
        say(command, "error", f"{problem}{' — ' + outcome if last else ''}")
    return 1 if result.problems else 0


def read_whole(command: str, source: str, outcome: str) -> ReadResult:
    """Read the run(s) of ``source`` for a command that needs every point: a problem (a damaged
    event file, no spectral scalars) is an error, in the words ``export`` and ``plot`` use.

    Every problem but the last is printed as an error line; the last is raised as a
    :class:`CommandError` that ends with ``outcome`` (what the command did not do). The notes
    (a depth without ``num_layers``) are left out: these commands read no depth.
    """
    result = read_runs([source], progress=sys.stderr.isatty())
    if result.problems:
        *first, last = result.problems
        for problem in first:
            say(command, "error", str(problem))
        raise CommandError(f"{last} — {outcome}")
    return result


def step_range(text: str) -> tuple[int | None, int | None]:
    """Parse ``A:B`` (inclusive, either end may be empty) for ``--steps``.

    >>> step_range("100:"), step_range(":50"), step_range("10:20")
    ((100, None), (None, 50), (10, 20))
    """
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (int(first) if first else None, int(last) if last else None)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be FIRST:LAST with integer steps, either end may be empty (e.g. 0:1000), got {text!r}"
        ) from None
    if None not in bounds and bounds[0] > bounds[1]:  # type: ignore[operator]
        raise argparse.ArgumentTypeError(f"FIRST must not exceed LAST, got {text!r}")
    return bounds


def layer_choice(text: str) -> int | None:
    """A layer index for ``--layer``, or ``mean`` for the mean over layers (None).

    >>> layer_choice("3"), layer_choice("mean")
    (3, None)
    """
    if text == "mean":
        return None
    try:
        layer = int(text)
    except ValueError:
        layer = -1
    if layer < 0:
        raise argparse.ArgumentTypeError(f"must be a layer index >= 0 or 'mean', got {text!r}")
    return layer


def smoothing_weight(text: str) -> float:
    """An EMA weight in [0, 1) for ``--smoothing``.

    >>> smoothing_weight("0.9")
    0.9
    """
    try:
        weight = float(text)
    except ValueError:
        weight = -1.0
    if not 0.0 <= weight < 1.0:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1) (0: no smoothing, 0.9: TensorBoard's strong), got {text!r}"
        )
    return weight


def add_logdirs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "logdir",
        nargs="+",
        metavar="LOGDIR",
        help="a run directory (holding events.out.tfevents.* files), a parent of several runs, "
        "or an event file; the run name is the path relative to it",
    )
