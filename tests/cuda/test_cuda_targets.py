"""Every target kind on a CUDA device (``@pytest.mark.gpu``): a PEFT Llama with two active LoRA
adapters, with DoRA, with LoHa; a tiny Qwen3-MoE; ``delta="first"``; the ESD family; TF32 on.
Each fit runs every monitor hook inside the sync detector (no wait of the training thread but the
first forward's reading at step 0, cuda_checks.after_the_reading) and
checks every logged value against a float64 SVD of the weights at its step
(tests/cuda_target_cases.py; ``make gpu-check`` runs this file).
"""

from __future__ import annotations

import math

import pytest
from cuda_checks import after_the_reading
from cuda_target_cases import KINDS, SCHEDULE, compared, run

pytestmark = pytest.mark.gpu

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _check(rows: list, rel: float = 0.01, absolute: float = 0.0) -> None:
    assert rows, "nothing compared"
    for step, key, logged, expected in rows:
        if math.isnan(expected):  # a zero update (no step taken yet): NaN, never a made-up value
            assert math.isnan(logged), (step, key)
        else:
            assert logged == pytest.approx(expected, rel=rel, abs=absolute), (step, key)


@pytest.mark.parametrize("kind", KINDS)
def test_each_target_kind_matches_float64_without_a_wait_of_the_training_thread(
    kind: str, restored_fp32_precision: None
) -> None:
    outcome = run(kind, accelerator="gpu")
    assert outcome["on_device"]
    assert after_the_reading(outcome["syncs"]) == []
    rows = compared(outcome, "stable_rank", outcome["weights"])
    assert sorted({step for step, *_ in rows}) == SCHEDULE
    _check(rows)
    if kind in ("lora-two-adapters", "dora", "loha"):
        _check(compared(outcome, "update_stable_rank", outcome["updates"]))
    if kind == "delta-first":
        first = outcome["weights"][0]
        updates = {
            step: {key: weights[key] - first[key] for key in first}
            for step, weights in outcome["weights"].items()
        }
        _check(compared(outcome, "update_stable_rank", updates))
    if kind == "esd":
        _check(compared(outcome, "esd_alpha", outcome["weights"]), rel=0, absolute=0.02)
