"""SpectralTrainerCallback: the Hugging Face ``Trainer`` frontend of :class:`SpectralTracker`.

Which hooks, and why (steps are ``state.global_step``: optimizer steps, 0 = before any update):

* ``on_train_begin`` builds the tracker on the model the Trainer trains (any checkpoint is loaded
  by then) and, with nothing to resume, snapshots the current step as the compression reference.
* ``on_step_end`` runs after each *optimizer* step - with ``gradient_accumulation_steps=4`` once
  per four micro-batches (those end in ``on_substep_end``) - after the update and before the next
  forward, so a snapshot there holds exactly the weights after ``global_step``.
* ``on_save`` writes the tracker's state beside the checkpoint the Trainer just wrote
  (``<output_dir>/checkpoint-<step>/spectral_tracker.pt``); ``on_train_begin`` reads it back when
  the run resumes from that checkpoint, so compression keeps its step-0 reference.
* ``on_train_end`` measures the last step, drains in-flight work (bounded) and draws the figures.
  The Trainer has no exception hook: after an exception the daemon worker is abandoned with its
  snapshot, and what was logged before stays logged.

Event files go where the Trainer's own ``TensorBoardCallback`` writes - ``TENSORBOARD_LOGGING_DIR``
if set, else ``args.logging_dir`` (transformers 4.x), else ``<output_dir>/runs/<time>_<host>``
(transformers 5) - so TensorBoard opened on the run shows the spectra beside the loss; or to
``logdir=``. Under ``torchrun`` / ``accelerate launch`` every rank decomposes a share of the
matrices and rank 0 writes them all.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from spectral_callbacks.monitor.options import DEFAULT_METRICS, MonitorOptions, with_options
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
            model, or a model wrapped by FSDP1 or partitioned by DeepSpeed ZeRO-3 (at
            ``on_train_begin``; FSDP2, ``fsdp_version: 2``, is decomposed where its shards live);
            with ``lr_balance``, a Trainer optimizer whose param groups mix a watched matrix with
            other parameters (pass ``optimizers=(AdamW(balanced_param_groups(model)), None)``).
        TypeError: an argument that is not an option.

    Example::

        >>> from transformers import Trainer, TrainingArguments
        >>> callback = SpectralTrainerCallback(every_n_steps=50)
        >>> trainer = Trainer(model, TrainingArguments("out"), train_dataset=data,
        ...                   callbacks=[callback])  # doctest: +SKIP
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
        self.tracker = SpectralTracker(
            model,
            logdir=logdir,
            start_step=state.global_step,
            state=_saved_state(args, state),
            options=self.options,
            # lr_balance scales the Trainer's optimizer (its groups from balanced_param_groups)
            optimizer=kwargs.get("optimizer") if self.options.lr_balance is not None else None,
            caller=type(self).__name__,
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is not None:
            self.tracker.step(state.global_step)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is None:
            return
        saved = self.tracker.state_dict()  # every rank: it may wait for rank 0's first results
        checkpoint = _output_dir(args) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            torch.save(saved, checkpoint / STATE_FILE)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.tracker is not None:
            self.tracker.close(state.global_step)


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

    reports = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    if not {"tensorboard", "all"} & set(reports):  # no TensorBoardCallback: a run of our own
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
