"""Scalars of a TensorBoard experiment as tidy rows, read through the public data provider.

The plugin never opens event files: TensorBoard's public data provider (``read_scalars`` and
``read_last_scalars`` of the ``scalars`` plugin) already ingests them, reloads
them while a run is written, and works the same with the Python loader and the Rust data server.

What makes a long run fast (benchmarks/tensorboard_tab.py; docs/dashboards.md has the profile):

* each provider call costs a round trip (with the Rust data server a fixed ~40 ms for most
  answers, whatever their size), so a view makes as few as it can: one ``read_last_scalars``
  that says whether the cached series are current (or, for a view at the last step, that is its
  data) and one ``read_scalars`` per run of what is missing or has grown;
* the tag directory (which tags each run has) comes from the last full listing, made by the
  ``runs`` route the page asks first on every poll (listed again when older than
  ``DIRECTORY_MAX_AGE`` or missing a run asked for);
* each series is kept as numpy arrays until the provider reports new points for it (its last
  point's step and wall time change), so a poll of an unchanged run reads one point per series
  and a growing run re-reads only the series that grew; the cache holds only series the provider
  still lists, so it is bounded by what TensorBoard itself holds; a request builds one DataFrame
  of the series it needs, not one per series.

Rows have the columns, tag parsing and relative depth of ``spectral-callbacks export
--all-scalars`` (``spectral_callbacks.offline.events``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import pandas as pd
from tensorboard.data import provider

from spectral_callbacks.names import parse_num_layers_tag, tidy_rows
from spectral_callbacks.offline.events import empty_rows

SCALARS_PLUGIN = "scalars"
TEXT_PLUGIN = "text"
# read_scalars must be given a limit; this one is above anything the provider keeps per series
# (TensorBoard keeps 1,000 scalars per series unless --samples_per_plugin scalars=0), so nothing
# is dropped here: the views downsample what they draw themselves.
READ_LIMIT = 10_000_000
# Views reuse the last full listing of tags for this long (the page lists on every poll).
DIRECTORY_MAX_AGE = 10.0

Directory = dict[str, frozenset[str]]  # run -> its scalar tags
Freshness = tuple[int, float]  # (step, wall_time) of a series' last point
MISSING: Freshness = (-1, 0.0)  # a series listed a moment ago and gone now: read as empty


class Series(NamedTuple):
    """One scalar series in the provider's order, and the freshness of its last point."""

    freshness: Freshness
    step: np.ndarray  # int64
    value: np.ndarray  # float64
    wall_time: np.ndarray  # float64


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
        self._series: dict[tuple[str, str, str], Series] = {}

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
        with self._lock:
            held = {
                run: [t for t in tags if (experiment_id, run, t) in self._series]
                for run, tags in wanted.items()
            }
        # Only cached copies need checking: a series read now is current by construction.
        last = self._read_last(ctx, experiment_id, held) if any(held.values()) else {}
        return self._frame(experiment_id, self._current(ctx, experiment_id, wanted, last))

    def last_rows(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, Iterable[str]]
    ) -> tuple[pd.DataFrame, list[int]]:
        """Tidy rows of the last point of each ``wanted`` series, and the logged steps (for a
        slider): those of each run's first wanted series (and its num_layers tag), as :meth:`rows`
        gives them.

        One ``read_last_scalars`` gives the points and says whether the cached first series are
        current. The last point is the provider's: the latest written, which for a run that never
        went back in steps is also the highest step.
        """
        wanted = self._known(ctx, experiment_id, wanted)
        last = self._read_last(ctx, experiment_id, wanted)
        points = {
            run: [(t, _series([last[run][t]])) for t in tags if t in last.get(run, {})]
            for run, tags in wanted.items()
        }
        first = {
            run: [t for t in tags if t == tags[0] or parse_num_layers_tag(t) is not None]
            for run, tags in wanted.items()
        }
        first_rows = self._frame(experiment_id, self._current(ctx, experiment_id, first, last))
        return self._frame(experiment_id, points), first_rows["step"].unique().tolist()

    def texts(
        self, ctx: object, experiment_id: str, runs: Sequence[str], tags: Sequence[str]
    ) -> dict[str, list[tuple[int, str]]]:
        """The text entries ``(step, text)`` of ``tags`` of each of ``runs``, in step order, read
        through the provider's ``read_tensors`` of the text plugin (not cached: a run writes a
        few, and TensorBoard keeps at most 10 per tag unless ``--samples_per_plugin text=0``)."""
        read = self._provider.read_tensors(
            ctx,
            experiment_id=experiment_id,
            plugin_name=TEXT_PLUGIN,
            downsample=READ_LIMIT,
            run_tag_filter=provider.RunTagFilter(runs=list(runs), tags=list(tags)),
        )
        entries: dict[str, list[tuple[int, str]]] = {}
        for run, of_run in read.items():
            found = [
                (int(datum.step), item.decode() if isinstance(item, bytes) else str(item))
                for data in of_run.values()
                for datum in data
                for item in np.asarray(datum.numpy).ravel()
            ]
            entries[run] = sorted(found, key=lambda entry: entry[0])
        return entries

    def _known(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, Iterable[str]]
    ) -> dict[str, list[str]]:
        """``wanted`` without tags the runs do not have, plus each run's num_layers tag."""
        directory = self.directory(ctx, experiment_id, wanted)
        known = {}
        for run, tags in wanted.items():
            listed = directory.get(run, frozenset())
            chosen = [t for t in dict.fromkeys(tags) if t in listed]
            if chosen:  # and the num_layers tags (one per stack where there are several)
                chosen += sorted(t for t in listed if parse_num_layers_tag(t) is not None)
            if chosen:
                known[run] = list(dict.fromkeys(chosen))
        return known

    def _read_last(
        self, ctx: object, experiment_id: str, wanted: Mapping[str, list[str]]
    ) -> Mapping[str, Mapping[str, provider.ScalarDatum]]:
        """The last point of each ``wanted`` series, in one call (the filter is a runs x tags
        product: a few points too many at most)."""
        return self._provider.read_last_scalars(
            ctx,
            experiment_id=experiment_id,
            plugin_name=SCALARS_PLUGIN,
            run_tag_filter=provider.RunTagFilter(
                runs=list(wanted), tags=sorted({t for tags in wanted.values() for t in tags})
            ),
        )

    def _current(
        self,
        ctx: object,
        experiment_id: str,
        wanted: Mapping[str, list[str]],
        last: Mapping[str, Mapping[str, provider.ScalarDatum]],
    ) -> dict[str, list[tuple[str, Series]]]:
        """Each ``wanted`` series: the cached copy where its freshness is that of the series'
        ``last`` point (any new point changes it: TensorBoard's sampling always keeps the latest
        point), else read, in one ``read_scalars`` per run (a filter is a runs x tags product)."""
        with self._lock:
            cached = {
                run: {t: self._series.get((experiment_id, run, t)) for t in tags}
                for run, tags in wanted.items()
            }
        current: dict[str, list[tuple[str, Series]]] = {}
        for run, of_run in cached.items():
            last_of_run = last.get(run, {})
            stale = [
                t
                for t, copy in of_run.items()
                if copy is None or copy.freshness != _freshness(last_of_run.get(t))
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
                        of_run[tag] = self._series[(experiment_id, run, tag)] = _series(
                            read.get(tag, [])
                        )
            current[run] = [(tag, copy) for tag, copy in of_run.items() if copy is not None]
        return current

    def _frame(
        self, experiment_id: str, series: Mapping[str, Sequence[tuple[str, Series]]]
    ) -> pd.DataFrame:
        """One DataFrame of the tidy rows of ``series`` (run -> (tag, series)), each series in
        the provider's order, as export builds them (``names.tidy_rows``: each tag parsed once;
        ``depth`` from the run's num_layers series, else the deepest layer the run lists + 1)."""
        with self._lock:
            directory = self._directories.get(experiment_id, (0.0, {}))[1]
        frames = []
        for run, of_run in series.items():
            of_run = [(tag, copy) for tag, copy in of_run if len(copy.step)]
            if not of_run:
                continue
            counts = [len(copy.step) for _, copy in of_run]
            rows, _ = tidy_rows(
                run,
                np.repeat(np.array([tag for tag, _ in of_run], dtype=object), counts),
                np.concatenate([copy.step for _, copy in of_run]),
                np.concatenate([copy.value for _, copy in of_run]),
                np.concatenate([copy.wall_time for _, copy in of_run]),
                listed=directory.get(run, frozenset()),
            )
            frames.append(rows)
        if not frames:
            return empty_rows()
        rows = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        return rows.astype({"metric": object, "stack": object, "role": object})


def _freshness(datum: provider.ScalarDatum | None) -> Freshness:
    return MISSING if datum is None else (datum.step, datum.wall_time)


def _series(data: Sequence[provider.ScalarDatum]) -> Series:
    def column(name: str, dtype: type) -> np.ndarray:
        return np.fromiter(map(attrgetter(name), data), dtype=dtype, count=len(data))

    return Series(
        freshness=_freshness(data[-1] if data else None),
        step=column("step", np.int64),
        value=column("value", np.float64),
        wall_time=column("wall_time", np.float64),
    )
