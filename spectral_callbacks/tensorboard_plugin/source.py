"""Scalars of a TensorBoard experiment as tidy rows, read through the public data provider.

The plugin never opens event files: TensorBoard's data provider (``list_scalars`` /
``read_scalars`` of the ``scalars`` plugin) already ingests them, reloads them while a run is
written, and works the same with the multiplexer and the Rust data server. Each (run, tag) read
is cached with the freshness the provider reports for it (its ``max_step`` and ``max_wall_time``),
so a view re-reads only the series that gained points since the last request, and a poll of an
unchanged run reads nothing. The cache holds only series still listed by the provider, so it is
bounded by what TensorBoard itself holds.

Rows are built exactly as ``spectral-callbacks export --all-scalars`` builds them
(``spectral_callbacks.events``): the same columns, tag parsing and relative depth.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import pandas as pd
from tensorboard.data import provider

from spectral_callbacks.events import _add_depth, _num_layers, _tidy, empty_rows
from spectral_callbacks.names import NUM_LAYERS_TAG, parse_tag

SCALARS_PLUGIN = "scalars"
# read_scalars must be given a limit; this one is above anything the provider keeps per series
# (TensorBoard keeps 1,000 scalars per series unless --samples_per_plugin scalars=0), so nothing
# is dropped here: the views downsample what they draw themselves.
READ_LIMIT = 10_000_000

Point = tuple[str, int, float, float]  # (tag, step, value, wall_time), as events.read_event_file
Index = Mapping[str, Mapping[str, provider.ScalarTimeSeries]]


class ScalarSource:
    """Cached reads of scalar series from a TensorBoard data provider.

    Args:
        data_provider: the ``context.data_provider`` TensorBoard gives its plugins.

    Example::

        source = ScalarSource(context.data_provider)
        index = source.index(ctx, experiment_id)
        rows = source.rows(ctx, experiment_id, index, {"run_a": ["spectral_alpha/L00/Q"]})
    """

    def __init__(self, data_provider: provider.DataProvider) -> None:
        self._provider = data_provider
        self._lock = threading.Lock()  # TensorBoard serves requests from several threads
        self._cache: dict[tuple[str, str, str], tuple[tuple[int, float], list[Point]]] = {}

    def index(self, ctx: object, experiment_id: str) -> Index:
        """Every scalar series as ``{run: {tag: ScalarTimeSeries}}`` (metadata only, cheap)."""
        index = self._provider.list_scalars(
            ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN
        )
        with self._lock:  # runs removed from the logdir leave the cache
            for key in [k for k in self._cache if k[0] == experiment_id and k[1] not in index]:
                del self._cache[key]
        return index

    def rows(
        self, ctx: object, experiment_id: str, index: Index, wanted: Mapping[str, Iterable[str]]
    ) -> pd.DataFrame:
        """Tidy rows (``spectral_callbacks.events.COLUMNS``) of the ``wanted`` tags of each run.

        Tags a run does not have are skipped. Depth comes from the run's
        ``spectral_monitor/num_layers`` or, without it, its deepest listed layer + 1, as export does.
        """
        frames = []
        for run, tags in wanted.items():
            listed = index.get(run, {})
            tags = [tag for tag in dict.fromkeys(tags) if tag in listed]
            points = self._points(ctx, experiment_id, run, listed, tags)
            num_layers = _num_layers(
                self._points(ctx, experiment_id, run, listed, [NUM_LAYERS_TAG])
            )
            if num_layers is None:
                layers = [p.layer for p in map(parse_tag, listed) if p and p.layer is not None]
                num_layers = max(layers) + 1 if layers else None
            frames.append(_add_depth(_tidy(run, points, all_scalars=True), num_layers))
        frames = [frame for frame in frames if not frame.empty]
        return pd.concat(frames, ignore_index=True) if frames else empty_rows()

    def _points(
        self,
        ctx: object,
        experiment_id: str,
        run: str,
        listed: Mapping[str, provider.ScalarTimeSeries],
        tags: list[str],
    ) -> list[Point]:
        """The points of ``tags`` of one run, from the cache where the series has not changed."""
        tags = [tag for tag in tags if tag in listed]
        fresh = {tag: (listed[tag].max_step, listed[tag].max_wall_time) for tag in tags}
        with self._lock:
            stale = [
                t for t in tags if self._cache.get((experiment_id, run, t), (None,))[0] != fresh[t]
            ]
        if stale:
            read = self._provider.read_scalars(
                ctx,
                experiment_id=experiment_id,
                plugin_name=SCALARS_PLUGIN,
                downsample=READ_LIMIT,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=stale),
            ).get(run, {})
            with self._lock:
                for tag in stale:
                    data = read.get(tag, [])
                    points = [(tag, d.step, d.value, d.wall_time) for d in data]
                    self._cache[(experiment_id, run, tag)] = (fresh[tag], points)
                self._forget_unlisted(experiment_id, run, listed)
        with self._lock:
            return [point for tag in tags for point in self._cache[(experiment_id, run, tag)][1]]

    def _forget_unlisted(
        self, experiment_id: str, run: str, listed: Mapping[str, provider.ScalarTimeSeries]
    ) -> None:
        """Drop cached series the provider no longer lists (a run or tag deleted from the logdir)."""
        for key in [k for k in self._cache if k[:2] == (experiment_id, run) and k[2] not in listed]:
            del self._cache[key]
