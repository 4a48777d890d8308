"""The JSON of each chart of the SPECTRAL tab, computed from tidy rows.

Each function takes the rows ``spectral-callbacks export --all-scalars`` gives (columns ``run,
step, metric, stack, layer, depth, role, expert, value, wall_time``) and returns plain lists and
dicts, values as float or ``None`` for NaN (JSON has no NaN).

Stacks (encoder and decoder, text and vision towers) stay apart: a view of one layer or one
role is of one ``stack``, which a model with one stack (``""``) is in whatever the stack asked,
so a decoder-only run is drawn beside either stack of an encoder-decoder; the depth profile draws
one curve per (run, stack). A role of a mixture-of-experts layer, logged as its mean, min and max
over the layer's experts, is drawn as the mean with ``low``/``high`` (the min and max) beside it,
and so is a circuit metric of a layer's attention heads (role ``heads``; ``over`` says which of
the two a spread spans). Lines are downsampled with
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
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from spectral_callbacks.chart_data import (
    compression_rows,
    head_grid,
    last_writes,
    layer_step_grid,
    one_per_layer,
    ordered_roles,
    role_color,
    spread_over,
)
from spectral_callbacks.monitor.alerts import ALERT_KINDS, alert_rows
from spectral_callbacks.names import (
    ALERT_SECTION,
    alert_tag,
    is_heads_role,
    ordered_stacks,
    parse_tag,
)
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


# The line style of a stack where colour says the run (the depth profile), fixed by its name as
# a role's colour is: the first stack of each kind of model solid, its partner dashed.
STACK_DASHES = {"": "", "enc": "", "dec": "7 3", "text": "", "vision": "7 3", "audio": "2 3"}
_SPARE_DASHES = ("2 3", "9 3 2 3", "4 2", "1 2")


def stack_dash(stack: str) -> str:
    """The SVG dash pattern of ``stack`` in every view, whichever stacks a chart holds.

    >>> stack_dash("enc"), stack_dash("dec"), stack_dash("tower_b") == stack_dash("tower_b")
    ('', '7 3', True)
    """
    if stack in STACK_DASHES:
        return STACK_DASHES[stack]
    return _SPARE_DASHES[zlib.crc32(stack.encode()) % len(_SPARE_DASHES)]


def _ordered_stacks(stacks: Iterable[str]) -> list[str]:
    """The named stacks among ``stacks`` (not ``""``, the one stack of most models), in order."""
    return [stack for stack in ordered_stacks(stacks) if stack]


def _metric_rows(rows: pd.DataFrame, metric: str) -> tuple[pd.DataFrame, dict[str, str]]:
    """Per-layer rows of ``metric``, a layer's experts as one row with ``low``/``high`` (as the
    command line draws them: ``chart_data.one_per_layer``), and the runs left out with the reason;
    ``compression`` is computed from ``stable_rank`` when not logged (a run of one snapshot, an
    analyzed model, has nothing to compress against: left out, as the command line leaves it
    out)."""
    rows = rows.assign(stack=rows["stack"].fillna("")) if "stack" in rows else rows.assign(stack="")
    left_out: dict[str, str] = {}
    if metric == "compression":
        chosen, left_out = compression_rows(rows, allow_none=True)
    else:
        chosen = rows[(rows["metric"] == metric) & rows["layer"].notna()]
    return one_per_layer(chosen), left_out


def _in_stack(rows: pd.DataFrame, stack: str) -> pd.DataFrame:
    """Rows of ``stack``, and every row of a run with one stack (``""``): a decoder-only model is
    compared with either stack of an encoder-decoder."""
    named = set(rows.loc[rows["stack"] != "", "run"])
    return rows[(rows["stack"] == stack) | ~rows["run"].isin(named)]


def _spread(line: pd.DataFrame, keep: np.ndarray | slice = slice(None)) -> dict[str, Any]:
    """``low``/``high`` of a line of a layer's experts or heads, and ``over``: which of the two
    (``chart_data.spread_over``); nothing for a plain matrix's."""
    low, high = line["low"].to_numpy(float), line["high"].to_numpy(float)
    if np.isnan(low).all() and np.isnan(high).all():
        return {}
    over = spread_over(str(line["role"].iloc[0]))
    return {"low": _floats(low[keep]), "high": _floats(high[keep]), "over": over}


def role_order(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every role of the ``catalog`` runs in the one order of the command line's charts and
    tables, which every view's legend follows.

    >>> role_order([{"roles": ["Q", "MLP_up"]}, {"roles": ["Q", "Q_cross", "MLP_gate"]}])
    ['Q', 'Q_cross', 'MLP_gate', 'MLP_up']
    """
    return ordered_roles([role for run in runs for role in run["roles"]])


def catalog(index: Mapping[str, Iterable[str]]) -> list[dict]:
    """What each run logged, from its tags: spectral metrics, roles, layers, stacks (with the
    layers of each: ``""`` for a model with one stack), the roles logged over experts, the roles
    and metrics logged per attention head (``circuits=True``), the kinds of alert it counts,
    and other scalars.

    Each role comes with its colour (:func:`~spectral_callbacks.chart_data.role_color`, the CLI's) and
    each stack with its line style (:func:`stack_dash`), so neither depends on the runs ticked.

    >>> entry = catalog({"a": ["spectral_alpha/L01/Q", "spectral_alpha/mean/Q", "train/loss"]})
    >>> entry[0]["roles"], entry[0]["layers"], entry[0]["stacks"], entry[0]["stack_layers"]
    (['Q'], [1], [], {'': [1]})
    >>> entry[0]["scalars"], entry[0]["role_colors"]
    (['train/loss'], {'Q': '#1f77b4'})
    >>> moe = catalog({"m": ["spectral_alpha/dec/L00/MLP_up/max", "spectral_alpha/enc/L02/Q"]})[0]
    >>> moe["roles"], moe["expert_roles"], moe["stacks"], moe["stack_layers"]
    (['Q', 'MLP_up'], ['MLP_up'], ['enc', 'dec'], {'enc': [2], 'dec': [0]})
    >>> heads = catalog({"h": ["spectral_qk_spectral_norm/L00/H01/heads",
    ...                        "spectral_qk_spectral_norm/L00/heads/max"]})[0]
    >>> heads["expert_roles"], heads["head_roles"], heads["head_metrics"]
    ([], ['heads'], ['qk_spectral_norm'])
    """
    runs = []
    for run, tags in index.items():
        parsed = [(tag, parse_tag(tag)) for tag in tags]
        spectral = [p for _, p in parsed if p is not None]
        if not spectral:
            continue
        per_layer = [(p.stack, p.layer) for p in spectral if p.layer is not None]
        stacks = _ordered_stacks(p.stack for p in spectral)
        roles = ordered_roles([p.role for p in spectral])
        scalars = sorted(tag for tag, p in parsed if p is None)
        runs.append(
            {
                "run": run,
                "metrics": sorted({p.metric for p in spectral}),
                "roles": roles,
                "layers": sorted({layer for _, layer in per_layer}),
                "stacks": stacks,
                "stack_layers": {
                    stack: sorted({layer for of, layer in per_layer if of == stack})
                    for stack in stacks or [""]
                },
                "expert_roles": ordered_roles(
                    [p.role for p in spectral if p.aggregate and not is_heads_role(p.role)]
                ),
                "head_roles": ordered_roles([p.role for p in spectral if is_heads_role(p.role)]),
                "head_metrics": sorted({p.metric for p in spectral if p.head is not None}),
                "alert_kinds": [k for k in ALERT_KINDS if alert_tag(k) in scalars],
                "scalars": scalars,
                "role_colors": {role: role_color(role) for role in roles},
                "stack_dashes": {stack: stack_dash(stack) for stack in stacks},
            }
        )
    return sorted(runs, key=lambda entry: entry["run"])


def compression_wave(
    rows: pd.DataFrame, run: str, metric: str, role: str, max_columns: int, stack: str = ""
) -> dict:
    """Heatmap of ``metric`` of ``role`` over layer x step for one run (and ``stack``).

    Column ``j`` is the value logged at ``steps[j]`` (the last write there; an experts' role: the
    mean over the experts); with more steps than ``max_columns`` the columns are the first step
    and the last step of each of ``max_columns - 1`` buckets, and ``low`` / ``high`` give the
    minimum and maximum over the steps a column stands for (after the previous column, up to its
    own), so no extreme is hidden. A run left out (compression of one snapshot) says why in
    ``left_out``.
    """
    chosen, left_out = _metric_rows(rows, metric)
    chosen = _in_stack(chosen[(chosen["run"] == run) & (chosen["role"] == role)], stack)
    if chosen.empty:
        return {
            "run": run,
            "stack": stack,
            "metric": metric,
            "role": role,
            "layers": [],
            "steps": [],
            "values": [],
            "left_out": left_out.get(run),
        }
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
        "stack": stack,
        "metric": metric,
        "role": role,
        "layers": grid.index.astype(int).tolist(),
        "steps": steps[columns].astype(int).tolist(),
        "values": [_floats(line) for line in values[:, columns]],
        "low": [_floats(line) for line in low],
        "high": [_floats(line) for line in high],
    }


def curves_by_role(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    layer: int,
    max_points: int,
    stack: str = "",
) -> list[dict]:
    """``metric`` of one layer (of ``stack``) vs step: one series per (run, role), roles in chart
    order; an experts' role with ``low``/``high``, its min and max over the experts."""
    chosen = _metric_rows(rows, metric)[0]
    chosen = _in_stack(chosen[chosen["layer"] == layer], stack).sort_values("step", kind="stable")
    series = []
    for run in runs:
        lines = {role: line for role, line in chosen[chosen["run"] == run].groupby("role")}
        for role in ordered_roles(list(lines)):
            series.append({"run": run, "role": role, **_points(lines[role], max_points)})
    return series


def _points(line: pd.DataFrame, max_points: int) -> dict[str, list]:
    """A line's steps and values, downsampled, with its spread over experts or heads if it has
    one."""
    keep, points = _downsampled(line, max_points)
    return {**points, **_spread(line, keep)}


def _downsampled(line: pd.DataFrame, max_points: int) -> tuple[np.ndarray, dict[str, list]]:
    """Which points of a line are kept (``keep_extremes``), and their steps and values."""
    values = line["value"].to_numpy(float)
    keep = keep_extremes(values, max_points)
    return keep, {"steps": line["step"].to_numpy()[keep].tolist(), "values": _floats(values[keep])}


def curves_by_layer(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    role: str,
    max_points: int,
    stack: str = "",
) -> list[dict]:
    """``metric`` of one role vs step: one series per (run, layer) of ``stack``, with the layer's
    depth within its stack (and an experts' spread as in :func:`curves_by_role`)."""
    chosen = _metric_rows(rows, metric)[0]
    chosen = _in_stack(chosen[chosen["role"] == role], stack).sort_values("step", kind="stable")
    series = []
    for run in runs:
        for layer, line in chosen[chosen["run"] == run].groupby("layer", sort=True):
            depth = float(line["depth"].iloc[0])
            series.append(
                {"run": run, "layer": int(layer), "depth": depth, **_points(line, max_points)}
            )
    return series


def _at_step(chosen: pd.DataFrame, step: int | None, keys: list[str]) -> pd.DataFrame:
    """Per ``keys``, the last write at the latest step <= ``step`` (None: the last step)."""
    if step is not None:
        chosen = chosen[chosen["step"] <= step]
    return last_writes(chosen, keys) if not chosen.empty else chosen


def depth_profile(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    role: str,
    step: int | None,
    steps: Iterable[int] | None = None,
) -> dict:
    """``metric`` of ``role`` vs relative depth at ``step`` (default: each run's last), one
    profile per run and stack (depth within the stack), an experts' role with its spread.

    ``steps`` (default: those of ``rows``) lists the logged steps, for the slider; each point
    carries the step it comes from. A run without the series has one empty profile.
    """
    chosen = _metric_rows(rows, metric)[0]
    chosen = chosen[(chosen["role"] == role) & chosen["run"].isin(runs)]
    profiles = []
    for run in runs:
        at = _at_step(chosen[chosen["run"] == run], step, ["stack", "layer"])
        stacks = (_ordered_stacks(at["stack"]) or [""]) if not at.empty else [""]
        for stack in stacks:
            of = at[at["stack"] == stack].sort_values("layer") if not at.empty else at
            profiles.append(
                {
                    "run": run,
                    "stack": stack,
                    "layers": of["layer"].astype(int).tolist() if not of.empty else [],
                    "depths": _floats(of["depth"]) if not of.empty else [],
                    "values": _floats(of["value"]) if not of.empty else [],
                    "steps": of["step"].astype(int).tolist() if not of.empty else [],
                    **(_spread(of) if not of.empty else {}),
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


def heads_by_layer(
    rows: pd.DataFrame, runs: Sequence[str], metric: str, step: int | None, stack: str = ""
) -> dict:
    """A per-head circuit ``metric`` over layer x head at ``step`` (None: each run's last), a
    panel per run (of ``stack``), shaped by ``charts.head_grid`` as ``plot --kind heads`` is.

    ``steps`` lists the steps logged, for the slider; a run without per-head values has an empty
    panel.
    """
    chosen = rows[(rows["metric"] == metric) & rows["head"].notna() & rows["run"].isin(runs)]
    chosen = _in_stack(chosen, stack)
    panels: list[dict[str, object]] = []
    for run in runs:
        of_run = chosen[chosen["run"] == run]
        if step is not None:
            of_run = of_run[of_run["step"] <= step]
        if of_run.empty:
            panels.append({"run": run, "layers": [], "heads": [], "values": [], "step": None})
            continue
        grid, at = head_grid(of_run, metric)
        panels.append(
            {
                "run": run,
                "layers": grid.index.astype(int).tolist(),
                "heads": grid.columns.astype(int).tolist(),
                "values": [_floats(line) for line in grid.to_numpy(dtype=float)],
                "step": at,
            }
        )
    return {
        "metric": metric,
        "step": step,
        "stack": stack,
        "steps": sorted(int(s) for s in chosen["step"].unique()),
        "runs": panels,
    }


def curves_by_head(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    layer: int,
    max_points: int,
    stack: str = "",
) -> list[dict]:
    """A per-head circuit ``metric`` of one layer (of ``stack``) vs step: one series per (run,
    head)."""
    chosen = rows[(rows["metric"] == metric) & rows["head"].notna() & (rows["layer"] == layer)]
    chosen = _in_stack(chosen, stack).sort_values("step", kind="stable")
    series = []
    for run in runs:
        for head, line in chosen[chosen["run"] == run].groupby("head", sort=True):
            series.append({"run": run, "head": int(head), **_downsampled(line, max_points)[1]})
    return series


def bars_by_layer(
    rows: pd.DataFrame,
    runs: Sequence[str],
    metric: str,
    step: int | None,
    steps: Iterable[int] | None = None,
    stack: str = "",
) -> dict:
    """``metric`` by layer x role of ``stack`` at ``step`` (None: each run's last), a panel per
    run; an experts' role with ``low``/``high`` (its min and max over the experts) per layer.

    ``steps`` (default: those of ``rows``) lists the logged steps, for the slider. A run left
    out (compression of one snapshot) says why in its panel's ``left_out``.
    """
    chosen, left_out = _metric_rows(rows, metric)
    chosen = _in_stack(chosen[chosen["run"].isin(runs)], stack)
    panels: list[dict[str, object]] = []
    for run in runs:
        at = _at_step(chosen[chosen["run"] == run], step, ["layer", "role"])
        if at.empty:
            panels.append(
                {"run": run, "layers": [], "roles": [], "values": {}, "left_out": left_out.get(run)}
            )
            continue
        layers = sorted(int(layer) for layer in at["layer"].unique())
        roles = ordered_roles(at["role"].unique())
        table = at.pivot(index="layer", columns="role", values=["value", "low", "high"])
        table = table.reindex(layers)
        spread = {
            role: {
                "low": _floats(table["low"][role]),
                "high": _floats(table["high"][role]),
                "over": spread_over(role),
            }
            for role in roles
            if table["low"][role].notna().any() or table["high"][role].notna().any()
        }
        panels.append(
            {
                "run": run,
                "layers": layers,
                "roles": roles,
                "values": {role: _floats(table["value"][role].to_numpy(float)) for role in roles},
                "spread": spread,
                "step": int(at["step"].max()),
            }
        )
    steps = chosen["step"].unique() if steps is None else steps
    return {
        "metric": metric,
        "step": step,
        "stack": stack,
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
    stack: str = "",
) -> dict:
    """Each run's ``metric`` minus ``baseline``'s vs ``x``, aligned as ``plot --kind metric-diff``
    (``series``); a spectral metric's layer is one of ``stack`` (a run with one stack: its own).
    A baseline with one point of the series (an analyzed model) is no curve to subtract: no
    series, and ``left_out`` says why in the command line's words.

    Raises:
        ValueError: as :func:`spectral_callbacks.offline.differences.diff_curves`.
    """
    if layer is not None and "stack" in rows:  # the other stacks' layers are other series
        stacks, per_layer = rows["stack"].fillna(""), rows["layer"].notna()
        named = set(rows.loc[per_layer & (stacks != ""), "run"])
        rows = rows[~per_layer | (stacks == stack) | ~rows["run"].isin(named)]
    try:
        curves = diff_curves(rows, metric, baseline, x=x, layer=layer, role=role).curves
    except ValueError as error:
        base = rows[(rows["run"] == baseline) & (rows["metric"] == metric)]
        base = base if layer is None else base[base["layer"] == layer]
        base = base if role is None else base[base["role"] == role]
        if base["step"].nunique() == 1:
            return {"series": [], "left_out": str(error)}
        raise
    series = []
    for run, diff in curves.items():
        keep = keep_extremes(diff.to_numpy(float), max_points)
        xs = diff.index.to_numpy(float)[keep]
        series.append({"run": run, "x": xs.tolist(), "values": _floats(diff.to_numpy(float)[keep])})
    return {"series": series, "left_out": None}


#: The tags of the alerts' text entries: ``add_text("spectral_alerts", ...)`` of torch's
#: SummaryWriter is read back as ``spectral_alerts/text_summary``.
ALERT_TEXT_TAGS: tuple[str, ...] = (f"{ALERT_SECTION}/text_summary", ALERT_SECTION)


#: The tags of the alert counts, ``spectral_alerts/<kind>``.
ALERT_COUNT_TAGS: frozenset[str] = frozenset(alert_tag(kind) for kind in ALERT_KINDS)


def alerts(
    runs: Sequence[str], texts: Mapping[str, Sequence[tuple[int, str]]], counts: pd.DataFrame
) -> list[dict]:
    r"""Per run: whether it counts alerts (``counted``: False where alerts were off), the count of
    each kind at its last snapshot (``counts``), their ``total``, and the alerts read from its
    text entries, newest first (``alerts``: fewer than ``total`` where TensorBoard kept only some
    of the entries).

    >>> counts = pd.DataFrame({"run": ["a"], "metric": ["spectral_alerts/sigma_growth"],
    ...                        "step": [20], "value": [1.0]})
    >>> text = "| step | kind | matrix |\n|---|---|---|\n| 20 | sigma_growth | h.0.q |"
    >>> alerts(["a", "b"], {"a": [(20, text)]}, counts)  # doctest: +NORMALIZE_WHITESPACE
    [{'run': 'a', 'counted': True, 'counts': {'sigma_growth': 1}, 'total': 1, 'step': 20,
      'alerts': [{'step': 20, 'kind': 'sigma_growth', 'matrix': 'h.0.q'}]},
     {'run': 'b', 'counted': False, 'counts': {}, 'total': 0, 'step': None, 'alerts': []}]
    """
    answer = []
    for run in runs:
        of_run = counts[(counts["run"] == run) & counts["metric"].isin(ALERT_COUNT_TAGS)]
        latest = of_run.sort_values("step", kind="stable").groupby("metric").tail(1)
        found = {
            tag.removeprefix(f"{ALERT_SECTION}/"): int(value)
            for tag, value in zip(latest["metric"], latest["value"], strict=True)
        }
        rows = [row for step, text in texts.get(run, ()) for row in alert_rows(text)]
        answer.append(
            {
                "run": run,
                "counted": bool(found),
                "counts": {kind: found[kind] for kind in ALERT_KINDS if kind in found},
                "total": sum(found.values()),
                "step": int(latest["step"].max()) if found else None,
                "alerts": sorted(rows, key=lambda row: -(row.get("step") or 0)),
            }
        )
    return answer
