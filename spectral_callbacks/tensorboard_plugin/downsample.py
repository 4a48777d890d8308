"""Fewer points for a chart without losing what the eye looks for: the ends and the extremes.

A series of n points is cut into ``max_points // 4`` buckets of consecutive points; each bucket
keeps its first, last, minimum and maximum point (the "M4" aggregation of Jugel et al., VLDB 2014).
So the drawn line still starts and ends where the data does and reaches every spike, and a chart of
any length costs at most ``max_points`` points.

Example::

    >>> import numpy as np
    >>> values = np.array([0.0, 5.0, 1.0, 2.0, -3.0, 4.0, 6.0, 1.0])
    >>> keep_extremes(values, max_points=4).tolist()
    [0, 4, 6, 7]
    >>> keep_extremes(values, max_points=100).tolist() == list(range(8))
    True
"""

from __future__ import annotations

import numpy as np


def keep_extremes(values: np.ndarray, max_points: int) -> np.ndarray:
    """Sorted indices of the points to keep: at most ``max_points``, at least first and last.

    Every bucket keeps its first, last, argmin and argmax (NaNs are ignored for the extremes, an
    all-NaN bucket keeps its ends), so the global first, last, minimum and maximum always stay.

    Args:
        values: the series' values, in step order.
        max_points: the most points to keep; at least 4.

    Raises:
        ValueError: ``max_points`` below 4.
    """
    if max_points < 4:
        raise ValueError(
            f"`max_points` must be at least 4 (first, last, min, max), got {max_points}"
        )
    count = len(values)
    if count <= max_points:
        return np.arange(count)
    edges = np.linspace(0, count, max_points // 4 + 1).astype(int)
    keep: list[int] = []
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        if stop <= start:
            continue
        keep += [start, stop - 1]
        bucket = values[start:stop]
        finite = ~np.isnan(bucket)
        if finite.any():
            where = np.flatnonzero(finite)
            keep += [start + where[bucket[finite].argmin()], start + where[bucket[finite].argmax()]]
    return np.unique(keep)
