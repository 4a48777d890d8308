"""A mixture of experts whose experts run through a grouped GEMM (``torch._grouped_mm`` inside a
custom ``autograd.Function``, as a fused kernel would be: the recorded forward sees no expert
product). The expert weights are 3-D parameters stored as the kernel reads them, ``x @ w[e]``:
``w1``/``w3`` of shape (E, d, f), ``w2`` (E, f, d). The router (a Linear d -> E) says d, so
each slice is read as the (out, in) matrix the kernel applies; the gate/up/down roles come
from the names, a plain ``w1``/``w2`` MLP's ``w1`` is its up; tensors no name places are
refused in one line that gives the ``mapping=`` which places them.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from research_models import LanguageModel, LucidAttention, biased, tokens
from tiny_models import RecordingLogger
from torch import nn

from spectral_callbacks import SpectralTracker
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import (
    Split,
    TargetWarning,
    UnwatchedExpertWarning,
    find_targets,
)

E, D, F_HIDDEN = 4, 16, 24


class GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm(x, w, offs)``: rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``,
    computed where the recording cannot look; the backward by the same grouped products."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        with torch._C.DisableTorchFunction():
            return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, offs = ctx.saved_tensors
        grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
        grad_w = torch.zeros_like(w)
        starts = [0, *offs.tolist()[:-1]]
        for expert, (start, stop) in enumerate(zip(starts, offs.tolist(), strict=True)):
            grad_w[expert] = x[start:stop].T @ grad[start:stop]
        return grad_x, grad_w, None


class GroupedExperts(nn.Module):
    """E experts as 3-D parameters in the kernel's layout: ``names`` of (up-side..., down)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names
        generator = torch.Generator().manual_seed(len(names))
        for name in names[:-1]:
            self.register_parameter(name, nn.Parameter(_init(E, D, F_HIDDEN, generator)))
        self.register_parameter(names[-1], nn.Parameter(_init(E, F_HIDDEN, D, generator)))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        weights = [getattr(self, name) for name in self.names]
        if len(weights) == 3:  # w2(silu(w1 x) * w3 x)
            hidden = F.silu(GroupedMM.apply(x, weights[0], offs)) * GroupedMM.apply(
                x, weights[1], offs
            )
        else:  # w2(gelu(w1 x))
            hidden = F.gelu(GroupedMM.apply(x, weights[0], offs))
        return GroupedMM.apply(hidden, weights[-1], offs)


def _init(experts: int, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(experts, rows, cols, generator=generator) * rows**-0.5


class GroupedMoE(nn.Module):
    """Top-1 routing: tokens sorted by expert, the experts' grouped products, scaled by the
    router's probability."""

    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E)
        self.experts = GroupedExperts(names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)  # (N, d)
        probability, choice = self.gate(flat).softmax(dim=-1).max(dim=-1)
        order = choice.argsort(stable=True)
        offs = torch.bincount(choice, minlength=E).cumsum(0).to(torch.int32)
        out = torch.empty_like(flat)
        out[order] = self.experts(flat[order], offs)
        return (out * probability[:, None]).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, names: tuple[str, ...]) -> None:
        super().__init__()
        self.attn = LucidAttention(D, heads=2, dim_head=8, core="sdpa", names=("to_qkv", "to_out"))
        self.norm = nn.LayerNorm(D)
        self.moe = GroupedMoE(names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x) + x
        return self.moe(self.norm(x)) + x


class MoELM(LanguageModel):
    def __init__(self, names: tuple[str, ...] = ("w1", "w3", "w2"), depth: int = 2) -> None:
        super().__init__(D)
        self.blocks = nn.ModuleList(Block(names) for _ in range(depth))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


GATED = {"w1": "MLP_gate", "w3": "MLP_up", "w2": "MLP_down"}
PLAIN = {"w1": "MLP_up", "w2": "MLP_down"}


def _quiet_find(model: nn.Module, **kwargs: Any):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)
        return find_targets(model, **kwargs)


def _expert_outputs(moe: GroupedMoE, x: torch.Tensor, by_role: dict[str, torch.Tensor]):
    """What each expert computes for ``x`` from the found matrices alone, (E, N, d)."""
    if "MLP_gate" in by_role:
        hidden = F.silu(x @ by_role["MLP_gate"].mT) * (x @ by_role["MLP_up"].mT)
    else:
        hidden = F.gelu(x @ by_role["MLP_up"].mT)
    return hidden @ by_role["MLP_down"].mT


def _assert_experts_reproduce_the_kernel(model: MoELM, targets) -> None:
    """Each block's MoE output equals the router's probability times the output of the chosen
    expert built from the found matrices (each expert's gate, up and down as the kernel uses)."""
    for layer, block in enumerate(model.blocks):
        found = [t for t in targets if t.layer == layer and t.expert is not None]
        by_role = {
            role: torch.stack(
                [t.matrix() for t in sorted(found, key=lambda t: t.expert) if t.role == role]
            )
            for role in {t.role for t in found}
        }
        assert all(matrices.shape[0] == E for matrices in by_role.values())
        x = torch.randn(40, D, generator=torch.Generator().manual_seed(layer))
        with torch.no_grad():
            out = block.moe(x)
            probability, choice = block.moe.gate(x).softmax(-1).max(-1)
            each = _expert_outputs(block.moe, x, by_role)  # (E, N, d)
        expected = each[choice, torch.arange(len(x))] * probability[:, None]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("names", [GATED, PLAIN], ids=["w1-w3-w2", "w1-w2"])
def test_grouped_gemm_experts_are_read_from_the_router_and_their_shapes(names) -> None:
    layout = tuple(name for name in ("w1", "w3", "w2") if name in names)
    model = biased(MoELM(layout))
    targets = _quiet_find(model)
    for layer in (0, 1):
        roles = sorted((t.role, t.expert, t.shape) for t in targets if t.layer == layer)
        expected = [(role, e, (F_HIDDEN, D)) for role in ("MLP_gate", "MLP_up") for e in range(E)]
        expected = [r for r in expected if r[0] in names.values()]
        expected += [("MLP_down", e, (D, F_HIDDEN)) for e in range(E)]
        expected += [(role, None, shape) for role, shape in _ATTENTION]
        assert roles == sorted(expected), layer
    # Each slice as the kernel reads it, x @ w[e]: the (out, in) matrix is w[e] transposed,
    # a view of the live parameter.
    for t in targets:
        if t.expert is not None:
            stored = model.get_parameter(t.parameter_name)[t.expert]
            assert t.matrix().data_ptr() == stored.data_ptr()
            assert torch.equal(t.matrix(), stored.T)
            assert names[t.parameter_name.rpartition(".")[2]] == t.role
    _assert_experts_reproduce_the_kernel(model, targets)


_ATTENTION = [
    ("Q", (8 * 2, D)),
    ("K", (8 * 2, D)),
    ("V", (8 * 2, D)),
    ("O", (D, 8 * 2)),
    ("Router", (E, D)),
]


def test_a_fit_logs_each_experts_matrices_exactly() -> None:
    model = biased(MoELM())
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracker's notes on the CPU placement
        tracker = SpectralTracker(
            model, writers=[logger], every_n_steps=1, log_spaced_until=0, figures=False,
            synchronous=True, experts="each",
        )  # fmt: skip
    targets = tracker.targets
    experts = [t for t in targets if t.expert is not None]
    assert len(experts) == 2 * 3 * E

    def exact() -> dict[str, tuple[float, float]]:
        result = {}
        for t in experts:
            singular = torch.linalg.svdvals(t.matrix().double())
            result[t.name] = (float((singular**2).sum() / singular[0] ** 2), float(singular[0]))
        return result

    expected = {0: exact()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, batch in enumerate(tokens(batch=6, seed=1).split(2), start=1):
        model.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = exact()
        tracker.step(step)
    tracker.close(3)
    assert expected[3] != expected[0]  # the experts trained
    for t in experts:
        where = dict(stack=t.stack, expert=t.expert)
        stable = logger.series(scalar_tag("stable_rank", t.layer, t.role, 2, **where))
        sigma = logger.series(scalar_tag("spectral_norm", t.layer, t.role, 2, **where))
        assert sorted(stable) == sorted(sigma) == [0, 1, 2, 3], t.name
        for step in stable:
            assert stable[step] == pytest.approx(expected[step][t.name][0], rel=1e-5), t.name
            assert sigma[step] == pytest.approx(expected[step][t.name][1], rel=1e-5), t.name


def test_experts_no_name_places_are_refused_with_the_mapping_that_places_them() -> None:
    model = biased(MoELM(("in_a", "in_b", "out")))
    with pytest.warns(UnwatchedExpertWarning) as caught:
        targets = find_targets(model)
    assert not any(t.expert is not None for t in targets)
    (message,) = [str(w.message) for w in caught if w.category is UnwatchedExpertWarning]
    line = next(line for line in message.splitlines() if "blocks.0.moe.experts.in_a" in line)
    assert line == (
        "  blocks.0.moe.experts.in_a (4, 16, 24): 3-D MoE experts tensor whose role no rule "
        "knows (the router maps d=16 to 4 experts); give it with mapping={'*.experts.in_a': "
        "Split(('MLP_up',), transposed=True)} if each (16, 24) slice feeds the hidden layer "
        "(x @ w[e]), else 'MLP_down'"
    )
    out = next(line for line in message.splitlines() if "blocks.0.moe.experts.out" in line)
    assert "mapping={'*.experts.out': 'MLP_up'} if each (24, 16) slice" in out
    assert out.endswith("else Split(('MLP_down',), transposed=True) (h @ w[e] writes d)")

    # The mapping the lines give places them: the same matrices as the named layout's.
    mapping = {
        "*.experts.in_a": Split(("MLP_gate",), transposed=True),
        "*.experts.in_b": Split(("MLP_up",), transposed=True),
        "*.experts.out": Split(("MLP_down",), transposed=True),
    }
    mapped = _quiet_find(model, mapping=mapping)
    assert sum(t.expert is not None for t in mapped) == 2 * 3 * E
    _assert_experts_reproduce_the_kernel(model, mapped)


def test_a_mapping_for_experts_that_does_not_fit_is_a_one_line_error() -> None:
    model = MoELM(("in_a", "in_b", "out"))
    with pytest.raises(ValueError, match=re.escape("mapping= gave an unusable Split")) as error:
        find_targets(model, mapping={"*.experts.in_a": Split(("MLP_gate", "MLP_up", "X"))})
    assert "\n" not in str(error.value)


def test_the_grouped_kernel_computes_each_experts_product_and_its_gradients() -> None:
    # The test model's own kernel against a loop over the experts, forward and backward.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(10, D, generator=generator, requires_grad=True)
    w = torch.randn(E, D, F_HIDDEN, generator=generator, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 10], dtype=torch.int32)  # expert 1 gets no token
    grad = torch.randn(10, F_HIDDEN, generator=generator)
    got = GroupedMM.apply(x, w, offs)
    got_x, got_w = torch.autograd.grad(got, (x, w), grad)
    bounds = [(0, 3), (3, 3), (3, 8), (8, 10)]
    expected = torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(bounds)])
    expected_x, expected_w = torch.autograd.grad(expected, (x, w), grad)
    for a, b in ((got, expected), (got_x, expected_x), (got_w, expected_w)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
