"""find_targets' user-facing behaviour: wrappers, mapping=, include/exclude/roles, errors, warnings."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from test_targets_torch import NanoBlock, NanoGPT
from torch import nn

from spectral_callbacks.targets import (
    AmbiguousTargetWarning,
    PartialTargetWarning,
    Split,
    TargetError,
    TargetWarning,
    find_targets,
    format_targets,
)

SIX = ("Q", "K", "V", "O", "MLP_up", "MLP_down")


def keys(targets):
    return [(t.layer, t.role, t.shape) for t in targets]


# --- unwrapping ---------------------------------------------------------------------------------


class DDPLike(nn.Module):
    """Stands in for DistributedDataParallel / DataParallel: the network under ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.filterwarnings("error::spectral_callbacks.targets.TargetWarning")
@pytest.mark.parametrize("wrap", ["compile", "ddp", "lightning", "ddp+compile"])
def test_wrapped_models_map_like_the_bare_network(wrap):
    model = NanoGPT(n_layer=2)
    bare = find_targets(model)
    # torch.compile keeps the model as `_orig_mod`: the prefix users see in its parameter names
    # and state_dict, so the names are compared with it.
    if wrap == "compile":
        wrapped, prefix = torch.compile(model), "_orig_mod."
    elif wrap == "ddp":
        wrapped, prefix = DDPLike(model), "module."
    elif wrap == "ddp+compile":
        wrapped, prefix = DDPLike(torch.compile(model)), "module._orig_mod."
    else:
        lightning = pytest.importorskip("lightning.pytorch")

        class Module(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

        wrapped, prefix = Module(), "model."
    targets = find_targets(wrapped)
    assert keys(targets) == keys(bare)
    assert [t.parameter_name for t in targets] == [prefix + t.parameter_name for t in bare]
    assert [t.matrix().data_ptr() for t in targets] == [t.matrix().data_ptr() for t in bare]


def test_two_lists_of_blocks_are_two_stacks_numbered_within_each():
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dim_feedforward=32,
        batch_first=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)  # no gaps: cross is per stack
        targets = find_targets(model)
    assert sorted({(t.stack, t.layer, t.num_layers, t.parameter_name[:7]) for t in targets}) == [
        ("dec", 0, 3, "decoder"),
        ("dec", 1, 3, "decoder"),
        ("dec", 2, 3, "decoder"),
        ("enc", 0, 2, "encoder"),
        ("enc", 1, 2, "encoder"),
    ]
    assert [t.depth for t in targets if t.role == "Q" and t.stack == "dec"] == [0.0, 0.5, 1.0]
    cross = {t.role: t for t in targets if t.stack == "dec" and t.layer == 0 and "_cross" in t.role}
    assert sorted(cross) == ["K_cross", "O_cross", "Q_cross", "V_cross"]
    attn = model.decoder.layers[0].multihead_attn
    assert torch.equal(cross["K_cross"].matrix(), attn.in_proj_weight[16:32])
    assert cross["O_cross"].matrix().data_ptr() == attn.out_proj.weight.data_ptr()
    assert not any(t.stack == "enc" and "_cross" in t.role for t in targets)
    # with include= one stack is watched, as the one unnamed stack
    encoder = find_targets(model, include="encoder.*")
    assert {(t.stack, t.layer, t.num_layers) for t in encoder} == {("", 0, 2), ("", 1, 2)}


# --- mapping= -----------------------------------------------------------------------------------


class InterleavedAttention(nn.Module):
    """A custom fused projection: rows (heads, [q; k; v], head_dim), like GPT-NeoX."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wout = nn.Linear(dim, dim, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B, T, _ = x.shape
        return self.wqkv(x).view(B, T, self.heads, 3, -1).unbind(3)  # each (B, T, h, hd)


class CustomNet(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"mix": InterleavedAttention()}) for _ in range(layers)
        )


def test_no_match_error_lists_candidates_and_shows_mapping():
    with pytest.raises(TargetError, match=r"blocks\.0\.mix\.wqkv\.weight \(48, 16\)") as error:
        find_targets(CustomNet())
    assert "mapping=" in str(error.value) and "Split" in str(error.value)
    assert isinstance(error.value, ValueError)


def test_mapping_describes_a_per_head_fused_split():
    torch.manual_seed(0)
    model = CustomNet()
    targets = find_targets(model, mapping={"*.wqkv": Split(("Q", "K", "V"), groups=4), "wout": "O"})
    assert keys(targets)[:4] == [
        (0, "Q", (16, 16)),
        (0, "K", (16, 16)),
        (0, "V", (16, 16)),
        (0, "O", (16, 16)),
    ]
    x = torch.randn(2, 3, 16)
    q, k, v = model.blocks[1]["mix"].qkv(x)
    found = {t.role: t.matrix() for t in targets if t.layer == 1}
    for role, state in zip("QKV", (q, k, v), strict=True):
        torch.testing.assert_close((x @ found[role].T).view(2, 3, 4, 4), state)


def test_mapping_overrides_and_drops_builtin_roles():
    model = NanoGPT(n_layer=2)
    targets = find_targets(
        model,
        mapping={"mlp.c_fc": "MLP_gate", re.compile(r"\.attn\.c_proj\."): None},
    )
    assert [t.role for t in targets if t.layer == 0] == ["Q", "K", "V", "MLP_gate", "MLP_down"]
    reasons = {s.parameter_name: s.reason for s in targets.skipped}
    assert reasons["transformer.h.1.attn.c_proj.weight"] == "mapped to None by mapping="


class HeldSequential(nn.Module):
    """Three linear layers in an ``nn.Sequential`` held as ``net``: layers 0, 1, 2."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))


class SequentialMLP(nn.Module):
    """One block whose MLP is an ``nn.Sequential``: its indices are parts, not layers."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


@pytest.mark.parametrize(
    "pattern", ["weight", "net.*", "*.weight", "net.*.weight", re.compile(r"net\.\d+\.weight")]
)
def test_a_mapping_wildcard_does_not_change_the_layer_numbering(pattern) -> None:
    targets = find_targets(HeldSequential(), mapping={pattern: "W"}, builtin_rules=False)
    assert [(t.layer, t.role, t.name) for t in targets] == [
        (layer, "W", f"net.{layer}.weight") for layer in range(3)
    ]
    assert {t.num_layers for t in targets} == {3}


def test_indices_a_mapping_spells_out_are_parts_of_one_layer() -> None:
    targets = find_targets(SequentialMLP(), mapping={"mlp.0": "MLP_up", "mlp.2": "MLP_down"})
    assert [(t.layer, t.role) for t in targets] == [(0, "MLP_up"), (0, "MLP_down")]


def test_mapping_callable_with_no_opinion_falls_back_to_builtin_rules():
    def only_mlp_up(name: str, parameter: torch.Tensor):
        return "MLP_in" if name.endswith("c_fc.weight") else None

    targets = find_targets(NanoGPT(n_layer=1), mapping=only_mlp_up)
    assert [t.role for t in targets] == ["Q", "K", "V", "O", "MLP_down", "MLP_in"]
    with pytest.warns(PartialTargetWarning, match="3 weights that look like targets") as caught:
        mapped_only = find_targets(NanoGPT(n_layer=1), mapping=only_mlp_up, builtin_rules=False)
    assert len(caught) == 1  # one warning listing all three, not three warnings
    assert [t.role for t in mapped_only] == ["MLP_in"]


def test_mapping_patterns_with_different_roles_warn_and_the_first_wins():
    with pytest.warns(AmbiguousTargetWarning, match="several mapping= patterns"):
        targets = find_targets(NanoGPT(n_layer=1), mapping={"c_fc": "A", "mlp.*": "B"})
    assert "A" in {t.role for t in targets}


def test_mapping_rejects_bad_roles_and_splits():
    with pytest.raises(ValueError, match="letters, digits and '_'"):
        find_targets(NanoGPT(n_layer=1), mapping={"c_fc": "MLP up"})
    with pytest.raises(TargetError, match="do not split into 5 equal parts"):
        find_targets(NanoGPT(n_layer=1), mapping={"c_attn": Split(("A", "B", "C", "D", "E"))})


def test_two_weights_with_one_layer_and_role_raise():
    with pytest.raises(TargetError, match="same \\(layer, role\\)"):
        find_targets(NanoGPT(n_layer=1), mapping={"c_fc": "O"})


# --- include / exclude / roles ------------------------------------------------------------------


def test_include_exclude_and_roles_filter_and_list_what_they_dropped():
    model = NanoGPT(n_layer=3)
    only_attention = find_targets(model, include="*.attn.*", exclude=re.compile(r"h\.2\."))
    assert keys(only_attention) == [
        (i, r, (32, 32)) for i in range(2) for r in ("Q", "K", "V", "O")
    ]
    assert {t.num_layers for t in only_attention} == {3}  # depth still counts every block
    text = format_targets(only_attention)
    assert re.search(
        r"\n  transformer\.h\.2\.attn\.c_attn\.weight +\(96, 32\) +excluded by exclude=", text
    )
    assert re.search(
        r"\n  transformer\.h\.0\.mlp\.c_fc\.weight +\(128, 32\) +not matched by include=", text
    )
    queries = find_targets(model, roles="Q", include="h.1.*")
    assert [(t.layer, t.role) for t in queries] == [(1, "Q")]


def test_roles_that_match_nothing():
    with pytest.raises(
        TargetError, match="roles found in this model: Q, K, V, O, MLP_up, MLP_down"
    ):
        find_targets(NanoGPT(n_layer=1), roles=["q"])
    with pytest.warns(PartialTargetWarning, match="MLP_gate"):
        targets = find_targets(NanoGPT(n_layer=1), roles=["Q", "MLP_gate"])
    assert [t.role for t in targets] == ["Q"]


def test_filters_that_remove_everything_raise():
    with pytest.raises(TargetError, match="removed by roles=/include=/exclude="):
        find_targets(NanoGPT(n_layer=1), exclude="transformer.*")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(include=5), "`include` must be a name pattern"),
        (dict(mapping=5), "`mapping` must be a dict"),
        (dict(roles=[1]), "`roles` must be role names"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, message):
    with pytest.raises(TargetError, match=message):
        find_targets(NanoGPT(n_layer=1), **kwargs)


def test_model_must_be_a_module():
    with pytest.raises(TargetError, match="`model` must be a torch.nn.Module, got dict"):
        find_targets({})  # type: ignore[arg-type]


# --- partial matches warn -------------------------------------------------------------------------


def test_unknown_weight_inside_a_block_warns_and_is_listed():
    model = NanoGPT(n_layer=2)
    model.transformer.h[1].attn.gate = nn.Linear(32, 32)
    with pytest.warns(
        PartialTargetWarning,
        match=r"transformer\.h\.1\.attn\.gate\.weight \(32, 32\): inside a block",
    ):
        targets = find_targets(model)
    assert len(targets) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=PartialTargetWarning)
        find_targets(model, exclude="attn.gate")  # the way to silence it


def test_a_weight_outside_the_blocks_that_no_rule_reads_is_named_in_one_warning():
    # before: an input projection (and any 2-D weight outside the blocks but an embedding or a
    # head) was listed as "outside the blocks; no rule matched" with no warning, in every mode
    model = NanoGPT(n_layer=2)
    model.proj_in = nn.Linear(32, 32)
    model.bridge = nn.Linear(32, 24)
    with pytest.warns(PartialTargetWarning, match="2 weights that look like targets") as caught:
        targets = find_targets(model)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "proj_in.weight (32, 32): outside the blocks" in message
    assert "bridge.weight (24, 32): outside the blocks" in message
    assert len(targets) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=PartialTargetWarning)
        find_targets(model, exclude=["proj_in", "bridge"])  # the way to silence it


def test_poolers_and_modality_projections_are_heads_not_warned_about():
    model = NanoGPT(n_layer=2)
    model.pooler = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    model.text_projection = nn.Linear(32, 16, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=PartialTargetWarning)
        targets = find_targets(model)
    reasons = {s.parameter_name: s.reason for s in targets.skipped}
    assert reasons["pooler.0.weight"] == reasons["text_projection.weight"] == "output head"


def test_layer_missing_a_role_warns():
    model = NanoGPT(n_layer=2)
    model.transformer.h[1].mlp = nn.Identity()
    with pytest.warns(PartialTargetWarning, match="layer 1: MLP_up, MLP_down"):
        find_targets(model)


def test_fused_weight_of_unknown_layout_warns_and_is_skipped():
    block = NanoBlock(32, 4)
    block.attn.query_key_value = nn.Linear(32, 40)  # not (heads, 3, head_dim)
    with pytest.warns(PartialTargetWarning, match="query_key_value.weight .* per-head fused QKV"):
        targets = find_targets(block)
    assert "attn.query_key_value.weight" not in {t.parameter_name for t in targets}


# --- Target -------------------------------------------------------------------------------------


def test_matrix_reads_the_live_parameter_without_autograd():
    model = NanoGPT(n_layer=3)
    k = find_targets(model, roles="K")[2]
    assert (k.layer, k.depth, k.name) == (2, 1.0, "transformer.h.2.attn.c_attn.weight[K]")
    with torch.no_grad():
        model.transformer.h[2].attn.c_attn.weight[40, 3] = 5.0
    assert k.matrix()[8, 3].item() == 5.0
    assert not k.matrix().requires_grad


def test_interleaved_split_copies_only_its_own_rows():
    torch.manual_seed(0)
    model = CustomNet(layers=1)
    mapping = {"wqkv": Split(("Q", "K", "V"), groups=4), "wout": "O"}
    v = find_targets(model, mapping=mapping, roles="V")[0]
    weight = model.blocks[0]["mix"].wqkv.weight
    expected = weight.view(4, 3, 4, 16)[:, 2].reshape(16, 16)
    assert torch.equal(v.matrix(), expected) and v.matrix().numel() == weight.numel() // 3


def test_multi_query_fused_qkv_is_not_split_into_wrong_thirds():
    # d + 2 * head_dim = 48 rows divide by 3, but equal thirds would be wrong: q has 32 rows
    block = NanoBlock(32, 4)
    block.attn.c_attn = nn.Linear(32, 48)
    with pytest.warns(
        PartialTargetWarning, match=r"c_attn.weight \(48, 32\): fused QKV of unknown"
    ):
        assert "Q" not in {t.role for t in find_targets(block)}
    mapped = find_targets(block, mapping={"attn.c_attn": Split(("Q", "K", "V"), sizes=(32, 8, 8))})
    assert [(t.role, t.shape) for t in mapped][:3] == [
        ("Q", (32, 32)),
        ("K", (8, 32)),
        ("V", (8, 32)),
    ]


def test_transposed_per_head_split_of_an_in_out_weight():
    torch.manual_seed(4)
    model = nn.Module()
    model.proj = nn.Module()
    model.proj.weight = nn.Parameter(
        torch.randn(16, 2 * 12)
    )  # stored (in, out), out = (3 heads, [k; v] of 4)
    (v,) = find_targets(
        model, mapping={"proj": Split(("K", "V"), groups=3, transposed=True)}, roles="V"
    )
    x = torch.randn(5, 16)
    expected = (x @ model.proj.weight).view(5, 3, 2, 4)[:, :, 1].reshape(5, 12)
    torch.testing.assert_close(x @ v.matrix().T, expected)
    assert v.shape == (12, 16)


def test_copy_into_writes_the_matrix_into_a_stack_slot():
    torch.manual_seed(6)
    model = CustomNet(layers=2)
    mapping = {"wqkv": Split(("Q", "K", "V"), groups=4), "wout": "O"}
    targets = [t for t in find_targets(model, mapping=mapping) if t.role in ("K", "O")]
    stack = torch.empty(len(targets), 16, 16)
    for slot, target in zip(stack, targets, strict=True):
        assert target.copy_into(slot) is slot
    torch.testing.assert_close(stack, torch.stack([t.matrix() for t in targets]), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"`out` must have shape \(16, 16\)"):
        targets[0].copy_into(torch.empty(16, 8))
