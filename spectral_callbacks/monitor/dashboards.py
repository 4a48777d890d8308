"""TensorBoard extras: the custom-scalars layout (multi-line charts) and figures from the charts module.

The layout has, for each logged metric, a section of charts per layer (its roles, like "stable
rank by matrix type") and a section of charts per role (its layers and their mean); TensorBoard
shows them in its Custom Scalars tab. What TensorBoard's custom-scalars frontend allows shapes it:

* a chart's tags are regular expressions, matched from the start of the tag name, so every tag is
  escaped and anchored (``^spectral_stable_rank/L00/K$``): ``K`` must not gather ``KV_down`` or
  ``K_rope``;
* every line of one run has the run's colour, told apart only by five symbols (■ ◆ ▲ ★ ✚, cycled
  per run), so a chart holds at most :data:`MAX_LINES` lines: one symbol each;
* sections are collapsed (``Category.closed``) except the first, so the tab opens on one section
  instead of a hundred charts;
* a chart appears once one of its lines has a finite value (the layout is rewritten when a chart
  gains a line with a finite value; TensorBoard shows the newest), never as a chart of NaN;
* the y-range cannot be set from a layout: "Ignore outliers in chart scaling" is a sidebar toggle
  of the frontend (on by default), which clips the step-0 values (docs/callback.md).

Figures are drawn by ``figures.py`` (``spectral_callbacks.charts``: object-oriented matplotlib on
the Agg canvas, no pyplot state) in a child process (``figure_process.py``), so matplotlib never
holds the training process's GIL, and written here as PNG image summaries.

Example::

    >>> from spectral_callbacks.names import MatrixLabel
    >>> targets = [MatrixLabel(f"{layer}.{role}", layer=layer, role=role, num_layers=2)
    ...            for layer in (0, 1) for role in ("Q", "K")]
    >>> layout = custom_scalars_layout(targets, metrics=("stable_rank",))
    >>> [(category.title, category.closed) for category in layout.category]
    [('spectral stable_rank by layer', False), ('spectral stable_rank by role', True)]
    >>> chart = layout.category[1].chart[1]
    >>> chart.title, list(chart.multiline.tag)  # doctest: +NORMALIZE_WHITESPACE
    ('K', ['^spectral_stable_rank/L00/K$', '^spectral_stable_rank/L01/K$',
           '^spectral_stable_rank/mean/K$'])
"""

from __future__ import annotations

import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import pandas as pd
from tensorboard.plugins.custom_scalar import layout_pb2

from spectral_callbacks.messages import rank_zero_warn
from spectral_callbacks.monitor import background
from spectral_callbacks.monitor.figure_process import FigureProcess
from spectral_callbacks.monitor.figures import image_summary
from spectral_callbacks.names import TaggedMatrix, layer_label, scalar_tag
from spectral_callbacks.tensorboard_adapter import add_layout, flush, logdir_of, write_summary

#: The run name of the tidy rows the live figures are drawn from (their legend).
FIGURE_RUN = "this run"
#: Lines per custom-scalars chart: TensorBoard has five symbols to tell one run's lines apart.
MAX_LINES = 5


def tag_pattern(tag: str) -> str:
    """The custom-scalars regex that matches exactly ``tag``.

    >>> tag_pattern("spectral_alpha/L00/K")
    '^spectral_alpha/L00/K$'
    >>> bool(re.match(tag_pattern("spectral_alpha/L00/K"), "spectral_alpha/L00/K_rope"))
    False
    """
    return f"^{re.escape(tag)}$"


def custom_scalars_layout(
    targets: Sequence[TaggedMatrix], metrics: Sequence[str], finite: Collection[str] | None = None
) -> layout_pb2.Layout:
    """The custom-scalars layout: per metric, charts by layer and charts by role.

    Args:
        targets: the watched matrices (``layer``, ``num_layers``, ``role``), in chart order.
        metrics: the logged metrics, one pair of sections each, in this order.
        finite: tags that have had a finite value; only they are drawn, and a chart or section
            without any is left out. Default ``None`` draws every tag.

    Returns:
        A ``layout_pb2.Layout`` whose first section is open and the others collapsed; each chart
        holds at most :data:`MAX_LINES` exact-match tag patterns.
    """
    stacks = list(dict.fromkeys(target.stack for target in targets))
    categories = []
    for metric in metrics:
        for stack in stacks:
            categories += _stack_categories(
                [t for t in targets if t.stack == stack], stack, metric, finite
            )
    for index, category in enumerate(categories):
        category.closed = index > 0
    return layout_pb2.Layout(category=categories)


def _tag(metric: str, layer: int, role: str, num_layers: int, stack: str, expert: bool) -> str:
    aggregate = "mean" if expert else ""
    return scalar_tag(metric, layer, role, num_layers, stack=stack, aggregate=aggregate)


def _stack_categories(
    targets: Sequence[TaggedMatrix], stack: str, metric: str, finite: Collection[str] | None
) -> list[Any]:
    """The by-layer and by-role sections of one metric for the targets of one stack."""
    num_layers = max((target.num_layers for target in targets), default=1)
    layers = sorted({target.layer for target in targets})
    roles = list(dict.fromkeys(target.role for target in targets))
    present = {(target.layer, target.role) for target in targets}
    # a layer's experts are drawn as their mean (min and max beside it in the scalars)
    experts = {(t.layer, t.role) for t in targets if t.expert is not None}
    where = f"{stack} " if stack else ""
    categories = []
    if True:
        by_layer: list[tuple[str, list[str]]] = []
        for layer in layers:
            label = layer_label(layer, num_layers)
            here = [role for role in roles if (layer, role) in present]
            # Attention and MLP apart, then chunks of MAX_LINES: six roles are Q K V O | MLP_up MLP_down.
            for group in (
                [role for role in here if not role.startswith("MLP")],
                [role for role in here if role.startswith("MLP")],
            ):
                for chunk in _chunks(group, MAX_LINES):
                    title = f"{label} {' '.join(chunk)}" if len(chunk) < len(here) else label
                    tags = [
                        _tag(metric, layer, role, num_layers, stack, (layer, role) in experts)
                        for role in chunk
                    ]
                    by_layer.append((title, tags))
        by_role: list[tuple[str, list[str]]] = []
        for role in roles:
            mean = scalar_tag(metric, None, role, stack=stack)
            with_role = [layer for layer in layers if (layer, role) in present]
            # Each chart keeps the mean over layers as its last line, a reference across charts.
            chunks = _chunks(with_role, MAX_LINES - 1)
            for chunk in chunks:
                title = role
                if len(chunks) > 1:
                    first, last = (
                        layer_label(chunk[0], num_layers),
                        layer_label(chunk[-1], num_layers),
                    )
                    title = f"{role} {first}-{last}"
                tags = [
                    _tag(metric, layer, role, num_layers, stack, (layer, role) in experts)
                    for layer in chunk
                ]
                by_role.append((title, tags + [mean]))
        for title, charts in (
            (f"spectral {metric} {where}by layer", by_layer),
            (f"spectral {metric} {where}by role", by_role),
        ):
            category = layout_pb2.Category(title=title)
            for chart_title, tags in charts:
                shown = [tag for tag in tags if finite is None or tag in finite]
                if shown:
                    category.chart.add(
                        title=chart_title,
                        multiline=layout_pb2.MultilineChartContent(tag=map(tag_pattern, shown)),
                    )
            if category.chart:
                categories.append(category)
    return categories


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    """``items`` in consecutive chunks of at most ``size``, as even as possible (7, 4 -> 4 + 3)."""
    count = -(-len(items) // size)
    return [items[i * len(items) // count : (i + 1) * len(items) // count] for i in range(count)]


class LayoutWriter:
    """Writes the custom-scalars layout whenever a line has its first finite value.

    The first snapshot's values normally bring every chart at once (one write); a metric that is
    NaN at first (``energy_rank_90`` beyond the top k) adds its charts when it becomes finite.
    Each write is one small event (at most one per logged snapshot, and no more in all than
    there are lines); TensorBoard shows the newest layout.

    Args:
        targets: the watched matrices.
        metrics: the logged metrics.
    """

    def __init__(self, targets: Sequence[TaggedMatrix], metrics: Sequence[str]) -> None:
        self.targets = list(targets)
        self.metrics = tuple(metrics)
        self._tags = {
            _tag(metric, t.layer, t.role, t.num_layers, stack, expert)
            if layer is not None
            else scalar_tag(metric, None, t.role, stack=stack)
            for t in self.targets
            for stack, expert in [(t.stack, t.expert is not None)]
            for metric in self.metrics
            for layer in (t.layer, None)
        }
        self.finite: set[str] = set()

    def update(self, experiments: Sequence[Any], scalars: Mapping[str, float]) -> bool:
        """Note the finite ``scalars``; rewrite the layout if a line appeared. ``True`` if written."""
        new = {
            tag
            for tag, value in scalars.items()
            if tag in self._tags and tag not in self.finite and math.isfinite(value)
        }
        if not new:
            return False
        self.finite |= new
        add_layout(experiments, custom_scalars_layout(self.targets, self.metrics, self.finite))
        return True


class FigureWriter:
    """Draws figures in a child process and writes them from a background thread, one at a time.

    Drawing a handful of figures costs seconds of CPU, mostly Python holding the GIL: on the main
    thread, or even on a thread of this process, that would stall training (see
    ``figure_process.py`` for the measurement). The main thread hands over a copy of the tidy rows (a
    DataFrame nothing else mutates); the thread sends them to the figure process and writes the
    PNGs it gets back. If the previous drawing is still running the new one is skipped (never
    queued). An error while drawing is re-raised on the main thread by the next :meth:`submit` or
    :meth:`wait`. :meth:`close` stops the process.

    The final figures go another way (:meth:`submit_final`): the child writes them into the run
    directories itself, and nothing in the training process waits for them; at interpreter exit
    the wait for them is bounded by ``exit_timeout`` (then the child is stopped, and that is said).

    Args:
        roles: roles that get an α-vs-depth and a compression-wave figure (``None``: all).
        exit_timeout: seconds the interpreter's exit waits for the final figures. Default ``60``.
    """

    def __init__(self, roles: Sequence[str] | None = ("Q",), exit_timeout: float = 60.0) -> None:
        self.roles = roles
        self.exit_timeout = exit_timeout
        self._thread: threading.Thread | None = None
        self._final: threading.Thread | None = None
        self._error: BaseException | None = None
        self._process = FigureProcess()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, experiments: Sequence[Any], rows: pd.DataFrame, step: int) -> bool:
        """Start drawing ``rows`` at ``step``; ``False`` if a drawing is still running."""
        self._raise_error()
        if self.busy or self._final is not None:
            return False
        # Through background.start_daemon: a drawing still running at exit is waited for, not
        # killed inside matplotlib's C++ (which would abort the process).
        self._thread = background.start_daemon(
            lambda: self._draw(list(experiments), rows, step), "SpectralMonitor-figures"
        )
        return True

    def submit_final(self, logdirs: Sequence[str], rows: pd.DataFrame, step: int) -> None:
        """Have the child draw ``rows`` and write them at ``step`` into ``logdirs``, then stop it.

        Returns at once: after a drawing still running, the child draws these at its lowest
        priority while the caller goes on. Errors are warned about (the run has ended).
        """
        self._raise_error()
        previous = self._thread

        def draw() -> None:
            if previous is not None:
                previous.join()
            try:
                self._process.write(rows, self.roles, logdirs, step)
            except Exception as error:  # noqa: BLE001 - the caller has gone on: said, not raised
                rank_zero_warn(
                    f"SpectralMonitor could not write its final figures (step {step}) to "
                    f"{', '.join(logdirs)}: {error}",
                    category=RuntimeWarning,
                )
            finally:
                self._process.close(timeout=0)

        self._final = background.start_daemon(
            draw,
            FINAL_FIGURES_THREAD,
            stop=self._stop_at_exit,
            waiting_for=f"while the figure process writes the final figures (at most "
            f"{self.exit_timeout:g} s, drain_timeout)",
        )
        _FINAL.add(self._final)

    def _stop_at_exit(self) -> str | None:
        """At exit: the final figures get ``exit_timeout`` seconds more, then the child is stopped."""
        timer = threading.Timer(self.exit_timeout, self._process.kill)
        timer.daemon = True
        timer.start()
        return None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the running drawing; ``False`` if it is still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        self._raise_error()
        return not self.busy

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for a running drawing, then stop the figure process (unless the
        final figures are being drawn: their thread stops it when they are written)."""
        if self._final is not None:
            return
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


#: The name of the threads that wait for the final figures (:func:`wait_for_figures` joins them).
FINAL_FIGURES_THREAD = "SpectralMonitor-final-figures"
_FINAL: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def wait_for_figures(timeout: float | None = None) -> bool:
    """Wait for the final figures of every run of this process to be written; ``False`` if some
    are still being drawn after ``timeout`` seconds (``None``: no limit).

    ``fit()`` returns without waiting for them; call this before reading them back in the same
    process (a notebook, a test).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in list(_FINAL):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(thread.is_alive() for thread in list(_FINAL))


def add_pngs(experiments: Sequence[Any], pngs: dict[str, bytes], step: int) -> None:
    """Write PNG-encoded figures to every TensorBoard writer at ``step`` as image summaries.

    The bytes are written as they are (no decode and re-encode on this process's GIL) through the
    writer's event-file writer; a writer without one gets ``add_image`` of the decoded pixels.
    """
    for tag, png in pngs.items():
        summary = image_summary(tag, png)
        for experiment in experiments:
            if not write_summary(experiment, summary, step):
                import io

                from matplotlib.image import imread

                pixels = imread(io.BytesIO(png), format="png")  # (H, W, 4) floats in [0, 1]
                experiment.add_image(tag, pixels, global_step=step, dataformats="HWC")


class LiveFigures:
    """When a run draws its figures: every ``every_n_steps`` (on the first snapshot logged at or
    after each multiple) and once more at the end, through a :class:`FigureWriter`.

    Args:
        roles: roles that get an α-vs-depth and a compression-wave figure (``None``: all).
        every_n_steps: the cadence; ``None`` draws only at the end.
        exit_timeout: seconds the interpreter's exit waits for the final figures. Default ``60``.
    """

    def __init__(
        self, roles: Sequence[str] | None, every_n_steps: int | None, exit_timeout: float = 60.0
    ) -> None:
        self.every_n_steps = every_n_steps
        self.last_step: int | None = None
        self._writer = FigureWriter(roles, exit_timeout)

    @property
    def busy(self) -> bool:
        """Whether a drawing is still running."""
        return self._writer.busy

    def due(self, step: int) -> bool:
        """Whether the figures are due at the snapshot of ``step``."""
        every, last = self.every_n_steps, self.last_step
        if every is None:
            return False
        return last is None and step >= every or last is not None and step // every > last // every

    def draw(self, experiments: Sequence[Any], rows: pd.DataFrame, step: int) -> None:
        """Start drawing ``rows`` at ``step`` (skipped if the previous drawing still runs)."""
        if len(rows) and self._writer.submit(experiments, rows, step):
            self.last_step = step

    def draw_final(
        self,
        experiments: Sequence[Any],
        rows: Callable[[], pd.DataFrame],
        step: int,
        deadline: float,
    ) -> bool:
        """The figures of the last snapshot ``step`` unless drawn; ``False`` if not done by ``deadline``.

        Where every writer says its run directory, the figure process writes them there itself
        and nothing waits (``True`` at once); otherwise they are drawn and written as during the
        run, waited for until ``deadline``.
        """
        logdirs = [logdir_of(experiment) for experiment in experiments]
        if self.last_step != step and all(logdirs):
            final = rows()
            if len(final):
                self._writer.submit_final([logdir for logdir in logdirs if logdir], final, step)
                self.last_step = step
            return True
        if self.last_step != step and self._writer.wait(max(0.0, deadline - time.monotonic())):
            self.draw(experiments, rows(), step)
        return self._writer.wait(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` for a drawing still running, then stop the figure process."""
        self._writer.close(timeout)
