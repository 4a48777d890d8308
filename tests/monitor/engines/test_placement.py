"""Where a snapshot's CPU work runs: the decision from cores and threads, the cores read from the
affinity mask and the cgroup quota, and the tracker acting on it, saying it and recording it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.engines import placement
from spectral_callbacks.monitor.engines.placement import (
    available_cores,
    cgroup_quota,
    choose_placement,
)
from spectral_callbacks.monitor.options import ConfigurationError

INLINE_TAG = "spectral_monitor/inline"


def _choose(synchronous: bool | None = None, **machine: Any) -> placement.Placement:
    values = {"devices": ["cpu"], "cores": 2.0, "training_threads": 2, "worker_threads": 1}
    return choose_placement(synchronous, **{**values, **machine})


@pytest.mark.parametrize(
    ("machine", "inline"),
    [
        ({"cores": 2.0, "training_threads": 2}, True),  # training fills every core
        ({"cores": 8.0, "training_threads": 8}, True),
        ({"cores": 2.0, "training_threads": 1}, False),  # one core spare: the worker's
        ({"cores": 16.0, "training_threads": 8}, False),
        ({"cores": 2.5, "training_threads": 2}, True),  # half a core is no core to itself
        ({"cores": 3.0, "training_threads": 2, "worker_threads": 2}, True),  # needs 2, 1 spare
        ({"cores": 4.0, "training_threads": 2, "worker_threads": 2}, False),
        ({"cores": 3.0, "training_threads": 2, "worker_threads": None}, True),  # torch's count: 2
        ({"cores": 2.0, "training_threads": 2, "devices": ["cuda"]}, False),  # the side stream
        ({"cores": 2.0, "training_threads": 2, "devices": ["cpu", "cuda"]}, False),
    ],
)
def test_the_worker_runs_only_where_it_has_cores_to_itself(
    machine: dict[str, Any], inline: bool
) -> None:
    assert _choose(**machine).inline is inline


def test_synchronous_forces_either_placement_whatever_the_machine() -> None:
    assert _choose(True, cores=64.0, training_threads=1).inline is True
    assert _choose(False, cores=2.0, training_threads=2).inline is False
    assert _choose(False).reason == "synchronous=False"


def test_the_reason_counts_the_cores_and_threads() -> None:
    assert _choose(cores=1.5, training_threads=2).reason == (
        "1.5 cores for 2 training threads: none spare for the worker"
    )
    assert _choose(cores=4.0, training_threads=2).describe() == (
        "snapshots computed on a worker thread (4 cores for 2 training threads: 2 spare for the "
        "worker)"
    )


def _cgroup_v2(root: Path, quotas: dict[str, str]) -> Path:
    for path, value in quotas.items():
        folder = root / path
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(value + "\n")
    proc = root / "proc_cgroup"
    proc.write_text("0::/job/step\n")
    return proc


def test_a_v2_quota_is_the_smallest_along_the_cgroup_and_its_parents(tmp_path: Path) -> None:
    proc = _cgroup_v2(tmp_path, {"job/step": "150000 100000", "job": "max 100000"})
    assert cgroup_quota(tmp_path, proc) == 1.5
    proc = _cgroup_v2(tmp_path, {"job/step": "max 100000", "job": "100000 100000"})
    assert cgroup_quota(tmp_path, proc) == 1.0
    proc = _cgroup_v2(tmp_path, {"job/step": "max 100000", "job": "max 100000"})
    assert cgroup_quota(tmp_path, proc) is None


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    folder = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("300000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    assert cgroup_quota(tmp_path, proc) == 3.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_quota(tmp_path, proc) is None


def test_no_cgroup_file_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path, tmp_path / "missing") is None
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_quota(tmp_path, proc) is None


def test_the_cores_are_the_affinity_mask_capped_by_the_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    proc = _cgroup_v2(tmp_path, {"job/step": "250000 100000"})
    assert available_cores(tmp_path, proc) == 2.5
    proc = _cgroup_v2(tmp_path, {"job/step": "800000 100000"})
    assert available_cores(tmp_path, proc) == 4.0


def test_local_processes_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "available_cores", lambda: 8.0)
    monkeypatch.setattr(placement.torch, "get_num_threads", lambda: 2)
    assert placement.machine_placement(None, ["cpu"], 1).inline is False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes x 2 threads on 8 cores
    assert placement.machine_placement(None, ["cpu"], 1).inline is True


class Scalars:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


@pytest.mark.parametrize(("cores", "inline"), [(1.0, True), (64.0, False)])
def test_the_tracker_places_from_the_machine_says_it_and_records_it(
    cores: float, inline: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(placement, "available_cores", lambda: cores)
    monkeypatch.setattr(placement.torch, "get_num_threads", lambda: 1)
    writer = Scalars()
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with caplog.at_level(logging.INFO, logger="spectral_callbacks"):
        tracker = SpectralTracker(
            model, metrics=["stable_rank"], figures=False, writers=[writer], start_step=None
        )
        tracker.begin(0)
    try:
        assert tracker.placement is not None and tracker.placement.inline is inline
        assert tracker._engine.synchronous is inline  # type: ignore[union-attr]
        assert writer.logged[0][INLINE_TAG] == float(inline)
        said = [r.getMessage() for r in caplog.records if "snapshots computed" in r.getMessage()]
        where = "inline at their step" if inline else "on a worker thread"
        assert said == [f"SpectralTracker: snapshots computed {where} ({tracker.placement.reason})"]
        for step in (1, 2):
            tracker.step(step)
    finally:
        tracker.close()
    assert writer.logged[2]["spectral_monitor/skipped"] == 0


def test_synchronous_false_keeps_the_worker_where_no_core_is_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement, "available_cores", lambda: 1.0)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with SpectralTracker(
        model, writers=[Scalars()], metrics=["stable_rank"], figures=False, synchronous=False
    ) as tracker:
        assert tracker.placement is not None and tracker.placement.inline is False


def test_synchronous_must_be_none_or_a_bool() -> None:
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with pytest.raises(ConfigurationError, match=r"`synchronous` must be None .*got 'yes'"):
        SpectralTracker(model, synchronous="yes")
