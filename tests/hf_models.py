"""The registry of tiny transformers models, built from their configs (random weights, no hub):
what the tests of targets/, tensorboard_plugin/ and monitor/ build, and the architecture table of
docs/targets.md (``benchmarks/targets_table.py``: :data:`TABLE`). Decoder-only models, encoder-
decoder and two-tower stacks, mixtures of experts."""

from __future__ import annotations

import torch
import transformers

# Decoder-only and encoder-only models (tests/targets/test_targets_hf.py checks each against its
# own forward).
SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def tiny_llama(
    width: int = 64, layers: int = 2, bias: bool = False
) -> transformers.LlamaForCausalLM:
    """A tiny Llama; ``bias``: every projection with a bias, drawn away from zero as a trained
    checkpoint's."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=bias,
        mlp_bias=bias,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.1)
    return model


def gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def gpt_neox():
    config = transformers.GPTNeoXConfig(**SIZES, vocab_size=50, rotary_pct=0.5)
    return transformers.GPTNeoXForCausalLM(config)


def llama():
    config = transformers.LlamaConfig(**SIZES, num_key_value_heads=2, vocab_size=50)
    return transformers.LlamaForCausalLM(config)


def mistral():
    config = transformers.MistralConfig(**SIZES, num_key_value_heads=1, vocab_size=50)
    return transformers.MistralForCausalLM(config)


def qwen2():  # q/k/v carry biases
    config = transformers.Qwen2Config(**SIZES, num_key_value_heads=2, vocab_size=50)
    return transformers.Qwen2ForCausalLM(config)


def phi3():  # fused qkv_proj [q; k; v] with GQA sizes, fused gate_up_proj [gate; up]
    config = transformers.Phi3Config(**SIZES, num_key_value_heads=2, vocab_size=50, pad_token_id=0)
    return transformers.Phi3ForCausalLM(config)


def t5_encoder():  # nested lists encoder.block.N.layer.M; gated MLP wi_0 (gate), wi_1 (up)
    config = transformers.T5Config(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        vocab_size=50,
        feed_forward_proj="gated-gelu",
    )
    return transformers.T5EncoderModel(config)


def opt():  # fc1/fc2 directly in the decoder layer
    config = transformers.OPTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=64,
        vocab_size=50,
        word_embed_proj_dim=32,
        max_position_embeddings=32,
    )
    return transformers.OPTForCausalLM(config)


def gptj():  # attn.out_proj, mlp.fc_in / fc_out
    config = transformers.GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, vocab_size=50, rotary_dim=4, n_positions=32
    )
    return transformers.GPTJForCausalLM(config)


def phi():  # self_attn.dense is O
    return transformers.PhiForCausalLM(transformers.PhiConfig(**SIZES, vocab_size=50))


def gpt_neo():  # attn.attention.q_proj ..., mlp.c_fc / c_proj as nn.Linear; its own attention code
    # (no attention interface), so only the projection test covers it
    config = transformers.GPTNeoConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        vocab_size=50,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=32,
    )
    return transformers.GPTNeoForCausalLM(config)


def bert():
    config = transformers.BertConfig(**SIZES, vocab_size=50)
    return transformers.BertModel(config)


def vit():
    config = transformers.ViTConfig(**SIZES, image_size=16, patch_size=8)
    return transformers.ViTModel(config)


# MLA sizes and a small MoE shared by the DeepSeek configs.
DEEPSEEK = dict(
    **SIZES,
    num_key_value_heads=4,
    vocab_size=50,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
)


def deepseek_v3_mla():
    # Layer 0 dense, layer 1 MoE (its shared expert is the watched MLP); rope not interleaved so
    # position 0 leaves the rope channels in place.
    config = transformers.DeepseekV3Config(**DEEPSEEK, q_lora_rank=16, rope_interleave=False)
    return transformers.DeepseekV3ForCausalLM(config)


def deepseek_v2():  # MLA without a query latent (q_lora_rank=None: a plain q_proj)
    config = transformers.DeepseekV2Config(**DEEPSEEK, q_lora_rank=None)
    return transformers.DeepseekV2ForCausalLM(config)


# DistilBERT and Falcon's fused query_key_value in each of its layouts
# (tests/targets/test_targets_names.py).
def distilbert():
    config = transformers.DistilBertConfig(
        vocab_size=64, dim=16, n_layers=2, n_heads=4, hidden_dim=32, max_position_embeddings=16
    )
    return transformers.DistilBertModel(config)


FALCON = {
    "multi-query (7B)": dict(multi_query=True, new_decoder_architecture=False),
    "grouped (40B/180B)": dict(new_decoder_architecture=True, num_kv_heads=2),
    "multi-head": dict(multi_query=False, new_decoder_architecture=False),
}


def falcon(layout: str):
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, **FALCON[layout]
    )
    return transformers.FalconModel(config)


# Encoder-decoder and two-tower stacks (tests/targets/test_targets_stacks.py).
def t5():
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=4
    )
    return transformers.T5ForConditionalGeneration(config)


def bart():
    config = transformers.BartConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
    )
    return transformers.BartForConditionalGeneration(config)


def mbart():
    config = transformers.MBartConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
    )
    return transformers.MBartForConditionalGeneration(config)


def whisper():
    config = transformers.WhisperConfig(
        vocab_size=64,
        d_model=16,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=8,
        max_source_positions=16,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return transformers.WhisperForConditionalGeneration(config)


def vision_encoder_decoder():
    vit = transformers.ViTConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
    )
    gpt2 = transformers.GPT2Config(
        n_embd=16,
        n_layer=3,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        add_cross_attention=True,
        is_decoder=True,
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2)
    return transformers.VisionEncoderDecoderModel(config)


def clip():
    text = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
    )
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision))


def siglip():
    text = dict(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    vision = dict(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
    )
    config = transformers.SiglipConfig(text_config=text, vision_config=vision)
    return transformers.SiglipModel(config)


# Mixtures of experts (3-D expert tensors, transformers 5).
SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=4)


def mixtral():
    config = transformers.MixtralConfig(
        **SMALL, intermediate_size=24, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def qwen3_moe():
    config = transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, head_dim=4,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def olmoe():
    config = transformers.OlmoeConfig(
        **SMALL, intermediate_size=8, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2
    )
    return transformers.OlmoeForCausalLM(config)


def deepseek_v3():
    config = transformers.DeepseekV3Config(
        **SMALL, intermediate_size=24, moe_intermediate_size=8, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
        n_group=1, topk_group=1,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


def switch_transformers():  # experts as a list of MLPs (tests/targets/test_experts.py)
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2,
        expert_capacity=8,
    )  # fmt: skip
    return transformers.SwitchTransformersForConditionalGeneration(config)


#: The architecture table of docs/targets.md (``python benchmarks/targets_table.py``), in its order.
TABLE = {
    "GPT-2": gpt2,
    "Llama": llama,
    "DistilBERT": distilbert,
    "Falcon 7B layout (multi-query)": lambda: falcon("multi-query (7B)"),
    "Falcon 40B layout (grouped)": lambda: falcon("grouped (40B/180B)"),
    "T5": t5,
    "BART": bart,
    "mBART": mbart,
    "Whisper": whisper,
    "CLIP": clip,
    "SigLIP": siglip,
    "ViT + GPT-2 (VisionEncoderDecoder)": vision_encoder_decoder,
    "Mixtral": mixtral,
    "Qwen2-MoE": qwen2_moe,
    "Qwen3-MoE": qwen3_moe,
    "OLMoE": olmoe,
    "DeepSeek-V3 (dense first layer)": deepseek_v3,
    "Switch Transformers (experts as a list of MLPs)": switch_transformers,
}
