"""Small GPTs whose attention survives tensor parallelism, and how the tests shard them.

``TinyTPGPT(fused=True)`` stores Q/K/V in one GPT-NeoX ``query_key_value`` interleaved per head
``(heads, 3, head_dim)``, so a column-parallel shard holds whole heads of all three (the layout
Megatron uses for tensor parallelism); ``fused=False`` has Llama's separate ``q_proj``/``k_proj``/
``v_proj``. The forward reads the number of heads from the local tensor, so the same module runs
whole or tensor-parallel. ``gpt2`` is Hugging Face's GPT-2 (``Conv1D`` stored ``(in, out)``, fused
``c_attn``) and ``nanogpt`` the example GPT (``Linear`` ``c_attn`` rows ``[q; k; v]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

VOCAB, BLOCK = 256, 16


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.fused = heads, d // heads, fused
        if fused:
            self.query_key_value = nn.Linear(d, 3 * d, bias=False)
            self.dense = nn.Linear(d, d, bias=False)
        else:
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        if self.fused:
            qkv = self.query_key_value(x).view(B, T, -1, 3, hd)  # (B, T, heads here, 3, hd)
            q, k, v = qkv.unbind(3)
        else:
            q, k, v = (p(x).view(B, T, -1, hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads here, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, heads here * hd)
        return (self.dense if self.fused else self.o_proj)(y)


class MLP(nn.Module):
    def __init__(self, d: int, fused: bool) -> None:
        super().__init__()
        names = ("dense_h_to_4h", "dense_4h_to_h") if fused else ("up_proj", "down_proj")
        self.up_name, self.down_name = names
        setattr(self, names[0], nn.Linear(d, 4 * d, bias=False))
        setattr(self, names[1], nn.Linear(4 * d, d, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(F.gelu(getattr(self, self.up_name)(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attention = Attention(d, heads, fused)
        self.mlp = MLP(d, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyTPGPT(nn.Module):
    def __init__(self, n_layer: int = 2, d: int = 128, heads: int = 4, fused: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(BLOCK, d)
        self.layers = nn.ModuleList(Block(d, heads, fused) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.layers:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T  # tied output  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(name: str, d: int = 128) -> tuple[nn.Module, Any]:
    """The model and a ``loss(model, x, y)`` function."""
    if name in ("neox", "llama"):
        return TinyTPGPT(d=d, fused=name == "neox"), lambda model, x, y: model(x, y)
    if name == "nanogpt":
        from gpt import GPT, GPTConfig

        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=d, block_size=BLOCK))
        return model, lambda model, x, y: model(x, y)[1]
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=BLOCK,
            n_embd=d,
            n_layer=2,
            n_head=4,
            attn_pdrop=0.0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
        )
        return GPT2LMHeadModel(config), lambda model, x, y: model(x, labels=x).loss
    raise ValueError(name)


def blocks(model: nn.Module) -> list[nn.Module]:
    for path in ("layers", "transformer.h"):
        found: Any = model
        for part in path.split("."):
            found = getattr(found, part, None)
        if found is not None:
            return list(found)
    raise ValueError(type(model).__name__)


def shard(model: nn.Module, how: str, mesh: Any) -> None:
    """``fsdp``: ``fully_shard`` per block and the root; ``tp``: column/row-parallel blocks."""
    if how == "fsdp":
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    for block in blocks(model):
        attention, mlp = block.attention, block.mlp
        plan = {"mlp." + mlp.up_name: ColwiseParallel(), "mlp." + mlp.down_name: RowwiseParallel()}
        if attention.fused:
            plan["attention.query_key_value"] = ColwiseParallel()
            plan["attention.dense"] = RowwiseParallel()
        else:
            plan.update({f"attention.{p}_proj": ColwiseParallel() for p in "qkv"})
            plan["attention.o_proj"] = RowwiseParallel()
        parallelize_module(block, mesh, plan)


def full_matrix(target: Any) -> torch.Tensor:
    """The whole current matrix of a target, gathered (test-only: a training-group collective)."""
    parameter = target.parameter.detach()
    whole = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
    if whole.dim() == 3:  # a 3-D experts tensor: the target's expert's slice
        whole = whole[target.expert]
    return target.rows.take(whole).double().clone()


def exact_metrics(matrix: torch.Tensor, k: int) -> dict[str, float]:
    """The reference: the metrics of the top ``k`` of a float64 full SVD, and the exact ‖W‖_F²."""
    from spectral_callbacks.functional import metrics_from_spectrum

    matrix = matrix.double()
    values = metrics_from_spectrum(torch.linalg.svdvals(matrix)[:k], (matrix**2).sum())
    return {name: float(value) for name, value in values.items()}
