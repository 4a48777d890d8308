"""The logit scale read from the recorded first forward: SDPA's ``scale=``, a number multiplying
the logits before the softmax; the forward's scale wins over the module's attribute, and a bound
logged with it holds on the model's own logits at inputs searched to make them large (as
test_logit_bounds.py checks every kind)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from qk_logit_models import like_a_checkpoint, worst_inputs

from spectral_callbacks.monitor.tracker import SpectralTracker
from spectral_callbacks.names import parse_tag
from spectral_callbacks.targets.errors import PartialTargetWarning

D, HEADS, T = 32, 4, 16


class Attention(torch.nn.Module):
    """Biased q/k/v/o projections; the logits scaled by ``how``: SDPA's ``scale=``
    (``"sdpa"``) or a number multiplying ``q @ k^T`` (``"written"``); ``declared``: a
    ``scaling`` attribute (none where ``None``)."""

    def __init__(self, how: str, applied: float, declared: float | None = None) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(D, D) for _ in range(4)
        )
        self.num_heads = HEADS
        self.how, self.applied = how, applied
        if declared is not None:
            self.scaling = declared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T_, _ = x.shape
        q, k, v = (
            p(x).view(B, T_, HEADS, D // HEADS).transpose(1, 2)  # (B, H, T, d_h)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.how == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.applied)
        else:
            scores = (q @ k.transpose(-1, -2)) * self.applied  # (B, H, T, T)
            causal = torch.ones(T_, T_, dtype=torch.bool).tril()
            y = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T_, D))


class Block(torch.nn.Module):
    def __init__(self, attention: Attention) -> None:
        super().__init__()
        self.attn = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class Model(torch.nn.Module):
    def __init__(self, how: str, applied: float, declared: float | None = None) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, D)
        self.layers = torch.nn.ModuleList(
            [Block(Attention(how, applied, declared)) for _ in range(2)]
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return x


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


def logged_after_a_forward(
    model: torch.nn.Module, follow: bool | str = "auto"
) -> dict[str, dict[tuple[int, int], float]]:
    """metric -> (layer, head) -> what a tracker logs at step 0, the model's forward run once
    between the tracker's construction and its close (the first training forward)."""
    writer = Recorder()
    tracker = SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, figures=False,
        roles_from_first_forward=follow,
    )  # fmt: skip
    with torch.no_grad():
        model(torch.randint(0, 50, (1, T)))
    tracker.close()
    found: dict[str, dict[tuple[int, int], float]] = {}
    for tag, value in writer.logged[0].items():
        parsed = parse_tag(tag)
        if parsed is not None and parsed.head is not None:
            found.setdefault(parsed.metric, {})[(parsed.layer or 0, parsed.head)] = value
    return found


def augmented_sigma(attention: Attention, head: int) -> float:
    """sigma_1 of head ``head``'s bias-augmented circuit [W_Q b_Q]^T [W_K b_K], float64, formed."""
    rows = slice(head * (D // HEADS), (head + 1) * (D // HEADS))

    def augmented(linear: torch.nn.Linear) -> torch.Tensor:
        return torch.cat([linear.weight[rows], linear.bias[rows, None]], dim=1).double()

    product = augmented(attention.q_proj).T @ augmented(attention.k_proj)
    return float(torch.linalg.svdvals(product)[0])


@pytest.mark.parametrize("follow", ["auto", True])
@pytest.mark.parametrize(
    ("how", "applied"), [("sdpa", 0.3), ("sdpa", 0.9), ("written", 0.7)], ids=str
)
def test_a_scale_only_the_forward_shows_gives_a_bound_that_holds(
    how: str, applied: float, follow: bool | str
) -> None:
    torch.manual_seed(0)
    model = like_a_checkpoint(Model(how, applied), seed=0)  # no scale attribute anywhere
    logged = logged_after_a_forward(model, follow)
    heads = {(layer, h) for layer in range(2) for h in range(HEADS)}
    assert set(logged["qk_logit_bound"]) == heads
    for (layer, h), bound in logged["qk_logit_bound"].items():
        attention = model.layers[layer].attn
        assert bound == pytest.approx(applied * augmented_sigma(attention, h), rel=1e-5)
    measured = worst_inputs(model, seed=0)
    for (layer, h), bound in logged["qk_logit_bound"].items():
        assert measured[layer]["per_unit"][h].item() <= bound * (1 + 1e-5), (layer, h)


def test_a_scale_the_forward_contradicts_is_the_forwards_and_said() -> None:
    torch.manual_seed(1)
    model = like_a_checkpoint(Model("sdpa", 0.9, declared=0.125), seed=1)
    with pytest.warns(
        PartialTargetWarning,
        match=r"layers.0.attn declares 0.125 \(scaling\), its forward applies 0.9 "
        r"\(scaled_dot_product_attention\(scale=0.9\)\).*scaled by what the forward applies",
    ):
        logged = logged_after_a_forward(model)
    for (layer, h), bound in logged["qk_logit_bound"].items():
        attention = model.layers[layer].attn
        assert bound == pytest.approx(0.9 * augmented_sigma(attention, h), rel=1e-5)
    measured = worst_inputs(model, seed=1)
    assert all(
        measured[layer]["per_unit"][h].item() <= bound * (1 + 1e-5)
        for (layer, h), bound in logged["qk_logit_bound"].items()
    )


def test_without_a_forward_the_declared_scale_stands() -> None:
    model = Model("sdpa", 0.9, declared=0.125)
    writer = Recorder()
    SpectralTracker(model, writers=[writer], circuits=True, synchronous=True).close()
    bound = next(
        v for tag, v in writer.logged[0].items() if tag.endswith("qk_logit_bound/L00/H00/heads")
    )
    assert bound == pytest.approx(0.125 * augmented_sigma(model.layers[0].attn, 0), rel=1e-5)


class ScaledRMSNorm(torch.nn.Module):
    """A norm whose gain is neither its weight nor 1 + weight (twice its weight)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * F.rms_norm(x, (x.shape[-1],)) * self.weight


def test_a_qk_norm_whose_gain_is_not_read_is_named_in_a_warning() -> None:
    model = Model("sdpa", 0.3, declared=0.3)
    for block in model.layers:
        block.attn.q_norm, block.attn.k_norm = ScaledRMSNorm(D // HEADS), ScaledRMSNorm(D // HEADS)
    writer = Recorder()
    with pytest.warns(
        PartialTargetWarning,
        match=r"the QK-norm gains of layer 0 \(layers.0.attn\): its QK-norm \(ScaledRMSNorm\) "
        r"scales by neither its weight nor 1 \+ weight; layer 1 .*qk_norm_logit_bound is not",
    ):
        SpectralTracker(model, writers=[writer], circuits=True, synchronous=True).close()
    metrics = {parse_tag(tag).metric for tag in writer.logged[0] if "/heads" in tag}
    assert "qk_norm_logit_bound" not in metrics and "qk_logit_bound" not in metrics
