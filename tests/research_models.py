"""Transformers written the way research code writes them, for the name rules' tests: lucidrains'
``to_qkv``/``to_out``/``FeedForward.net``, diffusers' ``to_q``/``to_k``/``to_v``/``to_out.0``
with a cross-attention and a GEGLU ``ff.net``, and attention and MLP as alternating entries of one
``ModuleList`` with a fused ``to_kv`` and an ``ff``/``feed_forward``/``ffn`` Sequential, and
x-transformers' ``[norm, block]`` pairs with ``ff = Sequential(Sequential(Linear, GELU), ...)`` or a
``GLU``. Every
Linear has a bias, and every bias is non-zero (as in a checkpoint).

The attention core is one of: ``"einsum"`` (plain torch operators), ``"sdpa"``
(``F.scaled_dot_product_attention``, which a recorded forward reads), or ``"kernel"`` (a custom
``torch.autograd.Function``, as a fused kernel would be: the recording sees no attention in it).
Each attention keeps the q, k, v it computed last (``seen``), so a test can check a found
matrix against what the model's own forward used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32


class _AttentionKernel(torch.autograd.Function):
    """softmax(q kᵀ s) v computed where the recording cannot look (a stand-in for a fused
    kernel); its backward recomputes the same product under autograd."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        with torch._C.DisableTorchFunction():
            return _softmax_attention(q, k, v)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _softmax_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    logits = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5  # (B, h, T, T)
    return torch.einsum("bhij,bhjd->bhid", logits.softmax(dim=-1), v)  # (B, h, T, d_h)


def attend(core: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of (B, h, T, d_h) streams by the chosen ``core``."""
    if core == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if core == "kernel":
        return _AttentionKernel.apply(q, k, v)
    return _softmax_attention(q, k, v)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    batch, tokens, width = x.shape
    return x.view(batch, tokens, heads, width // heads).transpose(1, 2)  # (B, h, T, d_h)


def _merge(x: torch.Tensor) -> torch.Tensor:
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * head_dim)  # (B, T, h d_h)


def biased(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every bias of ``model`` set to non-zero random values, as in a trained checkpoint."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator) + 0.05)
    return model


class LanguageModel(nn.Module):
    """Embedding -> ``body(x)`` -> norm -> head; ``loss(tokens)`` is next-token cross-entropy."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(tokens))))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# --- lucidrains: to_qkv chunked in three, to_out = Sequential(Linear, Dropout), FeedForward.net ---


class LucidAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, core: str, names: tuple[str, str]):
        super().__init__()
        self.heads, self.core, self.names = heads, core, names
        inner = heads * dim_head  # need not be dim
        self.norm = nn.LayerNorm(dim)
        setattr(self, names[0], nn.Linear(dim, 3 * inner))
        setattr(self, names[1], nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0)))
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = getattr(self, self.names[0])(self.norm(x)).chunk(3, dim=-1)
        self.seen = (q.detach(), k.detach(), v.detach())
        out = attend(self.core, *(_heads(t, self.heads) for t in (q, k, v)))
        return getattr(self, self.names[1])(_merge(out))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(dim),
            nn.Linear(dim, hidden),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(hidden, dim),
            nn.Dropout(0.0),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Mixer(FeedForward):
    """The same MLP under a class name that says nothing (only a forward can tell its roles)."""


class Lucid(LanguageModel):
    """``layers = ModuleList([ModuleList([Attention, FeedForward])] * depth)``; ``names`` of the
    attention's two Linears (``("to_qkv", "to_out")``, or names no rule knows)."""

    def __init__(
        self,
        depth: int = 2,
        dim: int = 16,
        heads: int = 2,
        dim_head: int = 6,
        core: str = "einsum",
        names: tuple[str, str] = ("to_qkv", "to_out"),
        mlp: type[FeedForward] = FeedForward,
    ) -> None:
        super().__init__(dim)
        self.layers = nn.ModuleList(
            nn.ModuleList([LucidAttention(dim, heads, dim_head, core, names), mlp(dim, 3 * dim)])
            for _ in range(depth)
        )

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for attention, feed_forward in self.layers:  # type: ignore[misc]
            x = attention(x) + x
            x = feed_forward(x) + x
        return x


# --- diffusers: attn1 (self), attn2 (cross, is_cross_attention), ff.net = [GEGLU, Dropout, Linear] ---


class DiffusersAttention(nn.Module):
    def __init__(self, dim: int, heads: int, core: str, context_dim: int | None = None) -> None:
        super().__init__()
        self.heads, self.core = heads, core
        self.is_cross_attention = context_dim is not None
        source = context_dim or dim
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(source, dim)
        self.to_v = nn.Linear(source, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        source = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(source), self.to_v(source)
        self.seen = (q.detach(), k.detach(), v.detach())
        out = _merge(attend(self.core, *(_heads(t, self.heads) for t in (q, k, v))))
        for layer in self.to_out:
            out = layer(out)
        return out


class GEGLU(nn.Module):
    """diffusers' GEGLU: ``hidden, gate = proj(x).chunk(2)``; ``hidden * gelu(gate)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * hidden)
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, gate = self.proj(x).chunk(2, dim=-1)
        self.seen = (hidden.detach(), gate.detach())
        return hidden * F.gelu(gate)


class DiffusersFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, hidden), nn.Dropout(0.0), nn.Linear(hidden, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class DiffusersBlock(nn.Module):
    def __init__(self, dim: int, heads: int, context_dim: int, core: str) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim) for _ in range(3))
        self.attn1 = DiffusersAttention(dim, heads, core)
        self.attn2 = DiffusersAttention(dim, heads, core, context_dim=context_dim)
        self.ff = DiffusersFeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


class Diffusers(LanguageModel):
    """``transformer_blocks`` of self-attention, cross-attention to a fixed learned context, GEGLU."""

    def __init__(self, depth: int = 2, dim: int = 16, heads: int = 2, core: str = "einsum"):
        super().__init__(dim)
        context_dim = 12
        self.context = nn.Parameter(torch.randn(1, 5, context_dim))
        self.transformer_blocks = nn.ModuleList(
            DiffusersBlock(dim, heads, context_dim, core) for _ in range(depth)
        )

    def body(self, x: torch.Tensor) -> torch.Tensor:
        context = self.context.expand(x.shape[0], -1, -1)
        for block in self.transformer_blocks:
            x = block(x, context)
        return x


# --- alternating: layers = [Attention, FFBlock, Attention, FFBlock, ...], to_kv fused ---


class KVAttention(nn.Module):
    def __init__(self, dim: int, heads: int, core: str) -> None:
        super().__init__()
        self.heads, self.core = heads, core
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.to_out = nn.Linear(dim, dim)
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        q, (k, v) = self.to_q(x), self.to_kv(x).chunk(2, dim=-1)
        self.seen = (q.detach(), k.detach(), v.detach())
        return self.to_out(_merge(attend(self.core, *(_heads(t, self.heads) for t in (q, k, v)))))


class FFBlock(nn.Module):
    """A pre-norm MLP as ``nn.Sequential(Linear, act, Dropout, Linear)`` under ``name``."""

    def __init__(self, dim: int, name: str) -> None:
        super().__init__()
        self.name = name
        self.norm = nn.LayerNorm(dim)
        mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(4 * dim, dim)
        )
        setattr(self, name, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.name)(self.norm(x))


class Alternating(LanguageModel):
    """Attention and MLP as alternating entries of one ``ModuleList``; the MLP under ``mlp_name``."""

    def __init__(
        self,
        depth: int = 2,
        dim: int = 16,
        heads: int = 2,
        core: str = "einsum",
        mlp_name: str = "ff",
    ) -> None:
        super().__init__(dim)
        self.layers = nn.ModuleList(
            module
            for _ in range(depth)
            for module in (KVAttention(dim, heads, core), FFBlock(dim, mlp_name))
        )

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) + x
        return x


# --- x-transformers: layers = [[norm, Attention], [norm, FeedForward], ...], ff.0 a Sequential ---


class XAttention(nn.Module):
    def __init__(self, dim: int, heads: int, core: str) -> None:
        super().__init__()
        self.heads, self.core = heads, core
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        self.seen = (q.detach(), k.detach(), v.detach())
        return self.to_out(_merge(attend(self.core, *(_heads(t, self.heads) for t in (q, k, v)))))


class GLU(nn.Module):
    """x-transformers' GLU: ``x, gate = proj(x).chunk(2)``; ``x * act(gate)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * hidden)
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        self.seen = (value.detach(), gate.detach())
        return value * F.silu(gate)


class XFeedForward(nn.Module):
    """``ff = Sequential(project_in, Dropout, Dropout, Linear)``; ``project_in`` a
    ``Sequential(Linear, GELU)``, or a :class:`GLU`."""

    def __init__(self, dim: int, hidden: int, glu: bool) -> None:
        super().__init__()
        project_in = GLU(dim, hidden) if glu else nn.Sequential(nn.Linear(dim, hidden), nn.GELU())
        self.ff = nn.Sequential(
            project_in, nn.Dropout(0.0), nn.Dropout(0.0), nn.Linear(hidden, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class XTransformers(LanguageModel):
    """``layers = ModuleList([ModuleList([LayerNorm, XAttention | XFeedForward])] * 2 depth)``."""

    def __init__(self, depth: int = 2, dim: int = 16, core: str = "einsum", glu: bool = False):
        super().__init__(dim)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(dim), block])
            for _ in range(depth)
            for block in (XAttention(dim, 2, core), XFeedForward(dim, 2 * dim, glu))
        )

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for norm, block in self.layers:  # type: ignore[misc]
            x = block(norm(x)) + x
        return x


# --- plain: blocks = ModuleList([Block(attn, mixer)]), for names no rule knows ---


class PlainBlock(nn.Module):
    def __init__(self, dim: int, names: tuple[str, str], mlp: type[FeedForward], core: str):
        super().__init__()
        self.attn = LucidAttention(dim, 2, dim // 2, core, names)
        self.mixer = mlp(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x) + x
        return self.mixer(x) + x


class Plain(LanguageModel):
    """``blocks = ModuleList([PlainBlock] * depth)``: attention ``attn.<names>``, MLP ``mixer.net``."""

    def __init__(
        self,
        depth: int = 2,
        dim: int = 16,
        core: str = "sdpa",
        names: tuple[str, str] = ("to_qkv", "to_out"),
        mlp: type[FeedForward] = FeedForward,
    ) -> None:
        super().__init__(dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, names, mlp, core) for _ in range(depth))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class PlainUnnamed(Plain):
    """Names no rule knows (``attn.mix``, ``attn.back.0``, ``mixer.net`` of a ``Mixer``), read by
    a forward through ``scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__(names=("mix", "back"), mlp=Mixer)


def tokens(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    """Random token ids, (batch, length)."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
