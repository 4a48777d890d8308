"""FP8 training layers (torchao's ``Float8Linear``: a float32 master weight, an FP8 product): the
master weight is the matrix watched, and the first-forward check reads the FP8 product with a
tolerance of its own (e4m3 keeps 3 mantissa bits), still refusing a layer that computes another
matrix. The model stands for a checkpoint: a tiny Llama with non-zero biases, converted by
``convert_to_float8_training`` as an FP8 run is; torchao runs its FP8 product on the CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
float8 = pytest.importorskip("torchao.float8")
from hf_models import tiny_llama  # noqa: E402
from tiny_models import RecordingLogger, assert_logged_exactly, exact_spectrum  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402

ROLES = {"Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down"}


def float8_llama() -> Any:
    """A 2-layer Llama (width 64, non-zero biases) whose projections are ``Float8Linear``."""
    torch.manual_seed(0)
    model = tiny_llama(width=64, bias=True)
    float8.convert_to_float8_training(model.model)  # the blocks; the output head stays
    return model


def test_float8_projections_are_watched_as_their_master_weights() -> None:
    model = float8_llama()
    layers = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(layers) == 14
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(model)
    assert [str(w.message) for w in caught if "not watched" in str(w.message)] == []
    assert {t.role for t in targets} == ROLES and len(targets) == 14
    for target in targets:
        owner = model.get_submodule(target.parameter_name.rpartition(".")[0])
        assert isinstance(owner, Float8Linear)
        assert target.parameter is owner.weight  # the master weight itself, float32
        assert torch.equal(target.matrix(), owner.weight.detach())


def test_a_float8_layer_computing_another_matrix_is_still_refused() -> None:
    model = float8_llama()
    attention = model.model.layers[0].self_attn
    scaled = attention.q_proj

    class Doubled(type(scaled)):  # type: ignore[misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    scaled.__class__ = Doubled
    with pytest.warns(UserWarning) as caught:
        targets = find_targets(model)
    lines = [line for w in caught for line in str(w.message).splitlines()]
    refused = [line for line in lines if "layers.0.self_attn.q_proj.weight" in line]
    assert len(refused) == 1 and "its forward is not x W^T + b for this weight" in refused[0]
    assert (0, "Q") not in {(t.layer, t.role) for t in targets}


def test_an_fp8_fit_logs_the_spectrum_of_the_master_weights() -> None:
    model = float8_llama()
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracker's notes on the CPU placement
        tracker = SpectralTracker(
            model, writers=[logger], every_n_steps=1, log_spaced_until=0, figures=False,
            synchronous=True,
        )  # fmt: skip
    targets = tracker.targets
    assert {t.role for t in targets} == ROLES and len(targets) == 14

    def exact() -> dict[str, tuple[float, float]]:
        return {t.name: exact_spectrum(t.parameter.detach()) for t in targets}

    expected = {0: exact()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = torch.randint(0, 64, (3, 2, 16), generator=torch.Generator().manual_seed(0))
    for step, batch in enumerate(batches, start=1):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = exact()
        tracker.step(step)
    tracker.close(3)
    assert sorted(expected) == [0, 1, 2, 3]
    assert_logged_exactly(logger, targets, expected, 2)
    assert expected[3] != expected[0]  # the weights trained
