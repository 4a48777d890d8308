"""Reading TensorBoard event files back into tidy rows, every point of every tag.

A *run* is a directory that holds event files (``events.out.tfevents.*``); a directory given by the
user is either a run or a parent of several runs. Each run's scalars become tidy rows:

=========  ==================================================================================
column     meaning
=========  ==================================================================================
run        path of the run relative to the directory given (its own name if that is the run)
step       the step the scalar was logged at (the trainer's optimizer step)
metric     ``stable_rank``, ``alpha``, ... for spectral tags; the whole tag for other scalars
stack      ``enc``/``dec``, ``text``/``vision`` where the model has several stacks, else empty
layer      layer index within its stack (nullable int); empty for the mean over layers and for
           other scalars
depth      relative depth layer / (L - 1) within the stack, L from ``spectral_monitor/num_layers``
           (``spectral_monitor/num_layers/<stack>`` per stack)
role       ``Q``, ``K``, ``V``, ``O``, ``MLP_up``, ``MLP_down`` or a variant role; empty otherwise;
           an aggregate over a layer's experts carries it: ``MLP_down/mean``, ``/min``, ``/max``
expert     the expert's index for a per-expert value (nullable int), else empty
head       the query head of a per-head circuit value (role ``heads``; nullable int), else empty
value      the logged value (float32 in the event file, widened exactly to float64)
wall_time  seconds since the epoch when it was logged
=========  ==================================================================================

Records are read with TensorBoard's own record reader and protobufs, without its reservoir
sampling (``EventAccumulator`` keeps at most 10,000 points per tag by default), so a long run is
read whole. A truncated or corrupt file does not stop the reading: the events before the damage
are kept and the damage is reported as a :class:`ReadProblem`.

Example::

    >>> import tempfile
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from spectral_callbacks.names import NUM_LAYERS_TAG, scalar_tag
    >>> logdir = tempfile.mkdtemp()
    >>> with SummaryWriter(logdir) as writer:
    ...     writer.add_scalar(NUM_LAYERS_TAG, 2, 0)
    ...     writer.add_scalar(scalar_tag("alpha", 1, "Q"), 0.25, 0)
    >>> read = read_runs([logdir])
    >>> read.rows[["step", "metric", "stack", "layer", "depth", "role", "value"]].to_dict("records")
    [{'step': 0, 'metric': 'alpha', 'stack': '', 'layer': 1, 'depth': 1.0, 'role': 'Q', 'value': 0.25}]
    >>> read.problems
    []
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from spectral_callbacks.messages import count
from spectral_callbacks.names import TIDY_COLUMNS, num_layers_tag, tidy_rows
from spectral_callbacks.tensorboard_adapter import tf_records

COLUMNS = TIDY_COLUMNS
EVENT_FILE_MARKER = "tfevents"
#: How a :class:`ReadProblem` of a run without spectral scalars begins (a caller may add advice).
NO_SPECTRAL_SCALARS = "event files hold no spectral scalars"


@dataclass(frozen=True)
class ReadProblem:
    """Something that could not be read: the path, what went wrong and what to do about it."""

    path: str
    what: str
    todo: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}; {self.todo}"


@dataclass
class ReadResult:
    """Tidy rows of every run that could be read, plus what could not be read and notes."""

    rows: pd.DataFrame
    problems: list[ReadProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Run:
    """A directory holding event files, and the name its rows carry."""

    name: str
    directory: Path
    files: tuple[Path, ...]


def is_event_file(path: Path) -> bool:
    """Whether ``path`` is named like a TensorBoard event file (``events.out.tfevents.*``)."""
    return EVENT_FILE_MARKER in path.name and path.is_file()


def find_runs(logdirs: Sequence[str | Path]) -> tuple[list[Run], list[ReadProblem]]:
    """The runs below each of ``logdirs``; missing paths and empty directories become problems.

    A path that is itself an event file is a run of one file (named after its directory). Runs
    whose names clash across the given directories are prefixed with the directory as given.
    """
    found: list[tuple[str, Run]] = []
    problems: list[ReadProblem] = []
    for logdir in logdirs:
        root = Path(logdir)
        if not root.exists():
            problems.append(
                ReadProblem(
                    str(logdir),
                    "no such file or directory",
                    "give the log directory of a run (the TensorBoardLogger's save_dir or a version_N below it)",
                )
            )
            continue
        if root.is_file():
            if is_event_file(root):
                found.append((str(logdir), Run(root.resolve().parent.name, root.parent, (root,))))
            else:
                problems.append(
                    ReadProblem(
                        str(logdir),
                        "not a TensorBoard event file (events.out.tfevents.*)",
                        "give the directory that holds the event files",
                    )
                )
            continue
        runs_here = []
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()  # runs in a stable, sorted order
            events = sorted(Path(directory, f) for f in files if EVENT_FILE_MARKER in f)
            if events:
                relative = Path(directory).relative_to(root).as_posix()
                name = root.resolve().name if relative == "." else relative
                runs_here.append((str(logdir), Run(name, Path(directory), tuple(events))))
        if not runs_here:
            problems.append(
                ReadProblem(
                    str(logdir),
                    "no TensorBoard event files (events.out.tfevents.*) in it or below",
                    "point at the directory a TensorBoardLogger wrote (its save_dir or a version_N)",
                )
            )
        found.extend(runs_here)
    counts = pd.Series([run.name for _, run in found]).value_counts()
    runs = [
        Run(f"{given.rstrip('/')}/{run.name}", run.directory, run.files)
        if counts.get(run.name, 0) > 1
        else run
        for given, run in found
    ]
    return runs, problems


def _records(path: Path) -> Iterator[bytes]:
    """The raw records of one event file, raising ``DataLossError`` at a truncated/corrupt one.

    TensorBoard's public loaders (``EventFileLoader``, ``EventAccumulator``) stop silently at a bad
    record, because a live run's last record may still be half-written; the CLI must say when it
    stopped early, so it drives TensorBoard's record iterator itself.
    """
    yield from tf_records(str(path))


def read_event_file(path: Path) -> tuple[list[tuple[str, int, float, float]], ReadProblem | None]:
    """Every scalar point of one event file as (tag, step, value, wall_time), in file order.

    Scalars are the classic ``simple_value`` ones (``torch.utils.tensorboard``, Lightning's
    TensorBoardLogger) and scalar tensors of the ``scalars`` plugin (``tf.summary``,
    ``SummaryWriter(..., new_style=True)``). Reading stops at the first truncated or corrupt
    record; the points before it are returned with a :class:`ReadProblem`.
    """
    from google.protobuf.message import DecodeError
    from tensorboard.compat import tf
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    points: list[tuple[str, int, float, float]] = []
    events = 0
    try:
        for record in _records(path):
            event = event_pb2.Event.FromString(record)
            events += 1
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    points.append((value.tag, event.step, value.simple_value, event.wall_time))
                elif (
                    value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars"
                ):
                    number = float(tensor_util.make_ndarray(value.tensor).item())
                    points.append((value.tag, event.step, number, event.wall_time))
    except (tf.errors.DataLossError, DecodeError) as error:
        # A damaged length field also reads as truncation: TensorBoard cannot tell them apart.
        if "has truncated record" in str(error):
            reason = "truncated record"
        elif isinstance(error, DecodeError):
            reason = "undecodable record"
        else:
            reason = "checksum mismatch"
        return points, ReadProblem(
            str(path),
            f"damaged event file ({reason}) after {count(events, 'readable event')}"
            f" ({count(len(points), 'scalar point')})",
            "if the run is still writing, read it again later, else the rest of this file is lost"
            " (copy it again from where it was written)",
        )
    return points, None


def read_texts(path: Path, tag: str) -> list[tuple[int, str]]:
    """The text entries (``add_text``) of ``tag`` in one event file, as (step, text) in file order.

    ``torch.utils.tensorboard`` stores ``add_text(tag, ...)`` under ``<tag>/text_summary``; a
    damaged record ends the reading (what came before is returned).
    """
    from google.protobuf.message import DecodeError
    from tensorboard.compat import tf
    from tensorboard.compat.proto import event_pb2

    found: list[tuple[int, str]] = []
    try:
        for record in _records(path):
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.tag in (tag, f"{tag}/text_summary") and value.HasField("tensor"):
                    texts = [item.decode("utf-8") for item in value.tensor.string_val]
                    found += [(event.step, text) for text in texts]
    except (tf.errors.DataLossError, DecodeError):
        pass
    return found


def _tidy(
    run: str, points: list[tuple[str, int, float, float]], all_scalars: bool
) -> tuple[pd.DataFrame, dict[str, int]]:
    """Tidy rows of one run's points (``names.tidy_rows``), and the stacks whose layer count was
    not logged."""
    tags, steps, values, wall_times = zip(*points, strict=True) if points else ((), (), (), ())
    return tidy_rows(run, tags, steps, values, wall_times, all_scalars=all_scalars)


def empty_rows() -> pd.DataFrame:
    """A tidy-row DataFrame with no rows and the right columns and dtypes."""
    return _tidy("", [], all_scalars=False)[0]


def read_runs(
    logdirs: Sequence[str | Path], *, all_scalars: bool = False, progress: bool = False
) -> ReadResult:
    """Read every run below ``logdirs`` into tidy rows, keeping every point of every tag.

    Args:
        logdirs: run directories, parents of runs, or event files.
        all_scalars: also keep scalars that are not spectral metrics (loss, tokens, the
            ``spectral_monitor/...`` health scalars), with the tag as ``metric`` (default False).
        progress: show a progress bar over the event files on stderr (default False).

    Returns:
        The rows, the problems (missing paths, no event files, damaged files, runs without spectral
        scalars) and notes (e.g. a depth computed without ``spectral_monitor/num_layers``).
    """
    runs, problems = find_runs(logdirs)
    notes: list[str] = []
    frames = []
    files = [(run, path) for run in runs for path in run.files]
    points_of: dict[str, list[tuple[str, int, float, float]]] = {run.name: [] for run in runs}
    for run, path in _progress(files, "reading event files", enabled=progress):
        points, problem = read_event_file(path)
        points_of[run.name].extend(points)
        if problem is not None:
            problems.append(problem)
    for run in runs:
        points = points_of[run.name]
        rows, guessed = _tidy(run.name, points, all_scalars)
        has_spectral = bool(rows["role"].notna().any())
        damaged = any(Path(p.path).parent == run.directory for p in problems)
        if not has_spectral and not (all_scalars and points) and not damaged:
            others = len({tag for tag, *_ in points})
            problems.append(
                ReadProblem(
                    str(run.directory),
                    f"{NO_SPECTRAL_SCALARS} (spectral_<metric>/L<layer>/<role>),"
                    f" only {others} other tags",
                    "train with SpectralMonitor among the Trainer's callbacks",
                )
            )
        notes += [
            f"run {run.name}: no {num_layers_tag(stack)} scalar; depth uses max layer + 1"
            f" = {count(layers, 'layer')}"
            for stack, layers in guessed.items()
        ]
        frames.append(rows)
    rows = pd.concat(frames, ignore_index=True) if frames else empty_rows()
    return ReadResult(rows, problems, notes, [run.name for run in runs])


def _progress(items: list, description: str, *, enabled: bool) -> Iterable:
    """Iterate ``items`` with a rich progress bar on stderr when ``enabled`` and worth it."""
    if not enabled or len(items) < 2:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=description, console=Console(stderr=True), transient=True)


def filter_rows(
    rows: pd.DataFrame,
    *,
    metrics: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
    layers: Sequence[int | None] | None = None,
    steps: tuple[int | None, int | None] | None = None,
) -> pd.DataFrame:
    """Rows whose metric, role, layer and step pass the filters (None: no filter).

    ``roles`` and ``layers`` apply to spectral rows only, so other scalars kept by ``all_scalars``
    stay; a ``None`` in ``layers`` selects the mean-over-layers rows; ``steps`` is an inclusive
    ``(first, last)`` range, either end open when ``None``.
    """
    keep = pd.Series(True, index=rows.index)
    spectral = rows["role"].notna()
    if metrics:
        keep &= rows["metric"].isin(metrics)
    if roles:
        keep &= ~spectral | rows["role"].isin(roles)
    if layers:
        wanted = [layer for layer in layers if layer is not None]
        on_layer = rows["layer"].isin(wanted).fillna(False).astype(bool)
        on_mean = rows["layer"].isna() & (None in layers)
        keep &= ~spectral | on_layer | on_mean
    if steps is not None:
        first, last = steps
        if first is not None:
            keep &= rows["step"] >= first
        if last is not None:
            keep &= rows["step"] <= last
    return rows[keep].reset_index(drop=True)
