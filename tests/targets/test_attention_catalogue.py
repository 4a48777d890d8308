"""The catalogue: attention, MLP and block forms written from the math (``tests/attention_forms.py``),
each read from its forward by structure alone, and each fit logging exactly a float64 reference.

For every form: the attention calls the forward shows (kind, query and K/V heads, layers), the
weight and rows behind each role of each layer (with the name rules off: the structure alone
decides; and with them on: they agree), and a short fit whose first forward is recorded
(``roles_from_first_forward=True``, ``circuits=True``) logging each target's stable rank and σ₁
and each head's QK stable rank equal to a float64 SVD at every step. A new form is one more entry
of ``attention_forms.FORMS``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from spectral_callbacks import SpectralTracker
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import (
    PartialTargetWarning,
    SharedLayerWarning,
    find_targets,
)
from spectral_callbacks.targets.roles import discover_roles

sys.path.insert(0, str(Path(__file__).parents[1]))
from attention_forms import FORMS, HS, Form, example_input  # noqa: E402
from tiny_models import RecordingLogger, assert_logged_exactly, exact_spectrum  # noqa: E402

IDS = [f"{i:02d}" for i in range(len(FORMS))]


def test_the_catalogue_has_twelve_forms_and_one_no_rule_knows() -> None:
    assert len(FORMS) >= 12
    assert any(form.structure_only for form in FORMS)
    assert len({form.name for form in FORMS}) == len(FORMS)


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_the_forward_shows_each_form_s_attention_calls(form: Form) -> None:
    torch.manual_seed(0)
    flow = discover_roles(form.build(), example_input())
    assert flow.unfollowed == []
    assert flow.attention_calls == len(flow.calls) == form.call_count
    assert {call.kind for call in flow.calls} == {form.kind}
    assert {(call.heads, call.kv_heads) for call in flow.calls} == {form.heads}
    assert [call.layer for call in flow.calls if call.reuses is None] == list(range(form.layers))
    assert [call.reuses for call in flow.calls][form.layers :] == [0] * (
        form.call_count - form.layers
    )
    assert len(flow.shared) == (form.call_count > form.layers)


@pytest.mark.parametrize("rules", [False, True], ids=["structure", "structure+names"])
@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_each_role_is_the_weight_and_rows_the_math_says(form: Form, rules: bool) -> None:
    torch.manual_seed(0)
    model = form.build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        if form.call_count > form.layers:
            with pytest.warns(SharedLayerWarning, match="a shared layer, watched as one set"):
                found = find_targets(model, example_input=example_input(), builtin_rules=rules)
        else:
            found = find_targets(model, example_input=example_input(), builtin_rules=rules)
    expected = {
        (layer, role): weight
        for layer in range(form.layers)
        for role, weight in form.weights(layer).items()
    }
    assert sorted((t.layer, t.role) for t in found) == sorted(expected)
    assert {t.num_layers for t in found} == {form.layers}
    for target in found:
        name, rows = expected[(target.layer, target.role)]
        assert target.parameter_name == name
        weight = model.get_parameter(name)
        assert torch.equal(target.matrix(), weight if rows is None else weight[list(rows)])
    if not rules or form.structure_only:
        assert set(found.sources.values()) == {"data flow"}
    else:
        assert set(found.sources.values()) <= {"data flow", "names = data flow"}
    read = {(name, role): n for (name, role), n in found.heads_read.items()}
    q_heads, kv_heads = form.heads
    for layer in range(form.layers):
        weights = form.weights(layer)
        assert read[(weights["Q"][0], "Q")] == q_heads
        assert read[(weights["K"][0], "K")] == read[(weights["V"][0], "V")] == kv_heads


def _qk_stable_ranks(
    query: torch.Tensor, key: torch.Tensor, heads: int, groups: int
) -> list[float]:
    """Per query head, the float64 stable rank of W_Q^h^T W_K^g(h), formed (d x d)."""
    ranks = []
    for h in range(heads):
        g = h // (heads // groups)
        circuit = query[h * HS : (h + 1) * HS].double().T @ key[g * HS : (g + 1) * HS].double()
        ranks.append(exact_spectrum(circuit)[0])
    return ranks


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_a_short_fit_logs_every_form_exactly(form: Form) -> None:
    torch.manual_seed(0)
    model = form.build()
    x = example_input()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedLayerWarning)  # said by the test above
        # Which logit scale each form applies is not what this test reads.
        warnings.filterwarnings("ignore", "the logit scale", PartialTargetWarning)
        tracker = SpectralTracker(
            model,
            ["stable_rank", "spectral_norm"],
            writers=[logger],
            figures=False,
            every_n_steps=1,
            synchronous=True,
            roles_from_first_forward=True,
            circuits=True,
        )
        expected: dict[int, dict[str, tuple[float, float]]] = {}
        circuits: dict[int, dict[int, list[float]]] = {}
        q_heads, kv_heads = form.heads
        for step in range(4):
            loss = model(x).pow(2).mean()
            loss.backward()
            if step == 0:  # the roles are read by now: step 0 is the weights before any update
                matrices = [t for t in tracker.targets if t.role in ("Q", "K") or t.head is None]
                watched = [t for t in tracker.targets if t.head is None]
                expected[0] = {t.name: exact_spectrum(t.matrix()) for t in watched}
                by = {(t.layer, t.role): t.matrix() for t in matrices}
                circuits[0] = {
                    layer: _qk_stable_ranks(by[(layer, "Q")], by[(layer, "K")], q_heads, kv_heads)
                    for layer in range(form.layers)
                }
            optimizer.step()
            optimizer.zero_grad()
            expected[step + 1] = {t.name: exact_spectrum(t.matrix()) for t in watched}
            by = {(t.layer, t.role): t.matrix() for t in matrices}
            circuits[step + 1] = {
                layer: _qk_stable_ranks(by[(layer, "Q")], by[(layer, "K")], q_heads, kv_heads)
                for layer in range(form.layers)
            }
            tracker.step(step + 1)
        tracker.close()
    heads = [t for t in tracker.targets if t.head is not None]
    assert len(heads) == form.layers * q_heads
    assert_logged_exactly(logger, watched, expected, form.layers)
    for layer in range(form.layers):
        for h in range(q_heads):
            tag = scalar_tag("qk_stable_rank", layer, "heads", form.layers, head=h)
            logged = logger.series(tag)
            assert sorted(logged) == sorted(circuits), tag
            for step, value in logged.items():
                assert value == pytest.approx(circuits[step][layer][h], rel=1e-6), (tag, step)


class _NanoAttention(torch.nn.Module):
    """nanoGPT's names (the rules read them) and its head count in ``self.nh`` (no name the
    circuits look up): ``view(B, T, n, C // n)`` is where the count shows."""

    def __init__(self, width: int = 32, nh: int = 4) -> None:
        super().__init__()
        self.nh = nh
        self.c_attn, self.c_proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, L, self.nh, C // self.nh).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, L, C))


class _NanoGPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = torch.nn.ModuleList(
            [torch.nn.ModuleDict({"attn": _NanoAttention()}) for _ in "ab"]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = x + block["attn"](x)
        return x


def test_circuits_of_a_block_that_keeps_its_head_count_under_its_own_name() -> None:
    # before: the names decided at construction and circuits=True ended with "no attention layer
    # could be read (... its head count is not on the module or its config)"
    torch.manual_seed(0)
    model = _NanoGPT()
    names = find_targets(model)
    assert [t.role for t in names] == ["Q", "K", "V", "O"] * 2  # the names read every weight
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the logit scale", PartialTargetWarning)
        tracker = SpectralTracker(
            model, ["stable_rank"], writers=[logger], figures=False, synchronous=True,
            circuits=True,
        )  # fmt: skip
        assert tracker.targets == []  # the default ("auto"): only the forward tells the heads
        model(example_input()).sum().backward()
        tracker.step(1)
        tracker.close()
    heads = [(t.layer, t.head) for t in tracker.targets if t.head is not None]
    assert heads == [(layer, h) for layer in range(2) for h in range(4)]
    assert {t.name: t.role for t in tracker.targets if t.head is None} == {
        t.name: t.role for t in names
    }
    tag = scalar_tag("qk_stable_rank", 1, "heads", 2, head=3)
    assert sorted(logger.series(tag)) == [0, 1]
