"""LoRA-style layers of any library (targets/lowrank.py): recognised by structure, verified by the
module's own output, watched through the adapted path. References are float64: the effective
weight is read back from the module's forward (``f(I) - f(0)``), the update from its factors."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import stack_models
import torch
from torch import nn

from spectral_callbacks.functional import randomized_svd
from spectral_callbacks.targets import TargetWarning, find_targets, format_targets
from spectral_callbacks.targets.lowrank import Layout, LowRankTarget, recognise


class HandLoRA(nn.Module):
    """A LoRA layer written by hand, with names no rule knows: ``frozen``, ``p``, ``q``."""

    def __init__(self, n_in: int, n_out: int, r: int = 2, s: float = 0.75) -> None:
        super().__init__()
        self.frozen = nn.Linear(n_in, n_out)
        self.frozen.weight.requires_grad_(False)
        self.p = nn.Parameter(torch.randn(r, n_in) / n_in**0.5)
        self.q = nn.Parameter(0.1 * torch.randn(n_out, r))
        self.s = s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(x) + self.s * (x @ self.p.T) @ self.q.T


class HandDoRA(nn.Module):
    """A DoRA layer written by hand that states ``alpha`` and ``rank`` but no ``scaling``:
    ``diag(g / ||W_0 + s B A||_row) (W_0 x + b + s B A x)`` with ``s = alpha / rank``."""

    def __init__(self, n_in: int, n_out: int, rank: int = 3, alpha: float = 6.0) -> None:
        super().__init__()
        self.frozen = nn.Linear(n_in, n_out)  # its default init: a nonzero bias
        self.frozen.weight.requires_grad_(False)
        self.p = nn.Parameter(torch.randn(rank, n_in) / n_in**0.5)
        self.q = nn.Parameter(0.1 * torch.randn(n_out, rank))
        self.alpha, self.rank = alpha, rank
        with torch.no_grad():
            rows = (self.frozen.weight + alpha / rank * self.q @ self.p).norm(dim=1)
        self.g = nn.Parameter(rows * (1.0 + 0.3 * torch.rand(n_out)))  # trained away from 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.alpha / self.rank
        effective = self.frozen.weight + s * self.q @ self.p
        scale = self.g / effective.norm(dim=1).detach()
        return scale * (self.frozen(x) + s * (x @ self.p.T) @ self.q.T)


class NotLoRA(HandLoRA):
    """The same parameters, but the product is not added: a nonlinearity between the factors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(x) + self.s * torch.tanh(x @ self.p.T) @ self.q.T


class Block(nn.Module):
    def __init__(self, layer: Callable[[int, int], nn.Module], width: int = 16) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.q_proj = layer(width, width)
        self.attn.k_proj = nn.Linear(width, width)
        self.attn.v_proj = nn.Linear(width, width)
        self.attn.o_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn
        batch, steps, width = x.shape
        q, k, v = (
            p(x).view(batch, steps, 2, width // 2).transpose(1, 2)  # (B, nh, T, hs)
            for p in (a.q_proj, a.k_proj, a.v_proj)
        )
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + a.o_proj(y.transpose(1, 2).reshape(batch, steps, width))


class Model(nn.Module):
    def __init__(self, layer: Callable[[int, int], nn.Module] = HandLoRA) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(layer) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def effective_weight(module: nn.Module, n_in: int) -> torch.Tensor:
    """(out, in) float64 weight the module applies: its output on the identity minus on zero."""
    module = module.double().eval()
    with torch.no_grad():
        eye = torch.eye(n_in, dtype=torch.float64)[None]
        weight = (module(eye) - module(torch.zeros_like(eye)))[0].T
    module.float()
    return weight


def as_query(layer: nn.Module) -> nn.Module:
    """A one-layer model holding ``layer`` where the names make it a query projection."""
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].attn = nn.Module()
    model.layers[0].attn.q_proj = layer
    return model


def check_watched_spectrum(target: Any, module: nn.Module) -> torch.Tensor:
    """The singular values the engine computes from the target's snapshot (its products, not a
    formed matrix) against float64 SVD of the weight the module's forward applies; returns that
    weight."""
    expected = effective_weight(module, target.shape[1])
    batch = type(target).stack_batch([target])
    k = min(target.shape) // 2
    found = randomized_svd(batch, k).S[0].double()
    exact = torch.linalg.svdvals(expected)[:k]
    assert torch.allclose(found, exact, rtol=1e-4, atol=1e-6), (found, exact)
    return expected


def check_effective_and_update(target: Any, module: nn.Module, rows: slice = slice(None)) -> None:
    """The target's effective weight against the module's forward, its update's singular values
    against float64 SVD of (effective - base)."""
    n_in = target.shape[1]
    expected = effective_weight(module, n_in)[rows]
    batch = type(target).stack_batch([target])
    assert torch.allclose(batch.dense(torch.float64)[0], expected, atol=1e-5, rtol=0), target.name
    update = expected - target.parameter.detach().double()[rows]
    exact = torch.linalg.svdvals(update)[: target.rank]
    from spectral_callbacks.functional.lowrank import low_rank_singular_values

    found = low_rank_singular_values(batch.ups, batch.downs)[0].double()
    assert torch.allclose(found[: exact.numel()], exact, rtol=1e-4, atol=1e-6), target.name


def test_a_hand_made_lora_layer_is_an_adapted_target_by_its_structure() -> None:
    model = Model()
    targets = find_targets(model)
    q = [t for t in targets if t.role == "Q"]
    assert [t.parameter_name for t in q] == [
        "layers.0.attn.q_proj.frozen.weight",
        "layers.1.attn.q_proj.frozen.weight",
    ]
    assert all(isinstance(t, LowRankTarget) and t.rank == 2 for t in q)
    layout = recognise(model.layers[0].attn.q_proj)
    assert isinstance(layout, Layout) and layout.scale == pytest.approx(0.75, rel=1e-6)
    for t in q:
        check_effective_and_update(t, t.layer_module)
    assert "s=0.75" in format_targets(targets)
    # The factors are not targets of their own and not warned about.
    assert not [t for t in targets if t.parameter_name.endswith((".p", ".q"))]


def test_a_hand_made_lora_layer_is_watched_exactly_through_discovery_too() -> None:
    model = Model()
    by_names = find_targets(model)
    found = find_targets(model, example_input=torch.randn(1, 4, 16))
    assert [t.name for t in found] == [t.name for t in by_names]
    assert found.sources["layers.0.attn.q_proj.frozen.weight"] == "names = data flow"
    for t in found:
        if t.role == "Q":
            assert isinstance(t, LowRankTarget)
            check_effective_and_update(t, t.layer_module)


def test_a_layer_that_looks_like_lora_but_is_not_is_refused_in_one_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(Model(NotLoRA))
    assert not [t for t in targets if t.role == "Q"]  # never watched as its base
    refused = [s for s in targets.skipped if s.parameter_name.endswith("q_proj.frozen.weight")]
    assert len(refused) == 2
    assert "NotLoRA: its update is not s B A for one s; not watched" in refused[0].reason
    assert "\n" not in refused[0].reason
    assert any(
        issubclass(w.category, TargetWarning) and "NotLoRA" in str(w.message) for w in caught
    )


def test_the_probe_leaves_the_layer_as_it_was_between_a_forward_and_its_backward() -> None:
    """Discovery may run after the first training forward (roles_from_first_forward): the probe
    writes none of the layer's parameters, so the backward of that forward still runs."""
    layer = HandLoRA(8, 6)
    layer.train()
    loss = layer(torch.randn(3, 8)).square().sum()  # saves p and q for its backward
    before = {name: (p.detach().clone(), p._version) for name, p in layer.named_parameters()}
    assert isinstance(recognise(layer), Layout)
    assert layer.training
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name][0]) and p._version == before[name][1], name
    loss.backward()
    assert layer.q.grad is not None


def test_a_hand_made_dora_layer_stating_alpha_and_rank_is_watched_with_their_ratio() -> None:
    """No ``scaling`` attribute: the stated scale is ``alpha / rank`` (here 6 / 3)."""
    targets = find_targets(Model(HandDoRA))
    q = [t for t in targets if t.role == "Q"]
    assert len(q) == 2, [s.reason for s in targets.skipped]
    for target in q:
        assert isinstance(target, LowRankTarget) and target.layout.magnitude == "g"
        assert target.layout.scale == pytest.approx(2.0, rel=1e-6)
        check_watched_spectrum(target, target.layer_module)


# --- torchtune --------------------------------------------------------------------------------


def torchtune_layer(peft: Any, dora: bool) -> nn.Module:
    """torchtune's LoRALinear or DoRALinear (16 -> 12, r=3, alpha=6) as after some training:
    B, the bias and DoRA's magnitude away from their initial values."""
    torch.manual_seed(0)
    kind = peft.DoRALinear if dora else peft.LoRALinear
    layer = kind(in_dim=16, out_dim=12, rank=3, alpha=6.0, use_bias=True)
    with torch.no_grad():
        layer.lora_b.weight.normal_(0, 0.1)
        layer.bias.normal_(0, 0.1)
    if dora:
        layer.initialize_dora_magnitude()
        with torch.no_grad():
            layer.magnitude.mul_(1.0 + 0.3 * torch.rand(12))
    return layer


@pytest.mark.parametrize("dora", [False, True], ids=["LoRALinear", "DoRALinear"])
def test_torchtune_lora_and_dora_linear(dora: bool) -> None:
    peft = pytest.importorskip("torchtune.modules.peft")
    layer = torchtune_layer(peft, dora)
    (target,) = find_targets(as_query(layer))
    assert isinstance(target, LowRankTarget)
    assert target.parameter_name == "layers.0.attn.q_proj.weight" and target.role == "Q"
    assert target.layout.scale == pytest.approx(2.0)
    assert (target.layout.magnitude is not None) == dora
    # DoRA scales the bias too; the effective weight is what multiplies x.
    expected = effective_weight(layer, 16)
    batch = type(target).stack_batch([target])
    assert torch.allclose(batch.dense(torch.float64)[0], expected, atol=1e-5, rtol=0)
    if not dora:
        check_effective_and_update(target, layer)


@pytest.mark.parametrize("dora", [False, True], ids=["LoRALinear", "DoRALinear"])
def test_a_torchtune_layer_under_disable_adapter_is_watched_as_its_base(dora: bool) -> None:
    """torchtune's ``disable_adapter`` (DPO's reference forward) sets each layer's ``disabled``:
    the forward is then ``W_0 x + b``, and so is the watched matrix; enabled again, W_0 + s B A."""
    peft = pytest.importorskip("torchtune.modules.peft")
    layer = torchtune_layer(peft, dora)
    model = as_query(layer)
    (target,) = find_targets(model)
    with peft.disable_adapter(model):
        base = check_watched_spectrum(target, layer)
    adapted = check_watched_spectrum(target, layer)
    torch.testing.assert_close(base, layer.weight.detach().double(), rtol=0, atol=1e-6)
    assert not torch.allclose(adapted, base, atol=1e-3)  # the update is not negligible


@pytest.mark.parametrize("dora", [False, True], ids=["LoRALinear", "DoRALinear"])
def test_a_torchtune_layer_found_under_disable_adapter_is_verified_as_an_adapter(
    dora: bool,
) -> None:
    """Found while disabled (a tracker built inside DPO's reference forward), the layer's
    forward shows no update; it is verified with its adapter on, so it is watched as the base
    while disabled and as W_0 + s B A once enabled, not refused for the life of the module."""
    peft = pytest.importorskip("torchtune.modules.peft")
    layer = torchtune_layer(peft, dora)
    model = as_query(layer)
    model.layers[0].attn.k_proj = nn.Linear(16, 12)  # a refused query still leaves a target
    with peft.disable_adapter(model):
        targets = find_targets(model)
        assert [t.role for t in targets] == ["Q", "K"], [s.reason for s in targets.skipped]
        target = targets[0]
        assert isinstance(target, LowRankTarget) and target.layout.scale == pytest.approx(2.0)
        base = check_watched_spectrum(target, layer)
        assert layer.disabled
    torch.testing.assert_close(base, layer.weight.detach().double(), rtol=0, atol=1e-6)
    adapted = check_watched_spectrum(target, layer)
    assert not torch.allclose(adapted, base, atol=1e-3)


def test_torchtune_lora_llama3_builder_watches_every_effective_weight() -> None:
    pytest.importorskip("torchtune")
    stack = stack_models.tune_lora_llama3()
    targets = find_targets(stack.model)
    assert len(targets) == 14 and all(isinstance(t, LowRankTarget) for t in targets)
    for t in targets:
        check_effective_and_update(t, t.layer_module)


# --- litgpt -----------------------------------------------------------------------------------


def test_litgpt_lora_linear() -> None:
    lora = pytest.importorskip("litgpt.lora")
    torch.manual_seed(0)
    layer = lora.LoRALinear(16, 12, r=4, lora_alpha=8, bias=True)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    layout = recognise(layer)
    assert isinstance(layout, Layout) and layout.base == "linear.weight"
    assert layout.scale == pytest.approx(2.0) and layout.rows is None


@pytest.mark.parametrize(
    "enable", [(True, False, True), (False, True, False), (True, True, True)], ids=str
)
def test_litgpt_lora_qkv_linear_is_placed_per_part(enable: tuple[bool, bool, bool]) -> None:
    """LoRAQKVLinear: one A and one B block per enabled part of [q; k; v] (grouped K/V), the
    update zero-padded where a part has none: each part's target is exact."""
    lora = pytest.importorskip("litgpt.lora")
    torch.manual_seed(0)
    heads, groups, size = 4, 2, 4
    out = (heads + 2 * groups) * size
    layer = lora.LoRAQKVLinear(
        16, out, head_size=size, n_head=heads, n_query_groups=groups, r=2, lora_alpha=4,
        enable_lora=enable, bias=True,
    )  # fmt: skip
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    layout = recognise(layer)
    assert isinstance(layout, Layout) and layout.scale == pytest.approx(2.0)
    block = nn.Module()
    block.attn = nn.Module()
    block.attn.qkv = layer
    block.attn.config = type("Config", (), {"n_head": heads, "n_query_groups": groups})()
    model = nn.Module()
    model.h = nn.ModuleList([block])
    targets = {t.role: t for t in find_targets(model)}
    assert sorted(targets) == ["K", "Q", "V"]
    parts = {"Q": slice(0, 16), "K": slice(16, 24), "V": slice(24, 32)}
    for role, t in targets.items():
        assert isinstance(t, LowRankTarget)
        check_effective_and_update(t, layer, parts[role])
        update = type(t).stack_batch([t]).ups[0]
        adapted = enable[("Q", "K", "V").index(role)]
        assert bool(update.abs().sum() > 0) == adapted, role  # zero-padded part: no update


def test_litgpt_lora_model_watches_every_effective_weight() -> None:
    pytest.importorskip("litgpt")
    stack = stack_models.lit_lora()
    targets = find_targets(stack.model)
    assert len(targets) == 14 and all(isinstance(t, LowRankTarget) for t in targets)
    qkv = {"Q": slice(0, 64), "K": slice(64, 96), "V": slice(96, 128)}
    for t in targets:
        rows = qkv.get(t.role, slice(None))
        check_effective_and_update(t, t.layer_module, rows)
