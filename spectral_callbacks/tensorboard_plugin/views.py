"""The JSON of each chart of the SPECTRAL tab, computed from tidy rows.

Each function takes the rows ``spectral-callbacks export --all-scalars`` gives (columns ``run,
step, metric, layer, depth, role, value, wall_time``) and returns plain lists and dicts, values
as float or ``None`` for NaN (JSON has no NaN). Lines are downsampled with
:func:`~spectral_callbacks.tensorboard_plugin.downsample.keep_extremes`; with ``max_points`` at
least the series' length every row is returned as exported. Charts that the command line also
draws reuse its definitions (``spectral_callbacks.charts``): compression computed from
``stable_rank`` when not logged, the last write at a step, metric-diff's alignment.

Example::

    >>> import pandas as pd
    >>> rows = pd.DataFrame({"run": ["a"] * 3, "step": [0, 10, 20], "metric": ["alpha"] * 3,
    ...     "layer": [0, 0, 0], "depth": [0.0] * 3, "role": ["Q"] * 3, "value": [0.1, 0.3, 0.2],
    ...     "wall_time": [0.0, 1.0, 2.0]})
    >>> curves_by_role(rows, ["a"], "alpha", layer=0, max_points=1000)
    [{'run': 'a', 'role': 'Q', 'steps': [0, 10, 20], 'values': [0.1, 0.3, 0.2]}]
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from spectral_callbacks.charts import (
    _final,
    _ordered_roles,
    compression_rows,
    layer_step_grid,
    role_color,
)
from spectral_callbacks.names import parse_tag
from spectral_callbacks.offline.differences import diff_curves
from spectral_callbacks.tensorboard_plugin.downsample import keep_extremes


def _floats(values: Iterable[float]) -> list[float | None]:
    """Python floats, ``None`` for NaN (converted by numpy, not one number at a time)."""
    values = np.asarray(values, dtype=float)
    nan = np.isnan(values)
    if not nan.any():
        return values.tolist()
    with_none = values.astype(object)
    with_none[nan] = None
    return with_none.tolist()


def _line(steps: np.ndarray, values: np.ndarray, max_points: int) -> dict[str, list]:
    keep = keep_extremes(values, max_points)
    return {"steps": steps[keep].tolist(), "values": _floats(values[keep])}


def _metric_rows(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per-layer rows of ``metric``; ``compression`` is computed from ``stable_rank`` when not logged."""
    if metric == "compression":
        try:
            return compression_rows(rows)[0]
        except ValueError:
            return rows.iloc[0:0]
    return rows[(rows["metric"] == metric) & rows["layer"].notna()]


def catalog(index: Mapping[str, Iterable[str]]) -> list[dict]:
    """What each run logged, from its tags: spectral metrics, roles, layers and other scalars.

    Each role comes with its colour (:func:`~spectral_callbacks.charts.role_color`, the CLI's), so
    a role has the same colour whichever runs are ticked.

    >>> entry = catalog({"a": ["spectral_alpha/L01/Q", "spectral_alpha/mean/Q", "train/loss"]})
    >>> entry
    [{'run': 'a', 'metrics': ['alpha'], 'roles': ['Q'], 'layers': [1], 'scalars': ['train/loss'], \
'role_colors': {'Q': '#1f77b4'}}]
    """
    runs = []
    for run, tags in index.items():
        parsed = [(tag, parse_tag(tag)) for tag in tags]
        spectral = [p for _, p in parsed if p is not None]
        if not spectral:
            continue
        runs.append(
            {
                "run": run,
                "metrics": sorted({p.metric for p in spectral}),
                "roles": _ordered_roles([p.role for p in spectral]),
                "layers": sorted({p.layer for p in spectral if p.layer is not None}),
                "scalars": sorted(tag for tag, p in parsed if p is None),
                "role_colors": {p.role: role_color(p.role) for p in spectral},
            }
        )
    return sorted(runs, key=lambda entry: entry["run"])


def compression_wave(
    rows: pd.DataFrame, run: str, metric: str, role: str, max_columns: int
) -> dict:
    """Heatmap of ``metric`` of ``role`` over layer x step for one run.

    Column ``j`` is the value logged at ``steps[j]`` (the last write there); with more steps than
    ``max_columns`` the columns are the first step and the last step of each of ``max_columns - 1``
    buckets, and ``low`` / ``high`` give the minimum and maximum over the steps a column stands for
    (after the previous column, up to its own), so no extreme is hidden.
    """
    chosen = _metric_rows(rows, metric)
    chosen = chosen[(chosen["run"] == run) & (chosen["role"] == role)]
    if chosen.empty:
        return {"run": run, "metric": metric, "role": role, "layers": [], "steps": [], "values": []}
    grid = layer_step_grid(chosen).sort_index()
    values = grid.to_numpy(dtype=float)
    steps = grid.columns.to_numpy()
    count = len(steps)
    if count > max_columns:
        ends = np.linspace(0, count - 1, max_columns).round().astype(int)
        columns = np.unique(np.concatenate([[0], ends]))
    else:
        columns = np.arange(count)
    starts = np.concatenate([[0], columns[:-1] + 1])
    with warnings.catch_warnings():  # an all-NaN bucket (e.g. energy_rank_90 never reached)
        warnings.simplefilter("ignore", RuntimeWarning)  # is a NaN cell, not news
        spans = [values[:, a : b + 1] for a, b in zip(starts, columns, strict=True)]
        low = np.stack([np.nanmin(span, axis=1) for span in spans], axis=1)
        high = np.stack([np.nanmax(span, axis=1) for span in spans], axis=1)
    return {
        "run": run,
        "metric": metric,
        "role": role,
        "layers": grid.index.astype(int).tolist(),
        "steps": steps[columns].astype(int).tolist(),
        "values": [_floats(line) for line in values[:, columns]],
        "low": [_floats(line) for line in low],
        "high": [_floats(line) for line in high],
    }


def curves_by_role(
    rows: pd.DataFrame, runs: Sequence[str], metric: str, layer: int, max_points: int
) -> list[dict]:
    """``metric`` of one layer vs step: one series per (run, role), roles in chart order."""
    chosen = _metric_rows(rows, metric)
    chosen = chosen[chosen["layer"] == layer].sort_values("step", kind="stable")
    series = []
    for run in runs:
        lines = {role: line for role, line in chosen[chosen["run"] == run].groupby("role")}
        for role in _ordered_roles(list(lines)):
            line = lines[role]
            points = _line(line["step"].to_numpy(), line["value"].to_numpy(float), max_points)
            series.append({"run": run, "role": role, **points})
    return series


def curves_by_layer(
    rows: pd.DataFrame, runs: Sequence[str], metric: str, role: str, max_points: int
) -> list[dict]:
    """``metric`` of one role vs step: one series per (run, layer), with the layer's depth."""
    chosen = _metric_rows(rows, metric)
    chosen = chosen[chosen["role"] == role].sort_values("step", kind="stable")
    series = []
    for run in runs:
        for layer, line in chosen[chosen["run"] == run].groupby("layer", sort=True):
            points = _line(line["step"].to_numpy(), line["value"].to_numpy(float), max_points)
            depth = float(line["depth"].iloc[0])
            series.append({"run": run, "layer": int(layer), "depth": depth, **points})
    return series


def _at_step(chosen: pd.DataFrame, step: int | None, keys: list[str]) -> pd.DataFrame:
    """Per ``keys``, the last write at the latest step <= ``step`` (None: the last step)."""
    if step is not None:
        chosen = chosen[chosen["step"] <= step]
    return _final(chosen, keys) if not chosen.empty else chosen


def depth_profile(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    role: str,
    step: int | None,
    steps: Iterable[int] | None = None,
) -> dict:
    """``metric`` of ``role`` vs relative depth at ``step`` (default: each run's last), per run.

    ``steps`` (default: those of ``rows``) lists the logged steps, for the slider; each point
    carries the step it comes from.
    """
    chosen = _metric_rows(rows, metric)
    chosen = chosen[(chosen["role"] == role) & chosen["run"].isin(runs)]
    profiles = []
    for run in runs:
        at = _at_step(chosen[chosen["run"] == run], step, ["layer"])
        at = at.sort_values("layer") if not at.empty else at
        profiles.append(
            {
                "run": run,
                "layers": at["layer"].astype(int).tolist() if not at.empty else [],
                "depths": _floats(at["depth"]) if not at.empty else [],
                "values": _floats(at["value"]) if not at.empty else [],
                "steps": at["step"].astype(int).tolist() if not at.empty else [],
            }
        )
    steps = chosen["step"].unique() if steps is None else steps
    return {
        "metric": metric,
        "role": role,
        "step": step,
        "steps": sorted(int(s) for s in set(steps)),
        "runs": profiles,
    }


def bars_by_layer(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    step: int | None,
    steps: Iterable[int] | None = None,
) -> dict:
    """``metric`` by layer x role at ``step`` (None: each run's last), a panel per run.

    ``steps`` (default: those of ``rows``) lists the logged steps, for the slider.
    """
    chosen = _metric_rows(rows, metric)
    chosen = chosen[chosen["run"].isin(runs)]
    panels: list[dict[str, object]] = []
    for run in runs:
        at = _at_step(chosen[chosen["run"] == run], step, ["layer", "role"])
        if at.empty:
            panels.append({"run": run, "layers": [], "roles": [], "values": {}})
            continue
        layers = sorted(int(layer) for layer in at["layer"].unique())
        roles = _ordered_roles(at["role"].unique())
        table = at.pivot(index="layer", columns="role", values="value").reindex(layers)
        panels.append(
            {
                "run": run,
                "layers": layers,
                "roles": roles,
                "values": {role: _floats(table[role].to_numpy(float)) for role in roles},
                "step": int(at["step"].max()),
            }
        )
    steps = chosen["step"].unique() if steps is None else steps
    return {
        "metric": metric,
        "step": step,
        "steps": sorted(int(s) for s in set(steps)),
        "runs": panels,
    }


def difference(
    rows: pd.DataFrame,
    metric: str,
    baseline: str,
    *,
    x: str,
    layer: int | None,
    role: str | None,
    max_points: int,
) -> list[dict]:
    """Each run's ``metric`` minus ``baseline``'s vs ``x``, aligned as ``plot --kind metric-diff``.

    Raises:
        ValueError: as :func:`spectral_callbacks.offline.differences.diff_curves`.
    """
    curves = diff_curves(rows, metric, baseline, x=x, layer=layer, role=role).curves
    series = []
    for run, diff in curves.items():
        keep = keep_extremes(diff.to_numpy(float), max_points)
        xs = diff.index.to_numpy(float)[keep]
        series.append({"run": run, "x": xs.tolist(), "values": _floats(diff.to_numpy(float)[keep])})
    return series
