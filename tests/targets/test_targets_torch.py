"""find_targets on plain PyTorch transformers: nanoGPT, torch.nn.TransformerEncoder, timm-style ViT.

The blocks below are written the way nanoGPT's ``model.py`` and timm's ``vision_transformer.py``
write them (timm is not installed). Each forward pass hands q, k, v to
``F.scaled_dot_product_attention``; the tests intercept that call and compare what the model
attended with against ``x @ Target.matrix().T`` split per head.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spectral_callbacks.targets import PartialTargetWarning, find_targets

SDPA = F.scaled_dot_product_attention


@pytest.fixture
def attention_inputs(monkeypatch):
    """Every (q, k, v) handed to F.scaled_dot_product_attention, in call order."""
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def capture(q, k, v, *args, **kwargs):
        calls.append((q.detach(), k.detach(), v.detach()))
        return SDPA(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", capture)
    return calls


def per_head(y: torch.Tensor, heads: int) -> torch.Tensor:
    B, T, _ = y.shape
    return y.view(B, T, heads, -1).transpose(1, 2)  # (B, h, T, d)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


# --- nanoGPT (karpathy/nanoGPT model.py, trimmed) -------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = NanoMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self, n_layer: int = 3, n_embd: int = 32, n_head: int = 4, vocab: int = 40
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(16, n_embd),
                h=nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --- timm-style ViT (timm/models/vision_transformer.py, trimmed) --------------------------------


class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, h, N, hd)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class TimmMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, num_heads)
        self.mlp = TimmMlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmViT(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 32, num_heads: int = 4, patch: int = 8) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(images).flatten(2).transpose(1, 2)  # (B, N, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def record_inputs(modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    inputs: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        module.register_forward_hook(
            lambda mod, args, out, name=name: inputs.__setitem__(name, args[0].detach())
        )
    return inputs


def by_key(targets):
    return {(t.layer, t.role): t for t in targets}


def test_nanogpt_split_matches_attention(attention_inputs):
    torch.manual_seed(0)
    model = NanoGPT()
    targets = find_targets(model)
    assert [(t.layer, t.role) for t in targets] == [
        (i, r) for i in range(3) for r in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    ]
    inputs = record_inputs(
        {f"{i}": block.attn.c_attn for i, block in enumerate(model.transformer.h)}
    )
    model(torch.randint(0, 40, (2, 6)))
    found = by_key(targets)
    for layer, (q, k, v) in enumerate(attention_inputs):
        x, bias = inputs[f"{layer}"], model.transformer.h[layer].attn.c_attn.bias
        for i, (role, state) in enumerate(zip("QKV", (q, k, v), strict=True)):
            y = x @ found[(layer, role)].matrix().T + bias[32 * i : 32 * (i + 1)]
            close(per_head(y, 4), state)
    # contiguous q|k|v rows are views of c_attn, not copies
    c_attn = model.transformer.h[0].attn.c_attn.weight
    assert found[(0, "V")].matrix().data_ptr() == c_attn[64].data_ptr()


def test_timm_vit_split_matches_attention_and_mlp(attention_inputs):
    torch.manual_seed(1)
    model = TimmViT()
    targets = find_targets(model)
    assert [(t.layer, t.role) for t in targets] == [
        (i, r) for i in range(2) for r in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    ]
    blocks = list(model.blocks)
    inputs = record_inputs({f"qkv{i}": b.attn.qkv for i, b in enumerate(blocks)})
    fc1 = {}
    blocks[1].mlp.fc1.register_forward_hook(lambda m, a, o: fc1.update(x=a[0], y=o))
    model(torch.randn(2, 3, 16, 16))
    found = by_key(targets)
    for layer, (q, k, v) in enumerate(attention_inputs):
        bias = blocks[layer].attn.qkv.bias
        for i, (role, state) in enumerate(zip("QKV", (q, k, v), strict=True)):
            y = (
                inputs[f"qkv{layer}"] @ found[(layer, role)].matrix().T
                + bias[32 * i : 32 * (i + 1)]
            )
            close(per_head(y, 4), state)
    close(fc1["x"] @ found[(1, "MLP_up")].matrix().T + blocks[1].mlp.fc1.bias, fc1["y"])
    text = {s.parameter_name: s.reason for s in targets.skipped}
    assert set(text) == {"cls_token", "pos_embed", "patch_embed.proj.weight", "head.weight"}
    assert text["head.weight"] == "output head"


def test_transformer_encoder_in_proj_matches_attention(attention_inputs):
    torch.manual_seed(2)
    layer = nn.TransformerEncoderLayer(
        d_model=16, nhead=4, dim_feedforward=24, dropout=0.0, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    targets = find_targets(model)
    assert [(t.layer, t.role, t.shape) for t in targets if t.layer == 0] == [
        (0, "Q", (16, 16)),
        (0, "K", (16, 16)),
        (0, "V", (16, 16)),
        (0, "O", (16, 16)),
        (0, "MLP_up", (24, 16)),
        (0, "MLP_down", (16, 24)),
    ]
    inputs = record_inputs({f"{i}": block.self_attn for i, block in enumerate(model.layers)})
    model(torch.randn(2, 5, 16))  # training mode with grad: the Python path, which calls SDPA
    found = by_key(targets)
    assert len(attention_inputs) == 2
    for i, (q, k, v) in enumerate(attention_inputs):
        x, bias = inputs[f"{i}"], model.layers[i].self_attn.in_proj_bias
        for j, (role, state) in enumerate(zip("QKV", (q, k, v), strict=True)):
            y = x @ found[(i, role)].matrix().T + bias[16 * j : 16 * (j + 1)]
            close(per_head(y, 4), state)


def test_multihead_attention_with_separate_kdim_vdim():
    attention = nn.MultiheadAttention(embed_dim=8, num_heads=2, kdim=4, vdim=6)
    targets = find_targets(attention)
    assert [(t.role, t.shape, t.layer, t.num_layers) for t in targets] == [
        ("Q", (8, 8), 0, 1),
        ("K", (8, 4), 0, 1),
        ("V", (8, 6), 0, 1),
        ("O", (8, 8), 0, 1),
    ]
    # the separate weights are watched whole (a view of the very parameter)
    assert targets[1].matrix().data_ptr() == attention.k_proj_weight.data_ptr()


@pytest.mark.filterwarnings("error::spectral_callbacks.targets.TargetWarning")
def test_layers_count_only_list_entries_that_hold_blocks():
    # a Sequential of embedding, blocks and head: the blocks are layers 0 and 1 of 2
    model = nn.Sequential(
        nn.Embedding(40, 32), NanoBlock(32, 4), NanoBlock(32, 4), nn.Linear(32, 40)
    )
    targets = find_targets(model)
    assert sorted({(t.layer, t.num_layers, t.parameter_name.split(".")[0]) for t in targets}) == [
        (0, 2, "1"),
        (1, 2, "2"),
    ]


# --- Meta's reference Llama (llama/model.py, trimmed: no RoPE, no cache) -------------------------


class MetaAttention(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2) -> None:
        super().__init__()
        hd = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(n_heads * hd, dim, bias=False)


class MetaFeedForward(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 48) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = MetaAttention(), MetaFeedForward()


def test_meta_llama_names_and_the_swiglu_roles():
    torch.manual_seed(3)
    model = nn.Module()
    model.layers = nn.ModuleList(MetaBlock() for _ in range(2))
    targets = find_targets(model)
    assert [(t.layer, t.role, t.shape) for t in targets if t.layer == 1] == [
        (1, "Q", (32, 32)),
        (1, "K", (16, 32)),
        (1, "V", (16, 32)),
        (1, "O", (32, 32)),
        (1, "MLP_gate", (48, 32)),
        (1, "MLP_up", (48, 32)),
        (1, "MLP_down", (32, 48)),
    ]
    m = {t.role: t.matrix() for t in targets if t.layer == 1}
    x = torch.randn(3, 32)
    expected = (F.silu(x @ m["MLP_gate"].T) * (x @ m["MLP_up"].T)) @ m["MLP_down"].T
    close(expected, model.layers[1].feed_forward(x))


# --- hand-written block: nn.MultiheadAttention + an nn.Sequential MLP -----------------------------


class SequentialMlpBlock(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim), nn.Dropout(0.0)
        )


def test_sequential_mlp_first_linear_is_up_last_is_down():
    torch.manual_seed(5)
    model = nn.Module()
    model.blocks = nn.ModuleList(SequentialMlpBlock() for _ in range(3))
    targets = find_targets(model)
    assert [(t.layer, t.role, t.shape) for t in targets if t.layer == 2] == [
        (2, "Q", (16, 16)),
        (2, "K", (16, 16)),
        (2, "V", (16, 16)),
        (2, "O", (16, 16)),
        (2, "MLP_up", (48, 16)),
        (2, "MLP_down", (16, 48)),
    ]
    mlp = model.blocks[2].mlp
    m = {t.role: t.matrix() for t in targets if t.layer == 2}
    x = torch.randn(4, 16)
    expected = F.gelu(x @ m["MLP_up"].T + mlp[0].bias) @ m["MLP_down"].T + mlp[2].bias
    close(expected, mlp(x))


def test_sequential_mlp_of_unexpected_shape_warns():
    block = SequentialMlpBlock()
    block.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 16))
    with pytest.warns(PartialTargetWarning, match="MLP Sequential with 3 Linear layers"):
        targets = find_targets(block)
    assert {t.role for t in targets} == {"Q", "K", "V", "O"}


def test_numbered_mlp_pattern_falls_through_when_not_a_sequential_of_linears():
    # "ff.[0-9]*.weight" also matches ff.0.gate_proj.weight (fnmatch's * spans dots): the rule
    # sees ff.0 is not a Linear inside a Sequential and lets the Llama rules decide
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = nn.Linear(8, 12), nn.Linear(8, 12), nn.Linear(12, 8)
    model = nn.Module()
    model.ff = nn.ModuleList([mlp])
    assert [t.role for t in find_targets(model)] == ["MLP_gate", "MLP_up", "MLP_down"]
