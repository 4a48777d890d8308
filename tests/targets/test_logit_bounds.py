"""Every QK value logged as a bound on a head's attention logit holds on the model's own logits.

Fresh random tiny models of each kind (tests/qk_logit_models.py: plain, biased, unscaled,
layer-scaled, RoPE, GQA, QK-norm, MLA, the scales Gemma 2 and Granite declare), their biases and
norm gains moved off their initial values as a checkpoint's are. The logits are read from each
model's own forward (the softmax's input, or SDPA's q, k and scale) at inputs ``x`` (what the
query and key projections read) searched to make them as large as they get: random inputs stay
far below every bound, so a wrong one (the scale assumed 1/sqrt(d_h), the distance-0 circuit
under RoPE) would pass on them.
"""

from __future__ import annotations

import pytest
import torch
from qk_logit_models import KINDS, like_a_checkpoint, worst_inputs

from spectral_callbacks.monitor.tracker import SpectralTracker


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def logged_per_head(model: torch.nn.Module, metric: str) -> dict[tuple[int, int], float]:
    """(layer, head) -> the value of ``metric`` a tracker logs at step 0."""
    from spectral_callbacks.names import parse_tag

    writer = Recorder()
    SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, figures=False, start_step=0
    ).close()
    found = {}
    for tag, value in writer.logged[0].items():
        parsed = parse_tag(tag)
        if parsed is not None and parsed.head is not None and parsed.metric == metric:
            found[(parsed.layer, parsed.head)] = value
    return found


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", list(KINDS))
def test_what_is_logged_as_a_bound_holds_on_the_measured_logits(kind: str, seed: int) -> None:
    build, logged_as = KINDS[kind]
    torch.manual_seed(seed)
    model = like_a_checkpoint(build(), seed)
    layers = worst_inputs(model, seed, per_unit=logged_as != "qk_norm")
    bounds = logged_per_head(model, "qk_logit_bound")
    norm_bounds = logged_per_head(model, "qk_norm_logit_bound")
    heads = {(layer, h) for layer, found in enumerate(layers) for h in range(len(found["largest"]))}
    if logged_as == "bound":
        assert set(bounds) == heads and not norm_bounds
        for (layer, h), bound in bounds.items():
            assert layers[layer]["per_unit"][h].item() <= bound * (1 + 1e-5), (layer, h)
    elif logged_as == "qk_norm":  # no bound per unit input norms exists; the gains' one does
        assert not bounds and set(norm_bounds) == heads
        for (layer, h), bound in norm_bounds.items():
            assert layers[layer]["largest"][h].item() <= bound * (1 + 1e-5), (layer, h)
    else:
        assert not bounds and not norm_bounds
    assert set(logged_per_head(model, "qk_spectral_norm")) == heads
