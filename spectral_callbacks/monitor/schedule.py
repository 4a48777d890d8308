"""Which optimizer steps get a snapshot: step 0, log-spaced early steps, every N, the last step.

Steps are counted as Lightning counts them, in ``trainer.global_step`` (optimizer steps; 0 = before
the first update). The regular grid is

* step 0 (the reference for ``compression``),
* the powers of two below ``log_spaced_until`` (1, 2, 4, ... - the stable rank collapses in the
  first ~1,000 steps, so that is where points are needed),
* every multiple of ``every_n_steps``,

and the callback adds the final step itself at ``on_train_end``. With ``max_overhead`` the grid is
thinned: after each snapshot the next one waits until the measured cost of a snapshot (main-thread
plus worker time) divided by the time spent training in between is at most ``max_overhead``, and
then falls on the next grid step, so points stay on a predictable grid.

Example::

    >>> schedule = SnapshotSchedule(every_n_steps=25, log_spaced_until=16)
    >>> [step for step in range(60) if schedule.on_grid(step)]
    [0, 1, 2, 4, 8, 25, 50]
    >>> schedule.due(previous_step=3, step=5)  # step 4 lies in (3, 5]: a jump over it still counts
    True
"""

from __future__ import annotations

import math
from typing import Any

from spectral_callbacks.monitor.options import check_schedule

# Weight of the newest step time in the moving average; ~20 steps of memory smooths out the
# noise of a shared machine without lagging a real change of speed (e.g. validation starting).
_STEP_TIME_DECAY = 0.05


class SnapshotSchedule:
    """Decides at which optimizer steps the callback snapshots the watched matrices.

    Args:
        every_n_steps: snapshot every this many optimizer steps. Default ``25`` (the cadence of
            the reference paper).
        log_spaced_until: also snapshot at the powers of two below this step. ``0`` turns the
            dense early steps off. Default ``1000``.
        max_overhead: if given, a fraction of training time (e.g. ``0.01`` = 1 %) the snapshots may
            cost; the interval stretches (along the grid) to stay within it. Default ``None``.

    Raises:
        ConfigurationError: if an argument is out of range.
    """

    def __init__(
        self,
        every_n_steps: int = 25,
        log_spaced_until: int = 1000,
        max_overhead: float | None = None,
    ) -> None:
        check_schedule(every_n_steps, log_spaced_until, max_overhead)
        self.every_n_steps = every_n_steps
        self.log_spaced_until = log_spaced_until
        self.max_overhead = max_overhead
        self.last_snapshot_step: int | None = None
        #: Snapshots scheduled so far, skipped ones included (kept across a resume).
        self.snapshots = 0
        # Budget mode state: the moving averages of one training step and of one snapshot's cost.
        self.step_seconds: float | None = None
        self.snapshot_seconds: float | None = None

    # --- the regular grid -------------------------------------------------------------------

    def on_grid(self, step: int) -> bool:
        """Whether ``step`` lies on the regular grid (0, early powers of two, multiples of N)."""
        if step == 0 or step % self.every_n_steps == 0:
            return True
        return step < self.log_spaced_until and step & (step - 1) == 0

    def next_on_grid(self, step: int) -> int:
        """The smallest grid step ``>= step``."""
        step = max(step, 0)
        candidates = [math.ceil(step / self.every_n_steps) * self.every_n_steps]
        if step == 0:
            candidates.append(0)
        power = 1 << max(step - 1, 0).bit_length()  # smallest power of two >= step
        if power < self.log_spaced_until:
            candidates.append(power)
        return min(candidates)

    # --- the decision -----------------------------------------------------------------------

    def min_interval(self) -> int:
        """Fewest optimizer steps between two snapshots that keeps the cost within the budget."""
        if self.max_overhead is None or not self.step_seconds or self.snapshot_seconds is None:
            return 1
        return max(1, math.ceil(self.snapshot_seconds / (self.max_overhead * self.step_seconds)))

    def due(self, previous_step: int, step: int) -> bool:
        """Whether a snapshot is due now that training moved from ``previous_step`` to ``step``.

        A grid step anywhere in ``(previous_step, step]`` counts, so a batch that runs several
        optimizer steps (manual optimization, several optimizers) cannot jump over a snapshot.
        In budget mode the grid steps closer than :meth:`min_interval` to the last snapshot are
        passed over.
        """
        earliest = previous_step + 1
        if self.last_snapshot_step is not None:
            earliest = max(earliest, self.last_snapshot_step + self.min_interval())
        return self.next_on_grid(earliest) <= step

    def record_snapshot(self, step: int) -> None:
        """Note that a snapshot was taken (or attempted: a skip also counts) at ``step``."""
        self.last_snapshot_step = step
        self.snapshots += 1

    def record_step_time(self, seconds: float) -> None:
        """Feed the wall time of one optimizer step into the budget's moving average."""
        self.step_seconds = _moving_average(self.step_seconds, seconds)

    def record_snapshot_cost(self, seconds: float) -> None:
        """Feed the cost of one snapshot (main-thread plus worker seconds) into the budget."""
        self.snapshot_seconds = _moving_average(self.snapshot_seconds, seconds, decay=0.3)

    # --- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the last snapshot step, the count, the budget's averages."""
        return {
            "last_snapshot_step": self.last_snapshot_step,
            "snapshots": self.snapshots,
            "step_seconds": self.step_seconds,
            "snapshot_seconds": self.snapshot_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.last_snapshot_step = state.get("last_snapshot_step")
        self.snapshots = int(state.get("snapshots", 0))
        self.step_seconds = state.get("step_seconds")
        self.snapshot_seconds = state.get("snapshot_seconds")


def _moving_average(current: float | None, value: float, decay: float = _STEP_TIME_DECAY) -> float:
    return value if current is None else (1 - decay) * current + decay * value
