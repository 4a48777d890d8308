"""Roles read from the model's own forward pass (targets/dataflow.py, provenance.py, roles.py).

The reference for every found matrix is what the forward itself multiplies by: the inputs and
outputs of each projection and the q/k/v handed to attention, captured with forward hooks and a
wrapped ``scaled_dot_product_attention``, never a layout the test assumes.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.targets import (
    PartialTargetWarning,
    TargetError,
    find_targets,
    format_targets,
)
from spectral_callbacks.targets.roles import discover_roles

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_models import read_scalars  # noqa: E402
from unhelpful_model import Unhelpful  # noqa: E402

SEVEN = ("Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down")


def tokens(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(1))


def captured_forward(model: nn.Module, x: torch.Tensor, monkeypatch: Any) -> dict[str, Any]:
    """Run ``model`` once; return each attention call's (q, k, v) and each Linear's (in, out)."""
    calls: list[tuple[torch.Tensor, ...]] = []
    attend = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((q.detach(), k.detach(), v.detach()))
        return attend(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, (args[0].detach(), out.detach()))

        return hook

    hooks = [
        module.register_forward_hook(keep(name))
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    monkeypatch.setattr(F, "scaled_dot_product_attention", attend)
    return {"attention": calls, "linear": seen}


def test_unhelpful_names_are_watched_with_no_mapping(monkeypatch: Any) -> None:
    torch.manual_seed(0)
    model = Unhelpful(layers=3)
    x = tokens()
    targets = find_targets(model, example_input=x)
    assert [(t.layer, t.role) for t in targets] == [(layer, r) for layer in range(3) for r in SEVEN]
    assert set(targets.sources.values()) == {"data flow"}
    run = captured_forward(model, x, monkeypatch)
    by = {(t.layer, t.role): t for t in targets}
    heads, groups, size = 4, 2, 8
    for layer, key in enumerate("pqr"):
        inputs, outputs = run["linear"][f"z.{key}.a"]
        q, k, v = run["attention"][layer]
        # Token 0: rotary is the identity there, so q and k are the projection's rows as used.
        first = inputs[:, 0]  # (B, d)
        expected_q = (first @ by[(layer, "Q")].matrix().T).view(-1, heads, size)
        expected_k = (first @ by[(layer, "K")].matrix().T).view(-1, groups, size)
        expected_v = (inputs @ by[(layer, "V")].matrix().T).view(2, 5, groups, size)
        torch.testing.assert_close(q[:, :, 0], expected_q)
        torch.testing.assert_close(k[:, ::2, 0], expected_k)  # K/V repeated per group
        torch.testing.assert_close(v[:, ::2], expected_v.transpose(1, 2))
        up_in, up_out = run["linear"][f"z.{key}.c"]
        up, gate = up_out.chunk(2, dim=-1)
        torch.testing.assert_close(up_in @ by[(layer, "MLP_up")].matrix().T, up)
        torch.testing.assert_close(up_in @ by[(layer, "MLP_gate")].matrix().T, gate)
        for role, leaf in (("O", "b"), ("MLP_down", "d")):
            assert by[(layer, role)].parameter is model.z[key].get_submodule(leaf).weight


def test_per_group_rows_of_the_fused_projection_are_read_from_the_forward() -> None:
    model = Unhelpful(layers=1)  # 4 query heads in 2 groups of 2, head size 8: [q q k v] x 2
    targets = {t.role: t for t in find_targets(model, example_input=tokens())}
    weight = model.z["p"].a.weight
    rows = {
        "Q": [*range(0, 16), *range(32, 48)],
        "K": [*range(16, 24), *range(48, 56)],
        "V": [*range(24, 32), *range(56, 64)],
    }
    for role, expected in rows.items():
        torch.testing.assert_close(targets[role].matrix(), weight[expected], rtol=0, atol=0)


@pytest.mark.parametrize("discovery", ["example_input", "first_forward"])
def test_logged_stable_rank_equals_float64_along_a_short_fit(
    tmp_path: Path, discovery: str
) -> None:
    torch.manual_seed(0)
    model = Unhelpful(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = tokens()
    expected: dict[int, dict[str, float]] = {}

    def exact() -> dict[str, float]:
        found = find_targets(model, example_input=x)
        result = {}
        for t in found:
            matrix = t.matrix().double()
            sigma = torch.linalg.svdvals(matrix)
            result[f"spectral_stable_rank/L{t.layer:02d}/{t.role}"] = float(
                (matrix**2).sum() / sigma[0] ** 2
            )
        return result

    expected[0] = exact()  # before the tracker: this reference's own forward is not training's
    how: dict[str, Any] = (
        {"example_input": x} if discovery == "example_input" else {"roles_from_first_forward": True}
    )
    with SpectralTracker(
        model,
        ["stable_rank"],
        logdir=tmp_path,
        figures=False,
        every_n_steps=2,
        svd_method="svdvals",
        max_pending=8,  # room for every scheduled step: which are logged is not the worker's pace
        **how,
    ) as tracker:
        # Read from the training forward itself: nothing is watched (or snapshotted) before it.
        assert (tracker.targets == []) == (discovery == "first_forward")
        for step in range(1, 5):
            loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected[step] = exact()
            tracker.step(step)
    assert len(tracker.targets) == 14
    scalars = read_scalars(tmp_path)
    worst = 0.0
    for step, values in expected.items():
        for tag, value in values.items():
            if step in scalars[tag]:
                worst = max(worst, abs(scalars[tag][step] - value) / value)
    assert len(expected[0]) == 14
    assert all(set(scalars[tag]) >= {0, 2, 4} for tag in expected[0])
    assert worst < 1e-5


def test_a_step_before_any_forward_falls_back_to_the_names(tmp_path: Path) -> None:
    model = _nanogpt()
    tracker = SpectralTracker(model, logdir=tmp_path, figures=False, roles_from_first_forward=True)
    assert tracker.targets == [] and tracker.state_dict() == {}
    with pytest.warns(RuntimeWarning, match="step 1 came before any forward"):
        tracker.step(1)
    assert [t.role for t in tracker.targets[:6]] == ["Q", "K", "V", "O", "MLP_up", "MLP_down"]
    tracker.close()
    with pytest.raises(ConfigurationError, match="roles_from_first_forward"):
        SpectralTracker(model, logdir=tmp_path, roles_from_first_forward="yes")


def test_a_rule_that_reads_a_layout_the_forward_contradicts_is_an_error() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(16, 48)  # the rule reads [q; k; v]; this forward uses [k; q; v]
            self.c_proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            k, q, v = (t.view(1, -1, 2, 8).transpose(1, 2) for t in self.c_attn(x).split(16, -1))
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, 16)
            return self.c_proj(y)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([nn.ModuleDict({"attn": Attention()}) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.h:
                x = x + block["attn"](x)
            return x

    model = Net()
    assert [t.role for t in find_targets(model)][:3] == ["Q", "K", "V"]  # the rule alone
    with pytest.raises(
        TargetError, match=r"disagree on h\.0\.attn\.c_attn\.weight.*rows 16\.\.31 as Q"
    ):
        find_targets(model, example_input=torch.randn(1, 3, 16))
    # Without the rules the forward's reading is used.
    found = find_targets(model, example_input=torch.randn(1, 3, 16), builtin_rules=False)
    k = next(t for t in found if (t.layer, t.role) == (0, "K"))
    torch.testing.assert_close(k.matrix(), model.h[0]["attn"].c_attn.weight[:16])


def _interleaved(names: str = "xyzw") -> nn.Module:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in names.split(",") if "," in names else names:
                setattr(self, name, nn.Linear(16, 16, bias=False))
            self.projections = names.split(",") if "," in names else list(names)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            x, y, z, w = (getattr(self, name) for name in self.projections)
            q, k, v = (p(h).view(1, -1, 2, 8).transpose(1, 2) for p in (x, y, z))
            scores = (q @ k.transpose(-2, -1)) / 8**0.5
            mixed = scores.softmax(dim=-1) @ v  # written out: matmul -> softmax -> matmul
            return h + w(mixed.transpose(1, 2).reshape(1, -1, 16))

    class FeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.i, self.j = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.j(F.gelu(self.i(h)))

    return nn.Sequential(
        Attention(), FeedForward(), Attention(), FeedForward(), Attention(), FeedForward()
    )


def test_layers_follow_attention_calls_in_interleaved_entries() -> None:
    model = _interleaved()
    targets = find_targets(model, example_input=torch.randn(1, 4, 16))
    assert [(t.layer, t.role, t.parameter_name) for t in targets if t.layer < 2] == [
        (0, "Q", "0.x.weight"),
        (0, "K", "0.y.weight"),
        (0, "V", "0.z.weight"),
        (0, "O", "0.w.weight"),
        (0, "MLP_up", "1.i.weight"),
        (0, "MLP_down", "1.j.weight"),
        (1, "Q", "2.x.weight"),
        (1, "K", "2.y.weight"),
        (1, "V", "2.z.weight"),
        (1, "O", "2.w.weight"),
        (1, "MLP_up", "3.i.weight"),
        (1, "MLP_down", "3.j.weight"),
    ]
    assert {t.num_layers for t in targets} == {3}


def test_a_module_that_does_not_compute_its_weight_is_refused() -> None:
    class NotLoRA(nn.Linear):  # W x + B tanh(A x): not W x, and not an adapter's W0 + s B A
        def __init__(self, n: int) -> None:
            super().__init__(n, n, bias=False)
            self.lora_a = nn.Linear(n, 2, bias=False)
            self.lora_b = nn.Linear(2, n, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + self.lora_b(torch.tanh(self.lora_a(x)))

    model = _interleaved("q_proj,k_proj,v_proj,o_proj")
    model[0].q_proj = NotLoRA(16)
    # The name rule reads q_proj as Q; the check on random inputs refuses it (a layer shaped like
    # an adapter is verified as one, targets/lowrank.py, and refused when it is not).
    with pytest.warns(PartialTargetWarning, match=r"NotLoRA: its update is not s B A"):
        by_names = find_targets(model)
    assert (0, "Q") not in {(t.layer, t.role) for t in by_names}
    assert {(t.layer, t.role) for t in by_names} >= {(0, "K"), (1, "Q")}
    # The forward shows it: q is W x plus the adapter's product.
    with pytest.warns(PartialTargetWarning, match=r"0\.q_proj adds other weights' products"):
        found = find_targets(model, example_input=torch.randn(1, 4, 16))
    assert (0, "Q") not in {(t.layer, t.role) for t in found}
    assert any(s.parameter_name == "0.q_proj.weight" for s in found.skipped)


def test_a_forward_that_cannot_be_followed_falls_back_to_the_names_in_one_line() -> None:
    class Projection(nn.Linear):  # x W^T as a broadcast product summed: no product the record reads
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.unsqueeze(-2) * self.weight).sum(-1)

    model = _interleaved("q_proj,k_proj,v_proj,o_proj")
    for entry in (0, 2, 4):
        model[entry].q_proj = Projection(16, 16, bias=False)
    with pytest.warns(
        PartialTargetWarning, match=r"could not be followed for layer 0, layer 1"
    ) as w:
        found = find_targets(model, example_input=torch.randn(1, 5, 16))
    assert len([r for r in w if "could not be followed" in str(r.message)]) == 1
    assert [(t.layer, t.role) for t in found if t.role in ("Q", "K", "V", "O")] == [
        (layer, role) for layer in range(3) for role in ("Q", "K", "V", "O")
    ]
    assert {found.sources[t.name] for t in found if t.role in ("Q", "K", "V", "O")} == {"names"}


@pytest.mark.parametrize("stored", ["(out, in)", "(in, out)"])
def test_a_projection_written_as_einsum_is_followed(stored: str) -> None:
    # before: einsum was a product the record did not read; the layers were "not followed" and
    # a weight no rule names (here `u`) was not found at all
    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shape = (16, 16)
            self.u = nn.Parameter(torch.randn(shape) / 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if stored == "(out, in)":
                return torch.einsum("...i,oi->...o", x, self.u)
            return torch.einsum("bti,io->bto", x, self.u)

    model = _interleaved("q_proj,k_proj,v_proj,o_proj")
    for entry in (0, 2, 4):
        model[entry].q_proj = Projection()
    x = torch.randn(1, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        found = find_targets(model, example_input=x)
    queries = [t for t in found if t.role == "Q"]
    assert [(t.layer, t.parameter_name) for t in queries] == [
        (layer, f"{entry}.q_proj.u") for layer, entry in enumerate((0, 2, 4))
    ]
    for t in queries:  # the matrix the forward multiplies by: x @ matrix().T is its output
        projection = model.get_submodule(t.parameter_name.rpartition(".")[0])
        torch.testing.assert_close(x @ t.matrix().T, projection(x))
    assert {found.sources[t.name] for t in queries} == {"data flow"}


def test_a_weight_cast_to_the_activations_dtype_is_followed() -> None:
    """Weights stored in bf16 and cast to the activations' dtype in the forward,
    ``F.linear(x, W.to(x.dtype), b.to(x.dtype))``: the cast is still the weight, so the roles of
    these unnamed projections come from the forward as for a plain Linear."""

    class CastProjection(nn.Linear):
        def __init__(self) -> None:
            super().__init__(16, 16, dtype=torch.bfloat16)  # the default init: a nonzero bias

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return F.linear(h, self.weight.to(h.dtype), self.bias.to(h.dtype))

    torch.manual_seed(0)
    model = _interleaved()
    for entry in (0, 2, 4):
        for name in "xyzw":
            setattr(model[entry], name, CastProjection())
    x = torch.randn(1, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        found = find_targets(model, example_input=x)
    attention = [t for t in found if t.role in ("Q", "K", "V", "O")]
    assert [(t.layer, t.role, t.parameter_name) for t in attention] == [
        (layer, role, f"{entry}.{name}.weight")
        for layer, entry in enumerate((0, 2, 4))
        for role, name in zip("QKVO", "xyzw", strict=True)
    ]
    assert {found.sources[t.name] for t in attention} == {"data flow"}
    for t in attention:  # the matrix the forward multiplies by, in the dtype it is stored in
        projection = model.get_submodule(t.parameter_name.rpartition(".")[0])
        assert t.matrix().dtype == torch.bfloat16
        torch.testing.assert_close(
            F.linear(x, t.matrix().float(), projection.bias.float()), projection(x)
        )


def test_multi_head_attention_is_read_from_its_arguments() -> None:
    layer = nn.TransformerDecoderLayer(16, 2, 32, batch_first=True)
    model = nn.TransformerDecoder(layer, 2)
    x, memory = torch.randn(1, 5, 16), torch.randn(1, 7, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        found = find_targets(model, example_input=(x, memory))
    assert [(t.layer, t.role, found.sources[t.name]) for t in found if t.layer == 1] == [
        (1, role, "names = data flow")
        for role in ("Q", "K", "V", "O", "Q_cross", "K_cross", "V_cross", "O_cross")
    ] + [(1, "MLP_up", "names = data flow"), (1, "MLP_down", "names = data flow")]


def test_the_printed_map_says_where_each_role_came_from() -> None:
    text = format_targets(find_targets(Unhelpful(layers=1), example_input=tokens()))
    assert "from" in text.splitlines()[0]
    assert "    0  K         z.p.a.weight[K]         (16, 32)  data flow" in text.splitlines()
    assert "roles from: data flow 7" in text


def test_discovery_leaves_the_random_stream_and_the_weights_as_they_were() -> None:
    model = Unhelpful(layers=1)
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    flow = discover_roles(model, tokens())
    assert flow.attention_calls == 1
    torch.testing.assert_close(torch.rand(3), expected)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


transformers = pytest.importorskip("transformers")


def _hf(name: str) -> nn.Module:
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50)
        return transformers.GPT2LMHeadModel(config)
    if name == "llama":
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=2, vocab_size=50)
        return transformers.LlamaForCausalLM(config)
    if name == "gpt_neox":
        config = transformers.GPTNeoXConfig(**sizes, vocab_size=50, rotary_pct=0.5)
        return transformers.GPTNeoXForCausalLM(config)
    return transformers.BertModel(transformers.BertConfig(**sizes, vocab_size=50))


def _nanogpt() -> nn.Module:
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=50))


@pytest.mark.parametrize("name", ["gpt2", "llama", "gpt_neox", "bert", "nanogpt"])
def test_names_of_known_models_are_unchanged_and_confirmed_by_the_forward(name: str) -> None:
    torch.manual_seed(0)
    model = _nanogpt() if name == "nanogpt" else _hf(name)
    x = torch.randint(0, 50, (1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        by_names = find_targets(model)
        by_flow = find_targets(model, example_input=x)
    assert [(t.name, t.stack, t.layer, t.role, t.rows) for t in by_flow] == [
        (t.name, t.stack, t.layer, t.role, t.rows) for t in by_names
    ]
    assert set(by_flow.sources.values()) == {"names = data flow"}


def test_the_command_line_reads_roles_from_a_forward_when_given_an_example_input(
    tmp_path: Path, capsys: Any
) -> None:
    from spectral_callbacks.cli import main

    torch.manual_seed(0)
    _hf("llama").save_pretrained(tmp_path / "llama")
    capsys.readouterr()  # what saving printed (a progress bar, on some releases) is not the CLI's
    assert main(["targets", str(tmp_path / "llama"), "--example-input", "auto"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split()[-1] == "from"
    assert sum(line.endswith("  names = data flow") for line in printed.splitlines()) == 14
    assert "roles from: names = data flow 14" in printed
    assert main(["targets", str(tmp_path / "llama")]) == 0
    assert "roles from the names alone" in capsys.readouterr().out
    logdir = tmp_path / "runs"
    argv = ["analyze", str(tmp_path / "llama"), "--logdir", str(logdir)]
    assert main([*argv, "--example-input", "auto"]) == 0
    assert "roles: from names = data flow 14" in capsys.readouterr().err
    assert main([*argv, "--example-input", str(tmp_path / "missing.pt")]) == 1
    assert "--example-input" in capsys.readouterr().err


def test_a_compiled_model_is_not_recorded_and_says_so(tmp_path: Path) -> None:
    model = torch.compile(_nanogpt())
    with pytest.warns(RuntimeWarning, match="compiled"):
        tracker = SpectralTracker(
            model, logdir=tmp_path, figures=False, roles_from_first_forward=True
        )
    assert len(tracker.targets) == 12  # found by the names at construction, as without the option
    tracker.close()


@pytest.mark.skipif(
    not hasattr(transformers, "DeepseekV3Config"), reason="DeepSeek-V3 needs transformers 4.51"
)
def test_a_key_written_in_place_is_followed_in_deepseek_v3() -> None:
    # DeepSeek-V3 builds its key with new_empty and two copy_ into slices: [k_nope; k_rope].
    config = transformers.DeepseekV3Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_key_value_heads=4,
        vocab_size=50,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        q_lora_rank=16,
        first_k_dense_replace=1,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)  # no layer left unfollowed
        by_flow = find_targets(model, example_input=torch.randint(0, 50, (1, 6)))
    assert [(t.name, t.layer, t.role) for t in by_flow] == [
        (t.name, t.layer, t.role) for t in find_targets(model)
    ]
    confirmed = {(t.layer, t.role) for t in by_flow if by_flow.sources[t.name] != "names"}
    assert confirmed >= {(layer, role) for layer in (0, 1) for role in ("K", "V", "O")}


def test_flex_attention_is_an_attention_call_and_its_tracing_is_left_alone() -> None:
    # flex_attention traces itself with torch.compile even when called eagerly: the recorder
    # must stay out of that trace (it would break the forward) and still see the call.
    flex = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.u, self.w = nn.Linear(16, 48), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.u(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, nh, T, hs) each
            return self.w(flex(q, k, v).transpose(1, 2).reshape(1, -1, 16))

    model = nn.Sequential(Attention(), Attention())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex's own "called without compile"
        flow = discover_roles(model, torch.randn(1, 4, 16))
    assert flow.attention_calls == 2
    assert [(r.layer, r.role, r.parameter, r.rows) for r in flow.roles if r.layer == 1] == [
        (1, "Q", "1.u.weight", tuple(range(0, 16))),
        (1, "K", "1.u.weight", tuple(range(16, 32))),
        (1, "V", "1.u.weight", tuple(range(32, 48))),
        (1, "O", "1.w.weight", None),
    ]


def test_a_learned_query_attending_over_the_sequence_is_not_cross_attention() -> None:
    class Pool(nn.Module):  # SigLIP's head: a learned probe is the query
        def __init__(self) -> None:
            super().__init__()
            self.probe = nn.Parameter(torch.randn(1, 1, 16))
            self.attention = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            query = self.probe.expand(x.shape[0], -1, -1)
            return self.attention(query, x, x, need_weights=False)[0]

    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    model = nn.Sequential(layer, Pool())
    found = find_targets(model, example_input=torch.randn(2, 5, 16))
    pooled = [(t.role, found.sources[t.name]) for t in found if t.name.startswith("1.")]
    assert pooled == [(role, "names = data flow") for role in ("Q", "K", "V", "O")]


def test_a_hand_made_lora_in_the_unhelpful_model_is_watched_as_its_effective_weight(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = Unhelpful(layers=2, adapted=True)  # each block's output projection: u + 0.5 w v
    x = tokens()
    found = find_targets(model, example_input=x)
    assert [(t.layer, t.role) for t in found] == [(layer, r) for layer in range(2) for r in SEVEN]
    assert set(found.sources.values()) == {"data flow"}

    def effective(key: str) -> torch.Tensor:
        b = model.z[key].b
        return b.u.double() + 0.5 * b.w.double() @ b.v.double()

    for target in found:
        if target.role == "O":
            assert getattr(target, "has_update", False)  # the adapted path: effective + update
            key = target.parameter_name.split(".")[1]
            torch.testing.assert_close(target.matrix().detach().double(), effective(key))

    def stable_ranks() -> dict[str, float]:
        ranks = {}
        for layer, key in enumerate("pq"):
            matrix = effective(key)
            top = torch.linalg.svdvals(matrix)[0]
            ranks[f"spectral_stable_rank/L{layer:02d}/O"] = float((matrix**2).sum() / top**2)
        return ranks

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    expected = {0: stable_ranks()}
    with SpectralTracker(
        model,
        ["stable_rank"],
        logdir=tmp_path,
        figures=False,
        every_n_steps=2,
        svd_method="svdvals",
        max_pending=8,  # room for every scheduled step: which are logged is not the worker's pace
        example_input=x,
    ) as tracker:
        for step in range(1, 5):
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
            expected[step] = stable_ranks()
            tracker.step(step)
    scalars = read_scalars(tmp_path)
    for step in (0, 2, 4):
        for tag, value in expected[step].items():
            assert scalars[tag][step] == pytest.approx(value, rel=1e-5)
    assert expected[4] != expected[0]  # the adapter trained: the effective weight moved
