"""Tiny models built by the open training stacks' own config and builder code (no hub, no files):
torchtitan (Llama 3 fused and unfused QKV, DeepSeek-V3 MLA + MoE), torchtune (Llama 2/3, LoRA
and DoRA builders) and litgpt (Pythia, Llama with grouped queries, Mixtral-style experts, LoRA).

Each builder returns a :class:`StackModel`: the module, a forward that takes token ids, and the
(layer, role) pairs the model holds (what a full watch must find). A builder whose library is not
installed raises ``ImportError`` (tests skip on it).

torchtitan's language models default to compiled FlexAttention; on the CPU these are built with
torchtitan's own ``ScaledDotProductAttention`` inner attention instead (the same projections, the
same causal attention; flex would compile a kernel at the first forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

VOCAB = 128


@dataclass
class StackModel:
    """A tiny model of one stack: the module, its forward on token ids, what it holds."""

    name: str
    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    expected: list[tuple[str, int, str]]  # (stack, layer, role), experts counted once per role
    experts: int = 0  # routed experts per MoE layer
    adapters: int = 0  # LoRA-style adapted layers the model holds
    notes: list[str] = field(default_factory=list)


def _roles(layers: int, roles: tuple[str, ...], stack: str = "") -> list[tuple[str, int, str]]:
    return [(stack, layer, role) for layer in range(layers) for role in roles]


ATTENTION = ("Q", "K", "V", "O")
GATED = ("MLP_gate", "MLP_up", "MLP_down")
PLAIN = ("MLP_up", "MLP_down")


# --- torchtitan -------------------------------------------------------------------------------


def titan_llama3(fuse_qkv: bool = True, layers: int = 2, flex: bool = False) -> StackModel:
    """torchtitan Llama 3 (``Llama3Model``) with grouped K/V: ``qkv_linear.wqkv`` fused per K/V
    group as ``[q x heads/kv_heads; k; v]`` (its default), or ``wq``/``wk``/``wv``. ``flex``:
    its own language-model attention, compiled FlexAttention with the block-causal mask of the
    positions (the forward builds it as torchtitan's trainer does), instead of SDPA."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_ffn_config,
        make_gqa_config,
    )
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    dim, heads, kv_heads, hidden = 64, 4, 2, 96
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000.0, scaling="none")
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim),
            ffn_norm=RMSNorm.Config(normalized_shape=dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=kv_heads,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=(
                    get_attention_config("flex") if flex else ScaledDotProductAttention.Config()
                ),
                fuse_qkv=fuse_qkv,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init
            ),
        )
        for _ in range(layers)
    ]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=blocks,
    )
    model = config.build()
    model.init_states()
    name = "torchtitan llama3 " + ("fused wqkv" if fuse_qkv else "wq/wk/wv")
    if not flex:
        return StackModel(name, model, model, _roles(layers, ATTENTION + GATED))

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1]).expand(tokens.shape)  # one document per row
        out: torch.Tensor = model(tokens, positions, model.get_attention_masks(positions))
        return out

    return StackModel(name + " flex", model, forward, _roles(layers, ATTENTION + GATED))


def titan_deepseek_v3(layers: int = 3, experts: int = 4) -> StackModel:
    """torchtitan DeepSeek-V3 (``DeepSeekV3Model``) by its ``build_mla_moe_layers``: MLA with a
    low-rank query (``wq_a``/``wq_b``), ``wkv_a`` rows ``[latent; rope key]``, ``wkv_b`` per head
    ``[k_nope; v]``; the first layer dense, the others MoE with 3-D expert tensors
    (``moe.experts.w1/w2/w3``), a router and shared experts."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers

    dim, heads, rope_dim = 64, 4, 8
    init = {"weight": partial(nn.init.trunc_normal_, std=0.02)}
    blocks = build_mla_moe_layers(
        n_layers=layers,
        n_dense_layers=1,
        dim=dim,
        n_heads=heads,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=1.0,
        dense_hidden_dim=96,
        moe_hidden_dim=32,
        num_experts=experts,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=init,
        norm_init={"weight": nn.init.ones_},
        depth_init=lambda layer: init,
        depth_experts_init=lambda layer: dict.fromkeys(
            ("w1_EFD", "w2_EDF", "w3_EFD"), init["weight"]
        ),
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="none"),
    )
    for block in blocks:  # the CPU: torchtitan's SDPA inner attention instead of compiled flex
        block.attention = dataclasses.replace(
            block.attention, inner_attention=ScaledDotProductAttention.Config()
        )
    config = DeepSeekV3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=blocks,
    )
    model = config.build()
    model.init_states()
    mla = ("Q_down", "Q_up", "KV_down", "K_rope", "K", "V", "O")
    expected = _roles(1, mla + GATED) + [
        (stack, layer + 1, role)
        for stack, layer, role in _roles(
            layers - 1,
            mla + ("Router", "MLP_shared_gate", "MLP_shared_up", "MLP_shared_down") + GATED,
        )
    ]
    return StackModel("torchtitan deepseek-v3 (MLA+MoE)", model, model, expected, experts=experts)


# --- torchtune --------------------------------------------------------------------------------

_TUNE = dict(
    vocab_size=VOCAB,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=64,
    max_seq_len=64,
    intermediate_dim=96,
)


def tune_llama(version: int = 3) -> StackModel:
    """torchtune ``llama2(...)`` / ``llama3(...)`` component builders, grouped K/V."""
    if version == 2:
        from torchtune.models.llama2 import llama2 as build
    else:
        from torchtune.models.llama3 import llama3 as build
    model = build(**_TUNE)
    return StackModel(f"torchtune llama{version}", model, model, _roles(2, ATTENTION + GATED))


def tune_lora_llama3(use_dora: bool = False) -> StackModel:
    """torchtune ``lora_llama3(...)``: ``LoRALinear`` (or ``DoRALinear``) on Q, K, V, O and the
    MLP, each with its own ``weight``, ``lora_a`` and ``lora_b`` (and DoRA's ``magnitude``)."""
    from torchtune.models.llama3 import lora_llama3

    model = lora_llama3(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
        apply_lora_to_mlp=True,
        apply_lora_to_output=False,
        lora_rank=4,
        lora_alpha=8.0,
        use_dora=use_dora,
        **_TUNE,
    )
    _randomize_up_factors(model, ("lora_b.weight",))
    if use_dora:
        for module in model.modules():
            if hasattr(module, "initialize_dora_magnitude"):
                module.initialize_dora_magnitude()
    kind = "DoRA" if use_dora else "LoRA"
    return StackModel(
        f"torchtune lora_llama3 ({kind})", model, model, _roles(2, ATTENTION + GATED), adapters=14
    )


def _randomize_up_factors(model: nn.Module, suffixes: tuple[str, ...]) -> None:
    """Give the zero-initialized up factors (B) values, as after some training: an update of
    zero would make the effective weight equal the base, and hide a wrong one."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(suffixes):
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))


# --- litgpt -----------------------------------------------------------------------------------

_LIT = dict(block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_embd=64)


def lit_pythia() -> StackModel:
    """litgpt Pythia (GPT-NeoX): ``attn.qkv`` rows ``[q; k; v]``, ``mlp.fc``/``mlp.proj``."""
    from litgpt import GPT, Config

    config = Config.from_name("pythia-14m", **_LIT, n_head=4)
    model = GPT(config)
    return StackModel("litgpt pythia", model, model, _roles(2, ATTENTION + PLAIN))


def lit_llama_gqa() -> StackModel:
    """litgpt Llama style with grouped queries: ``attn.qkv`` rows ``[q; k; v]`` with K/V sized by
    ``n_query_groups``; ``mlp.fc_1`` (gate), ``mlp.fc_2`` (up), ``mlp.proj`` (down)."""
    from litgpt import GPT, Config

    config = Config.from_name(
        "Llama-3.2-1B", **_LIT, n_head=4, n_query_groups=2, intermediate_size=96
    )
    model = GPT(config)
    return StackModel("litgpt llama (GQA)", model, model, _roles(2, ATTENTION + GATED))


def lit_mixtral(experts: int = 4) -> StackModel:
    """litgpt Mixtral style: ``mlp.gate`` router, ``mlp.experts.<e>.fc_1/fc_2/proj``."""
    from litgpt import GPT, Config

    config = Config.from_name(
        "Mixtral-8x7B-v0.1",
        **_LIT,
        n_head=4,
        n_query_groups=2,
        intermediate_size=96,
        n_expert=experts,
        n_expert_per_token=2,
    )
    model = GPT(config)
    expected = _roles(2, ATTENTION + ("Router",) + GATED)
    return StackModel("litgpt mixtral (MoE)", model, model, expected, experts=experts)


def lit_lora(enable_k: bool = False) -> StackModel:
    """litgpt ``lora.GPT`` (Llama style, grouped queries): ``attn.qkv`` is a ``LoRAQKVLinear``
    with LoRA on Q and V only (``enable_lora`` pads K's update with zeros); ``proj`` and the MLP
    ``LoRALinear`` (``linear`` + ``lora_A``/``lora_B``)."""
    from litgpt.lora import GPT, Config

    config = Config.from_name(
        "Llama-3.2-1B",
        **_LIT,
        n_head=4,
        n_query_groups=2,
        intermediate_size=96,
        lora_r=4,
        lora_alpha=8,
        lora_query=True,
        lora_key=enable_k,
        lora_value=True,
        lora_projection=True,
        lora_mlp=True,
    )
    model = GPT(config)
    _randomize_up_factors(model, ("lora_B",))
    return StackModel(
        "litgpt lora (Q,V on fused qkv)", model, model, _roles(2, ATTENTION + GATED), adapters=10
    )


BUILDERS: dict[str, Callable[[], StackModel]] = {
    "torchtitan llama3 fused": partial(titan_llama3, True),
    "torchtitan llama3 unfused": partial(titan_llama3, False),
    "torchtitan deepseek-v3": titan_deepseek_v3,
    "torchtune llama2": partial(tune_llama, 2),
    "torchtune llama3": partial(tune_llama, 3),
    "torchtune lora_llama3": partial(tune_lora_llama3, False),
    "torchtune dora_llama3": partial(tune_lora_llama3, True),
    "litgpt pythia": lit_pythia,
    "litgpt llama gqa": lit_llama_gqa,
    "litgpt mixtral": lit_mixtral,
    "litgpt lora": lit_lora,
}
