"""The name rules of research code (tests/research_models.py, every bias non-zero): lucidrains'
``to_qkv``/``to_out.0``/``FeedForward.net``, diffusers' ``to_q``/``to_k``/``to_v``/``to_out.0``
with ``attn2`` as cross-attention and a GEGLU ``ff.net.0.proj``, and attention and MLP as
alternating entries of one list (``to_kv``, ``ff``/``feed_forward``/``ffn`` Sequentials).

Each found matrix is checked against what the model's own forward computed (the q, k, v its
attention used, the halves its GEGLU chunked), with the attention in a custom kernel the
recording cannot follow, so the names alone decide; a short fit logs each one exactly; and the
report (``format_targets``, ``spectral-callbacks targets``) says what decided each role: the
names, the forward, or both.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import research_models as rm
import torch
from tiny_models import RecordingLogger, assert_logged_exactly, exact_spectrum
from torch import nn

from spectral_callbacks import SpectralTracker
from spectral_callbacks.targets import (
    PartialTargetWarning,
    TargetWarning,
    find_targets,
    format_targets,
)

ATTENTION = ("Q", "K", "V", "O")
CROSS = ("Q_cross", "K_cross", "V_cross", "O_cross")
MLP = ("MLP_up", "MLP_down")
MODELS = {
    "lucidrains": (lambda core: rm.Lucid(core=core), ATTENTION + MLP),
    "diffusers": (lambda core: rm.Diffusers(core=core), ATTENTION + CROSS + ("MLP_gate",) + MLP),
    "alternating ff": (lambda core: rm.Alternating(core=core, mlp_name="ff"), ATTENTION + MLP),
    "alternating feed_forward": (
        lambda core: rm.Alternating(core=core, mlp_name="feed_forward"),
        ATTENTION + MLP,
    ),
    "alternating ffn": (lambda core: rm.Alternating(core=core, mlp_name="ffn"), ATTENTION + MLP),
    "x-transformers": (lambda core: rm.XTransformers(core=core), ATTENTION + MLP),
    "x-transformers glu": (
        lambda core: rm.XTransformers(core=core, glu=True),
        ATTENTION + ("MLP_gate",) + MLP,
    ),
}


def _by_names(model: nn.Module):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)
        return find_targets(model)


def _used_by_forward(model: nn.Module, targets) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For each target, (the input of its Linear, what the forward used as its role's output)
    from one forward: the attention's q, k, v (``seen``), the GEGLU's two halves, else the
    Linear's whole output."""
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for path in {t.parameter_name.rpartition(".")[0] for t in targets}:

        def keep(module: nn.Module, args: Any, out: torch.Tensor, path: str = path) -> None:
            inputs[path], outputs[path] = args[0].detach(), out.detach()

        hooks.append(model.get_submodule(path).register_forward_hook(keep))
    with torch.no_grad():
        model(rm.tokens())
    for hook in hooks:
        hook.remove()
    used = {}
    for t in targets:
        path = t.parameter_name.rpartition(".")[0]
        owner = model.get_submodule(path.rpartition(".")[0])
        holder = owner if hasattr(owner, "seen") else model.get_submodule(path)
        seen = getattr(holder, "seen", ())
        position = {"Q": 0, "K": 1, "V": 2, "MLP_up": 0, "MLP_gate": 1}.get(t.role.split("_c")[0])
        if seen and position is not None:
            used[t.name] = (inputs[path], seen[position])
        else:
            used[t.name] = (inputs[path], outputs[path])
    return used


@pytest.mark.parametrize("name", sorted(MODELS))
def test_research_names_map_to_the_matrices_the_forward_uses(name: str) -> None:
    build, roles = MODELS[name]
    model = rm.biased(build("kernel"))
    targets = _by_names(model)
    assert [(t.layer, t.role) for t in targets] == [(layer, r) for layer in (0, 1) for r in roles]
    assert {t.num_layers for t in targets} == {2}
    used_by_forward = _used_by_forward(model, targets)
    for t in targets:
        x, used = used_by_forward[t.name]
        bias = model.get_parameter(t.parameter_name.replace(".weight", ".bias"))
        rows = t.rows.take(bias[:, None])[:, 0]  # the bias of the same output rows
        torch.testing.assert_close(x @ t.matrix().T + rows, used, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_fit_of_a_model_whose_forward_cannot_be_followed_logs_each_named_matrix(name) -> None:
    model = rm.biased(MODELS[name][0]("kernel"))
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU placement notes; the unfollowed forward's line
        tracker = SpectralTracker(
            model, writers=[logger], every_n_steps=1, log_spaced_until=0, figures=False,
            synchronous=True,
        )  # fmt: skip
    targets = tracker.targets
    assert [(t.layer, t.role) for t in targets] == [(t.layer, t.role) for t in _by_names(model)]

    def exact() -> dict[str, tuple[float, float]]:
        return {t.name: exact_spectrum(t.matrix()) for t in targets}

    expected = {0: exact()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, batch in enumerate(rm.tokens(batch=6, seed=1).split(2), start=1):
        model.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = exact()
        tracker.step(step)
    tracker.close(3)
    assert expected[3] != expected[0]
    assert_logged_exactly(logger, targets, expected, 2)


def test_a_compiled_model_is_found_by_its_names_and_logged_exactly() -> None:
    # torch.compile (dynamo with the eager backend: no C++ build): the forward runs a graph,
    # so the names decide, and a short fit logs each matrix of the diffusers-style model.
    model = rm.biased(rm.Diffusers(core="sdpa"))
    compiled = torch.compile(model, backend="eager")
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU placement notes
        tracker = SpectralTracker(
            compiled, writers=[logger], every_n_steps=1, log_spaced_until=0, figures=False,
            synchronous=True,
        )  # fmt: skip
    targets = tracker.targets
    assert [(t.layer, t.role, t.rows) for t in targets] == [
        (t.layer, t.role, t.rows) for t in _by_names(model)
    ]

    def exact() -> dict[str, tuple[float, float]]:
        return {t.name: exact_spectrum(t.matrix()) for t in targets}

    expected = {0: exact()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, batch in enumerate(rm.tokens(batch=6, seed=1).split(2), start=1):
        logits = compiled(batch[:, :-1])
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, rm.VOCAB), batch[:, 1:].reshape(-1)
        ).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = exact()
        tracker.step(step)
    tracker.close(3)
    assert expected[3] != expected[0]
    assert_logged_exactly(logger, targets, expected, 2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_forward_confirms_each_names_reading(name: str) -> None:
    # The same models attending by scaled_dot_product_attention, which a forward reads: every
    # weight in the same roles and rows by the forward as by the names.
    model = rm.biased(MODELS[name][0]("sdpa"))
    by_names = _by_names(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)
        by_both = find_targets(model, example_input=rm.tokens())
    assert set(by_both.sources.values()) == {"names = data flow"}
    assert sorted((t.name, t.role, t.rows) for t in by_both) == sorted(
        (t.name, t.role, t.rows) for t in by_names
    )


# Blocks held in a list of lists (each entry of ``layers`` a ModuleList of its parts, called by
# indexing): numbered by the forward as the names number them too.
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_forward_numbers_the_layers_as_the_names_do(name: str) -> None:
    model = rm.biased(MODELS[name][0]("sdpa"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=TargetWarning)
        by_both = find_targets(model, example_input=rm.tokens())
    assert [(t.name, t.stack, t.layer) for t in by_both] == [
        (t.name, t.stack, t.layer) for t in _by_names(model)
    ]


# The three answers to "what decided this role", each from a model that gives it.
PROVENANCE = {
    "names": (lambda: rm.Plain(core="kernel"), "names"),  # the forward cannot be followed
    "names = data flow": (rm.Plain, "names = data flow"),
    "data flow": (rm.PlainUnnamed, "data flow"),
}


@pytest.mark.parametrize("case", sorted(PROVENANCE))
def test_the_report_says_whether_names_the_forward_or_both_decided(case: str) -> None:
    build, source = PROVENANCE[case]
    model = rm.biased(build())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(model, example_input=rm.tokens())
    unfollowed = [w for w in caught if "could not be followed" in str(w.message)]
    assert len(unfollowed) == (1 if source == "names" else 0)
    assert unfollowed == [] or unfollowed[0].category is PartialTargetWarning
    assert [(t.layer, t.role) for t in targets] == [
        (layer, role) for layer in (0, 1) for role in ATTENTION + MLP
    ]
    assert set(targets.sources.values()) == {source}
    lines = format_targets(targets).splitlines()
    assert lines[0].split()[-1] == "from"
    rows = lines[1 : 1 + len(targets)]
    assert all(row.endswith(f"  {source}") for row in rows), rows
    assert f"roles from: {source} {len(targets)}" in lines


def test_the_targets_command_says_what_decided_each_role(tmp_path: Path, capsys: Any) -> None:
    from spectral_callbacks.cli import main

    batch = tmp_path / "batch.pt"
    torch.save(rm.tokens(), batch)
    for name, arch, example, source in (
        ("by names", "research_models:Plain", [], "names"),
        ("by both", "research_models:Plain", ["--example-input", str(batch)], "names = data flow"),
        ("by the forward", "research_models:PlainUnnamed", ["--example-input", str(batch)], "data flow"),
    ):  # fmt: skip
        weights = tmp_path / f"{name}.pt"
        module, _, cls = arch.partition(":")
        torch.save(rm.biased(getattr(rm, cls)()).state_dict(), weights)
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=TargetWarning)
            assert main(["targets", str(weights), "--arch", arch, *example]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert printed[0].split()[-1] == "from", name
        assert sum(line.endswith(f"  {source}") for line in printed) == 12, (name, printed)
        assert f"roles from: {source} 12" in printed, name
