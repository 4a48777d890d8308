"""The standard charts of the field, drawn from tidy rows (see ``spectral_callbacks.offline.events``).

Below both the callback (its live figures, ``monitor/figures.py``) and the command line and
offline analysis (``plot``, ``offline/differences.py``), so neither reaches into the other. What
each chart shows is shaped in ``chart_data.py`` (no matplotlib), which the SPECTRAL tab uses too;
this module draws it.

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
experts from per-expert rows or from their logged aggregates (role ``MLP_down/mean`` ...). A
circuit metric (``qk_spectral_norm`` ..., role ``heads``) is drawn alike over a layer's heads,
and the legend says "min–max over heads".

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

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from spectral_callbacks.chart_data import (
    compression_rows,
    depths,
    fallbacks,
    head_grid,
    heads_of,
    last_writes,
    layer_step_grid,
    metric_label,
    metric_name,
    missing_runs,
    one_per_layer,
    ordered_roles,
    panel_title,
    role_colors,
    role_glyph,
    run_panels,
    runs_of,
    select_points,
    select_rows,
    spread_label,
    spread_over,
    stacks_of,
)

# Per-run line styles so runs stay apart when colour already encodes the role.
_LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
FIGURE_FORMATS = (".png", ".svg", ".pdf")


# The gid of the edge lines of a band over a layer's experts or heads, followed by what it is
# over (kept out of the legend, in plotted_values): "spread heads".
_SPREAD = "spread"
# Entries in one column of a legend beside the axes: at "small" type 16 fill a 4-inch-tall
# figure's height beside its title; a longer legend ran past the figure's bottom (and
# constrained_layout gave up: "axes sizes collapsed to zero").
_LEGEND_ROWS = 16
# What a further column adds to a figure's width, so its axes keep theirs.
_LEGEND_COLUMN_INCHES = 2.0


def _spread_band(
    ax: Axes, x: np.ndarray, line: pd.DataFrame, color: object, series: str, role: str
) -> None:
    """The min-max around one drawn line of ``role``, where its points are a layer's experts or
    heads (:func:`spread_over`): a shaded band between two thin edge lines, ``<series> min`` and
    ``<series> max`` (a lone point gets a whisker)."""
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
            gid=f"{_SPREAD} {spread_over(role)}",
            label=f"{series} {end}",
        )
    if lone:
        ax.vlines(x[finite], low[finite], high[finite], color=color, linewidth=0.8, alpha=0.7)
    else:
        ax.fill_between(x, low, high, where=finite, color=color, alpha=0.18, linewidth=0)


def draw_legend(ax: Axes, title: str, *, outside: bool = False) -> int:
    """A legend when something is labelled (a run may be named ""), else none and no warning.

    ``outside``: right of the axes, for legends long enough to cover the curves (a run · role
    legend of several runs has 12 entries and more), in columns of at most
    ``_LEGEND_ROWS`` entries, so it stays within the figure's height (three runs of a
    decoder-only model, a T5 and a Mixtral have 30). Returns the number of columns (0: none).
    """
    handles, labels = ax.get_legend_handles_labels()
    gids = [str(getattr(h, "get_gid", lambda: None)() or "") for h in handles]
    entries = [
        (h, label)
        for h, label, gid in zip(handles, labels, gids, strict=True)
        if not gid.startswith(_SPREAD)
    ]
    # the band edges: one entry says what the bands are over (a layer's experts, or its heads)
    over = [gid.split(" ", 1)[1] for gid in gids if gid.startswith(f"{_SPREAD} ")]
    if over:
        from matplotlib.patches import Patch

        entries.append((Patch(facecolor="0.5", alpha=0.35), spread_label(over)))
    if not entries:
        return 0
    handles, labels = [h for h, _ in entries], [label for _, label in entries]
    if outside:
        columns = -(-len(handles) // _LEGEND_ROWS)
        ax.legend(
            handles,
            labels,
            title=title,
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
            ncols=columns,
        )
        return columns
    ax.legend(handles, labels, title=title, fontsize="small")
    return 1


def axes_of(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """``ax`` and its figure, or a new one-panel figure."""
    if ax is not None:
        return ax.figure, ax  # type: ignore[return-value]
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def note_left_out(
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
    chosen = select_points(rows, metric="alpha", what="alpha-depth", role=role)
    final = last_writes(chosen.assign(depth=depths(chosen)), ["run", "stack", "layer"])
    fig, ax = axes_of(ax, (6.0, 4.0))
    left_out = missing_runs(rows, final, f"no alpha of {role_glyph(role)}")
    note_left_out(fig, left_out, fallbacks(chosen, final))
    for run in runs_of(chosen):
        of_run = final[final["run"] == run]
        for stack in stacks_of(of_run):
            line = of_run[of_run["stack"] == stack].sort_values("depth")
            label = f"{run} {stack}" if stack else run
            depth = line["depth"].to_numpy(dtype=float)
            (drawn,) = ax.plot(depth, line["value"].to_numpy(), marker="o", label=label)
            _spread_band(ax, depth, line, drawn.get_color(), label, role)
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
    draw_legend(ax, "run")
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
    chosen = select_points(rows, metric=metric, what="rank-steps", layer=layer)
    colors = role_colors(chosen["role"].unique())
    panels = run_panels(chosen)  # each run and stack its line style: the layer of each stack
    own = ax is None
    fig, ax = axes_of(ax, (6.5, 4.0))
    for index, (run, stack, of_panel) in enumerate(panels):
        for role in colors:
            line = last_writes(of_panel[of_panel["role"] == role], ["step"])
            if line.empty:
                continue
            label = (
                role_glyph(role)
                if len(panels) == 1
                else f"{panel_title(run, stack)} · {role_glyph(role)}"
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
            _spread_band(ax, steps, line, colors[role], label, role)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_name(metric)} of layer {layer} vs steps")
    ax.grid(alpha=0.3)
    several = len(panels) > 1  # then each label names its run and stack, as the title says
    named = [
        name for name, shown in (("run", len(runs_of(chosen)) > 1), ("stack", several)) if shown
    ]
    # beside the curves, never on them; a figure made here widens for each further column
    columns = draw_legend(ax, " · ".join([*named, "role"]), outside=True)
    if own and columns > 1:
        fig.set_size_inches(6.5 + _LEGEND_COLUMN_INCHES * (columns - 1), 4.0)
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
    chosen = select_rows(rows, metric="update_energy_rank_90", what="update-rank", run=run)
    run = run if run is not None else runs_of(chosen)[0]
    chosen = chosen[chosen["run"] == run]
    energy = last_writes(chosen, ["layer", "role"])
    ranks = rows[(rows["metric"] == "update_rank") & (rows["run"] == run) & rows["layer"].notna()]
    r_of = {
        (int(r.layer), r.role): float(r.value)
        for r in last_writes(ranks, ["layer", "role"]).itertuples()
    }
    roles = ordered_roles(list(energy["role"].unique()))
    colors = role_colors(roles)
    layers = sorted(int(layer) for layer in energy["layer"].unique())
    fig, ax = axes_of(ax, (max(6.5, 0.45 * len(layers) * len(roles)), 4.0))
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
    chosen = select_points(rows, metric=metric, what="layer-steps", role=role, run=run)
    run = run if run is not None else runs_of(chosen)[0]
    chosen = chosen[chosen["run"] == run]
    fig, ax = axes_of(ax, (6.5, 4.0))
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    # Each stack its line style, each layer its shade within its stack (darker = deeper).
    for index, (_, stack, of_stack) in enumerate(run_panels(chosen)):
        layers = sorted(int(layer) for layer in of_stack["layer"].unique())
        for i, layer in enumerate(layers):
            line = last_writes(of_stack[of_stack["layer"] == layer], ["step"])
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
            _spread_band(ax, steps, line, shade, label, role)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_name(metric)} of {role_glyph(role)} vs steps")
    ax.grid(alpha=0.3)
    draw_legend(ax, "layer")
    return fig


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
    final = last_writes(chosen, ["run", "stack", "layer", "role"])
    fell_back = fallbacks(chosen, final)
    panels = run_panels(final)  # one per run and stack
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
        colors = role_colors(of_run["role"].unique())  # this run's roles: no gap, no stray entry
        width = 0.8 / len(colors)
        spread_roles: list[str] = []
        for i, role in enumerate(colors):
            bars = of_run[of_run["role"] == role].set_index("layer").reindex(layers)
            heights = bars["value"].to_numpy(dtype=float)
            x = np.arange(len(layers)) + (i - (len(colors) - 1) / 2) * width
            ax.bar(x, heights, width=width, color=colors[role], label=role_glyph(role))
            low, high = bars["low"].to_numpy(dtype=float), bars["high"].to_numpy(dtype=float)
            members = np.isfinite(low) & np.isfinite(high)
            if members.any():  # the bar is the experts' mean: a whisker spans their min-max
                ax.vlines(x[members], low[members], high[members], color="black", linewidth=0.8)
                spread_roles.append(role)
        ax.set_xticks(np.arange(len(layers)), [str(layer) for layer in layers])
        ax.set_xlabel("layer")
        ax.set_ylabel("final compression (%)")
        ax.set_title(f"Final compression by layer — {panel_title(run, stack)}")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if spread_roles:  # after the roles
            handles.append(Line2D([], [], color="black", linewidth=0.8))
            labels.append(spread_label(spread_over(role) for role in spread_roles))
        # Right of the axes: inside, it would cover the first layers' bars (compression reaches ~90 %).
        ax.legend(
            handles,
            labels,
            title="role",
            fontsize="small",
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
    note_left_out(fig, left_out, fell_back)  # type: ignore[arg-type]
    return fig  # type: ignore[return-value]


def compression_wave(rows: pd.DataFrame, role: str = "Q") -> Figure:
    """Heatmap of ``role``'s compression, layer (rows, L0 at the top) x step (columns); one panel per run.

    Raises:
        ValueError: no compression (or stable rank) rows of ``role``.
    """
    logged, left_out = compression_rows(rows)
    of_all = one_per_layer(logged)
    chosen = select_rows(of_all, metric="compression", what="compression-wave", role=role)
    spread = bool(np.isfinite(chosen["low"].to_numpy(dtype=float)).any())
    left_out = {**missing_runs(of_all, chosen, f"no compression of {role_glyph(role)}"), **left_out}
    panels = run_panels(chosen)  # one per run and stack
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
        of_members = f", mean over {spread_over(role)}" if spread else ""
        ax.set_title(
            f"Compression wave of {role_glyph(role)}{of_members} — {panel_title(run, stack)}"
        )
    note_left_out(fig, left_out)
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


def heads_by_layer(rows: pd.DataFrame, metric: str = "qk_spectral_norm") -> Figure:
    """Heatmap layer (rows, L0 at the top) x head (columns) of a per-head circuit metric at the last
    step, one panel per run (and stack).

    Raises:
        ValueError: no per-head value of ``metric``.
    """
    chosen = heads_of(rows, metric)
    panels = run_panels(chosen)
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
        ax.set_title(f"{metric_label(metric)} per head at step {step} — {panel_title(run, stack)}")
    return fig


def heads_vs_steps(
    rows: pd.DataFrame, layer: int = 0, metric: str = "qk_spectral_norm", *, ax: Axes | None = None
) -> Figure:
    """A per-head circuit metric of one layer against step, one line per head (runs and stacks
    after one another in the legend).

    Raises:
        ValueError: no per-head value of ``metric`` in ``layer``.
    """
    chosen = heads_of(rows, metric)
    chosen = chosen[chosen["layer"] == layer]
    if chosen.empty:
        raise ValueError(f"no per-head {metric!r} in layer {layer}")
    fig, ax = axes_of(ax, (6.5, 4.0))
    for run, stack, of_panel in run_panels(chosen):
        for head, line in of_panel.sort_values("step").groupby("head"):
            name = f"H{int(head):02d}" + (
                "" if len(runs_of(chosen)) == 1 else f" {panel_title(run, stack)}"
            )
            ax.plot(line["step"], line["value"], marker=".", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metric_label(metric))
    ax.set_title(f"{metric_label(metric)} per head, layer {layer}")
    draw_legend(ax, "head", outside=True)
    return fig
