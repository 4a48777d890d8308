"""The options every frontend takes, defined and validated once.

:class:`MonitorOptions` is the one definition of what ``SpectralTracker``, both Lightning
``SpectralMonitor`` classes and the Hugging Face ``SpectralTrainerCallback`` accept. Every value is
checked at construction by :func:`require`, so a bad argument fails in the user's own line with a
message that names it, says what is allowed and shows what came - never later, deep in a worker
thread, as an error that blames a weight matrix.

Example::

    >>> MonitorOptions(every_n_steps=50).every_n_steps
    50
    >>> MonitorOptions(n_iter=-1)
    Traceback (most recent call last):
    ...
    spectral_callbacks.monitor.checks.ConfigurationError: `n_iter` must be None or a non-negative int, got -1
    >>> MonitorOptions.from_kwargs("SpectralMonitor", every_n_step=50)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: SpectralMonitor got unknown argument(s) 'every_n_step' (did you mean 'every_n_steps'?); ...

Every frontend's ``__init__`` carries :func:`with_options`: its signature then lists each field of
:class:`MonitorOptions` as a keyword-only parameter with its default (``help()``,
``inspect.signature`` and the docs show them), so a new option is one new field here.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from spectral_callbacks.functional.circuits import CIRCUIT_METRICS
from spectral_callbacks.functional.esd import ESD_MEDIAN_ALPHA, ESD_METRICS
from spectral_callbacks.functional.metrics import MIN_FIT_POINTS, UPDATE_METRICS
from spectral_callbacks.functional.svd import METHODS, Method
from spectral_callbacks.monitor.alerts import AlertRules
from spectral_callbacks.monitor.checks import (
    ConfigurationError,
    did_you_mean,
    is_int,
    is_names,
    is_real,
    require,
)
from spectral_callbacks.monitor.lr_balance import LRBalance

__all__ = [
    "DEFAULT_FIGURE_ROLES",
    "DEFAULT_METRICS",
    "KNOWN_METRICS",
    "ConfigurationError",
    "MonitorOptions",
    "check_schedule",
    "is_int",
    "is_names",
    "is_real",
    "option_names",
    "require",
    "with_options",
]

#: Metrics the SVD path produces, ``compression`` derived from ``stable_rank``, the update family
#: of adapted layers (logged for them by default: see ``tracker.py``), the ESD family of the
#: full eigenvalue spectrum (computed on every ``esd_every_n_snapshots``-th snapshot) and the
#: per-head circuits (with ``circuits``).
KNOWN_METRICS: tuple[str, ...] = (
    "stable_rank",
    "alpha",
    "alpha_r2",
    "spectral_norm",
    "frobenius_norm",
    "energy_rank_90",
    "compression",
    *UPDATE_METRICS,
    *ESD_METRICS,
    ESD_MEDIAN_ALPHA,
    *CIRCUIT_METRICS,
)

# Every metric defined on the default settings and cheap at every snapshot: not the ESD family
# (an exact eigendecomposition of each matrix, several times the cost of its top-k SVD), nor
# energy_rank_90 (NaN whenever 90 % of ||W||_F^2 lies beyond the top k=32: 95 % of the demo's
# values).
DEFAULT_METRICS: tuple[str, ...] = tuple(
    name
    for name in KNOWN_METRICS
    if name not in (*ESD_METRICS, ESD_MEDIAN_ALPHA, "energy_rank_90", *UPDATE_METRICS)
    and name not in CIRCUIT_METRICS
)

# The default asks for the Q figures where there is a Q (a model without one, e.g. MLA's Q_down /
# Q_up, simply gets none); roles the user names must exist.
DEFAULT_FIGURE_ROLES: tuple[str, ...] = ("Q",)

# Nice increments a process may add to lower a thread's priority (Linux: 0 .. 19).
_MAX_NICE = 19

# The fewest ranks each fitted metric needs (functional/metrics.py): below that the metric is NaN
# at every step, which should be said at construction, not discovered in the charts.
# (The ESD family fits the full spectrum, whatever k.)
_FIT_RANKS = {"alpha": MIN_FIT_POINTS, "alpha_r2": MIN_FIT_POINTS}


def is_patterns(value: Any) -> bool:
    """``None``, a name pattern (a string or a compiled regex) or a list or tuple of them."""
    if value is None or isinstance(value, str | re.Pattern):
        return True
    return isinstance(value, list | tuple | set | frozenset) and all(
        isinstance(item, str | re.Pattern) for item in value
    )


@dataclass(frozen=True)
class MonitorOptions:
    r"""What to watch, when to snapshot, how to decompose and what to log.

    Args:
        metrics: which metrics to log, from ``stable_rank, alpha, alpha_r2, spectral_norm,
            frobenius_norm, energy_rank_90, compression, esd_alpha, esd_ks_distance, esd_xmin,
            esd_tail_size``; ``esd_alpha`` brings the rest of its family (its fit's D, x_min and
            tail size). Default: all but ``energy_rank_90`` and the ESD family.
        roles, include, exclude, mapping: which matrices to watch; passed to
            :func:`spectral_callbacks.targets.find_targets` (which checks them). Default ``None``
            watches every Q, K, V, O, MLP_up and MLP_down matrix found.
        example_input: a batch for one forward of the model (a tensor, a tuple of arguments or a
            dict of keyword arguments): roles, fused layouts and layers are then read from that
            forward, the name rules checked against it (``find_targets(example_input=)``).
            Default ``None``: the name rules alone.
        roles_from_first_forward: read the roles from the first forward the model makes after
            construction (the first training forward: recorded, not repeated). ``"auto"``: the
            name rules first (the fast path: where they place every weight of the blocks, the
            targets are found and step 0 snapshotted at construction, and the first forward
            must agree with them); where they cannot, the targets, the engine and the first
            snapshot wait for that forward. ``True``: the forward always decides (the targets
            wait for it). ``False``: the names alone. A compiled model (``torch.compile``) and
            sharded (DTensor) weights are read by the names, said in one line.
            Default ``"auto"``.
        every_n_steps: snapshot every this many optimizer steps. Default ``25``.
        log_spaced_until: also snapshot at the powers of two below this step (dense early points,
            where the stable rank collapses); ``0`` turns them off. Default ``1000``.
        max_overhead: a fraction of training time the snapshots may cost (e.g. ``0.01``); the
            interval then stretches along the grid to stay within it. Default ``None`` (off).
        k: singular values computed per matrix (capped at the smaller side). Default ``32``.
        n_oversamples, n_iter, svd_method: randomized-SVD options; ``None`` keeps the defaults of
            :func:`spectral_callbacks.functional.randomized_svd`. Default ``None, None, "auto"``.
        fit_window: 1-based ranks ``(first, last)`` of the α fit; ``None`` fits ranks 1..k.
        esd_every_n_snapshots: with an ESD metric in ``metrics``, fit the full eigenvalue spectrum
            on the first snapshot, every this many after it and the run's last one (taken again
            at the last step when the cadence missed it), counted over the whole run (a
            resumed run keeps the cadence; an exact eigendecomposition costs several top-k SVDs,
            see benchmarks/esd_snapshot.py). Default ``10``.
        max_pending: snapshots that may be in flight; when the bound is hit a snapshot is skipped and
            counted in ``spectral_monitor/skipped``, never queued. Default ``2``.
        max_snapshot_bytes: bytes the snapshot copies and the SVD's working set may hold at once
            (per process, counted by the engine from shapes, never asked of the device). A snapshot
            that does not fit is copied in parts over consecutive optimizer steps, each matrix
            logged at the step of its copy. ``"auto"``: 5 % of the total memory of the device the
            watched matrices live on (the GPU's, or the host's); ``None``: no bound.
            Default ``"auto"``.
        figure_every_n_steps: draw figures every this many optimizer steps (on the first snapshot
            logged at or after each multiple), and always at the end; ``None`` draws them only at
            the end. Default ``1000``.
        figures: draw figures at all (TensorBoard only). Default ``True``.
        figure_roles: roles that get an α-vs-depth and a compression-wave figure (``None``: every
            role); other than the default, checked against the roles found when the model is
            known. Default ``("Q",)``.
        synchronous: where a snapshot's CPU work runs: ``True`` inline on the training thread at
            its step, ``False`` on the worker thread (on CUDA: the side stream), ``None`` chosen
            at the start of training: on the CPU the worker where a core is spare beside
            training's intra-op threads, inline where none is (``monitor/engines/placement.py``); on CUDA
            the side stream. Default ``None``.
        drain_timeout: seconds to wait for in-flight snapshots at the end of training or after an
            exception. Default ``60.0``.
        worker_threads: intra-op threads of the worker; ``None`` keeps torch's default. Default ``1``.
        worker_nice: on the CPU (Linux), raise the worker thread's nice value by this increment
            (0-19); ``None`` or ``0`` leaves it. Default ``None``.
        history_size: snapshots kept in memory for the figures. Default ``256``.
        experts: what a mixture of experts logs per (layer, role): ``"aggregate"`` the mean, min
            and max over its experts as scalars and their distribution as a histogram,
            ``"each"`` also one scalar per expert (``spectral_<metric>/L03/E007/MLP_down``).
            Default ``"aggregate"``.
        alerts: the :class:`~spectral_callbacks.monitor.alerts.AlertRules` each snapshot's results
            are read against (rank collapse, σ₁ growth, non-finite weights; ESD α out of a band
            when its thresholds are set);
            ``None`` turns alerts off. Default ``AlertRules()``.
        on_alert: called on the main thread with each
            :class:`~spectral_callbacks.monitor.alerts.Alert` (to stop the run, lower the learning
            rate, ...). Default ``None``.
        compute: replace the SVD + metrics function (``(group, batch) -> {metric: (B,) tensor}``).
            Default ``None`` (:class:`~spectral_callbacks.monitor.engines.compute.SpectrumCompute`).
        delta: also log the update family (``spectral_update_*``) of each dense watched matrix
            against a reference: ``"first"`` (its weights when the tracker starts) or a base
            model's ``state_dict`` or the path of one (``.safetensors``, ``.pt``, a model
            directory). Keeps one copy of every watched matrix on its device for the whole run,
            refused at construction when it does not fit (docs/fine-tuning.md). Default ``None``.
        circuits: also log the QK and OV circuits of every attention head
            (``qk_spectral_norm``, the distance-0 QK circuit times the logit scale the module
            declares; ``qk_logit_bound`` or ``qk_norm_logit_bound`` where a bound on the logits
            holds for the layer's kind; ``qk_stable_rank``, ``ov_spectral_norm``,
            ``ov_stable_rank``; docs/logged-names.md),
            computed exactly from the snapshot's copies of Q/K/V/O off the training thread.
            ``True`` reads each layer's head count from its module or config; a dict
            ``{pattern: num_heads}`` gives it for the attention modules it matches (fnmatch, as
            ``mapping``). Default ``False`` (the copies of Q/K/V/O are taken a second time:
            benchmarks/circuits_cost.py).
        lr_balance: an :class:`~spectral_callbacks.monitor.lr_balance.LRBalance`: at each ESD
            snapshot, TempBalance's learning-rate factor of each watched matrix from its
            ``esd_alpha`` (the ESD family is then computed whatever ``metrics`` says), applied
            to its parameter groups around each optimizer step and logged as
            ``spectral_lr_factor/L<layer>/<role>`` (docs/lr-balance.md). One process only.
            Default ``None`` (off).

    Raises:
        ConfigurationError: an argument out of range or of the wrong type, named in the message.
    """

    metrics: Sequence[str] = DEFAULT_METRICS
    roles: Sequence[str] | None = None
    include: Any = None
    exclude: Any = None
    mapping: Any = None
    example_input: Any = dataclasses.field(default=None, compare=False, repr=False)
    roles_from_first_forward: bool | Literal["auto"] = "auto"
    every_n_steps: int = 25
    log_spaced_until: int = 1000
    max_overhead: float | None = None
    k: int = 32
    n_oversamples: int | None = None
    n_iter: int | None = None
    svd_method: Method = "auto"
    fit_window: tuple[int, int] | None = None
    esd_every_n_snapshots: int = 10
    max_pending: int = 2
    max_snapshot_bytes: int | Literal["auto"] | None = "auto"
    figure_every_n_steps: int | None = 1000
    figures: bool = True
    figure_roles: Sequence[str] | None = DEFAULT_FIGURE_ROLES
    synchronous: bool | None = None
    drain_timeout: float = 60.0
    worker_threads: int | None = 1
    worker_nice: int | None = None
    history_size: int = 256
    experts: Literal["aggregate", "each"] = "aggregate"
    alerts: AlertRules | None = AlertRules()
    on_alert: Any = None
    compute: Any = None
    delta: Any = None
    circuits: bool | Mapping[str, int] = False
    lr_balance: LRBalance | None = None

    def __post_init__(self) -> None:
        metrics = self.metrics
        require(
            "metrics",
            metrics,
            is_names(metrics) and bool(metrics) and all(m in KNOWN_METRICS for m in metrics),
            f"a non-empty list of {', '.join(KNOWN_METRICS)}",
        )
        if "esd_alpha" in metrics:  # the exponent comes with its fit's D, x_min and tail size
            metrics = (*metrics, *(name for name in ESD_METRICS if name not in metrics))
        object.__setattr__(self, "metrics", tuple(metrics))
        require(
            "roles_from_first_forward",
            self.roles_from_first_forward,
            isinstance(self.roles_from_first_forward, bool)
            or self.roles_from_first_forward == "auto",
            '"auto", True or False',
        )
        require(
            "roles",
            self.roles,
            self.roles is None or is_names(self.roles),
            "None or a list of role names",
        )
        check_schedule(self.every_n_steps, self.log_spaced_until, self.max_overhead)
        for name in ("k", "max_pending", "history_size", "esd_every_n_snapshots"):
            value = getattr(self, name)
            require(name, value, is_int(value, 1), "a positive int")
        require(
            "experts", self.experts, self.experts in ("aggregate", "each"), "'aggregate' or 'each'"
        )
        budget = self.max_snapshot_bytes
        require(
            "max_snapshot_bytes",
            budget,
            budget is None or budget == "auto" or is_int(budget, 1),
            "a positive int (bytes, e.g. 256 * 2**20), 'auto' or None",
        )
        for name in ("n_oversamples", "n_iter"):
            value = getattr(self, name)
            require(name, value, value is None or is_int(value, 0), "None or a non-negative int")
        require("svd_method", self.svd_method, self.svd_method in METHODS, f"one of {METHODS}")
        window = self.fit_window
        require(
            "fit_window",
            window,
            window is None
            or isinstance(window, tuple | list)
            and len(window) == 2
            and all(is_int(rank, 1) for rank in window)
            and window[0] <= window[1],
            "None or 1-based ranks (first, last) with 1 <= first <= last, e.g. (1, 32)",
        )
        self._check_fit_ranks()
        every = self.figure_every_n_steps
        require(
            "figure_every_n_steps",
            every,
            every is None or is_int(every, 1),
            "a positive int or None",
        )
        require("figures", self.figures, isinstance(self.figures, bool), "True or False")
        require(
            "synchronous",
            self.synchronous,
            self.synchronous is None or isinstance(self.synchronous, bool),
            "None (chosen from the machine's cores), True (inline) or False (worker thread)",
        )
        require(
            "figure_roles",
            self.figure_roles,
            self.figure_roles is None or is_names(self.figure_roles),
            "None or a list of role names such as ('Q', 'K')",
        )
        timeout = self.drain_timeout
        require(
            "drain_timeout",
            timeout,
            is_real(timeout) and math.isfinite(timeout) and timeout >= 0,
            "a finite number of seconds >= 0 (for a long wait, a large one such as 3600)",
        )
        threads = self.worker_threads
        require(
            "worker_threads",
            threads,
            threads is None or is_int(threads, 1),
            "None or a positive int",
        )
        nice = self.worker_nice
        require(
            "worker_nice",
            nice,
            nice is None or is_int(nice, 0) and nice <= _MAX_NICE,
            f"None or a nice increment from 0 to {_MAX_NICE}",
        )
        require(
            "alerts",
            self.alerts,
            self.alerts is None or isinstance(self.alerts, AlertRules),
            "None or an AlertRules",
        )
        require(
            "on_alert",
            self.on_alert,
            self.on_alert is None or callable(self.on_alert),
            "None or a function called with each Alert",
        )
        require(
            "compute",
            self.compute,
            self.compute is None or callable(self.compute),
            "None or a function (group, batch) -> {metric: (B,) tensor}",
        )
        delta = self.delta
        require(
            "delta",
            delta,
            delta is None
            or isinstance(delta, Mapping)
            or isinstance(delta, str | os.PathLike)
            and bool(str(delta)),
            "None, 'first', a state_dict of the base weights or the path of one",
        )
        if isinstance(delta, str | os.PathLike) and delta != "first" and not os.path.exists(delta):
            # a typo of 'first' ("firsts") or a missing file: said now, not when training starts
            raise ConfigurationError(
                f"`delta`={str(delta)!r}: no such file; give a state_dict, its file or 'first'"
            )
        for name in ("include", "exclude"):
            value = getattr(self, name)
            require(
                name,
                value,
                is_patterns(value),
                "None, a name pattern (an fnmatch string such as '*.attn.*' or a compiled regex) "
                "or a list of them",
            )
        mapping = self.mapping
        require(
            "mapping",
            mapping,
            mapping is None
            or callable(mapping)
            or isinstance(mapping, Mapping)
            and all(isinstance(key, str | re.Pattern) for key in mapping),
            "None, a dict {pattern: role | Split | None} such as {'*.attn.wq': 'Q'} or a "
            "function (name, weight) -> decision",
        )
        circuits = self.circuits
        require(
            "circuits",
            circuits,
            isinstance(circuits, bool)
            or isinstance(circuits, Mapping)
            and bool(circuits)
            and all(isinstance(p, str) and is_int(n, 1) for p, n in circuits.items()),
            "True, False or a dict {pattern: number of query heads}, e.g. {'*.attn': 12}",
        )
        require(  # its fields are checked by LRBalance itself
            "lr_balance",
            self.lr_balance,
            self.lr_balance is None or isinstance(self.lr_balance, LRBalance),
            "None or an LRBalance, e.g. LRBalance(low=0.7, high=1.3)",
        )

    def _check_fit_ranks(self) -> None:
        """``k`` (and ``fit_window``) leave each fitted metric asked for enough ranks to fit."""
        for metric, least in _FIT_RANKS.items():
            if metric not in self.metrics:
                continue
            fit = "alpha" if metric == "alpha_r2" else metric
            leave = "alpha and alpha_r2" if fit == "alpha" else fit
            require(
                "k",
                self.k,
                self.k >= least,
                f"at least {least} to fit `{fit}` (or leave {leave} out of `metrics`)",
            )
            window = self.fit_window
            if fit == "alpha" and window is not None:
                # the fit reads ranks first..min(last, k): a window beyond k has no point to fit
                require(
                    "fit_window",
                    window,
                    min(window[1], self.k) - window[0] + 1 >= least,
                    f"ranks spanning at least {least} to fit `alpha`, counted within the computed "
                    f"ranks 1..k={self.k} (a smaller first rank or a larger `k`), e.g. (1, {self.k})",
                )

    @classmethod
    def from_kwargs(
        cls, caller: str, own_arguments: Sequence[str] = (), **kwargs: Any
    ) -> MonitorOptions:
        """The options from a frontend's keyword arguments, naming an unknown one plainly
        (``own_arguments``: the frontend's keywords that are not options, such as the tracker's
        ``logdir``, so that ``log_dir`` is answered with the one meant).

        Raises:
            TypeError: an argument that is not an option (with the list of options).
            ConfigurationError: an option out of range.
        """
        known = option_names()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            everything = [*own_arguments, *known]
            named = ", ".join(f"{name!r}{did_you_mean(name, everything)}" for name in unknown)
            own = f"{', '.join(own_arguments)} and " if own_arguments else ""
            raise TypeError(
                f"{caller} got unknown argument(s) {named}; it takes {own}the options "
                f"{', '.join(known)}"
            )
        return cls(**kwargs)

    @property
    def target_options(self) -> dict[str, Any]:
        """The arguments passed on to ``find_targets``."""
        return {
            "roles": self.roles,
            "include": self.include,
            "exclude": self.exclude,
            "mapping": self.mapping,
            "example_input": self.example_input,
        }

    def replace(self, **changes: Any) -> MonitorOptions:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def check_schedule(every_n_steps: Any, log_spaced_until: Any, max_overhead: Any) -> None:
    """The checks of the schedule's arguments (``SnapshotSchedule`` runs them too)."""
    require("every_n_steps", every_n_steps, is_int(every_n_steps, 1), "a positive int")
    require(
        "log_spaced_until",
        log_spaced_until,
        is_int(log_spaced_until, 0),
        "a non-negative int (0 turns dense early steps off)",
    )
    require(
        "max_overhead",
        max_overhead,
        max_overhead is None or is_real(max_overhead) and 0 < max_overhead < 1,
        "a fraction in (0, 1) such as 0.01 for 1 %, or None",
    )


def option_names() -> tuple[str, ...]:
    """Every option's name, in the order of :class:`MonitorOptions`' fields (what
    :meth:`MonitorOptions.from_kwargs` accepts and :func:`with_options` adds to a signature)."""
    return tuple(field.name for field in dataclasses.fields(MonitorOptions))


_Init = TypeVar("_Init", bound=Callable[..., None])


def with_options(init: _Init) -> _Init:
    """Give a frontend's ``__init__(self, ..., **options)`` a signature that lists every option.

    The ``**options`` parameter is replaced, in the signature ``inspect.signature`` and ``help()``
    read, by one keyword-only parameter per field of :class:`MonitorOptions` (with its default and
    type) that ``init`` does not already name; the function itself still takes them as keywords,
    checked by :meth:`MonitorOptions.from_kwargs`. A new field is thereby a new parameter of every
    frontend.

    >>> @with_options
    ... def make(metrics=("stable_rank",), **options): ...
    >>> parameters = inspect.signature(make).parameters
    >>> parameters["every_n_steps"]
    <Parameter "every_n_steps: 'int' = 25">
    >>> list(parameters) == list(option_names())
    True
    """
    signature = inspect.signature(init)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    named = {p.name for p in own}
    options = [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=field.default,
            annotation=field.type,
        )
        for field in dataclasses.fields(MonitorOptions)
        if field.name not in named
    ]
    init.__signature__ = signature.replace(parameters=[*own, *options])  # type: ignore[attr-defined]
    return init
