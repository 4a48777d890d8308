"""Tiny transformers models built from their configs (random weights, no hub), shared by the tests
of several folders: encoder-decoder and two-tower stacks, and mixtures of experts."""

from __future__ import annotations

import transformers


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
