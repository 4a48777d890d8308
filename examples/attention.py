"""Causal self-attention variants for the example GPT, one class per idea, one interface.

Every class takes a ``GPTConfig`` (see ``gpt.py``), maps ``(B, T, n_embd) -> (B, T, n_embd)``, and
exposes ``qkv(x) -> (q, k, v)``: the per-head queries, keys and values of shape
``(B, T, heads, dim)`` *before* RoPE, which is exactly what ``F.scaled_dot_product_attention``
consumes after rotation (K and V may have fewer heads than Q: they are shared by groups of query
heads). Parameter names follow Hugging Face / DeepSeek so ``find_targets`` rules carry over, and
each class docstring gives its role map (docs/targets.md, Roles).

Positions: the GPT adds a learned ``wpe`` for every variant, so variants are compared on equal
footing; the variants whose design carries a decoupled rotary key (MLA, GLA, GTA) additionally
rotate the last ``qk_rope_head_dim`` channels of q and k (Su et al. 2021, rotate-half form).

Variants (``ATTENTION_CLASSES`` maps the ``attention=`` name to the class):

* ``mha`` - multi-head attention, nanoGPT layout (Vaswani et al. 2017).
* ``mqa`` / ``gqa`` - one / ``n_kv_head`` shared K/V heads (Shazeer 2019; Ainslie et al. 2023).
* ``mla`` - multi-head latent attention, DeepSeek-V2 layout (DeepSeek-AI 2024).
* ``gla2`` / ``gla4`` - grouped latent attention with 2 / 4 latent groups (Zadouri, Strauss & Dao
  2025, "Hardware-Efficient Attention for Fast Decoding").
* ``gta`` - grouped tied attention, same paper.
* ``mfa`` - multi-matrix factorization attention (Hu et al. 2024).
* ``tpa`` - tensor product attention (Zhang et al. 2025).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from gpt import GPTConfig


def apply_rope(x: Tensor, rope_dim: int, base: float = 10000.0) -> Tensor:
    """Rotate the last ``rope_dim`` channels of ``x`` (B, T, H, D) by their position t (RoPE).

    Rotate-half form: channel i is paired with channel i + rope_dim/2 and the pair turns by the
    angle t * base^(-2i/rope_dim). The first ``D - rope_dim`` channels pass through unchanged.
    """
    if rope_dim == 0:
        return x
    T = x.size(1)
    half = rope_dim // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv_freq  # (T, half)
    cos = angles.cos()[None, :, None, :]  # (1, T, 1, half)
    sin = angles.sin()[None, :, None, :]
    keep, rot = x.split([x.size(-1) - rope_dim, rope_dim], dim=-1)
    r1, r2 = rot.float().split(half, dim=-1)
    rotated = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1).to(x.dtype)
    return torch.cat([keep, rotated], dim=-1)


class CausalAttention(nn.Module):
    """Shared forward pass: ``qkv`` -> RoPE on the rope channels -> causal SDPA -> output projection.

    Subclasses define ``qkv`` and the output projection (``c_proj`` for MHA, ``o_proj`` otherwise),
    and set the Hugging Face-style attributes ``num_heads``, ``num_key_value_heads``, ``head_dim``
    (plus their variant's own, e.g. ``kv_lora_rank``). ``roles`` lists the role of each watched
    matrix in parameter order.
    """

    roles: tuple[str, ...] = ()
    rope_dim: int = 0  # channels of q and k that RoPE rotates (the last ones)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.n_head
        self.head_dim = config.head_dim
        self.num_key_value_heads = config.n_head
        self.dropout = config.dropout
        # The logit scale the softmax applies, declared as Hugging Face attention modules do:
        # 1/sqrt of the query-key dot product's width (variants with rotary channels widen it).
        self.scaling = 1.0 / math.sqrt(config.head_dim)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def out(self, y: Tensor) -> Tensor:
        return self.o_proj(y)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)  # (B, T, h, d), k and v with h_kv <= h heads
        q, k = apply_rope(q, self.rope_dim), apply_rope(k, self.rope_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, d)
        if k.size(1) != q.size(1):  # grouped K/V: each K/V head serves h / h_kv query heads
            repeats = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, scale=self.scaling
        )  # (B, h, T, dv)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, h * dv)
        return self.out(y)


class MultiHeadAttention(CausalAttention):
    """Multi-head attention in the nanoGPT layout (``attention="mha"``).

    Parameters: ``c_attn`` (3d, d), rows ``[q; k; v]`` each (d, d) with heads contiguous;
    ``c_proj`` (d, d). Roles: Q, K, V (split from ``c_attn``), O (``c_proj``).
    """

    roles = ("Q", "K", "V", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d = config.n_embd
        self.c_attn = nn.Linear(d, 3 * d, bias=config.bias)
        self.c_proj = nn.Linear(d, d, bias=config.bias)

    def out(self, y: Tensor) -> Tensor:
        return self.c_proj(y)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        return tuple(t.view(B, T, self.num_heads, self.head_dim) for t in (q, k, v))  # type: ignore[return-value]


class GroupedQueryAttention(CausalAttention):
    """Grouped-query (``"gqa"``) and multi-query (``"mqa"``, one K/V head) attention.

    Parameters: ``q_proj`` (h*hd, d), ``k_proj`` and ``v_proj`` (h_kv*hd, d), ``o_proj`` (d, h*hd).
    Roles: Q, K, V, O. ``qkv`` returns k and v with ``num_key_value_heads`` heads.
    """

    roles = ("Q", "K", "V", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, hd = config.n_embd, config.head_dim
        self.num_key_value_heads = config.kv_heads
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.bias)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * hd, bias=config.bias)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * hd, bias=config.bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_key_value_heads, self.head_dim)
        return q, k, v


class MultiHeadLatentAttention(CausalAttention):
    """Multi-head latent attention in the DeepSeek-V2 layout (``attention="mla"``).

    Parameters: ``q_a_proj`` (q_lora_rank, d) + ``q_a_layernorm``; ``q_b_proj``
    (h*(nope+rope), q_lora_rank), rows per head ``[q_nope; q_rope]``; ``kv_a_proj_with_mqa``
    (kv_lora_rank + rope, d), rows ``[latent; shared rope key]``, + ``kv_a_layernorm`` on the
    latent; ``kv_b_proj`` (h*(nope+v_head_dim), kv_lora_rank), rows per head ``[k_nope; v]``;
    ``o_proj`` (d, h*v_head_dim).
    Roles: Q_down (q_a_proj), Q_up (q_b_proj), KV_down (latent rows of kv_a_proj_with_mqa), K_rope
    (its last qk_rope_head_dim rows), K and V (kv_b_proj split per head), O (o_proj).

    ``qkv``: q (B, T, h, nope+rope); k (B, T, h, nope+rope) = per-head k_nope followed by the one
    shared rope key copied to every head; v (B, T, h, v_head_dim).
    """

    roles = ("Q_down", "Q_up", "KV_down", "K_rope", "K", "V", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, h = config.n_embd, config.n_head
        self.q_lora_rank, self.kv_lora_rank = config.q_rank, config.kv_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.nope_dim, config.rope_dim
        self.v_head_dim = config.value_dim
        self.rope_dim = self.qk_rope_head_dim
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scaling = 1.0 / math.sqrt(qk_dim)
        self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=config.bias)
        self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank)
        self.q_b_proj = nn.Linear(self.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            d, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.bias
        )
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * self.v_head_dim, d, bias=config.bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        h, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, h, nope + rope)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, h, nope + self.v_head_dim)
        k_nope, v = kv.split([nope, self.v_head_dim], dim=-1)
        k = torch.cat(
            [k_nope, k_rope[:, :, None, :].expand(B, T, h, rope)], dim=-1
        )  # (B, T, h, nope+rope)
        return q, k, v


class GroupedLatentAttention(CausalAttention):
    """Grouped latent attention (``"gla2"``, ``"gla4"``): MLA whose latent is split into g groups.

    The heads are split into g contiguous groups; the heads of group j read only latent j, so a
    decoding shard holds one latent of kv_lora_rank/g channels (Zadouri, Strauss & Dao 2025).
    Parameters: ``q_proj`` (h*(nope+rope), d), rows per head ``[q_nope; q_rope]``;
    ``kv_a_proj_with_mqa`` (kv_lora_rank + rope, d), rows ``[latent_0; ...; latent_{g-1}; rope
    key]``; ``kv_b_proj`` = ModuleList of g Linear, group j: ((h/g)*(nope+v_head_dim),
    kv_lora_rank/g), rows per head ``[k_nope; v]``; ``o_proj`` (d, h*v_head_dim). Each latent is
    RMS-normalized (no learned scale) before its up-projection.
    Roles: Q, KV_down (latent rows), K_rope (last rope rows), K_g0, V_g0, K_g1, V_g1, ... (each
    ``kv_b_proj[j]`` split per head), O.

    ``qkv``: as MLA - q (B, T, h, nope+rope), k (B, T, h, nope+rope) with the shared rope key last,
    v (B, T, h, v_head_dim).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, h = config.n_embd, config.n_head
        self.n_latent_groups = config.latent_groups
        self.kv_lora_rank = config.kv_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.nope_dim, config.rope_dim
        self.v_head_dim = config.value_dim
        self.rope_dim = self.qk_rope_head_dim
        self.scaling = 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        g = self.n_latent_groups
        self.q_proj = nn.Linear(
            d, h * (self.qk_nope_head_dim + self.qk_rope_head_dim), bias=config.bias
        )
        self.kv_a_proj_with_mqa = nn.Linear(
            d, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.bias
        )
        per_group = (h // g) * (self.qk_nope_head_dim + self.v_head_dim)
        self.kv_b_proj = nn.ModuleList(
            nn.Linear(self.kv_lora_rank // g, per_group, bias=False) for _ in range(g)
        )
        self.o_proj = nn.Linear(h * self.v_head_dim, d, bias=config.bias)

    @property
    def roles(self) -> tuple[str, ...]:  # type: ignore[override]
        groups = [role for j in range(self.n_latent_groups) for role in (f"K_g{j}", f"V_g{j}")]
        return ("Q", "KV_down", "K_rope", *groups, "O")

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        h, g = self.num_heads, self.n_latent_groups
        nope, rope, dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = self.q_proj(x).view(B, T, h, nope + rope)
        latents, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        latents = latents.view(B, T, g, self.kv_lora_rank // g)  # (B, T, g, r/g)
        latents = F.rms_norm(latents, (latents.size(-1),))
        kv = torch.cat(
            [
                up(latents[:, :, j]).view(B, T, h // g, nope + dv)
                for j, up in enumerate(self.kv_b_proj)
            ],
            dim=2,
        )  # (B, T, h, nope+dv), group j's heads contiguous
        k_nope, v = kv.split([nope, dv], dim=-1)
        k = torch.cat(
            [k_nope, k_rope[:, :, None, :].expand(B, T, h, rope)], dim=-1
        )  # (B, T, h, nope+rope)
        return q, k, v


class GroupedTiedAttention(CausalAttention):
    """Grouped tied attention (``"gta"``): one projection serves as both value and key.

    Each of the ``n_kv_head`` tied heads is the value, and its first ``head_dim - qk_rope_head_dim``
    channels are also the non-rotary part of the key; the rotary part of the key is one head
    ``k_rope_proj`` shared by all heads (Zadouri, Strauss & Dao 2025).
    Parameters: ``q_proj`` (h*hd, d); ``kv_proj`` (h_kv*hd, d), tied; ``k_rope_proj`` (rope, d);
    ``o_proj`` (d, h*hd). Roles: Q, KV (kv_proj), K_rope (k_rope_proj), O.

    ``qkv``: q (B, T, h, hd); k (B, T, h_kv, hd) = ``[kv[..., :hd-rope]; shared rope key]``;
    v (B, T, h_kv, hd) = kv.
    """

    roles = ("Q", "KV", "K_rope", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, hd = config.n_embd, config.head_dim
        self.num_key_value_heads = config.kv_heads
        self.qk_rope_head_dim = self.rope_dim = config.rope_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.bias)
        self.kv_proj = nn.Linear(d, self.num_key_value_heads * hd, bias=config.bias)
        self.k_rope_proj = nn.Linear(d, self.qk_rope_head_dim, bias=config.bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        hkv, hd, rope = self.num_key_value_heads, self.head_dim, self.qk_rope_head_dim
        q = self.q_proj(x).view(B, T, self.num_heads, hd)
        kv = self.kv_proj(x).view(B, T, hkv, hd)
        k_rope = self.k_rope_proj(x)[:, :, None, :].expand(B, T, hkv, rope)
        k = torch.cat([kv[..., : hd - rope], k_rope], dim=-1)  # (B, T, h_kv, hd)
        return q, k, kv


class MultiMatrixFactorizationAttention(CausalAttention):
    """Multi-matrix factorization attention (``"mfa"``): low-rank Q, many heads, one K/V head.

    Parameters: ``q_a_proj`` (q_lora_rank, d); ``q_b_proj`` (h*hd, q_lora_rank); ``k_proj`` and
    ``v_proj`` (hd, d), a single head shared by all queries; ``o_proj`` (d, h*hd) (Hu et al. 2024).
    Roles: Q_down, Q_up, K, V, O.
    """

    roles = ("Q_down", "Q_up", "K", "V", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, hd = config.n_embd, config.head_dim
        self.num_key_value_heads = 1
        self.q_lora_rank = config.q_rank
        self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=config.bias)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, hd, bias=config.bias)
        self.v_proj = nn.Linear(d, hd, bias=config.bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.bias)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_proj(x)).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, 1, self.head_dim)
        v = self.v_proj(x).view(B, T, 1, self.head_dim)
        return q, k, v


class TensorProductAttention(CausalAttention):
    """Tensor product attention (``"tpa"``): per-token Q, K, V as sums of rank-one tensor products.

    For each token, ``q_t = (1/R_q) * A_q(x_t)^T B_q(x_t)`` with ``A_q(x_t)`` (R_q, h) and
    ``B_q(x_t)`` (R_q, hd), likewise K and V with ranks R_k, R_v (Zhang et al. 2025, the T6
    layout: A is viewed as (h, R), B as (R, hd)).
    Parameters: ``W_A_q`` (h*R_q, d), ``W_B_q`` (R_q*hd, d), ``W_A_k`` (h*R_k, d), ``W_B_k``
    (R_k*hd, d), ``W_A_v`` (h*R_v, d), ``W_B_v`` (R_v*hd, d), ``o_proj`` (d, h*hd).
    Roles: Q_A, Q_B, K_A, K_B, V_A, V_B, O.
    """

    roles = ("Q_A", "Q_B", "K_A", "K_B", "V_A", "V_B", "O")

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        d, h, hd = config.n_embd, config.n_head, config.head_dim
        self.q_rank, self.k_rank, self.v_rank = (
            config.tpa_q_rank,
            config.tpa_kv_rank,
            config.tpa_kv_rank,
        )
        self.W_A_q = nn.Linear(d, h * self.q_rank, bias=False)
        self.W_B_q = nn.Linear(d, self.q_rank * hd, bias=False)
        self.W_A_k = nn.Linear(d, h * self.k_rank, bias=False)
        self.W_B_k = nn.Linear(d, self.k_rank * hd, bias=False)
        self.W_A_v = nn.Linear(d, h * self.v_rank, bias=False)
        self.W_B_v = nn.Linear(d, self.v_rank * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=config.bias)

    def _product(self, x: Tensor, W_A: nn.Linear, W_B: nn.Linear, rank: int) -> Tensor:
        B, T, _ = x.shape
        a = W_A(x).view(B, T, self.num_heads, rank)  # (B, T, h, R)
        b = W_B(x).view(B, T, rank, self.head_dim)  # (B, T, R, hd)
        return torch.matmul(a, b) / rank  # (B, T, h, hd)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self._product(x, self.W_A_q, self.W_B_q, self.q_rank)
        k = self._product(x, self.W_A_k, self.W_B_k, self.k_rank)
        v = self._product(x, self.W_A_v, self.W_B_v, self.v_rank)
        return q, k, v


ATTENTION_CLASSES: dict[str, type[CausalAttention]] = {
    "mha": MultiHeadAttention,
    "mqa": GroupedQueryAttention,
    "gqa": GroupedQueryAttention,
    "mla": MultiHeadLatentAttention,
    "gla2": GroupedLatentAttention,
    "gla4": GroupedLatentAttention,
    "gta": GroupedTiedAttention,
    "mfa": MultiMatrixFactorizationAttention,
    "tpa": TensorProductAttention,
}
