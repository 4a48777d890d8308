"""The standard charts of the field, drawn from tidy rows (see ``spectral_callbacks.events``).

Every function takes the tidy-row DataFrame (columns ``run, step, metric, layer, depth, role, value,
wall_time``) and returns a :class:`matplotlib.figure.Figure` built with the object-oriented API: no
``pyplot`` global state, so the callback can draw figures from any thread and tests can inspect the
axes. ``save_figure`` writes one to ``.png``, ``.svg`` or ``.pdf``.

* :func:`alpha_vs_depth` - alpha of one role against relative depth i/(L-1), one line per run.
* :func:`rank_vs_steps` - a metric of one layer against steps, one line per role (a line style per run).
* :func:`compression_by_layer` - final compression % by layer, grouped bars per role (a panel per run).
* :func:`compression_wave` - heatmap layer x step of one role's compression (a panel per run).
* :func:`metric_diff` - any scalar of each run minus a baseline run, against steps or another scalar
  (the aligned curves themselves: :func:`diff_to_baseline`).

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

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from spectral_callbacks.names import ROLES

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


def _ordered_roles(roles: Sequence[str]) -> list[str]:
    """Canonical roles in chart order first, then the extra roles sorted."""
    present = set(roles)
    return [r for r in ROLES if r in present] + sorted(present - set(ROLES))


def _role_colors(roles: Sequence[str]) -> dict[str, str]:
    return {role: f"C{i % 10}" for i, role in enumerate(_ordered_roles(roles))}


def _select(rows: pd.DataFrame, *, metric: str, what: str, **equal: object) -> pd.DataFrame:
    """Rows of ``metric`` (per-layer only) matching ``equal``; a clear ValueError when none are left."""
    chosen = rows[(rows["metric"] == metric) & rows["layer"].notna()]
    for column, value in equal.items():
        if value is not None:
            chosen = chosen[chosen[column] == value]
    if chosen.empty:
        have = ", ".join(sorted(map(str, rows["metric"].unique()))) or "nothing"
        filters = ", ".join(f"{k}={v!r}" for k, v in equal.items() if v is not None)
        raise ValueError(
            f"{what} needs per-layer `{metric}` rows{' with ' + filters if filters else ''}; "
            f"the rows hold: {have}. Log `{metric}` or pick another --role/--layer."
        )
    return chosen


def _final(rows: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The last logged value per ``keys`` (the highest step, the latest write at that step)."""
    ordered = rows.sort_values(["step", "wall_time"], kind="stable")
    return ordered.groupby(keys, as_index=False, sort=True).last()


def _legend(ax: Axes, title: str) -> None:
    """A legend when something is labelled (a run may be named ""), else none and no warning."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title=title, fontsize="small")


def _runs(rows: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(rows["run"]))  # first-seen order, the order the user named the runs


def _depths(rows: pd.DataFrame) -> pd.Series:
    """Relative depth per row, from ``depth`` where known, else layer / max layer of the run."""
    fallback = rows["layer"] / rows.groupby("run")["layer"].transform("max").clip(lower=1)
    return rows["depth"].fillna(fallback) if "depth" in rows else fallback


def alpha_vs_depth(rows: pd.DataFrame, role: str = "Q") -> Figure:
    """Alpha of ``role`` against relative depth i/(L-1), one line per run, at each run's last step.

    Args:
        rows: tidy rows with ``alpha`` rows.
        role: the role to draw (default ``"Q"``, the Q projection of the paper's figure).

    Raises:
        ValueError: no per-layer ``alpha`` rows of ``role``.
    """
    chosen = _select(rows, metric="alpha", what="alpha-depth", role=role)
    final = _final(chosen.assign(depth=_depths(chosen)), ["run", "layer"])
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for run in _runs(chosen):
        line = final[final["run"] == run].sort_values("depth")
        ax.plot(line["depth"].to_numpy(), line["value"].to_numpy(), marker="o", label=run)
    ax.set_xlabel("relative depth i / (L − 1)")
    ax.set_ylabel(metric_label("alpha"))
    ax.set_title(f"α of {role_glyph(role)} vs relative depth")
    ax.set_xlim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    _legend(ax, "run")
    return fig


def rank_vs_steps(rows: pd.DataFrame, layer: int = 0, metric: str = "stable_rank") -> Figure:
    """``metric`` of one layer against steps: one line per role, one line style per run.

    Args:
        rows: tidy rows.
        layer: the layer to draw (default 0, where the collapse is strongest).
        metric: the metric to draw (default ``"stable_rank"``).

    Raises:
        ValueError: no rows of ``metric`` at ``layer``.
    """
    chosen = _select(rows, metric=metric, what="rank-steps", layer=layer)
    colors = _role_colors(chosen["role"].unique())
    runs = _runs(chosen)
    fig = Figure(figsize=(6.5, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for run_index, run in enumerate(runs):
        of_run = chosen[chosen["run"] == run]
        for role in colors:
            line = of_run[of_run["role"] == role].sort_values("step", kind="stable")
            if line.empty:
                continue
            label = role_glyph(role) if len(runs) == 1 else f"{run} · {role_glyph(role)}"
            ax.plot(
                line["step"].to_numpy(),
                line["value"].to_numpy(),
                color=colors[role],
                linestyle=_LINE_STYLES[run_index % len(_LINE_STYLES)],
                label=label,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_label(metric).split(' $')[0]} of layer {layer} vs steps")
    ax.grid(alpha=0.3)
    _legend(ax, "role" if len(runs) == 1 else "run · role")
    return fig


def _compression_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Logged ``compression`` rows, or computed from ``stable_rank`` against each matrix's first step."""
    logged = rows[(rows["metric"] == "compression") & rows["layer"].notna()]
    if not logged.empty:
        return logged
    ranks = _select(rows, metric="stable_rank", what="compression")
    ranks = ranks.sort_values(["step", "wall_time"], kind="stable")
    reference = ranks.groupby(["run", "layer", "role"])["value"].transform("first")
    return ranks.assign(metric="compression", value=100.0 * (1.0 - ranks["value"] / reference))


def compression_by_layer(rows: pd.DataFrame) -> Figure:
    """Final compression % by layer, grouped bars per role; one panel per run.

    Uses the logged ``compression`` rows; without them, computes 100 (1 - s_t / s_0) from
    ``stable_rank`` with s_0 the first logged step of each matrix.

    Raises:
        ValueError: neither ``compression`` nor ``stable_rank`` rows.
    """
    final = _final(_compression_rows(rows), ["run", "layer", "role"])
    runs = _runs(final)
    colors = _role_colors(final["role"].unique())
    fig = Figure(figsize=(7.0, 3.2 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    width = 0.8 / len(colors)
    for ax, run in zip(axes, runs, strict=True):
        of_run = final[final["run"] == run]
        layers = np.sort(of_run["layer"].unique()).astype(int)
        for i, role in enumerate(colors):
            bars = of_run[of_run["role"] == role].set_index("layer")["value"]
            heights = bars.reindex(layers).to_numpy(dtype=float)
            x = np.arange(len(layers)) + (i - (len(colors) - 1) / 2) * width
            ax.bar(x, heights, width=width, color=colors[role], label=role_glyph(role))
        ax.set_xticks(np.arange(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("final compression (%)")
        ax.set_title(f"Final compression by layer — {run}")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
        # Right of the axes: inside, it would cover the first layers' bars (compression reaches ~90 %).
        ax.legend(title="role", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def compression_wave(rows: pd.DataFrame, role: str = "Q") -> Figure:
    """Heatmap of ``role``'s compression, layer (rows) x step (columns); one panel per run.

    Raises:
        ValueError: no compression (or stable rank) rows of ``role``.
    """
    chosen = _compression_rows(rows)
    chosen = _select(chosen, metric="compression", what="compression-wave", role=role)
    runs = _runs(chosen)
    fig = Figure(figsize=(7.0, 3.0 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs, strict=True):
        last = _final(chosen[chosen["run"] == run], ["layer", "step"])
        grid = last.pivot(index="layer", columns="step", values="value").sort_index()
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
        ax.set_title(f"Compression wave of {role_glyph(role)} — {run}")
    return fig


def _edges(centers: np.ndarray) -> np.ndarray:
    """Cell edges around sorted centers (one unit wide for a single center)."""
    if len(centers) == 1:
        return np.array([centers[0] - 0.5, centers[0] + 0.5])
    middle = (centers[1:] + centers[:-1]) / 2
    return np.concatenate([[2 * centers[0] - middle[0]], middle, [2 * centers[-1] - middle[-1]]])


def _series(rows: pd.DataFrame, run: str, metric: str) -> pd.Series:
    """One scalar of one run as value by step (the latest write per step), sorted by step."""
    of_run = rows[(rows["run"] == run) & (rows["metric"] == metric)]
    if of_run.empty:
        have = ", ".join(sorted(map(str, rows.loc[rows["run"] == run, "metric"].unique())))
        raise ValueError(f"run {run!r} has no `{metric}` scalar; it has: {have or 'nothing'}")
    last = _final(of_run, ["step"])
    return pd.Series(last["value"].to_numpy(dtype=float), index=last["step"].to_numpy(dtype=float))


def diff_to_baseline(
    rows: pd.DataFrame,
    metric: str,
    baseline: str,
    *,
    x: str = "step",
    layer: int | None = None,
    role: str | None = None,
) -> dict[str, pd.Series]:
    """``metric`` of each run minus the ``baseline`` run, as a difference indexed by ``x``.

    Runs are aligned by linear interpolation: the baseline's curve is interpolated at each run's
    x values; points outside the baseline's x range are left out (no extrapolation). With ``x`` a
    scalar such as ``tokens``, each run's steps are first mapped to that scalar by interpolation.
    :func:`metric_diff` draws these curves; the SPECTRAL TensorBoard tab serves them.

    Args:
        rows: tidy rows; other scalars carry their tag as ``metric`` (``spectral-callbacks export
            --all-scalars``).
        metric: the scalar to compare, e.g. ``train/loss`` or ``stable_rank``.
        baseline: the run subtracted from every other run.
        x: ``"step"`` (default) or the tag of another scalar, e.g. tokens seen.
        layer, role: pick one (layer, role) series of a spectral metric (default None: none).

    Returns:
        For each run but the baseline, in the rows' run order, the difference by x value.

    Raises:
        ValueError: unknown baseline, missing scalar, several series left, or no other run.
    """
    chosen = rows[rows["metric"] == metric]
    if layer is not None:
        chosen = chosen[chosen["layer"] == layer]
    if role is not None:
        chosen = chosen[chosen["role"] == role]
    per_series = chosen.groupby(["run"], dropna=False)[["layer", "role"]].nunique(dropna=False)
    if chosen.empty:
        raise ValueError(f"no rows of `{metric}` (layer={layer}, role={role}) to compare")
    if (per_series > 1).any().any():
        raise ValueError(
            f"`{metric}` has several (layer, role) series; pick one with --layer and --role"
        )
    runs = _runs(rows)
    if baseline not in runs:
        raise ValueError(f"--baseline {baseline!r} is not one of the runs: {', '.join(runs)}")
    others = [run for run in runs if run != baseline]
    if not others:
        raise ValueError("metric-diff needs at least one run besides the baseline")
    scalars = pd.concat([chosen, rows[rows["metric"] == x]]) if x != "step" else chosen

    def along_x(run: str) -> pd.Series:
        values = _series(scalars, run, metric)
        if x == "step":
            return values
        position = _series(rows, run, x)
        # Map each step of `metric` to the x scalar logged at (or interpolated between) steps.
        mapped = np.interp(values.index, position.index, position.to_numpy())
        return pd.Series(values.to_numpy(), index=mapped).sort_index()

    reference = along_x(baseline)
    diffs = {}
    for run in others:
        curve = along_x(run)
        inside = (curve.index >= reference.index.min()) & (curve.index <= reference.index.max())
        curve = curve[inside]
        diff = curve.to_numpy() - np.interp(curve.index, reference.index, reference.to_numpy())
        diffs[run] = pd.Series(diff, index=curve.index)
    return diffs


def metric_diff(
    rows: pd.DataFrame,
    metric: str,
    baseline: str,
    *,
    x: str = "step",
    layer: int | None = None,
    role: str | None = None,
) -> Figure:
    """``metric`` of each run minus the ``baseline`` run, against steps or another logged scalar.

    The curves are those of :func:`diff_to_baseline` (same arguments), one line per run.

    Raises:
        ValueError: unknown baseline, missing scalar, several series left, or no other run.
    """
    diffs = diff_to_baseline(rows, metric, baseline, x=x, layer=layer, role=role)
    fig = Figure(figsize=(6.5, 4.0), layout="constrained")
    ax = fig.add_subplot()
    for run, diff in diffs.items():
        ax.plot(diff.index.to_numpy(dtype=float), diff.to_numpy(), label=run)
    ax.axhline(0.0, color="black", linewidth=0.8, label=f"{baseline} (baseline)")
    ax.set_xlabel("optimizer step" if x == "step" else x)
    ax.set_ylabel(f"Δ {metric_label(metric)} (run − {baseline})")
    ax.set_title(f"{metric_label(metric)} relative to {baseline}")
    ax.grid(alpha=0.3)
    _legend(ax, "run")
    return fig


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
