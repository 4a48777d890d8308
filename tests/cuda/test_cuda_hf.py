"""The Hugging Face Trainer on a CUDA device with ``TrainingArguments(tf32=True, bf16=True)``
(``@pytest.mark.gpu``).

``tf32=True`` turns TF32 on through torch's new precision API where it exists (transformers'
``enable_tf32``: ``torch.backends.fp32_precision = "tf32"``), after which torch's legacy reads
raise; ``bf16=True`` trains under bf16 autocast. Every logged stable rank must still be that of
a float64 SVD of the weights at its step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_train import tiny_gpt2, train
from tiny_models import exact_stable_rank, read_scalars

from spectral_callbacks.functional import precision
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import find_targets

pytestmark = pytest.mark.gpu

SCHEDULED = [0, 1, 2, 10, 20]  # hf_train.OPTIONS over 20 steps


@pytest.mark.parametrize("synchronous", [None, True], ids=["default", "synchronous"])
def test_the_trainer_with_tf32_and_bf16_logs_exact_values(
    synchronous: bool | None, tmp_path: Path, restored_fp32_precision: None
) -> None:
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    recorder = train(
        tmp_path,
        steps=20,
        arguments=dict(use_cpu=False, tf32=True, bf16=True),
        figures=False,
        synchronous=synchronous,
    )
    assert precision.tf32_enabled()  # the Trainer's setting was in force
    runs = {path.parent for path in tmp_path.rglob("events.out.tfevents.*")}
    logged: dict[str, dict[int, float]] = {}
    for run in runs:
        logged.update(read_scalars(run))
    targets = find_targets(tiny_gpt2())
    for target in targets:
        series = logged[scalar_tag("stable_rank", target.layer, target.role)]
        assert sorted(series) == SCHEDULED, target.name
        for step in SCHEDULED:
            weight = recorder.weights[step][target.name]
            assert weight.is_cuda  # the snapshots were of CUDA weights
            exact = exact_stable_rank(weight)
            assert series[step] == pytest.approx(exact, rel=0.01), (target.name, step)


def test_the_trainer_with_tf32_runs_the_randomized_svd_and_logs_exact_values(
    tmp_path: Path, restored_fp32_precision: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model wide enough (n_embd 512: 512 x 1536 .. 2048 x 512) that the defaults take the
    # randomized path (block Krylov on W or its Gram matrix, with the TF32 split products), not
    # the exact svdvals a 32-wide model gets: counted where the randomized SVD iterates.
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate")
    import spectral_callbacks.functional.svd as svd_module

    iterations: list[tuple[int, ...]] = []
    randomized = svd_module._randomized

    def counting(A, *args, **kwargs):  # type: ignore[no-untyped-def]
        iterations.append(tuple(A.shape))
        return randomized(A, *args, **kwargs)

    monkeypatch.setattr(svd_module, "_randomized", counting)
    recorder = train(
        tmp_path, steps=20, arguments=dict(use_cpu=False, tf32=True), figures=False, width=512
    )
    assert precision.tf32_enabled()
    assert iterations, "no matrix took the randomized path"
    runs = {path.parent for path in tmp_path.rglob("events.out.tfevents.*")}
    logged: dict[str, dict[int, float]] = {}
    for run in runs:
        logged.update(read_scalars(run))
    for target in find_targets(tiny_gpt2(512)):
        series = logged[scalar_tag("stable_rank", target.layer, target.role)]
        assert sorted(series) == SCHEDULED, target.name
        for step in SCHEDULED:
            weight = recorder.weights[step][target.name]
            exact = exact_stable_rank(weight)
            assert series[step] == pytest.approx(exact, rel=0.01), (target.name, step)
