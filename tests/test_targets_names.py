"""Hand-written projection names, DistilBERT, and Falcon's fused query_key_value split from its
config flags (multi-query, grouped new_decoder_architecture, plain multi-head)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from spectral_callbacks.targets import TargetWarning, find_targets

transformers = pytest.importorskip("transformers")


def _find(model: nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)
        return find_targets(model)


ATTENTION = {
    "q/k/v/o": {"q": "Q", "k": "K", "v": "V", "o": "O"},
    "wq/wk/wv/wo": {"wq": "Q", "wk": "K", "wv": "V", "wo": "O"},
    "query/key/value/out": {"query": "Q", "key": "K", "value": "V", "out": "O"},
    "to_q/to_k/to_v/to_out": {"to_q": "Q", "to_k": "K", "to_v": "V", "to_out": "O"},
}
MLP = {
    "up/down": ("up", "down"),
    "w_in/w_out": ("w_in", "w_out"),
    "dense_in/dense_out": ("dense_in", "dense_out"),
}


class Block(nn.Module):
    def __init__(self, attention: dict[str, str], mlp: tuple[str, str], dim: int = 8) -> None:
        super().__init__()
        self.attn = nn.Module()
        for name in attention:
            linear = nn.Linear(dim, dim)
            # diffusers writes to_out as [Linear, Dropout]
            module = nn.ModuleList([linear, nn.Dropout(0.0)]) if name == "to_out" else linear
            setattr(self.attn, name, module)
        self.mlp = nn.Module()
        setattr(self.mlp, mlp[0], nn.Linear(dim, 4 * dim))
        setattr(self.mlp, mlp[1], nn.Linear(4 * dim, dim))


@pytest.mark.parametrize("attention", sorted(ATTENTION))
@pytest.mark.parametrize("mlp", sorted(MLP))
def test_hand_written_names_map_to_their_roles(attention: str, mlp: str) -> None:
    model = nn.Sequential(*(Block(ATTENTION[attention], MLP[mlp]) for _ in range(2)))
    targets = _find(model)
    assert [(t.layer, t.role) for t in targets] == [
        (layer, role) for layer in (0, 1) for role in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    ]
    for t in targets:
        assert t.matrix().data_ptr() == model.get_parameter(t.parameter_name).data_ptr()


def test_distilbert() -> None:
    config = transformers.DistilBertConfig(
        vocab_size=64, dim=16, n_layers=2, n_heads=4, hidden_dim=32, max_position_embeddings=16
    )
    targets = _find(transformers.DistilBertModel(config))
    assert [(t.layer, t.role) for t in targets] == [
        (layer, role) for layer in (0, 1) for role in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    ]


FALCON = {
    "multi-query (7B)": dict(multi_query=True, new_decoder_architecture=False),
    "grouped (40B/180B)": dict(new_decoder_architecture=True, num_kv_heads=2),
    "multi-head": dict(multi_query=False, new_decoder_architecture=False),
}


@pytest.mark.parametrize("layout", sorted(FALCON))
def test_falcon_query_key_value_is_split_as_the_attention_reads_it(layout: str) -> None:
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, **FALCON[layout]
    )
    model = transformers.FalconModel(config)
    targets = _find(model)
    assert {t.role for t in targets} == {"Q", "K", "V", "O", "MLP_up", "MLP_down"}
    attention = model.h[1].self_attention
    of = {t.role: t for t in targets if t.layer == 1}
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        fused = attention.query_key_value(x)
        query, key, value = attention._split_heads(fused)  # the model's own reading
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        if attention.new_decoder_architecture:  # key/value are broadcast over each group's heads
            group = heads // kv_heads
            key = key.reshape(1, 3, kv_heads, group, head_dim)[:, :, :, 0]
            value = value.reshape(1, 3, kv_heads, group, head_dim)[:, :, :, 0]
        for role, expected in (("Q", query), ("K", key), ("V", value)):
            got = x @ of[role].matrix().t()
            torch.testing.assert_close(got, expected.reshape(1, 3, -1))
    assert of["K"].shape[0] == (
        head_dim
        if attention.multi_query and not attention.new_decoder_architecture
        else kv_heads * head_dim
    )
