"""SpectralMonitor: snapshot the watched matrices on schedule, decompose them off the training path, log.

Which hooks, and why (steps are ``trainer.global_step``: optimizer steps, 0 = before any update):

* step 0 is taken in ``on_train_start``: the model is on its device and restored from any checkpoint,
  and no update has run.
* every later snapshot is taken in ``on_train_batch_end`` *when ``global_step`` has advanced since the
  last call*. That hook runs after all of the batch's optimizer steps and before the next batch's
  forward, so the weights are exactly those after step ``global_step``. It is correct under
  gradient accumulation (``global_step`` only advances on the batch that steps, so the other
  micro-batches are ignored), under manual optimization (``global_step`` counts the user's
  ``optimizer.step()`` calls) and with several optimizers (all of the batch's steps are done; a batch
  that advances ``global_step`` by more than one still triggers any grid step it jumped over).
  ``on_before_zero_grad`` would be wrong for manual optimization and fire between the optimizers of
  one batch; ``on_train_batch_start`` would see the weights one data-loading later, no better.
* the final step is taken in ``on_train_end``, whatever ended the fit (``max_steps``, ``max_epochs``,
  early stopping).
* in-flight work is finished with a bounded wait and logged in ``on_train_end`` and in
  ``on_exception`` (which Lightning also calls on ``KeyboardInterrupt``); the worker is shut down
  there and again, idempotently, in ``teardown``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from spectral_callbacks.monitor import dashboards
from spectral_callbacks.monitor import distributed as multi
from spectral_callbacks.monitor.compute import SpectrumCompute
from spectral_callbacks.monitor.engine import Compute, SnapshotEngine, SnapshotResult
from spectral_callbacks.monitor.reporting import (
    KNOWN_METRICS,
    Reporter,
    health_scalars,
    log_to_all,
    num_layers_scalar,
)
from spectral_callbacks.monitor.schedule import SnapshotSchedule
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot

# Every metric but esd_alpha, which is only valid when the eigenvalue tail lies inside the top-k.
DEFAULT_METRICS: tuple[str, ...] = tuple(name for name in KNOWN_METRICS if name != "esd_alpha")


class SpectralMonitor(Callback):
    r"""Log the spectra (stable rank, α, compression, ...) of a transformer's matrices during training.

    Snapshots of the watched matrices are taken right after optimizer steps on a schedule, decomposed
    with a batched randomized SVD off the critical path (a worker thread; on CUDA a side stream), and
    logged as ``spectral_<metric>/L<layer>/<role>`` scalars to every logger, with the step of the
    snapshot. See docs/callback.md for the engine and tuning, docs/logged-names.md for every name.

    Args:
        metrics: which metrics to log, from ``stable_rank, alpha, alpha_r2, spectral_norm,
            frobenius_norm, energy_rank_90, esd_alpha, compression``. Default: all but ``esd_alpha``.
        roles, include, exclude, mapping: which matrices to watch; passed to
            :func:`spectral_callbacks.targets.find_targets`. Default ``None`` watches every Q, K, V,
            O, MLP_up and MLP_down matrix found.
        every_n_steps: snapshot every this many optimizer steps. Default ``25``.
        log_spaced_until: also snapshot at the powers of two below this step (dense early points,
            where the stable rank collapses); ``0`` turns them off. Default ``1000``.
        max_overhead: a fraction of training time the snapshots may cost (e.g. ``0.01``); the
            interval then stretches along the grid to stay within it. Default ``None`` (off).
        k: singular values computed per matrix (capped at the smaller side). Default ``32``.
        n_oversamples, n_iter, svd_method: randomized-SVD options; ``None`` keeps the defaults of
            :func:`spectral_callbacks.functional.randomized_svd`. Default ``None, None, "auto"``.
        fit_window: ranks used for the α fit; ``None`` keeps the functional default.
        max_pending: snapshots that may be in flight; when the bound is hit a snapshot is skipped and
            counted in ``spectral_monitor/skipped``, never queued. Default ``2``.
        figure_every_n_steps: draw figures for TensorBoard every this many optimizer steps (on the
            first snapshot logged at or after each multiple), and always at the end; ``None`` draws
            them only at the end. Default ``1000``.
        figures: draw figures at all. Default ``True``. They are drawn on a background thread, one
            drawing at a time (a drawing still running when the next is due skips that one).
        figure_roles: roles that get an α-vs-depth and a compression-wave figure (``None``: every
            role; each figure costs ~0.1-1 s of CPU). Default ``("Q",)``.
        synchronous: compute each snapshot inline and wait for it (the naive baseline of
            benchmarks/overhead.py). Default ``False``.
        drain_timeout: seconds to wait for in-flight snapshots at the end of fit or after an
            exception. Default ``60.0``.
        worker_threads: intra-op threads of the worker (``torch.set_num_threads`` is per thread), so a
            CPU SVD does not claim every core training uses; ``None`` keeps torch's default. Default ``1``.
        worker_nice: on the CPU, lower the worker thread's priority by this nice increment (Linux),
            so training threads run first on busy cores and the SVD takes the slack; ``None`` or
            ``0`` leaves it. Off by default: a niced worker that is descheduled while holding the
            GIL makes the training thread wait for it (measured: see docs/callback.md). Default
            ``None``.
        history_size: snapshots kept in memory for the figures. Default ``256``.
        compute: replace the SVD + metrics function (``(group, batch) -> {metric: (B,) tensor}``);
            for tests and custom metrics. Default ``None`` (:class:`SpectrumCompute`).

    Raises:
        MisconfigurationException: if an argument is out of range (at construction); if the Trainer
            has no logger or the model has no matrix to watch (at ``setup`` / ``on_fit_start``);
            if the strategy shards parameters (FSDP, FSDP2, DeepSpeed ZeRO-3), or is another
            multi-process strategy than DDP, or ``max_overhead`` is set with several processes
            (at ``setup``). Under DDP each rank decomposes a share of the matrices and rank 0 logs
            them all: see docs/distributed.md.

    Example::

        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.loggers import TensorBoardLogger
        >>> monitor = SpectralMonitor(every_n_steps=50, roles=["Q", "K"])
        >>> trainer = Trainer(callbacks=[monitor], logger=TensorBoardLogger("runs"))  # doctest: +SKIP
    """

    def __init__(
        self,
        metrics: Sequence[str] = DEFAULT_METRICS,
        *,
        roles: Sequence[str] | None = None,
        include: Any = None,
        exclude: Any = None,
        mapping: Any = None,
        every_n_steps: int = 25,
        log_spaced_until: int = 1000,
        max_overhead: float | None = None,
        k: int = 32,
        n_oversamples: int | None = None,
        n_iter: int | None = None,
        svd_method: str = "auto",
        fit_window: Any = None,
        max_pending: int = 2,
        figure_every_n_steps: int | None = 1000,
        figures: bool = True,
        figure_roles: Sequence[str] | None = ("Q",),
        synchronous: bool = False,
        drain_timeout: float = 60.0,
        worker_threads: int | None = 1,
        worker_nice: int | None = None,
        history_size: int = 256,
        compute: Compute | None = None,
    ) -> None:
        unknown = [metric for metric in metrics if metric not in KNOWN_METRICS]
        if isinstance(metrics, str) or unknown or not metrics:
            raise MisconfigurationException(
                f"`metrics` must be a non-empty list of {', '.join(KNOWN_METRICS)}; got {metrics!r}"
            )
        for name, value in (("k", k), ("max_pending", max_pending), ("history_size", history_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MisconfigurationException(f"`{name}` must be a positive int, got {value!r}")
        if figure_every_n_steps is not None and (
            not isinstance(figure_every_n_steps, int) or figure_every_n_steps < 1
        ):
            raise MisconfigurationException(
                f"`figure_every_n_steps` must be a positive int or None, got {figure_every_n_steps!r}"
            )
        if drain_timeout < 0:
            raise MisconfigurationException(
                f"`drain_timeout` must be >= 0 seconds, got {drain_timeout!r}"
            )
        self.metrics = tuple(metrics)
        self.target_options = {
            "roles": roles,
            "include": include,
            "exclude": exclude,
            "mapping": mapping,
        }
        self.schedule = SnapshotSchedule(every_n_steps, log_spaced_until, max_overhead)
        self.compute = compute or SpectrumCompute(
            k,
            n_oversamples=n_oversamples,
            n_iter=n_iter,
            method=svd_method,
            fit_window=fit_window,
            esd="esd_alpha" in self.metrics,
        )
        self.max_pending = max_pending
        self.figure_every_n_steps = figure_every_n_steps
        self.figures = figures
        self.synchronous = synchronous
        self.drain_timeout = drain_timeout
        self.worker_threads = worker_threads
        self.worker_nice = worker_nice
        self.history_size = history_size
        self.targets: list[Any] = []
        self._engine: SnapshotEngine | None = None
        self._reporter: Reporter | None = None
        self._restored: dict[str, Any] = {}
        self._draining = False
        self._previous_step = -1
        self._previous_time: float | None = None
        self._last_figure_step: int | None = None
        self._last_submitted_step: int | None = None
        self._figure_writer = dashboards.FigureWriter(figure_roles)
        self._run_name = "this run"
        self._trainer: Trainer | None = None

    @property
    def state_key(self) -> str:
        # Two monitors watching different matrices keep separate states. Only plain values go into
        # the key: `mapping` may hold functions whose repr changes between processes, and a key
        # that changes would silently lose the compression reference on resume.
        options = self.target_options
        return self._generate_state_key(
            roles=repr(options["roles"]),
            include=repr(options["include"]),
            exclude=repr(options["exclude"]),
        )

    # --- hooks: a guard and one call each ----------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise MisconfigurationException(
                "SpectralMonitor logs its metrics through the Trainer's loggers, but the Trainer has "
                "none: pass `logger=TensorBoardLogger('runs')` (or any Lightning logger) to the Trainer"
            )
        multi.check_strategy(trainer, self.schedule.max_overhead)
        self._trainer = trainer

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Targets are found here, not in `setup`: the model is built (`configure_model`) and on its
        # device now, and compiled or wrapped modules are in place.
        self._start(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._runs_here(trainer):
            self._begin(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if self._runs_here(trainer) and self._engine is not None:
            self._after_batch(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._runs_here(trainer) and self._engine is not None:
            self._finish(trainer)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if isinstance(self._engine, multi.DistributedEngine):
            self._engine.abort()  # peers may never reach another collective
        if self._engine is not None:
            self._finish_after_exception(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        if (
            self._reporter is not None
            and not self._reporter.references
            and self._engine is not None
            and self._may_wait_for_references()
        ):
            # A checkpoint saved before the first snapshot's result came back would lose the
            # compression reference: wait for it (bounded) so a resume keeps it.
            self._collect_and_log(self._trainer, wait_seconds=self.drain_timeout)
        references = (
            self._reporter.references if self._reporter else self._restored.get("references", {})
        )
        state = {
            "references": dict(references),
            "schedule": self.schedule.state_dict(),
            "skipped": self._engine.skipped if self._engine else self._restored.get("skipped", 0),
        }
        # The compute's own random generators: a resumed run continues their streams.
        if hasattr(self.compute, "state_dict"):
            state["compute"] = self.compute.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self.schedule.load_state_dict(state_dict.get("schedule", {}))
        if "compute" in state_dict and hasattr(self.compute, "load_state_dict"):
            self.compute.load_state_dict(state_dict["compute"])
        if self._reporter is not None:
            self._reporter.load_state_dict(state_dict)

    # --- the work ------------------------------------------------------------------------------

    def _start(self, pl_module: LightningModule) -> None:
        from spectral_callbacks.targets import find_targets
        from spectral_callbacks.targets.find import TargetError

        try:
            self.targets = list(find_targets(pl_module, **self.target_options))
        except TargetError as error:  # nothing to watch, or a bad mapping: a configuration error
            raise MisconfigurationException(
                f"SpectralMonitor: {error}\nSpectralMonitor(roles=, include=, exclude=, mapping=) "
                "passes these arguments on to find_targets."
            ) from error
        if not self.targets:
            raise MisconfigurationException(
                "SpectralMonitor found no matrix to watch with "
                f"{ {k: v for k, v in self.target_options.items() if v is not None} }; run "
                "`spectral-callbacks targets` on the model to see the candidates, then pass `mapping=`"
            )
        groups = group_by_shape(self.targets)
        on_cuda = any(group.device.startswith("cuda") for group in groups)
        self._engine = self._make_engine(
            groups,
            max_pending=self.max_pending,
            synchronous=self.synchronous,
            worker_threads=self.worker_threads,
            # On CUDA the worker only enqueues kernels: lowering its priority would only add latency.
            worker_nice=None if on_cuda else self.worker_nice,
        )
        self._engine.skipped = int(self._restored.get("skipped", 0))
        self._reporter = Reporter(self.targets, self.metrics, self.history_size)
        self._reporter.load_state_dict(self._restored)

    def _begin(self, trainer: Trainer) -> None:
        assert self._reporter is not None
        if trainer.is_global_zero:
            log_to_all(
                trainer.loggers,
                num_layers_scalar(self._reporter.num_layers),
                step=trainer.global_step,
            )
            experiments = dashboards.tensorboard_experiments(trainer.loggers)
            dashboards.add_layout(
                experiments, dashboards.custom_scalars_layout(self.targets, self.metrics)
            )
        self._previous_step = trainer.global_step
        self._previous_time = time.perf_counter()
        if trainer.global_step == 0 and self.schedule.last_snapshot_step is None:
            self._snapshot(0)

    def _after_batch(self, trainer: Trainer) -> None:
        assert self._engine is not None
        step = trainer.global_step
        if step != self._previous_step:
            now = time.perf_counter()
            if self._previous_time is not None and step > self._previous_step:
                self.schedule.record_step_time(
                    (now - self._previous_time) / (step - self._previous_step)
                )
            self._collect_and_log(trainer)  # first: a finished snapshot frees its slot
            # Budget mode cannot size the interval before the first cost is known: until then it
            # passes grid steps over (like any stretched interval) instead of piling up skips.
            cost_unknown = (
                self.schedule.max_overhead is not None and self.schedule.snapshot_seconds is None
            )
            if self.schedule.due(self._previous_step, step) and not (
                cost_unknown and self._engine.pending
            ):
                self._snapshot(step)
            self._previous_step, self._previous_time = step, now
        else:
            self._collect_and_log(trainer)

    def _snapshot(self, step: int) -> None:
        assert self._engine is not None
        self.schedule.record_snapshot(step)
        if not self._engine.has_room:  # skip before paying for a copy that would be dropped
            self._engine.skipped += 1
            return
        start = time.perf_counter()
        with torch.no_grad():
            snapshot = take_snapshot(list(self._engine.groups.values()), step)
        accepted = self._engine.submit(snapshot)
        snapshot.main_thread_seconds = time.perf_counter() - start
        if accepted:
            self._last_submitted_step = step
        else:
            snapshot.tensors = {}

    def _collect_and_log(self, trainer: Trainer | None, wait_seconds: float = 0.0) -> None:
        if self._engine is None or self._reporter is None or trainer is None:
            return
        deadline = time.monotonic() + wait_seconds
        while True:  # collect() hands finished results over before raising a later error
            for result in self._engine.collect(wait_seconds=max(0.0, deadline - time.monotonic())):
                self._log(trainer, result)
            if not self._engine.pending or time.monotonic() >= deadline:
                return

    def _log(self, trainer: Trainer, result: SnapshotResult) -> None:
        assert self._engine is not None and self._reporter is not None
        scalars = self._reporter.scalars(result.step, result.metrics)
        scalars.update(
            health_scalars(
                main_thread_ms=1000 * result.main_thread_seconds,
                svd_ms=1000 * result.svd_seconds,
                pending=self._engine.pending,
                skipped=self._engine.skipped,
            )
        )
        if isinstance(result, multi.GatheredResult):  # per-rank health, the total skipped
            scalars.update(result.rank_scalars)
        log_to_all(trainer.loggers, scalars, step=result.step)
        self.schedule.record_snapshot_cost(
            result.main_thread_seconds + result.copy_seconds + result.svd_seconds
        )
        experiments = dashboards.tensorboard_experiments(trainer.loggers)
        if self.figures and experiments and self._figures_due(result.step):
            self._draw(experiments, result.step)
        dashboards.flush(experiments)

    def _figures_due(self, step: int) -> bool:
        every = self.figure_every_n_steps
        if every is None:
            return False
        last = self._last_figure_step
        return last is None and step >= every or last is not None and step // every > last // every

    def _draw(self, experiments: list[Any], step: int) -> None:
        assert self._reporter is not None
        rows = self._reporter.rows(run=self._run_name)
        if len(rows) and self._figure_writer.submit(experiments, rows, step):
            self._last_figure_step = step

    def _finish(self, trainer: Trainer) -> None:
        assert self._engine is not None
        step = trainer.global_step
        deadline = time.monotonic() + self.drain_timeout
        final_missing = self._last_submitted_step != step
        if isinstance(self._engine, multi.DistributedEngine):
            # A snapshot is a collective point: every rank must decide alike, by the shared schedule
            # (a local skip of the last scheduled snapshot cannot be retaken on one rank alone).
            final_missing = self.schedule.last_snapshot_step != step
        self._draining = True
        self._announce_wait(trainer, deadline, final_snapshot=final_missing, final_figures=True)
        if final_missing:
            # The final step is always measured: make room for it rather than skip it.
            while self._engine.pending >= self.max_pending and time.monotonic() < deadline:
                self._collect_and_log(trainer, wait_seconds=0.05)
            skipped_here = self.schedule.last_snapshot_step == step
            self._snapshot(step)
            if skipped_here and self._last_submitted_step == step:
                self._engine.skipped -= 1  # skipped in the last batch, measured now after all
        if isinstance(self._engine, multi.DistributedEngine):
            self._engine.flush(deadline)  # every rank sends what is still due: the last collectives
        self._collect_and_log(trainer, wait_seconds=max(0.0, deadline - time.monotonic()))
        self._warn_if_left(trainer)
        experiments = dashboards.tensorboard_experiments(trainer.loggers)
        if self.figures and experiments and self._reporter is not None and self._reporter.history:
            last = self._reporter.history[-1][0]
            remaining = max(0.0, deadline - time.monotonic())
            if self._last_figure_step != last and self._figure_writer.wait(remaining):
                self._draw(experiments, last)
            if not self._figure_writer.wait(max(0.0, deadline - time.monotonic())):
                warnings.warn(
                    f"SpectralMonitor: the final figures were not written within drain_timeout={self.drain_timeout} s",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._close()

    def _finish_after_exception(self, trainer: Trainer) -> None:
        # Training already failed: log what finishes within the bounded wait, but never let a
        # worker error replace the exception the user needs to see.
        try:
            # Interrupted during the end-of-fit drain (Ctrl-C while it waited): do not wait again.
            wait = 0.0 if self._draining else self.drain_timeout
            if trainer.is_global_zero:
                self._announce_wait(trainer, time.monotonic() + wait)
                self._collect_and_log(trainer, wait_seconds=wait)
                self._warn_if_left(trainer, interrupted=self._draining)
                self._figure_writer.wait(min(wait, 10.0))
        except Exception as error:  # noqa: BLE001 - reported, the original exception propagates
            warnings.warn(
                f"while shutting down after an exception: {error}", RuntimeWarning, stacklevel=2
            )
        finally:
            self._close()

    def _runs_here(self, trainer: Trainer) -> bool:
        """Rank 0 does all the work of one process; under DDP every rank snapshots its share."""
        return trainer.is_global_zero or isinstance(self._engine, multi.DistributedEngine)

    def _make_engine(self, groups: list[Any], **options: Any) -> Any:
        """A SnapshotEngine, or under DDP one over this rank's share that gathers to rank 0."""
        rank, world_size = multi.world(self._trainer)
        if world_size == 1:
            return SnapshotEngine(self.compute, groups, **options)
        return multi.DistributedEngine(
            self.compute,
            self.targets,
            multi.result_columns(self.metrics),
            rank=rank,
            world_size=world_size,
            group=multi.results_group(2 * self.drain_timeout + 60),
            **options,
        )

    def _may_wait_for_references(self) -> bool:
        """Under DDP only rank 0 logs, and only a reduce already issued can bring the references."""
        if not isinstance(self._engine, multi.DistributedEngine):
            return True
        trainer = self._trainer
        return trainer is not None and trainer.is_global_zero and bool(self._engine.in_flight)

    def _announce_wait(
        self,
        trainer: Trainer,
        deadline: float,
        final_snapshot: bool = False,
        final_figures: bool = False,
    ) -> None:
        """Say what the end of fit waits for, and for how long at most, before it waits."""
        assert self._engine is not None
        pending = self._engine.pending
        figures = self.figures and bool(dashboards.tensorboard_experiments(trainer.loggers))
        drawing = figures and (final_figures or self._figure_writer.busy)
        seconds = max(0.0, deadline - time.monotonic())
        if trainer.is_global_zero and seconds > 0 and (pending or final_snapshot or drawing):
            what = [f"{pending} snapshot(s) in flight"] if pending else []
            what += ["the final step's snapshot"] if final_snapshot else []
            what += ["the final figures"] if drawing else []
            rank_zero_info(
                f"SpectralMonitor: waiting up to {seconds:.0f} s (drain_timeout) for "
                f"{' and '.join(what)}; Ctrl-C drops them"
            )

    def _warn_if_left(self, trainer: Trainer, interrupted: bool = False) -> None:
        if self._engine is not None and self._engine.pending:
            why = (
                "were still in flight when the end-of-fit wait was interrupted"
                if interrupted
                else f"did not finish within drain_timeout={self.drain_timeout} s"
            )
            advice = "" if interrupted else "; raise `drain_timeout` or lower `k`"
            warnings.warn(
                f"SpectralMonitor: {self._engine.pending} snapshot(s) {why} and are dropped{advice}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _close(self) -> None:
        if self._engine is not None:
            self._engine.close(timeout=min(5.0, self.drain_timeout))
        self._figure_writer.close(timeout=min(5.0, self.drain_timeout))
