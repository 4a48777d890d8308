"""The example GPT and its attention variants: shapes, causality, documented layouts, training."""

from __future__ import annotations

import math

import pytest
import torch
from attention import ATTENTION_CLASSES, apply_rope
from gpt import GPT, GPTConfig

from spectral_callbacks.chart_data import role_color
from spectral_callbacks.targets import find_targets

VARIANTS = sorted(ATTENTION_CLASSES)
TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16)


def tiny_gpt(attention: str, **overrides: object) -> GPT:
    return GPT(GPTConfig(**{**TINY, "attention": attention, **overrides}))  # type: ignore[arg-type]


@pytest.mark.parametrize("attention", VARIANTS)
def test_forward_backward_reaches_every_parameter(attention: str) -> None:
    model = tiny_gpt(attention)
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert loss is not None
    loss.backward()
    for name, param in model.named_parameters():
        if name == "transformer.wpe.weight" or param.ndim < 2:
            continue
        assert param.grad is not None and param.grad.abs().sum() > 0, name


EXPECTED_SHAPES = {  # (q, k, v) as (heads, dim) for n_head=4, head_dim=8: rope 4, kv_heads 2 for gqa/gta
    "mha": ((4, 8), (4, 8), (4, 8)),
    "mqa": ((4, 8), (1, 8), (1, 8)),
    "gqa": ((4, 8), (2, 8), (2, 8)),
    "mla": ((4, 12), (4, 12), (4, 8)),
    "gla2": ((4, 12), (4, 12), (4, 8)),
    "gla4": ((4, 12), (4, 12), (4, 8)),
    "gta": ((4, 8), (2, 8), (2, 8)),
    "mfa": ((4, 8), (1, 8), (1, 8)),
    "tpa": ((4, 8), (4, 8), (4, 8)),
}


@pytest.mark.parametrize("attention", VARIANTS)
def test_qkv_shapes(attention: str) -> None:
    attn = tiny_gpt(attention).transformer.h[0].attn
    q, k, v = attn.qkv(torch.randn(3, 5, 32))
    assert [tuple(t.shape) for t in (q, k, v)] == [(3, 5, *s) for s in EXPECTED_SHAPES[attention]]
    assert k.size(2) == attn.num_key_value_heads and q.size(2) == attn.num_heads


@pytest.mark.parametrize("attention", VARIANTS)
def test_output_at_t_ignores_inputs_after_t(attention: str) -> None:
    model = tiny_gpt(attention).eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 9:] = torch.randint(0, 256, (2, 7))
    before, _ = model(idx)
    after, _ = model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def reference_qkv(
    attn: torch.nn.Module, attention: str, x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """q, k, v from the weights in float64, following each class docstring's layout."""
    W = {name.removesuffix(".weight"): p.detach().double() for name, p in attn.named_parameters()}
    B, T, _ = x.shape
    h, hd = attn.num_heads, attn.head_dim
    if attention == "mha":
        q, k, v = (x @ w.T for w in W["c_attn"].chunk(3))
        return q.view(B, T, h, hd), k.view(B, T, h, hd), v.view(B, T, h, hd)
    if attention in ("mqa", "gqa", "mfa"):
        q = x @ W["q_proj"].T if "q_proj" in W else (x @ W["q_a_proj"].T) @ W["q_b_proj"].T
        k, v = x @ W["k_proj"].T, x @ W["v_proj"].T
        return q.view(B, T, h, hd), k.view(B, T, -1, hd), v.view(B, T, -1, hd)
    if attention == "gta":
        rope = attn.qk_rope_head_dim
        kv = (x @ W["kv_proj"].T).view(B, T, -1, hd)
        k_rope = (x @ W["k_rope_proj"].T)[:, :, None].expand(B, T, kv.size(2), rope)
        return (
            (x @ W["q_proj"].T).view(B, T, h, hd),
            torch.cat([kv[..., : hd - rope], k_rope], -1),
            kv,
        )
    if attention == "tpa":
        out = []
        for name, rank in (("q", attn.q_rank), ("k", attn.k_rank), ("v", attn.v_rank)):
            a = (x @ W[f"W_A_{name}"].T).view(B, T, h, rank)
            b = (x @ W[f"W_B_{name}"].T).view(B, T, rank, hd)
            out.append(torch.einsum("bthr,btrd->bthd", a, b) / rank)
        return tuple(out)
    # mla and gla: latent rows first, then the one shared rope key; per head [k_nope; v] rows
    nope, rope, dv, r = (
        attn.qk_nope_head_dim,
        attn.qk_rope_head_dim,
        attn.v_head_dim,
        attn.kv_lora_rank,
    )
    down = x @ W["kv_a_proj_with_mqa"].T
    latent, k_rope = down[..., :r], down[..., r:]
    if attention == "mla":
        q = (_rms(x @ W["q_a_proj"].T) * W["q_a_layernorm"]) @ W["q_b_proj"].T
        kv = (_rms(latent) * W["kv_a_layernorm"]) @ W["kv_b_proj"].T
    else:
        g = attn.n_latent_groups
        q = x @ W["q_proj"].T
        parts = [_rms(part) @ W[f"kv_b_proj.{j}"].T for j, part in enumerate(latent.chunk(g, -1))]
        kv = torch.cat(parts, -1)  # group j's heads follow group j-1's
    kv = kv.view(B, T, h, nope + dv)
    k = torch.cat([kv[..., :nope], k_rope[:, :, None].expand(B, T, h, rope)], -1)
    return q.view(B, T, h, nope + rope), k, kv[..., nope:]


@pytest.mark.parametrize("attention", VARIANTS)
def test_qkv_follows_the_documented_weight_layout(attention: str) -> None:
    attn = tiny_gpt(attention).transformer.h[0].attn
    for param in attn.parameters():  # norms away from 1 so their scale is checked too
        torch.nn.init.normal_(param, mean=0.5 if param.ndim == 1 else 0.0, std=0.3)
    x = torch.randn(2, 6, 32)
    actual = attn.qkv(x)
    expected = reference_qkv(attn, attention, x.double())
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", VARIANTS)
def test_forward_is_causal_attention_over_qkv(attention: str) -> None:
    attn = tiny_gpt(attention).transformer.h[0].attn
    x = torch.randn(2, 6, 32)
    q, k, v = (t.double().transpose(1, 2) for t in attn.qkv(x))  # (B, h, T, d)
    q = apply_rope(q.transpose(1, 2), attn.rope_dim).transpose(1, 2)
    k = apply_rope(k.transpose(1, 2), attn.rope_dim).transpose(1, 2)
    repeats = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, -1).float()
    torch.testing.assert_close(attn(x), attn.out(y), rtol=1e-4, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position() -> None:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, dtype=torch.float64, generator=generator)
    seq = torch.stack([q, k]).expand(10, 2, 8)[None].transpose(1, 2).contiguous()  # (1, 2, 10, 8)
    rotated = apply_rope(seq.transpose(1, 2), rope_dim=6)  # (1, 10, 2, 8)
    torch.testing.assert_close(rotated[..., :2], seq.transpose(1, 2)[..., :2])  # 2 untouched
    score = lambda m, n: float(rotated[0, m, 0] @ rotated[0, n, 1])  # noqa: E731
    # Rotations keep the scores' scale |q| |k|: the tolerance is absolute on it (a relative one
    # failed on draws with a score near zero). Over 2,000 seeds the equal pairs differ by at most
    # 1.6e-7 of it (the angles are float32) and the scores over distance spread by at least 0.011.
    scale = float(q.norm() * k.norm())
    assert score(7, 4) == pytest.approx(score(5, 2), rel=0, abs=1e-6 * scale)
    assert score(9, 3) == pytest.approx(score(6, 0), rel=0, abs=1e-6 * scale)
    by_distance = [score(9, 9 - distance) for distance in range(10)]
    assert max(by_distance) - min(by_distance) > 1e-3 * scale  # and the distance does matter


@pytest.mark.parametrize("attention", VARIANTS)
def test_loss_decreases_on_a_fixed_batch(attention: str) -> None:
    torch.manual_seed(0)
    model = tiny_gpt(attention, n_layer=1)
    data = torch.randint(0, 16, (4, 17))  # 16 symbols: memorizable in a few dozen steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        _, loss = model(data[:, :-1], data[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("init", ["gpt", "zero_out", "normal"])
def test_init_scales_the_residual_output_projections(init: str) -> None:
    model = tiny_gpt("mla", n_layer=8, n_embd=64, init=init)
    expected_out = {"gpt": 0.02 / math.sqrt(16), "zero_out": 0.0, "normal": 0.02}[init]
    block = model.transformer.h[3]
    for weight in (block.attn.o_proj.weight, block.mlp.c_proj.weight):
        assert float(weight.detach().std()) == pytest.approx(expected_out, rel=0.1, abs=1e-12)
    assert float(block.attn.q_b_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(attention="linear"), "`attention` must be one of"),
        (dict(init="xavier"), "`init` must be one of"),
        (dict(n_embd=30), "multiple of `n_head`"),
        (dict(attention="gqa", n_kv_head=3), "multiple of `n_kv_head`"),
        (dict(attention="gla4", n_head=2, n_embd=32), "latent groups"),
        (dict(attention="mla", qk_rope_head_dim=3), "qk_rope_head_dim"),
    ],
)
def test_bad_config_names_the_argument(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **overrides})


def test_sequence_longer_than_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        tiny_gpt("mha")(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("attention", VARIANTS)
def test_no_two_roles_of_a_variant_share_a_colour(attention: str) -> None:
    # Hashed into four spare colours, MLA's Q_up and K_rope were both grey in the tab's bars.
    config = GPTConfig(attention=attention, n_layer=1, n_head=4, n_embd=64, block_size=16)
    roles = {target.role for target in find_targets(GPT(config))}
    colors = {role: role_color(role) for role in roles}
    assert len(set(colors.values())) == len(roles), colors


def test_no_two_roles_of_a_deepseek_or_encoder_decoder_layout_share_a_colour() -> None:
    for roles in (
        # DeepSeek-V2/V3: MLA, a router, routed and shared experts
        ("Q_down", "Q_up", "KV_down", "K_rope", "K", "V", "O", "Router", "MLP_gate", "MLP_up")
        + ("MLP_down", "MLP_shared_gate", "MLP_shared_up", "MLP_shared_down"),
        ("Q", "K", "V", "O", "Q_cross", "K_cross", "V_cross", "O_cross", "MLP_up", "MLP_down"),
    ):
        colors = [role_color(role) for role in roles]
        assert len(set(colors)) == len(roles), dict(zip(roles, colors, strict=True))
