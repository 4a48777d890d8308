"""SnapshotSchedule: the grid, jumps over grid steps, the overhead budget, resume state."""

from __future__ import annotations

import pytest

from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.monitor.schedule import SnapshotSchedule


def _simulate(schedule: SnapshotSchedule, steps: range) -> list[int]:
    taken, previous = [], -1
    for step in steps:
        if schedule.due(previous, step):
            schedule.record_snapshot(step)
            taken.append(step)
        previous = step
    return taken


def test_grid_is_step_zero_powers_of_two_and_multiples() -> None:
    schedule = SnapshotSchedule(every_n_steps=10, log_spaced_until=64)
    assert _simulate(schedule, range(0, 101)) == [
        0,
        1,
        2,
        4,
        8,
        10,
        16,
        20,
        30,
        32,
        40,
        50,
        60,
        70,
        80,
        90,
        100,
    ]


def test_dense_early_steps_can_be_turned_off() -> None:
    schedule = SnapshotSchedule(every_n_steps=7, log_spaced_until=0)
    assert _simulate(schedule, range(0, 30)) == [0, 7, 14, 21, 28]


def test_next_on_grid_matches_a_brute_force_search() -> None:
    schedule = SnapshotSchedule(every_n_steps=13, log_spaced_until=300)
    for step in range(0, 400):
        expected = next(s for s in range(step, 1000) if schedule.on_grid(s))
        assert schedule.next_on_grid(step) == expected, step


def test_a_jump_over_a_grid_step_still_counts() -> None:
    # Two optimizers (or manual optimization) can advance global_step by 2 in one batch.
    schedule = SnapshotSchedule(every_n_steps=5, log_spaced_until=0)
    assert _simulate(schedule, range(0, 21, 2)) == [0, 6, 10, 16, 20]


def test_gradient_accumulation_steps_repeat_and_fire_once() -> None:
    # With accumulate_grad_batches=4, on_train_batch_end sees each global_step 4 times; the
    # callback only asks when the step advanced, which this mirrors.
    schedule = SnapshotSchedule(every_n_steps=3, log_spaced_until=0)
    seen = [batch // 4 for batch in range(40)]
    taken, previous = [], -1
    for step in seen:
        if step != previous and schedule.due(previous, step):
            schedule.record_snapshot(step)
            taken.append(step)
        previous = step
    assert taken == [0, 3, 6, 9]


def test_budget_stretches_the_interval_along_the_grid() -> None:
    schedule = SnapshotSchedule(every_n_steps=10, log_spaced_until=0, max_overhead=0.01)
    schedule.record_step_time(0.1)
    schedule.record_snapshot_cost(0.05)  # 5 % of a step: needs >= 50 steps between snapshots
    assert schedule.min_interval() == 50
    schedule.record_snapshot(0)
    assert not schedule.due(0, 40)
    assert not schedule.due(40, 49)
    assert schedule.due(49, 50)


def test_budget_does_nothing_until_costs_are_known() -> None:
    schedule = SnapshotSchedule(every_n_steps=10, log_spaced_until=0, max_overhead=0.01)
    assert schedule.min_interval() == 1
    assert _simulate(schedule, range(0, 31)) == [0, 10, 20, 30]


def test_state_round_trip() -> None:
    schedule = SnapshotSchedule(max_overhead=0.02)
    schedule.record_snapshot(75)
    schedule.record_step_time(0.2)
    schedule.record_snapshot_cost(0.3)
    restored = SnapshotSchedule(max_overhead=0.02)
    restored.load_state_dict(schedule.state_dict())
    assert restored.state_dict() == schedule.state_dict()
    assert restored.min_interval() == schedule.min_interval() == 75


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "`every_n_steps` must be a positive int, got 0"),
        ({"every_n_steps": 2.5}, "`every_n_steps` must be a positive int"),
        ({"log_spaced_until": -1}, "`log_spaced_until` must be a non-negative int"),
        ({"max_overhead": 5}, r"`max_overhead` must be a fraction in \(0, 1\)"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        SnapshotSchedule(**kwargs)
