"""The worker's life: it cannot crash the process at exit, a dead worker is an error on the main
thread, its thread count stays its own, and a failed snapshot's traceback frees the batch."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from spectral_callbacks.monitor.engines.engine import SnapshotEngine, SpectralComputeError
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import ShapeGroup, group_by_shape, take_snapshot
from spectral_callbacks.targets import Target

ROOT = Path(__file__).resolve().parents[3]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


# The interpreter exits while the worker is inside a LAPACK call (a 2000 x 2000 svdvals, ~2 s on
# one thread): before background.py a 1500 x 1500 one aborted ("terminate called without an active
# exception", 134) or segfaulted (139) in 3 runs of 3. The wait is announced at once here (no 1 s
# grace), so the message does not depend on how fast this machine runs the SVD.
INSIDE_LAPACK_AT_EXIT = """
    import time, warnings
    from spectral_callbacks.targets import Target
    import torch
    from spectral_callbacks.monitor import background
    from spectral_callbacks.monitor.engines.engine import SnapshotEngine
    from spectral_callbacks.monitor.options import MonitorOptions
    from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    warnings.filterwarnings("ignore")
    background.ANNOUNCE_AFTER_SECONDS = 0.0
    w = torch.randn(2000, 2000)
    groups = group_by_shape([Target.from_parameter("w", w, role="Q")])
    engine = SnapshotEngine(
        lambda g, b: {"s": torch.linalg.svdvals(b)[..., 0]}, groups, MonitorOptions()
    )
    engine.submit(take_snapshot(groups, 0))
    time.sleep(0.3)
    engine.close(timeout=0)
    raise SystemExit(STATUS)
"""


@pytest.mark.parametrize("status", [0, 0, 3])
def test_exit_while_the_worker_is_inside_lapack_keeps_the_programs_status(status: int) -> None:
    done = _python(INSIDE_LAPACK_AT_EXIT.replace("STATUS", str(status)))
    assert done.returncode == status, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    assert "waiting for the SpectralMonitor-worker thread" in done.stderr  # said, not silent


def test_a_fit_with_no_drain_time_exits_zero() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from exit_status import run_child

    status, last_line = run_child(width=256, layers=2, steps=3, drain=0.0)
    assert status == 0, last_line


def test_a_worker_that_cannot_start_is_an_error_at_the_next_collect() -> None:
    weights = {"w": torch.randn(4, 4)}
    groups = group_by_shape([Target.from_parameter("w", weights["w"], role="Q")])
    # worker_threads=0 makes the worker's start fail (torch.set_num_threads(0) raises);
    # MonitorOptions refuses it, so it is set past the check.
    options = MonitorOptions()
    object.__setattr__(options, "worker_threads", 0)
    engine = SnapshotEngine(lambda g, b: {"x": torch.zeros(1)}, groups, options)
    engine.submit(take_snapshot(groups, step=0))
    deadline = time.monotonic() + 30
    with pytest.raises(
        SpectralComputeError, match=r"worker thread could not start.*`worker_threads` \(0\)"
    ):
        while time.monotonic() < deadline:
            engine.collect(wait_seconds=0.05)
    engine.close()


def test_the_worker_thread_count_does_not_change_other_threads() -> None:
    # torch.set_num_threads also sets the default of threads that have not run a parallel op yet:
    # the main thread here, before the fix, then ran with the worker's 1 thread.
    done = _python(
        """
        import threading, torch
        from spectral_callbacks.targets import Target
        from spectral_callbacks.monitor.engines.engine import SnapshotEngine
        from spectral_callbacks.monitor.options import MonitorOptions
        from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
        torch.set_num_threads(2)
        seen = []
        def compute(group, batch):
            seen.append(torch.get_num_threads())
            return {"x": batch.sum((-2, -1))}
        w = torch.ones(3, 3)
        groups = group_by_shape([Target.from_parameter("w", w, role="Q")])
        engine = SnapshotEngine(compute, groups, MonitorOptions(worker_threads=1))
        engine.submit(take_snapshot(groups, 0))
        assert len(engine.collect(wait_seconds=30)) == 1
        engine.close()
        fresh = []
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start(); thread.join()
        print(seen[0], fresh[0], torch.get_num_threads())
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "2", "2"]


def test_the_sharded_worker_limits_only_its_own_threads_and_is_waited_for_at_exit(
    tmp_path: Path,
) -> None:
    # The sharded engine's worker once called torch.set_num_threads itself (a fresh thread then
    # started with 1) and was a plain thread that exit did not wait for.
    done = _python(
        f"""
        import threading, torch, torch.distributed as dist
        from spectral_callbacks.monitor import background
        from spectral_callbacks.monitor.engines.sharded import (
            SHARDED_WORKER_THREAD_NAME, ShardedEngine, svd_group)
        from spectral_callbacks.monitor.engines.compute import SpectrumCompute
        from spectral_callbacks.monitor.options import MonitorOptions
        from spectral_callbacks.targets import Target
        torch.set_num_threads(2)
        dist.init_process_group(
            "gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        targets = [Target.from_parameter("w", torch.eye(4), role="O")]
        engine = ShardedEngine(
            targets, SpectrumCompute(k=2), MonitorOptions(max_pending=4, worker_threads=1),
            group=svd_group(timeout_seconds=30))
        engine.offer(3)
        waited = [thread.name for thread in background.waited_for()]
        assert len(engine.collect(wait_seconds=30)) == 1
        fresh = []
        thread = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        thread.start(); thread.join()
        engine.close()
        dist.destroy_process_group()
        print(SHARDED_WORKER_THREAD_NAME in waited, fresh[0], torch.get_num_threads())
        """
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "2", "2"]


def test_a_failed_snapshot_does_not_keep_its_batch_alive() -> None:
    seen: list[weakref.ref] = []

    def fails(group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(weakref.ref(batch))
        raise ValueError("boom")

    weight = torch.randn(8, 8)
    groups = group_by_shape([Target.from_parameter("w", weight, role="Q")])
    engine = SnapshotEngine(fails, groups, MonitorOptions())
    engine.submit(take_snapshot(groups, step=0))
    deadline = time.monotonic() + 30
    with pytest.raises(SpectralComputeError, match="boom") as caught:
        while time.monotonic() < deadline:
            engine.collect(wait_seconds=0.05)
    gc.collect()
    assert seen and seen[0]() is None  # the error (still held here) pins no snapshot memory
    assert isinstance(caught.value.__cause__, ValueError)  # the cause is kept, its locals are not
    engine.close()


# A plain loop's tracker whose final figures are still being written when the program ends.
FIGURES_AT_EXIT = """
    import torch
    from spectral_callbacks import SpectralTracker
    from spectral_callbacks.monitor import background
    background.ANNOUNCE_AFTER_SECONDS = 0.0
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with SpectralTracker(model, logdir=LOGDIR, k=4, figure_every_n_steps=None) as tracker:
        tracker.step(1)
"""


def test_the_exit_wait_names_the_class_the_user_wrote(tmp_path: Path) -> None:
    # before: "SpectralMonitor at exit: ..." after a SpectralTracker or SpectralTrainerCallback run
    done = _python(FIGURES_AT_EXIT.replace("LOGDIR", repr(str(tmp_path))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SpectralTracker at exit: waiting for the SpectralMonitor-final-figures thread" in (
        done.stderr
    )
    assert "SpectralMonitor at exit" not in done.stderr


def test_only_a_thread_still_working_at_exit_is_announced(capsys: pytest.CaptureFixture) -> None:
    from spectral_callbacks.monitor import background

    release = threading.Event()
    with background.owned_by("SpectralTrainerCallback"):
        working = background.start_daemon(release.wait, "held", stop=lambda: "1 snapshot")
        finished = background.start_daemon(lambda: None, "done")
    finished.join()
    threading.Timer(0.2, release.set).start()
    assert background.stop_all(announce_after=0.05) == ["held: 1 snapshot"]
    assert not working.is_alive()
    assert capsys.readouterr().err.splitlines() == [
        "SpectralTrainerCallback at exit: abandoned held: 1 snapshot",
        f"SpectralTrainerCallback at exit: waiting for the held thread {background.WAITING_FOR}",
    ]
