"""The private parts of TensorBoard and Lightning this package relies on, in one place.

Three accessors are not public API, so each sits here behind a function with a fallback that only
costs speed or detail, never data - the day one of them changes, this file changes:

* ``SummaryWriter._get_file_writer()`` - write a snapshot's ~200 scalars as *one* event. Without
  it each scalar goes through ``log_metrics``, one event each (slower, same values).
  The custom-scalars layout goes the same way, so that its sections can start collapsed (without
  it ``add_custom_scalars`` writes the layout with every section open), and so do the figures'
  PNGs, as they are (without it they are decoded and written with ``add_image``).
* ``TensorBoardLogger._prefix`` - a logger with a metric prefix must get ``log_metrics``, which adds
  the prefix. Without the attribute a logger is assumed to have no prefix.
* ``event_file_loader._make_tf_record_iterator`` - read raw records and learn where a file is
  damaged. Without it the records are read by ``PyRecordReader_New`` of TensorBoard's bundled
  TensorFlow stub, which raises the same ``DataLossError``.

Loggers are recognised by class name, so the TensorBoard loggers of ``lightning.pytorch``,
``lightning.fabric``, ``pytorch_lightning`` and ``lightning_fabric`` are all found without
importing any of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any


class LogdirWriter:
    """Event files in ``logdir``, for a tracker given ``logdir=``: a logger without Lightning.

    It offers what the tracker asks of a logger (``log_metrics``, ``experiment``, ``finalize``);
    the ``SummaryWriter`` is made on first use.
    """

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self._experiment: Any = None

    @property
    def experiment(self) -> Any:
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            self._experiment = SummaryWriter(self.logdir)
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.experiment.add_scalar(tag, value, step)

    def finalize(self, status: str = "success") -> None:
        if self._experiment is not None:
            self._experiment.close()


def is_tensorboard_logger(logger: Any) -> bool:
    """Whether ``logger`` writes TensorBoard event files: a :class:`LogdirWriter`, or a Lightning
    or Fabric ``TensorBoardLogger`` of any of the packages."""
    if isinstance(logger, LogdirWriter):
        return True
    return any(cls.__name__ == "TensorBoardLogger" for cls in type(logger).__mro__)


def summary_writers(loggers: Iterable[Any]) -> list[Any]:
    """The ``SummaryWriter`` of every TensorBoard logger among ``loggers``."""
    return [logger.experiment for logger in loggers if is_tensorboard_logger(logger)]


def log_scalars(loggers: Iterable[Any], scalars: Mapping[str, float], step: int) -> None:
    """``log_metrics(scalars, step)`` on every logger; a TensorBoard logger gets one event.

    ``TensorBoardLogger.log_metrics`` writes one event per scalar, and without TensorFlow installed
    TensorBoard checksums every event in pure Python on its writer thread, holding the GIL the
    training thread needs: a snapshot's ~200 scalars cost ~4 % of a small model's training time that
    way. One multi-value ``Summary`` per snapshot is one event; readers see the same scalars.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    for logger in loggers:
        file_writer = _file_writer(logger)
        if file_writer is None:
            logger.log_metrics(dict(scalars), step)
            continue
        values = [
            Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()
        ]
        file_writer.add_summary(Summary(value=values), global_step=step)


def _file_writer(logger: Any) -> Any:
    """The event-file writer of a plain TensorBoard logger, or ``None`` to use ``log_metrics``."""
    if not is_tensorboard_logger(logger) or bool(getattr(logger, "_prefix", None)):
        return None
    return _event_file_writer(logger.experiment)


def _event_file_writer(writer: Any) -> Any:
    """``SummaryWriter._get_file_writer()`` (torch and tensorboardX), or ``None`` without it."""
    get_file_writer = getattr(writer, "_get_file_writer", None)
    return get_file_writer() if callable(get_file_writer) else None


def write_summary(writer: Any, summary: Any, step: int | None = None) -> bool:
    """Write a ``Summary`` proto as one event of ``writer``; ``False`` if it has no event-file writer
    (the caller then falls back to the writer's public methods)."""
    file_writer = _event_file_writer(writer)
    if file_writer is None:
        return False
    file_writer.add_summary(summary, global_step=step)
    return True


def logdir_of(writer: Any) -> str | None:
    """The directory a ``SummaryWriter`` writes its event files to (torch's ``get_logdir()``,
    tensorboardX's ``logdir``), or ``None`` for a writer that does not say."""
    get_logdir = getattr(writer, "get_logdir", None)
    logdir = get_logdir() if callable(get_logdir) else getattr(writer, "logdir", None)
    return logdir if isinstance(logdir, str) else None


def write_event_file(logdir: str, summaries: Sequence[Any], step: int, suffix: str) -> None:
    """Write ``summaries`` at ``step`` into a new event file of its own in ``logdir``, and close it.

    TensorBoard reads every event file of a directory as one run, so these events join the run's
    others. A process other than the run's (the figure process) writes this way.
    """
    import time

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(logdir, filename_suffix=suffix)
    try:
        for summary in summaries:
            writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
    finally:
        writer.close()


def add_text(writers: Sequence[Any], tag: str, text: str, step: int) -> None:
    """A text entry (Markdown) under ``tag`` at ``step`` in every ``SummaryWriter``."""
    for writer in writers:
        writer.add_text(tag, text, global_step=step)


def add_histograms(
    writers: Sequence[Any], histograms: Mapping[str, Sequence[float]], step: int
) -> None:
    """Each ``tag -> values`` of ``histograms`` as a TensorBoard histogram at ``step``, in every
    ``SummaryWriter``: all of them as one event where the writer has an event-file writer (as
    :func:`log_scalars` does), else through ``add_histogram``; a writer with neither is skipped.

    One bucket per value at most (a layer's experts are a few to a few hundred values); ``min``,
    ``max``, ``num``, ``sum`` and ``sum_squares`` are exact.
    """
    if not histograms:
        return
    import numpy as np
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard.summary import make_histogram

    arrays = {tag: np.asarray(values, dtype=np.float64) for tag, values in histograms.items()}
    summary = Summary(
        value=[
            Summary.Value(tag=tag, histo=make_histogram(values, bins=min(len(values), 64)))
            for tag, values in arrays.items()
        ]
    )
    for writer in writers:
        if write_summary(writer, summary, step):
            continue
        add_histogram = getattr(writer, "add_histogram", None)
        if callable(add_histogram):
            for tag, values in arrays.items():
                add_histogram(tag, values, global_step=step, bins=min(len(values), 64))


def add_layout(writers: Sequence[Any], layout: Any) -> None:
    """Write the custom-scalars ``layout`` (a ``layout_pb2.Layout``) to every ``SummaryWriter``.

    ``SummaryWriter.add_custom_scalars`` takes a dict and cannot collapse a section, so the layout
    goes out as the summary that method writes, through the writer's ``_get_file_writer``; a writer
    without it gets ``add_custom_scalars`` (all sections open).
    """
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import metadata as custom_scalar_metadata

    summary = Summary(
        value=[
            Summary.Value(
                tag=custom_scalar_metadata.CONFIG_SUMMARY_TAG,
                metadata=custom_scalar_metadata.create_summary_metadata(),
                tensor=TensorProto(
                    dtype="DT_STRING",
                    string_val=[layout.SerializeToString()],
                    tensor_shape=TensorShapeProto(),
                ),
            )
        ]
    )
    for writer in writers:
        if not write_summary(writer, summary):
            writer.add_custom_scalars(_layout_dict(layout))


def _layout_dict(layout: Any) -> dict[str, dict[str, list]]:
    """The ``add_custom_scalars`` dict of ``layout`` (it has no place for ``closed``)."""
    return {
        category.title: {
            chart.title: ["Multiline", list(chart.multiline.tag)] for chart in category.chart
        }
        for category in layout.category
    }


def flush(writers: Sequence[Any]) -> None:
    """Flush every writer so a running TensorBoard shows the new points within seconds."""
    for writer in writers:
        writer.flush()


def tf_records(path: str) -> Iterator[bytes]:
    """The raw records of one event file; ``DataLossError`` at a truncated or corrupt record.

    TensorBoard's public loaders stop silently at a bad record (a live run's last record may still
    be half-written); the CLI must say where a file stopped, so it drives the record reader itself.
    """
    from tensorboard.backend.event_processing import event_file_loader

    make_iterator = getattr(event_file_loader, "_make_tf_record_iterator", None)
    if callable(make_iterator):
        yield from make_iterator(path)
        return
    yield from _stub_records(path)


def _stub_records(path: str) -> Iterator[bytes]:
    """The fallback reader: TensorBoard's TensorFlow stub, which checks lengths and checksums."""
    from tensorboard.compat import tf
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

    reader = pywrap_tensorflow.PyRecordReader_New(path)
    while True:
        try:
            reader.GetNext()
        except tf.errors.OutOfRangeError:
            return
        yield reader.record()
