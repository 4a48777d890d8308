"""Training configurations on a CUDA device (``@pytest.mark.gpu``; ``make gpu-check`` runs this
file): bf16 autocast around a tiny GPT-2 whose biases are non-zero (a checkpoint's), the same
model trained through ``torch.compile`` of a wrapper around it (inductor), and with non-reentrant
activation checkpointing. Each is a plain loop: every scheduled step is logged, step 0 and the
last step equal a float64 SVD of the weights at that step, and no ``tracker.step`` makes the
training thread wait for the device (cuda_checks.SyncDetector; the first forward's reading, inside
the model's forward at step 0, is not checked: its waits are confined to step 0).

The CPU versions of these checks are tests/monitor/test_first_forward_safety.py and the
configuration matrix (tests/integrations/test_training_configurations.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from cuda_checks import SyncDetector
from cuda_target_cases import SCHEDULE, STEPS
from tiny_models import RecordingLogger

from spectral_callbacks import SpectralTracker
from spectral_callbacks.targets import find_targets

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")

VOCAB = 50
OPTIONS: dict[str, Any] = dict(
    metrics=["stable_rank"],
    every_n_steps=2,
    log_spaced_until=2,
    k=16,
    max_pending=16,
    figures=False,
    svd_method="randomized",
)


def biased_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    return model.cuda()


def float64_stable_ranks(model: torch.nn.Module) -> dict[str, float]:
    result = {}
    for target in find_targets(model):
        matrix = target.matrix().detach().double().cpu()
        value = (matrix**2).sum() / torch.linalg.svdvals(matrix)[0] ** 2
        result[f"spectral_stable_rank/L{target.layer:02d}/{target.role}"] = float(value)
    return result


@pytest.mark.parametrize("config", ["bf16-autocast", "compiled", "checkpointed"])
def test_a_training_configuration_logs_exact_values_without_a_wait(config: str) -> None:
    model = biased_gpt2()
    if config == "checkpointed":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    initial = float64_stable_ranks(copy.deepcopy(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = RecordingLogger()
    detector = SyncDetector()
    tokens = torch.randint(0, VOCAB, (STEPS, 4, 17), generator=torch.Generator().manual_seed(0))
    with detector.active():
        tracker = SpectralTracker(model, writers=[logger], **OPTIONS)
        trained = torch.compile(model) if config == "compiled" else model
        for step in range(1, STEPS + 1):
            x = tokens[step - 1].cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=config == "bf16-autocast"):
                loss = trained(x, labels=x).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with detector.checking(f"tracker.step at step {step}"):
                tracker.step(step)
        tracker.close()
    assert detector.found == []
    final = float64_stable_ranks(model)
    assert len(initial) == 12
    for tag in initial:
        logged = logger.series(tag)
        assert sorted(logged) == SCHEDULE, tag
        assert logged[0] == pytest.approx(initial[tag], rel=0.01), tag
        assert logged[STEPS] == pytest.approx(final[tag], rel=0.01), tag
