"""Warnings and notes from global rank 0 only: under DDP every rank would print each one.

The functions are ``lightning_utilities``' (what Lightning's own callbacks use), without importing
Lightning itself. Lightning sets the rank when it starts its processes; before that (a plain loop,
``torchrun``, the Hugging Face Trainer) it is read from the launcher's environment, as Lightning
reads it.
"""

from __future__ import annotations

import os

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["rank_zero_info", "rank_zero_warn"]


def _environment_rank() -> int:
    # LOCAL_RANK before SLURM_PROCID: SLURM may set the latter without managing the processes.
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


if getattr(rank_zero_only, "rank", None) is None:
    rank_zero_only.rank = _environment_rank()  # type: ignore[attr-defined]
