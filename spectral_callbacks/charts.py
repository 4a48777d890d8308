"""The standard charts of the field, drawn from tidy rows (see ``spectral_callbacks.offline.events``).

Below both the callback (its live figures, ``monitor/figures.py``) and the command line and
offline analysis (``plot``, ``offline/differences.py``), so neither reaches into the other.

Every function takes the tidy-row DataFrame (columns ``run, step, metric, layer, depth, role, value,
wall_time``) and returns a :class:`matplotlib.figure.Figure` built with the object-oriented API: no
``pyplot`` global state, so the callback can draw figures from any thread and tests can inspect the
axes. ``save_figure`` writes one to ``.png``, ``.svg`` or ``.pdf``.

* :func:`alpha_vs_depth` - alpha of one role against relative depth i/(L-1), one line per run.
* :func:`rank_vs_steps` - a metric of one layer against steps, one line per role (a line style per run).
* :func:`compression_by_layer` - final compression % by layer, grouped bars per role (a panel per run).
* :func:`compression_wave` - heatmap layer x step of one role's compression (a panel per run).
* :func:`update_rank_vs_r` - per layer and role, the rank holding 90 % of an adapter's update
  ``||ΔW||_F²`` beside the adapter's r (is r = 8 enough?), at each matrix's last step.
* :func:`metric_vs_steps_by_layer` - a metric of one role against steps, one line per layer
  (e.g. ``update_stable_rank``).
* :func:`~spectral_callbacks.offline.differences.metric_diff` (in ``offline/differences.py``, built
  on this module) - any scalar of each run minus a baseline run (or its partner by a name
  pattern), against steps or another scalar, optionally EMA-smoothed.

A role of a mixture of experts is one point per layer, the mean over the layer's experts, with
their min-max as a band around the line (a whisker on a bar): :func:`one_per_layer` reads the
experts from per-expert rows or from their logged aggregates (role ``MLP_down/mean`` ...).

Runs a chart cannot draw (a single snapshot where a curve or a reference is needed) are left out
with the reason written under the figure and kept in ``fig.left_out`` (run -> reason), so a caller
can say it too. Every drawing function takes ``ax=`` to draw into a panel of a larger figure.

Example::

    >>> import pandas as pd
    >>> rows = pd.DataFrame({"run": ["a", "a"], "step": [10, 10], "metric": ["alpha", "alpha"],
    ...     "layer": [0, 1], "depth": [0.0, 1.0], "role": ["Q", "Q"], "value": [0.2, 0.4],
    ...     "wall_time": [0.0, 0.0]})
    >>> fig = alpha_vs_depth(rows, role="Q")
    >>> [line.get_ydata().tolist() for line in fig.axes[0].get_lines()]
    [[0.2, 0.4]]
    >>> role_glyph("MLP_up"), role_glyph("KV_down")
    ('MLP↑', 'KV_down')
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from spectral_callbacks.names import ROLES, ordered_stacks, relative_depth, role_sort_key

if TYPE_CHECKING:  # torch is imported only where compression is computed
    import torch

# How a role reads in a paper figure; roles not listed (variant roles such as Q_down) are verbatim.
ROLE_GLYPHS: dict[str, str] = {
    "Q": "Q",
    "K": "K",
    "V": "V",
    "O": "O",
    "MLP_up": "MLP↑",
    "MLP_down": "MLP↓",
}
METRIC_LABELS: dict[str, str] = {
    "stable_rank": r"stable rank $\|W\|_F^2 / \sigma_1^2$",
    "alpha": "α (rank-decay exponent)",
    "alpha_r2": "R² of the α fit",
    "compression": "compression (%)",
    "spectral_norm": "spectral norm σ₁",
    "frobenius_norm": r"Frobenius norm $\|W\|_F$",
    "energy_rank_90": r"rank holding 90 % of $\|W\|_F^2$",
    "esd_alpha": "ESD tail exponent",
    "esd_ks_distance": "ESD fit KS distance",
    "esd_xmin": "ESD x_min",
    "esd_tail_size": "ESD tail size",
    "update_stable_rank": r"update stable rank $\|\Delta W\|_F^2 / \sigma_1^2$",
    "update_energy_rank_90": r"update rank holding 90 % of $\|\Delta W\|_F^2$",
    "update_relative_size": r"update size $\|\Delta W\|_F / \|W_0\|_F$",
    "update_spectral_norm": r"update spectral norm $\sigma_1(\Delta W)$",
    "qk_spectral_norm": r"QK logit bound $\sigma_1(W_{QK}^h)/\sqrt{d_h}$",
    "qk_stable_rank": r"QK circuit stable rank",
    "ov_spectral_norm": r"OV circuit norm $\sigma_1(W_{OV}^h)$",
    "ov_stable_rank": r"OV circuit stable rank",
}
# Labels whose formula is their object: a title keeps it, in plain text.
_TITLE_NAMES = {
    "energy_rank_90": "rank holding 90 % of ‖W‖²",
    "update_energy_rank_90": "update rank holding 90 % of ‖ΔW‖²",
}
# Per-run line styles so runs stay apart when colour already encodes the role.
_LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
FIGURE_FORMATS = (".png", ".svg", ".pdf")


def role_glyph(role: str) -> str:
    """How ``role`` is written in a figure: ``MLP_up`` -> ``MLP↑``; unknown roles verbatim."""
    return ROLE_GLYPHS.get(role, role)


def metric_label(metric: str) -> str:
    """An axis label for ``metric``; unknown metrics (e.g. ``train/loss``) verbatim."""
    return METRIC_LABELS.get(metric, metric)


def metric_name(metric: str) -> str:
    """``metric`` in a title: its label without the formula that defines it, unless the formula
    is what it names.

    >>> metric_name("stable_rank"), metric_name("energy_rank_90")
    ('stable rank', 'rank holding 90 % of ‖W‖²')
    """
    return _TITLE_NAMES.get(metric) or metric_label(metric).split(" $")[0]


def _ordered_roles(roles: Sequence[str]) -> list[str]:
    """``roles`` in the one order every surface uses (charts, the tab, the tables):
    ``targets.target.ROLE_ORDER``, so ``Q_cross`` follows ``O`` and ``MLP_gate`` precedes
    ``MLP_up`` everywhere."""
    return sorted(set(roles), key=role_sort_key)


# matplotlib's tab10 (its default cycle C0..C9); the SPECTRAL tab draws with the same list.
PALETTE: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip


# Roles that sit beside a canonical one in the same model, in tab20's light partner of a
# canonical colour: a decoder's cross-attention beside its self-attention (T5, BART, Whisper),
# the gate beside MLP_up (Llama, Mixtral's experts). Hashed into the four spare colours they
# met each other (K_cross, Q_cross and a Mixtral's Router were all C9).
PARTNER_COLORS: dict[str, str] = {
    "Q_cross": "#aec7e8",
    "K_cross": "#ffbb78",
    "V_cross": "#98df8a",
    "O_cross": "#ff9896",
    "MLP_gate": "#c5b0d5",
}


def role_color(role: str) -> str:
    """The colour of ``role`` in every chart, whichever roles a chart holds.

    The six canonical roles own the first six colours; the cross-attention roles and
    ``MLP_gate`` the light partner of Q, K, V, O and MLP_up (``PARTNER_COLORS``); any other role
    (a variant's ``Q_down``, ``Router``, ...) gets one of the remaining four by a hash of its
    name, so it too keeps its colour from chart to chart and run to run.

    >>> role_color("Q"), role_color("MLP_down"), role_color("Q_cross")
    ('#1f77b4', '#8c564b', '#aec7e8')
    >>> role_color("Q_down") == role_color("Q_down")
    True
    """
    if role in ROLES:
        return PALETTE[ROLES.index(role)]
    if role in PARTNER_COLORS:
        return PARTNER_COLORS[role]
    spare = PALETTE[len(ROLES) :]
    return spare[zlib.crc32(role.encode()) % len(spare)]


def _role_colors(roles: Sequence[str]) -> dict[str, str]:
    return {role: role_color(role) for role in _ordered_roles(roles)}


def _select(rows: pd.DataFrame, *, metric: str, what: str, **equal: object) -> pd.DataFrame:
    """Rows of ``metric`` (per-layer only) matching ``equal``; a clear ValueError when none are left.

    The error lists the values the rows do hold for each filter (e.g. the layers that exist).
    """
    of_metric = rows[(rows["metric"] == metric) & rows["layer"].notna()]
    if of_metric.empty:
        have = ", ".join(sorted(map(str, rows["metric"].unique()))) or "nothing"
        raise ValueError(f"{what} needs per-layer `{metric}` rows; the rows hold: {have}")
    chosen = of_metric
    for column, value in equal.items():
        if value is not None:
            chosen = chosen[chosen[column] == value]
    if chosen.empty:
        filters = ", ".join(f"{k}={v!r}" for k, v in equal.items() if v is not None)
        present = "; ".join(
            f"{column}s: {', '.join(map(str, sorted(of_metric[column].dropna().unique())))}"
            for column, value in equal.items()
            if value is not None
        )
        raise ValueError(
            f"{what} needs per-layer `{metric}` rows with {filters}; there are {present}"
        )
    return chosen


def _select_points(rows: pd.DataFrame, *, metric: str, what: str, **equal: object) -> pd.DataFrame:
    """:func:`_select` over :func:`one_per_layer` of ``metric``'s rows: a layer's experts are one
    point, their mean, with ``low``/``high`` their min and max."""
    of_metric = rows[rows["metric"] == metric]
    points = one_per_layer(of_metric) if len(of_metric) else rows
    return _select(points, metric=metric, what=what, **equal)


# The gid of the edge lines of a band over experts (kept out of the legend, in plotted_values).
_SPREAD = "spread over experts"
SPREAD_LABEL = "min–max over experts"


def _spread_band(ax: Axes, x: np.ndarray, line: pd.DataFrame, color: object, series: str) -> None:
    """The min-max over experts around one drawn line, where its points are experts: a shaded
    band between two thin edge lines, ``<series> min`` and ``<series> max`` (a lone point gets a
    whisker)."""
    if "low" not in line:
        return
    low, high = line["low"].to_numpy(dtype=float), line["high"].to_numpy(dtype=float)
    finite = np.isfinite(low) & np.isfinite(high)
    if not finite.any():
        return
    lone = finite.sum() == 1
    for values, end in ((low, "min"), (high, "max")):
        ax.plot(
            x,
            values,
            color=color,
            linewidth=0.7,
            alpha=0.7,
            marker="_" if lone else None,
            gid=_SPREAD,
            label=f"{series} {end}",
        )
    if lone:
        ax.vlines(x[finite], low[finite], high[finite], color=color, linewidth=0.8, alpha=0.7)
    else:
        ax.fill_between(x, low, high, where=finite, color=color, alpha=0.18, linewidth=0)


def _final(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last finite value per ``keys`` (the highest step, the latest write at that step).

    A series whose newest values are NaN (non-finite weights from some step on) gives its last
    finite row, with that row's step; :func:`_fallbacks` says where that happened.
    """
    ordered = rows.sort_values(["step", "wall_time"], kind="stable")
    finite = ordered[np.isfinite(ordered["value"].to_numpy(dtype=float))]
    return finite.groupby(keys, as_index=False, sort=True).tail(1).sort_values(keys)


def layer_step_grid(rows: pd.DataFrame) -> pd.DataFrame:
    """Layer x step values of one run and role (the last finite write per cell), as a heatmap
    draws them.

    A snapshot taken in parts over consecutive steps (the snapshot budget) logs each layer at the
    step of its copy, a few steps apart: those steps become one column, at the first of them. A
    column closes where a layer comes again, so a snapshot of every layer at one step keeps its
    own column.

    >>> rows = pd.DataFrame({"layer": [0, 1, 0, 1], "step": [0, 1, 25, 27], "value": [1.0, 2, 3, 4],
    ...                      "wall_time": [0.0] * 4})
    >>> layer_step_grid(rows).to_dict()
    {0: {0: 1.0, 1: 2.0}, 25: {0: 3.0, 1: 4.0}}
    """
    last = _final(rows, ["layer", "step"])
    column: dict[int, int] = {}
    start: int | None = None
    seen: set[int] = set()
    for step, layers in last.groupby("step", sort=True)["layer"]:
        if start is None or seen & set(layers):
            start, seen = int(step), set()
        seen |= set(layers)
        column[int(step)] = start
    last = last.assign(step=last["step"].map(column))
    return last.pivot_table(index="layer", columns="step", values="value", aggfunc="last")


def _fallbacks(rows: pd.DataFrame, final: pd.DataFrame) -> dict[str, str]:
    """Per run, a note when ``final`` (from :func:`_final`) is older than its series' newest
    step (a NaN since); a layer logged a few steps before another (a staggered snapshot) is not."""
    notes = {}
    keys = [
        k for k in ("run", "stack", "layer", "role") if k in final.columns and k in rows.columns
    ]
    newest_of = rows.groupby(keys, sort=False)["step"].max().rename("newest").reset_index()
    final = final.merge(newest_of, on=keys, how="left")
    for run, newest in rows.groupby("run", sort=False)["step"].max().items():
        older = final[(final["run"] == run) & (final["step"] < final["newest"])]
        if not older.empty:
            notes[str(run)] = (
                f"NaN at step {newest} for {len(older)} series: drawn at their last finite step "
                f"({older['step'].min()}-{older['step'].max()})"
            )
    return notes


def _legend(ax: Axes, title: str, *, outside: bool = False) -> None:
    """A legend when something is labelled (a run may be named ""), else none and no warning.

    ``outside``: right of the axes, for legends long enough to cover the curves (a run · role
    legend of several runs has 12 entries and more).
    """
    handles, labels = ax.get_legend_handles_labels()
    entries = [
        (h, label)
        for h, label in zip(handles, labels, strict=True)
        if getattr(h, "get_gid", lambda: None)() != _SPREAD
    ]
    if len(entries) < len(handles):  # the band edges: one entry says what the bands are
        from matplotlib.patches import Patch

        entries.append((Patch(facecolor="0.5", alpha=0.35), SPREAD_LABEL))
    if not entries:
        return
    handles, labels = [h for h, _ in entries], [label for _, label in entries]
    if outside:
        ax.legend(
            handles,
            labels,
            title=title,
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
    else:
        ax.legend(handles, labels, title=title, fontsize="small")


def _missing(rows: pd.DataFrame, drawn: pd.DataFrame, why: str) -> dict[str, str]:
    """``why`` for every run of ``rows`` with nothing in ``drawn`` (so none is dropped silently)."""
    have = set(drawn["run"].unique())
    return {run: why for run in _runs(rows) if run not in have}


def _runs(rows: pd.DataFrame) -> list[str]:
    return rows["run"].unique().tolist()  # first-seen order, the order the user named the runs


def _stacks(rows: pd.DataFrame) -> list[str]:
    """The stacks of ``rows`` in ``names.STACK_ORDER`` (``[""]`` for a model with one stack)."""
    if "stack" not in rows or not len(rows):
        return [""]
    return ordered_stacks(rows["stack"].unique()) or [""]


def _panels(rows: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """One panel per run and stack (an encoder's layer 0 is not its decoder's): ``(run, stack,
    rows)``, runs in the order named, a run's stacks in ``names.STACK_ORDER``."""
    return [
        (run, stack, of_run[of_run["stack"] == stack] if "stack" in of_run else of_run)
        for run in _runs(rows)
        for of_run in [rows[rows["run"] == run]]
        for stack in _stacks(of_run)
    ]


def _of(run: str, stack: str) -> str:
    """A panel's name: the run, and its stack where it has one (``t5 · dec``)."""
    return f"{run} · {stack}" if stack else run


# One point of a chart: a matrix, or a layer's experts of one role, at one step.
_POINT = ["run", "stack", "layer", "role", "step", "metric"]


def one_per_layer(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with one row per (run, stack, layer, role, step, metric) and the spread over
    experts: the row of a layer's experts of one role holds their mean as ``value`` and their min
    and max as ``low`` and ``high`` (both NaN for a matrix that is not an expert); ``stack`` is
    ``""`` where rows have none.

    Experts come as per-expert rows (the callback's history; an export with ``experts="each"``)
    or as their logged aggregates (role ``MLP_down/mean``, ``/min``, ``/max``, as ``export``
    reads them); where both are present the logged aggregates are kept. NaN values are left out
    of the mean, min and max, as the callback leaves them out.

    >>> rows = pd.DataFrame({"run": "a", "step": 0, "metric": "alpha", "layer": [0, 1, 1, 1],
    ...     "role": ["Q", "MLP_up", "MLP_up", "MLP_up"], "expert": [None, 0, 1, 2],
    ...     "value": [0.5, 1.0, 2.0, 6.0], "wall_time": 0.0})
    >>> one_per_layer(rows)[["layer", "role", "value", "low", "high"]].to_dict("records")
    [{'layer': 0, 'role': 'Q', 'value': 0.5, 'low': nan, 'high': nan}, \
{'layer': 1, 'role': 'MLP_up', 'value': 3.0, 'low': 1.0, 'high': 6.0}]
    """
    rows = rows.assign(stack=rows["stack"].fillna("") if "stack" in rows else "")
    roles = rows["role"].astype("string")
    aggregate = roles.str.extract(r"/(mean|min|max)$", expand=False)
    of_aggregate = aggregate.notna().to_numpy(dtype=bool)
    of_expert = (
        rows["expert"].notna().to_numpy(dtype=bool)
        if "expert" in rows
        else np.zeros(len(rows), dtype=bool)
    )
    plain = rows[~of_aggregate & ~of_expert].assign(low=np.nan, high=np.nan)
    if not (of_aggregate.any() or of_expert.any()):
        return plain
    logged = rows[of_aggregate].assign(
        role=roles[of_aggregate].str.rsplit("/", n=1).str[0].astype(object),
        aggregate=aggregate[of_aggregate].astype(object),
    )
    spread = _spread(logged, "aggregate")
    computed = _spread(rows[of_expert & ~of_aggregate], None)
    if len(spread) and len(computed):  # an "each" export: its logged aggregates win
        logged_points = pd.MultiIndex.from_frame(spread[_POINT].astype(object))
        computed_points = pd.MultiIndex.from_frame(computed[_POINT].astype(object))
        computed = computed[~computed_points.isin(logged_points)]
    joined = pd.concat([f for f in (plain, spread, computed) if len(f)], ignore_index=True)
    if "expert" in rows:
        joined["expert"] = pd.array([pd.NA] * len(joined), dtype="Int64")
    return joined.astype({"layer": rows["layer"].dtype})


def _spread(rows: pd.DataFrame, aggregate_column: str | None) -> pd.DataFrame:
    """One row per point of ``rows``: ``value`` the mean, ``low``/``high`` the min/max, over the
    rows' own values (``aggregate_column=None``) or as the aggregate each row names."""
    if rows.empty:
        return pd.DataFrame(columns=[*_POINT, "value", "low", "high"])
    points = rows.groupby(_POINT, sort=False, dropna=False)
    if aggregate_column is None:
        stats = points["value"].agg(["mean", "min", "max"])
    else:
        stats = (
            rows.groupby([*_POINT, aggregate_column], sort=False, dropna=False)["value"]
            .last()
            .unstack(aggregate_column)
            .reindex(columns=["mean", "min", "max"])
        )
    stats = stats.rename(columns={"mean": "value", "min": "low", "max": "high"})
    # A point's depth is its layer's; its wall time the latest write of it.
    extra = {c: how for c, how in (("depth", "first"), ("wall_time", "max")) if c in rows}
    if extra:
        stats = stats.join(points.agg(extra))
    return stats.reset_index()


def _depths(rows: pd.DataFrame) -> pd.Series:
    """Relative depth per row, from ``depth`` where known, else from layer and the layer count of
    the run's stack."""
    keys = ["run", "stack"] if "stack" in rows else ["run"]
    num_layers = rows.groupby(keys)["layer"].transform("max") + 1
    fallback = pd.Series(
        [
            relative_depth(int(layer), int(layers))
            for layer, layers in zip(rows["layer"], num_layers, strict=True)
        ],
        index=rows.index,
        dtype=float,
    )
    return rows["depth"].fillna(fallback) if "depth" in rows else fallback


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its figure, or a new one-panel figure."""
    if ax is not None:
        return ax.figure, ax  # type: ignore[return-value]
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _note_left_out(
    fig: Figure, left_out: dict[str, str], fell_back: dict[str, str] | None = None
) -> None:
    """Record the runs a chart left out on ``fig.left_out`` (and those drawn from an earlier step
    than their last on ``fig.fell_back``) and write both under the figure."""
    known: dict[str, str] = getattr(fig, "left_out", {})
    known.update(left_out)
    fig.left_out = known  # type: ignore[attr-defined]
    earlier: dict[str, str] = getattr(fig, "fell_back", {})
    earlier.update(fell_back or {})
    fig.fell_back = earlier  # type: ignore[attr-defined]
    lines = []
    if known:
        lines.append("left out — " + "; ".join(f"{run}: {why}" for run, why in known.items()))
    if earlier:
        lines.append("earlier step — " + "; ".join(f"{run}: {why}" for run, why in earlier.items()))
    if lines:  # a figure-level label, so the constrained layout makes room for it
        fig.supxlabel("\n".join(lines), fontsize="x-small", wrap=True)


def alpha_vs_depth(
    rows: pd.DataFrame,
    role: str = "Q",
    *,
    ax: Axes | None = None,
    ylim: tuple[float, float] | None = None,
    title: str | None = None,
) -> Figure:
    """Alpha of ``role`` against relative depth i/(L-1), one line per run and stack (encoder and
    decoder, text and vision: depth within the stack), at each run's last step.

    Args:
        rows: tidy rows with ``alpha`` rows.
        role: the role to draw (default ``"Q"``, the Q projection of the paper's figure).
        ax: draw into this panel (default None: a new figure).
        ylim: the y range (default None: matplotlib's); points outside it are counted in the panel.
        title: the panel title (default "α of <role> vs relative depth").

    Raises:
        ValueError: no per-layer ``alpha`` rows of ``role``.
    """
    chosen = _select_points(rows, metric="alpha", what="alpha-depth", role=role)
    final = _final(chosen.assign(depth=_depths(chosen)), ["run", "stack", "layer"])
    fig, ax = _axes(ax, (6.0, 4.0))
    left_out = _missing(rows, final, f"no alpha of {role_glyph(role)}")
    _note_left_out(fig, left_out, _fallbacks(chosen, final))
    for run in _runs(chosen):
        of_run = final[final["run"] == run]
        for stack in _stacks(of_run):
            line = of_run[of_run["stack"] == stack].sort_values("depth")
            label = f"{run} {stack}" if stack else run
            depth = line["depth"].to_numpy(dtype=float)
            (drawn,) = ax.plot(depth, line["value"].to_numpy(), marker="o", label=label)
            _spread_band(ax, depth, line, drawn.get_color(), label)
    ax.set_xlabel("relative depth i / (L − 1)")
    ax.set_ylabel(metric_label("alpha"))
    ax.set_title(title or f"α of {role_glyph(role)} vs relative depth")
    if ylim is not None:
        ax.set_ylim(*ylim)
        outside = final[(final["value"] < ylim[0]) | (final["value"] > ylim[1])]
        if not outside.empty:  # said inside the panel, so the title stays the panel's name
            points = f"{len(outside)} point{'s' if len(outside) != 1 else ''}"
            ax.text(
                0.5,
                0.98,
                f"{points} outside {ylim[0]}–{ylim[1]} "
                f"(α {outside['value'].min():.2f}…{outside['value'].max():.2f})",
                transform=ax.transAxes,
                ha="center",
                va="top",
                fontsize="small",
                color="0.3",
            )
    ax.set_xlim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    _legend(ax, "run")
    return fig


def rank_vs_steps(
    rows: pd.DataFrame,
    layer: int = 0,
    metric: str = "stable_rank",
    *,
    ax: Axes | None = None,
) -> Figure:
    """``metric`` of one layer against steps: one line per role, one line style per run.

    A run with a single step of a role (an analyzed model) is drawn as a marker, not an invisible
    one-point line.

    Args:
        rows: tidy rows.
        layer: the layer to draw (default 0, where the collapse is strongest).
        metric: the metric to draw (default ``"stable_rank"``).
        ax: draw into this panel (default None: a new figure).

    Raises:
        ValueError: no rows of ``metric`` at ``layer``.
    """
    chosen = _select_points(rows, metric=metric, what="rank-steps", layer=layer)
    colors = _role_colors(chosen["role"].unique())
    panels = _panels(chosen)  # each run and stack its line style: the layer of each stack
    fig, ax = _axes(ax, (6.5, 4.0))
    for index, (run, stack, of_panel) in enumerate(panels):
        for role in colors:
            line = _final(of_panel[of_panel["role"] == role], ["step"])
            if line.empty:
                continue
            label = (
                role_glyph(role) if len(panels) == 1 else f"{_of(run, stack)} · {role_glyph(role)}"
            )
            steps = line["step"].to_numpy(dtype=float)
            ax.plot(
                steps,
                line["value"].to_numpy(),
                color=colors[role],
                linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
                marker="o" if len(line) == 1 else None,
                label=label,
            )
            _spread_band(ax, steps, line, colors[role], label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_name(metric)} of layer {layer} vs steps")
    ax.grid(alpha=0.3)
    several = len(panels) > 1  # then each label names its run and stack, as the title says
    named = [name for name, shown in (("run", len(_runs(chosen)) > 1), ("stack", several)) if shown]
    _legend(ax, " · ".join([*named, "role"]), outside=True)  # beside the curves, never on them
    return fig


def update_rank_vs_r(
    rows: pd.DataFrame, *, run: str | None = None, ax: Axes | None = None
) -> Figure:
    """The update's energy rank at 90 % beside the adapter's r, per layer and role (last step).

    Bars: ``update_energy_rank_90`` of each (layer, role), grouped by layer, one color per role; a
    black tick on each bar marks that adapter's r (``update_rank``). A bar far below its tick says
    the update uses fewer directions than r allows; one at its tick, that r may be too small.

    Args:
        rows: tidy rows with ``update_energy_rank_90`` (and ``update_rank``) per layer.
        run: which run to draw (default None: the first).
        ax: draw into this panel (default None: a new figure).

    Raises:
        ValueError: no per-layer ``update_energy_rank_90`` rows (not an adapted model's run).
    """
    chosen = _select(rows, metric="update_energy_rank_90", what="update-rank", run=run)
    run = run if run is not None else _runs(chosen)[0]
    chosen = chosen[chosen["run"] == run]
    energy = _final(chosen, ["layer", "role"])
    ranks = rows[(rows["metric"] == "update_rank") & (rows["run"] == run) & rows["layer"].notna()]
    r_of = {
        (int(r.layer), r.role): float(r.value)
        for r in _final(ranks, ["layer", "role"]).itertuples()
    }
    roles = _ordered_roles(list(energy["role"].unique()))
    colors = _role_colors(roles)
    layers = sorted(int(layer) for layer in energy["layer"].unique())
    fig, ax = _axes(ax, (max(6.5, 0.45 * len(layers) * len(roles)), 4.0))
    width = 0.8 / len(roles)
    for j, role in enumerate(roles):
        of_role = energy[energy["role"] == role]
        xs = (
            np.array([layers.index(int(layer)) for layer in of_role["layer"]])
            + (j - (len(roles) - 1) / 2) * width
        )
        ax.bar(
            xs,
            of_role["value"].to_numpy(dtype=float),
            width=width,
            color=colors[role],
            label=role_glyph(role),
        )
        r_values = [r_of.get((int(layer), role), np.nan) for layer in of_role["layer"]]
        ax.scatter(xs, r_values, marker="_", s=120, color="black", zorder=3, linewidths=1.5)
    ax.scatter([], [], marker="_", color="black", label="adapter r")
    # The axis ends just above the highest bar or tick (r = 8: at 8, not 10); the legend stands
    # beside the panel, where it covers no bar, tick or axis label.
    top = np.nanmax([*energy["value"].to_numpy(dtype=float), *r_of.values(), 1.0])
    ax.set_ylim(0, 1.05 * top)
    ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("rank")
    step = int(energy["step"].max())
    ax.set_title(f"update rank (90 % of ‖ΔW‖²) vs adapter r, step {step}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def metric_vs_steps_by_layer(
    rows: pd.DataFrame,
    role: str = "Q",
    metric: str = "update_stable_rank",
    *,
    run: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """``metric`` of one role against steps, one line per layer (darker = deeper).

    Args:
        rows: tidy rows.
        role: the role to draw (default ``"Q"``).
        metric: the metric (default ``"update_stable_rank"``).
        run: which run to draw (default None: the first).
        ax: draw into this panel (default None: a new figure).

    Raises:
        ValueError: no per-layer rows of ``metric`` for ``role``.
    """
    chosen = _select_points(rows, metric=metric, what="layer-steps", role=role, run=run)
    run = run if run is not None else _runs(chosen)[0]
    chosen = chosen[chosen["run"] == run]
    fig, ax = _axes(ax, (6.5, 4.0))
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    # Each stack its line style, each layer its shade within its stack (darker = deeper).
    for index, (_, stack, of_stack) in enumerate(_panels(chosen)):
        layers = sorted(int(layer) for layer in of_stack["layer"].unique())
        for i, layer in enumerate(layers):
            line = _final(of_stack[of_stack["layer"] == layer], ["step"])
            shade = cmap(0.9 * i / max(1, len(layers) - 1))
            steps = line["step"].to_numpy(dtype=float)
            label = f"{stack} L{layer}" if stack else f"L{layer}"
            ax.plot(
                steps,
                line["value"].to_numpy(),
                color=shade,
                linestyle=_LINE_STYLES[index % len(_LINE_STYLES)],
                label=label,
                marker="o" if len(line) == 1 else None,
            )
            _spread_band(ax, steps, line, shade, label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_name(metric)} of {role_glyph(role)} vs steps")
    ax.grid(alpha=0.3)
    _legend(ax, "layer")
    return fig


def compression_rows(
    rows: pd.DataFrame, *, allow_none: bool = False
) -> tuple[pd.DataFrame, dict[str, str]]:
    """Per-layer compression rows of each run, and the runs left out with the reason.

    A run's logged ``compression`` rows are used as they are; a run without them gets
    ``functional.compression`` of its ``stable_rank`` against each matrix's first finite stable
    rank (the reference rule of the callback; each stack's and expert's matrices their own). A
    run with a single snapshot (an analyzed model) has no reference to compress against and is
    left out.

    Args:
        rows: tidy rows.
        allow_none: give no rows (and the reasons) where no run has compression, instead of
            raising (the SPECTRAL tab says the reasons in its panels).

    Raises:
        ValueError: no run has compression (its reasons named, e.g. a single snapshot), or
            neither ``compression`` nor ``stable_rank`` rows in any run; not with ``allow_none``.
    """
    per_layer = rows[rows["layer"].notna()]
    frames, left_out = [], {}
    for run in _runs(per_layer):
        of_run = per_layer[per_layer["run"] == run]
        logged = of_run[of_run["metric"] == "compression"]
        if not logged.empty:
            frames.append(logged)
            continue
        ranks = of_run[of_run["metric"] == "stable_rank"].sort_values(
            ["step", "wall_time"], kind="stable"
        )
        if ranks["step"].nunique() > 1:
            # torch (~1 s to import) only when compression must be computed: the tab's server
            # does not import it for runs that logged compression.
            from spectral_callbacks.functional import compression

            matrix = [c for c in ("run", "stack", "layer", "role", "expert") if c in ranks]
            reference = ranks.groupby(matrix, dropna=False)["value"].transform("first")
            percent = compression(_float64(ranks["value"]), _float64(reference)).numpy()
            frames.append(ranks.assign(metric="compression", value=percent))
        elif not ranks.empty:
            left_out[run] = (
                f"one snapshot (step {ranks['step'].iloc[0]}), nothing to compress against"
            )
        else:
            left_out[run] = "no compression or stable_rank rows"
    if not frames and allow_none:
        return per_layer.iloc[0:0], left_out
    if not frames and left_out:  # say why, not "no stable_rank rows" of runs that have them
        reasons = "; ".join(f"{run}: {why}" for run, why in left_out.items())
        raise ValueError(f"compression: no run to draw — {reasons}")
    if not frames:
        _select(rows.iloc[0:0], metric="stable_rank", what="compression")  # raises, naming it
    return pd.concat(frames), left_out


def _float64(values: pd.Series) -> torch.Tensor:
    """A float64 tensor of ``values`` (NaN kept)."""
    import torch

    return torch.tensor(values.to_numpy(dtype=float), dtype=torch.float64)


def compression_by_layer(rows: pd.DataFrame, *, ax: Axes | None = None) -> Figure:
    """Final compression % by layer, grouped bars per role; one panel per run.

    Uses each run's logged ``compression`` rows; without them, computes 100 (1 - s_t / s_ref) from
    ``stable_rank`` with s_ref each matrix's first finite step (see :func:`compression_rows`).

    Args:
        rows: tidy rows.
        ax: draw into this panel (default None: a new figure); then ``rows`` must hold one run.

    Raises:
        ValueError: neither ``compression`` nor ``stable_rank`` rows, or several runs with ``ax``.
    """
    logged, left_out = compression_rows(rows)
    chosen = one_per_layer(logged)
    final = _final(chosen, ["run", "stack", "layer", "role"])
    fell_back = _fallbacks(chosen, final)
    panels = _panels(final)  # one per run and stack
    if ax is not None:
        if len(panels) > 1:
            raise ValueError(
                f"compression_by_layer draws one run of one stack into `ax`, got {len(panels)}"
            )
        fig, axes = ax.figure, [ax]
    else:
        fig = Figure(figsize=(7.0, 3.2 * len(panels)), layout="constrained")
        axes = list(fig.subplots(len(panels), 1, squeeze=False)[:, 0])
    for ax, (run, stack, of_run) in zip(axes, panels, strict=True):
        layers = np.sort(of_run["layer"].unique()).astype(int)
        colors = _role_colors(of_run["role"].unique())  # this run's roles: no gap, no stray entry
        width = 0.8 / len(colors)
        spread = False
        for i, role in enumerate(colors):
            bars = of_run[of_run["role"] == role].set_index("layer").reindex(layers)
            heights = bars["value"].to_numpy(dtype=float)
            x = np.arange(len(layers)) + (i - (len(colors) - 1) / 2) * width
            ax.bar(x, heights, width=width, color=colors[role], label=role_glyph(role))
            low, high = bars["low"].to_numpy(dtype=float), bars["high"].to_numpy(dtype=float)
            experts = np.isfinite(low) & np.isfinite(high)
            if experts.any():  # the bar is the experts' mean: a whisker spans their min-max
                ax.vlines(x[experts], low[experts], high[experts], color="black", linewidth=0.8)
                spread = True
        ax.set_xticks(np.arange(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("final compression (%)")
        ax.set_title(f"Final compression by layer — {_of(run, stack)}")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if spread:  # after the roles
            handles.append(Line2D([], [], color="black", linewidth=0.8))
            labels.append(SPREAD_LABEL)
        # Right of the axes: inside, it would cover the first layers' bars (compression reaches ~90 %).
        ax.legend(
            handles,
            labels,
            title="role",
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
    _note_left_out(fig, left_out, fell_back)  # type: ignore[arg-type]
    return fig  # type: ignore[return-value]


def compression_wave(rows: pd.DataFrame, role: str = "Q") -> Figure:
    """Heatmap of ``role``'s compression, layer (rows, L0 at the top) x step (columns); one panel per run.

    Raises:
        ValueError: no compression (or stable rank) rows of ``role``.
    """
    logged, left_out = compression_rows(rows)
    of_all = one_per_layer(logged)
    chosen = _select(of_all, metric="compression", what="compression-wave", role=role)
    experts = bool(np.isfinite(chosen["low"].to_numpy(dtype=float)).any())
    left_out = {**_missing(of_all, chosen, f"no compression of {role_glyph(role)}"), **left_out}
    panels = _panels(chosen)  # one per run and stack
    fig = Figure(figsize=(7.0, 3.0 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (run, stack, of_panel) in zip(axes, panels, strict=True):
        grid = layer_step_grid(of_panel).sort_index()
        steps = grid.columns.to_numpy(dtype=float)
        layers = grid.index.to_numpy(dtype=float)
        # Cell edges halfway between snapshots: the schedule is dense early, sparse late.
        mesh = ax.pcolormesh(
            _edges(steps),
            _edges(layers),
            grid.to_numpy(dtype=float),
            cmap="viridis",
            shading="flat",
        )
        fig.colorbar(mesh, ax=ax, label="compression (%)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("layer")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.invert_yaxis()  # L0 on the first row, as in the SPECTRAL tab
        of_experts = ", mean over experts" if experts else ""
        ax.set_title(f"Compression wave of {role_glyph(role)}{of_experts} — {_of(run, stack)}")
    _note_left_out(fig, left_out)
    return fig


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centers (one unit wide for a single center)."""
    if len(centers) == 1:
        return np.array([centers[0] - 0.5, centers[0] + 0.5])
    middle = (centers[1:] + centers[:-1]) / 2
    return np.concatenate([[2 * centers[0] - middle[0]], middle, [2 * centers[-1] - middle[-1]]])


def plotted_values(fig: Figure) -> pd.DataFrame:
    """Every number ``fig`` shows, as tidy rows ``panel, series, x, y`` (a CSV beside the PNG).

    The points of each labelled data line, and the height of each labelled bar with ``x`` the
    label of its tick (the layer). Reference lines (the zero line) and unlabelled artists are left
    out; ``panel`` is the title of the axes.

    >>> fig = Figure()
    >>> ax = fig.add_subplot()
    >>> _ = ax.plot([0, 1], [2.0, 3.0], label="a")
    >>> _ = ax.set_title("p")
    >>> plotted_values(fig).to_dict("records")
    [{'panel': 'p', 'series': 'a', 'x': 0.0, 'y': 2.0}, {'panel': 'p', 'series': 'a', 'x': 1.0, 'y': 3.0}]
    """
    from matplotlib.container import BarContainer

    records = []
    for ax in fig.axes:
        panel = ax.get_title()
        for line in ax.get_lines():
            label = str(line.get_label())
            if label.startswith("_") or line.get_transform() is not ax.transData:
                continue
            xs = np.asarray(line.get_xdata(), dtype=float)
            ys = np.asarray(line.get_ydata(), dtype=float)
            records += [(panel, label, x, y) for x, y in zip(xs, ys, strict=True)]
        labels = [t.get_text() for t in ax.get_xticklabels()]
        ticks = dict(zip(ax.get_xticks(), labels, strict=True))
        for container in ax.containers:
            label = str(container.get_label())
            if not isinstance(container, BarContainer) or label.startswith("_"):
                continue
            for patch in container.patches:
                center = round(patch.get_x() + patch.get_width() / 2)
                records.append((panel, label, float(ticks.get(center, center)), patch.get_height()))
    return pd.DataFrame.from_records(records, columns=["panel", "series", "x", "y"])


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path``; the format comes from the extension (.png, .svg or .pdf).

    Raises:
        ValueError: another extension.
    """
    path = Path(path)
    if path.suffix.lower() not in FIGURE_FORMATS:
        raise ValueError(
            f"`-o` must end in {', '.join(FIGURE_FORMATS)}, got {str(path)!r}; pick one of those"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path


def head_grid(rows: pd.DataFrame, metric: str = "qk_spectral_norm") -> tuple[pd.DataFrame, int]:
    """The layer x head table of a per-head circuit metric at the last step that has it, and that
    step (rows of one run and stack; the SPECTRAL tab and ``plot --kind heads`` draw it).

    >>> rows = pd.DataFrame({"step": [0, 5, 5, 5], "metric": "qk_spectral_norm",
    ...                      "layer": [0, 0, 0, 1], "role": "heads", "head": [0, 0, 1, 0],
    ...                      "value": [1.0, 2.0, 3.0, 4.0]})
    >>> grid, step = head_grid(rows)
    >>> step, grid.to_numpy().tolist()
    (5, [[2.0, 3.0], [4.0, nan]])

    Raises:
        ValueError: no per-head value of ``metric``.
    """
    chosen = _heads_of(rows, metric)
    step = int(chosen["step"].max())
    at_step = chosen[chosen["step"] == step]
    grid = at_step.pivot_table(index="layer", columns="head", values="value", aggfunc="last")
    return grid.sort_index().sort_index(axis=1), step


def _heads_of(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
    if "head" not in rows:
        raise ValueError("the rows have no head column (runs logged without circuits=True)")
    chosen = rows[(rows["metric"] == metric) & rows["head"].notna()]
    if chosen.empty:
        known = sorted(rows.loc[rows["head"].notna(), "metric"].unique())
        raise ValueError(
            f"no per-head {metric!r}; train with circuits=True (per-head metrics here: "
            f"{', '.join(known) or 'none'})"
        )
    return chosen.astype({"layer": "int64", "head": "int64"})


def heads_by_layer(rows: pd.DataFrame, metric: str = "qk_spectral_norm") -> Figure:
    """Heatmap layer (rows, L0 at the top) x head (columns) of a per-head circuit metric at the last
    step, one panel per run (and stack).

    Raises:
        ValueError: no per-head value of ``metric``.
    """
    chosen = _heads_of(rows, metric)
    panels = _panels(chosen)
    fig = Figure(figsize=(6.5, 3.0 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (run, stack, of_panel) in zip(axes, panels, strict=True):
        grid, step = head_grid(of_panel, metric)
        mesh = ax.pcolormesh(
            _edges(grid.columns.to_numpy(dtype=float)),
            _edges(grid.index.to_numpy(dtype=float)),
            grid.to_numpy(dtype=float),
            cmap="viridis",
            shading="flat",
        )
        fig.colorbar(mesh, ax=ax, label=metric_label(metric))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.invert_yaxis()
        ax.set_title(f"{metric_label(metric)} per head at step {step} — {_of(run, stack)}")
    return fig


def heads_vs_steps(
    rows: pd.DataFrame, layer: int = 0, metric: str = "qk_spectral_norm", *, ax: Axes | None = None
) -> Figure:
    """A per-head circuit metric of one layer against step, one line per head (runs and stacks
    after one another in the legend).

    Raises:
        ValueError: no per-head value of ``metric`` in ``layer``.
    """
    chosen = _heads_of(rows, metric)
    chosen = chosen[chosen["layer"] == layer]
    if chosen.empty:
        raise ValueError(f"no per-head {metric!r} in layer {layer}")
    fig, ax = _axes(ax, (6.5, 4.0))
    for run, stack, of_panel in _panels(chosen):
        for head, line in of_panel.sort_values("step").groupby("head"):
            name = f"H{int(head):02d}" + ("" if len(_runs(chosen)) == 1 else f" {_of(run, stack)}")
            ax.plot(line["step"], line["value"], marker=".", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_label(metric)} per head, layer {layer}")
    _legend(ax, "head", outside=True)
    return fig
