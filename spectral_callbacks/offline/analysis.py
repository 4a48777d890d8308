"""Spectral metrics of a model at rest, written as the same scalars a training run logs.

``analyze_model`` computes ``spectral_metrics`` of every matrix ``find_targets`` maps in a model
(read with ``spectral_callbacks.offline.loading.load_model``); ``write_scalars`` writes them with a
TensorBoard ``SummaryWriter`` under the tags of ``spectral_callbacks.names`` at one step, plus
``spectral_monitor/num_layers``, so ``spectral-callbacks plot`` draws GPT-2 or Pythia beside a
custom run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from torch import nn

from spectral_callbacks.names import MatrixLabel
from spectral_callbacks.offline.loading import AnalysisError

# Matrices analysed together; bounds the memory of the stacked copies for large models.
BATCH_MATRICES = 8
#: The columns of ``analyze_model`` rows that say which matrix a row is; the others are metrics.
DESCRIPTION_COLUMNS = (
    "stack",
    "layer",
    "role",
    "expert",
    "num_layers",
    "parameter",
    "shape",
    "source",
)


def analyze_model(
    model: nn.Module,
    *,
    progress: Callable[[int], None] | None = None,
    example_input: Any = None,
    **options: Any,
) -> tuple[pd.DataFrame, int]:
    """``spectral_metrics`` of every matrix ``find_targets`` maps in ``model``.

    Matrices are grouped by shape as a training snapshot groups them (``group_by_shape``) and
    analysed in batches of at most ``BATCH_MATRICES``, which bounds the memory of the stacks.

    Args:
        model: the network.
        progress: called with the number of matrices done after each batch (default None).
        example_input: a batch for one forward, from which the roles are read
            (``find_targets(example_input=)``); default ``None``: the name rules alone.
        **options: passed to ``spectral_metrics`` (e.g. the SVD method).

    Returns:
        Rows ``stack, layer, role, expert, num_layers, parameter, shape, source, <metric>...`` in
        target order (``source``: where the role came from, ``names`` or ``data flow``) (``num_layers``: of the row's stack; ``expert``: ``None`` outside experts), and the
        number of layers L of the model's deepest stack.
    """
    import torch

    from spectral_callbacks.functional import spectral_metrics, update_metrics
    from spectral_callbacks.functional.batch import MeasuredBatch
    from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    from spectral_callbacks.targets import find_targets

    targets = find_targets(model, example_input=example_input)
    results: dict[str, dict[str, float]] = {}
    for group in group_by_shape(targets):
        for start in range(0, len(group.targets), BATCH_MATRICES):
            chunk = dataclasses.replace(
                group, targets=group.targets[start : start + BATCH_MATRICES]
            )
            snapshot = take_snapshot([chunk], step=0)
            batch = snapshot.tensors[chunk.key].float()
            if isinstance(batch, MeasuredBatch):  # exact from its own structure (no SVD)
                metrics = batch.exact_metrics()
            else:
                metrics = spectral_metrics(batch, **options)  # (B,) each
            # An adapted layer (targets/adapted.py) also carries its update: exact from factors.
            if not isinstance(batch, torch.Tensor | MeasuredBatch):
                metrics.update(update_metrics(*batch.update_spectrum()))
            for position, name in enumerate(chunk.names):
                results[name] = {
                    metric: float(value[position]) for metric, value in metrics.items()
                }
            if progress is not None:
                progress(len(chunk.targets))
    rows = pd.DataFrame(
        [
            {
                "stack": t.stack,
                "layer": t.layer,
                "role": t.role,
                "expert": t.expert,
                "num_layers": t.num_layers,
                "parameter": t.name,
                "shape": "x".join(map(str, t.shape)),
                "source": targets.sources.get(t.name, "names"),
                **results[t.name],
            }
            for t in targets
        ]
    )
    return rows, max(t.num_layers for t in targets)


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

    The scalars are built by the training run's ``Reporter`` - one per (metric, layer, role),
    the mean over the finite layers per (metric, role), a layer's experts as their mean, min and
    max (and their histogram) - and written as one event like a snapshot's, with
    ``spectral_monitor/num_layers`` (one per stack where there are several: relative depth is
    within a stack), so the names and means are the same by construction. ``num_layers`` is
    used for rows without a ``num_layers`` column of their own. A value that is not finite is not written: at rest each tag holds one point, so
    a NaN (``energy_rank_90`` beyond the top k, a matrix with NaN entries) would be a chart with
    nothing on it; the caller counts what was left out.

    Returns:
        The tags written.

    Raises:
        AnalysisError: ``logdir`` is a file or cannot be created.
    """
    from spectral_callbacks import tensorboard_adapter as tb
    from spectral_callbacks.monitor.reporting import Reporter

    metrics = [c for c in rows.columns if c not in DESCRIPTION_COLUMNS]
    check_logdir(logdir)
    targets = []
    for row in rows.itertuples(index=False):
        layers = int(getattr(row, "num_layers", num_layers))
        expert: Any = getattr(row, "expert", None)
        targets.append(
            MatrixLabel(
                name=row.parameter,
                stack=str(getattr(row, "stack", "")),
                layer=int(row.layer),
                role=str(row.role),
                expert=None if pd.isna(expert) else int(expert),
                num_layers=layers,
            )
        )
    values = {row["parameter"]: {m: float(row[m]) for m in metrics} for _, row in rows.iterrows()}
    reporter = Reporter(targets, metrics)
    scalars = reporter.scalars(step, values)
    finite = {tag: value for tag, value in scalars.items() if math.isfinite(value)}
    num_layers_scalars = reporter.num_layers_scalars()
    writer = tb.LogdirWriter(str(logdir))
    try:
        tb.log_scalars([writer], num_layers_scalars, step)
        tb.log_scalars([writer], finite, step)
        tb.add_histograms([writer.experiment], reporter.expert_values(values), step)
    except OSError as error:
        raise AnalysisError(
            f"{logdir}: cannot create the log directory ({error.strerror or error}); give a "
            "writable directory",
            argument="logdir",
        ) from error
    finally:
        writer.finalize()
    return [*num_layers_scalars, *finite]
