"""The calibration's decision: given the timings measured, the default runs the faster candidate,
keeps it for calls of the same kind, and stays accurate whichever wins (timings injected: nothing
here is timed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import spectral_callbacks.functional.svd as svd_module
from spectral_callbacks.functional import randomized_svd
from spectral_callbacks.functional.calibration import MethodCalibration, decide
from spectral_callbacks.functional.method_choice import choose_method
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.snapshot import ShapeGroup


def _injected(seconds: dict[str, float], calls: list[str]) -> MethodCalibration:
    def measure(run: Callable[[str], Any], method: str) -> tuple[float, Any]:
        calls.append(method)
        return seconds[method], run(method)

    return MethodCalibration(measure)


def _flat(m: int, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=generator) / n**0.5


def test_a_candidates_fastest_round_counts() -> None:
    # randomized, gram, randomized, gram, ...: the first round is close (a preempted run may
    # be in it), so a second one is run; it makes randomized faster than half of gram: done.
    rounds = iter([0.3, 0.2, 0.009, 0.2, 0.3, 0.2])
    calibration = MethodCalibration(lambda run, method: (next(rounds), run(method)))
    assert calibration.run("key", ("randomized", "gram"), str.upper) == "RANDOMIZED"
    assert calibration.seconds["key"] == {"randomized": 0.009, "gram": 0.2}
    assert next(rounds) == 0.3  # the third round was not run


def test_a_preempted_last_run_does_not_decide_the_method() -> None:
    # Two close rounds (no clear verdict), then randomized's third run is preempted (10x its
    # time): its fastest run still counts, so randomized is kept and runs from then on.
    runs = {"randomized": iter([0.10, 0.10, 1.0]), "gram": iter([0.15, 0.15, 0.15])}
    calls: list[str] = []

    def measure(run: Callable[[str], Any], method: str) -> tuple[float, Any]:
        calls.append(method)
        return next(runs[method]), run(method)

    calibration = MethodCalibration(measure)
    W = _flat(1536, 512)
    first = randomized_svd(W, 32, calibration=calibration)
    (key,) = calibration.chosen
    assert calibration.chosen[key] == "randomized"
    assert calibration.seconds[key] == {"randomized": 0.10, "gram": 0.15}
    assert sorted(calls) == ["gram"] * 3 + ["randomized"] * 3
    again = randomized_svd(W, 32, calibration=calibration)
    assert len(calls) == 6  # the kept choice: nothing timed again
    exact = torch.linalg.svdvals(W.double())[:32]
    for top in (first, again):
        assert torch.allclose(top.S.double(), exact, rtol=1e-2)


def test_close_rounds_run_to_the_limit_and_a_clear_first_round_ends_at_once() -> None:
    close = iter([0.3, 0.2, 0.25, 0.21, 0.2, 0.22, "unused"])
    calibration = MethodCalibration(lambda run, method: (next(close), run(method)))
    assert calibration.run("key", ("randomized", "gram"), str.upper) == "RANDOMIZED"
    assert next(close) == "unused"  # 3 rounds: no candidate was ever twice as fast
    clear = iter([0.5, 0.2, "unused"])
    calibration = MethodCalibration(lambda run, method: (next(clear), run(method)))
    assert calibration.run("key", ("randomized", "gram"), str.upper) == "GRAM"
    assert next(clear) == "unused"  # one run each: 0.2 is under half of 0.5


def test_decide_takes_the_fewest_seconds_and_the_first_on_a_tie() -> None:
    assert decide({"randomized": 0.014, "gram": 0.012}) == "gram"
    assert decide({"randomized": 0.010, "gram": 0.012}) == "randomized"
    assert decide({"randomized": 0.01, "gram": 0.01}) == "randomized"


@pytest.mark.parametrize(
    ("seconds", "faster"),
    [
        ({"randomized": 0.014, "gram": 0.012}, "gram"),
        ({"randomized": 0.010, "gram": 0.5}, "randomized"),
    ],
)
def test_the_measured_faster_candidate_runs_and_is_kept(
    seconds: dict[str, float], faster: str
) -> None:
    W = _flat(1536, 512)
    calls: list[str] = []
    calibration = _injected(seconds, calls)
    first = randomized_svd(W, 32, calibration=calibration)
    rounds = 3 if max(seconds.values()) < 2 * min(seconds.values()) else 1  # a clear verdict: 1
    assert sorted(calls) == ["gram"] * rounds + ["randomized"] * rounds  # both timed
    (key,) = calibration.chosen
    assert calibration.chosen[key] == faster and calibration.seconds[key] == seconds
    again = randomized_svd(W, 32, calibration=calibration)
    assert len(calls) == 2 * rounds  # the kept choice: nothing timed again
    exact = torch.linalg.svdvals(W.double())[:32]
    for top in (first, again):  # sigma_1 to the stopping rule's bound, the rest within 1 %
        assert top.S[0].double() == pytest.approx(exact[0].item(), rel=3e-3)
        assert torch.allclose(top.S.double(), exact, rtol=1e-2)


def test_whichever_wins_the_accuracy_holds_on_a_power_law() -> None:
    generator = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(768, 256, generator=generator, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(256, 256, generator=generator, dtype=torch.float64))
    s = torch.arange(1, 257, dtype=torch.float64).pow(-0.5)
    W = ((U * s) @ V.T).float()
    for faster in ("gram", "randomized"):
        slower = "randomized" if faster == "gram" else "gram"
        calibration = _injected({faster: 0.001, slower: 1.0}, [])
        top = randomized_svd(W, 32, calibration=calibration)
        assert set(calibration.chosen.values()) == {faster}
        assert top.S[0].double() == pytest.approx(1.0, rel=3e-3)
        assert torch.allclose(top.S.double(), s[:32], rtol=1e-2)


def test_cold_and_warm_calls_and_shapes_are_calibrated_apart() -> None:
    W = _flat(512, 256)
    calls: list[str] = []
    calibration = _injected({"randomized": 0.001, "gram": 1.0}, calls)
    cold = randomized_svd(W, 16, calibration=calibration)
    assert cold.V is not None
    randomized_svd(W, 16, init=cold.V, calibration=calibration)
    randomized_svd(_flat(256, 512), 16, calibration=calibration)
    randomized_svd(torch.stack([W, W]), 16, calibration=calibration)
    warm = [key[-1] for key in calibration.chosen]
    assert len(calibration.chosen) == 4 and warm.count(True) == 1 and len(calls) == 4 * 2


def test_a_cold_exact_call_keeps_no_subspace_once_warm_calls_were_measured_exact() -> None:
    # 512 x 512: the flop count expects warm calls to be randomized, so an exact cold call
    # hands back a subspace (eigh) for them; once the warm calls were measured faster exact,
    # that subspace would go unused, and a cold call takes eigvalsh alone.
    assert choose_method(512, 512, 40, 1, torch.float32) == "randomized"
    W = _flat(512, 512)
    calibration = _injected({"randomized": 1.0, "gram": 0.001}, [])
    cold = randomized_svd(W, 32, calibration=calibration)
    assert cold.V is not None
    warm = randomized_svd(W, 32, init=cold.V, calibration=calibration)
    assert set(calibration.chosen.values()) == {"gram"} and warm.V is None
    again = randomized_svd(W, 32, calibration=calibration)
    assert again.V is None
    assert torch.allclose(again.S, cold.S, rtol=1e-5)  # eigvalsh and eigh agree to rounding


def test_an_explicit_method_or_no_calibration_times_nothing() -> None:
    calls: list[str] = []
    calibration = _injected({"randomized": 0.001, "gram": 1.0}, calls)
    randomized_svd(_flat(256, 128), 8, method="gram", calibration=calibration)
    randomized_svd(_flat(256, 128), 8, method="randomized", calibration=calibration)
    assert calls == [] and calibration.chosen == {}


def test_the_monitors_compute_calibrates_each_kind_of_call_once() -> None:
    compute = SpectrumCompute(k=8)
    calls: list[str] = []
    compute.calibration = _injected({"randomized": 1.0, "gram": 0.001}, calls)
    group = ShapeGroup("256x128/float32/cpu", ())
    batch = torch.stack([_flat(256, 128, seed) for seed in range(3)])
    for _ in range(3):
        metrics = compute(group, batch)
    assert set(compute.calibration.chosen.values()) == {"gram"}
    assert len(calls) == 2 * len(compute.calibration.chosen)  # timed once per kind of call
    exact = torch.linalg.svdvals(batch.double())[:, 0]
    assert torch.allclose(metrics["spectral_norm"].double(), exact, rtol=1e-4)


@pytest.mark.parametrize("faster", ["randomized", "gram"])
def test_a_batch_is_calibrated_on_its_first_matrix_and_the_winner_runs_on_the_rest(
    faster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What each run of a path was given: (path, matrices, whether the calibration timed it).
    inputs: list[tuple[str, int, bool]] = []
    timing = False
    original = svd_module._top_svd

    def recording(A: torch.Tensor, k: int, width: int, chosen: str, *rest: Any) -> Any:
        inputs.append((chosen, A.shape[0], timing))
        return original(A, k, width, chosen, *rest)

    def measure(run: Callable[[str], Any], method: str) -> tuple[float, Any]:
        nonlocal timing
        timing = True
        try:
            return (0.001 if method == faster else 1.0), run(method)
        finally:
            timing = False

    monkeypatch.setattr(svd_module, "_top_svd", recording)
    calibration = MethodCalibration(measure)
    batch = torch.stack([_flat(512, 256, seed) for seed in range(6)])
    moved = batch + 1e-3 * torch.stack([_flat(512, 256, seed) for seed in range(6, 12)])
    exact = torch.linalg.svdvals(batch.double())[:, :16]
    cold = randomized_svd(batch, 16, calibration=calibration)
    timed = sorted((path, matrices) for path, matrices, was_timed in inputs if was_timed)
    assert timed == [("gram", 1), ("randomized", 1)]  # one clear round, on one matrix
    assert [(path, matrices) for path, matrices, was_timed in inputs if not was_timed] == [
        (faster, 5)  # the winner on the rest of the batch
    ]
    assert torch.allclose(cold.S.double(), exact, rtol=1e-2)  # every matrix, the first too
    assert cold.S[:, 0].double() == pytest.approx(exact[:, 0].tolist(), rel=3e-3)
    assert cold.V is not None and cold.V.shape[0] == 6  # a subspace for the warm calls
    inputs.clear()
    warm = randomized_svd(moved, 16, init=cold.V, calibration=calibration)
    assert sorted((path, matrices) for path, matrices, _ in inputs) == sorted(
        [("gram", 1), ("randomized", 1), (faster, 5)]
    )
    exact = torch.linalg.svdvals(moved.double())[:, :16]
    assert torch.allclose(warm.S.double(), exact, rtol=1e-2)
    assert warm.S[:, 0].double() == pytest.approx(exact[:, 0].tolist(), rel=3e-3)
    inputs.clear()
    randomized_svd(batch, 16, calibration=calibration)  # the same kind again: nothing timed
    assert inputs == [(faster, 6, False)]


def test_the_benchmark_prints_a_row_per_shape_and_spectrum(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import method_calibration

    method_calibration.main(["--repeats", "1", "--shapes", "160x64,64x160"])
    rows = [row.split("|")[1:-1] for row in capsys.readouterr().out.splitlines()]
    rows = [[cell.strip() for cell in row] for row in rows if row and row[0].strip()[:1].isdigit()]
    assert [(row[0], row[1]) for row in rows] == [
        ("160x64", "flat"),
        ("160x64", "i^-0.5"),
        ("64x160", "flat"),
        ("64x160", "i^-0.5"),
    ]
    for row in rows:
        cold, warm = row[3].split(" / ")  # the methods chosen for cold and for warm calls
        assert cold in ("randomized", "gram") and warm in ("randomized", "gram", "-")
        assert row[7] in ("eigvalsh(gram)", "svdvals(W)", "svdvals(W.T)")
        assert float(row[8].split()[0]) > 0
