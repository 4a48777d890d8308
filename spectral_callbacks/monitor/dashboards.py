"""TensorBoard extras: the custom-scalars layout (multi-line charts) and figures from the charts module.

The layout has, for each logged metric, one chart per layer with every role (like "stable rank by
matrix type") and one chart per role with every layer; TensorBoard shows them in its Custom Scalars
tab. Figures are drawn with ``spectral_callbacks.offline.charts`` (object-oriented matplotlib on the Agg
canvas, no pyplot state) in a child process (``figure_process.py``) and written as PNG image
summaries.

Example::

    >>> from types import SimpleNamespace
    >>> targets = [SimpleNamespace(layer=layer, num_layers=2, role=role)
    ...            for layer in (0, 1) for role in ("Q", "K")]
    >>> layout = custom_scalars_layout(targets, metrics=("stable_rank",))
    >>> layout["spectral stable_rank by layer"]["L01"]
    ['Multiline', ['spectral_stable_rank/L01/Q', 'spectral_stable_rank/L01/K']]
    >>> layout["spectral stable_rank by role"]["K"]
    ['Multiline', ['spectral_stable_rank/L00/K', 'spectral_stable_rank/L01/K', 'spectral_stable_rank/mean/K']]
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pandas as pd

from spectral_callbacks.monitor import background
from spectral_callbacks.monitor.figure_process import FigureProcess, png_size
from spectral_callbacks.names import layer_label, scalar_tag

FIGURE_SECTION = "spectral_figures"


def custom_scalars_layout(
    targets: Sequence[Any], metrics: Sequence[str]
) -> dict[str, dict[str, list]]:
    """The ``add_custom_scalars`` layout: per metric, a chart per layer and a chart per role."""
    num_layers = max((target.num_layers for target in targets), default=1)
    layers = sorted({target.layer for target in targets})
    roles = list(dict.fromkeys(target.role for target in targets))
    present = {(target.layer, target.role) for target in targets}
    layout: dict[str, dict[str, list]] = {}
    for metric in metrics:
        by_layer = {
            layer_label(layer, num_layers): [
                "Multiline",
                [
                    scalar_tag(metric, layer, role, num_layers)
                    for role in roles
                    if (layer, role) in present
                ],
            ]
            for layer in layers
        }
        by_role = {
            role: [
                "Multiline",
                [
                    scalar_tag(metric, layer, role, num_layers)
                    for layer in layers
                    if (layer, role) in present
                ]
                + [scalar_tag(metric, None, role)],
            ]
            for role in roles
        }
        layout[f"spectral {metric} by layer"] = by_layer
        layout[f"spectral {metric} by role"] = by_role
    return layout


def draw_figures(rows: pd.DataFrame, roles: Sequence[str] | None = ("Q",)) -> dict[str, Any]:
    """Figures for the rows seen so far: tag -> ``matplotlib.figure.Figure``.

    α vs relative depth and the compression heatmap (layer x step) for each of ``roles`` (``None``:
    every role), stable rank of the first layer vs steps, and final compression by layer x role.
    A chart whose metric is not in ``rows`` is left out. Each figure costs ~0.1-1 s of CPU to draw
    and render, hence few roles by default.
    """
    from spectral_callbacks.offline import charts

    figures: dict[str, Any] = {}
    metrics = set(rows["metric"]) if len(rows) else set()
    present = list(dict.fromkeys(rows["role"])) if len(rows) else []
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
    return figures


class FigureWriter:
    """Draws figures in a child process and writes them from a background thread, one at a time.

    Drawing a handful of figures costs seconds of CPU, mostly Python holding the GIL: on the main
    thread, or even on a thread of this process, that would stall training (see
    ``figure_process.py`` for the measurement). The main thread hands over a copy of the tidy rows (a
    DataFrame nothing else mutates); the thread sends them to the figure process and writes the
    PNGs it gets back. If the previous drawing is still running the new one is skipped (never
    queued). An error while drawing is re-raised on the main thread by the next :meth:`submit` or
    :meth:`wait`. :meth:`close` stops the process.

    Args:
        roles: roles that get an α-vs-depth and a compression-wave figure (``None``: all).
    """

    def __init__(self, roles: Sequence[str] | None = ("Q",)) -> None:
        self.roles = roles
        self.skipped = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._process = FigureProcess()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, experiments: Sequence[Any], rows: pd.DataFrame, step: int) -> bool:
        """Start drawing ``rows`` at ``step``; ``False`` if a drawing is still running."""
        self._raise_error()
        if self.busy:
            self.skipped += 1
            return False
        # Through background.start_daemon: a drawing still running at exit is waited for, not
        # killed inside matplotlib's C++ (which would abort the process).
        self._thread = background.start_daemon(
            lambda: self._draw(list(experiments), rows, step), "SpectralMonitor-figures"
        )
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the running drawing; ``False`` if it is still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        self._raise_error()
        return not self.busy

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for a running drawing, then stop the figure process."""
        if self._thread is not None:
            self._thread.join(timeout)
        if not self.busy:
            self._process.close(timeout)

    def _draw(self, experiments: list[Any], rows: pd.DataFrame, step: int) -> None:
        try:
            add_pngs(experiments, self._process.render(rows, self.roles), step)
            flush(experiments)
        except BaseException as error:  # noqa: BLE001 - re-raised on the main thread
            self._error = error

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"SpectralMonitor could not draw its figures: {error}") from error


def tensorboard_experiments(loggers: Sequence[Any]) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger among ``loggers``."""
    from lightning.pytorch.loggers import TensorBoardLogger

    return [logger.experiment for logger in loggers if isinstance(logger, TensorBoardLogger)]


def add_layout(experiments: Sequence[Any], layout: dict[str, dict[str, list]]) -> None:
    """Write the custom-scalars layout to every TensorBoard writer."""
    for experiment in experiments:
        experiment.add_custom_scalars(layout)


def add_pngs(experiments: Sequence[Any], pngs: dict[str, bytes], step: int) -> None:
    """Write PNG-encoded figures to every TensorBoard writer at ``step`` as image summaries.

    The bytes are written as they are (no decode and re-encode on this process's GIL) through the
    writer's event-file writer; a writer without one gets ``add_image`` of the decoded pixels.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    for tag, png in pngs.items():
        width, height = png_size(png)
        image = Summary.Image(height=height, width=width, colorspace=4, encoded_image_string=png)
        summary = Summary(value=[Summary.Value(tag=tag, image=image)])
        for experiment in experiments:
            get_file_writer = getattr(
                experiment, "_get_file_writer", None
            )  # torch and tensorboardX
            if callable(get_file_writer):
                get_file_writer().add_summary(summary, global_step=step)
            else:
                import io

                from matplotlib.image import imread

                pixels = imread(io.BytesIO(png), format="png")  # (H, W, 4) floats in [0, 1]
                experiment.add_image(tag, pixels, global_step=step, dataformats="HWC")


def flush(experiments: Sequence[Any]) -> None:
    """Flush every writer so a running TensorBoard shows the new points within seconds."""
    for experiment in experiments:
        experiment.flush()
