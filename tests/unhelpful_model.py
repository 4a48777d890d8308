"""A transformer written with deliberately unhelpful names, for roles read from data flow.

Blocks live in an ``nn.ModuleDict`` under arbitrary keys; every weight is ``a``, ``b``, ``c``...;
the attention projection is fused per key/value group as ``[q x g; k; v]`` (``g`` query heads per
group), rotary embeddings mix q and k within each head, and the MLP is a GLU stored ``[up; gate]``.
No name rule can read it: only the forward pass says which rows are which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Adapted(nn.Module):
    """A hand-made LoRA layer: ``u`` frozen, ``x u^T + 0.5 (x v^T) w^T``; no library's names."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.u = nn.Parameter(torch.randn(width, width) / width**0.5, requires_grad=False)
        self.v = nn.Parameter(torch.randn(rank, width) / width**0.5)
        self.w = nn.Parameter(torch.randn(width, rank) / rank**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.u.T + 0.5 * (x @ self.v.T) @ self.w.T


class Block(nn.Module):
    def __init__(
        self, width: int, heads: int, groups: int, hidden: int, adapted: bool = False
    ) -> None:
        super().__init__()
        self.heads, self.groups, self.size = heads, groups, width // heads
        per_group = heads // groups + 2  # [q x g; k; v]
        self.n = nn.RMSNorm(width)
        self.a = nn.Linear(width, groups * per_group * self.size, bias=False)
        self.b = Adapted(width) if adapted else nn.Linear(width, width, bias=False)
        self.m = nn.RMSNorm(width)
        self.c = nn.Linear(width, 2 * hidden, bias=False)  # [up; gate]
        self.d = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        g = self.heads // self.groups
        h = self.a(self.n(x)).view(B, T, self.groups, g + 2, self.size)
        q = h[:, :, :, :g].reshape(B, T, self.heads, self.size).transpose(1, 2)  # (B, nh, T, hs)
        k = h[:, :, :, g].transpose(1, 2)  # (B, groups, T, hs)
        v = h[:, :, :, g + 1].transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.b(y.transpose(1, 2).reshape(B, T, C))
        up, gate = self.c(self.m(x)).chunk(2, dim=-1)
        return x + self.d(up * F.silu(gate))


class Unhelpful(nn.Module):
    """``e`` embeds, ``z`` (a ModuleDict keyed ``p``, ``q``, ``r``...) holds the blocks, ``o`` reads out;
    ``adapted=True`` makes each block's output projection ``b`` a hand-made LoRA layer."""

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        groups: int = 2,
        layers: int = 3,
        adapted: bool = False,
    ) -> None:
        super().__init__()
        self.e = nn.Embedding(vocab, width)
        keys = "pqrstuvwxyzabcdefghijklmno"[:layers]  # not numbers: no rule can count them
        self.z = nn.ModuleDict(
            {key: Block(width, heads, groups, 3 * width, adapted) for key in keys}
        )
        self.f = nn.RMSNorm(width)
        self.o = nn.Linear(width, vocab, bias=False)
        self.size = width // heads

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        angle = torch.arange(T)[:, None] / 10_000 ** (torch.arange(self.size // 2) / self.size)
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # (T, hs)
        x = self.e(tokens)
        for block in self.z.values():
            x = block(x, cos, sin)
        return self.o(self.f(x))
