"""Turn snapshot results into logged scalars: per (layer, role), means per role, the callback's health.

Everything runs on the main thread. Tags come from ``spectral_callbacks.names`` (never spelled by
hand), the step is the optimizer step *of the snapshot*, not of the moment it is logged, and every
writer gets the same dictionary. The offline analysis of a model at rest builds its scalars here
too, so a run and an analyzed model carry the same names by construction. A bounded history of recent snapshots is kept
as tidy rows for the figures.

Example::

    >>> import math
    >>> from spectral_callbacks.names import MatrixLabel
    >>> targets = [MatrixLabel("h.0.q", layer=0, role="Q", num_layers=2),
    ...            MatrixLabel("h.1.q", layer=1, role="Q", num_layers=2)]
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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from spectral_callbacks.functional import compression
from spectral_callbacks.monitor.engines.compute import SVD_FALLBACK
from spectral_callbacks.names import (
    EXPERT_AGGREGATES,
    NUM_LAYERS_TAG,
    TIDY_COLUMNS,
    TaggedMatrix,
    histogram_tag,
    monitor_tag,
    num_layers_tag,
    reference_step_tag,
    scalar_tag,
)

# Metrics that are NaN only when the matrix itself holds a NaN or Inf. Not energy_rank_90 or alpha
# (NaN on finite matrices: not reached within the top-k, too few nonzero values to fit), and
# stable_rank only as a last resort (0/0 on an all-zero matrix).
_FINITE_ON_FINITE_WEIGHTS = ("spectral_norm", "frobenius_norm")


class Reporter:
    """Builds and logs the scalars of each snapshot; remembers references and recent history.

    Each target is read by where it sits: ``stack`` (``""`` for a model with one), ``layer``,
    ``role`` and ``expert`` (``None`` outside a mixture of experts); what kind of matrix it is
    does not matter here. The experts of one (stack, layer, role) are logged as their mean, min
    and max; each expert's own scalar only with ``experts="each"``; every expert's values are in
    :meth:`rows` and :meth:`expert_values` (the histograms over experts) either way. The query
    heads of a layer's circuits (``head``) are aggregated alike, and each head's own scalar is
    always logged (``spectral_qk_spectral_norm/L00/H03/heads``).

    Args:
        targets: the watched matrices (``name``, ``layer``, ``num_layers``, ``role``, ``depth``,
            optionally ``stack`` and ``expert``).
        metrics: which metrics to log (see ``monitor.options.KNOWN_METRICS``).
        history_size: how many snapshots the figure history keeps (oldest dropped first).
            Default ``256``.
        experts: ``"aggregate"`` (default) logs mean/min/max over a layer's experts,
            ``"each"`` also one scalar per expert.
    """

    def __init__(
        self,
        targets: Sequence[TaggedMatrix],
        metrics: Sequence[str],
        history_size: int = 256,
        experts: str = "aggregate",
    ) -> None:
        self.targets = {target.name: target for target in targets}
        self.metrics = tuple(metrics)
        self.each_expert = experts == "each"
        self.num_layers_of: dict[str, int] = {}
        for target in targets:
            stack = target.stack
            self.num_layers_of[stack] = max(self.num_layers_of.get(stack, 1), target.num_layers)
        self.num_layers = max(self.num_layers_of.values(), default=1)
        # The compression reference of each matrix: its stable rank at its first *defined* snapshot
        # (normally step 0; later for a matrix that starts at exactly zero, whose stable rank 0/0
        # is undefined), and the step it comes from. Both survive a resume (``state_dict``).
        self.references: dict[str, float] = {}
        self.reference_steps: dict[str, int] = {}
        # (step, wall time, logged scalars, each matrix's values of that snapshot)
        self.history: collections.deque[
            tuple[int, float, dict[str, float], dict[str, dict[str, float]]]
        ] = collections.deque(maxlen=history_size)
        # (matrix name, step) of the first snapshot whose weights were not finite, once found.
        self.first_non_finite: tuple[str, int] | None = None
        # Matrices whose SVD solver raised and whose spectrum came from the exact float64 path
        # (the compute's SVD_FALLBACK), over the run, and the first of them (name, step).
        self.svd_fallbacks = 0
        self.first_svd_fallback: tuple[str, int] | None = None
        # Each matrix's latest logged values: the means per role (and over experts) are over
        # these, so a snapshot staggered over several steps (the budget) still gets means over
        # every layer (expert).
        self.latest: dict[str, dict[str, float]] = {}
        self._of_role: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
        self._of_experts: dict[tuple[str, int, str], list[str]] = collections.defaultdict(list)
        for target in targets:
            self._of_role[(target.stack, target.role)].append(target.name)
            if _member_of(target) is not None:
                self._of_experts[_experts_key(target)].append(target.name)

    def tag(self, target: TaggedMatrix, metric: str) -> str:
        """The tag of ``metric`` of one matrix (a per-expert tag for an expert's slice)."""
        stack = target.stack
        return scalar_tag(
            metric,
            target.layer,
            target.role,
            self.num_layers_of[stack],
            stack=stack,
            expert=target.expert,
            head=target.head,
        )

    def scalars(self, step: int, values: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """The tagged scalars of one snapshot (``values``: target name -> metric -> value).

        A matrix whose reference is set by this snapshot also gets its
        ``spectral_monitor/reference_step/L<layer>/<role>`` scalar (the value is ``step``).

        The mean of a role (and the mean/min/max over a layer's experts) is logged where
        ``values`` hold some of its matrices, over every matrix's latest value (so over the steps
        of a snapshot taken in parts, at most the coverage delay apart), once each has one.
        """
        per_target: dict[str, dict[str, float]] = {}
        new_references: list[str] = []
        for name, metrics in values.items():
            row = dict(metrics)
            if self.first_non_finite is None and _non_finite(row):
                self.first_non_finite = (name, step)
            if row.pop(SVD_FALLBACK, 0.0):
                self.svd_fallbacks += 1
                self.first_svd_fallback = self.first_svd_fallback or (name, step)
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
            if target.expert is None or self.each_expert:
                for metric in self.metrics:
                    if metric in row:
                        scalars[self.tag(target, metric)] = float(row[metric])
            self.latest[name] = row
        for (stack, layer, role), metric, expert_values in self._experts_of(per_target):
            finite = [value for value in expert_values if not math.isnan(value)]
            for aggregate in EXPERT_AGGREGATES:
                tag = scalar_tag(
                    metric, layer, role, self.num_layers_of[stack], stack=stack, aggregate=aggregate
                )
                scalars[tag] = _AGGREGATE[aggregate](finite) if finite else math.nan
        touched_roles = {(self.targets[n].stack, self.targets[n].role) for n in per_target}
        for stack, role in touched_roles:
            for metric, layer_values in self._latest_of(self._of_role[(stack, role)]).items():
                finite = [value for value in layer_values if not math.isnan(value)]
                scalars[scalar_tag(metric, None, role, stack=stack)] = (
                    sum(finite) / len(finite) if finite else math.nan
                )
        if "compression" in self.metrics:
            for name in new_references:
                target = self.targets[name]
                if target.expert is not None and not self.each_expert:
                    continue  # one tag per expert only where per-expert charts were asked for
                stack = target.stack
                tag = reference_step_tag(
                    target.layer,
                    target.role,
                    self.num_layers_of[stack],
                    stack=stack,
                    expert=target.expert,
                )
                scalars[tag] = float(step)
        if self.svd_fallbacks:  # from the first on, so a run without one logs what it always did
            scalars.update(health_scalars(svd_fallbacks=self.svd_fallbacks))
        self.history.append((step, time.time(), scalars, per_target))
        return scalars

    def _latest_of(self, names: Sequence[str]) -> dict[str, list[float]]:
        """metric -> the latest values of ``names``, for the metrics every one of them has."""
        if any(name not in self.latest for name in names):
            return {}  # a part of a staggered snapshot: the aggregate waits for every matrix
        rows = [self.latest[name] for name in names]
        return {
            metric: [float(row[metric]) for row in rows]
            for metric in self.metrics
            if all(metric in row for row in rows)
        }

    def _experts_of(
        self, names: Iterable[str]
    ) -> Iterator[tuple[tuple[str, int, str], str, list[float]]]:
        """``((stack, layer, role), metric, values)`` of each (layer, role) of experts one of
        ``names`` belongs to: every expert's latest value, in expert order, once all have one."""
        touched = {
            _experts_key(self.targets[name])
            for name in names
            if _member_of(self.targets[name]) is not None
        }
        for key in sorted(touched):
            for metric, values in self._latest_of(self._of_experts[key]).items():
                yield key, metric, values

    def expert_values(self, values: Mapping[str, Mapping[str, float]]) -> dict[str, list[float]]:
        """The histograms over experts of a snapshot logged by :meth:`scalars` (``values`` as
        given to it): tag (``spectral_<metric>/L03/MLP_down``) -> every expert's latest value,
        NaN left out, for each (layer, role) whose mean/min/max that snapshot logged.

        >>> from spectral_callbacks.names import MatrixLabel
        >>> targets = [MatrixLabel(f"e{e}", layer=0, role="MLP_up", expert=e) for e in range(3)]
        >>> reporter = Reporter(targets, metrics=("stable_rank",))
        >>> values = {"e0": {"stable_rank": 2.0}, "e1": {"stable_rank": 4.0}, "e2": {"stable_rank": 3.0}}
        >>> reporter.scalars(0, values)["spectral_stable_rank/L00/MLP_up/max"]
        4.0
        >>> reporter.expert_values(values)
        {'spectral_stable_rank/L00/MLP_up': [2.0, 4.0, 3.0]}
        """
        found: dict[str, list[float]] = {}
        for (stack, layer, role), metric, expert_values in self._experts_of(values):
            finite = [value for value in expert_values if not math.isnan(value)]
            if finite:
                tag = histogram_tag(metric, layer, role, self.num_layers_of[stack], stack=stack)
                found[tag] = finite
        return found

    def num_layers_scalars(self) -> dict[str, float]:
        """``spectral_monitor/num_layers`` (and ``.../num_layers/<stack>`` for each stack)."""
        if list(self.num_layers_of) in ([], [""]):
            return num_layers_scalar(self.num_layers)
        return {num_layers_tag(stack): float(n) for stack, n in self.num_layers_of.items()}

    def rows(self, run: str = "") -> pd.DataFrame:
        """The remembered snapshots as tidy rows, one per matrix and metric (no means), every
        expert's own values included."""
        records = []
        for step, wall_time, _, values in self.history:
            for name, row in values.items():
                target = self.targets[name]
                for metric in self.metrics:
                    if metric in row:
                        records.append(
                            (
                                run,
                                step,
                                metric,
                                target.stack,
                                target.layer,
                                target.depth,
                                target.role,
                                target.expert,
                                target.head,
                                float(row[metric]),
                                wall_time,
                            )
                        )
        frame = pd.DataFrame.from_records(records, columns=list(TIDY_COLUMNS))
        return frame.astype({"layer": "Int64", "expert": "Int64", "head": "Int64"})

    def state_dict(self) -> dict[str, Any]:
        """The compression references and their steps (what a resume must keep), and the count
        of SVD fallbacks where there were any."""
        state: dict[str, Any] = {
            "references": dict(self.references),
            "reference_steps": dict(self.reference_steps),
        }
        if self.svd_fallbacks:
            state["svd_fallbacks"] = self.svd_fallbacks
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # A checkpoint written before the first-defined-snapshot rule may hold a NaN reference
        # (a zero-initialised matrix): drop it, so the next finite snapshot becomes the reference.
        references = dict(state.get("references", {}))
        self.references = {name: ref for name, ref in references.items() if math.isfinite(ref)}
        # A checkpoint from before reference steps were kept: its references came from step 0.
        steps = state.get("reference_steps", {})
        self.reference_steps = {name: int(steps.get(name, 0)) for name in self.references}
        self.svd_fallbacks = int(state.get("svd_fallbacks", 0))


def health_scalars(**values: float) -> dict[str, float]:
    """``spectral_monitor/<name>`` scalars, e.g. ``health_scalars(svd_ms=3.0)``.

    >>> health_scalars(svd_ms=3.0, skipped=0)
    {'spectral_monitor/svd_ms': 3.0, 'spectral_monitor/skipped': 0.0}
    """
    return {monitor_tag(name): float(value) for name, value in values.items()}


def num_layers_scalar(num_layers: int) -> dict[str, float]:
    """The one-off ``spectral_monitor/num_layers`` scalar readers use for relative depth."""
    return {NUM_LAYERS_TAG: float(num_layers)}


def _member_of(target: TaggedMatrix) -> int | None:
    """The expert or head a target is, within its (layer, role): aggregated over its layer."""
    return target.expert if target.expert is not None else target.head


def _experts_key(target: TaggedMatrix) -> tuple[str, int, str]:
    return (target.stack, target.layer, target.role)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


_AGGREGATE: dict[str, Callable[[list[float]], float]] = {"mean": _mean, "min": min, "max": max}


def _non_finite(row: Mapping[str, float]) -> bool:
    """Whether a matrix's metrics say its weights held a NaN or Inf."""
    names = [name for name in _FINITE_ON_FINITE_WEIGHTS if name in row] or ["stable_rank"]
    return any(name in row and not math.isfinite(float(row[name])) for name in names)


def _add_compression(rows: Mapping[str, dict[str, float]], references: Mapping[str, float]) -> None:
    """Each row with a stable rank gets its ``compression``: ``functional.compression`` (the math
    lives there, not here), in one call for the whole snapshot."""
    names = [name for name, row in rows.items() if "stable_rank" in row]
    # Host tensors named so: a training script may set torch.set_default_device("cuda").
    stable_ranks = torch.tensor(
        [rows[name]["stable_rank"] for name in names], dtype=torch.float64, device="cpu"
    )
    reference = torch.tensor(
        [references.get(name, math.nan) for name in names], dtype=torch.float64, device="cpu"
    )
    for name, value in zip(names, compression(stable_ranks, reference).tolist(), strict=True):
        rows[name]["compression"] = value
