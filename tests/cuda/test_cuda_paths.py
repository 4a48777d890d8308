"""CUDA paths beside the training loop's: synchronous compute inside autocast, fp16 weights, TF32
set through the new API, a model whose layers sit on two GPUs (skipped with one) or partly on the
host (``@pytest.mark.gpu``). The Hugging Face Trainer's TF32 and bf16 are in tests/cuda/test_cuda_hf.py,
TF32 through the legacy API in tests/functional/test_svd.py."""

from __future__ import annotations

import pytest
import torch

from spectral_callbacks.monitor.engines.compute import ComputeFunction, SpectrumCompute
from spectral_callbacks.monitor.engines.engine import SnapshotEngine
from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
from spectral_callbacks.targets import Target

pytestmark = pytest.mark.gpu


def _stable_rank(weight: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(weight.double().cpu())
    return float((singular**2).sum() / singular[0] ** 2)


class StreamRecorder(ComputeFunction):
    """A compute function that records the stream each call actually ran on (the current stream
    of its batch's device at the call), before computing."""

    def __init__(self, compute: SpectrumCompute) -> None:
        self.compute = compute
        self.working_bytes, self.kept_bytes = compute.working_bytes, compute.kept_bytes
        self.ran: list[tuple[torch.device, torch.cuda.Stream]] = []

    def __call__(self, group: object, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        self.ran.append((batch.device, torch.cuda.current_stream(batch.device)))
        return self.compute(group, batch)


def _engine(weights: dict[str, torch.Tensor], **options: object) -> tuple[SnapshotEngine, list]:
    targets = [Target.from_parameter(name, w, role="Q") for name, w in weights.items()]
    groups = group_by_shape(targets)
    compute = StreamRecorder(SpectrumCompute(k=16, method="randomized"))
    return SnapshotEngine(compute, groups, MonitorOptions(**options)), groups  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_synchronous_inside_autocast_with_tf32_on_matches_float64(
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = {
        f"w{i}": (torch.randn(512, 384, device="cuda", generator=generator) / 20).to(dtype)
        for i in range(3)
    }
    engine, groups = _engine(weights, synchronous=True)
    previous = torch.backends.fp32_precision
    torch.backends.fp32_precision = "tf32"  # as transformers' TrainingArguments(tf32=True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            engine.submit(take_snapshot(groups, step=0))
        (result,) = engine.collect(wait_seconds=60)
    finally:
        torch.backends.fp32_precision = previous
        engine.close()
    for name, weight in weights.items():
        got = result.metrics[name]["stable_rank"]
        assert got == pytest.approx(_stable_rank(weight), rel=0.01), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_a_model_on_two_devices_is_computed_on_each_devices_stream() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = {
        f"w{i}": torch.randn(256, 192, generator=generator).to(f"cuda:{i % 2}") for i in range(4)
    }
    engine, groups = _engine(weights, max_pending=2)
    assert {group.device for group in groups} == {"cuda:0", "cuda:1"}
    engine.submit(take_snapshot(groups, step=0))
    (result,) = engine.collect(wait_seconds=60)
    engine.close()
    for name, weight in weights.items():
        got = result.metrics[name]["stable_rank"]
        assert got == pytest.approx(_stable_rank(weight), rel=0.01), name
    # Each group ran on a stream of its own device, never that device's default (training's).
    ran = engine.compute.ran
    assert {device.index for device, _ in ran} == {0, 1}
    for device, stream in ran:
        assert stream.device == device
        assert stream.cuda_stream != torch.cuda.default_stream(device).cuda_stream


def test_a_model_partly_on_the_cpu_is_computed_where_each_part_lives() -> None:
    # One GPU is enough: layers offloaded to the host are decomposed by the worker on the CPU,
    # the others on the device's compute stream, and one result holds them all.
    generator = torch.Generator().manual_seed(0)
    weights = {
        "w0": torch.randn(256, 192, generator=generator).cuda(),
        "w1": torch.randn(256, 192, generator=generator),
        "w2": torch.randn(128, 64, generator=generator).cuda(),
    }
    engine, groups = _engine(weights, max_pending=2)
    assert {group.device for group in groups} == {"cuda:0", "cpu"}
    snapshot = take_snapshot(groups, step=0)
    assert set(snapshot.copied) == {"cuda:0"}  # the host copy is complete already
    engine.submit(snapshot)
    (result,) = engine.collect(wait_seconds=60)
    engine.close()
    for name, weight in weights.items():
        got = result.metrics[name]["stable_rank"]
        assert got == pytest.approx(_stable_rank(weight), rel=0.01), name
