"""find_targets on the example GPT's attention variants (examples/attention.py).

For each variant the queries, keys and values are rebuilt from the found matrices alone (plus the
variant's parameter-free steps: the MLA latent norms, the TPA products) and compared with what the
attention module's own ``qkv(x)`` computes; O and the MLP matrices are checked with forward hooks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gpt = pytest.importorskip("gpt")  # examples/ is on sys.path (tests/conftest.py)
from attention import ATTENTION_CLASSES  # noqa: E402

from spectral_callbacks.targets import find_targets  # noqa: E402

VARIANTS = sorted(ATTENTION_CLASSES)
L, H, D = 2, 4, 32  # layers, heads, width: head_dim 8


def build(variant: str):
    torch.manual_seed(0)
    config = gpt.GPTConfig(n_layer=L, n_head=H, n_embd=D, block_size=16, attention=variant)
    return gpt.GPT(config)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def rebuild_qkv(variant: str, attn, m, x: torch.Tensor):
    """(q, k, v) of shape (B, T, heads, dim) from the found matrices ``m[role]`` only."""
    B, T, _ = x.shape

    def lin(role, inp=x):
        return inp @ m[role].T

    def heads(y, n):
        return y.view(B, T, n, -1)

    if variant in ("mha", "mqa", "gqa"):
        kv = attn.num_key_value_heads
        return heads(lin("Q"), H), heads(lin("K"), kv), heads(lin("V"), kv)
    if variant == "mfa":
        q = heads(lin("Q_up", lin("Q_down")), H)
        return q, heads(lin("K"), 1), heads(lin("V"), 1)
    if variant == "tpa":
        out = []
        for name, rank in (("Q", attn.q_rank), ("K", attn.k_rank), ("V", attn.v_rank)):
            a = lin(f"{name}_A").view(B, T, H, rank)
            b = lin(f"{name}_B").view(B, T, rank, -1)
            out.append(a @ b / rank)
        return tuple(out)
    if variant == "gta":
        kv = heads(lin("KV"), attn.num_key_value_heads)
        rope = attn.qk_rope_head_dim
        k_rope = lin("K_rope")[:, :, None, :].expand(-1, -1, kv.shape[2], -1)
        k = torch.cat([kv[..., : attn.head_dim - rope], k_rope], dim=-1)
        return heads(lin("Q"), H), k, kv
    # MLA and GLA: latent -> per-head [k_nope; v], plus one rope key shared by all heads
    rope = attn.qk_rope_head_dim
    k_rope = lin("K_rope")[:, :, None, :].expand(B, T, H, rope)
    if variant == "mla":
        q = heads(lin("Q_up", attn.q_a_layernorm(lin("Q_down"))), H)
        latent = attn.kv_a_layernorm(lin("KV_down"))
        k_nope, v = heads(lin("K", latent), H), heads(lin("V", latent), H)
    else:
        g = attn.n_latent_groups
        q = heads(lin("Q"), H)
        latents = lin("KV_down").view(B, T, g, -1)
        latents = F.rms_norm(latents, (latents.size(-1),))
        k_nope = torch.cat([heads(lin(f"K_g{j}", latents[:, :, j]), H // g) for j in range(g)], 2)
        v = torch.cat([heads(lin(f"V_g{j}", latents[:, :, j]), H // g) for j in range(g)], 2)
    return q, torch.cat([k_nope, k_rope], dim=-1), v


@pytest.mark.parametrize("variant", VARIANTS)
def test_roles_and_counts_follow_each_variants_role_map(variant):
    model = build(variant)
    targets = find_targets(model)
    expected = [*model.transformer.h[0].attn.roles, "MLP_up", "MLP_down"]
    assert len(targets) == L * len(expected)
    for layer in range(L):
        roles = [t.role for t in targets if t.layer == layer]
        assert sorted(roles) == sorted(expected)
    assert [t.layer for t in targets] == sorted(t.layer for t in targets)
    assert all(t.num_layers == L for t in targets)
    assert all(tuple(t.matrix().shape) == t.shape for t in targets)
    assert len({(t.parameter_name, t.rows) for t in targets}) == len(targets)


@pytest.mark.parametrize("variant", VARIANTS)
def test_found_matrices_rebuild_the_variants_own_qkv(variant):
    model = build(variant)
    targets = find_targets(model)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        for layer, block in enumerate(model.transformer.h):
            m = {t.role: t.matrix() for t in targets if t.layer == layer}
            expected = block.attn.qkv(x)
            actual = rebuild_qkv(variant, block.attn, m, x)
            for a, e in zip(actual, expected, strict=True):
                close(a, e)


@pytest.mark.parametrize("variant", VARIANTS)
def test_output_and_mlp_matrices_are_the_ones_multiplied(variant):
    model = build(variant)
    targets = [t for t in find_targets(model) if t.role in ("O", "MLP_up", "MLP_down")]
    seen = {}
    for t in targets:
        module = model.get_submodule(t.parameter_name.rpartition(".")[0])
        module.register_forward_hook(lambda m, a, o, t=t: seen.__setitem__(t.name, (a[0], o, t)))
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 6)))
        assert len(seen) == 3 * L
        for x, y, t in seen.values():
            close(x @ t.matrix().T, y)


def test_gla_group_index_is_not_a_layer():
    targets = find_targets(build("gla4"), roles=["K_g*", "V_g3"])
    assert {t.layer for t in targets} == {0, 1}
    assert [t.role for t in targets if t.layer == 0] == ["K_g0", "K_g1", "K_g2", "K_g3", "V_g3"]
    assert targets[0].parameter_name == "transformer.h.0.attn.kv_b_proj.0.weight"
