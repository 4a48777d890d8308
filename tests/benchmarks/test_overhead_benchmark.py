"""benchmarks/overhead.py at toy size: the worker's CPU seconds and the table (nothing is timed)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overhead  # noqa: E402

from spectral_callbacks.monitor.engines.engine import WORKER_THREAD_NAME  # noqa: E402

TOY = ["--layers", "1", "--width", "32", "--block", "8", "--batch", "2", "--steps", "30"]


def _toy_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overhead.add_model_arguments(parser)
    return parser.parse_args(TOY)


def test_the_worker_cpu_is_the_worker_threads_own(tmp_path: Path) -> None:
    default = overhead.run_once("worker", _toy_args(), str(tmp_path))
    # The default schedule: 0, 1, 2, 4, 8, 16, 25 and the last, 30; on a loaded machine a snapshot
    # due while two are still pending is skipped (and counted), not queued.
    assert default["snapshots"] + default["skipped"] == 8 and default["snapshots"] >= 1
    assert 0 < default["worker_cpu"] < default["cpu"]  # a part of the process's CPU seconds
    inline = overhead.run_once("inline", _toy_args(), str(tmp_path))
    assert inline["snapshots"] == 8 and inline["worker_cpu"] == 0  # no worker thread
    assert (default["inline"], inline["inline"]) == (0.0, 1.0)


def test_the_loop_timer_reads_the_worker_threads_own_clock() -> None:
    burn, go, burned, release = 0.3, threading.Event(), [], threading.Event()

    def worker() -> None:  # spends a known number of CPU seconds, then stays alive, idle
        go.wait()
        start = time.thread_time()
        while time.thread_time() - start < burn:
            pass
        burned.append(time.thread_time() - start)
        release.wait()

    thread = threading.Thread(target=worker, name=WORKER_THREAD_NAME, daemon=True)
    thread.start()
    try:
        timer = overhead.LoopTimer()
        timer.on_train_batch_start(None)  # type: ignore[arg-type]
        go.set()
        while not burned:  # the main thread sleeps: its own clock barely moves
            time.sleep(0.01)
        timer.on_train_end(None)  # type: ignore[arg-type]
    finally:
        release.set()
        thread.join()
    assert timer.worker_cpu == pytest.approx(burned[0], abs=0.05)


def test_the_table_gives_each_variant_its_worker_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    overhead.main([*TOY, "--rounds", "1", "--variants", "worker,inline"])
    out = capsys.readouterr().out
    rows = {
        row.split("|")[1].strip(): row.split("|")[-3].strip()
        for row in out.splitlines()
        if row.startswith("| ") and "variant" not in row
    }
    assert rows["none"] == rows["inline"] == "0.00"
    assert float(rows["worker"]) > 0
    assert "worker: each worker CPU second cost training" in out
    assert "inline: each worker CPU second" not in out


def _placed(out: str) -> dict[str, str]:
    return {
        row.split("|")[1].strip(): row.split("|")[2].strip()
        for row in out.splitlines()
        if row.startswith("| ") and "variant" not in row
    }


@pytest.mark.parametrize(("cores", "placed"), [(1.0, "inline"), (64.0, "worker")])
def test_the_default_variant_is_placed_from_the_machine(
    cores: float, placed: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from spectral_callbacks.monitor.engines import placement

    monkeypatch.setattr(placement, "available_cores", lambda: cores)
    overhead.main([*TOY, "--rounds", "1", "--variants", "default,inline-no-figures"])
    assert _placed(capsys.readouterr().out) == {
        "none": "-",
        "default": placed,
        "inline-no-figures": "inline",
    }


def test_train_threads_sets_trainings_threads(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        overhead.main([*TOY, "--rounds", "1", "--variants", "inline", "--train-threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "CPU, training on 1 threads of" in capsys.readouterr().out
