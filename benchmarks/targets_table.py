"""The architecture table of docs/targets.md: what find_targets watches in tiny models built from
transformers configs (no hub): targets per role, stacks with their layers, experts, and what is
left out and why. Run: python benchmarks/targets_table.py"""

from __future__ import annotations

import warnings
from collections import Counter

import transformers as T

from spectral_callbacks.targets import find_targets, role_sort_key

S = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4)
ED = dict(
    vocab_size=64,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
)
TOWER = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32)
MOE = dict(**S, num_key_value_heads=2, num_experts_per_tok=2)
DS = dict(
    **S,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_shared_experts=1,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=4,
    n_group=1,
    topk_group=1,
)


def vision_encoder_decoder():
    vit = T.ViTConfig(**TOWER, image_size=8, patch_size=4)
    gpt2 = T.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=64, add_cross_attention=True)
    return T.VisionEncoderDecoderModel(
        T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2)
    )


MODELS = {
    "GPT-2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=64)),
    "Llama": lambda: T.LlamaForCausalLM(
        T.LlamaConfig(**S, intermediate_size=32, num_key_value_heads=2)
    ),
    "DistilBERT": lambda: T.DistilBertModel(
        T.DistilBertConfig(vocab_size=64, dim=16, n_layers=2, n_heads=4, hidden_dim=32)
    ),
    "Falcon 7B layout (multi-query)": lambda: T.FalconModel(
        T.FalconConfig(**S, multi_query=True, new_decoder_architecture=False)
    ),
    "Falcon 40B layout (grouped)": lambda: T.FalconModel(
        T.FalconConfig(**S, new_decoder_architecture=True, num_kv_heads=2)
    ),
    "T5": lambda: T.T5ForConditionalGeneration(
        T.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ),
    "BART": lambda: T.BartForConditionalGeneration(T.BartConfig(**ED)),
    "mBART": lambda: T.MBartForConditionalGeneration(T.MBartConfig(**ED)),
    "Whisper": lambda: T.WhisperForConditionalGeneration(
        T.WhisperConfig(
            **ED,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    ),
    "CLIP": lambda: T.CLIPModel(
        T.CLIPConfig(
            text_config=dict(vocab_size=64, **TOWER),
            vision_config=dict(**TOWER, image_size=8, patch_size=4),
        )
    ),
    "SigLIP": lambda: T.SiglipModel(
        T.SiglipConfig(
            text_config=dict(vocab_size=64, **TOWER),
            vision_config=dict(**TOWER, image_size=8, patch_size=4),
        )
    ),
    "ViT + GPT-2 (VisionEncoderDecoder)": vision_encoder_decoder,
    "Mixtral": lambda: T.MixtralForCausalLM(
        T.MixtralConfig(**MOE, intermediate_size=24, num_local_experts=4)
    ),
    "Qwen2-MoE": lambda: T.Qwen2MoeForCausalLM(
        T.Qwen2MoeConfig(
            **MOE,
            intermediate_size=24,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            num_experts=4,
        )
    ),
    "Qwen3-MoE": lambda: T.Qwen3MoeForCausalLM(
        T.Qwen3MoeConfig(
            **MOE, intermediate_size=24, moe_intermediate_size=8, num_experts=4, head_dim=4
        )
    ),
    "OLMoE": lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**MOE, intermediate_size=8, num_experts=4)),
    "DeepSeek-V3 (dense first layer)": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**DS)),
    "Switch Transformers (experts as a list of MLPs)": lambda: (
        T.SwitchTransformersForConditionalGeneration(
            T.SwitchTransformersConfig(
                vocab_size=64,
                d_model=16,
                d_kv=4,
                d_ff=24,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                num_experts=4,
                encoder_sparse_step=2,
                decoder_sparse_step=2,
            )
        )
    ),
}


def row(name: str) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(MODELS[name]())
    roles = Counter(t.role for t in targets)
    per_role = " ".join(f"{r}×{roles[r]}" for r in sorted(roles, key=role_sort_key))
    stacks = {t.stack or "(one)": t.num_layers for t in targets}
    stack_text = ", ".join(f"{s} {n}" for s, n in stacks.items())
    experts = {t.expert for t in targets if t.expert is not None}
    expert_layers = len({(t.stack, t.layer) for t in targets if t.expert is not None})
    expert_text = f"{len(experts)} in {expert_layers} layers" if experts else "-"
    reasons = Counter(s.reason for s in targets.skipped)
    skipped = "; ".join(f"{reason} ×{n}" for reason, n in reasons.items()) or "-"
    warned = sum(1 for w in caught if "spectral_callbacks" in type(w.message).__module__)
    return f"| {name} | {stack_text} | {per_role} | {expert_text} | {skipped} | {warned} |"


if __name__ == "__main__":
    T.logging.set_verbosity_error()
    print(
        "| architecture | stacks (layers) | targets per role | experts | not watched (why) | warnings |"
    )
    print("|---|---|---|---|---|---|")
    for name in MODELS:
        print(row(name))
