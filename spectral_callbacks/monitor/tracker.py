"""SpectralTracker: the framework-agnostic core every frontend drives.

It owns the pipeline - find targets → schedule → snapshot + engine → reporting → writers and
dashboards - behind four calls any training loop can make::

    tracker = SpectralTracker(model, logdir="runs/exp")   # snapshots step 0 now
    for step in range(1, max_steps + 1):
        ...; optimizer.step(); optimizer.zero_grad()
        tracker.step(step)                                 # after the update; cheap when not due
    tracker.close()                                        # the last step, drained, final figures

Steps are optimizer steps (0 = before the first update). ``step(s)`` must be called after the
update of step ``s`` and before the next one: on the CPU the copy is made inside the call, on
CUDA it is queued on the training stream, behind the update and ahead of the next one, and the SVD
runs on a compute stream that waits for the copy by an event (see ``snapshot.py``).

Several processes (a default process group with more than one rank): every rank constructs a
tracker and calls ``step`` at the same steps; under DDP each decomposes its share, with sharded
(DTensor) weights the ranks decompose each matrix together where its shards live, and rank 0
writes everything (``writers`` and ``logdir`` are ignored on the other ranks).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.tensor import DTensor

from spectral_callbacks import tensorboard_adapter as tb
from spectral_callbacks.functional import CIRCUIT_METRICS, ESD_METRICS
from spectral_callbacks.functional.esd import ESD_MEDIAN_ALPHA
from spectral_callbacks.functional.metrics import UPDATE_METRICS
from spectral_callbacks.messages import rank_zero_info, rank_zero_warn
from spectral_callbacks.monitor import background, dashboards
from spectral_callbacks.monitor.alerts import Alert, AlertWatch, alert_table
from spectral_callbacks.monitor.balancer import LRBalancer
from spectral_callbacks.monitor.engines.budget import Plan, plan_snapshot, resolve_budget
from spectral_callbacks.monitor.engines.compute import (
    ComputeFunction,
    SpectrumCompute,
    as_compute_function,
)
from spectral_callbacks.monitor.engines.distributed import world
from spectral_callbacks.monitor.engines.engine import SnapshotResult
from spectral_callbacks.monitor.engines.placement import Placement, machine_placement
from spectral_callbacks.monitor.engines.protocol import Engine, make_engine
from spectral_callbacks.monitor.interrupts import ctrl_c_after
from spectral_callbacks.monitor.max_logits import MAX_LOGIT, MaxLogits
from spectral_callbacks.monitor.options import (
    DEFAULT_FIGURE_ROLES,
    DEFAULT_METRICS,
    ConfigurationError,
    MonitorOptions,
    is_int,
    require,
    with_options,
)
from spectral_callbacks.monitor.reporting import Reporter, health_scalars
from spectral_callbacks.monitor.schedule import SnapshotSchedule
from spectral_callbacks.monitor.snapshot import group_by_shape
from spectral_callbacks.monitor.watch_plan import WatchPlan
from spectral_callbacks.names import (
    ALERT_SECTION,
    LR_BALANCE_SECTION,
    LR_FACTOR,
    METRIC_PREFIX,
    TARGET_MAP_TAG,
    format_target_map,
    is_heads_role,
)
from spectral_callbacks.targets.target import Target

# The TensorBoard writers are flushed at most this often: a running TensorBoard (which rereads its
# files every few seconds) still shows each point within seconds, and a burst of snapshots (the
# dense early schedule) costs one flush, not one each (a flush waits for the writer thread).
FLUSH_INTERVAL_SECONDS = 1.0
# The tracker's keywords that are not MonitorOptions: named with the options when one is mistyped.
_TRACKER_ARGUMENTS = ("logdir", "writers", "start_step", "state", "optimizer", "forward_compiled")
# What is said once per run, at the first matrix each kind of problem hit.
_FIRST_PROBLEM = {
    "non_finite": (
        "the weights of {name!r} hold NaN or Inf at step {step} (the first non-finite matrix "
        "found); its metrics are logged as NaN from there on"
    ),
    "svd_fallback": (
        "the SVD's solver raised on {name!r} at step {step} (the log has its error); its spectrum "
        "comes from the exact float64 path, and so does that of any later matrix this happens to "
        "(spectral_monitor/svd_fallbacks counts them)"
    ),
}


def _check_step(step: Any) -> None:
    require("step", step, is_int(step, 0), "a non-negative int (the optimizer step)")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _as_caller(method: _Method) -> _Method:
    """The threads ``method`` starts are the caller's (its name in the messages at exit)."""

    @functools.wraps(method)
    def wrapper(self: SpectralTracker, *args: Any, **kwargs: Any) -> Any:
        with background.owned_by(self.caller):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class SpectralTracker:
    r"""Snapshot a model's watched matrices on schedule, decompose them off the training path, log.

    Args:
        model: the network (any ``nn.Module``; wrappers such as DDP or ``torch.compile`` are
            unwrapped by :func:`~spectral_callbacks.targets.find_targets`).
        metrics: which metrics to log (see :class:`MonitorOptions`).
        logdir: write TensorBoard event files here (scalars, the custom-scalars layout, figures).
        writers: objects with ``log_metrics(dict, step)`` - Lightning or Fabric loggers, for
            example - that get every scalar; TensorBoard loggers among them also get the layout
            and the figures. Default ``()``.
        start_step: the optimizer step the weights are at now: the tracker begins there (and, with
            nothing restored, snapshots it as the compression reference). ``None`` defers that to
            :meth:`begin` (frontends that restore state first). Default ``0``.
        state: a :meth:`state_dict` to resume from (as :meth:`load_state_dict` before beginning).
        options: a :class:`MonitorOptions` instead of the keyword arguments below.
        optimizer: with ``lr_balance``, the optimizer whose param groups it scales (or attach it
            later with :meth:`attach_optimizer`, before :meth:`begin`). Default ``None``.
        caller: the name error messages use. Default ``"SpectralTracker"``.
        forward_compiled: the model's forward will run compiled though the model is not (a
            frontend that compiles it later: the Hugging Face Trainer's ``torch_compile=True``),
            so the roles come from the names, said in one line. Default ``False``.
        \*\*kwargs: every other option of :class:`MonitorOptions` (``every_n_steps``, ``k``, ...).

    Raises:
        ConfigurationError: ``model`` not a module, neither ``logdir`` nor ``writers`` (nowhere
            to write), an option out of range, no matrix to watch, a bad mapping, a watched
            matrix that cannot fit ``max_snapshot_bytes`` alone (with the numbers),
            ``figure_roles`` naming a role the model does not have, ``max_overhead`` with
            several processes, ``lr_balance`` with several processes, without an optimizer at
            :meth:`begin` or with a param group mixing a watched matrix with other parameters,
            ``optimizer`` without ``lr_balance``, ``compute`` with sharded (DTensor) weights, or
            FSDP1 / ZeRO-3 parameters that cannot be gathered (FSDP1 without
            ``use_orig_params=True``; adapters or ``circuits=`` under either: see
            ``monitor/engines/partitioned.py``).
        ConfigurationError: from :meth:`step`, a step that is not a non-negative int or that
            goes back (checked before any work: the tracker stays usable).
        ShardedEngineError: with sharded weights, from :meth:`step` or :meth:`close`, if the
            sharded computation failed or fell behind on a rank (the run cannot go on).

    Example::

        >>> import tempfile, torch
        >>> model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
        >>> logdir = tempfile.mkdtemp()
        >>> with SpectralTracker(model, ["stable_rank"], logdir=logdir, figures=False) as tracker:
        ...     for step in range(1, 3):
        ...         tracker.step(step)
        >>> sorted(tracker.state_dict()["references"])[:1]
        ['linear1.weight']
    """

    @with_options
    def __init__(
        self,
        model: torch.nn.Module,
        metrics: Sequence[str] = DEFAULT_METRICS,
        *,
        logdir: str | os.PathLike[str] | None = None,
        writers: Sequence[Any] = (),
        start_step: int | None = 0,
        state: Mapping[str, Any] | None = None,
        options: MonitorOptions | None = None,
        optimizer: Any = None,
        caller: str = "SpectralTracker",
        forward_compiled: bool = False,
        **kwargs: Any,
    ) -> None:
        require(
            "model",
            model,
            isinstance(model, torch.nn.Module),
            "a torch.nn.Module (the network whose weights are watched)",
        )
        require(
            "start_step",
            start_step,
            start_step is None or is_int(start_step, 0),
            "None or a non-negative int (the optimizer step the weights are at now)",
        )
        if options is None:
            options = MonitorOptions.from_kwargs(
                caller,
                _TRACKER_ARGUMENTS if caller == "SpectralTracker" else (),
                metrics=metrics,
                **kwargs,
            )
        elif kwargs:
            raise TypeError(f"pass either `options` or keyword options, not both: {sorted(kwargs)}")
        self.options = options
        self.caller = caller
        watch = dict(
            model=model,
            writers=writers,
            logdir=logdir,
            state=state,
            start_step=start_step,
            optimizer=optimizer,
        )
        # Until the plan hands over the targets, everything that needs them waits (begin,
        # state_dict, load_state_dict write into ``_waiting``).
        self._waiting: dict[str, Any] | None = watch
        self.targets: list[Any] = []
        self._engine: Engine | None = None
        self._closed = False
        # The first snapshot's step while the heads wait for the first forward's logit scales
        # (WatchPlan.scales_pending): taken when the plan releases it.
        self._held_step: int | None = None
        self._max_logits = MaxLogits([])
        self._watch_plan = WatchPlan(model, options, caller, self._start_watching, self._offer_held)
        self._watch_plan.start(forward_compiled)

    def _watch(
        self,
        model: torch.nn.Module,
        targets: list[Any],
        writers: Sequence[Any],
        logdir: str | os.PathLike[str] | None,
        state: Mapping[str, Any] | None,
        start_step: int | None,
        optimizer: Any,
    ) -> None:
        """Everything that follows from the targets, in named steps: what is watched, where it is
        written, how it is computed within the budget, when, what is logged, the run's state."""
        self._init_targets(targets)
        writers = self._check_writers(writers, logdir)
        self._init_compute()
        world_size = self._init_schedule()
        self._balancer = self._make_balancer(model, optimizer, world_size)
        self._init_writers(writers, logdir)
        self._init_metrics()
        self._init_reporting()
        self._init_run_state()
        if state is not None:
            self.load_state_dict(state)
        if start_step is not None:
            self.begin(start_step)

    def _init_targets(self, targets: list[Any]) -> None:
        """The watched matrices (the plan's final targets); ``figure_roles`` checked against
        their roles."""
        options = self.options
        self.targets = targets
        found = list(dict.fromkeys(target.role for target in self.targets))
        figure_roles = options.figure_roles
        require(
            "figure_roles",
            figure_roles,
            figure_roles is None
            or tuple(figure_roles) == DEFAULT_FIGURE_ROLES
            or all(role in found for role in figure_roles),
            f"None or roles this model has ({', '.join(found)})",
        )

    def _check_writers(
        self, writers: Sequence[Any], logdir: str | os.PathLike[str] | None
    ) -> list[Any]:
        """``writers`` as a list of loggers, refused when the tracker would have nowhere to write."""
        writers = list(writers)
        require(
            "writers",
            writers,
            all(callable(getattr(writer, "log_metrics", None)) for writer in writers),
            "a list of loggers, objects with log_metrics(metrics: dict, step: int)",
        )
        if not writers and logdir is None:  # it would compute every snapshot and keep nothing
            raise ConfigurationError(
                f'{self.caller} has nowhere to write: pass `logdir="runs/exp"` (TensorBoard event '
                "files) or `writers=[...]` (loggers with log_metrics, e.g. Fabric's fabric.loggers)"
            )
        return writers

    def _init_compute(self) -> None:
        """The compute function and the snapshot budget, refused here, with the numbers, when
        one matrix cannot fit (the engine plans alike)."""
        options = self.options
        self.compute: ComputeFunction = (
            SpectrumCompute(
                options.k,
                n_oversamples=options.n_oversamples,
                n_iter=options.n_iter,
                method=options.svd_method,
                fit_window=options.fit_window,
                esd=any(name in (*ESD_METRICS, ESD_MEDIAN_ALPHA) for name in options.metrics)
                or options.lr_balance is not None,
                esd_every_n_snapshots=options.esd_every_n_snapshots,
                esd_median=ESD_MEDIAN_ALPHA in options.metrics
                or (options.lr_balance is not None and options.lr_balance.fit == "median"),
            )
            if options.compute is None
            else as_compute_function(options.compute)
        )
        self.max_snapshot_bytes = resolve_budget(options.max_snapshot_bytes, self.targets)
        self._plan: Plan | None = None
        if not any(isinstance(target.parameter, DTensor) for target in self.targets):
            self._plan = plan_snapshot(
                group_by_shape(self.targets), self.compute, self.max_snapshot_bytes, self.caller
            )

    def _init_schedule(self) -> int:
        """Which steps get a snapshot, and this process's rank; returns the world size."""
        options = self.options
        self.schedule = SnapshotSchedule(
            options.every_n_steps, options.log_spaced_until, options.max_overhead
        )
        self.rank, world_size = world()
        require(
            "max_overhead",
            options.max_overhead,
            options.max_overhead is None or world_size == 1,
            f"None with {world_size} processes (each rank would measure its own budget and "
            "snapshot at different steps; choose `every_n_steps` instead)",
        )
        return world_size

    def _init_writers(self, writers: list[Any], logdir: str | os.PathLike[str] | None) -> None:
        """Rank 0 writes: to ``writers`` and to its own TensorBoard writer in ``logdir``."""
        self.writers: list[Any] = list(writers) if self.rank == 0 else []
        self._own_logger: tb.LogdirWriter | None = None
        if logdir is not None and self.rank == 0:
            self._own_logger = tb.LogdirWriter(str(logdir))
            self.writers.append(self._own_logger)

    def _init_metrics(self) -> None:
        """The logged metrics: ``metrics``, plus what the targets and options add."""
        options = self.options
        # Adapted layers (targets/adapted.py) also log their update's spectrum by default; a
        # user who lists `metrics` gets exactly those (update_* names included).
        self.metrics: tuple[str, ...] = tuple(options.metrics)
        if self.metrics == DEFAULT_METRICS and any(target.has_update for target in self.targets):
            self.metrics += UPDATE_METRICS
        if options.circuits is not False:  # asked for by name: logged whatever `metrics` lists
            circuits = (*CIRCUIT_METRICS, MAX_LOGIT)  # max_logit: where observe_max_logits gives it
            self.metrics += tuple(name for name in circuits if name not in self.metrics)
        if self._balancer is not None:  # the ESD family and the α the balancer reads
            read = (*ESD_METRICS, self._balancer.balance.alpha_metric)
            self.metrics += tuple(dict.fromkeys(name for name in read if name not in self.metrics))

    def _init_reporting(self) -> None:
        """What reads the results: the alerts, the scalars, the figures, the dashboard layout."""
        options = self.options
        self._alerts = AlertWatch(self.targets, options.alerts) if options.alerts else None
        self._reporter = Reporter(
            self.targets, self.metrics, options.history_size, experts=options.experts
        )
        self._figures = dashboards.LiveFigures(
            options.figure_roles, options.figure_every_n_steps, exit_timeout=options.drain_timeout
        )
        self._layout = dashboards.LayoutWriter(self.targets, self.metrics)
        self._max_logits = MaxLogits([t for t in self.targets if is_heads_role(t.role)])

    def _init_run_state(self) -> None:
        """The run's state before :meth:`begin`: no engine yet, nothing skipped or flushed."""
        self._engine = None
        #: Where the CPU work of each snapshot runs, chosen in :meth:`begin`.
        self.placement: Placement | None = None
        self._restored_skipped = 0
        self._previous_step = -1
        self._previous_time: float | None = None
        self._warned: set[str] = set()  # kinds of _FIRST_PROBLEM already said
        self._closed = False
        self._unflushed = False
        self._flushed_at = -float("inf")
        # The final step when _finish takes it again for the ESD family: logged once, not twice.
        self._retaken_step: int | None = None

    # --- the calls a loop makes --------------------------------------------------------------

    @_as_caller
    def begin(self, step: int) -> None:
        """Start at optimizer step ``step``: the engine, the one-off scalars, the first snapshot.

        With no restored state the weights of ``step`` are snapshotted now: they are this run's
        compression reference (normally step 0, the initialization). Under several processes this
        is a collective: every rank calls it.
        """
        if self._engine is not None:
            return
        if self._closed:
            raise RuntimeError(f"{self.caller} is closed: construct a new one for a new run")
        _check_step(step)
        if self._waiting is not None:
            self._waiting["start_step"] = step  # begun when the first forward has shown the roles
            return
        options = self.options
        if self._balancer is not None and not self._balancer.attached:
            raise ConfigurationError(
                f"{self.caller}: `lr_balance` needs the optimizer whose learning rates it scales: "
                f"pass `{self.caller}(..., optimizer=optimizer)` or call "
                "`attach_optimizer(optimizer)` before the first step"
            )
        # Read now, not at construction: a loop may set training's threads in between.
        self.placement = machine_placement(
            options.synchronous,
            [target.parameter.device.type for target in self.targets],
            options.worker_threads,
        )
        rank_zero_info(f"{self.caller}: {self.placement.describe()}")
        if self._balancer is not None:
            rank_zero_info(f"{self.caller}: lr_balance: {self._balancer.summary()}")
        self._say_staggered(step)
        self._engine = make_engine(
            self.compute,
            self.targets,
            self.metrics,
            options,
            inline=self.placement.inline,
            skipped=self._restored_skipped,
            gathering=self._watch_plan.gathering,
        )
        once = {
            **self._reporter.num_layers_scalars(),
            **health_scalars(inline=self.placement.inline),
        }
        tb.log_scalars(self.writers, once, step)
        if self.schedule.last_snapshot_step is None:  # a run's first begin, not a resume
            tb.add_text(tb.summary_writers(self.writers), TARGET_MAP_TAG, self._target_map(), step)
        self._previous_step, self._previous_time = step, time.perf_counter()
        if self.schedule.last_snapshot_step is None:
            if step != 0:
                rank_zero_warn(
                    f"{self.caller}: training starts at step {step} with no state to resume from, "
                    f"so compression is measured against step {step}; to keep the reference of "
                    "an earlier run, resume with its saved state",
                    category=RuntimeWarning,
                )
            if self._watch_plan.scales_pending:  # the heads' scales come with the first forward
                self._held_step = step
            else:
                self._offer(step)

    @_as_caller
    def step(self, step: int) -> None:
        """Call after the optimizer update of ``step``: log what finished, snapshot if due.

        Calling it again with the same step (e.g. once per micro-batch) only logs what finished.
        A step that jumps over a grid step (several optimizer steps per call) still triggers it.
        """
        if self._closed:
            raise RuntimeError(f"{self.caller} is closed: construct a new one for a new run")
        _check_step(step)
        self._watch_plan.raise_kept_error()
        if self._waiting is not None:
            self._watch_plan.names_now(step)
        # No forward was recorded before this step (none ran: the weights are still the first
        # snapshot's): the declared scales stand and the held snapshot goes now.
        self._watch_plan.settle_scales()
        if step < self._previous_step:  # checked before any work, so the run can go on
            raise ConfigurationError(
                f"`step` must not go back: got {step} after {self._previous_step}; pass each "
                "optimizer step in order (a new run needs a new tracker)"
            )
        if self._engine is None:
            self.begin(step)
            return
        if step == self._previous_step:
            self._collect_and_log()
            return
        now = time.perf_counter()
        if self._previous_time is not None and step > self._previous_step:
            self.schedule.record_step_time(
                (now - self._previous_time) / (step - self._previous_step)
            )
        self._collect_and_log()  # first: a finished snapshot frees its slot
        # Budget mode cannot size the interval before the first cost is known: until then it passes
        # grid steps over (like any stretched interval) instead of piling up skips.
        cost_unknown = (
            self.schedule.max_overhead is not None and self.schedule.snapshot_seconds is None
        )
        if self.schedule.due(self._previous_step, step) and not (
            cost_unknown and self._engine.pending
        ):
            self._offer(step)
        else:  # the next parts of a snapshot staggered by the budget, if one is being taken
            self._engine.advance(step)
        self._previous_step, self._previous_time = step, now

    def attach_optimizer(self, optimizer: Any) -> None:
        """With ``lr_balance``: scale ``optimizer``'s learning rates from now on (its param groups
        are checked here). Frontends call it with the framework's optimizer.

        Raises:
            ConfigurationError: no ``lr_balance``; a param group mixing a watched matrix with other
                parameters; none of the watched matrices among the optimizer's parameters.
        """
        if self._balancer is None:
            raise ConfigurationError(
                f"{self.caller}: `optimizer` is only used by `lr_balance`, which is off; pass "
                "lr_balance=LRBalance() to balance its learning rates"
            )
        self._balancer.attach(optimizer)

    @_as_caller
    def close(self, step: int | None = None, *, error: BaseException | None = None) -> None:
        """End of training: measure the last step, wait (bounded) for in-flight work, shut down.

        Args:
            step: the last optimizer step; default the last one passed to :meth:`step`.
            error: the exception that stopped training, if any: then nothing new is snapshotted,
                what finishes within ``drain_timeout`` is logged with the final figures, and an
                error of the spectral work is only warned about, so it never hides ``error``.

        Raises:
            KeyboardInterrupt: a Ctrl-C during the wait, after the snapshots in flight are dropped
                (said in one line) and the tracker is shut down, so a loop of runs stops as it
                would anywhere else (not with ``error``: that one is already on its way up).

        Idempotent; also called by ``with SpectralTracker(...)`` on exit.
        """
        self._watch_plan.cancel()  # a forward that comes later has nothing to tell
        if error is None:  # a first snapshot held for the first forward, which never came
            self._watch_plan.settle_scales()
        if self._waiting is not None:  # no forward ran: nothing was watched
            self._closed = True
            if error is None:
                self._watch_plan.raise_kept_error()  # the first forward's, if its reading failed
            return
        if self._closed:
            return
        if step is not None:
            _check_step(step)
        interrupted = False
        try:
            try:
                if self._engine is not None and error is None:
                    self._finish(self._previous_step if step is None else step)
                elif self._engine is not None:
                    self._finish_after_exception()
            except KeyboardInterrupt:  # the wait said "Ctrl-C drops them": so it does
                interrupted = True
                self._interrupted()
        finally:
            interrupted = self._shutdown(wait=not interrupted) or interrupted
        if interrupted and error is None:
            raise KeyboardInterrupt

    def __enter__(self) -> SpectralTracker:
        return self

    def __exit__(self, exc_type: Any, error: BaseException | None, traceback: Any) -> None:
        self.close(error=error)

    # --- resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: compression references, schedule, skip count, compute state,
        the alerts' counts and windows.

        The results that have finished are logged first (so the saved alerts have read them).
        Saved before the first snapshot's result came back, it waits (bounded by
        ``drain_timeout``) for that result, so a resume keeps the compression reference.
        Saved while still waiting for the first forward (``roles_from_first_forward``), nothing
        has been watched yet: the state it was given to resume from (``{}`` if none), kept as is.
        """
        if self._waiting is not None:
            return dict(self._waiting["state"] or {})
        engine = self._engine
        if engine is not None and not self._reporter.references and engine.awaiting_results:
            self._collect_and_log(wait_seconds=self.options.drain_timeout)
        else:  # what has finished is logged (and read by the alerts) before it is saved
            self._collect_and_log()
        state: dict[str, Any] = {
            **self._reporter.state_dict(),  # the compression references and their steps
            "schedule": self.schedule.state_dict(),
            "skipped": engine.skipped if engine is not None else self._restored_skipped,
        }
        compute_state = self.compute.state_dict()
        if compute_state is not None:
            state["compute"] = compute_state
        if self._alerts is not None:
            state["alerts"] = self._alerts.state_dict()
        if self._balancer is not None:
            state["lr_balance"] = self._balancer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; call it before :meth:`begin`.

        Raises:
            RuntimeError: if the tracker has already begun (its engine counts skips from then on).
        """
        if self._waiting is not None:  # restored when the first forward has shown the roles
            self._waiting["state"] = dict(state)
            return
        if self._engine is not None:
            raise RuntimeError(
                f"{self.caller}.load_state_dict must come before the first step: construct it with "
                "`start_step=None` (or `state=`), load the state, then call `begin(step)`"
            )
        self._reporter.load_state_dict(state)
        self.schedule.load_state_dict(dict(state.get("schedule", {})))
        self._restored_skipped = int(state.get("skipped", 0))
        if "compute" in state:
            self.compute.load_state_dict(state["compute"])
        # The compute counts the snapshots it decomposes (its ESD cadence) on the worker, so at
        # checkpoint time its own count misses those still in flight; the schedule's count of
        # snapshots taken does not (counted here, on the main thread, when each was offered).
        if "snapshots" in state.get("schedule", {}):
            self.compute.continue_after(self.schedule.snapshots - self._restored_skipped)
        if self._alerts is not None and "alerts" in state:
            self._alerts.load_state_dict(state["alerts"])
        if self._balancer is not None and "lr_balance" in state:
            self._balancer.load_state_dict(state["lr_balance"])

    # --- the work ------------------------------------------------------------------------------

    # --- roles from the first forward ------------------------------------------------------------

    def forward_begins(self) -> None:
        """A frontend marks where the training step's forward begins (Lightning: the batch's
        start), so the first one is recorded whole whatever the step calls; a no-op after it."""
        self._watch_plan.forward_begins()

    def forward_ends(self) -> None:
        """... and where it ends, before the backward and the update (Lightning:
        ``on_before_backward``): the roles are read now and, if they waited, step 0 taken."""
        self._watch_plan.forward_ends()

    def _start_watching(self, targets: list[Target], begin: bool) -> None:
        """:meth:`_watch` what waited (the plan's final targets; ``begin`` False: the first
        snapshot is the next step's); if that raises, the tracker is still waiting (so
        :meth:`close` only ends it, with nothing begun to shut down)."""
        waiting = self._waiting
        assert waiting is not None
        self._waiting = None
        try:
            self._watch(targets=targets, **(waiting if begin else {**waiting, "start_step": None}))
        except BaseException:
            self._waiting = waiting
            raise

    def _offer_held(self) -> None:
        """The first snapshot the heads' logit scales held (see ``begin``), taken now."""
        step, self._held_step = self._held_step, None
        if step is not None and self._engine is not None and not self._closed:
            self._offer(step)

    def _make_balancer(
        self, model: torch.nn.Module, optimizer: Any, world_size: int
    ) -> LRBalancer | None:
        """The learning-rate balancer of ``lr_balance`` (on ``optimizer`` if given), or None."""
        balance = self.options.lr_balance
        if balance is None:
            require(
                "optimizer",
                optimizer,
                optimizer is None,
                "None without `lr_balance` (the optimizer is only used to balance its learning "
                "rates: pass lr_balance=LRBalance())",
            )
            return None
        require(
            "lr_balance",
            balance,
            world_size == 1,
            f"None with {world_size} processes (only rank 0 reads the results, and every rank "
            "must scale its learning rates alike)",
        )
        balancer = LRBalancer(balance, model, self.targets, self.caller)
        if optimizer is not None:
            balancer.attach(optimizer)
        return balancer

    def observe_max_logits(self, attention: torch.nn.Module | str, max_scores: Any) -> None:
        """Log the per-head maximum logit an attention call handed out, beside its heads' QK
        values (``monitor/max_logits.py``): call it in the attention's forward with what the call
        returned, e.g. ``flex_attention(..., return_aux=AuxRequest(max_scores=True))``'s
        ``aux.max_scores`` (``(B, H, L)``). No logit is computed here and nothing is synchronized:
        the running maximum stays on its device until the next snapshot's values are logged.

        Args:
            attention: the attention module (or its name) whose heads ``circuits=`` watches.
            max_scores: ``(..., H, L)`` per-query maximum logits, or flex's ``AuxOutput``.

        Raises:
            ValueError: ``attention`` is not a watched attention layer, or ``max_scores`` does
                not have its number of heads.
        """
        if isinstance(attention, torch.nn.Module):
            model = self._watch_plan.model
            attention = next(
                (n for n, m in model.named_modules() if m is attention), repr(attention)
            )
        if self._waiting is not None:
            return  # the heads are not decided yet (the first forward decides them)
        self._max_logits.observe(attention, max_scores)

    def _offer(self, step: int) -> None:
        assert self._engine is not None
        self._max_logits.take(step)  # the maxima since the previous snapshot are this one's
        self.schedule.record_snapshot(step)
        self._engine.offer(step)

    def _collect_and_log(self, wait_seconds: float = 0.0) -> None:
        engine = self._engine
        if engine is None:
            return
        deadline = time.monotonic() + wait_seconds
        while True:  # collect() hands finished results over before raising a later error
            results = engine.collect(wait_seconds=max(0.0, deadline - time.monotonic()))
            if results:  # the wait above is interruptible, a write half-done is not
                with ctrl_c_after():
                    for result in results:
                        self._log(result)
            if not engine.pending or time.monotonic() >= deadline:
                self._flush()
                return

    def _log(self, result: SnapshotResult) -> None:
        assert self._engine is not None
        metrics = dict(result.metrics)
        for name, row in self._max_logits.rows(result.step).items():  # measured, beside them
            metrics[name] = {**metrics.get(name, {}), **row}
        scalars = self._reporter.scalars(result.step, metrics)
        history = self._reporter.history
        if (
            result.step == self._retaken_step
            and len(history) >= 2
            and history[-2][0] == result.step
        ):
            self._log_retaken_esd(result.step, scalars)
            return
        scalars.update(
            health_scalars(
                main_thread_ms=1000 * result.main_thread_seconds,
                svd_ms=1000 * result.svd_seconds,
                pending=self._engine.pending,
                skipped=self._engine.skipped,
                skipped_matrices=self._engine.skipped_matrices,
                coverage_delay=result.step
                - (result.step if result.due_step is None else result.due_step),
            )
        )
        if result.held_bytes:  # the engine's ledger, right after this copy
            scalars.update(health_scalars(snapshot_bytes=result.held_bytes))
        scalars.update(result.rank_scalars)  # per-rank health under DDP
        raised: list[Alert] = []
        if self._alerts is not None:  # read from the results alone: no device work
            raised = self._alerts.check(result.step, result.metrics)
            scalars.update(self._alerts.count_scalars())
        balanced = self._balancer is not None and self._balancer.update(result.metrics)
        if balanced:  # the factors that apply from the next optimizer step on
            scalars.update(self._factor_scalars())
        tb.log_scalars(self.writers, scalars, result.step)
        if balanced:
            summary = self._balancer.summary()  # type: ignore[union-attr]
            tb.add_text(tb.summary_writers(self.writers), LR_BALANCE_SECTION, summary, result.step)
        self._report_alerts(raised, result.step)
        self.schedule.record_snapshot_cost(
            result.main_thread_seconds + result.copy_seconds + result.svd_seconds
        )
        self._warn_of_first_problems()
        experiments = tb.summary_writers(self.writers)
        if experiments:  # the distribution over a layer's experts, beside their mean/min/max
            histograms = self._reporter.expert_values(result.metrics)
            tb.add_histograms(experiments, histograms, result.step)
        self._layout.update(experiments, scalars)  # charts appear with their first finite value
        if self.options.figures and experiments and self._figures.due(result.step):
            self._figures.draw(experiments, self._figure_rows(), result.step)
        self._unflushed = True

    def _log_retaken_esd(self, step: int, scalars: dict[str, float]) -> None:
        """The final step taken again (_finish) and logged already adds its ESD family only: one
        step gets one value per tag (export, charts)."""
        esd = tuple(f"{METRIC_PREFIX}{metric}/" for metric in (*ESD_METRICS, ESD_MEDIAN_ALPHA))
        tb.log_scalars(self.writers, {t: v for t, v in scalars.items() if t.startswith(esd)}, step)
        del self._reporter.history[-2]  # the figures' rows: the newer take of the step only
        self._unflushed = True

    def _target_map(self) -> str:
        """The text entry of the watched matrices (``names.TARGET_MAP_COLUMNS``)."""
        rows = []
        for target in self.targets:
            rank, scaling, rule = target.adapter_rank_and_scaling() or ("", None, "")
            rows.append(
                (
                    target.name,
                    target.stack,
                    target.layer,
                    target.role,
                    "" if target.expert is None else target.expert,
                    f"{target.shape[0]}x{target.shape[1]}",
                    rank,
                    "" if scaling is None else f"{scaling:.6g}",
                    rule,
                )
            )
        return format_target_map(rows)

    def _factor_scalars(self) -> dict[str, float]:
        """``spectral_lr_factor/L<layer>/<role>``: the balancer's current factor of each matrix."""
        assert self._balancer is not None
        return {
            self._reporter.tag(target, LR_FACTOR): self._balancer.factor_of(target.name)
            for target in self.targets
        }

    def _report_alerts(self, raised: list[Alert], step: int) -> None:
        """Each alert as a warning (``non_finite`` has its own once-per-run warning), one
        TensorBoard text entry per snapshot with alerts, and the user's ``on_alert`` hook."""
        if not raised:
            return
        for alert in raised:
            if alert.kind != "non_finite":
                rank_zero_warn(f"{self.caller}: {alert.describe()}", category=RuntimeWarning)
        tb.add_text(tb.summary_writers(self.writers), ALERT_SECTION, alert_table(raised), step)
        if self.options.on_alert is not None:
            for alert in raised:
                self.options.on_alert(alert)

    def _flush(self, *, now: bool = False) -> None:
        """Flush what was logged, once ``FLUSH_INTERVAL_SECONDS`` have passed since the last
        flush (``now``: whatever the time)."""
        if not self._unflushed:
            return
        clock = time.monotonic()
        if now or clock - self._flushed_at >= FLUSH_INTERVAL_SECONDS:
            with ctrl_c_after():
                tb.flush(tb.summary_writers(self.writers))
            self._unflushed, self._flushed_at = False, clock

    def _warn_of_first_problems(self) -> None:
        """Once per kind, at the first matrix it hit (said, never swallowed): weights that are not
        finite, an SVD solver that raised (``spectral_monitor/svd_fallbacks`` counts them)."""
        firsts = {
            "non_finite": self._reporter.first_non_finite,
            "svd_fallback": self._reporter.first_svd_fallback,
        }
        for kind, first in firsts.items():
            if first is None or kind in self._warned:
                continue
            self._warned.add(kind)
            name, step = first
            text = _FIRST_PROBLEM[kind].format(name=name, step=step)
            rank_zero_warn(f"{self.caller}: {text}", category=RuntimeWarning)

    def _figure_rows(self) -> Any:
        return self._reporter.rows(run=dashboards.FIGURE_RUN)

    def _draw_final(self, deadline: float) -> None:
        """The final figures (of the last logged snapshot), waited for until ``deadline``."""
        experiments = tb.summary_writers(self.writers)
        if not (self.options.figures and experiments and self._reporter.history):
            return
        last = self._reporter.history[-1][0]
        if not self._figures.draw_final(experiments, self._figure_rows, last, deadline):
            rank_zero_warn(
                f"{self.caller}: the final figures were not written within "
                f"drain_timeout={self.options.drain_timeout} s",
                category=RuntimeWarning,
            )

    def _finish(self, step: int) -> None:
        assert self._engine is not None
        deadline = time.monotonic() + self.options.drain_timeout
        offered = self.schedule.last_snapshot_step == step
        # The run's end is read from its last snapshot (rank-layers): taken again when the ESD
        # cadence did not fall on it.
        again = offered and self._final_lacks_esd()
        self._retaken_step = step if again else None
        if isinstance(self.compute, SpectrumCompute):  # the number the final snapshot gets
            self.compute.esd_from(self.schedule.snapshots - self._engine.skipped)
        if not offered:
            self.schedule.record_snapshot(step)
        self._announce_wait(deadline, final_snapshot=not offered or again)
        self._engine.finish(step, offered=offered and not again, deadline=deadline)
        self._collect_and_log(wait_seconds=max(0.0, deadline - time.monotonic()))
        self._warn_if_left()
        self._say_skipped()
        self._say_reference_steps()
        self._draw_final(deadline)

    def _final_lacks_esd(self) -> bool:
        """Whether the final step's snapshot, already taken, went without the ESD family that the
        run logs (its cadence did not fall on it)."""
        compute, engine = self.compute, self._engine
        if not isinstance(compute, SpectrumCompute) or not compute.esd or engine is None:
            return False
        # Snapshots are numbered as the compute counts them: those taken, skips left out.
        return not compute.esd_due(self.schedule.snapshots - 1 - engine.skipped)

    def _finish_after_exception(self) -> None:
        assert self._engine is not None
        self._engine.abort()  # peers may never reach another collective
        wait = self.options.drain_timeout
        try:
            if self.rank == 0:
                self._announce_wait(time.monotonic() + wait)
                self._collect_and_log(wait_seconds=wait)
                self._warn_if_left()
                # Bounded more tightly: the user is waiting for their exception (or Ctrl-C).
                self._draw_final(time.monotonic() + min(wait, 10.0))
        except Exception as error:  # noqa: BLE001 - reported, the original exception propagates
            rank_zero_warn(
                f"{self.caller}: while shutting down after an exception: {error}",
                category=RuntimeWarning,
            )

    def _say_staggered(self, step: int) -> None:
        """At the start: a snapshot that does not fit the budget at once, and what that costs."""
        plan = self._plan
        if plan is None or plan.budget is None or not plan.staggered:
            return
        parts = len(plan.parts)
        delay = max(self.options.every_n_steps, 2 * parts)  # the engine's delay bound
        mib = 2**20
        whole = sum(plan.copies.values()) + max(plan.working.values(), default=0) + plan.kept
        early = [s for s in range(step + 1, step + parts) if self.schedule.on_grid(s)]
        crowded = (
            f"; the scheduled steps {', '.join(map(str, early))} may fall within the first "
            "snapshot's parts and cannot all be taken: those skipped are counted "
            "(spectral_monitor/skipped) and said at the end"
            if early
            else ""
        )
        rank_zero_info(
            f"{self.caller}: a snapshot needs {whole / mib:.1f} MiB, over max_snapshot_bytes="
            f"{plan.budget / mib:.1f} MiB: each is copied in up to {parts} parts over consecutive "
            f"steps, each matrix logged at its copy's step, at most {delay} steps late (then "
            "the parts left are skipped, spectral_monitor/skipped_matrices); compression's "
            f"reference is each matrix's first copy, from step {step} on{crowded}"
        )

    def _say_skipped(self) -> None:
        """At the end: how many scheduled snapshots (and matrices of staggered ones) were skipped."""
        engine = self._engine
        if engine is None or not (engine.skipped or engine.skipped_matrices):
            return
        staggered = self._plan is not None and self._plan.staggered
        why = (
            "a snapshot still being copied in parts (max_snapshot_bytes) or " if staggered else ""
        ) + f"max_pending={self.options.max_pending} snapshots in flight"
        matrices = (
            f", and {engine.skipped_matrices} matrices of staggered snapshots past the delay bound"
            if engine.skipped_matrices
            else ""
        )
        rank_zero_info(
            f"{self.caller}: {engine.skipped} of {self.schedule.snapshots} scheduled snapshots "
            f"skipped ({why}){matrices}; spectral_monitor/skipped has them by step"
        )

    def _say_reference_steps(self) -> None:
        """At the end: the steps compression was measured against, where they are not all 0."""
        steps = set(self._reporter.reference_steps.values())
        if steps and steps != {0}:
            low, high = min(steps), max(steps)
            span = f"step {low}" if low == high else f"steps {low} to {high}"
            rank_zero_info(
                f"{self.caller}: compression is measured against each matrix's first snapshot, "
                f"at {span} (spectral_monitor/reference_step has each)"
            )

    def _announce_wait(self, deadline: float, final_snapshot: bool = False) -> None:
        """Say what the end of training waits for, and for how long at most, before it waits."""
        assert self._engine is not None
        pending = self._engine.pending
        seconds = max(0.0, deadline - time.monotonic())
        # Not the final figures: the figure process writes them while the program goes on.
        if seconds > 0 and (pending or final_snapshot):
            what = [f"{pending} snapshot(s) in flight"] if pending else []
            what += ["the final step's snapshot"] if final_snapshot else []
            rank_zero_info(
                f"{self.caller}: waiting up to {seconds:.0f} s (drain_timeout) for "
                f"{' and '.join(what)}; Ctrl-C drops them"
            )

    def _warn_if_left(self) -> None:
        if self._engine is not None and self._engine.pending:
            rank_zero_warn(
                f"{self.caller}: {self._engine.pending} snapshot(s) did not finish within "
                f"drain_timeout={self.options.drain_timeout} s and are dropped; raise "
                "`drain_timeout` or lower `k`",
                category=RuntimeWarning,
            )

    def _interrupted(self) -> None:
        """Ctrl-C in the end-of-training wait: what the announcement promised, said in one line."""
        pending = self._engine.pending if self._engine is not None else 0
        rank_zero_info(f"{self.caller}: Ctrl-C: stopped waiting; {pending} snapshot(s) dropped")

    def _release_run_memory(self) -> None:
        """Drop what only the run needed, once it is over: the ``delta=`` references (a copy of
        every watched matrix: ~13 GB for a 7B model in bf16) and the warm-start subspaces, on the
        device, which a callback object kept after ``fit()`` would otherwise hold."""
        for target in self.targets:
            target.release_reference()
        self.compute.release()

    def _shutdown(self, wait: bool = True) -> bool:
        """Stop the engine and the figures (waiting up to 5 s unless ``wait`` is false); whether
        a Ctrl-C stopped that wait."""
        self._closed = True
        interrupted = False
        if self._balancer is not None:  # the optimizer's learning rates are its own again
            self._balancer.detach()
        # The worker finishes at most the shape group it is in (a daemon thread; the exit hook
        # waits for it to leave torch); timeout 0 is not waiting, which needs no warning.
        timeout = min(5.0, self.options.drain_timeout) if wait else 0.0
        try:
            if self._engine is not None:
                self._engine.close(timeout=timeout)
            self._figures.close(timeout=timeout)
        except KeyboardInterrupt:  # Ctrl-C while the worker or a drawing finishes: stop waiting
            interrupted = True
            self._interrupted()
            if self._engine is not None:
                self._engine.close(timeout=0.0)
            self._figures.close(timeout=0.0)
        self._release_run_memory()
        self._flush(now=True)
        if self._own_logger is not None:
            with ctrl_c_after():
                self._own_logger.finalize("success")
        return interrupted
