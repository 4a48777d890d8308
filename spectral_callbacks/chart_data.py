"""The data of the charts, shaped from tidy rows: no matplotlib here.

What a chart draws is decided here, once, for every place that draws it: the matplotlib figures of
``charts.py`` (the callback's live figures, ``plot``), the SPECTRAL tab's JSON
(``tensorboard_plugin/views.py``) and ``metric-diff`` (``offline/differences.py``). The tab's
server imports this module, never matplotlib.

* the role and metric vocabulary of a figure: :func:`role_glyph`, :func:`metric_label`,
  :func:`role_color` (one colour per role in every chart, the tab's included), :func:`ordered_roles`;
* selecting rows with a clear error: :func:`select_rows`, :func:`select_points`;
* the value a chart shows: :func:`last_writes` (the last finite write per series),
  :func:`fallbacks` (where that was older than the series' newest step), :func:`one_per_layer`
  (a layer's experts, or its heads, as one point with their spread; :func:`spread_over` and
  :func:`spread_label` name which), :func:`layer_step_grid` (a heatmap's
  cells), :func:`compression_rows` (logged, or computed from the stable rank), :func:`depths`;
* how rows split into panels: :func:`runs_of`, :func:`stacks_of`, :func:`run_panels`,
  :func:`panel_title`, :func:`missing_runs`.

Example::

    >>> rows = pd.DataFrame({"run": "a", "step": [0, 5, 5], "metric": "alpha", "layer": 0,
    ...     "role": "Q", "value": [1.0, 2.0, 3.0], "wall_time": [0.0, 1.0, 2.0]})
    >>> last_writes(rows, ["run", "layer"])["value"].tolist()
    [3.0]
    >>> role_glyph("MLP_up"), role_color("Q")
    ('MLP↑', '#1f77b4')
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from spectral_callbacks.names import (
    ROLES,
    is_heads_role,
    ordered_stacks,
    relative_depth,
    role_sort_key,
    split_group,
)

if TYPE_CHECKING:  # torch is imported only where compression is computed
    import torch


# How a role reads in a paper figure; roles not listed (variant roles such as Q_down) are verbatim.
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
    "qk_spectral_norm": r"QK circuit $s\,\sigma_1(W_{QK}^h)$",
    "qk_logit_bound": r"QK logit bound per unit input norms",
    "qk_norm_logit_bound": r"QK-norm logit bound $|\mathrm{logit}|$",
    "qk_stable_rank": r"QK circuit stable rank",
    "ov_spectral_norm": r"OV circuit norm $\sigma_1(W_{OV}^h)$",
    "ov_stable_rank": r"OV circuit stable rank",
}
# Labels whose formula is their object: a title keeps it, in plain text.
_TITLE_NAMES = {
    "energy_rank_90": "rank holding 90 % of ‖W‖²",
    "update_energy_rank_90": "update rank holding 90 % of ‖ΔW‖²",
}


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


def ordered_roles(roles: Sequence[str]) -> list[str]:
    """``roles`` in the one order every surface uses (charts, the tab, the tables):
    ``names.ROLE_ORDER``, so ``Q_cross`` follows ``O`` and ``MLP_gate`` precedes ``MLP_up``
    everywhere."""
    return sorted(set(roles), key=role_sort_key)


# matplotlib's tab10 (its default cycle C0..C9); the SPECTRAL tab draws with the same list.
PALETTE: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip


# tab20's light partner of each tab10 colour (the same order).
LIGHT: tuple[str, ...] = (
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
    "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
)  # fmt: skip

# Roles that sit beside a canonical one in the same model take the canonical colour's light
# partner: a decoder's cross-attention beside its self-attention (T5, BART, Whisper), the gate
# beside MLP_up (Llama, Mixtral's experts).
PARTNER_COLORS: dict[str, str] = {
    "Q_cross": LIGHT[0],
    "K_cross": LIGHT[1],
    "V_cross": LIGHT[2],
    "O_cross": LIGHT[3],
    "MLP_gate": LIGHT[4],
}

# The attention variants' roles and the MoE's, fixed so that no two roles of one model share a
# colour (four spare colours by hash cannot tell MLA's four extra roles apart): MLA / MFA /
# DeepSeek (with its router and shared experts) in the spare colours; TPA's factors, which
# replace Q, K and V, in the colour of the role they factor (A) and its light partner (B).
VARIANT_COLORS: dict[str, str] = {
    "Q_down": PALETTE[6],
    "Q_up": PALETTE[7],
    "KV_down": PALETTE[8],
    "K_rope": PALETTE[9],
    "KV": LIGHT[9],
    "Router": LIGHT[5],
    "MLP_shared_gate": LIGHT[6],
    "MLP_shared_up": LIGHT[7],
    "MLP_shared_down": LIGHT[8],
    "Q_A": PALETTE[0],
    "Q_B": LIGHT[0],
    "K_A": PALETTE[1],
    "K_B": LIGHT[1],
    "V_A": PALETTE[2],
    "V_B": LIGHT[2],
}

# GLA's latent groups K_g<i> / V_g<i> (no plain K or V beside them): groups 0 and 1 in the base
# role's colour and its light partner, groups 2 and 3 in spare light colours.
_GROUP_COLORS: dict[str, tuple[str, ...]] = {
    "K": (PALETTE[1], LIGHT[1], LIGHT[6], LIGHT[7]),
    "V": (PALETTE[2], LIGHT[2], LIGHT[8], LIGHT[5]),
}


def role_color(role: str) -> str:
    """The colour of ``role`` in every chart, whichever roles a chart holds.

    The six canonical roles own the first six colours; the cross-attention roles and
    ``MLP_gate`` the light partner of Q, K, V, O and MLP_up (``PARTNER_COLORS``); the attention
    variants' and the MoE's roles a fixed colour each (``VARIANT_COLORS``), distinct within each
    model of ``examples/attention_variants.py``; any other role one of the four spare colours by a hash
    of its name, so it too keeps its colour from chart to chart and run to run.

    >>> role_color("Q"), role_color("MLP_down"), role_color("Q_cross")
    ('#1f77b4', '#8c564b', '#aec7e8')
    >>> role_color("Q_up") != role_color("K_rope")
    True
    """
    if role in ROLES:
        return PALETTE[ROLES.index(role)]
    if role in PARTNER_COLORS:
        return PARTNER_COLORS[role]
    if role in VARIANT_COLORS:
        return VARIANT_COLORS[role]
    base, group = split_group(role)
    if group is not None and base in _GROUP_COLORS and group < len(_GROUP_COLORS[base]):
        return _GROUP_COLORS[base][group]
    spare = PALETTE[len(ROLES) :]
    return spare[zlib.crc32(role.encode()) % len(spare)]


def role_colors(roles: Sequence[str]) -> dict[str, str]:
    return {role: role_color(role) for role in ordered_roles(roles)}


def select_rows(rows: pd.DataFrame, *, metric: str, what: str, **equal: object) -> pd.DataFrame:
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


def select_points(rows: pd.DataFrame, *, metric: str, what: str, **equal: object) -> pd.DataFrame:
    """:func:`select_rows` over :func:`one_per_layer` of ``metric``'s rows: a layer's experts are one
    point, their mean, with ``low``/``high`` their min and max."""
    of_metric = rows[rows["metric"] == metric]
    points = one_per_layer(of_metric) if len(of_metric) else rows
    return select_rows(points, metric=metric, what=what, **equal)


def last_writes(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last finite value per ``keys`` (the highest step, the latest write at that step).

    A series whose newest values are NaN (non-finite weights from some step on) gives its last
    finite row, with that row's step; :func:`fallbacks` says where that happened.
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
    last = last_writes(rows, ["layer", "step"])
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


def fallbacks(rows: pd.DataFrame, final: pd.DataFrame) -> dict[str, str]:
    """Per run, a note when ``final`` (from :func:`last_writes`) is older than its series' newest
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


def missing_runs(rows: pd.DataFrame, drawn: pd.DataFrame, why: str) -> dict[str, str]:
    """``why`` for every run of ``rows`` with nothing in ``drawn`` (so none is dropped silently)."""
    have = set(drawn["run"].unique())
    return {run: why for run in runs_of(rows) if run not in have}


def runs_of(rows: pd.DataFrame) -> list[str]:
    return rows["run"].unique().tolist()  # first-seen order, the order the user named the runs


def stacks_of(rows: pd.DataFrame) -> list[str]:
    """The stacks of ``rows`` in ``names.STACK_ORDER`` (``[""]`` for a model with one stack)."""
    if "stack" not in rows or not len(rows):
        return [""]
    return ordered_stacks(rows["stack"].unique()) or [""]


def run_panels(rows: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """One panel per run and stack (an encoder's layer 0 is not its decoder's): ``(run, stack,
    rows)``, runs in the order named, a run's stacks in ``names.STACK_ORDER``."""
    return [
        (run, stack, of_run[of_run["stack"] == stack] if "stack" in of_run else of_run)
        for run in runs_of(rows)
        for of_run in [rows[rows["run"] == run]]
        for stack in stacks_of(of_run)
    ]


def panel_title(run: str, stack: str) -> str:
    """A panel's name: the run, and its stack where it has one (``t5 · dec``)."""
    return f"{run} · {stack}" if stack else run


# One point of a chart: a matrix, or a layer's experts of one role (or its heads), at one step.
POINT_COLUMNS = ["run", "stack", "layer", "role", "step", "metric"]


def one_per_layer(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with one row per (run, stack, layer, role, step, metric) and the spread over a
    layer's experts or heads: the row of a layer's experts of one role (or of its attention
    heads, for a circuit metric such as ``qk_spectral_norm``) holds their mean as ``value`` and
    their min and max as ``low`` and ``high`` (both NaN for a lone matrix); ``stack`` is ``""``
    where rows have none. :func:`spread_over` says which of the two a role's spread is over.

    Experts and heads come as their own rows (the callback's history; an export with
    ``experts="each"``; every head's ``spectral_<metric>/L00/H03/heads``) or as their logged
    aggregates (role ``MLP_down/mean``, ``/min``, ``/max``, ``heads/mean`` ..., as ``export``
    reads them); where both are present the logged aggregates are kept, so a head's own value is
    never a point of its role's line. NaN values are left out of the mean, min and max, as the
    callback leaves them out.

    >>> rows = pd.DataFrame({"run": "a", "step": 0, "metric": "alpha", "layer": [0, 1, 1, 1],
    ...     "role": ["Q", "MLP_up", "MLP_up", "MLP_up"], "expert": [None, 0, 1, 2],
    ...     "value": [0.5, 1.0, 2.0, 6.0], "wall_time": 0.0})
    >>> one_per_layer(rows)[["layer", "role", "value", "low", "high"]].to_dict("records")
    [{'layer': 0, 'role': 'Q', 'value': 0.5, 'low': nan, 'high': nan}, \
{'layer': 1, 'role': 'MLP_up', 'value': 3.0, 'low': 1.0, 'high': 6.0}]
    >>> heads = pd.DataFrame({"run": "a", "step": 0, "metric": "qk_spectral_norm", "layer": 0,
    ...     "role": ["heads", "heads", "heads/mean", "heads/min", "heads/max"],
    ...     "head": [0, 1, None, None, None], "value": [1.0, 3.0, 2.0, 1.0, 3.0], "wall_time": 0.0})
    >>> one_per_layer(heads)[["role", "value", "low", "high"]].to_dict("records")
    [{'role': 'heads', 'value': 2.0, 'low': 1.0, 'high': 3.0}]
    """
    rows = rows.assign(stack=rows["stack"].fillna("") if "stack" in rows else "")
    roles = rows["role"].astype("string")
    aggregate = roles.str.extract(r"/(mean|min|max)$", expand=False)
    of_aggregate = aggregate.notna().to_numpy(dtype=bool)
    # an expert's or a head's own value: one member of what its layer's aggregates are over
    of_member = np.zeros(len(rows), dtype=bool)
    for column in ("expert", "head"):
        if column in rows:
            of_member |= rows[column].notna().to_numpy(dtype=bool)
    plain = rows[~of_aggregate & ~of_member].assign(low=np.nan, high=np.nan)
    if not (of_aggregate.any() or of_member.any()):
        return plain
    logged = rows[of_aggregate].assign(
        role=roles[of_aggregate].str.rsplit("/", n=1).str[0].astype(object),
        aggregate=aggregate[of_aggregate].astype(object),
    )
    spread = spread_rows(logged, "aggregate")
    computed = spread_rows(rows[of_member & ~of_aggregate], None)
    if len(spread) and len(computed):  # members beside their logged aggregates: those win
        logged_points = pd.MultiIndex.from_frame(spread[POINT_COLUMNS].astype(object))
        computed_points = pd.MultiIndex.from_frame(computed[POINT_COLUMNS].astype(object))
        computed = computed[~computed_points.isin(logged_points)]
    joined = pd.concat([f for f in (plain, spread, computed) if len(f)], ignore_index=True)
    for column in ("expert", "head"):
        if column in rows:
            joined[column] = pd.array([pd.NA] * len(joined), dtype="Int64")
    return joined.astype({"layer": rows["layer"].dtype})


def spread_over(role: str) -> str:
    """What the spread (``low``/``high``) of ``role``'s line is over, as a chart names it:
    ``"heads"`` for a layer's attention heads (a circuit metric), else ``"experts"``.

    >>> spread_over("heads"), spread_over("heads_cross"), spread_over("MLP_down")
    ('heads', 'heads', 'experts')
    """
    return "heads" if is_heads_role(role) else "experts"


def spread_label(over: Iterable[str]) -> str:
    """The legend entry of the bands (or whiskers) spanning what ``over`` names (each a
    :func:`spread_over`): ``min–max over heads``, ``min–max over experts``, or both.

    >>> spread_label(["heads"]), spread_label(["experts", "experts"])
    ('min–max over heads', 'min–max over experts')
    """
    return f"min–max over {' / '.join(sorted(set(over), reverse=True)) or 'experts'}"


def spread_rows(rows: pd.DataFrame, aggregate_column: str | None) -> pd.DataFrame:
    """One row per point of ``rows``: ``value`` the mean, ``low``/``high`` the min/max, over the
    rows' own values (``aggregate_column=None``) or as the aggregate each row names."""
    if rows.empty:
        return pd.DataFrame(columns=[*POINT_COLUMNS, "value", "low", "high"])
    points = rows.groupby(POINT_COLUMNS, sort=False, dropna=False)
    if aggregate_column is None:
        stats = points["value"].agg(["mean", "min", "max"])
    else:
        stats = (
            rows.groupby([*POINT_COLUMNS, aggregate_column], sort=False, dropna=False)["value"]
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


def depths(rows: pd.DataFrame) -> pd.Series:
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
    for run in runs_of(per_layer):
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
            percent = compression(float64_values(ranks["value"]), float64_values(reference)).numpy()
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
        select_rows(rows.iloc[0:0], metric="stable_rank", what="compression")  # raises, naming it
    return pd.concat(frames), left_out


def float64_values(values: pd.Series) -> torch.Tensor:
    """A float64 tensor of ``values`` (NaN kept)."""
    import torch

    return torch.tensor(values.to_numpy(dtype=float), dtype=torch.float64)


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
    chosen = heads_of(rows, metric)
    step = int(chosen["step"].max())
    at_step = chosen[chosen["step"] == step]
    grid = at_step.pivot_table(index="layer", columns="head", values="value", aggfunc="last")
    return grid.sort_index().sort_index(axis=1), step


def heads_of(rows: pd.DataFrame, metric: str) -> pd.DataFrame:
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
