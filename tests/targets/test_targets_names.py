"""Hand-written projection names, DistilBERT, and Falcon's fused query_key_value split from its
config flags (multi-query, grouped new_decoder_architecture, plain multi-head)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_models import FALCON, distilbert, falcon
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
    targets = _find(distilbert())
    assert [(t.layer, t.role) for t in targets] == [
        (layer, role) for layer in (0, 1) for role in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
    ]


def _rows_of(fused: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Where each row of ``part`` sits among the rows of ``fused`` (random rows are unique)."""
    found = [(fused == row).all(dim=1).nonzero().flatten() for row in part]
    assert all(len(index) == 1 for index in found), "a split row is not one row of the fused weight"
    return torch.cat(found)


def _attend(model, ids: torch.Tensor, edit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's fused query_key_value output and what its attention hands to ``dense``.

    Read through forward hooks on the two public submodules, so this is what the attention's
    own ``forward`` computes from the fused rows; ``edit(fused)`` may change that output first.
    """
    attention, seen = model.h[1].self_attention, {}

    def on_fused(_module, _args, output):
        output = output.clone() if edit is None else edit(output.clone())
        seen["fused"] = output
        return output

    def on_dense(_module, args):
        seen["heads"] = args[0]

    hooks = [
        attention.query_key_value.register_forward_hook(on_fused),
        attention.dense.register_forward_pre_hook(on_dense),
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen["fused"].reshape(ids.shape[1], -1), seen["heads"].reshape(ids.shape[1], -1)


@pytest.mark.parametrize("layout", sorted(FALCON))
def test_falcon_query_key_value_is_split_as_the_attention_reads_it(layout: str) -> None:
    """The fused rows named Q, K and V are the ones FalconAttention's forward uses as such.

    Compared through its public behaviour only (hooks on ``query_key_value`` and ``dense``):
    with causal attention the first token attends to itself alone, so its output per head is
    exactly its own value rows of that head's K/V group, whatever the queries and keys; changing
    the first token's query rows changes nothing, while changing its key rows of K/V group g
    changes the later tokens' outputs of the heads in g only, and changing the last token's
    query rows of head h changes that token's output of head h only.
    """
    torch.manual_seed(0)
    model = falcon(layout).eval()
    targets = _find(model)
    assert {t.role for t in targets} == {"Q", "K", "V", "O", "MLP_up", "MLP_down"}
    attention = model.h[1].self_attention
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    group = heads // kv_heads  # query heads per K/V head
    weight = attention.query_key_value.weight.detach()
    rows = {
        t.role: _rows_of(weight, t.matrix()) for t in targets if t.layer == 1 and t.role in "QKV"
    }
    assert len(rows["Q"]) == heads * head_dim and len(rows["K"]) == len(rows["V"])
    assert len(torch.cat(list(rows.values())).unique()) == len(weight)  # each row named once

    ids = torch.tensor([[5, 17, 33, 2]])
    fused, out = _attend(model, ids)
    values = fused[0, rows["V"]].reshape(kv_heads, head_dim)
    torch.testing.assert_close(out[0], values.repeat_interleave(group, dim=0).flatten())

    def heads_changed(role: str, token: int, block: int) -> list[int]:
        """The (later token, head) outputs that change when one block of ``role``'s rows does."""
        index = rows[role].reshape(-1, head_dim)[block]

        def edit(output: torch.Tensor) -> torch.Tensor:
            output[0, token, index] += 30.0 * torch.randn(head_dim, generator=generator)
            return output

        _, edited = _attend(model, ids, edit)
        differs = ~torch.isclose(edited, out, atol=1e-5, rtol=1e-4)
        return sorted(
            {
                (t, h)
                for t, h in differs.reshape(len(out), heads, head_dim).any(2).nonzero().tolist()
            }
        )

    generator = torch.Generator().manual_seed(0)
    last = ids.shape[1] - 1
    for head in range(heads):
        assert heads_changed("Q", 0, head) == []  # the first token's query meets one key alone
        assert heads_changed("Q", last, head) == [(last, head)]
    for kv in range(kv_heads):
        assert heads_changed("K", 0, kv) == [
            (t, h) for t in range(1, last + 1) for h in range(kv * group, (kv + 1) * group)
        ]
    of = {t.role: t for t in targets if t.layer == 1}
    assert of["K"].shape[0] == (
        head_dim
        if attention.multi_query and not attention.new_decoder_architecture
        else kv_heads * head_dim
    )
