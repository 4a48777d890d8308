"""find_targets on Hugging Face transformers models built from tiny configs with random weights.

Each test runs the model's own forward pass with two probes: a registered attention function that
records the query/key/value states the model hands to attention, and forward hooks on every
projection that record its input and output. The matrices find_targets returns must reproduce
both: ``x @ Target.matrix().T`` (+ the bias rows) equals each projection's output, and split per
head it equals the Q, K and V the attention function received. Rotary models run at position 0,
where RoPE is the identity, so their Q and K can be compared too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

# AttentionInterface, set_attn_implementation and DeepseekV2 (all used below): transformers 4.54.
transformers = pytest.importorskip("transformers", minversion="4.54")

from hf_models import (  # noqa: E402
    bert,
    deepseek_v2,
    deepseek_v3_mla,
    gpt2,
    gpt_neo,
    gpt_neox,
    gptj,
    llama,
    mistral,
    opt,
    phi,
    phi3,
    qwen2,
    t5_encoder,
    vit,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

from spectral_callbacks.targets import Target, find_targets, format_targets  # noqa: E402

transformers.logging.set_verbosity_error()
ATTENTION_STATES: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Record (B, H, T, d) query, key and value, then attend as SDPA would."""
    ATTENTION_STATES.append((query.detach(), key.detach(), value.detach()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("spectral_capture", _capture_attention)

LLAMA_ROLES = ("Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down")
SIX = ("Q", "K", "V", "O", "MLP_up", "MLP_down")
MLA_ROLES = ("Q_down", "Q_up", "KV_down", "K_rope", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down")


ARCHITECTURES = {
    "gpt2": (gpt2, SIX),
    "gpt_neox": (gpt_neox, SIX),
    "llama": (llama, LLAMA_ROLES),
    "mistral": (mistral, LLAMA_ROLES),
    "qwen2": (qwen2, LLAMA_ROLES),
    "phi3": (phi3, LLAMA_ROLES),
    "t5_encoder": (t5_encoder, LLAMA_ROLES),
    "opt": (opt, SIX),
    "gptj": (gptj, SIX),
    "phi": (phi, SIX),
    "gpt_neo": (gpt_neo, SIX),
    "bert": (bert, SIX),
    "vit": (vit, SIX),
    "deepseek_v2": (deepseek_v2, ("Q", *MLA_ROLES[2:])),
    "deepseek_v3": (deepseek_v3_mla, MLA_ROLES),
}


def run_with_probes(model, targets):
    """Forward once at position 0; return per-layer attention states and per-module (input, output)."""
    model.set_attn_implementation("spectral_capture")  # the one AttentionInterface registered
    model.eval()
    io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for module_name in {t.parameter_name.rpartition(".")[0] for t in targets}:
        module = model.get_submodule(module_name)

        def hook(mod, args, output, module_name=module_name):
            io[module_name] = (args[0].detach(), output.detach())

        handles.append(module.register_forward_hook(hook))
    ATTENTION_STATES.clear()
    batch, length = 2, 5
    with torch.no_grad():
        if isinstance(model, transformers.ViTModel):
            model(pixel_values=torch.randn(batch, 3, 16, 16))
        elif isinstance(model, transformers.T5EncoderModel):  # relative positions, no position_ids
            model(input_ids=torch.randint(0, 50, (batch, length)))
        else:
            ids = torch.randint(0, 50, (batch, length))
            model(input_ids=ids, position_ids=torch.zeros(batch, length, dtype=torch.long))
    for handle in handles:
        handle.remove()
    return list(ATTENTION_STATES), io


def project(target: Target, model, x: torch.Tensor) -> torch.Tensor:
    """``x @ matrix.T`` plus this target's rows of the module's bias."""
    y = x @ target.matrix().T
    bias = getattr(model.get_submodule(target.parameter_name.rpartition(".")[0]), "bias", None)
    if bias is not None:
        rows = dataclasses.replace(target.rows, transposed=False)
        y = y + rows.take(bias.detach()[:, None])[:, 0]
    return y


def per_head(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, h * d) -> (B, h, T, d), the layout attention functions receive."""
    B, T, _ = y.shape
    return y.view(B, T, -1, head_dim).transpose(1, 2)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(params=list(ARCHITECTURES))
def architecture(request):
    torch.manual_seed(0)
    build, roles = ARCHITECTURES[request.param]
    return request.param, build(), roles


def test_counts_roles_and_layers(architecture):
    name, model, roles = architecture
    targets = find_targets(model)
    # A DeepSeek's MoE layers: their MLP is routed experts (test_experts.py), a router and shared
    # experts; the dense roles are counted here.
    moe = {t.layer for t in targets if t.expert is not None}
    dense = [
        t for t in targets if t.expert is None and t.role != "Router" and "shared" not in t.role
    ]
    expected = [(i, r) for i in range(2) for r in roles if not (i in moe and r.startswith("MLP"))]
    assert [(t.layer, t.role) for t in dense] == expected
    assert all(t.num_layers == 2 for t in targets)
    assert all(tuple(t.matrix().shape) == t.shape for t in targets)
    assert len({t.name for t in targets}) == len(targets)
    # no stored row is watched twice: the (parameter, rows) pairs are distinct
    assert len({(t.parameter_name, t.rows, t.expert) for t in targets}) == len(targets)


def test_every_matrix_is_what_the_projection_multiplies_by(architecture):
    name, model, _ = architecture
    # routed experts and routers are no Linear to probe: test_experts.py checks them
    targets = [t for t in find_targets(model) if t.expert is None and t.role != "Router"]
    _, io = run_with_probes(model, targets)
    rebuilt: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(0))
    for t in targets:
        x, y = io[t.parameter_name.rpartition(".")[0]]
        if t.parameter_name not in rebuilt:
            rebuilt[t.parameter_name] = torch.full_like(y, float("nan"))
            covered[t.parameter_name] = torch.zeros(y.shape[-1], dtype=torch.long)
        # the output columns this part produces, in the model's order
        rows = dataclasses.replace(t.rows, transposed=False)
        columns = rows.take(torch.arange(y.shape[-1])[:, None])[:, 0]
        rebuilt[t.parameter_name][..., columns] = project(t, model, x)
        covered[t.parameter_name][columns] += 1
    for parameter_name, y_rebuilt in rebuilt.items():
        _, y = io[parameter_name.rpartition(".")[0]]
        assert covered[parameter_name].eq(1).all(), parameter_name  # every output row once
        close(y_rebuilt, y)


@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "gpt_neox",
        "llama",
        "mistral",
        "qwen2",
        "phi3",
        "t5_encoder",
        "opt",
        "gptj",
        "phi",
        "bert",
        "vit",
    ],
)
def test_q_k_v_match_the_attention_inputs(name):
    torch.manual_seed(1)
    build, _ = ARCHITECTURES[name]
    model = build()
    targets = find_targets(model)
    states, io = run_with_probes(model, targets)
    by_key = {(t.layer, t.role): t for t in targets}
    head_dim = (
        getattr(model.config, "d_kv", None)
        or model.config.hidden_size // model.config.num_attention_heads
    )
    assert len(states) == 2
    for layer, (query, key, value) in enumerate(states):
        for role, state in zip("QKV", (query, key, value), strict=True):
            target = by_key[(layer, role)]
            x, _ = io[target.parameter_name.rpartition(".")[0]]
            expected = per_head(project(target, model, x), head_dim)
            if name == "opt" and role == "Q":  # OPT scales q_proj's output before attention
                expected = expected * head_dim**-0.5
            close(expected, state)


def test_gqa_keys_and_values_keep_their_narrower_shape():
    model = mistral()  # one K/V head
    shapes = {t.role: t.shape for t in find_targets(model, roles=["Q", "K", "V"])}
    assert shapes == {"Q": (32, 32), "K": (8, 32), "V": (8, 32)}


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_mla_roles_rebuild_deepseek_query_key_value(name):
    torch.manual_seed(2)
    model = ARCHITECTURES[name][0]()
    targets = find_targets(model, roles=["Q*", "K*", "V*"])  # the attention's, no experts
    states, io = run_with_probes(model, targets)
    by_key = {(t.layer, t.role): t for t in targets}
    nope, rope, v_dim = 8, 4, 6
    for layer, (query, key, value) in enumerate(states):
        attn = model.model.layers[layer].self_attn
        prefix = f"model.layers.{layer}.self_attn"
        if name == "deepseek_v2":  # no query latent: one q_proj
            x, _ = io[f"{prefix}.q_proj"]
            q = per_head(x @ by_key[(layer, "Q")].matrix().T, nope + rope)
        else:
            x, _ = io[f"{prefix}.q_a_proj"]
            q = per_head(
                attn.q_a_layernorm(x @ by_key[(layer, "Q_down")].matrix().T)
                @ by_key[(layer, "Q_up")].matrix().T,
                nope + rope,
            )
        close(q, query)
        x, _ = io[f"{prefix}.kv_a_proj_with_mqa"]
        latent = attn.kv_a_layernorm(x @ by_key[(layer, "KV_down")].matrix().T)
        close(per_head(latent @ by_key[(layer, "K")].matrix().T, nope), key[..., :nope])
        k_rope = (x @ by_key[(layer, "K_rope")].matrix().T)[:, None]  # one key shared by all heads
        close(k_rope.expand(-1, 4, -1, -1), key[..., nope:])
        close(per_head(latent @ by_key[(layer, "V")].matrix().T, v_dim), value)


def test_summary_names_what_is_not_watched():
    text = format_targets(find_targets(gpt2()))
    assert "transformer.wte.weight  (50, 32)  embedding" in text
    assert "lm_head.weight          (50, 32)  tied to transformer.wte.weight" in text
    deepseek = format_targets(find_targets(deepseek_v3_mla()))
    # the router and the routed experts are watched now (test_experts.py)
    assert "Router           model.layers.1.mlp.gate.weight" in deepseek
    assert "model.layers.1.mlp.experts.down_proj[E003/MLP_down]" in deepseek


def test_gpt2_split_is_a_view_of_the_conv1d_weight():
    model = gpt2()
    q = find_targets(model, roles="Q")[0]
    weight = model.transformer.h[0].attn.c_attn.weight  # stored (in, out) = (32, 96)
    assert q.matrix().data_ptr() == weight.data_ptr()
    with torch.no_grad():
        weight[3, 5] = 7.0  # matrix() reads the live parameter
    assert q.matrix()[5, 3].item() == 7.0


def test_copy_into_handles_transposed_and_per_head_weights():
    for build in (gpt2, gpt_neox):  # Conv1D (in, out) slices; (heads, 3, hd) interleaving
        for target in find_targets(build(), roles=["Q", "V"]):
            slot = torch.empty(target.shape)
            torch.testing.assert_close(target.copy_into(slot), target.matrix(), rtol=0, atol=0)
