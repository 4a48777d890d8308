"""Spectral metrics of a model at rest, written as the same scalars a training run logs.

``analyze_model`` computes ``spectral_metrics`` of every matrix ``find_targets`` maps in a model
(read with ``spectral_callbacks.offline.loading.load_model``); ``write_scalars`` writes them with a
TensorBoard ``SummaryWriter`` under the tags of ``spectral_callbacks.names`` at one step, plus
``spectral_monitor/num_layers``, so ``spectral-callbacks plot`` draws GPT-2 or Pythia beside a
custom run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from spectral_callbacks.names import NUM_LAYERS_TAG, scalar_tag
from spectral_callbacks.offline.loading import AnalysisError

# Matrices analysed together; bounds the memory of the stacked copies for large models.
BATCH_MATRICES = 8


def analyze_model(
    model: nn.Module,
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[pd.DataFrame, int]:
    """``spectral_metrics`` of every matrix ``find_targets`` maps in ``model``.

    Matrices of one shape are stacked and analysed in batches of ``BATCH_MATRICES``.

    Args:
        model: the network.
        progress: called with the number of matrices done after each batch (default None).
        **options: passed to ``spectral_metrics`` (e.g. the SVD method).

    Returns:
        Rows ``layer, role, parameter, shape, <metric>...`` in target order, and the number of
        layers L of the model.
    """
    from spectral_callbacks.functional import spectral_metrics
    from spectral_callbacks.targets import find_targets

    targets = find_targets(model)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for index, target in enumerate(targets):
        by_shape.setdefault(tuple(target.shape), []).append(index)
    results: list[dict[str, float]] = [{} for _ in targets]
    with torch.no_grad():
        for indices in by_shape.values():
            for start in range(0, len(indices), BATCH_MATRICES):
                batch = indices[start : start + BATCH_MATRICES]
                stacked = torch.stack([targets[i].matrix().float() for i in batch])  # (B, m, n)
                metrics = spectral_metrics(stacked, **options)
                for position, i in enumerate(batch):
                    results[i] = {name: float(value[position]) for name, value in metrics.items()}
                if progress is not None:
                    progress(len(batch))
    rows = pd.DataFrame(
        [
            {
                "layer": t.layer,
                "role": t.role,
                "parameter": t.name,
                "shape": "x".join(map(str, t.shape)),
                **results[i],
            }
            for i, t in enumerate(targets)
        ]
    )
    return rows, targets[0].num_layers


def check_logdir(logdir: str | Path) -> None:
    """An AnalysisError (``argument == "logdir"``) if ``logdir`` exists and is not a directory."""
    if Path(logdir).exists() and not Path(logdir).is_dir():
        raise AnalysisError(
            f"{logdir}: is a file, not a directory; give a directory to write the event file to",
            argument="logdir",
        )


def write_scalars(
    rows: pd.DataFrame, num_layers: int, logdir: str | Path, step: int = 0
) -> list[str]:
    """Write ``analyze_model`` rows to ``logdir`` as the callback's scalars at ``step``.

    One scalar per (metric, layer, role), the mean over the finite layers per (metric, role), and
    ``spectral_monitor/num_layers``. A value that is not finite is not written: at rest each tag
    holds one point, so a NaN (``energy_rank_90`` beyond the top k, a matrix with NaN entries)
    would be a chart with nothing on it; the caller counts what was left out.

    Returns:
        The tags written.

    Raises:
        AnalysisError: ``logdir`` is a file or cannot be created.
    """
    from torch.utils.tensorboard import SummaryWriter

    metrics = [c for c in rows.columns if c not in ("layer", "role", "parameter", "shape")]
    tags = []
    check_logdir(logdir)
    try:
        writer = SummaryWriter(str(logdir))
    except OSError as error:
        raise AnalysisError(
            f"{logdir}: cannot create the log directory ({error.strerror or error}); give a "
            "writable directory",
            argument="logdir",
        ) from error
    with writer:
        writer.add_scalar(NUM_LAYERS_TAG, num_layers, step)
        tags.append(NUM_LAYERS_TAG)
        for metric in metrics:
            finite = rows[np.isfinite(rows[metric].astype(float))]
            for row in finite.itertuples(index=False):
                tag = scalar_tag(metric, int(row.layer), str(row.role), num_layers)
                writer.add_scalar(tag, float(getattr(row, metric)), step)
                tags.append(tag)
            for role, values in finite.groupby("role", sort=False)[metric]:
                tag = scalar_tag(metric, None, str(role))
                writer.add_scalar(tag, float(values.mean()), step)
                tags.append(tag)
    return tags
