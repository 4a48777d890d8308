"""``--smoke``: each benchmark's run at toy sizes, seconds long.

Every script in this folder takes ``--smoke`` and the test suite runs each one so (tests/benchmarks/
test_every_benchmark_runs.py): a script left behind by a rename fails a test instead of failing the
next person who runs it. Nothing is timed there; speed is read from the full-size tables.

The toy sizes are the parser's defaults under ``--smoke``, so an argument given beside it still wins:
``--smoke --layers 4``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, **toy: Any
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with a ``--smoke`` flag whose defaults are ``toy``."""
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes, seconds long (what the test suite runs)"
    )
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        parser.set_defaults(**toy)
    return parser.parse_args(argv)
