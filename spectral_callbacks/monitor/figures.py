"""The callback's figures: which charts a run's tidy rows get, drawn and rendered to PNG bytes.

Below both the parent's writer (``dashboards.py``, which writes the PNGs to TensorBoard) and the
child process that draws them (``figure_process.py``), so neither imports the other. The charts
themselves are ``spectral_callbacks.charts`` (object-oriented matplotlib, no pyplot state).
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Sequence
from typing import Any

import pandas as pd

FIGURE_SECTION = "spectral_figures"


def draw_figures(rows: pd.DataFrame, roles: Sequence[str] | None = ("Q",)) -> dict[str, Any]:
    """Figures for the rows seen so far: tag -> ``matplotlib.figure.Figure``.

    α vs relative depth and the compression heatmap (layer x step) for each of ``roles`` (``None``:
    every role), stable rank of the first layer vs steps, and final compression by layer x role.
    A chart whose metric has no finite value in ``rows`` is left out (never a chart of NaN). A
    role of experts is drawn as the mean over experts with their min-max around it. A run that
    logs an update (adapted layers, or ``delta=``) also gets the update's stable rank vs steps,
    one line per layer, for each of ``roles`` that has it, and a run with adapters the update's
    energy rank at 90 % beside each adapter's r. Each figure costs ~0.1-1 s of CPU to draw and
    render, hence few roles by default.
    """
    from spectral_callbacks import charts  # matplotlib: imported where figures are drawn

    figures: dict[str, Any] = {}
    finite = rows["value"].map(math.isfinite).astype(bool) if len(rows) else []
    metrics = set(rows.loc[finite, "metric"]) if len(rows) else set()
    # a layer's experts logged as their aggregates (role MLP_down/mean ...) are drawn as MLP_down
    logged_roles = rows["role"].dropna().astype(str) if len(rows) else pd.Series([], dtype=str)
    present = list(dict.fromkeys(logged_roles.str.replace(r"/(mean|min|max)$", "", regex=True)))
    per_layer = rows[finite & rows["layer"].notna()] if len(rows) else rows
    chosen = present if roles is None else [role for role in roles if role in present]
    if "alpha" in metrics:
        for role in chosen:
            figures[f"{FIGURE_SECTION}/alpha_vs_depth/{role}"] = charts.alpha_vs_depth(
                rows, role=role
            )
    if "stable_rank" in metrics:
        first_layer = int(rows["layer"].min())
        figures[f"{FIGURE_SECTION}/stable_rank_vs_steps/L{first_layer:02d}"] = charts.rank_vs_steps(
            rows, layer=first_layer, metric="stable_rank"
        )
    if "compression" in metrics:
        figures[f"{FIGURE_SECTION}/compression_by_layer"] = charts.compression_by_layer(rows)
        for role in chosen:
            figures[f"{FIGURE_SECTION}/compression_wave/{role}"] = charts.compression_wave(
                rows, role=role
            )
    updated = set(per_layer.loc[per_layer["metric"] == "update_stable_rank", "role"])
    for role in (role for role in chosen if role in updated):
        figures[f"{FIGURE_SECTION}/update_stable_rank_vs_steps/{role}"] = (
            charts.metric_vs_steps_by_layer(rows, role=role, metric="update_stable_rank")
        )
    # An adapter's r is logged as update_rank (NaN for a dense fine-tune's delta=: no r to show).
    if {"update_energy_rank_90", "update_rank"} <= set(per_layer["metric"]):
        figures[f"{FIGURE_SECTION}/update_rank_vs_r"] = charts.update_rank_vs_r(rows)
    return figures


def render(rows: Any, roles: Sequence[str] | None) -> dict[str, bytes]:
    """Every figure of :func:`draw_figures` as PNG bytes, by tag."""
    pngs = {}
    for tag, figure in draw_figures(rows, roles).items():
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        figure.clear()
        pngs[tag] = buffer.getvalue()
    return pngs


def png_size(png: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header.

    >>> png_size(b"\\x89PNG\\r\\n\\x1a\\n" + bytes(8) + (640).to_bytes(4, "big") + (480).to_bytes(4, "big"))
    (640, 480)
    """
    width, height = struct.unpack(">II", png[16:24])
    return width, height


def image_summary(tag: str, png: bytes) -> Any:
    """A TensorBoard ``Summary`` holding ``png`` as it is (no decode and re-encode) under ``tag``."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = png_size(png)
    image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)
    return Summary(value=[Summary.Value(tag=tag, image=image)])
