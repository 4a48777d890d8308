"""Turn snapshot results into logged scalars: per (layer, role), means per role, the callback's health.

Everything runs on the main thread. Tags come from ``spectral_callbacks.names`` (never spelled by
hand), the step is the optimizer step *of the snapshot*, not of the moment it is logged, and every
writer gets the same dictionary. The offline analysis of a model at rest builds its scalars here
too, so a run and an analyzed model carry the same names by construction. A bounded history of recent snapshots is kept
as tidy rows for the figures.

Example::

    >>> import math
    >>> from types import SimpleNamespace
    >>> targets = [SimpleNamespace(name="h.0.q", layer=0, num_layers=2, role="Q", depth=0.0),
    ...            SimpleNamespace(name="h.1.q", layer=1, num_layers=2, role="Q", depth=1.0)]
    >>> reporter = Reporter(targets, metrics=("stable_rank", "compression"))
    >>> first = reporter.scalars(0, {"h.0.q": {"stable_rank": 20.0}, "h.1.q": {"stable_rank": 10.0}})
    >>> later = reporter.scalars(25, {"h.0.q": {"stable_rank": 5.0}, "h.1.q": {"stable_rank": 10.0}})
    >>> {tag: later[tag] for tag in sorted(later)}  # doctest: +NORMALIZE_WHITESPACE
    {'spectral_compression/L00/Q': 75.0, 'spectral_compression/L01/Q': 0.0,
     'spectral_compression/mean/Q': 37.5, 'spectral_stable_rank/L00/Q': 5.0,
     'spectral_stable_rank/L01/Q': 10.0, 'spectral_stable_rank/mean/Q': 7.5}

A matrix that starts at zero (stable rank 0/0 = NaN) takes its first defined snapshot as reference:

    >>> reporter = Reporter(targets, metrics=("stable_rank", "compression"))
    >>> first = reporter.scalars(0, {"h.0.q": {"stable_rank": 20.0}, "h.1.q": {"stable_rank": math.nan}})
    >>> first["spectral_compression/L01/Q"], first["spectral_monitor/reference_step/L00/Q"]
    (nan, 0.0)
    >>> later = reporter.scalars(25, {"h.0.q": {"stable_rank": 5.0}, "h.1.q": {"stable_rank": 8.0}})
    >>> later["spectral_compression/L01/Q"], later["spectral_monitor/reference_step/L01/Q"]
    (0.0, 25.0)
    >>> reporter.scalars(50, {"h.0.q": {"stable_rank": 5.0}, "h.1.q": {"stable_rank": 2.0}})[
    ...     "spectral_compression/L01/Q"]
    75.0
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from spectral_callbacks.functional import compression
from spectral_callbacks.names import (
    NUM_LAYERS_TAG,
    TIDY_COLUMNS,
    monitor_tag,
    reference_step_tag,
    scalar_tag,
)

# Metrics that are NaN only when the matrix itself holds a NaN or Inf. Not energy_rank_90 or alpha
# (NaN on finite matrices: not reached within the top-k, too few nonzero values to fit), and
# stable_rank only as a last resort (0/0 on an all-zero matrix).
_FINITE_ON_FINITE_WEIGHTS = ("spectral_norm", "frobenius_norm")


class Reporter:
    """Builds and logs the scalars of each snapshot; remembers references and recent history.

    Args:
        targets: the watched matrices (``name``, ``layer``, ``num_layers``, ``role``, ``depth``).
        metrics: which metrics to log (see ``monitor.options.KNOWN_METRICS``).
        history_size: how many snapshots the figure history keeps (oldest dropped first).
            Default ``256``.
    """

    def __init__(
        self, targets: Sequence[Any], metrics: Sequence[str], history_size: int = 256
    ) -> None:
        self.targets = {target.name: target for target in targets}
        self.metrics = tuple(metrics)
        self.num_layers = max((target.num_layers for target in targets), default=1)
        # The compression reference of each matrix: its stable rank at its first *defined* snapshot
        # (normally step 0; later for a matrix that starts at exactly zero, whose stable rank 0/0
        # is undefined), and the step it comes from. Both survive a resume (``state_dict``).
        self.references: dict[str, float] = {}
        self.reference_steps: dict[str, int] = {}
        self.history: collections.deque[tuple[int, float, dict[str, float]]] = collections.deque(
            maxlen=history_size
        )
        # (matrix name, step) of the first snapshot whose weights were not finite, once found.
        self.first_non_finite: tuple[str, int] | None = None
        # Each matrix's latest logged values: the means per role are over these, so a snapshot
        # staggered over several steps (the budget) still gets means over every layer.
        self.latest: dict[str, dict[str, float]] = {}
        self._role_size = collections.Counter(target.role for target in targets)

    def scalars(self, step: int, values: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """The tagged scalars of one snapshot (``values``: target name -> metric -> value).

        A matrix whose reference is set by this snapshot also gets its
        ``spectral_monitor/reference_step/L<layer>/<role>`` scalar (the value is ``step``).

        The mean of a role is logged where ``values`` hold some of its matrices, over every
        matrix's latest value (so over the steps of a snapshot taken in parts, at most the
        coverage delay apart), once each of them has one.
        """
        per_target: dict[str, dict[str, float]] = {}
        new_references: list[str] = []
        for name, metrics in values.items():
            row = dict(metrics)
            if self.first_non_finite is None and _non_finite(row):
                self.first_non_finite = (name, step)
            stable_rank = row.get("stable_rank", math.nan)
            if name not in self.references and math.isfinite(stable_rank):
                self.references[name] = float(stable_rank)
                self.reference_steps[name] = step
                new_references.append(name)
            per_target[name] = row
        _add_compression(per_target, self.references)
        scalars: dict[str, float] = {}
        for name, row in per_target.items():
            target = self.targets[name]
            for metric in self.metrics:
                if metric not in row:
                    continue
                value = float(row[metric])
                scalars[scalar_tag(metric, target.layer, target.role, self.num_layers)] = value
            self.latest[name] = row
        by_role: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        roles = {self.targets[name].role for name in per_target}
        for name, row in self.latest.items():
            role = self.targets[name].role
            if role in roles:
                for metric in self.metrics:
                    if metric in row:
                        by_role[(metric, role)].append(float(row[metric]))
        for (metric, role), layer_values in by_role.items():
            if len(layer_values) < self._role_size[role]:
                continue  # a part of a staggered snapshot: the mean waits for every matrix
            finite = [value for value in layer_values if not math.isnan(value)]
            scalars[scalar_tag(metric, None, role)] = (
                sum(finite) / len(finite) if finite else math.nan
            )
        if "compression" in self.metrics:
            for name in new_references:
                target = self.targets[name]
                tag = reference_step_tag(target.layer, target.role, self.num_layers)
                scalars[tag] = float(step)
        self.history.append((step, time.time(), scalars))
        return scalars

    def rows(self, run: str = "") -> pd.DataFrame:
        """The remembered snapshots as tidy rows (per (layer, role) tags only; no means)."""
        records = []
        for step, wall_time, scalars in self.history:
            for target in self.targets.values():
                for metric in self.metrics:
                    tag = scalar_tag(metric, target.layer, target.role, self.num_layers)
                    if tag in scalars:
                        records.append(
                            (
                                run,
                                step,
                                metric,
                                target.layer,
                                target.depth,
                                target.role,
                                scalars[tag],
                                wall_time,
                            )
                        )
        return pd.DataFrame.from_records(records, columns=list(TIDY_COLUMNS))

    def state_dict(self) -> dict[str, Any]:
        """The compression references and their steps (what a resume must keep)."""
        return {"references": dict(self.references), "reference_steps": dict(self.reference_steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # A checkpoint written before the first-defined-snapshot rule may hold a NaN reference
        # (a zero-initialised matrix): drop it, so the next finite snapshot becomes the reference.
        references = dict(state.get("references", {}))
        self.references = {name: ref for name, ref in references.items() if math.isfinite(ref)}
        # A checkpoint from before reference steps were kept: its references came from step 0.
        steps = state.get("reference_steps", {})
        self.reference_steps = {name: int(steps.get(name, 0)) for name in self.references}


def health_scalars(**values: float) -> dict[str, float]:
    """``spectral_monitor/<name>`` scalars, e.g. ``health_scalars(svd_ms=3.0)``.

    >>> health_scalars(svd_ms=3.0, skipped=0)
    {'spectral_monitor/svd_ms': 3.0, 'spectral_monitor/skipped': 0.0}
    """
    return {monitor_tag(name): float(value) for name, value in values.items()}


def num_layers_scalar(num_layers: int) -> dict[str, float]:
    """The one-off ``spectral_monitor/num_layers`` scalar readers use for relative depth."""
    return {NUM_LAYERS_TAG: float(num_layers)}


def _non_finite(row: Mapping[str, float]) -> bool:
    """Whether a matrix's metrics say its weights held a NaN or Inf."""
    names = [name for name in _FINITE_ON_FINITE_WEIGHTS if name in row] or ["stable_rank"]
    return any(name in row and not math.isfinite(float(row[name])) for name in names)


def _add_compression(rows: Mapping[str, dict[str, float]], references: Mapping[str, float]) -> None:
    """Each row with a stable rank gets its ``compression``: ``functional.compression`` (the math
    lives there, not here), in one call for the whole snapshot."""
    names = [name for name, row in rows.items() if "stable_rank" in row]
    stable_ranks = torch.tensor([rows[name]["stable_rank"] for name in names], dtype=torch.float64)
    reference = torch.tensor(
        [references.get(name, math.nan) for name in names], dtype=torch.float64
    )
    for name, value in zip(names, compression(stable_ranks, reference).tolist(), strict=True):
        rows[name]["compression"] = value
