"""WatchPlan hands the tracker its final targets by one call, and holds no reference to it after:
a hand that raises is not raised inside the user's forward, and the names may hand them again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from unhelpful_model import Unhelpful

from spectral_callbacks.monitor.options import MonitorOptions
from spectral_callbacks.monitor.watch_plan import WatchPlan
from spectral_callbacks.targets import find_targets
from spectral_callbacks.targets.delta import DeltaTarget

VOCAB = 64


def test_the_forward_hands_the_targets_once_and_a_failed_hand_is_raised_after_it() -> None:
    torch.manual_seed(0)
    model = Unhelpful(vocab=VOCAB, layers=2)
    handed: list[tuple[list[Any], bool]] = []

    def hand(targets: list[Any], begin: bool) -> None:
        handed.append((targets, begin))
        raise RuntimeError("the tracker could not start")

    plan = WatchPlan(model, MonitorOptions.from_kwargs("T"), "T", hand)
    plan.start()
    assert handed == []  # the names cannot place these weights: the forward decides
    x = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()  # the hand raised inside: kept, not raised here
    assert len(handed) == 1 and len(handed[0][0]) == 14 and handed[0][1] is True
    with pytest.raises(RuntimeError, match="could not start"):
        plan.forward_ends()
    plan.raise_kept_error()  # raised once


def test_the_names_hand_the_final_targets_with_references_and_then_let_the_tracker_go() -> None:
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    handed: list[tuple[list[Any], bool]] = []
    options = MonitorOptions.from_kwargs("T", roles_from_first_forward=True, delta="first")
    plan = WatchPlan(model, options, "T", lambda targets, begin: handed.append((targets, begin)))
    plan.start()
    assert handed == []  # asked for the forward's roles: it waits
    with pytest.warns(RuntimeWarning, match="step 3 came before any forward"):
        plan.names_now(3)
    [(targets, begin)] = handed
    assert begin is False  # the first snapshot is the step's, not the one begin was asked for
    assert [t.name for t in targets] == [t.name for t in find_targets(model)]
    assert all(isinstance(t, DeltaTarget) for t in targets)
    assert plan._hand is None  # handed over: the tracker is not kept alive by the plan
