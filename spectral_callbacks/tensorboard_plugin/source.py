"""Scalars of a TensorBoard experiment as tidy rows, read through the public data provider.

The plugin never opens event files: TensorBoard's public data provider (``read_scalars`` and
``read_last_scalars`` of the ``scalars`` plugin) already ingests them, reloads
them while a run is written, and works the same with the Python loader and the Rust data server.

What makes a long run fast (benchmarks/tensorboard_tab.py):

* the tag directory (which tags each run has) comes from the last full listing, made by the
  ``runs`` route the page asks first on every poll (listed again when older than
  ``DIRECTORY_MAX_AGE`` or missing a run asked for); a view reads the last point of its own
  series only, whose step and wall time say whether the cached copy is still current;
* each series is read once and kept as a small tidy DataFrame until the provider reports new
  points for it, so a poll of an unchanged run reads nothing and a growing run re-reads only
  the series that grew; the cache holds only series the provider still lists, so it is bounded
  by what TensorBoard itself holds;
* views at the last step read one point per series (``read_last_scalars``).

Rows have the columns, tag parsing and relative depth of ``spectral-callbacks export
--all-scalars`` (``spectral_callbacks.offline.events``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
from tensorboard.data import provider

from spectral_callbacks.names import NUM_LAYERS_TAG, parse_tag
from spectral_callbacks.offline.events import _add_depth, empty_rows

SCALARS_PLUGIN = "scalars"
# read_scalars must be given a limit; this one is above anything the provider keeps per series
# (TensorBoard keeps 1,000 scalars per series unless --samples_per_plugin scalars=0), so nothing
# is dropped here: the views downsample what they draw themselves.
READ_LIMIT = 10_000_000
# Views reuse the last full listing of tags for this long (the page lists on every poll).
DIRECTORY_MAX_AGE = 10.0

Directory = dict[str, frozenset[str]]  # run -> its scalar tags
Freshness = tuple[int, float]  # (step, wall_time) of a series' last point


class ScalarSource:
    """Cached reads of scalar series from a TensorBoard data provider, as tidy rows.

    Args:
        data_provider: the ``context.data_provider`` TensorBoard gives its plugins.

    Example::

        source = ScalarSource(context.data_provider)
        directory = source.list_tags(ctx, experiment_id)
        rows = source.rows(ctx, experiment_id, {"run_a": ["spectral_alpha/L00/Q"]})
    """

    def __init__(self, data_provider: provider.DataProvider) -> None:
        self._provider = data_provider
        self._lock = threading.Lock()  # TensorBoard serves requests from several threads
        self._directories: dict[str, tuple[float, Directory]] = {}
        self._series: dict[tuple[str, str, str], tuple[Freshness, pd.DataFrame]] = {}

    def list_tags(self, ctx: object, experiment_id: str) -> Directory:
        """Every run's scalar tags, listed afresh; later :meth:`directory` calls reuse it.

        Listed by ``read_last_scalars``: the tags with one point each, where ``list_scalars``
        of TensorBoard's Python loader scans every point of every series for its ``max_step``.
        """
        listing = self._provider.read_last_scalars(
            ctx, experiment_id=experiment_id, plugin_name=SCALARS_PLUGIN
        )
        directory = {run: frozenset(tags) for run, tags in listing.items()}
        with self._lock:
            self._directories[experiment_id] = (time.monotonic(), directory)
            for key in [k for k in self._series if k[0] == experiment_id]:
                if key[2] not in directory.get(key[1], ()):  # a run or tag gone from the logdir
                    del self._series[key]
        return directory

    def directory(self, ctx: object, experiment_id: str, runs: Iterable[str] = ()) -> Directory:
        """The tags of the last listing (the page lists on every poll), or a new listing when
        that one is older than ``DIRECTORY_MAX_AGE`` s or lacks one of ``runs``."""
        with self._lock:
            listed, directory = self._directories.get(experiment_id, (-np.inf, {}))
        recent = time.monotonic() - listed < DIRECTORY_MAX_AGE
        if recent and all(run in directory for run in runs):
            return directory
        return self.list_tags(ctx, experiment_id)

    def rows(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, Iterable[str]]
    ) -> pd.DataFrame:
        """Tidy rows of every point of the ``wanted`` tags of each run (unknown tags skipped).

        Depth comes from the run's ``spectral_monitor/num_layers`` or, without it, its deepest
        listed layer + 1, as export does.
        """
        wanted = self._known(ctx, experiment_id, wanted)
        fresh = self._freshness(ctx, experiment_id, wanted)
        with self._lock:
            stale = {
                run: [t for t in tags if self._cached(experiment_id, run, t) != fresh[run][t]]
                for run, tags in wanted.items()
            }
        stale = {run: tags for run, tags in stale.items() if tags}
        for run, tags in stale.items():  # one read per run: a filter is a runs x tags product
            read = self._provider.read_scalars(
                ctx,
                experiment_id=experiment_id,
                plugin_name=SCALARS_PLUGIN,
                downsample=READ_LIMIT,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
            ).get(run, {})
            with self._lock:
                for tag in tags:
                    frame = _series_rows(run, [(tag, read.get(tag, []))])
                    self._series[(experiment_id, run, tag)] = (fresh[run][tag], frame)
        with self._lock:
            frames = {
                run: [self._series[(experiment_id, run, tag)][1] for tag in tags]
                for run, tags in wanted.items()
            }
        return self._with_depth(experiment_id, frames)

    def last_rows(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, Iterable[str]]
    ) -> pd.DataFrame:
        """Tidy rows of the last point of each ``wanted`` series (one read, not cached).

        The last point is the provider's: the latest written, which for a run that never went
        back in steps is also the highest step.
        """
        wanted = self._known(ctx, experiment_id, wanted)
        read = self._provider.read_last_scalars(
            ctx,
            experiment_id=experiment_id,
            plugin_name=SCALARS_PLUGIN,
            run_tag_filter=provider.RunTagFilter(
                runs=list(wanted), tags=sorted({t for tags in wanted.values() for t in tags})
            ),
        )
        frames = {
            run: [_series_rows(run, [(t, [read[run][t]]) for t in tags if t in read.get(run, {})])]
            for run, tags in wanted.items()
        }
        return self._with_depth(experiment_id, frames)

    def _known(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, Iterable[str]]
    ) -> dict[str, list[str]]:
        """``wanted`` without tags the runs do not have, plus each run's num_layers tag."""
        directory = self.directory(ctx, experiment_id, wanted)
        known = {}
        for run, tags in wanted.items():
            listed = directory.get(run, frozenset())
            chosen = [t for t in dict.fromkeys(tags) if t in listed]
            if chosen and NUM_LAYERS_TAG in listed:
                chosen.append(NUM_LAYERS_TAG)
            if chosen:
                known[run] = list(dict.fromkeys(chosen))
        return known

    def _freshness(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, list[str]]
    ) -> dict[str, dict[str, Freshness]]:
        """(step, wall_time) of each series' last point: any new point changes it (TensorBoard's
        sampling always keeps the latest point), and it costs one point per series to read."""
        fresh: dict[str, dict[str, Freshness]] = {}
        for run, tags in wanted.items():
            last = self._provider.read_last_scalars(
                ctx,
                experiment_id=experiment_id,
                plugin_name=SCALARS_PLUGIN,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags),
            ).get(run, {})
            fresh[run] = {t: (d.step, d.wall_time) for t, d in last.items()}
        for run, tags in wanted.items():  # listed a moment ago, gone now: read as empty
            for tag in tags:
                fresh[run].setdefault(tag, (-1, 0.0))
        return fresh

    def _cached(self, experiment_id: str, run: str, tag: str) -> Freshness | None:
        entry = self._series.get((experiment_id, run, tag))
        return entry[0] if entry is not None else None

    def _with_depth(
        self, experiment_id: str, frames: Mapping[str, list[pd.DataFrame]]
    ) -> pd.DataFrame:
        """Concatenated rows, ``depth`` filled per run (and the num_layers rows kept, as export)."""
        with self._lock:
            directory = self._directories.get(experiment_id, (0.0, {}))[1]
        out = []
        for run, parts in frames.items():
            parts = [part for part in parts if not part.empty]
            if not parts:
                continue
            rows = pd.concat(parts, ignore_index=True)
            num_layers = _num_layers(rows, directory.get(run, frozenset()))
            out.append(_add_depth(rows, num_layers))
        return pd.concat(out, ignore_index=True) if out else empty_rows()


def _num_layers(rows: pd.DataFrame, tags: Iterable[str]) -> int | None:
    """The run's last logged ``spectral_monitor/num_layers``, else its deepest listed layer + 1."""
    logged = rows.loc[rows["metric"] == NUM_LAYERS_TAG, "value"]
    if not logged.empty:
        return int(logged.iloc[-1])
    layers = [p.layer for p in map(parse_tag, tags) if p is not None and p.layer is not None]
    return max(layers) + 1 if layers else None


def _series_rows(
    run: str, series: Iterable[tuple[str, Sequence[provider.ScalarDatum]]]
) -> pd.DataFrame:
    """Tidy rows (no depth yet) of some series of one run, each in the provider's order, as
    export builds them: the tag parsed once per series, not once per point."""
    series = list(series)
    counts = [len(data) for _, data in series]
    parsed = [parse_tag(tag) for tag, _ in series]
    points = [d for _, data in series for d in data]
    total = len(points)
    frame = pd.DataFrame(
        {
            "run": run,
            "step": np.fromiter((d.step for d in points), dtype="int64", count=total),
            "metric": np.repeat(
                [p.metric if p else t for p, (t, _) in zip(parsed, series, strict=True)], counts
            ),
            "layer": pd.array(
                np.repeat([p.layer if p else None for p in parsed], counts).tolist(), dtype="Int64"
            ),
            "role": np.repeat([p.role if p else None for p in parsed], counts),
            "value": np.fromiter((d.value for d in points), dtype="float64", count=total),
            "wall_time": np.fromiter((d.wall_time for d in points), dtype="float64", count=total),
        }
    )
    return frame.astype({"metric": object, "role": object})
