"""SpectralTrainerCallback: the Hugging Face ``Trainer`` frontend of :class:`SpectralTracker`.

Which hooks, and why (steps are ``state.global_step``: optimizer steps, 0 = before any update):

* ``on_train_begin`` builds the tracker on the model the Trainer trains (any checkpoint is loaded
  by then) and, with nothing to resume, snapshots the current step as the compression reference.
* ``on_step_end`` runs after each *optimizer* step - with ``gradient_accumulation_steps=4`` once
  per four micro-batches (those end in ``on_substep_end``) - after the update and before the next
  forward, so a snapshot there holds exactly the weights after ``global_step``.
* ``on_save`` writes the tracker's state beside the checkpoint the Trainer just wrote
  (``<output_dir>/checkpoint-<step>/spectral_tracker.pt``, from global rank 0, which holds the
  compression references); ``on_train_begin`` reads it back when the run resumes from that
  checkpoint, so compression keeps its step-0 reference.
* ``on_step_end`` of the last step (``control.should_training_stop``) also measures it, drains
  in-flight work (bounded) and draws the figures, while the ``report_to`` trackers' runs are still
  open; ``on_train_end`` does it where another callback stopped training after that hook (then
  into the event files only). The Trainer has no exception hook: after an exception the daemon worker is abandoned with its
  snapshot, and what was logged before stays logged.

Event files go where the Trainer's own ``TensorBoardCallback`` writes - ``TENSORBOARD_LOGGING_DIR``
if set, else ``args.logging_dir`` (transformers 4.x), else ``<output_dir>/runs/<time>_<host>``
(transformers 5) - so TensorBoard opened on the run shows the spectra beside the loss; or to
``logdir=``. The directory is said once, at ``on_train_begin``. Under ``torchrun`` /
``accelerate launch`` every rank decomposes a share of the matrices and rank 0 writes them all.

Where ``report_to`` sends the Trainer's logs (W&B, MLflow, Comet, ...): :meth:`attach` gives the
callback its Trainer, and each snapshot's scalars then go to the ``on_log`` of the Trainer's own
``report_to`` callbacks, at the snapshot's step as ``state.global_step`` (see :class:`_ReportTo`
for why not ``Trainer.log``). The ``TensorBoardCallback`` among them is left out: the event files
above already hold every scalar, at the snapshot's step, with the layout, figures and alerts the
SPECTRAL tab reads; a second copy under ``train/spectral_*`` would double every chart.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spectral_callbacks.messages import rank_zero_info, rank_zero_warn
from spectral_callbacks.monitor.options import (
    DEFAULT_METRICS,
    MonitorOptions,
    require,
    with_options,
)
from spectral_callbacks.monitor.tracker import SpectralTracker

#: The file beside each Trainer checkpoint that holds the tracker's state.
STATE_FILE = "spectral_tracker.pt"

# A TensorBoardCallback directory made this long before our on_train_begin is this run's.
_SAME_RUN_SECONDS = 120.0


class SpectralTrainerCallback(TrainerCallback):
    r"""Log the spectra of a transformer's matrices while ``transformers.Trainer`` trains it.

    Args:
        metrics: which metrics to log. Default: all but ``energy_rank_90`` and the ESD family.
        logdir: where to write TensorBoard event files. Default ``None``: where the Trainer's
            TensorBoard callback writes (see the module docstring).
        \*\*options: every option of :class:`~spectral_callbacks.monitor.options.MonitorOptions`.

    Raises:
        ConfigurationError: an option out of range (at construction); nothing to watch in the
            model, or FSDP1 / DeepSpeed ZeRO-3 parameters that cannot be gathered (at
            ``on_train_begin``: FSDP1 without ``use_orig_params``, or ``circuits=`` under
            either; the rest (adapters too) is gathered unit by unit, and FSDP2, ``fsdp_version: 2``, is
            decomposed where its shards live);
            with ``lr_balance``, a Trainer optimizer whose param groups mix a watched matrix with
            other parameters (pass ``optimizers=(AdamW(balanced_param_groups(model)), None)``).
        TypeError: an argument that is not an option.

    Example::

        >>> from transformers import Trainer, TrainingArguments
        >>> callback = SpectralTrainerCallback(every_n_steps=50)
        >>> trainer = Trainer(model, TrainingArguments("out", report_to=["wandb"]),
        ...                   train_dataset=data, callbacks=[callback])  # doctest: +SKIP
        >>> callback.attach(trainer)  # the spectra also go to report_to  # doctest: +SKIP
    """

    @with_options
    def __init__(
        self,
        metrics: Sequence[str] = DEFAULT_METRICS,
        *,
        logdir: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        self.options = MonitorOptions.from_kwargs(type(self).__name__, metrics=metrics, **options)
        self.logdir = logdir
        self.tracker: SpectralTracker | None = None
        self._trainer: Any = None
        self._report: _ReportTo | None = None

    def attach(self, trainer: Any) -> SpectralTrainerCallback:
        """Also send the spectra where ``trainer``'s ``report_to`` sends its logs; returns ``self``.

        Adds this callback to ``trainer`` unless it is there already, so
        ``SpectralTrainerCallback().attach(trainer)`` is all a built Trainer needs. A callback
        hook is not given the Trainer, which holds the ``report_to`` callbacks: hence this call.
        Without it the spectra reach the TensorBoard event files only (a warning says so when
        ``report_to`` names another tracker).

        Raises:
            ConfigurationError: ``trainer`` is not a ``transformers.Trainer``.
        """
        from transformers import Trainer

        require(
            "trainer",
            trainer,
            isinstance(trainer, Trainer),
            "a transformers.Trainer (the one whose report_to should get the spectra)",
        )
        if self not in _callbacks_of(trainer):
            trainer.add_callback(self)
        self._trainer = trainer
        return self

    def __getattr__(self, name: str) -> Any:
        # Reached only for what the class lacks: a hook of another trainer, such as Lightning's
        # `setup` or `on_exception`, says which class that trainer takes.
        if name.startswith("on_") or name in ("setup", "teardown", "state_key"):
            raise AttributeError(
                f"{type(self).__name__} is the Hugging Face Trainer's callback, but a trainer "
                f"called its {name!r}: a Lightning Trainer takes spectral_callbacks.pl."
                "SpectralMonitor (the same options), Trainer(callbacks=[SpectralMonitor()], "
                "logger=TensorBoardLogger('runs'))"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self.tracker is not None:  # a second train() with this callback starts afresh
            # (a no-op after on_train_end; after an exception, logs what finished, snapshots nothing)
            self.tracker.close(error=RuntimeError("the previous train() raised"))
        if model is None:
            raise ValueError("SpectralTrainerCallback needs the model: the Trainer passes `model=`")
        logdir = self.logdir if self.logdir is not None else trainer_logdir(args)
        self._report = None
        if self._trainer is not None:
            reporting = report_to_callbacks(self._trainer)
            self._report = _ReportTo(reporting) if reporting else None
        self._report_hook(args, state, control, model=model, **kwargs)
        self.tracker = SpectralTracker(
            model,
            logdir=logdir,
            writers=[self._report] if self._report is not None else [],
            start_step=state.global_step,
            state=_saved_state(args, state),
            options=self.options,
            # lr_balance scales the Trainer's optimizer (its groups from balanced_param_groups)
            optimizer=kwargs.get("optimizer") if self.options.lr_balance is not None else None,
            caller=type(self).__name__,
            # The Trainer compiles a wrapper around `model` (torch_compile=True): its forward
            # runs a graph, which records nothing, so the names decide from the start.
            forward_compiled=bool(getattr(args, "torch_compile", False)),
        )
        self._say_where(args, logdir)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is None:
            return
        self._report_hook(args, state, control, **kwargs)
        self.tracker.step(state.global_step)
        if control.should_training_stop:
            # The last step, drained, while the report_to trackers are open: their own
            # on_train_end comes before ours (the Trainer lists them first) and MLflow's ends its
            # run, so a later log_metrics would open a run of its own.
            self.tracker.close(state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is None:
            return
        saved = self.tracker.state_dict()  # every rank: it may wait for rank 0's first results
        checkpoint = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if _holds_the_references() and checkpoint.is_dir():
            torch.save(saved, checkpoint / STATE_FILE)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is None:
            return
        if self._report is not None:  # stopped early (another callback): their runs may be over
            self._report.callbacks = []
        self.tracker.close(state.global_step)

    def _report_hook(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """What the ``report_to`` callbacks' ``on_log`` gets while this hook runs."""
        if self._report is not None:
            self._report.hook = (args, state, control, kwargs)

    def _say_where(self, args: TrainingArguments, logdir: str | os.PathLike[str]) -> None:
        """Where the spectra go, said once per run (rank 0); a warning if report_to misses them."""
        name = type(self).__name__
        where = f"{name}: TensorBoard event files in {logdir} (tensorboard --logdir {logdir})"
        trackers = [report for report in _report_to(args) if report != "tensorboard"]
        if self._report is not None:
            names = ", ".join(type(callback).__name__ for callback in self._report.callbacks)
            where += f"; the scalars also go to report_to: {names}"
        elif trackers and self._trainer is None:
            rank_zero_warn(
                f"{name}: report_to={trackers!r} gets the Trainer's logs but not the spectra: call "
                f"callback.attach(trainer) after building the Trainer (the spectra are in the "
                f"TensorBoard event files in {logdir})",
                category=UserWarning,
            )
        rank_zero_info(where)


class _ReportTo:
    """The Trainer's ``report_to`` callbacks as one of the tracker's writers.

    ``log_metrics`` hands each snapshot's scalars to their ``on_log``, the public hook through
    which the Trainer gives them its own logs, so each tracker stores them as it stores the loss
    (W&B under ``train/``, as ``rewrite_logs`` names the loss), at ``state.global_step`` - that of
    a copy of the state set to the snapshot's step: results arrive at a later hook (the next
    ``tracker.step``; a few steps later from a worker thread or a CUDA stream), and the trackers
    then hold each value at the step the event files hold it, the optimizer step it measures. Not
    ``Trainer.log``, the public entry to that path: it would also print every scalar through the
    progress callback, keep them in ``state.log_history`` (saved in every checkpoint's
    ``trainer_state.json``) and hand them to the ``TensorBoardCallback``, whose event file would
    hold a second copy beside ours.
    """

    def __init__(self, callbacks: list[TrainerCallback]) -> None:
        self.callbacks = callbacks
        #: ``(args, state, control, kwargs)`` of the hook running now (the tracker logs in hooks).
        self.hook: tuple[Any, Any, Any, dict[str, Any]] | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.hook is None:
            return
        args, state, control, kwargs = self.hook
        at_step = copy.copy(state)  # the Trainer's own state keeps its step
        at_step.global_step = step
        logs = {tag: float(value) for tag, value in metrics.items()}
        for callback in self.callbacks:
            callback.on_log(args, at_step, control, logs=dict(logs), **kwargs)


def report_to_callbacks(trainer: Any) -> list[TrainerCallback]:
    """``trainer``'s callbacks for its ``report_to`` trackers, but its ``TensorBoardCallback``.

    The classes are those ``transformers.integrations.get_reporting_integration_callbacks``
    gives the Trainer for ``args.report_to`` (``"all"`` included); the instances are the ones
    the Trainer made, in its callback list (``add_callback`` / ``pop_callback`` edit that list).
    """
    from transformers.integrations import TensorBoardCallback, get_reporting_integration_callbacks

    classes = tuple(get_reporting_integration_callbacks(_report_to(trainer.args)))
    return [
        callback
        for callback in _callbacks_of(trainer)
        if isinstance(callback, classes) and not isinstance(callback, TensorBoardCallback)
    ]


def _callbacks_of(trainer: Any) -> list[TrainerCallback]:
    # The list Trainer.add_callback / pop_callback edit (CallbackHandler.callbacks, in every
    # transformers from 4.0 to 5.25); no public accessor returns the instances themselves.
    return list(trainer.callback_handler.callbacks)


def _report_to(args: TrainingArguments) -> list[str]:
    """``args.report_to`` as a list (TrainingArguments already turns "all" and "none" into one)."""
    reports = args.report_to
    if reports is None or reports == "none":
        return []
    return list(reports) if isinstance(reports, list | tuple) else [reports]


def trainer_logdir(args: TrainingArguments) -> str:
    """Where the Trainer's ``TensorBoardCallback`` writes this run's event files.

    ``TENSORBOARD_LOGGING_DIR`` if set; else ``args.logging_dir`` (transformers 4.x); else
    transformers 5's ``<output_dir>/runs/<time>_<host>``. The time is taken by that callback in
    its own ``on_train_begin``, just before ours: with ``report_to`` holding ``"tensorboard"``, a
    directory of that form made moments ago is reused, so both write into one run.
    """
    env = os.getenv("TENSORBOARD_LOGGING_DIR")
    if env:
        return os.path.expanduser(env)
    legacy = getattr(args, "logging_dir", None)
    if legacy:
        return str(legacy)
    from transformers.integrations.integration_utils import default_logdir

    if not {"tensorboard", "all"} & set(_report_to(args)):  # no TensorBoardCallback: our own run
        return str(_output_dir(args) / default_logdir())
    runs = _output_dir(args) / "runs"
    host = socket.gethostname()
    recent = [
        path
        for path in (runs.iterdir() if runs.is_dir() else [])
        if path.is_dir()
        and path.name.endswith(f"_{host}")
        and time.time() - path.stat().st_mtime < _SAME_RUN_SECONDS
    ]
    if recent:
        return str(max(recent, key=lambda path: path.stat().st_mtime))
    return str(_output_dir(args) / default_logdir())


def _output_dir(args: TrainingArguments) -> Path:
    return Path(str(args.output_dir))


def _holds_the_references() -> bool:
    """Whether this process writes the tracker's state: global rank 0 of ``torch.distributed``,
    where the tracker logs and keeps the compression references. Not the Trainer's
    ``is_world_process_zero``: under DeepSpeed with its CPU accelerator it is true on every rank,
    and another rank's file (no references) overwrote rank 0's."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not distributed or torch.distributed.get_rank() == 0


def _saved_state(args: TrainingArguments, state: TrainerState) -> dict[str, Any] | None:
    """The tracker state saved beside the checkpoint this run resumes from, if there is one."""
    if state.global_step == 0:
        return None
    candidates = [_output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"]
    resume = getattr(args, "resume_from_checkpoint", None)
    if isinstance(resume, str | os.PathLike):
        candidates.insert(0, Path(resume))
    for checkpoint in candidates:
        if (checkpoint / STATE_FILE).is_file():
            return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    return None
