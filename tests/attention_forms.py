"""Attention, MLP and block forms written from the math, for the catalogue of what the forward shows.

Each :class:`Form` builds a small model (width 32, 4 heads of 8, biased projections) whose attention
is written one way (``einsum``, ``@`` with a transpose, ``bmm``, ``baddbmm``, SDPA; softmax,
``log_softmax().exp()``, sigmoid, none: linear attention), with its blocks arranged one way
(alternating list entries, parallel, shared) and its MLP one way (``nn.Sequential``, a chunk-split
GLU, a gated triple, weights cast on the way), and says what the reader must find: the roles of
each layer, the weight and rows behind each, the query and K/V heads, the kind of call. A new form
is one more entry of ``FORMS``. ``tests/targets/test_attention_catalogue.py`` checks each;
``benchmarks/attention_catalogue.py`` prints the table of docs/targets.md from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

D, H, HS, T = 32, 4, 8, 6  # width, heads, head size, tokens of the example input
G = 2  # K/V heads of the grouped forms

Weights = dict[str, tuple[str, tuple[int, ...] | None]]  # role -> (parameter, rows or None: all)


@dataclass(frozen=True)
class Form:
    """One way of writing a transformer, and what reading its forward must give.

    Attributes:
        name: the form, as the catalogue table says it.
        build: a new model (random weights, non-zero biases); it takes ``(B, T, D)`` floats.
        layers: the layers the forward shows.
        weights: per layer, each role's parameter and rows (``None``: all rows).
        heads: (query heads, K/V heads) of every attention call.
        kind: the kind of call read (``targets/attention.py``).
        structure_only: no name rule knows any of its weights: the forward alone decides
            even with the rules on (the others' MLPs, ``mlp.*``, are known to the rules).
        calls: attention calls in one forward where more than ``layers`` (a shared layer).
    """

    name: str
    build: Callable[[], nn.Module]
    layers: int
    weights: Callable[[int], Weights]
    heads: tuple[int, int] = (H, H)
    kind: str = "softmax"
    structure_only: bool = False
    calls: int = 0

    @property
    def call_count(self) -> int:
        return self.calls or self.layers


def causal(length: int) -> torch.Tensor:
    """``(T, T)`` True above the diagonal: the positions a token may not attend to."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)


def split_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    B, L, C = x.shape
    return x.view(B, L, n, C // n).transpose(1, 2)  # (B, n, T, hs)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    B, n, L, hs = y.shape
    return y.transpose(1, 2).reshape(B, L, n * hs)  # (B, T, n * hs)


class Residual(nn.Module):
    """``x + f(x)`` for each entry of one ``ModuleList`` in turn (attention and MLP entries)."""

    def __init__(self, entries: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(entries)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for entry in self.layers:
            x = x + entry(x)
        return x


class SequentialMLP(nn.Module):
    """``nn.Sequential(Linear, act, Dropout, Linear)``."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(D, 4 * D), act or nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * D, D)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ChunkGLU(nn.Module):
    """``e`` holds ``[up; gate]``: ``f(up * silu(gate))``."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.f = nn.Linear(D, 4 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.e(x).chunk(2, dim=-1)
        return self.f(up * F.silu(gate))


# --- 1. the issue's form: einsum, masked_fill, softmax, to_q/to_k/to_v/to_out, alternating -------


class EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = H  # not a name the circuits look up: the forward's shapes tell it
        self.to_q, self.to_k, self.to_v = (nn.Linear(D, D) for _ in range(3))
        self.to_out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), self.heads) for p in (self.to_q, self.to_k, self.to_v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * HS**-0.5
        sim = sim.masked_fill(causal(x.shape[1]), float("-inf"))
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(merge_heads(out))


def issue_form() -> nn.Module:
    return Residual([EinsumAttention(), SequentialMLP(), EinsumAttention(), SequentialMLP()])


def _issue_weights(layer: int) -> Weights:
    a, f = f"layers.{2 * layer}", f"layers.{2 * layer + 1}.net"
    roles = {"Q": "to_q", "K": "to_k", "V": "to_v", "O": "to_out"}
    found: Weights = {role: (f"{a}.{name}.weight", None) for role, name in roles.items()}
    return found | {"MLP_up": (f"{f}.0.weight", None), "MLP_down": (f"{f}.3.weight", None)}


# --- 2. the same math with names no rule knows, heads after positions, where(), a chunk GLU --------


class Anonymous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(D, D) for _ in range(4))
        self.g = ChunkGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, H, HS) for p in (self.a, self.b, self.c))  # (B, T, nh, hs)
        logits = torch.einsum("xqhc,xkhc->xhqk", q, k) / math.sqrt(HS)
        logits = torch.where(causal(L), float("-inf"), logits)
        mixed = torch.einsum("xhqk,xkhc->xqhc", logits.softmax(-1), v)
        x = x + self.d(mixed.reshape(B, L, D))
        return x + self.g(x)


def anonymous_form() -> nn.Module:
    return nn.ModuleDict({key: Anonymous() for key in "uv"})


class _Keyed(nn.Module):
    """Blocks in a ModuleDict under letters: no index a rule could count."""

    def __init__(self) -> None:
        super().__init__()
        self.z = anonymous_form()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.z.values():
            x = block(x)
        return x


def _anonymous_weights(layer: int) -> Weights:
    b = f"z.{'uv'[layer]}"
    roles = {"Q": "a", "K": "b", "V": "c", "O": "d"}
    found: Weights = {role: (f"{b}.{name}.weight", None) for role, name in roles.items()}
    return found | {
        "MLP_gate": (f"{b}.g.e.weight", tuple(range(2 * D, 4 * D))),
        "MLP_up": (f"{b}.g.e.weight", tuple(range(2 * D))),
        "MLP_down": (f"{b}.g.f.weight", None),
    }


# --- 3. nanoGPT: fused [q; k; v], view(B, T, n, C // n), q @ k^T, masked_fill, Sequential MLP ----


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nh = H  # the head count in an attribute of its own name
        self.mix, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.mix(x).split(C, dim=2)
        q, k, v = (t.view(B, L, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(causal(L), float("-inf"))
        y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        return self.out(y.transpose(1, 2).contiguous().view(B, L, C))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = FusedAttention(), SequentialMLP(nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def nanogpt_form() -> nn.Module:
    return Residual([NanoBlock(), NanoBlock()])


def _nanogpt_weights(layer: int) -> Weights:
    b = f"layers.{layer}"
    fused = f"{b}.attn.mix.weight"
    return {
        "Q": (fused, tuple(range(D))),
        "K": (fused, tuple(range(D, 2 * D))),
        "V": (fused, tuple(range(2 * D, 3 * D))),
        "O": (f"{b}.attn.out.weight", None),
        "MLP_up": (f"{b}.mlp.net.0.weight", None),
        "MLP_down": (f"{b}.mlp.net.3.weight", None),
    }


class _Block(nn.Module):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``: a pre-norm block around any attention."""

    def __init__(self, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention, self.mlp = attention, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.n1(x))
        return x + self.mlp(self.n2(x))


def _stack(
    attention: Callable[[], nn.Module], mlp: Callable[[], nn.Module] = SequentialMLP
) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return Residual([_Block(attention(), mlp()) for _ in range(2)])

    return build


def _block_weights(names: str = "stuw") -> Callable[[int], Weights]:
    def weights(layer: int) -> Weights:
        b = f"layers.{layer}"
        found: Weights = {
            role: (f"{b}.attention.{name}.weight", None)
            for role, name in zip("QKVO", names, strict=True)
        }
        return found | {
            "MLP_up": (f"{b}.mlp.net.0.weight", None),
            "MLP_down": (f"{b}.mlp.net.3.weight", None),
        }

    return weights


class _Projections(nn.Module):
    """Four biased projections ``s``, ``t``, ``u`` (query, key, value) and ``w`` (output)."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.t, self.u, self.w = (nn.Linear(D, D) for _ in range(4))


# --- 4. bmm on (B * H, T, d), the scale after the product ---------------------------------------


class BmmAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = (split_heads(p(x), H).reshape(B * H, L, HS) for p in (self.s, self.t, self.u))
        w = torch.bmm(q, k.transpose(1, 2)) * HS**-0.5  # (B * nh, T, T)
        w = w.masked_fill(causal(L), float("-inf")).softmax(-1)
        y = torch.bmm(w, v).view(B, H, L, HS)
        return self.w(merge_heads(y))


# --- 5. baddbmm with an ALiBi bias, the scale as its alpha ------------------------------------


class AlibiAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = (split_heads(p(x), H).reshape(B * H, L, HS) for p in (self.s, self.t, self.u))
        slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1) / H)  # (nh,)
        distance = (torch.arange(L)[None, :] - torch.arange(L)[:, None]).clamp(max=0)
        alibi = (slopes[:, None, None] * distance).repeat(B, 1, 1)  # (B * nh, T, T)
        w = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=1.0, alpha=HS**-0.5)
        w = w.masked_fill(causal(L), float("-inf")).softmax(-1)
        return self.w(merge_heads(torch.bmm(w, v).view(B, H, L, HS)))


# --- 6. a float32 upcast around the softmax, torch.where's mask, the scale before the product -----


class UpcastAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        scores = (q * HS**-0.5) @ k.transpose(-1, -2)
        scores = torch.where(causal(x.shape[1]), torch.finfo(scores.dtype).min, scores)
        w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.w(merge_heads(torch.matmul(w, v)))


# --- 7. an additive mask, log_softmax().exp() ----------------------------------------------------


class LogSoftmaxAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        mask = torch.zeros(x.shape[1], x.shape[1]).masked_fill(causal(x.shape[1]), float("-inf"))
        scores = q @ k.transpose(-2, -1) / HS**0.5 + mask
        return self.w(merge_heads(scores.log_softmax(-1).exp() @ v))


# --- 8. sigmoid attention (a bias of -log T, no softmax) ---------------------------------------


class SigmoidAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        scores = torch.einsum("...id,...jd->...ij", q, k) * HS**-0.5 - math.log(x.shape[1])
        w = torch.sigmoid(scores).masked_fill(causal(x.shape[1]), 0.0)
        return self.w(merge_heads(torch.einsum("...ij,...jd->...id", w, v)))


# --- 9. grouped-query einsum: K/V heads an axis of their own -----------------------------------


class GroupedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s, self.w = nn.Linear(D, D), nn.Linear(D, D)
        self.t, self.u = nn.Linear(D, G * HS), nn.Linear(D, G * HS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.s(x).view(B, L, G, H // G, HS).permute(0, 2, 3, 1, 4)  # (B, g, r, T, hs)
        k, v = (split_heads(p(x), G) for p in (self.t, self.u))  # (B, g, T, hs)
        scores = torch.einsum("bgrid,bgjd->bgrij", q, k) * HS**-0.5
        w = scores.masked_fill(causal(L), float("-inf")).softmax(-1)
        y = torch.einsum("bgrij,bgjd->bgrid", w, v).reshape(B, H, L, HS)
        return self.w(merge_heads(y))


# --- 10. parallel block (GPT-J, PaLM): attention and a SwiGLU MLP read one normalised input ------


class ParallelBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = nn.LayerNorm(D)
        self.attention = _Projections()
        self.g, self.u, self.w = nn.Linear(D, 2 * D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n(x)
        a = self.attention
        q, k, v = (split_heads(p(h), H) for p in (a.s, a.t, a.u))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + a.w(merge_heads(y)) + self.w(F.silu(self.g(h)) * self.u(h))


def parallel_form() -> nn.Module:
    return nn.Sequential(ParallelBlock(), ParallelBlock())


def _parallel_weights(layer: int) -> Weights:
    b = str(layer)
    found: Weights = {
        role: (f"{b}.attention.{name}.weight", None)
        for role, name in zip("QKVO", "stuw", strict=True)
    }
    return found | {
        "MLP_gate": (f"{b}.g.weight", None),
        "MLP_up": (f"{b}.u.weight", None),
        "MLP_down": (f"{b}.w.weight", None),
    }


# --- 11. a shared layer (ALBERT): one block run three times -------------------------------------


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block(BmmAttention(), SequentialMLP())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.block(x)
        return x


def _shared_weights(layer: int) -> Weights:
    found: Weights = {
        role: (f"block.attention.{name}.weight", None)
        for role, name in zip("QKVO", "stuw", strict=True)
    }
    return found | {
        "MLP_up": ("block.mlp.net.0.weight", None),
        "MLP_down": ("block.mlp.net.3.weight", None),
    }


# --- 12. weights stored in bfloat16, cast on the way: F.linear(x, W.to(x.dtype), b.to(x.dtype)) --


class Cast(nn.Linear):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class CastAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s, self.t, self.u, self.w = (Cast(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        w = (q @ k.mT * HS**-0.5).masked_fill(causal(x.shape[1]), float("-inf")).softmax(-1)
        return self.w(merge_heads(w @ v))


class CastMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Cast(D, 4 * D), nn.GELU(), nn.Dropout(0.1), Cast(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# --- 13. linear attention: elu(x) + 1 on queries and keys, keys and values first ---------------


class LinearAttention(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = torch.einsum("bhnd,bhne->bhde", k, v)  # keys and values over positions
        norm = torch.einsum("bhnd,bhd->bhn", q, k.sum(dim=2)).unsqueeze(-1)
        y = torch.einsum("bhnd,bhde->bhne", q, state) / norm
        return self.w(merge_heads(y))


# --- 14. softmax written out: exp(s - max) / sum ------------------------------------------------


class WrittenSoftmax(_Projections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), H) for p in (self.s, self.t, self.u))
        s = torch.matmul(q, k.transpose(2, 3)) * HS**-0.5
        e = (s - s.amax(-1, keepdim=True)).exp().masked_fill(causal(x.shape[1]), 0.0)
        return self.w(merge_heads((e / e.sum(-1, keepdim=True)) @ v))


FORMS: tuple[Form, ...] = (
    Form(
        "einsum `b h i d, b h j d -> b h i j`, masked_fill, softmax; to_q/to_k/to_v/to_out; "
        "attention and `Sequential(Linear, GELU, Dropout, Linear)` alternating in one ModuleList",
        issue_form, 2, _issue_weights,
    ),
    Form(
        "einsum `xqhc,xkhc->xhqk` (heads after positions), torch.where mask; names a/b/c/d; "
        "chunk-split GLU; blocks in a ModuleDict under letters",
        _Keyed, 2, _anonymous_weights, structure_only=True,
    ),
    Form(
        "nanoGPT: fused [q; k; v] split, view(B, T, n, C // n) with n in `self.nh`, "
        "q @ k.transpose(-2, -1), masked_fill",
        nanogpt_form, 2, _nanogpt_weights,
    ),
    Form("bmm on (B·H, T, d), scale after the product", _stack(BmmAttention), 2, _block_weights()),
    Form(
        "baddbmm with an ALiBi bias (scale as alpha)", _stack(AlibiAttention), 2, _block_weights()
    ),
    Form(
        "float32 softmax and the cast back, torch.where mask, scale before the product",
        _stack(UpcastAttention), 2, _block_weights(),
    ),
    Form(
        "additive mask, log_softmax().exp()", _stack(LogSoftmaxAttention), 2, _block_weights(),
        kind="log_softmax",
    ),
    Form(
        "sigmoid attention, einsum with `...`", _stack(SigmoidAttention), 2, _block_weights(),
        kind="sigmoid",
    ),
    Form(
        "grouped-query einsum `bgrid,bgjd->bgrij` (K/V heads an axis of their own)",
        _stack(GroupedAttention), 2, _block_weights(), heads=(H, G),
    ),
    Form(
        "parallel block (GPT-J/PaLM): SDPA and a SwiGLU MLP on one normalised input",
        parallel_form, 2, _parallel_weights, kind="scaled_dot_product_attention",
        structure_only=True,
    ),
    Form(
        "shared layer (ALBERT): one block (bmm attention) run three times",
        Shared, 1, _shared_weights, calls=3,
    ),
    Form(
        "bfloat16 weights cast on the way: F.linear(x, W.to(x.dtype), b.to(x.dtype)), q @ k.mT",
        _stack(CastAttention, CastMLP), 2, _block_weights(),
    ),
    Form(
        "linear attention: elu(x) + 1 feature map, keys and values contracted first",
        _stack(LinearAttention), 2, _block_weights(), kind="linear",
    ),
    Form(
        "softmax written out: exp(s - max) / sum", _stack(WrittenSoftmax), 2, _block_weights(),
        kind="exp",
    ),
)  # fmt: skip


def example_input(batch: int = 2) -> torch.Tensor:
    """``(batch, T, D)`` floats, the same for every call."""
    return torch.randn(batch, T, D, generator=torch.Generator().manual_seed(0))
