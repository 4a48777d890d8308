"""Which method is fastest on this machine, measured: the flop count of ``method_choice`` only as
the prior for shapes not timed yet.

A cost model tuned on one CPU guesses wrong on shapes and machines it was not tuned on (a held-out
1536 x 512 Gaussian matrix: the model's randomized path took 14 ms against 12 ms for the exact
Gram ``eigvalsh``). So a :class:`MethodCalibration` times each candidate once, the first time a
kind of call comes - the same shape, batch size, dtype and device, cold or warm - and from then on
runs the one that was faster there. Every candidate keeps the accuracy guarantees of
``randomized_svd`` (the exact paths are exact; the randomized one stops by its residual rule), so
which one wins changes the time, not what is promised of the result. The timed calls are real
calls: the winner's result is returned, so calibrating a kind of call costs a few calls of each
candidate, once. ``randomized_svd`` times them on a batch's first matrix only and runs the winner
on the rest, so that cost is a few single matrices', not a few whole batches' (which made a
GPT-2 small's first snapshot several times slower than the best exact method).

Example::

    >>> calibration = MethodCalibration()
    >>> decide({"randomized": 0.014, "gram": 0.012})
    'gram'
    >>> key = ("512x1536", 1, "torch.float32", "cpu", False)
    >>> calibration.run(key, ("randomized", "gram"), lambda method: method.upper())
    ... # doctest: +ELLIPSIS
    '...'
    >>> key in calibration.chosen
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

Result = TypeVar("Result")


def decide(seconds: Mapping[str, float]) -> str:
    """The candidate with the fewest seconds (the first listed on a tie)."""
    return min(seconds, key=lambda name: seconds[name])


def timed(run: Callable[[str], Result], method: str) -> tuple[float, Result]:
    """``run(method)`` and its wall seconds (the work is on this thread: CPU only)."""
    start = time.perf_counter()
    result = run(method)
    return time.perf_counter() - start, result


def _clear_winner(seconds: Mapping[str, float]) -> bool:
    """The fastest at most half the time of every other: more rounds cannot change the verdict
    (a preempted or cold run is rarely 2x slow), so calibrating costs one run of each."""
    fastest = min(seconds.values())
    return sum(took <= 2 * fastest for took in seconds.values()) == 1


class MethodCalibration:
    """The fastest method per kind of call, measured once on this machine, then kept.

    Each candidate is run up to ``rounds`` times, alternating, and its fastest run counts: one run
    preempted by other work on a shared machine (or paying a first call's allocations) then
    cannot decide. A round that leaves one candidate faster than half of every other's time
    ends it: a verdict that clear needs no more runs. Not thread-safe: one per compute function, used by the thread that runs it.

    Args:
        measure: ``(run, method) -> (seconds, result)``; default :func:`timed` (wall time).
            Tests inject timings here.
        rounds: most runs of each candidate when a kind of call is calibrated. Default ``3``.

    Attributes:
        chosen: key -> the method that was fastest.
        seconds: key -> method -> the seconds each candidate took when timed.
    """

    def __init__(
        self,
        measure: Callable[[Callable[[str], Any], str], tuple[float, Any]] = timed,
        rounds: int = 3,
    ) -> None:
        self.measure = measure
        self.rounds = rounds
        self.chosen: dict[Hashable, str] = {}
        self.seconds: dict[Hashable, dict[str, float]] = {}

    def run(self, key: Hashable, candidates: Sequence[str], run: Callable[[str], Result]) -> Result:
        """``run(method)`` with the method measured fastest for ``key``; the first time ``key``
        comes, every candidate is run and timed (up to ``rounds`` times, alternating; its fastest
        run counts), and the fastest one's result returned."""
        chosen = self.chosen.get(key)
        if chosen is not None:
            return run(chosen)
        seconds: dict[str, float] = {}
        results: dict[str, Result] = {}
        for _ in range(self.rounds):
            for method in candidates:
                took, results[method] = self.measure(run, method)
                seconds[method] = min(took, seconds.get(method, took))
            if _clear_winner(seconds):
                break
        chosen = self.chosen[key] = decide(seconds)
        self.seconds[key] = seconds
        return results[chosen]
