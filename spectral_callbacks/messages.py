"""Warnings and notes from global rank 0 only: under DDP every rank would print each one.

They follow ``lightning_utilities``' rank-zero functions (what Lightning's own callbacks use),
without importing Lightning itself. Lightning sets the rank when it starts its processes; before that (a plain loop,
``torchrun``, the Hugging Face Trainer) it is read from the launcher's environment, as Lightning
reads it.

Also how a message counts things: ``count(1, "run")`` is "1 run".
"""

from __future__ import annotations

import concurrent.futures.thread
import contextlib
import importlib.util
import logging
import os
import sys
import threading
import warnings
from collections.abc import Sequence

from lightning_utilities.core.rank_zero import rank_zero_only

__all__ = ["count", "rank_zero_info", "rank_zero_warn"]

# Notes go to the "spectral_callbacks" logger at INFO. As Lightning does for its own logger, it
# gets a stderr handler when logging is not set up at all, so a plain loop sees the notes too.
_log = logging.getLogger("spectral_callbacks")
_log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _log.addHandler(logging.StreamHandler())
    _log.propagate = False


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, the noun in the plural unless the number is one (for messages).

    >>> count(1, "run"), count(3, "run"), count(1, "matrix", "matrices"), count(0, "row")
    ('1 run', '3 runs', '1 matrix', '0 rows')
    """
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def first_few(items: Sequence[object], separator: str = ", ", most: int = 6) -> str:
    """The first ``most`` of ``items`` joined by ``separator``, `` ...`` where more were left out
    (for messages that name what they are about without flooding the console).

    >>> first_few(["a", "b"]), first_few(range(8), most=3)
    ('a, b', '0, 1, 2 ...')
    """
    shown = separator.join(str(item) for item in items[:most])
    return shown + (" ..." if len(items) > most else "")


def rank_zero_warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` on global rank 0 only, located at the user's line or at none.

    The location is the innermost frame outside this package and the frameworks that call it
    (Lightning, Hugging Face, torch, the threading machinery): the user's ``trainer.fit(...)``,
    ``tracker.step(step)`` or ``find_targets(model)``. Where there is none (a background thread),
    the warning names no file, rather than the library's own source line.
    """
    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_THE_USER):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        warnings.warn_explicit(message, category, "spectral_callbacks", 0, registry={})
        return
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    where = (frame.f_code.co_filename, frame.f_lineno)
    module = frame.f_globals.get("__name__")
    try:
        warnings.warn_explicit(
            message, category, *where, module=module, registry=registry,
            module_globals=frame.f_globals,
        )  # fmt: skip
    except ImportError:
        # The caller's loader cannot give its source (``python -c``: __main__'s loader is the
        # builtin importer, whose get_source raises): the warning, without the source line.
        warnings.warn_explicit(message, category, *where, module=module, registry=registry)


def _package_dirs(*names: str) -> tuple[str, ...]:
    dirs: list[str] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(path, "") for path in spec.submodule_search_locations)
    return tuple(dirs)


# Frames that are not the user's: this package, the frameworks whose hooks call it, and the
# standard library's thread and context machinery a hook or worker runs under.
_NOT_THE_USER: tuple[str, ...] = _package_dirs(
    "spectral_callbacks",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "torch",
) + tuple(
    module.__file__
    for module in (threading, contextlib, concurrent.futures.thread)
    if module.__file__
)


@rank_zero_only
def rank_zero_info(message: str) -> None:
    """Log ``message`` at INFO on global rank 0 only."""
    _log.info(message)


def _environment_rank() -> int:
    # LOCAL_RANK before SLURM_PROCID: SLURM may set the latter without managing the processes.
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


if getattr(rank_zero_only, "rank", None) is None:
    rank_zero_only.rank = _environment_rank()  # type: ignore[attr-defined]
