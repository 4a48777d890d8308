"""Alerts: the results of each snapshot read against rules, on the main thread, with no device work.

Each snapshot's metrics (target name -> metric -> value, as the engine hands them over) go through
:meth:`AlertWatch.check`, which returns the :class:`Alert`\\ s they raise:

* ``rank_collapse`` - a matrix's stable rank fell by more than ``rank_drop`` (a fraction) from its
  highest value among the snapshots of the last ``window`` steps;
* ``sigma_growth`` - its spectral norm σ₁ grew by more than the factor ``sigma_growth`` over its
  lowest value in the last ``window`` steps;
* ``esd_alpha_low`` / ``esd_alpha_high`` - its ESD α (when that snapshot carries it) is below
  ``esd_alpha_low`` (WeightWatcher's "over-trained" label is 2) or above ``esd_alpha_high``
  ("under-trained": 6); off unless set;
* ``non_finite`` - its weights hold a NaN or Inf (its norms are not finite);
* ``logit_growth`` - with ``circuits`` on, an attention layer's weight-only value of its attention
  logits (the max over its heads of ``qk_spectral_norm``; with QK-norm, of ``qk_norm_logit_bound``,
  the bound the norms' gains put on the logits, since the projections' ``qk_spectral_norm`` is
  normalized away there) grew by more than the factor ``logit_growth`` over its lowest value in the
  last ``window`` steps: the weight-only warning of attention-logit growth, the instability behind
  many loss spikes (Dehghani et al. 2023; Wortsman et al. 2023).

The rules that compare over a window (against snapshots from ``after_step`` on only), and the ESD
bands, are read only from ``after_step`` on: the
first steps of every run collapse stable ranks by design (the spectral lifecycle), and a freshly
initialized matrix's ESD is a Marchenko-Pastur bulk, not a power law. An alert of one kind for one
matrix is raised at most once per ``window`` steps. The tracker turns each alert into a warning, a
TensorBoard text entry and count scalars (``spectral_alerts/<kind>``), and calls the user's hook.

Example::

    >>> from types import SimpleNamespace
    >>> targets = [SimpleNamespace(name="h.0.q", layer=0, role="Q")]
    >>> watch = AlertWatch(targets, AlertRules(after_step=0, window=100, sigma_growth=2.0))
    >>> watch.check(10, {"h.0.q": {"stable_rank": 20.0, "spectral_norm": 1.0}})
    []
    >>> [a.kind for a in watch.check(20, {"h.0.q": {"stable_rank": 5.0, "spectral_norm": 3.0}})]
    ['rank_collapse', 'sigma_growth']
    >>> watch.check(30, {"h.0.q": {"stable_rank": 4.0, "spectral_norm": 4.0}})  # once per window
    []
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spectral_callbacks.monitor.checks import is_int, is_real, require
from spectral_callbacks.names import TaggedMatrix, alert_tag, stack_of

#: Every kind of alert, in the order counts are logged.
ALERT_KINDS: tuple[str, ...] = (
    "rank_collapse",
    "sigma_growth",
    "esd_alpha_low",
    "esd_alpha_high",
    "non_finite",
    "logit_growth",
)


@dataclass(frozen=True)
class AlertRules:
    """The thresholds of the alerts (defaults measured in benchmarks/alert_thresholds.py).

    Each threshold is checked when the rules are built.

    Args:
        rank_drop: ``rank_collapse`` when the stable rank falls by more than this fraction of its
            highest value within the window. Default ``0.7`` (the healthy demo and lifecycle
            runs fell at most 0.50 within 50 steps from step 100; their 30x lr spikes 0.83-0.92).
        sigma_growth: ``sigma_growth`` when σ₁ exceeds this factor times its lowest value within
            the window. Default ``3.0`` (healthy at most 1.53x; the spikes 8.3-10.3x).
        esd_alpha_low: ``esd_alpha_low`` below this ESD α; ``2.0`` is WeightWatcher's
            "over-trained" label. Default ``None`` (off: healthy runs end with a third of their
            matrices below 2; docs/callback.md, Alerts).
        esd_alpha_high: ``esd_alpha_high`` above this ESD α; ``6.0`` is WeightWatcher's
            "under-trained" label. Default ``None`` (off, as ``esd_alpha_low``).
        window: steps the comparisons look back, and the least gap between two alerts of one kind
            for one matrix. Default ``50``.
        after_step: the first step whose snapshot the window and ESD rules read (``non_finite`` is
            read from the start). Default ``100``.
        logit_growth: ``logit_growth`` when a layer's max-over-heads ``qk_spectral_norm`` (with
            QK-norm: ``qk_norm_logit_bound``) exceeds this factor times its lowest value within
            the window. Default ``3.0`` (the healthy
            runs of benchmarks/logit_bound_validation.py grew at most 2.06x within 50 steps from
            step 100, the 30x lr spike 19x: docs/callback.md, Attention heads).

    Raises:
        ConfigurationError: a threshold out of range, named in the message.
    """

    rank_drop: float = 0.7
    sigma_growth: float = 3.0
    esd_alpha_low: float | None = None
    esd_alpha_high: float | None = None
    window: int = 50
    after_step: int = 100
    logit_growth: float = 3.0

    def __post_init__(self) -> None:
        drop, growth = self.rank_drop, self.sigma_growth
        require("rank_drop", drop, is_real(drop) and 0 < drop < 1, "a fraction in (0, 1), e.g. 0.5")
        require("sigma_growth", growth, is_real(growth) and growth > 1, "a factor > 1, e.g. 2.0")
        low, high = self.esd_alpha_low, self.esd_alpha_high
        require("esd_alpha_low", low, low is None or is_real(low), "None or a number, e.g. 2.0")
        above = "" if low is None else f" above {low!r}"
        require(
            "esd_alpha_high",
            high,
            high is None or is_real(high) and (low is None or high > low),
            f"None or a number{above}, e.g. 6.0",
        )
        require(
            "logit_growth",
            self.logit_growth,
            is_real(self.logit_growth) and self.logit_growth > 1,
            "a factor > 1, e.g. 1.5",
        )
        require("window", self.window, is_int(self.window, 1), "a positive int of steps")
        require("after_step", self.after_step, is_int(self.after_step, 0), "a step >= 0")


#: What an alert's ``value`` and ``threshold`` are, by kind (the tables and the tab name it).
ALERT_UNITS: dict[str, str] = {
    "rank_collapse": "fraction",  # the fall of the stable rank from the window's highest
    "sigma_growth": "factor",  # σ₁ over the window's lowest
    "esd_alpha_low": "ESD α",
    "esd_alpha_high": "ESD α",
    "non_finite": "",  # no value: the weights hold NaN or Inf
    "logit_growth": "factor",  # the layer's max-over-heads QK bound over the window's lowest
}


@dataclass(frozen=True)
class Alert:
    """One alert: what fired, for which matrix, at which step, the value and the threshold."""

    kind: str
    step: int
    matrix: str  #: the watched parameter's name
    layer: int
    role: str
    #: the value that crossed, in :attr:`unit`: the stable rank's fall as a fraction of the
    #: window's highest, σ₁'s growth as a factor over the window's lowest, or the ESD α itself;
    #: NaN for non_finite
    value: float
    threshold: float  #: in the same unit as ``value``
    since_step: int | None = None  #: the snapshot it is compared with (window rules)
    stack: str = ""  #: the stack the layer is numbered in (``enc``, ``dec``; ``""``: the only one)

    @property
    def unit(self) -> str:
        """What ``value`` and ``threshold`` are: ``fraction``, ``factor``, ``ESD α`` or ``""``."""
        return ALERT_UNITS[self.kind]

    def describe(self) -> str:
        """One line: what the value was, against what, since when."""
        what = {
            "rank_collapse": f"stable rank fell by {self.value:.0%} (more than {self.threshold:.0%})",
            "sigma_growth": f"σ1 grew {self.value:.2f}x (more than {self.threshold:g}x)",
            "esd_alpha_low": f"ESD α = {self.value:.2f} < {self.threshold:g}",
            "esd_alpha_high": f"ESD α = {self.value:.2f} > {self.threshold:g}",
            "non_finite": "weights hold NaN or Inf",
            "logit_growth": f"the max attention-logit bound over heads grew {self.value:.2f}x "
            f"(more than {self.threshold:g}x)",
        }[self.kind]
        since = f" since step {self.since_step}" if self.since_step is not None else ""
        where = f"{self.stack} L{self.layer}" if self.stack else f"L{self.layer}"
        return (
            f"step {self.step}: {self.kind} in {self.matrix!r} ({where} {self.role}): {what}{since}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "unit": self.unit}


class AlertWatch:
    """Reads each snapshot's results against :class:`AlertRules`; keeps the window's history.

    Args:
        targets: the watched matrices (``name``, ``layer``, ``role``).
        rules: the thresholds.
    """

    def __init__(self, targets: Sequence[TaggedMatrix], rules: AlertRules) -> None:
        self.targets = {target.name: target for target in targets}
        self.rules = rules
        # Per matrix: (step, stable rank, sigma_1) of the snapshots within the window.
        self._history: dict[str, collections.deque[tuple[int, float, float]]] = (
            collections.defaultdict(collections.deque)
        )
        self._last: dict[tuple[str, str], int] = {}  # (kind, matrix) -> step of its last alert
        self.counts: dict[str, int] = dict.fromkeys(ALERT_KINDS, 0)
        # Per attention layer (its heads' layout name): (step, max over heads of the logit bound).
        self._bounds: dict[str, collections.deque[tuple[int, float]]] = collections.defaultdict(
            collections.deque
        )

    def check(self, step: int, values: Mapping[str, Mapping[str, float]]) -> list[Alert]:
        """The alerts the snapshot of ``step`` raises (each counted in :attr:`counts`)."""
        rules = self.rules
        raised = []
        armed = step >= rules.after_step
        for name, row in values.items():
            target = self.targets.get(name)
            if target is None:
                continue
            found: list[tuple[str, float, float, int | None]] = []
            norms = [row[key] for key in ("spectral_norm", "frobenius_norm") if key in row]
            if any(not math.isfinite(value) for value in norms):
                found.append(("non_finite", math.nan, math.nan, None))
            rank, sigma = row.get("stable_rank", math.nan), row.get("spectral_norm", math.nan)
            history = self._history[name]
            while history and history[0][0] < step - rules.window:
                history.popleft()
            if armed and math.isfinite(rank) and history:
                peak_step, peak = max(((s, r) for s, r, _ in history), key=lambda p: p[1])
                if peak > 0 and 1 - rank / peak > rules.rank_drop:
                    found.append(("rank_collapse", 1 - rank / peak, rules.rank_drop, peak_step))
            if armed and math.isfinite(sigma) and history:
                base_step, base = min(((s, v) for s, _, v in history), key=lambda p: p[1])
                if base > 0 and sigma / base > rules.sigma_growth:
                    found.append(("sigma_growth", sigma / base, rules.sigma_growth, base_step))
            alpha = row.get("esd_alpha", math.nan)
            low, high = rules.esd_alpha_low, rules.esd_alpha_high
            if armed and math.isfinite(alpha) and low is not None and alpha < low:
                found.append(("esd_alpha_low", alpha, low, None))
            if armed and math.isfinite(alpha) and high is not None and alpha > high:
                found.append(("esd_alpha_high", alpha, high, None))
            if armed and math.isfinite(rank) and math.isfinite(sigma):
                history.append((step, rank, sigma))
            for kind, value, threshold, since in found:
                last = self._last.get((kind, name))
                if last is not None and step - last < rules.window:
                    continue
                self._last[(kind, name)] = step
                self.counts[kind] += 1
                raised.append(
                    Alert(
                        kind,
                        step,
                        name,
                        target.layer,
                        target.role,
                        value,
                        threshold,
                        since,
                        stack=stack_of(target),
                    )
                )
        raised += self._check_logit_bounds(step, values)
        return raised

    def _check_logit_bounds(
        self, step: int, values: Mapping[str, Mapping[str, float]]
    ) -> list[Alert]:
        """``logit_growth`` of each attention layer whose heads this snapshot holds."""
        rules = self.rules
        bound: dict[str, tuple[Any, float]] = {}  # layer -> (a head target, max over heads)
        for name, row in values.items():
            target = self.targets.get(name)
            # Behind QK-norm the logits do not follow the projections (their qk_spectral_norm grew
            # 3.4x in 50 steps on a QK-norm run whose measured logits fell: benchmarks/
            # logit_growth_lead_time.py, docs/callback.md); the norms' gains bound them.
            value = row.get("qk_norm_logit_bound", row.get("qk_spectral_norm", math.nan))
            if target is None or not math.isfinite(value):
                continue
            layer = target.attention_layer or name
            bound[layer] = (target, max(value, bound.get(layer, (target, -math.inf))[1]))
        raised = []
        for layer, (target, value) in bound.items():
            history = self._bounds[layer]
            while history and history[0][0] < step - rules.window:
                history.popleft()
            if step < rules.after_step:
                continue
            if history:
                base_step, base = min(history, key=lambda entry: entry[1])
                last = self._last.get(("logit_growth", layer))
                if (
                    base > 0
                    and value / base > rules.logit_growth
                    and (last is None or step - last >= rules.window)
                ):
                    self._last[("logit_growth", layer)] = step
                    self.counts["logit_growth"] += 1
                    raised.append(
                        Alert(
                            "logit_growth",
                            step,
                            layer,
                            target.layer,
                            target.role,
                            value / base,
                            rules.logit_growth,
                            base_step,
                            stack=stack_of(target),
                        )
                    )
            history.append((step, value))
        return raised

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the counts, each matrix's window of snapshots, its last alerts."""
        return {
            "counts": dict(self.counts),
            "history": {name: [list(entry) for entry in h] for name, h in self._history.items()},
            "last": [[kind, name, step] for (kind, name), step in self._last.items()],
            "bounds": {layer: [list(entry) for entry in h] for layer, h in self._bounds.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned: a resumed run counts on, compares with the
        snapshots before the checkpoint and does not repeat an alert within its window."""
        self.counts.update({kind: int(n) for kind, n in state.get("counts", {}).items()})
        self._history.clear()
        for name, entries in state.get("history", {}).items():
            self._history[name] = collections.deque(
                (int(step), float(rank), float(sigma)) for step, rank, sigma in entries
            )
        self._last = {(kind, name): int(step) for kind, name, step in state.get("last", [])}
        self._bounds.clear()
        for layer, entries in state.get("bounds", {}).items():
            self._bounds[layer] = collections.deque(
                (int(step), float(value)) for step, value in entries
            )

    def count_scalars(self) -> dict[str, float]:
        """``spectral_alerts/<kind>``: the alerts of each kind raised so far."""
        return {alert_tag(kind): float(count) for kind, count in self.counts.items()}


def alert_table(alerts: Sequence[Alert]) -> str:
    """The alerts of one snapshot as a Markdown table (TensorBoard renders its text entries so);
    ``value`` and ``threshold`` are in the row's ``unit``.

    >>> print(alert_table([Alert("sigma_growth", 300, "h.0.q", 0, "Q", 2.5, 2.0, 250)]))
    | step | kind | matrix | stack | layer | role | value | threshold | unit | since step |
    |---|---|---|---|---|---|---|---|---|---|
    | 300 | sigma_growth | h.0.q |  | 0 | Q | 2.5 | 2 | factor | 250 |
    """
    lines = [
        "| step | kind | matrix | stack | layer | role | value | threshold | unit | since step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in alerts:
        since = "" if a.since_step is None else str(a.since_step)
        lines.append(
            f"| {a.step} | {a.kind} | {a.matrix} | {a.stack} | {a.layer} | {a.role} | "
            f"{a.value:.4g} | {a.threshold:.4g} | {a.unit} | {since} |"
        )
    return "\n".join(lines)


def alert_rows(text: str) -> list[dict]:
    r"""The alerts of one text entry: the Markdown table :func:`alert_table` writes, read back (the
    SPECTRAL tab's alerts panel), one dict per row keyed by its header (``step``, ``kind``,
    ``matrix``, ``value``, ``threshold``, ...); numbers as numbers (NaN as ``None``), an empty cell
    as ``None``.

    >>> table = "| step | kind | matrix | value | since step |\n|---|---|---|---|---|\n"
    >>> alert_rows(table + "| 300 | sigma_growth | h.0.q | 2.5 |  |")
    [{'step': 300, 'kind': 'sigma_growth', 'matrix': 'h.0.q', 'value': 2.5, 'since_step': None}]
    """
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    if len(lines) < 2:
        return []
    header = [cell.replace(" ", "_") for cell in _cells(lines[0])]
    return [dict(zip(header, map(_cell_value, _cells(line)), strict=False)) for line in lines[2:]]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def _cell_value(cell: str) -> object:
    if cell == "":
        return None
    for kind in (int, float):
        try:
            number = kind(cell)
        except ValueError:
            continue
        return number if math.isfinite(number) else None  # NaN: a non_finite alert's value
    return cell
