"""The open training stacks with their real code: tiny torchtitan, torchtune and litgpt models built
by their own config and builder code (stack_models.py), watched with no ``mapping=``: every layer's
roles found, each matrix what the library's forward uses (the checks of
benchmarks/stacks_table.py, on one recorded forward), logged stable ranks equal to float64 along a
short fit, LoRA/DoRA layers watched as their effective weights. Skipped where a library is not
installed (the ``stacks`` libraries: Makefile)."""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from stack_models import BUILDERS

from spectral_callbacks.targets import PartialTargetWarning, find_targets
from spectral_callbacks.targets.lowrank import LowRankTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stacks_table  # noqa: E402

LIBRARY = {name: name.split()[0] for name in BUILDERS}


def build(name: str):
    pytest.importorskip(LIBRARY[name])
    return BUILDERS[name]()


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_role_is_found_and_is_what_the_forward_uses(name: str) -> None:
    stack = build(name)
    targets = list(find_targets(stack.model))
    assert {(t.stack, t.layer, t.role) for t in targets} == set(stack.expected)
    exact = stacks_table.exact_targets(stack, targets)
    assert exact and not [target for target, ok in exact.items() if not ok]
    if stack.experts:  # each expert's matrices, every MoE layer and role
        per_role = Counter((t.layer, t.role) for t in targets if t.expert is not None)
        assert set(per_role.values()) == {stack.experts}
    if stack.adapters:
        layers = {id(t.layer_module) for t in targets if isinstance(t, LowRankTarget)}
        assert len(layers) == stack.adapters
        assert all(isinstance(t, LowRankTarget) for t in targets)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_discovery_from_the_forward_agrees_with_the_names(name: str) -> None:
    """With an example input the roles are read from the model's forward as well; where it can
    be followed both agree, where not (the parts of MLA and the experts it cannot tell apart) the
    names stand."""
    stack = build(name)
    by_names = find_targets(stack.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = find_targets(stack.model, example_input=torch.randint(0, 100, (2, 8)))
    assert [(t.name, t.layer, t.role) for t in found] == [
        (t.name, t.layer, t.role) for t in by_names
    ]


@pytest.mark.parametrize("name", ["torchtitan llama3 fused", "torchtitan llama3 unfused"])
def test_torchtitans_complex_rotary_embedding_is_followed(name: str) -> None:
    # before: view_as_complex / view_as_real around q and k stopped the index replay, both
    # attention calls were "not followed" and the names alone decided, in a warning
    stack = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        found = find_targets(stack.model, example_input=torch.randint(0, 100, (2, 8)))
    assert len(found) == 14
    assert set(found.sources.values()) == {"names = data flow"}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_logged_stable_ranks_equal_float64_along_a_short_fit(name: str) -> None:
    stack = build(name)
    assert stacks_table.fit_error(stack, steps=2) < 1e-5
