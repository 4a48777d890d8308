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


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_rank_keeps_the_references_of_its_share_of_the_targets_and_heads(
    monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    from hf_models import tiny_llama

    from spectral_callbacks.monitor.engines import distributed

    torch.manual_seed(0)
    # GQA: K and V (32 x 64) cost less than a head (64 x 64), so the heads come before them in
    # the partition's order (on 3 ranks they move their owners)
    model = tiny_llama(bias=True)
    options = MonitorOptions.from_kwargs(
        "T", delta="first", circuits=True, roles_from_first_forward=False
    )
    kept: list[set[str]] = []
    for rank in range(world_size):  # what each rank of a DDP run decides, one after the other
        monkeypatch.setattr(distributed, "world", lambda rank=rank: (rank, world_size))
        handed: list[list[Any]] = []
        WatchPlan(model, options, "T", lambda targets, begin, to=handed: to.append(targets)).start()
        [targets] = handed
        dense = [t for t in targets if isinstance(t, DeltaTarget)]
        heads = [t for t in targets if t.attention_layer is not None]
        assert len(dense) == 14 and heads and len(targets) == len(dense) + len(heads)
        mine = {t.name for t in dense if t.reference is not None}
        for t in dense:
            if t.name in mine:
                assert torch.equal(t.reference, t.matrix())  # a copy of the weights now
        # the engine's share of every target it gets, the heads included, in the same order
        owners = distributed.partition(targets, world_size)
        share = {t.name for t, o in zip(targets, owners, strict=True) if o == rank}
        assert mine == share & {t.name for t in dense}, rank
        kept.append(mine)
    # every reference is kept once, on the rank that decomposes its matrix (one process: all)
    assert sorted(n for mine in kept for n in mine) == sorted(t.name for t in dense)
    if world_size == 3:  # the heads move the partition: a share of the matrices alone differs
        alone = distributed.partition(dense, world_size)
        owned = [{t.name for t, o in zip(dense, alone, strict=True) if o == r} for r in range(3)]
        assert owned != kept
