"""``delta=``: the update family of a dense fine-tune, W_t - W_ref, against float64 exact SVD."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from tiny_models import TinyGPT

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import delta as delta_module
from spectral_callbacks.targets import find_targets
from spectral_callbacks.targets.delta import DeltaTarget


class Writer:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.records.append((step, dict(metrics)))

    def series(self, tag: str) -> dict[int, float]:
        return {step: m[tag] for step, m in self.records if tag in m}


def _train(model: Any, tracker: SpectralTracker, steps: int, weights: dict[int, Any]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 256, (4, 17), generator=generator)
        _, loss = model.model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        weights[step] = {t.name: t.matrix().detach().double().clone() for t in find_targets(model)}
        tracker.step(step)


def _exact_update_stable_rank(delta: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(delta)
    return float((singular**2).sum() / singular[0] ** 2)


def test_delta_first_logs_the_exact_update_of_a_dense_fine_tune() -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_embd=64, n_head=4, block_size=16)
    first = {t.name: t.matrix().detach().double().clone() for t in find_targets(model)}
    weights: dict[int, Any] = {}
    writer = Writer()
    tracker = SpectralTracker(
        model, delta="first", writers=[writer], every_n_steps=5, log_spaced_until=0,
        figures=False, synchronous=True, k=64,
    )  # fmt: skip
    assert all(isinstance(t, DeltaTarget) for t in tracker.targets)
    _train(model, tracker, 15, weights)
    tracker.close()
    checked = 0
    for target in tracker.targets:
        tag = scalar_tag("update_stable_rank", target.layer, target.role, target.num_layers)
        series = writer.series(tag)
        assert sorted(series) == [0, 5, 10, 15]
        assert series[0] != series[0]  # NaN: no update yet at the first snapshot
        for step in (5, 10, 15):
            exact = _exact_update_stable_rank(weights[step][target.name] - first[target.name])
            assert series[step] == pytest.approx(exact, rel=0.01), (target.name, step)
            checked += 1
        size = scalar_tag("update_relative_size", target.layer, target.role, target.num_layers)
        diff = weights[15][target.name] - first[target.name]
        assert writer.series(size)[15] == pytest.approx(
            float(diff.norm() / first[target.name].norm()), rel=1e-5
        )
    assert checked == len(tracker.targets) * 3


def test_delta_state_dict_measures_against_the_given_base() -> None:
    torch.manual_seed(0)
    base = TinyGPT(n_layer=1, n_embd=64, n_head=4, block_size=16)
    model = TinyGPT(n_layer=1, n_embd=64, n_head=4, block_size=16)
    writer = Writer()
    with SpectralTracker(
        model, delta=base.state_dict(), writers=[writer], figures=False, synchronous=True, k=64
    ) as tracker:
        pass
    references = {t.name: t.matrix().detach().double() for t in find_targets(base)}
    for target in tracker.targets:
        tag = scalar_tag("update_stable_rank", target.layer, target.role, target.num_layers)
        delta = target.matrix().detach().double() - references[target.name]
        assert writer.series(tag)[0] == pytest.approx(_exact_update_stable_rank(delta), rel=0.01)


def test_delta_from_a_file_and_a_missing_weight_named(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_embd=32, n_head=2, block_size=8)
    path = tmp_path / "base.pt"
    torch.save(model.state_dict(), path)
    tracker = SpectralTracker(model, delta=path, start_step=None, figures=False, writers=[Writer()])
    assert all(isinstance(t, DeltaTarget) for t in tracker.targets)
    tracker.close()
    partial = {k: v for k, v in model.state_dict().items() if "c_fc" not in k}
    with pytest.raises(ConfigurationError, match=r"no matching weight for 1 .*c_fc"):
        SpectralTracker(model, delta=partial, start_step=None, figures=False, writers=[Writer()])
    with pytest.raises(ConfigurationError, match=r"`delta`=.*missing.pt.*no such file"):
        SpectralTracker(
            model, delta=tmp_path / "missing.pt", start_step=None, figures=False, writers=[Writer()]
        )
    with pytest.raises(ConfigurationError, match=r"`delta` must be None, 'first', a state_dict"):
        SpectralTracker(model, delta=3, start_step=None, figures=False, writers=[Writer()])


def test_delta_that_does_not_fit_is_refused_with_the_numbers(monkeypatch: Any) -> None:
    model = TinyGPT(n_layer=1, n_embd=32, n_head=2, block_size=8)
    monkeypatch.setattr(delta_module, "_free_bytes", lambda device: 1024)
    with pytest.raises(ConfigurationError, match=r"0 MiB on cpu, but only 0 MiB is free"):
        SpectralTracker(model, delta="first", start_step=None, figures=False, writers=[Writer()])


def test_closing_releases_the_delta_references_and_the_warm_start_subspaces() -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = TinyGPT(n_layer=1, n_embd=64, n_head=4, block_size=16)
    tracker = SpectralTracker(
        model, delta="first", writers=[Writer()], every_n_steps=1, log_spaced_until=0,
        figures=False, synchronous=True, svd_method="randomized",
    )  # fmt: skip
    _train(model, tracker, 2, {})
    references = [weakref.ref(t.reference) for t in tracker.targets]
    subspaces = [weakref.ref(v) for v in tracker.compute._subspaces.values()]
    assert references and subspaces  # kept between snapshots while training runs
    tracker.close()
    gc.collect()
    # A copy of every watched matrix (delta=) and the subspaces are the run's, not the model's.
    assert [ref() for ref in references] == [None] * len(references)
    assert [ref() for ref in subspaces] == [None] * len(subspaces)
    assert len(tracker.targets) == len(references)  # the targets themselves stay described


def test_references_kept_for_some_targets_only_are_those_and_counted_alone(
    monkeypatch: Any,
) -> None:
    # Gathered weights (FSDP1, ZeRO-3): each rank keeps the references of its own share only.
    torch.manual_seed(0)
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2, block_size=8)
    found = find_targets(model)
    kept = {t.name for t in found[::3]}
    targets = delta_module.with_references(found, "first", "test", kept=kept)
    assert all(isinstance(t, DeltaTarget) for t in targets)  # every one logs its update
    held = {t.name: t.reference for t in targets if t.reference is not None}
    assert set(held) == kept
    for target in targets:
        if target.name in kept:  # a copy of the weights now
            assert torch.equal(held[target.name], target.matrix())
            assert held[target.name].untyped_storage().data_ptr() != (
                target.parameter.untyped_storage().data_ptr()
            )
    first = next(t for t in targets if t.name in kept)
    assert DeltaTarget.stack_batch([first]).references[0] is held[first.name]
    other = next(t for t in targets if t.name not in kept)
    with pytest.raises(
        RuntimeError, match=re.escape(f"{other.name}: no delta= reference is kept here")
    ):
        DeltaTarget.stack_batch([other])
    # The free-memory check counts the references kept, not every watched matrix.
    size = sum(t.shape[0] * t.shape[1] * 4 for t in found if t.name in kept)
    monkeypatch.setattr(delta_module, "_free_bytes", lambda device: size)
    delta_module.with_references(found, "first", "test", kept=kept)
    monkeypatch.setattr(delta_module, "_free_bytes", lambda device: size - 1)
    with pytest.raises(delta_module.TargetError, match="keeps a reference copy"):
        delta_module.with_references(found, "first", "test", kept=kept)
