"""A small GPT in the nanoGPT layout with pluggable attention (the D8/D12/D16 reference family).

Parameter names are nanoGPT's: ``transformer.wte``, ``transformer.wpe``, blocks at
``transformer.h.{i}`` with ``ln_1``, ``attn``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, then
``transformer.ln_f`` and ``lm_head`` (tied to ``wte``). The attention module is chosen by
``GPTConfig.attention``; its classes and role maps live in ``attention.py``.

Example::

    >>> model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, attention="gqa"))
    >>> logits, loss = model(torch.zeros(3, 16, dtype=torch.long), torch.zeros(3, 16, dtype=torch.long))
    >>> tuple(logits.shape), loss.ndim
    ((3, 16, 256), 0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from attention import ATTENTION_CLASSES
from torch import Tensor, nn

INITS = ("gpt", "zero_out", "normal")


@dataclass
class GPTConfig:
    """Shape of the model. ``None`` fields take the variant's published default (see properties)."""

    vocab_size: int = 256  # bytes: any text trains with no tokenizer to download
    block_size: int = 1024  # context in bytes (~256 BPE tokens of GPT-2)
    n_layer: int = 8  # D8 of the reference family (8, 12, 16 layers)
    n_head: int = 12  # head_dim 64, as in GPT-2 and nanoGPT
    n_embd: int = 768  # the reference D8 width (arXiv:2604.22778)
    dropout: float = 0.0  # pretraining on this much data does not overfit; keep the math exact
    bias: bool = False  # no biases in Linear layers: a bit faster, no worse (nanoGPT's finding)
    attention: str = "mha"  # one of attention.ATTENTION_CLASSES
    n_kv_head: int | None = None  # K/V heads of gqa/gta; default half the query heads (mqa: 1)
    q_lora_rank: int | None = (
        None  # query latent of mla/mfa; default n_embd // 2 (DeepSeek-V2 ~0.3 d)
    )
    kv_lora_rank: int | None = (
        None  # K/V latent of mla/gla; default 4 * head_dim (MLA paper: d_c = 4 d_h)
    )
    qk_nope_head_dim: int | None = (
        None  # non-rotary q/k channels per head (mla/gla); default head_dim
    )
    qk_rope_head_dim: int | None = (
        None  # rotary q/k channels (mla/gla/gta); default head_dim // 2 (DeepSeek 128/64)
    )
    v_head_dim: int | None = None  # value channels per head (mla/gla); default head_dim
    tpa_q_rank: int = 6  # R_q of TPA (the paper's default)
    tpa_kv_rank: int = 2  # R_k = R_v of TPA (the paper's default)
    init: str = "gpt"  # "gpt": GPT-2's N(0, 0.02) with residual outputs scaled by 1/sqrt(2L);
    # "zero_out": residual output projections start at zero; "normal": N(0, 0.02) everywhere (ablation)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_CLASSES:
            raise ValueError(
                f"`attention` must be one of {sorted(ATTENTION_CLASSES)}, got {self.attention!r}"
            )
        if self.init not in INITS:
            raise ValueError(f"`init` must be one of {INITS}, got {self.init!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"`n_embd` ({self.n_embd}) must be a multiple of `n_head` ({self.n_head})"
            )
        if self.n_head % self.kv_heads:
            raise ValueError(
                f"`n_head` ({self.n_head}) must be a multiple of `n_kv_head` ({self.kv_heads})"
            )
        if self.n_head % self.latent_groups or self.kv_rank % self.latent_groups:
            raise ValueError(
                f"attention={self.attention!r} needs `n_head` ({self.n_head}) and `kv_lora_rank` "
                f"({self.kv_rank}) to be multiples of its {self.latent_groups} latent groups"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(
                f"`qk_rope_head_dim` must be even and <= head_dim ({self.head_dim}), got {self.rope_dim}"
            )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        if self.attention in ("mqa", "mfa"):
            return 1
        if self.attention in ("gqa", "gta"):
            return self.n_kv_head or max(1, self.n_head // 2)
        return self.n_head

    @property
    def latent_groups(self) -> int:
        return {"gla2": 2, "gla4": 4}.get(self.attention, 1)

    @property
    def q_rank(self) -> int:
        return self.q_lora_rank or self.n_embd // 2

    @property
    def kv_rank(self) -> int:
        return self.kv_lora_rank or 4 * self.head_dim

    @property
    def nope_dim(self) -> int:
        return self.qk_nope_head_dim or self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.head_dim // 2 if self.qk_rope_head_dim is None else self.qk_rope_head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)  # MLP_up
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)  # MLP_down
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = ATTENTION_CLASSES[config.attention](config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # pre-norm residual stream, as GPT-2
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (Press & Wolf 2017)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize as ``config.init`` says; called by ``__init__``."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if self.config.init == "normal":
            return
        # Residual output projections: each block adds two to the residual stream, so GPT-2 scales
        # their init by 1/sqrt(2L) to keep its variance independent of depth; "zero_out" starts
        # every block as the identity instead.
        for name, param in self.named_parameters():
            if name.endswith(("attn.c_proj.weight", "attn.o_proj.weight", "mlp.c_proj.weight")):
                if self.config.init == "gpt":
                    nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
                else:
                    nn.init.zeros_(param)

    def num_params(self) -> int:
        """Parameters without the position embedding (counted the nanoGPT way; wte is tied)."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size {self.config.block_size}: "
                "pass shorter sequences or build the model with a larger block_size"
            )
        pos = torch.arange(t, device=idx.device)
        tokens, positions = (
            self.transformer.wte(idx),
            self.transformer.wpe(pos),
        )  # (B, T, d), (T, d)
        x = self.transformer.drop(tokens + positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
