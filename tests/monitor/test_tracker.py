"""SpectralTracker and the options every frontend shares: validation, reuse, NaN weights, figures
after an exception, resume of a compute's state, and the TensorBoard adapter's fallbacks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tiny_models import RecordingLogger, TinyGPT, exact_compute, quiet_trainer, token_loader

from spectral_callbacks import SpectralMonitor, SpectralTracker, tensorboard_adapter
from spectral_callbacks.monitor import dashboards
from spectral_callbacks.monitor.engines.compute import ComputeFunction
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.names import monitor_tag, scalar_tag
from spectral_callbacks.offline.events import read_event_file

Q0 = scalar_tag("stable_rank", 0, "Q")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_iter": -1}, r"`n_iter` must be None or a non-negative int, got -1"),
        ({"n_oversamples": -1}, r"`n_oversamples` must be None or a non-negative int, got -1"),
        ({"svd_method": "foo"}, r"`svd_method` must be one of \('auto'.*got 'foo'"),
        ({"fit_window": (5, 2)}, r"`fit_window` must be None or 1-based ranks .*got \(5, 2\)"),
        ({"fit_window": (0, 10)}, r"`fit_window` must be .*got \(0, 10\)"),
        ({"fit_window": 5}, r"`fit_window` must be .*got 5"),
        ({"compute": 5}, r"`compute` must be None or a function .*got 5"),
        ({"worker_threads": 0}, r"`worker_threads` must be None or a positive int, got 0"),
        ({"figures": "yes"}, r"`figures` must be True or False, got 'yes'"),
        ({"figure_roles": "Q"}, r"`figure_roles` must be None or a list of role names"),
        (
            {"worker_nice": 100},
            r"`worker_nice` must be None or a nice increment from 0 to 19, got 100",
        ),
        ({"max_overhead": "x"}, r"`max_overhead` must be a fraction in \(0, 1\).*got 'x'"),
        (
            {"drain_timeout": "5"},
            r"`drain_timeout` must be a finite number of seconds >= 0.*got '5'",
        ),
        (
            {"drain_timeout": float("inf")},
            r"`drain_timeout` must be a finite number of seconds >= 0.*got inf",
        ),
        (
            {"k": 1},
            r"`k` must be at least 3 to fit `alpha` \(or leave alpha and alpha_r2 out of `metrics`\), got 1",
        ),
        ({"k": 2, "metrics": ("alpha_r2",)}, r"`k` must be at least 3 to fit `alpha`.*got 2"),
        (
            {"fit_window": (4, 5)},
            r"`fit_window` must be ranks spanning at least 3 to fit `alpha`.*got \(4, 5\)",
        ),
        # a window starting beyond k: every alpha and alpha_r2 would be NaN
        (
            {"fit_window": (40, 60)},
            r"`fit_window` must be ranks spanning at least 3 to fit `alpha`, counted within the computed ranks 1..k=32 .*got \(40, 60\)",
        ),
        ({"fit_window": (8, 20), "k": 9}, r"`fit_window` .*ranks 1..k=9 .*got \(8, 20\)"),
        # before: accepted here, refused (or silently misread) only once training started
        (
            {"delta": "firsts"},
            r"`delta`='firsts': no such file; give a state_dict, its file or 'first'",
        ),
        ({"delta": "no/such/base.pt"}, r"`delta`='no/such/base.pt': no such file"),
        ({"include": 5}, r"`include` must be None, a name pattern .*got 5"),
        ({"exclude": ["*.q", 3]}, r"`exclude` must be None, a name pattern .*got \['\*.q', 3\]"),
        ({"mapping": ["Q"]}, r"`mapping` must be None, a dict \{pattern: role .*got \['Q'\]"),
        ({"esd_every_n_snapshots": 0}, r"`esd_every_n_snapshots` must be a positive int, got 0"),
        ({"roles": "Q"}, r"`roles` must be None or a list of role names, got 'Q'"),
        ({"k": True}, r"`k` must be a positive int, got True"),
    ],
)
def test_every_argument_is_checked_at_construction_naming_it(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        MonitorOptions(**kwargs)
    with pytest.raises(MisconfigurationException, match=match):  # what Lightning users catch
        SpectralMonitor(**kwargs)


def test_unknown_roles_of_figure_roles_are_named_once_the_model_is_known() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"`figure_roles` must be None or roles this model has \(Q, K, V, O, MLP_up, MLP_down\), got \('Z',\)",
    ):
        SpectralTracker(TinyGPT(), figure_roles=("Z",), start_step=None)
    trainer = quiet_trainer(
        max_steps=2, logger=RecordingLogger(), callbacks=[SpectralMonitor(figure_roles=("Z",))]
    )
    with pytest.raises(MisconfigurationException, match="`figure_roles`"):
        trainer.fit(TinyGPT(), token_loader())


def test_a_writer_without_log_metrics_is_named_before_anything_runs() -> None:
    with pytest.raises(
        ConfigurationError, match=r"`writers` must be a list of loggers.*got \[<object"
    ):
        SpectralTracker(TinyGPT(), writers=[object()])


def test_k_below_the_fit_is_fine_without_the_fitted_metrics() -> None:
    assert MonitorOptions(k=1, metrics=("stable_rank", "spectral_norm")).k == 1


def test_a_tracker_with_nowhere_to_write_is_refused() -> None:
    # before: it computed every snapshot and wrote nothing, silently
    with pytest.raises(
        ConfigurationError,
        match=r"SpectralTracker has nowhere to write: pass `logdir=\"runs/exp\"` .*or `writers=",
    ):
        SpectralTracker(TinyGPT(), figures=False)


def test_a_model_that_is_not_a_module_is_named() -> None:
    with pytest.raises(ConfigurationError, match=r"`model` must be a torch.nn.Module.*got None"):
        SpectralTracker(None, writers=[RecordingLogger()])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (5.5, r"`step` must be a non-negative int \(the optimizer step\), got 5.5"),
        ("7", r"`step` must be a non-negative int \(the optimizer step\), got '7'"),
        (-1, r"`step` must be a non-negative int \(the optimizer step\), got -1"),
        (True, r"`step` must be a non-negative int \(the optimizer step\), got True"),
        (3, r"`step` must not go back: got 3 after 5; pass each optimizer step in order"),
    ],
)
def test_step_is_checked_where_it_enters_and_the_run_goes_on(bad: Any, match: str) -> None:
    writer = RecordingLogger()
    options = dict(every_n_steps=5, log_spaced_until=0, figures=False, metrics=("stable_rank",))
    with SpectralTracker(TinyGPT(), writers=[writer], **options) as tracker:
        tracker.step(5)  # a snapshot in flight
        with pytest.raises(ConfigurationError, match=match):
            tracker.step(bad)
        tracker.step(10)
    assert sorted(writer.series(Q0)) == [0, 5, 10]  # nothing in flight was abandoned


def test_a_bad_start_step_is_named() -> None:
    with pytest.raises(ConfigurationError, match=r"`start_step` must be None or a non-negative"):
        SpectralTracker(TinyGPT(), writers=[RecordingLogger()], start_step=-3)


def test_an_unknown_argument_lists_the_options() -> None:
    with pytest.raises(
        TypeError, match=r"SpectralTracker got unknown argument\(s\) 'every_n_step'.*every_n_steps"
    ):
        SpectralTracker(TinyGPT(), every_n_step=5)


def _monitor(**kwargs: Any) -> SpectralMonitor:
    options: dict[str, Any] = dict(
        compute=exact_compute,
        metrics=("stable_rank", "compression"),
        figures=False,
        every_n_steps=5,
        log_spaced_until=0,
    )
    return SpectralMonitor(**{**options, **kwargs})


def test_one_instance_reused_for_a_second_fit_starts_afresh() -> None:
    monitor = _monitor()
    first, second = RecordingLogger(), RecordingLogger()
    quiet_trainer(max_steps=10, logger=first, callbacks=[monitor]).fit(TinyGPT(), token_loader())
    quiet_trainer(max_steps=10, logger=second, callbacks=[monitor]).fit(
        TinyGPT(lr=5e-3), token_loader()
    )
    assert sorted(first.series(Q0)) == sorted(second.series(Q0)) == [0, 5, 10]
    assert second.series(scalar_tag("compression", 0, "Q"))[0] == 0.0  # its own reference


def test_starting_past_step_zero_without_state_says_what_the_reference_is() -> None:
    writer = RecordingLogger()
    with pytest.warns(RuntimeWarning, match="starts at step 10 with no state.*against step 10"):
        tracker = SpectralTracker(TinyGPT(), writers=[writer], start_step=10, figures=False)
    tracker.close()
    assert sorted(writer.series(Q0)) == [10]
    assert writer.series(scalar_tag("compression", 0, "Q"))[10] == 0.0


def _nan_into(model: TinyGPT) -> None:
    with torch.no_grad():
        model.model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")


def test_nan_weights_warn_once_naming_the_first_matrix_and_step() -> None:
    model, writer = TinyGPT(), RecordingLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SpectralTracker(
            model,
            writers=[writer],
            metrics=("stable_rank", "spectral_norm"),
            every_n_steps=2,
            log_spaced_until=0,
            figures=False,
            synchronous=True,
        ) as tracker:
            for step in range(1, 9):
                if step == 5:
                    _nan_into(model)
                tracker.step(step)
    found = [w for w in caught if "NaN or Inf" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert "'model.transformer.h.1.mlp.c_fc.weight' hold NaN or Inf at step 6" in str(
        found[0].message
    )
    assert torch.isnan(torch.tensor(writer.series(scalar_tag("stable_rank", 1, "MLP_up"))[8]))
    assert not torch.isnan(torch.tensor(writer.series(Q0)[8]))  # only that matrix


def test_an_svd_solver_that_raises_is_counted_and_said_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # From step 5 on, LAPACK's eigensolvers raise on every input (as eigh did on a matrix far from
    # unit scale with MKL on an AMD EPYC): no snapshot raises, every matrix's spectrum comes from
    # the exact float64 path (LAPACK's SVD), the fallbacks are counted under
    # spectral_monitor/svd_fallbacks (logged from the first on) and said once, naming the first.
    model, writer = TinyGPT(), RecordingLogger()
    failing = [False]
    for name in ("eigh", "eigvalsh"):
        solver = getattr(torch.linalg, name)

        def maybe_failing(A: torch.Tensor, *args: Any, solver: Any = solver, **kwargs: Any) -> Any:
            if failing[0]:
                raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
            return solver(A, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, maybe_failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SpectralTracker(
            model,
            writers=[writer],
            metrics=("stable_rank", "spectral_norm"),
            every_n_steps=2,
            log_spaced_until=0,
            figures=False,
            synchronous=True,
        ) as tracker:
            for step in range(1, 9):
                failing[0] = step >= 5
                tracker.step(step)
            watched = len(tracker.targets)
    counts = writer.series(monitor_tag("svd_fallbacks"))
    assert counts == {6: watched, 8: 2 * watched}, counts
    found = [w for w in caught if "solver raised" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in caught]
    assert f"{tracker.targets[0].name!r} at step 6" in str(found[0].message)
    # The weights never change here: the fallback's values are those of the normal path.
    for tag in (Q0, scalar_tag("spectral_norm", 1, "MLP_down")):
        before, after = writer.series(tag)[4], writer.series(tag)[8]
        assert after == pytest.approx(before, rel=2.5e-3), tag


def test_an_all_zero_matrix_is_not_reported_as_non_finite() -> None:
    model = TinyGPT()
    with torch.no_grad():
        model.model.transformer.h[0].attn.c_proj.weight.zero_()  # zero-initialised output layers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpectralTracker(
            model,
            writers=[RecordingLogger()],
            metrics=("stable_rank",),
            figures=False,
            synchronous=True,
        ).close()
    assert not [w for w in caught if "NaN or Inf" in str(w.message)]


def _images(logdir: Path) -> list[str]:
    reader = event_accumulator.EventAccumulator(str(logdir))
    reader.Reload()
    return reader.Tags()["images"]


@pytest.mark.parametrize("fault", ["exception", "interrupt"])
def test_final_figures_are_drawn_after_an_exception_or_ctrl_c(tmp_path: Path, fault: str) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version="")
    monitor = _monitor(
        figures=True,
        figure_every_n_steps=None,
        metrics=("stable_rank", "alpha", "compression"),
        compute=None,
        k=8,
    )
    trainer = quiet_trainer(max_steps=50, logger=logger, callbacks=[monitor])
    model = TinyGPT(fail_at_step=6) if fault == "exception" else TinyGPT(interrupt_at_step=6)
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(RuntimeError if fault == "exception" else SystemExit):
            trainer.fit(model, token_loader())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert dashboards.wait_for_figures(timeout=120)  # written by the figure process, not waited
    images = _images(tmp_path / "run")
    assert any("alpha_vs_depth/Q" in tag for tag in images), images


def test_ctrl_c_in_the_end_of_training_wait_drops_the_snapshots_at_once_in_one_line(
    tmp_path: Path,
) -> None:
    # before: a KeyboardInterrupt traceback through tracker.py and engine.py, after waiting up to
    # 5 s for the worker and warning that it did not stop; then: close() returned normally and a
    # sweep loop started its next run. Now the snapshots are dropped in one line, then the
    # KeyboardInterrupt goes on up to the loop.
    script = Path(__file__).resolve().parents[1] / "interrupted_drain.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Each pipe read on a thread of its own: every wait below is bounded, and a script that hangs
    # fails this test with its threads' stacks (SIGUSR1: faulthandler) instead of hanging the suite.
    out, err = _LineReader(process.stdout), _LineReader(process.stderr)
    try:
        waiting = err.first("waiting up to", timeout=120)
        assert waiting is not None, _stacks_of(process, err)
        time.sleep(0.5)  # inside the wait
        interrupted_at = time.monotonic()
        process.send_signal(signal.SIGINT)
        after = out.first("", timeout=60)  # the sweep's handler runs once close() raised
        seconds = time.monotonic() - interrupted_at  # not counting the interpreter's own teardown
        assert after is not None, _stacks_of(process, err)
        status = process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the script did not exit after the Ctrl-C: {_stacks_of(process, err)}")
    finally:
        process.kill()
    out.thread.join(10)
    err.thread.join(10)
    lines = err.lines[: err.lines.index(waiting) + 1]
    rest = err.lines[len(lines) :]
    assert after.strip() == "the sweep got the KeyboardInterrupt", after
    assert out.lines == [after]  # no second run
    assert status == -signal.SIGINT  # what an uncaught Ctrl-C exits with
    assert "waiting up to" in lines[-1] and "Ctrl-C drops them" in lines[-1], lines
    assert re.search(r"Ctrl-C: stopped waiting; [1-4] snapshot\(s\) dropped", rest[0]), rest
    assert rest[-1] == "KeyboardInterrupt", rest  # its traceback, as for any Ctrl-C
    # Not a speed: one shape group's 0.3 s at most, against the 5 s join it must not wait for
    # (2 s was tight on a loaded 2-core machine).
    assert seconds < 4.0, seconds


class _LineReader:
    """The lines of a pipe, read on a daemon thread; :meth:`first` waits for one, bounded."""

    def __init__(self, pipe: Any) -> None:
        self.lines: list[str] = []
        self._added = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self.thread.start()

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            with self._added:
                self.lines.append(line.rstrip("\n"))
                self._added.notify_all()
        with self._added:  # the pipe closed: no line is coming
            self._added.notify_all()

    def first(self, text: str, timeout: float) -> str | None:
        """The first line containing ``text`` within ``timeout`` seconds, else ``None``."""
        with self._added:
            self._added.wait_for(
                lambda: any(text in line for line in self.lines) or not self.thread.is_alive(),
                timeout,
            )
            return next((line for line in self.lines if text in line), None)


def _stacks_of(process: subprocess.Popen[str], err: _LineReader) -> str:
    """What the script printed, with where each of its threads is now (if it still runs)."""
    if process.poll() is None:
        process.send_signal(signal.SIGUSR1)  # interrupted_drain.py: faulthandler dumps the stacks
        time.sleep(2)
    return "\n".join(err.lines[-150:])


class _CountingCompute(ComputeFunction):
    """A compute with state, as SpectrumCompute's generator will be: saved and restored."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        return exact_compute(group, batch)

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def test_state_dict_carries_the_compute_state_and_resumes_a_plain_loop() -> None:
    model = TinyGPT()
    with SpectralTracker(
        model,
        writers=[RecordingLogger()],
        metrics=("stable_rank", "compression"),
        compute=_CountingCompute(),
        every_n_steps=2,
        log_spaced_until=0,
        figures=False,
    ) as tracker:
        for step in range(1, 5):
            tracker.step(step)
    state = tracker.state_dict()
    assert state["compute"]["calls"] > 0 and state["schedule"]["last_snapshot_step"] == 4
    resumed_compute, writer = _CountingCompute(), RecordingLogger()
    with SpectralTracker(
        model,
        writers=[writer],
        metrics=("stable_rank", "compression"),
        compute=resumed_compute,
        every_n_steps=2,
        log_spaced_until=0,
        figures=False,
        start_step=4,
        state=state,
    ) as again:
        again.step(5)
        again.step(6)
    assert resumed_compute.calls > state["compute"]["calls"]
    assert sorted(writer.series(Q0)) == [6]  # no new reference at the resumed step
    reference = state["references"]["model.transformer.h.0.attn.c_attn.weight[Q]"]
    compression = writer.series(scalar_tag("compression", 0, "Q"))[6]
    assert compression == pytest.approx(100 * (1 - writer.series(Q0)[6] / reference), abs=1e-4)
    with pytest.raises(RuntimeError, match="load_state_dict must come before the first step"):
        again.load_state_dict(state)


def test_the_record_reader_falls_back_when_the_private_one_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for step in range(3):
            writer.add_scalar(Q0, float(step), step)
    (path,) = tmp_path.glob("events.out.tfevents.*")
    expected, _ = read_event_file(path)
    monkeypatch.delattr(event_file_loader, "_make_tf_record_iterator")
    points, problem = read_event_file(path)
    assert problem is None and points == expected and len(points) == 3
    path.write_bytes(path.read_bytes()[:-7])  # a half-written last record
    points, problem = read_event_file(path)
    assert problem is not None and "truncated record" in problem.what and len(points) == 2


def test_a_writer_without_the_private_file_writer_gets_log_metrics() -> None:
    class Experiment:  # a SummaryWriter look-alike without `_get_file_writer`
        pass

    class TensorBoardLogger(RecordingLogger):
        experiment = Experiment()

    logger = TensorBoardLogger()
    tensorboard_adapter.log_scalars([logger], {Q0: 2.0}, step=3)
    assert logger.records == [(3, {Q0: 2.0})]


def test_both_engines_implement_the_protocol_and_the_factory_picks_by_world_size(
    tmp_path: Path,
) -> None:
    import torch.distributed as dist

    from spectral_callbacks.monitor.engines.distributed import DistributedEngine
    from spectral_callbacks.monitor.engines.engine import SnapshotEngine
    from spectral_callbacks.monitor.engines.protocol import Engine, make_engine
    from spectral_callbacks.targets import find_targets

    targets = find_targets(TinyGPT())
    options = MonitorOptions(
        max_pending=2, synchronous=False, worker_threads=1, worker_nice=None, drain_timeout=5.0
    )
    single = make_engine(exact_compute, targets, ("stable_rank",), options)
    assert type(single) is SnapshotEngine and isinstance(single, Engine)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        group = dist.group.WORLD
        several = DistributedEngine(
            exact_compute, targets, ("stable_rank",), MonitorOptions(), rank=0, world_size=1,
            group=group,
        )  # fmt: skip
        assert isinstance(several, Engine)
        assert (
            several.offer(0) and several.collect(wait_seconds=0.2) == []
        )  # sent at the next point
        several.finish(0, offered=True, deadline=float("inf"))
        (result,) = several.collect(wait_seconds=10)
        assert result.step == 0 and len(result.metrics) == len(targets)
        several.close()
    finally:
        dist.destroy_process_group()
    single.close()


def test_the_writers_are_flushed_at_most_once_an_interval_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spectral_callbacks.monitor import tracker as tracker_module

    flushes: list[int] = []
    flush = tensorboard_adapter.flush
    monkeypatch.setattr(
        tensorboard_adapter, "flush", lambda writers: (flushes.append(len(writers)), flush(writers))
    )
    monkeypatch.setattr(tracker_module, "FLUSH_INTERVAL_SECONDS", 3600.0)
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    tracker = SpectralTracker(
        TinyGPT(),
        writers=[logger],
        metrics=("stable_rank",),
        every_n_steps=1,
        log_spaced_until=0,
        figures=False,
        synchronous=True,
        start_step=0,
    )
    for step in range(1, 6):  # each call logs the previous step's snapshot
        tracker.step(step)
    assert flushes == [1]  # step 0's points at once; the burst after them waits for the interval
    monkeypatch.setattr(tracker_module, "FLUSH_INTERVAL_SECONDS", 0.0)
    tracker.step(6)  # logs step 5's points, and flushes them
    assert flushes == [1, 1]
    monkeypatch.setattr(tracker_module, "FLUSH_INTERVAL_SECONDS", 3600.0)
    tracker.close()  # logs step 6's points, and flushes them whatever the interval
    assert flushes == [1, 1, 1]
    (path,) = (tmp_path / "run" / "version_0").glob("events.out.tfevents.*")
    points, problem = read_event_file(path)
    assert problem is None
    assert sorted({step for tag, step, _, _ in points if tag == Q0}) == list(range(7))


def test_health_scalars_are_the_measured_costs_and_pending_reaches_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spectral_callbacks.monitor import snapshot as snapshot_module

    copy_sleep, svd_sleep, max_pending = 0.02, 0.1, 3
    stack = snapshot_module._stack

    def slow_stack(group: Any) -> torch.Tensor:  # a copy that costs a known time per group
        time.sleep(copy_sleep)
        return stack(group)

    def slow_compute(group: Any, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        time.sleep(svd_sleep)
        return exact_compute(group, batch)

    monkeypatch.setattr(snapshot_module, "_stack", slow_stack)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    logger = RecordingLogger()
    with SpectralTracker(
        model,
        ["stable_rank"],
        writers=[logger],
        compute=slow_compute,
        every_n_steps=1,
        log_spaced_until=0,
        max_pending=max_pending,
        figures=False,
    ) as tracker:
        groups = len(snapshot_module.group_by_shape(tracker.targets))
        for step in range(1, 41):
            time.sleep(0.02)  # a training step, shorter than a snapshot's SVDs
            tracker.step(step)
    main_ms = logger.series(monitor_tag("main_thread_ms"))
    svd_ms = logger.series(monitor_tag("svd_ms"))
    pending = logger.series(monitor_tag("pending"))
    assert (
        groups == 3 and len(main_ms) >= 3 and sorted(main_ms) == sorted(svd_ms) == sorted(pending)
    )
    assert all(
        1000 * groups * copy_sleep <= ms < 1000 * groups * svd_sleep for ms in main_ms.values()
    )
    assert all(ms >= 1000 * groups * svd_sleep for ms in svd_ms.values())
    # Logged once its own result is collected: the others still in flight, max_pending - 1 at most.
    assert max(pending.values()) == max_pending - 1


def test_warnings_point_at_the_users_line_not_the_librarys() -> None:
    # before: the warnings showed tracker.py's / find.py's own file and line
    model = TinyGPT()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = SpectralTracker(
            model,
            writers=[RecordingLogger()],
            roles=["Q", "Z"],  # Z matches nothing: a warning from find_targets
            metrics=("stable_rank",),
            every_n_steps=2,
            log_spaced_until=0,
            figures=False,
            synchronous=True,
        )
        with torch.no_grad():
            model.model.transformer.h[0].attn.c_attn.weight[0, 0] = float("nan")
        tracker.step(2)  # the NaN warning comes from inside step() or close()
        tracker.close()
    mine = [w for w in caught if "matched no target" in str(w.message) or "NaN" in str(w.message)]
    assert len(mine) == 2, [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]


def test_cli_warnings_are_one_line_naming_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import spectral_callbacks.offline.loading as loading
    import spectral_callbacks.targets as targets
    from spectral_callbacks.cli.main import main

    find_targets = targets.find_targets
    monkeypatch.setattr(loading, "load_model", lambda path, arch, base=None: TinyGPT().model)
    monkeypatch.setattr(  # the library's own warning, from inside the command
        targets, "find_targets", lambda model: find_targets(model, roles=["Q", "Z"])
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["targets", str(tmp_path / "model.pt")]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "spectral-callbacks targets: warning: `roles` ['Z'] matched no target (roles found: "
        "Q, K, V, O, MLP_up, MLP_down)"
    ], err


def test_a_default_device_set_on_the_training_thread_leaves_the_host_tensors_on_the_host() -> None:
    # torch.set_default_device("cuda") in a training script: every host-side factory of the
    # reporter, the DDP payload and the pinned buffers names device="cpu". The meta device (the
    # one other device of a CPU build) stands in for CUDA: a tensor made there has no data.
    from spectral_callbacks.monitor.engines.distributed import ResultLayout

    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_embd=64, n_head=4, block_size=16)
    logger = RecordingLogger()
    tracker = SpectralTracker(
        model, writers=[logger], figures=False, synchronous=False, every_n_steps=1,
        log_spaced_until=0, metrics=("stable_rank", "compression"),
    )  # fmt: skip
    torch.set_default_device("meta")
    try:
        tracker.step(0)
        tracker.step(1)
        tracker.close(1)
        layout = ResultLayout(["w"], ("stable_rank",), world_size=1)
        flat = layout.pack(0, {"w": {"stable_rank": 2.0}}, {"matrices": 1})
    finally:
        torch.set_default_device(None)
    assert flat.device.type == "cpu" and layout.unpack(flat)[0] == {"w": {"stable_rank": 2.0}}
    weight = model.model.transformer.h[0].mlp.c_fc.weight.detach().double()
    singular = torch.linalg.svdvals(weight)
    exact = float(singular.square().sum() / singular[0] ** 2)
    ranks = logger.series(scalar_tag("stable_rank", 0, "MLP_up"))
    assert set(ranks) == {0, 1} and ranks[0] == pytest.approx(exact, rel=1e-3)
    assert logger.series(scalar_tag("compression", 0, "MLP_up"))[0] == 0.0
