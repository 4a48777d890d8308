"""The one body of SpectralMonitor, built against ``lightning.pytorch`` or ``pytorch_lightning``.

The callback only translates Lightning's hooks and loggers into :class:`SpectralTracker` calls; the
class body is written once, in :func:`monitor_class`, and built against either package's
``Callback``, so each package sees a callback of its own type and gets its own
``MisconfigurationException`` (with 2.6.6 of both, either Trainer also runs the other's callback). This module imports neither package: ``integrations/lightning.py`` and
``integrations/pytorch_lightning.py`` each build the class for theirs.

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
* the roles are read from the first training forward (``roles_from_first_forward``): recorded from
  ``on_train_batch_start`` to ``on_before_backward`` (or ``on_before_optimizer_step``), so the
  whole ``training_step`` is seen whether it calls ``self(x)``, ``self.model(x)`` or several
  children, and the weights are still those of step 0 when the roles are read. A forward that
  ran earlier (the sanity check's validation step) may already have shown them.
* the final step is taken in ``on_train_end``, whatever ended the fit (``max_steps``, ``max_epochs``,
  early stopping).
* in-flight work is finished with a bounded wait and logged, and the final figures drawn, in
  ``on_train_end`` and in ``on_exception`` (which Lightning also calls on ``KeyboardInterrupt``);
  the worker is shut down there and again, idempotently, in ``teardown``.
* each ``fit`` starts afresh: a new tracker in ``on_fit_start``, given the state restored from the
  checkpoint of *that* fit (if there is one) in ``on_train_start``, so one instance can be reused
  for a second fit. Not earlier: strategies that shard the model (``ModelParallelStrategy``, FSDP,
  DeepSpeed: ``restore_checkpoint_after_setup``) restore callback states *after* ``on_fit_start``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from spectral_callbacks.monitor.options import (
    DEFAULT_METRICS,
    ConfigurationError,
    MonitorOptions,
    with_options,
)
from spectral_callbacks.monitor.tracker import SpectralTracker

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["check_strategy", "monitor_class"]


def monitor_class(package: str) -> type:
    """``SpectralMonitor`` built on ``package``'s ``Callback``: ``lightning.pytorch`` or ``pytorch_lightning``.

    Raises:
        ModuleNotFoundError: if ``package`` is not installed.
    """
    framework = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    exceptions = importlib.import_module(f"{package}.utilities.exceptions")
    # The core's ConfigurationError, and the MisconfigurationException of this package.
    misconfiguration = type(
        "SpectralMisconfiguration",
        (ConfigurationError, exceptions.MisconfigurationException),
        {"__module__": __name__},
    )

    @contextlib.contextmanager
    def raised_as_misconfiguration() -> Iterator[None]:
        try:
            yield
        except ConfigurationError as error:
            if isinstance(error, exceptions.MisconfigurationException):
                raise
            raise misconfiguration(str(error)) from None

    class SpectralMonitor(framework.Callback):  # type: ignore[name-defined,misc]
        r"""Log the spectra (stable rank, α, compression, ...) of a transformer's matrices during training.

        Snapshots of the watched matrices are taken right after optimizer steps on a schedule,
        decomposed with a batched randomized SVD off the critical path (a worker thread; on CUDA a
        side stream), and logged as ``spectral_<metric>/L<layer>/<role>`` scalars to every logger,
        with the step of the snapshot. See docs/callback.md for the engine and tuning,
        docs/logged-names.md for every name.

        Args:
            metrics: which metrics to log. Default: all but ``energy_rank_90`` and the ESD family.
            \*\*options: every option of :class:`~spectral_callbacks.monitor.options.MonitorOptions`
                (``roles``, ``every_n_steps``, ``k``, ``figures``, ``drain_timeout``, ...), with
                the defaults documented there.

        Raises:
            MisconfigurationException: if an argument is out of range (at construction, a
                :class:`ConfigurationError`); if the Trainer has no logger (at ``setup``) or the
                model has no matrix to watch or no role of ``figure_roles`` (at ``on_fit_start``);
                if ``lr_balance`` is set and the fit has not one optimizer or its param
                groups mix a watched matrix with other parameters (at ``on_train_start``);
                if the strategy is another multi-process strategy than DDP (DeepSpeed
                included), ``FSDPStrategy`` or ``ModelParallelStrategy``, or ``max_overhead`` is set with several
                processes (at ``setup``). Under DDP each rank decomposes a share of the
                matrices; under ``ModelParallelStrategy`` the ranks decompose each sharded
                matrix together where its shards live; rank 0 logs them all: see
                docs/distributed.md.
            ShardedEngineError: under ``ModelParallelStrategy``, if the sharded computation
                fails or falls behind on a rank (it ends the run on every rank).
            TypeError: an argument that is not an option.

        Example::

            >>> from lightning.pytorch import Trainer
            >>> from lightning.pytorch.loggers import TensorBoardLogger
            >>> monitor = SpectralMonitor(every_n_steps=50, roles=["Q", "K"])
            >>> trainer = Trainer(callbacks=[monitor], logger=TensorBoardLogger("runs"))  # doctest: +SKIP
        """

        @with_options
        def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS, **options: Any) -> None:
            with raised_as_misconfiguration():
                self.options = MonitorOptions.from_kwargs(
                    type(self).__name__, metrics=metrics, **options
                )
            self.tracker: SpectralTracker | None = None
            self._restored: dict[str, Any] = {}
            # Two monitors watching different matrices keep separate states. Only plain values go
            # into the key: `mapping` may hold functions whose repr changes between processes, and
            # a key that changes would silently lose the compression reference on resume. Built
            # once (the options are frozen): Lightning reads it around every hook it calls.
            self._state_key = self._generate_state_key(
                roles=repr(self.options.roles),
                include=repr(self.options.include),
                exclude=repr(self.options.exclude),
            )

        @property
        def targets(self) -> list[Any]:
            """The watched matrices of the current (or last) fit; ``[]`` before one."""
            return self.tracker.targets if self.tracker is not None else []

        @property
        def schedule(self) -> Any:
            """The snapshot schedule of the current (or last) fit; ``None`` before one."""
            return self.tracker.schedule if self.tracker is not None else None

        @property
        @override
        def state_key(self) -> str:
            return self._state_key

        def __getattr__(self, name: str) -> Any:
            # Reached only for what the class lacks: a hook of another trainer, such as the
            # Hugging Face Trainer's `on_init_end`, says which class that trainer takes.
            if name.startswith("on_"):
                raise AttributeError(
                    f"{type(self).__name__} is a Lightning callback, but a trainer called its "
                    f"{name!r}: the Hugging Face Trainer takes "
                    "spectral_callbacks.hf.SpectralTrainerCallback (the same options), "
                    "Trainer(..., callbacks=[SpectralTrainerCallback()])"
                )
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        # --- hooks: a guard and one call each -----------------------------------------------

        @override
        def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
            if stage == "fit" and not trainer.loggers:
                raise misconfiguration(
                    f"{type(self).__name__} logs its metrics through the Trainer's loggers, but the "
                    "Trainer has none: pass `logger=TensorBoardLogger('runs')` (or any Lightning "
                    "logger) to the Trainer"
                )
            with raised_as_misconfiguration():
                check_strategy(trainer, self.options.max_overhead, strategies)

        @override
        def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            # Targets are found here, not in `setup`: the model is built (`configure_model`) and on
            # its device now, and compiled or wrapped modules are in place.
            with raised_as_misconfiguration():
                self.tracker = SpectralTracker(
                    pl_module,
                    writers=trainer.loggers,
                    start_step=None,
                    options=self.options,
                    caller=type(self).__name__,
                )

        @override
        def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
            # Every strategy has restored this fit's checkpoint by now (a sharding one only after
            # on_fit_start); a second fit of this instance without one starts afresh.
            state, self._restored = self._restored, {}
            if self.tracker is not None:
                if state:
                    self.tracker.load_state_dict(state)
                with raised_as_misconfiguration():  # the engine is chosen here (make_engine)
                    if self.options.lr_balance is not None:
                        self.tracker.attach_optimizer(_one_optimizer(trainer.optimizers))
                    self.tracker.begin(trainer.global_step)

        @override
        def on_train_batch_start(
            self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
        ) -> None:
            if self.tracker is not None:
                self.tracker.forward_begins()

        @override
        def on_before_backward(
            self, trainer: Trainer, pl_module: LightningModule, loss: Any
        ) -> None:
            if self.tracker is not None:
                with raised_as_misconfiguration():
                    self.tracker.forward_ends()

        @override
        def on_before_optimizer_step(
            self, trainer: Trainer, pl_module: LightningModule, optimizer: Any
        ) -> None:
            if self.tracker is not None:  # a manual step whose backward Lightning did not run
                with raised_as_misconfiguration():
                    self.tracker.forward_ends()

        @override
        def on_train_batch_end(
            self,
            trainer: Trainer,
            pl_module: LightningModule,
            outputs: Any,
            batch: Any,
            batch_idx: int,
        ) -> None:
            if self.tracker is not None:
                self.tracker.step(trainer.global_step)

        @override
        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            if self.tracker is not None:
                self.tracker.close(trainer.global_step)

        @override
        def on_exception(
            self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
        ) -> None:
            if self.tracker is not None:
                self.tracker.close(error=exception)

        @override
        def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
            if self.tracker is not None:
                self.tracker.close()  # a no-op after on_train_end / on_exception

        @override
        def state_dict(self) -> dict[str, Any]:
            if self.tracker is not None:
                return self.tracker.state_dict()
            return dict(self._restored)

        @override
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self._restored = dict(state_dict)

    # A module-level name, so instances pickle (Lightning deep-copies and spawns callbacks).
    SpectralMonitor.__qualname__ = "SpectralMonitor"
    SpectralMonitor.__module__ = {
        "lightning.pytorch": "spectral_callbacks.integrations.lightning",
        "pytorch_lightning": "spectral_callbacks.integrations.pytorch_lightning",
    }.get(package, __name__)
    return SpectralMonitor


def _one_optimizer(optimizers: Sequence[Any]) -> Any:
    """The Trainer's optimizer, whose learning rates ``lr_balance`` scales (there must be one)."""
    if len(optimizers) != 1:
        raise ConfigurationError(
            f"`lr_balance` balances one optimizer, but configure_optimizers returned "
            f"{len(optimizers)}; return one, its groups built by balanced_param_groups(self)"
        )
    return optimizers[0]


def check_strategy(trainer: Any, max_overhead: float | None, strategies: Any) -> None:
    """Reject strategies whose parameters the monitor cannot decompose where they live.

    Args:
        trainer: the Trainer (``strategy``, ``world_size``).
        max_overhead: the budget option (not supported with several processes).
        strategies: the ``strategies`` module of the Trainer's package.

    Raises:
        ConfigurationError: for any other multi-process strategy than DDP (DeepSpeed included),
            ``FSDPStrategy`` and ``ModelParallelStrategy``; and for ``max_overhead`` with several processes (the budget
            is measured per rank, so ranks would snapshot at different steps).
    """
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__
    world_size = int(getattr(trainer, "world_size", 1) or 1)
    # FSDPStrategy (FSDP1) and DeepSpeed ZeRO-3 (a DDPStrategy): gathered unit by unit by the
    # tracker (monitor/engines/partitioned.py), which refuses what it cannot gather.
    multi_process = (
        strategies.DDPStrategy,
        strategies.ModelParallelStrategy,
        strategies.FSDPStrategy,
    )
    if world_size > 1 and not isinstance(strategy, multi_process):
        raise ConfigurationError(
            f"SpectralMonitor does not support {name} with {world_size} processes: it supports a "
            "single device, DDP (strategy='ddp', 'ddp_spawn', 'ddp_notebook', DeepSpeed stages "
            "1-3), FSDPStrategy (FSDP1) and sharded DTensor weights through "
            "ModelParallelStrategy (fully_shard / FSDP2 and tensor parallelism in configure_model)."
        )
    if world_size > 1 and max_overhead is not None:
        raise ConfigurationError(
            f"`max_overhead` is not supported with {world_size} processes: each rank measures its own "
            "step and snapshot times, so ranks would snapshot at different steps; pass "
            "`max_overhead=None` and choose `every_n_steps` instead"
        )
