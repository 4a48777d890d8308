"""A metric's difference between runs: each run minus a baseline run, or minus its partner.

The study compares attention variants by their loss difference against a reference run vs
training tokens, and initialisations of the *same* variant by a paired difference. Runs are aligned
by interpolation (:func:`diff_curves`), optionally smoothed with TensorBoard's EMA (:func:`ema`),
and drawn by :func:`metric_diff`; the SPECTRAL TensorBoard tab serves the same curves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from spectral_callbacks.chart_data import (
    last_writes,
    metric_label,
    metric_name,
    role_glyph,
    runs_of,
)

if TYPE_CHECKING:  # matplotlib only where metric_diff draws (the tab imports diff_curves)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _series(rows: pd.DataFrame, run: str, metric: str) -> pd.Series:
    """One scalar of one run as value by step (the latest write per step), sorted by step."""
    of_run = rows[(rows["run"] == run) & (rows["metric"] == metric)]
    if of_run.empty:
        have = ", ".join(sorted(map(str, rows.loc[rows["run"] == run, "metric"].unique())))
        raise ValueError(f"run {run!r} has no `{metric}` scalar; it has: {have or 'nothing'}")
    last = last_writes(of_run, ["step"])
    return pd.Series(last["value"].to_numpy(dtype=float), index=last["step"].to_numpy(dtype=float))


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def pair_runs(runs: Sequence[str], pattern: str, partner: str) -> list[tuple[str, str, str]]:
    """Pair each run named like ``pattern`` with the run named like ``partner``.

    ``{name}`` placeholders in ``pattern`` match any text without ``/``; ``partner`` is ``pattern``'s
    twin with the same placeholders filled in the same way. The label of a pair is its placeholder
    values.

    Returns:
        ``(label, run, partner_run)`` per run matching ``pattern``, in run order; a run whose
        partner is not among ``runs`` gets ``partner_run`` ``""``.

    Raises:
        ValueError: no placeholder in ``pattern``, ``partner`` uses one ``pattern`` lacks, or no run
            matches ``pattern``.

    Example::

        >>> pair_runs(["mha/zero_out", "mha/gpt", "mqa/zero_out", "mqa/gpt"],
        ...           "{variant}/zero_out", "{variant}/gpt")
        [('mha', 'mha/zero_out', 'mha/gpt'), ('mqa', 'mqa/zero_out', 'mqa/gpt')]
    """
    names = _PLACEHOLDER.findall(pattern)
    if not names:
        raise ValueError(
            f"a pair pattern needs a {{name}} placeholder, e.g. '{{variant}}/zero_out', got {pattern!r}"
        )
    extra = set(_PLACEHOLDER.findall(partner)) - set(names)
    if extra:
        raise ValueError(
            f"the partner pattern {partner!r} uses {sorted(extra)}, which {pattern!r} does not define"
        )
    pieces = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ..., literal
    regex = "".join(
        re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>[^/]+)" for i, piece in enumerate(pieces)
    )
    pairs = []
    for run in runs:
        match = re.fullmatch(regex, run)
        if match is None:
            continue
        values = match.groupdict()
        other = partner
        for name, value in values.items():
            other = other.replace(f"{{{name}}}", value)
        label = ", ".join(values[name] for name in dict.fromkeys(names))
        pairs.append((label, run, other if other in runs and other != run else ""))
    if not pairs:
        raise ValueError(f"no run is named like {pattern!r}; the runs are: {', '.join(runs)}")
    return pairs


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: a debiased exponential moving average; non-finite values kept.

    ``weight`` in [0, 1): 0 leaves the curve as it is, 0.99 averages over ~100 points.

    >>> ema(np.array([1.0, 3.0, 3.0]), 0.5).tolist()
    [1.0, 2.3333333333333335, 2.7142857142857144]
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"the smoothing weight must be in [0, 1), got {weight!r}")
    smoothed, last, count = np.empty(len(values)), 0.0, 0
    for i, value in enumerate(values):
        if not np.isfinite(value):
            smoothed[i] = value
            continue
        last, count = last * weight + (1.0 - weight) * value, count + 1
        smoothed[i] = last / (1.0 - weight**count)
    return smoothed


@dataclass
class DiffCurves:
    """The difference curves of :func:`diff_curves`: what ``metric-diff`` draws and the tab serves."""

    curves: dict[str, pd.Series]  # label -> difference, indexed by x
    left_out: dict[str, str]  # run -> why it has no curve
    title: str
    ylabel: str


def diff_curves(
    rows: pd.DataFrame,
    metric: str,
    baseline: str | None = None,
    *,
    pair: tuple[str, str] | None = None,
    x: str = "step",
    layer: int | None = None,
    role: str | None = None,
    smoothing: float = 0.0,
) -> DiffCurves:
    """``metric`` of each run minus a reference run, against steps or another logged scalar.

    The reference is one ``baseline`` run for all, or with ``pair`` each run's own partner
    (:func:`pair_runs`), e.g. ``("{variant}/zero_out", "{variant}/gpt")`` gives, per variant, the
    zero-init run minus the GPT-init run. Runs are aligned by linear interpolation: the reference
    curve is interpolated at each run's x values; points outside its x range are left out (no
    extrapolation). With ``x`` a scalar such as ``train/tokens``, each run's steps are first mapped
    to that scalar by interpolation. A curve that cannot be made (its reference has one point, or
    no x in common) is left out with the reason.

    Args:
        rows: tidy rows; other scalars carry their tag as ``metric`` (``read_runs(...,
            all_scalars=True)``).
        metric: the scalar to compare, e.g. ``train/loss`` or ``stable_rank``.
        baseline: the run subtracted from every other run (or give ``pair``).
        pair: ``(pattern, partner)`` name patterns (or give ``baseline``).
        x: ``"step"`` (default) or the tag of another scalar, e.g. tokens seen.
        layer, role: pick one (layer, role) series of a spectral metric (default None: none).
        smoothing: TensorBoard's EMA weight in [0, 1) applied to each difference (default 0: none).

    Raises:
        ValueError: neither or both of ``baseline`` and ``pair``, an unknown baseline, a missing
            scalar, several series left, a bad smoothing weight, or no curve at all.
    """
    if (baseline is None) == (pair is None):
        raise ValueError("metric_diff needs either a baseline run or a pair of name patterns")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"the smoothing weight must be in [0, 1), got {smoothing!r}")
    chosen = rows[rows["metric"] == metric]
    if layer is not None:
        chosen = chosen[chosen["layer"] == layer]
    if role is not None:
        chosen = chosen[chosen["role"] == role]
    per_series = chosen.groupby(["run"], dropna=False)[["layer", "role"]].nunique(dropna=False)
    if chosen.empty:
        raise ValueError(f"no rows of `{metric}` (layer={layer}, role={role}) to compare")
    if (per_series > 1).any().any():
        raise ValueError(f"`{metric}` has several (layer, role) series; pick one layer and role")
    runs = runs_of(rows)
    left_out: dict[str, str] = {}
    # A spectral metric's series is one matrix: the title and axis say which.
    what = metric_label(metric)
    if layer is not None or role is not None:
        where = " ".join(
            part
            for part in (f"layer {layer}" if layer is not None else "", role_glyph(role or ""))
            if part
        )
        what = f"{metric_name(metric)} of {where}"
    if pair is not None:
        wanted = []
        for label, run, partner in pair_runs(runs, *pair):
            if partner:
                wanted.append((label, run, partner))
            else:
                left_out[run] = f"no partner run named like {pair[1]!r}"
        title = f"{what}: {pair[0]} − {pair[1]}"
        ylabel = f"Δ {what} ({pair[0]} − {pair[1]})"
    else:
        if baseline not in runs:
            raise ValueError(f"the baseline {baseline!r} is not one of the runs: {', '.join(runs)}")
        wanted = [(run, run, str(baseline)) for run in runs if run != baseline]
        if not wanted:
            raise ValueError("metric-diff needs at least one run besides the baseline")
        title = f"{what} relative to {baseline}"
        ylabel = f"Δ {what} (run − {baseline})"
    scalars = pd.concat([chosen, rows[rows["metric"] == x]]) if x != "step" else chosen

    def along_x(run: str) -> pd.Series:
        values = _series(scalars, run, metric)
        if x == "step":
            return values
        position = _series(rows, run, x)
        # Map each step of `metric` to the x scalar logged at (or interpolated between) steps.
        mapped = np.interp(values.index, position.index, position.to_numpy())
        return pd.Series(values.to_numpy(), index=mapped).sort_index()

    curves: dict[str, pd.Series] = {}
    for label, run, reference_run in wanted:
        reference = along_x(reference_run)
        if len(reference) < 2:
            if baseline is not None:
                raise ValueError(
                    f"the baseline {baseline!r} has `{metric}` at one {x} only "
                    f"({reference.index[0]:g}): a difference needs a baseline curve; pick a "
                    "trained run as the baseline"
                )
            left_out[run] = f"its partner {reference_run!r} has `{metric}` at one {x} only"
            continue
        curve = along_x(run)
        inside = (curve.index >= reference.index.min()) & (curve.index <= reference.index.max())
        curve = curve[inside]
        if curve.empty:
            left_out[run] = f"no {x} inside {reference_run!r}'s range"
            continue
        diff = curve.to_numpy() - np.interp(curve.index, reference.index, reference.to_numpy())
        if smoothing:
            diff = ema(diff, smoothing)
        curves[label] = pd.Series(diff, index=curve.index)
    if not curves:
        why = "; ".join(f"{run}: {reason}" for run, reason in left_out.items())
        raise ValueError(f"no difference curve could be drawn ({why})")
    return DiffCurves(curves, left_out, title, ylabel)


def metric_diff(
    rows: pd.DataFrame,
    metric: str,
    baseline: str | None = None,
    *,
    pair: tuple[str, str] | None = None,
    x: str = "step",
    layer: int | None = None,
    role: str | None = None,
    smoothing: float = 0.0,
    ax: Axes | None = None,
) -> Figure:
    """Draw the :func:`diff_curves` (same arguments), one line per run or pair.

    A run left out is named under the figure with the reason (see the module docstring).

    Args:
        ax: draw into this panel (default None: a new figure).

    Raises:
        ValueError: as :func:`diff_curves`.
    """
    diffs = diff_curves(
        rows, metric, baseline, pair=pair, x=x, layer=layer, role=role, smoothing=smoothing
    )
    from spectral_callbacks.charts import axes_of, draw_legend, note_left_out

    fig, ax = axes_of(ax, (6.5, 4.0))
    for label, diff in diffs.curves.items():
        ax.plot(
            diff.index.to_numpy(dtype=float),
            diff.to_numpy(),
            marker="o" if len(diff) == 1 else None,
            label=label,
        )
    zero_label = f"{baseline} (baseline)" if baseline is not None else None
    ax.axhline(0.0, color="black", linewidth=0.8, label=zero_label)
    ax.set_xlabel("optimizer step" if x == "step" else x)
    ax.set_ylabel(diffs.ylabel)
    ax.set_title(diffs.title + (f" (EMA {smoothing:g})" if smoothing else ""))
    ax.grid(alpha=0.3)
    draw_legend(ax, "run" if pair is None else "pair")
    note_left_out(fig, diffs.left_out)  # type: ignore[arg-type]
    return fig  # type: ignore[return-value]
