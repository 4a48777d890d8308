"""Tiny attention models of every kind the QK values distinguish, and their measured logits.

Shared by tests/targets/test_logit_bounds.py (every logged bound holds) and
benchmarks/logit_bound_kinds.py (how far each logged value is from the measured maximum).

The measured logit of head h between tokens i and j is what the model's own forward hands its
softmax: the input of ``softmax`` in a Hugging Face eager attention (its scale, soft-cap and a mask
that is 0 on the causal positions read here), or ``q k^T`` times SDPA's ``scale`` (1/sqrt(E) where
None, as SDPA documents) in the example GPT. ``x`` is the input of the layer's query projection
(the same tensor its key projection reads); ``[x; 1]`` where the projections carry biases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from gpt import GPT, GPTConfig
from torch.overrides import TorchFunctionMode

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
T = 16  # tokens per sequence: within every model's positions and sliding windows


def _hf(config_class: type, model_class: type, **options: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = config_class(**options, vocab_size=50)
        config._attn_implementation = "eager"  # the softmax's input is visible
        return model_class(config)

    return build


def _gpt2(**options: Any) -> Callable[[], torch.nn.Module]:
    sizes = dict(n_embd=32, n_layer=4, n_head=4, n_positions=T)
    return _hf(transformers.GPT2Config, transformers.GPT2LMHeadModel, **sizes, **options)


def _deepseek_mla() -> torch.nn.Module:
    config = transformers.DeepseekV3Config(
        **SIZES,
        num_key_value_heads=4,
        vocab_size=50,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        first_k_dense_replace=2,  # dense layers only: MLA is what is looked at
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        n_group=1,
        topk_group=1,
    )
    config._attn_implementation = "eager"
    return transformers.DeepseekV3ForCausalLM(config)


#: kind -> (builder, what is logged for it: "bound" = qk_logit_bound, "qk_norm" =
#: qk_norm_logit_bound, "none" = neither)
KINDS: dict[str, tuple[Callable[[], torch.nn.Module], str]] = {
    "plain (example MHA)": (
        lambda: GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=T)),
        "bound",
    ),
    "biased (GPT-2)": (_gpt2(), "bound"),
    "unscaled (GPT-2 scale_attn_weights=False)": (_gpt2(scale_attn_weights=False), "bound"),
    "layer-scaled (GPT-2 by 1/(layer+1))": (_gpt2(scale_attn_by_inverse_layer_idx=True), "bound"),
    "RoPE (Llama)": (
        _hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, **SIZES),
        "bound",
    ),
    "RoPE + GQA (Llama, 2 K/V heads)": (
        _hf(
            transformers.LlamaConfig, transformers.LlamaForCausalLM, **SIZES, num_key_value_heads=2
        ),
        "bound",
    ),
    "RoPE + biases + GQA (Qwen2)": (
        _hf(
            transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **SIZES, num_key_value_heads=2
        ),
        "bound",
    ),
    "query_pre_attn_scalar (Gemma 2)": (
        _hf(
            transformers.Gemma2Config,
            transformers.Gemma2ForCausalLM,
            **SIZES,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=2,
        ),
        "bound",
    ),  # fmt: skip
    "attention_multiplier (Granite)": (
        _hf(
            transformers.GraniteConfig,
            transformers.GraniteForCausalLM,
            **SIZES,
            attention_multiplier=1.0,
        ),
        "bound",
    ),  # fmt: skip
    "QK-norm (Qwen3)": (
        _hf(
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            **SIZES,
            num_key_value_heads=2,
            head_dim=8,
        ),  # fmt: skip
        "qk_norm",
    ),
    "QK-norm 1 + weight (Gemma 3)": (
        _hf(
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            **SIZES,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
        ),
        "qk_norm",
    ),  # fmt: skip
    "MLA (DeepSeek-V3)": (_deepseek_mla, "none"),
}


def like_a_checkpoint(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every vector parameter (biases, norm gains) moved off its initial value, as training
    leaves them: zero biases and unit gains would hide what biases and gains do."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


class _Logits(TorchFunctionMode):
    """Records each attention call's logits (B, H, T, T), in call order (differentiable)."""

    def __init__(self) -> None:
        super().__init__()
        self.logits: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax):
            self.logits.append(args[0].double())
        elif func is F.scaled_dot_product_attention:
            q, k = args[0].double(), args[1].double()  # (B, H, T, E), (B, G, T, E)
            if k.shape[1] != q.shape[1]:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scale = kwargs.get("scale")
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # SDPA's default
            self.logits.append(q @ k.mT * scale)
        return func(*args, **kwargs)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Each layer's attention module (the owner of its query projection), in layer order."""
    names = ("q_a_proj", "q_proj", "c_attn")
    modules = dict(model.named_modules())
    owners = [n.rpartition(".")[0] for n in modules if n.rpartition(".")[2] in names]
    return [modules[name] for name in dict.fromkeys(owners)]


def logits_at(model: torch.nn.Module, xs: list[torch.Tensor], tokens: torch.Tensor) -> list:
    """Each attention layer's logits when its input (what its query and key projections read)
    is ``xs[layer]`` (B, T, d), put in place of the hidden states its block hands it."""

    def replace(x: torch.Tensor) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": x.to(kwargs["hidden_states"].dtype)}
            return (x.to(args[0].dtype), *args[1:]), kwargs

        return hook

    handles = [
        module.register_forward_pre_hook(replace(x), with_kwargs=True)
        for module, x in zip(attention_modules(model), xs, strict=True)
    ]
    mode = _Logits()
    try:
        with mode:
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    assert len(mode.logits) == len(xs), (len(mode.logits), len(xs))
    return mode.logits


def ratios(xs: list[torch.Tensor], logits: list, biased: bool) -> list[dict[str, torch.Tensor]]:
    """Per layer: ``per_unit`` (H,) the max over batch and causal pairs (i >= j) of
    |logit_ij| / (||x_i|| ||x_j||) (``[x; 1]`` where ``biased``), and ``largest`` (H,) the max
    |logit_ij|."""
    layers = []
    for x, layer_logits in zip(xs, logits, strict=True):
        norms = (x.double().square().sum(-1) + (1.0 if biased else 0.0)).sqrt()  # (B, T)
        causal = torch.ones(layer_logits.shape[-2:], dtype=torch.bool).tril()
        magnitude = layer_logits.abs().masked_fill(~causal, 0.0)  # (B, H, T, T)
        product = norms[:, None, :, None] * norms[:, None, None, :]
        # A zero x (a padding token's embedding) has logit 0 without biases: nothing to bound.
        per_unit = torch.where(product > 0, magnitude / product, torch.zeros_like(magnitude))
        layers.append(
            {"per_unit": per_unit.amax(dim=(0, 2, 3)), "largest": magnitude.amax(dim=(0, 2, 3))}
        )
    return layers


def worst_inputs(
    model: torch.nn.Module, seed: int, *, per_unit: bool = True, steps: int = 150
) -> list[dict[str, torch.Tensor]]:
    """The measured maxima (``ratios``) at inputs searched to make them large: each layer's ``x``
    (one sequence of ``T`` tokens) moved by Adam up the sum over heads of the measured maximum
    (``per_unit``, or the largest |logit| where that is what a bound is on). A random input
    is far from any bound; this comes within a few percent of the tight ones."""
    biased = has_biases(model)
    generator = torch.Generator().manual_seed(seed)
    d = attention_width(model)
    layers = len(attention_modules(model))
    xs = [torch.randn(1, T, d, generator=generator, requires_grad=True) for _ in range(layers)]
    tokens = torch.randint(1, 50, (1, T), generator=generator)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    optimizer = torch.optim.Adam(xs, lr=0.05)
    key = "per_unit" if per_unit else "largest"
    for _ in range(steps):
        found = ratios(xs, logits_at(model, xs, tokens), biased)
        loss = -sum(layer[key].sum() for layer in found)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    with torch.no_grad():
        return ratios(xs, logits_at(model, xs, tokens), biased)


def attention_width(model: torch.nn.Module) -> int:
    """``d``, the width the query projection reads."""
    module = attention_modules(model)[0]
    for name in ("q_a_proj", "q_proj", "c_attn"):
        projection = getattr(module, name, None)
        if projection is not None:
            weight = projection.weight
            return int(
                weight.shape[0] if type(projection).__name__ == "Conv1D" else weight.shape[1]
            )
    raise ValueError(f"no query projection on {type(module).__name__}")


def has_biases(model: torch.nn.Module) -> bool:
    """Whether the query or key projections carry a bias."""
    names = ("q_proj", "k_proj", "c_attn", "q_a_proj")
    return any(
        getattr(module, "bias", None) is not None
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in names
    )
