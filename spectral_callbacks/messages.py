"""Warnings and notes from global rank 0 only: under DDP every rank would print each one.

The functions are ``lightning_utilities``' (what Lightning's own callbacks use), without importing
Lightning itself. Lightning sets the rank when it starts its processes; before that (a plain loop,
``torchrun``, the Hugging Face Trainer) it is read from the launcher's environment, as Lightning
reads it.
"""

from __future__ import annotations

import logging
import os

from lightning_utilities.core.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_warn as _rank_zero_warn

__all__ = ["rank_zero_info", "rank_zero_warn"]

# Notes go to the "spectral_callbacks" logger at INFO. As Lightning does for its own logger, it
# gets a stderr handler when logging is not set up at all, so a plain loop sees the notes too.
_log = logging.getLogger("spectral_callbacks")
_log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():
    _log.addHandler(logging.StreamHandler())
    _log.propagate = False


def rank_zero_warn(
    message: str, category: type[Warning] = UserWarning, stacklevel: int = 1
) -> None:
    """``warnings.warn`` on global rank 0 only; ``stacklevel`` counts as ``warnings.warn``'s does.

    lightning_utilities' function adds three frames of its own (and this one a fourth): they are
    added here once, so a caller writes the stacklevel it would give ``warnings.warn``.
    """
    _rank_zero_warn(message, category=category, stacklevel=stacklevel + 4)


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
