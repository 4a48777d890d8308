"""randomized_svd against float64 torch.linalg.svdvals on fresh random inputs, and its bad inputs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from device_checks import tf32_matmuls
from seeds import run_seed

import spectral_callbacks.functional.krylov as krylov_module
import spectral_callbacks.functional.precision as precision
import spectral_callbacks.functional.svd as svd_module
from spectral_callbacks.functional import randomized_svd
from spectral_callbacks.functional.calibration import MethodCalibration
from spectral_callbacks.functional.krylov import (
    _first_block_gram,
    _first_block_grams,
    block_krylov,
    cholesky_qr,
    column_norms,
    residual_excess,
    ritz_residuals,
    start_block,
)
from spectral_callbacks.functional.method_choice import choose_method

# A fixed seed and the run's fresh one (in the test id; tests/seeds.py says how to replay it).
SEEDS = [0, run_seed()]
EXACT_AND_RANDOM = ["auto", "randomized", "subspace", "gram", "svdvals"]


def decaying(shape: tuple[int, ...], a: float, seed: int) -> torch.Tensor:
    """``(..., m, n)`` float64 matrices U diag(i^-a) V^T with random orthonormal U, V."""
    g = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(*batch, m, r, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(*batch, n, r, generator=g, dtype=torch.float64)).Q
    s = torch.arange(1, r + 1, dtype=torch.float64).pow(-a)
    return (U * s) @ V.mT


def reference(W: torch.Tensor, k: int) -> torch.Tensor:
    return torch.linalg.svdvals(W.double())[..., :k]


def flat_or_decaying(
    m: int, n: int, spectrum: str, seed: int, generator: torch.Generator
) -> torch.Tensor:
    """float32 ``(m, n)``: Gaussian entries / sqrt(n) drawn from ``generator`` (``"flat"``, the
    hard case), else the power law sigma_i = i^-0.5 of ``decaying`` (``seed``)."""
    if spectrum == "flat":
        return torch.randn(m, n, generator=generator) / n**0.5
    return decaying((m, n), 0.5, seed).float()


def assert_within_the_rule(S: torch.Tensor, truth: torch.Tensor) -> None:
    """The stopping rule's contract at the default tol (docs/metrics.md): sigma_1 within 2.4 tol
    of the truth, the other top values within their residual bound's reach (10 tol), with a
    margin; what a cold call that stops at a test promises, wherever it stops."""
    torch.testing.assert_close(S[..., 0].double(), truth[..., 0], rtol=2.5e-3, atol=0)
    torch.testing.assert_close(S.double(), truth, rtol=2.5e-2, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", EXACT_AND_RANDOM)
@pytest.mark.parametrize("shape", [(150, 90), (90, 150), (3, 120, 100)])
def test_top_k_matches_float64_svdvals(shape: tuple[int, ...], method: str, seed: int) -> None:
    W = decaying(shape, 0.5, seed).float()
    # A fixed depth (no stopping rule): the machinery itself, converged. Subspace iteration
    # converges at the gap, not its square root, so it gets a deeper fixed depth: at depth 5
    # sigma_10 was up to 1.2 % off over 600 seeded cases (a flaky test), at depth 8 at most 5e-4.
    g = torch.Generator().manual_seed(seed)
    n_iter = 8 if method == "subspace" else 5
    top = randomized_svd(W, 10, generator=g, method=method, n_iter=n_iter)
    assert top.S.shape == (*shape[:-2], 10) and top.S.dtype == torch.float32
    rtol = 3e-3 if method == "subspace" else 1e-4
    torch.testing.assert_close(top.S.double(), reference(W, 10), rtol=rtol, atol=0)
    if method in ("randomized", "subspace"):
        V = top.V
        assert V is not None and V.shape == (*shape[:-2], shape[-1], 18)
        torch.testing.assert_close(V.mT @ V, torch.eye(18).expand_as(V.mT @ V), atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_flat_gaussian_spectral_norm_within_a_tenth_of_a_percent(seed: int) -> None:
    # The hard case: a Gaussian matrix has a flat top spectrum (docs/metrics.md, One matrix: accuracy and speed).
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(2, 400, 200, generator=g)
    top = randomized_svd(W, generator=g, method="randomized")
    torch.testing.assert_close(top.S[..., 0].double(), reference(W, 1)[..., 0], rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_inputs(dtype: torch.dtype) -> None:
    W = decaying((120, 80), 1.0, random.randrange(2**31)).to(dtype)
    top = randomized_svd(W, 8, method="randomized", n_iter=5)
    assert top.S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-9 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(top.S.double(), reference(W, 8), rtol=rtol, atol=0)


@pytest.mark.parametrize("view", ["transposed", "strided", "batch_slice"])
def test_views_are_handled(view: str) -> None:
    base = decaying((4, 160, 120), 0.7, random.randrange(2**31)).float()
    W = {"transposed": base[0].T, "strided": base[0, ::2, 1:], "batch_slice": base[::2, :, :90]}[
        view
    ]
    assert not W.is_contiguous()
    top = randomized_svd(W, 6, method="randomized", n_iter=5)
    torch.testing.assert_close(top.S.double(), reference(W, 6), rtol=1e-4, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_warm_start_gives_the_cold_answer_with_fewer_iterations(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(2, 300, 200, generator=g)
    noise = torch.randn(W.shape, generator=g)
    W2 = W + 0.01 * noise * W.norm(dim=(-2, -1), keepdim=True) / noise.norm(
        dim=(-2, -1), keepdim=True
    )
    previous = randomized_svd(W, 16, generator=g, method="randomized")
    cold = randomized_svd(W2, 16, generator=g, method="randomized")
    warm = randomized_svd(W2, 16, generator=g, init=previous.V, method="randomized")  # 2 steps
    exact = reference(W2, 16)
    torch.testing.assert_close(warm.S[..., 0].double(), exact[..., 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(warm.S.double(), cold.S.double(), rtol=1e-2, atol=0)


def test_init_with_other_width_or_non_finite_values_still_works() -> None:
    W = decaying((100, 80), 0.5, random.randrange(2**31)).float()
    V = randomized_svd(W, 4, method="randomized").V
    assert V is not None
    wider = randomized_svd(W, 12, init=V, method="randomized", n_iter=6)  # topped up at random
    stale = torch.full((80, 40), float("nan"))
    narrower = randomized_svd(W, 2, init=stale, method="randomized", n_iter=5)
    torch.testing.assert_close(wider.S.double(), reference(W, 12), rtol=1e-4, atol=0)
    torch.testing.assert_close(narrower.S.double(), reference(W, 2), rtol=1e-4, atol=0)


def test_k_at_least_min_side_clamps_and_runs_exact() -> None:
    W = torch.randn(2, 30, 7)
    top = randomized_svd(W, 50)
    assert top.V is None and top.S.shape == (2, 7)
    torch.testing.assert_close(top.S.double(), reference(W, 7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 9), (9, 1)])
def test_a_single_row_or_column_has_its_norm_as_only_singular_value(shape: tuple[int, int]) -> None:
    W = torch.randn(shape)
    top = randomized_svd(W)
    assert top.S.shape == (1,)
    torch.testing.assert_close(top.S.double(), W.double().norm().reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", EXACT_AND_RANDOM)
def test_rank_deficient_and_zero_matrices_read_the_same_with_every_method(method: str) -> None:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    rank_3 = torch.randn(120, 3, generator=g) @ torch.randn(3, 90, generator=g)
    W = torch.stack([rank_3, torch.zeros(120, 90)])
    top = randomized_svd(W, 8, method=method)
    assert torch.all(top.S[0, 3:] == 0) and torch.all(top.S[1] == 0)
    torch.testing.assert_close(top.S[0, :3].double(), reference(rank_3, 3), rtol=1e-4, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_matrix_gets_nan_and_leaves_its_batch_alone(bad: float) -> None:
    W = decaying((3, 40, 30), 1.0, random.randrange(2**31)).float()
    W[1, 5, 7] = bad
    for method in EXACT_AND_RANDOM:
        top = randomized_svd(W, 4, method=method, n_iter=10)
        assert torch.isnan(top.S[1]).all(), method
        expected = reference(W[[0, 2]], 4)
        torch.testing.assert_close(top.S[[0, 2]].double(), expected, rtol=1e-3, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_batch_computed_in_parts_reads_the_same_values_and_keeps_a_bad_matrix_apart(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Parts of two matrices (k = 10: a 300 x 18 float32 block is 21,600 bytes): 5 matrices in 3.
    monkeypatch.setattr(svd_module, "_CHUNK_BYTES", 2 * 300 * 18 * 4)
    parts: list[int] = []
    randomized = svd_module._randomized

    def counting(A: torch.Tensor, *args: object, **kwargs: object) -> object:
        parts.append(A.shape[0])
        return randomized(A, *args, **kwargs)

    monkeypatch.setattr(svd_module, "_randomized", counting)
    W = decaying((5, 400, 300), 0.5, seed).float()
    W[3, 7, 9] = float("nan")
    top = randomized_svd(W, 10, method="randomized", generator=torch.Generator().manual_seed(seed))
    assert parts == [2, 2, 1]
    assert top.S.shape == (5, 10) and torch.isnan(top.S[3]).all()
    good = [0, 1, 2, 4]
    assert_within_the_rule(top.S[good], reference(W[good], 10))
    assert top.V is not None and top.V.shape == (5, 300, 18)
    V = top.V[good]
    torch.testing.assert_close(V.mT @ V, torch.eye(18).expand(4, 18, 18), atol=1e-4, rtol=0)
    warm = randomized_svd(W[good], 10, init=V)  # the parts' subspaces warm-start the whole
    assert_within_the_rule(warm.S, reference(W[good], 10))


def test_only_a_cpu_batch_is_split() -> None:
    assert svd_module._chunks(torch.empty(9, 768, 768), 40) == [
        slice(0, 4),
        slice(4, 8),
        slice(8, 12),
    ]
    assert svd_module._chunks(torch.empty(768, 768), 40) == [slice(None)]
    assert svd_module._chunks(torch.empty(9, 768, 768, device="meta"), 40) == [slice(None)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["randomized", "auto"])
@pytest.mark.parametrize("exponent", [-70, -40, -30, 30, 40, 60, 64, 70])
def test_a_matrix_far_from_unit_scale_reads_its_values_cold_and_warm(
    exponent: int, method: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Scaled by a power of two (exact), so the answer is the unit-scale one times the scale.
    # Float32 cannot hold W^T W at 2^-70 (underflow) nor at 2^60 and 2^70 (overflow): the Krylov
    # products are taken at unit size, or the matrix goes to the exact float64 path; either way
    # the values are right. With MKL on an AMD EPYC, LAPACK's eigh of the Rayleigh quotient
    # failed to converge at 2^-70 for some start blocks: here the eigensolvers fail on every
    # float32 input that far from unit scale, so none may get one (no fallback is taken). Float32
    # squares of residuals and images once overflowed at 2^40 (a warm start 16 % short). A NaN
    # and an Inf matrix read NaN, and leave the rest of the batch alone, at every scale.
    scale = 2.0**exponent
    W = decaying((4, 300, 200), 0.5, seed).float()
    W[1] = torch.randn(300, 200, generator=torch.Generator().manual_seed(seed))  # flat
    W[2, 5, 7], W[3, 0, 1] = float("nan"), float("inf")
    good = [0, 1]
    exact = reference(W[good], 10)
    unit = randomized_svd(W, 10, method="randomized")
    failed = _failing_eigensolvers(monkeypatch, _far_from_unit_float32)
    cold = randomized_svd(W * scale, 10, method=method)
    # auto takes the exact (float32 Gram) path on a cold 300 x 200 batch: no subspace then.
    assert (cold.V is not None or method == "auto") and unit.V is not None
    assert cold.fell_back is None
    if cold.V is not None:
        eye = torch.eye(18).expand(2, 18, 18)
        torch.testing.assert_close(cold.V[good].mT @ cold.V[good], eye, atol=1e-4, rtol=0)
    unit_warm = randomized_svd(W * 1.001, 10, init=unit.V)
    start = cold.V if cold.V is not None else unit.V
    warm = randomized_svd(W * (scale * 1.001), 10, init=start, method=method)
    assert warm.fell_back is None and failed and not any(failed)
    for top in (cold, warm):
        assert torch.isnan(top.S[2:]).all()
    if abs(exponent) <= 40 and method == "randomized":  # the same iteration, scaled exactly
        torch.testing.assert_close(cold.S / scale, unit.S, rtol=1e-4, atol=0, equal_nan=True)
    # Warm, the unit-scale call may stop a step earlier: its first block's sigma_1 bound can be
    # decided by the left Rayleigh-Ritz, which a rescaled iteration does not take. Both meet the
    # stopping rule's contract: sigma_1 to 1e-3, the other top values to 1e-2 (as against the truth).
    torch.testing.assert_close(warm.S[good, 0] / scale, unit_warm.S[good, 0], rtol=1e-3, atol=0)
    torch.testing.assert_close(warm.S[good] / scale, unit_warm.S[good], rtol=1e-2, atol=0)
    for top, truth in (
        (cold, exact),
        (warm, exact * 1.001),
    ):  # docs/metrics.md, One matrix: accuracy and speed
        values = top.S[good].double() / scale
        torch.testing.assert_close(values[..., 0], truth[..., 0], rtol=1e-3, atol=0)
        torch.testing.assert_close(values, truth, rtol=1e-2, atol=0)


def _far_from_unit_float32(A: torch.Tensor) -> bool:
    """A float32 input whose largest entry lies outside 2^(+-100): its squares leave float32's
    normal range, and LAPACK's eigh failed to converge on such (MKL, AMD EPYC)."""
    largest = A.abs().amax().item()
    return A.dtype == torch.float32 and (0 < largest < 2.0**-100 or largest > 2.0**100)


def _failing_eigensolvers(
    monkeypatch: pytest.MonkeyPatch, fails: Callable[[torch.Tensor], bool]
) -> list[bool]:
    """torch.linalg.eigh and eigvalsh (the public functions every path calls: the Krylov
    iteration's Rayleigh-Ritz, the exact Gram path) raising LAPACK's convergence error on the
    inputs ``fails`` picks; returns whether each call failed."""
    calls: list[bool] = []
    for name in ("eigh", "eigvalsh"):
        solver = getattr(torch.linalg, name)

        def failing(A: torch.Tensor, *args: object, name=name, solver=solver, **kwargs: object):
            calls.append(fails(A))
            if calls[-1]:
                raise torch.linalg.LinAlgError(
                    f"linalg.{name}: (Batch element 0): The algorithm failed to converge because "
                    "the input matrix is ill-conditioned or has too many repeated eigenvalues "
                    "(error code: 17)."
                )
            return solver(A, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, failing)
    return calls


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("method", ["randomized", "subspace", "auto", "gram"])
@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_solver_that_fails_on_one_matrix_sends_that_one_to_the_exact_path_flagged_and_logged(
    start: str,
    method: str,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The eigensolvers raise on every input that holds matrix 1's scale (1e3 above the others):
    # the Rayleigh quotient of its Krylov space and its Gram matrices alike. The batch is taken
    # again matrix by matrix; matrix 1 alone fails again and comes from LAPACK's SVD of the
    # float64 matrix (the fallback's fallback), flagged and logged; the others keep their path.
    W = decaying((3, 160, 120), 0.5, seed).float()
    W[1] *= 1e3
    init = randomized_svd(W, 10, method="randomized").V if start == "warm" else None
    calls = _failing_eigensolvers(monkeypatch, lambda A: bool(A.abs().amax() > 1e4))
    top = randomized_svd(
        W, 10, method=method, init=init, generator=torch.Generator().manual_seed(seed)
    )
    assert any(calls)
    assert top.fell_back is not None and top.fell_back.tolist() == [False, True, False]
    assert "failed to converge because the input matrix" in caplog.text
    assert "on a 160x120 matrix; its values come from the exact float64 path" in caplog.text
    # Subspace iteration at its default depth is a comparison method, 2-3 % off (no rule).
    if method == "randomized":
        assert_within_the_rule(top.S, reference(W, 10))
    else:
        rtol = 5e-2 if method == "subspace" else 1e-5
        torch.testing.assert_close(top.S.double(), reference(W, 10), rtol=rtol, atol=0)
    if top.V is not None:
        eye = torch.eye(top.V.shape[-1]).expand(3, -1, -1)
        torch.testing.assert_close(top.V.mT @ top.V, eye, atol=1e-4, rtol=0)
        # Matrix 1's subspace is its exact top one: a warm start from it is as good as any.
        right = torch.linalg.svd(W[1].double()).Vh.mT[:, :10]
        inside = torch.linalg.vector_norm(top.V[1].double().mT @ right, dim=-2)
        torch.testing.assert_close(inside, torch.ones_like(inside), atol=1e-4, rtol=0)


def test_a_solver_that_fails_everywhere_still_gives_every_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every eigh raises, on a 2-D matrix, a batch, and a batch held as factors (an adapted
    # layer): each matrix comes from LAPACK's SVD, flagged; nothing raises out of the call.
    from spectral_callbacks.functional.lowrank import AdaptedMatrices

    W = decaying((2, 200, 150), 0.5, random.randrange(2**31)).float()
    calls = _failing_eigensolvers(monkeypatch, lambda A: True)
    one = randomized_svd(W[0], 8, method="randomized")
    batch = randomized_svd(W, 8, method="randomized")
    U, Vf = torch.randn(200, 2), torch.randn(2, 150)
    factors = AdaptedMatrices((W[0], W[1]), (U, U), (Vf, Vf))
    adapted = randomized_svd(factors, 8, method="randomized")
    assert calls and all(calls)
    assert one.fell_back is not None and bool(one.fell_back)
    assert batch.fell_back is not None and batch.fell_back.tolist() == [True, True]
    assert adapted.fell_back is not None and adapted.fell_back.tolist() == [True, True]
    torch.testing.assert_close(one.S.double(), reference(W[0], 8), rtol=1e-5, atol=0)
    torch.testing.assert_close(batch.S.double(), reference(W, 8), rtol=1e-5, atol=0)
    effective = W + (U @ Vf)
    torch.testing.assert_close(adapted.S.double(), reference(effective, 8), rtol=1e-5, atol=0)


@pytest.mark.parametrize("exponent", [-80, -60, 0, 60, 80])
def test_column_norms_hold_at_any_scale_float32_holds(exponent: int) -> None:
    X = torch.randn(3, 500, 7, dtype=torch.float64) * 2.0**exponent
    X[0, :, 2] = 0  # a zero column
    norms = column_norms(X.float())
    assert norms.dtype == torch.float32 and norms.shape == (3, 7)
    torch.testing.assert_close(norms.double(), X.norm(dim=-2), rtol=1e-5, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("columns", [1, 2, precision.NARROW, precision.NARROW + 1, 40])
def test_products_of_every_width_agree_with_float64(columns: int, seed: int) -> None:
    # Narrow products take a transposed form and rank-one accumulations an elementwise one
    # (precision.matmul, precision.accumulate): each must give the float32 product, within
    # float32 rounding of the float64 one, batched or not, in place or not.
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(3, 300, 50, generator=g, dtype=torch.float64)
    B = torch.randn(3, 50, columns, generator=g, dtype=torch.float64)
    out = torch.randn(3, 300, columns, generator=g, dtype=torch.float64)
    scale = (A.abs() @ B.abs()).amax()  # rounding is relative to the sizes summed
    for a, b, o in ((A, B, out), (A[0], B[0], out[0])):
        exact = o - a @ b
        torch.testing.assert_close(
            precision.matmul(a.float(), b.float()).double(), a @ b, atol=1e-6 * scale, rtol=0
        )
        for in_place in (False, True):
            result = precision.accumulate(o.float(), a.float(), b.float(), -1.0, in_place=in_place)
            torch.testing.assert_close(result.double(), exact, atol=1e-6 * scale, rtol=0)
    # An outer product (one inner column) accumulated into a block, as a Ritz vector is formed.
    u, v = A[..., :1], torch.randn(3, 1, 50, generator=g, dtype=torch.float64)
    into = torch.randn(3, 300, 50, generator=g, dtype=torch.float64)
    for in_place in (False, True):
        result = precision.accumulate(into.float(), u.float(), v.float(), 2.0, in_place=in_place)
        torch.testing.assert_close(result.double(), into + 2.0 * u @ v, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("condition", [1.0, 1e2])
def test_cholesky_qr_gives_an_orthonormal_basis_of_the_same_columns(
    condition: float, seed: int
) -> None:
    # X = Q R: Q orthonormal to float32 rounding times the condition, and spanning X's columns
    # (X is reproduced by Q Q^T X), for columns of known condition number.
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(4, 700, 40, generator=g, dtype=torch.float64)).Q
    W = torch.linalg.qr(torch.randn(4, 40, 40, generator=g, dtype=torch.float64)).Q
    singular = torch.logspace(0, -torch.log10(torch.tensor(condition)).item(), 40).double()
    X = U @ torch.diag_embed(singular.expand(4, 40)) @ W.mT  # (4, 700, 40), cond = condition
    Q = cholesky_qr(X.float(), least=0.5 / condition)
    assert Q is not None and Q.shape == X.shape
    Q = Q.double()
    eye = torch.eye(40, dtype=torch.float64).expand(4, 40, 40)
    torch.testing.assert_close(Q.mT @ Q, eye, atol=1e-4 * condition, rtol=0)
    torch.testing.assert_close(Q @ (Q.mT @ X), X, atol=1e-5 * condition, rtol=0)


def test_an_overflowing_matrix_is_redone_and_a_nan_one_stays_nan() -> None:
    W = decaying((3, 120, 100), 1.0, random.randrange(2**31)).float()
    W[0] *= 2.0**70
    W[1, 3, 4] = float("nan")
    top = randomized_svd(W, 8, method="randomized")
    assert torch.isnan(top.S[1]).all()
    # A cold call stops at a test (early on this 1/i spectrum): the rule's contract, as for W[2].
    assert_within_the_rule(top.S[0].double() / 2.0**70, reference(W[0] / 2.0**70, 8))
    assert_within_the_rule(top.S[2], reference(W[2], 8))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(4, 128, 128), (4, 512, 128), (4, 128, 512)])
def test_the_automatic_exact_path_reads_a_float32_gram_matrix_to_float64_accuracy(
    shape: tuple[int, int, int], seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A flat spectrum and power laws down to sigma_32 = 0.03 sigma_1: all read from the float32
    # Gram matrix (squaring W's rounding costs about 5e-7 (sigma_1 / sigma_i)^2 of each value).
    _, m, n = shape
    assert choose_method(m, n, 40, svd_module.default_n_iter(m, n), torch.float32, batch=4) == (
        "gram"
    )
    dtypes = _gram_dtypes(monkeypatch)
    W = torch.cat([decaying((1, m, n), a, seed + i) for i, a in enumerate((0.2, 0.5, 1.0))])
    W = torch.cat([W.float(), torch.randn(1, m, n, generator=torch.Generator().manual_seed(seed))])
    top = randomized_svd(W, 32)
    assert dtypes == [(torch.float32, 4)]  # nothing redone
    torch.testing.assert_close(top.S.double(), reference(W, 32), rtol=1e-4, atol=0)


def test_what_a_float32_gram_matrix_cannot_read_is_redone_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = random.randrange(2**31)
    U, S, Vh = torch.linalg.svd(decaying((6, 128, 128), 0.5, seed))
    S[1, 0] *= 1000  # one dominant outlier: sigma_32 = 2e-4 sigma_1
    S[2, 3:] = 0  # rank 3
    W = ((U * S[..., None, :]) @ Vh).float()
    W[3] *= 2.0**70  # W^T W overflows float32
    W[4] *= 2.0**-70  # ... underflows
    W[5, 6, 7] = float("nan")
    dtypes = _gram_dtypes(monkeypatch)
    top = randomized_svd(W, 32)
    # Redone one matrix at a time (the snapshot budget counts one matrix's float64 work); the NaN
    # matrix is not redone.
    assert dtypes == [(torch.float32, 6)] + [(torch.float64, 1)] * 4
    assert torch.isnan(top.S[5]).all() and torch.all(top.S[2, 3:] == 0)
    exact = reference(W[:5], 32)
    rows = [0, 1, 3, 4]
    torch.testing.assert_close(top.S[rows].double(), exact[rows], rtol=1e-5, atol=0)
    torch.testing.assert_close(top.S[2, :3].double(), exact[2, :3], rtol=1e-5, atol=0)


def _gram_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Record (dtype, matrices) of each call of the exact Gram path."""
    calls: list[tuple[torch.dtype, int]] = []
    original = svd_module.gram_eigvalsh

    def recording(
        A: torch.Tensor,
        width: int | None = None,
        dtype: torch.dtype = torch.float64,
        exponent: int | None = None,
    ):
        calls.append((dtype, A.shape[0]))
        return original(A, width, dtype, exponent)

    monkeypatch.setattr(svd_module, "gram_eigvalsh", recording)
    return calls


def test_a_generator_makes_the_result_reproducible() -> None:
    W = torch.randn(200, 150)
    a = randomized_svd(W, 5, generator=torch.Generator().manual_seed(7), method="randomized")
    b = randomized_svd(W, 5, generator=torch.Generator().manual_seed(7), method="randomized")
    assert torch.equal(a.S, b.S)


def test_method_is_chosen_by_shape() -> None:
    assert choose_method(4096, 4096, 40, 6, torch.float32) == "randomized"
    assert choose_method(64, 64, 40, 6, torch.float32) == "gram"  # the block covers most of it
    assert choose_method(64, 64, 40, 6, torch.float64) == "svdvals"
    # A warm call on a small matrix pays only in a batch big enough to make up for a call's cost
    # (measured, 1 thread, CPU ms: 256x256 warm 3.7 against exact 2.9, 16 x 256x256 warm 17.5
    # against 42; 48 x 128x128 warm 25 against 24).
    assert choose_method(256, 256, 40, 1, torch.float32, batch=1) == "gram"
    assert choose_method(256, 256, 40, 1, torch.float32, batch=16) == "randomized"
    assert choose_method(128, 128, 40, 1, torch.float32, batch=48) == "gram"


@pytest.mark.parametrize("shape", [(16, 256, 256), (16, 256, 320), (16, 320, 256)])
def test_an_exact_first_call_hands_back_a_subspace_when_warm_calls_will_pay(
    shape: tuple[int, int, int],
) -> None:
    _, m, n = shape
    depth = svd_module.default_n_iter(m, n)
    assert choose_method(m, n, 40, depth, torch.float32, batch=16) == "gram"
    assert choose_method(m, n, 40, 1, torch.float32, batch=16) == "randomized"
    g = torch.Generator().manual_seed(random.randrange(2**31))
    W = decaying(shape, 0.5, random.randrange(2**31)).float()
    # A caller that keeps a calibration will call again (the monitor's compute); the exact path
    # is made to win its timing here, so the test does not depend on this machine's speed.
    calibration = MethodCalibration(lambda run, method: (float(method != "gram"), run(method)))
    first = randomized_svd(W, 32, generator=g, calibration=calibration)  # exact, top-40 subspace
    torch.testing.assert_close(first.S.double(), reference(W, 32), rtol=1e-5, atol=0)
    assert first.V is not None and first.V.shape == (16, n, 40)
    torch.testing.assert_close(
        first.V.mT @ first.V, torch.eye(40).expand(16, 40, 40), atol=1e-5, rtol=0
    )
    right = torch.linalg.svd(W.double()).Vh.mT[..., :32]  # the top 32 are in it
    inside = torch.linalg.vector_norm(first.V.double().mT @ right, dim=-2)
    torch.testing.assert_close(inside, torch.ones_like(inside), atol=1e-5, rtol=0)
    W2 = W + 1e-3 * W.norm(dim=(-2, -1), keepdim=True) * torch.randn(shape, generator=g) / m
    warm = randomized_svd(W2, 32, generator=g, init=first.V)  # randomized, warm
    assert warm.V is not None
    torch.testing.assert_close(
        warm.S[..., 0].double(), reference(W2, 1)[..., 0], rtol=2.5e-3, atol=0
    )
    stateless = randomized_svd(W, 32, generator=g)  # no calibration: no warm call will follow
    assert stateless.V is None
    torch.testing.assert_close(stateless.S.double(), reference(W, 32), rtol=1e-5, atol=0)
    # One matrix: warm calls would not pay (exact too), so eigvalsh, no subspace.
    assert choose_method(m, n, 40, 1, torch.float32, batch=1) == "gram"
    calibration = MethodCalibration(lambda run, method: (float(method != "gram"), run(method)))
    few = randomized_svd(W[:1], 32, generator=g, calibration=calibration)
    assert few.V is None


@pytest.mark.parametrize(
    ("W", "kwargs", "error", "match"),
    [
        (
            torch.ones(5),
            {},
            ValueError,
            r"`W` must be a 2-D \(m, n\) matrix or a 3-D .* got shape \(5,\)",
        ),
        (torch.ones(2, 2, 3, 3), {}, ValueError, r"`W` must be a 2-D .* got shape \(2, 2, 3, 3\)"),
        (torch.ones(0, 3), {}, ValueError, r"`W` must have no empty dimension"),
        (
            torch.ones(3, 3, dtype=torch.int64),
            {},
            TypeError,
            r"`W` must have a floating-point dtype",
        ),
        ([[1.0]], {}, TypeError, r"`W` must be a torch.Tensor, got list"),
        (torch.ones(3, 3), {"k": 0}, ValueError, r"`k` must be an int >= 1, got 0"),
        (torch.ones(3, 3), {"k": True}, ValueError, r"`k` must be an int >= 1, got True"),
        (torch.ones(3, 3), {"n_iter": -1}, ValueError, r"`n_iter` must be an int >= 0"),
        (torch.ones(3, 3), {"n_oversamples": 1.5}, ValueError, r"`n_oversamples` must be an int"),
        (torch.ones(3, 3), {"method": "lanczos"}, ValueError, r"`method` must be one of"),
        (torch.ones(3, 3), {"tol": 0}, ValueError, r"`tol` must be a number in \(0, 1\), got 0"),
        (
            torch.ones(3, 3),
            {"init": torch.ones(4, 2)},
            ValueError,
            r"`init` must have shape \(3, j\) to fit `W` of shape \(3, 3\), got \(4, 2\)",
        ),
        (
            torch.ones(2, 3, 3),
            {"init": torch.ones(5, 3, 2)},
            ValueError,
            r"`init` must have shape \(2, 3, j\) \(or \(3, j\), one start for every matrix\)",
        ),
        (torch.ones(3, 3), {"init": "V"}, TypeError, r"`init` must be a floating-point"),
    ],
)
def test_bad_input_is_named_in_a_clear_error(
    W: object, kwargs: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        randomized_svd(W, **kwargs)  # type: ignore[arg-type]


def _krylov_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The Krylov steps (applications of W^T W to a block) of each iteration randomized_svd
    runs, one entry per iteration: the depth reached plus one, whichever way W^T W is applied."""
    runs: list[int] = []
    original = svd_module.top_subspace

    def counting(apply: Callable, *args: object, **kwargs: object) -> object:
        runs.append(0)

        def counted(X: torch.Tensor) -> object:
            runs[-1] += 1
            return apply(X)

        return original(counted, *args, **kwargs)

    monkeypatch.setattr(svd_module, "top_subspace", counting)
    return runs


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spectrum", ["flat", "power_law"])
@pytest.mark.parametrize("start", ["cold", "warm"])
def test_the_stopping_rule_stops_only_where_every_top_pair_meets_its_bound_or_at_the_last_depth(
    start: str, spectrum: str, seed: int
) -> None:
    # The rule's contract (krylov.ritz_residuals), for every input: the iteration returns at a
    # tested depth (from first_check on) where each top-k Ritz pair (theta_i, x_i) of W^T W has
    # ||W^T W x_i - theta_i x_i||^2 <= tol theta_i^2 (i = 1; 10 tol for the others) or a
    # residual at the rounding floor, or else at the largest depth. Which depth that is depends on
    # the start and on the BLAS's rounding; what it promises at the depth it stops does not.
    # Tested from depth 1 on with a tight tol, so the rule decides at depths where pairs still
    # fail (cold: depth 4-8 here), not only where everything has long converged.
    g = torch.Generator().manual_seed(seed)
    m, n, k, b, tol = 600, 500, 32, 40, 1e-4
    if spectrum == "flat":  # a Gaussian matrix: the hard case, it often goes deeper
        W = torch.randn(m, n, generator=g, dtype=torch.float64).float() / n**0.5
    else:
        W = decaying((m, n), 0.5, seed).float()

    def apply(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Y = W @ X
        return W.mT @ Y, Y

    steps = [0]

    def counted(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps[0] += 1
        return apply(X)

    if start == "warm":  # the top subspace of a nearby matrix, as the previous snapshot's V
        nearby = W + 1e-2 * torch.randn(m, n, generator=g) / n**0.5
        init = torch.linalg.svd(nearby.double(), full_matrices=False).Vh[:b].mT.float()
    else:
        init = None
    block = start_block(W, b, g, init)
    depth, first_check = 12, 0 if start == "warm" else 1
    found = block_krylov(
        counted,
        block,
        k,
        depth,
        tol,
        first_check=first_check,
        finite=None,
        rank_scale=m,
        forward=lambda X: W @ X,
    )
    reached = steps[0] - 1
    assert bool(found.finite) and first_check <= reached <= depth
    if found.values is None:  # W X: every pair of W^T W decided on the right
        X, images = found.basis, found.images
        assert X is not None and images is not None and found.left is not None
        assert found.left.shape == (m, b)
        theta = (X * images).sum(-2)  # the Ritz values x_i^T W^T W x_i, descending
        assert torch.all(theta[:-1] >= theta[1:] * (1 - 1e-5))
        _, excess = ritz_residuals([X], [images], torch.eye(b), theta, k, tol, m)
        if reached < depth:  # stopped by the rule: every pair within its bound (rounding)
            assert torch.all(excess <= 1 + 1e-3), (reached, excess.max())
        return
    # Decided by the left Rayleigh-Ritz of the first block (krylov.left_rayleigh_ritz). Block 0's
    # Ritz pairs, formed here in float64: all but the top one met their bounds on the right.
    assert reached == 0
    W64, Q0 = W.double(), block.double()
    theta, x = torch.linalg.eigh(Q0.mT @ W64.mT @ W64 @ Q0)
    X = Q0 @ x[:, -b:].flip(-1)
    theta, images = theta[-b:].flip(-1), W64.mT @ (W64 @ X)
    _, excess = ritz_residuals([X], [images], torch.eye(b, dtype=torch.float64), theta, k, tol, m)
    assert torch.all(excess[1:] <= 1 + 1e-3), excess
    # The next start: orthonormal, spanning the images.
    start = found.start
    assert found.images is None and start is not None
    torch.testing.assert_close(start.mT @ start, torch.eye(b), atol=1e-5, rtol=0)
    kept = (start.double() @ (start.double().mT @ images)).norm(dim=-2) / images.norm(dim=-2)
    assert torch.all((kept - 1).abs() <= 1e-5), kept
    # The values: the singular values of W^T U, U orthonormal in span(W Q_0); the top left pair
    # (u_1, s_1 = W^T u_1) meets sigma_1's bound on W W^T, whose residual
    # ||W s_1 - ||s_1||^2 u_1||^2 = ||W s_1||^2 - ||s_1||^4, since u_1^T W s_1 = ||s_1||^2.
    U = torch.linalg.qr(W64 @ Q0).Q
    L = W64.mT @ U
    _, sigma, Rh = torch.linalg.svd(L, full_matrices=False)
    torch.testing.assert_close(found.values, sigma, rtol=1e-5, atol=0)
    assert torch.all(sigma <= reference(W, b) * (1 + 1e-5))  # Ritz values: lower bounds
    s_1 = L @ Rh[0]
    residual_sq = (W.double() @ s_1).square().sum() - sigma[0] ** 4
    assert residual_sq <= tol * sigma[0] ** 4 * (1 + 1e-2) + 1e-10, (residual_sq, sigma[0])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spectrum", ["flat", "steep", "cliff"])
@pytest.mark.parametrize("noise", [0.0, 1e-3, 0.1])
def test_the_first_block_residual_norms_read_off_its_gram_matrices_are_its_float64_residuals(
    spectrum: str, noise: float, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A warm start's first test reads ||Z x_i - theta_i Q_0 x_i|| (Z = W^T W Q_0) off float64
    # Gram matrices of Q_0 and Z (krylov._first_block_gram) instead of forming the residuals.
    # Against the residuals formed in float64 from the same float32 Q_0 and Z, for every U, V:
    # within 1e-4 of each norm plus a hundredth of the rounding floor (rank_scale eps theta_1),
    # on spectra with sigma_32 / sigma_1 from 0.9 to 1e-6, starts from the exact top subspace to
    # a rotated one, a start only orthonormal to 1e-5 (start_block takes it as it is), and a
    # batch split into several float64 parts.
    monkeypatch.setattr(krylov_module, "_GRAM64_BYTES", 200 * 40 * 8)  # one matrix per part
    g = torch.Generator().manual_seed(seed)
    batch, m, n, b, k = 3, 300, 200, 40, 32
    i = torch.arange(1, n + 1, dtype=torch.float64)
    sigma = {
        "flat": 1 - 0.5 * i / n,
        "steep": i**-2.0,
        "cliff": torch.where(i <= 20, 1.0, 1e-3 / i),
    }[spectrum]
    U = torch.linalg.qr(torch.randn(batch, m, n, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64)).Q
    W = (U * sigma @ V.mT).float()
    near = V[..., :b] + noise * torch.randn(batch, n, b, generator=g, dtype=torch.float64)
    Q0 = torch.linalg.qr(near).Q
    Q0 = (Q0 + 1e-5 / n**0.5 * torch.randn(batch, n, b, generator=g, dtype=torch.float64)).float()
    defect = (Q0.double().mT @ Q0.double() - torch.eye(b, dtype=torch.float64)).abs().amax()
    assert 1e-6 < defect <= 1e3 * torch.finfo(torch.float32).eps
    Z = W.mT @ (W @ Q0)
    T, G, P = _first_block_grams(Q0, Z)
    Q64, Z64 = Q0.double(), Z.double()
    for found, expected in ((T, Q64.mT @ Z64), (G, Z64.mT @ Z64), (P, Q64.mT @ Q64)):
        # float64 rounding, relative to the largest entry (P's off-diagonal is ~1e-6)
        torch.testing.assert_close(found, expected, rtol=0, atol=1e-12 * expected.abs().max())
    theta, x = torch.linalg.eigh(T)
    theta, x = theta[..., -b:].flip(-1), x[..., -b:].flip(-1)
    norms = _first_block_gram(T, G, P, x, theta, k).residuals
    exact = (Z64 @ x - Q64 @ x * theta[..., None, :])[..., :k].norm(dim=-2)
    floor = m * torch.finfo(torch.float32).eps * theta[..., :1]
    assert torch.all((norms - exact).abs() <= 1e-4 * exact + 1e-2 * floor)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("angle", [0.07, 0.3])
def test_a_first_block_that_misses_only_sigma_1_is_decided_by_the_left_rayleigh_ritz(
    angle: float, seed: int
) -> None:
    # W = U diag(sigma) V^T with random U, V and a known spectrum; the start holds v_2..v_40
    # exactly and q_1 = cos(a) v_1 + sin(a) v_41. On the right only the top pair misses its bound:
    # ||r_1||^2 / theta_1^2 = cos^2 sin^2 (s_1^2 - s_41^2)^2 / theta_1^2 = 2.8 tol at a = 0.07
    # (tol = 1e-3). On the left, span(W Q_0) holds cos s_1 u_1 + sin s_41 u_41: the mixing
    # shrinks by s_41 / s_1 = 1/2, and its top pair's residual is 0.7 tol at a = 0.07 (decided
    # there with one product W s_1, values exact in closed form), 13 tol at a = 0.3 (the
    # iteration goes on, and ends on a block of W X). This holds for every U, V.
    g = torch.Generator().manual_seed(seed)
    m, n, k, b, tol = 300, 200, 32, 40, 1e-3
    sigma = torch.cat(
        [
            torch.ones(1, dtype=torch.float64),
            torch.linspace(0.9, 0.55, 39, dtype=torch.float64),
            torch.linspace(0.5, 0.1, n - 40, dtype=torch.float64),
        ]
    )
    U = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64)).Q
    W64 = U * sigma @ V.T
    W = W64.float()
    c, s = math.cos(angle), math.sin(angle)
    start = V[:, :b].clone()
    start[:, 0] = c * V[:, 0] + s * V[:, 40]
    products: list[int] = []

    def apply(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Y = W @ X
        return W.mT @ Y, Y

    def forward(X: torch.Tensor) -> torch.Tensor:
        products.append(X.shape[-1])
        return W @ X

    found = block_krylov(
        apply,
        start.float(),
        k,
        8,
        tol,
        first_check=0,
        finite=None,
        rank_scale=m,
        forward=forward,
    )
    assert bool(found.finite) and products == [1]  # one product W s_1
    if angle > 0.1:  # the left pair missed too: the iteration went on, its values from W X
        assert found.values is None and found.left is not None and found.left.shape == (m, b)
        return
    assert found.values is not None and found.left is None
    found_values = found.values
    # The left Ritz value of u ~ c s_1 u_1 + s s_41 u_41: ||W^T u||^2 = (c^2 s_1^4 + s^2 s_41^4)
    # / (c^2 s_1^2 + s^2 s_41^2); the others are sigma_2..sigma_40 exactly.
    top = ((c**2 * sigma[0] ** 4 + s**2 * sigma[40] ** 4) / (c**2 + s**2 * sigma[40] ** 2)).sqrt()
    expected = torch.cat([top.reshape(1), sigma[1:b]])
    torch.testing.assert_close(found_values, expected, rtol=1e-5, atol=0)
    assert torch.all(found_values <= sigma[:b] * (1 + 1e-5))  # lower bounds, to float32 rounding
    # The next start spans the Ritz images W^T W Q_0 x = V diag(sigma^2) V^T Q_0 x, orthonormal.
    assert found.images is None and found.start is not None
    images = (V * sigma.square() @ V.T) @ start
    kept = (found.start.double() @ (found.start.double().mT @ images)).norm(dim=-2)
    torch.testing.assert_close(kept, images.norm(dim=-2), rtol=1e-5, atol=0)
    eye = torch.eye(b, dtype=torch.float64)
    torch.testing.assert_close(
        found.start.double().mT @ found.start.double(), eye, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spectrum", ["flat", "power_law"])
def test_a_warm_start_from_the_exact_subspace_stops_at_the_first_test_and_a_cold_start_stops_early_only_on_a_decaying_spectrum(
    spectrum: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # For every input: from the exact top subspace the first block holds the top-b singular
    # pairs, so every residual is rounding and the rule, first tested at the first block
    # (depth 0), stops there (one Krylov step), with the exact values.
    # A cold start is tested early from depth 2 (svd._EARLY_CHECK). On sigma_i = i^-0.5 it has
    # converged by depth 3 or 4 (measured worst excess at depth 2: 4, at depth 3: 0.4; the
    # early tests go on while it is under 10) and stops before its expected depth, sigma_1 held
    # to a tenth of its bound there. A flat (Gaussian) matrix is far from its bounds at depth 2
    # (sigma_1's excess 150 or more against 10): it goes to its expected depth, at most
    # _EXTRA_DEPTH deeper. Every Ritz value is a lower bound of its singular value (Rayleigh-Ritz
    # on W itself).
    g = torch.Generator().manual_seed(seed)
    m, n = 600, 500
    W = flat_or_decaying(m, n, spectrum, seed, g)
    exact = reference(W, 32)
    steps = _krylov_steps(monkeypatch)
    top_subspace = torch.linalg.svd(W.double(), full_matrices=False).Vh[:40].mT.float()
    warm = randomized_svd(W, method="randomized", init=top_subspace, generator=g)
    cold = randomized_svd(W, method="randomized", generator=g)
    expected = svd_module.default_n_iter(m, n)
    assert steps[0] == 1
    torch.testing.assert_close(warm.S.double(), exact, rtol=1e-4, atol=0)
    for top in (warm, cold):
        assert torch.all(top.S.double() <= exact * (1 + 1e-5)), (top.S[:3], exact[:3])
    if spectrum == "flat":
        assert expected + 1 <= steps[1] <= expected + svd_module._EXTRA_DEPTH + 1
    else:  # stopped by an early test: sigma_1 within a tenth of the rule's reach
        assert svd_module._EARLY_CHECK + 1 <= steps[1] <= expected, steps
        torch.testing.assert_close(cold.S[0].double(), exact[0], rtol=2.5e-4, atol=0)
    # The accuracy the default tol was measured to give (svd.DEFAULT_TOL: sigma_1 within
    # 2.4 tol on Gaussians), with a margin; a random start could miss it only with a probability
    # that vanishes with the spectral gap.
    assert_within_the_rule(cold.S, exact)


def _cold_krylov(
    W: torch.Tensor, early_check: int | None, seed: int
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A cold block Krylov run on ``W`` as ``randomized_svd`` plans it (k = 32, b = 40, tested
    from the expected depth on, at most _EXTRA_DEPTH deeper), with ``early_check``: the depth
    it returned at, the Ritz vectors, their images and ``W X``."""
    m, n = W.shape
    steps = [0]

    def apply(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps[0] += 1
        Y = W @ X
        return (Y.mT @ W).mT, Y

    expected = svd_module.default_n_iter(m, n)
    start = start_block(W, 40, torch.Generator().manual_seed(seed), None)
    found = block_krylov(
        apply,
        start,
        32,
        expected + svd_module._EXTRA_DEPTH,
        svd_module.DEFAULT_TOL,
        first_check=expected,
        finite=None,
        rank_scale=max(m, n),
        early_check=early_check,
    )
    assert bool(found.finite) and found.images is not None
    return steps[0] - 1, found.basis, found.images, found.left


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("a", [2.0, 1.0, 0.5, None])
def test_a_cold_start_stops_before_its_expected_depth_only_where_every_pair_meets_its_bound_and_sigma_1_a_tenth_of_it(
    a: float | None, seed: int
) -> None:
    # What an early test promises, for every input: it returns before the expected depth only
    # where every top-k Ritz pair meets the rule's bound with sigma_1's a tenth as wide
    # (||r_1||^2 <= tol theta_1^2 / 10), so sigma_1 and stable rank are no less accurate than at
    # the expected depth. Fast-decaying spectra (i^-2, i^-1: at most 1.1 times their bounds at
    # depth 2, measured) stop there; a flat one is far from its bounds at depth 2 and goes on.
    # Against float64: Ritz values are lower bounds, and within the rule's contract.
    g = torch.Generator().manual_seed(seed)
    m, n, k, tol = 600, 500, 32, svd_module.DEFAULT_TOL
    if a is None:
        W = torch.randn(m, n, generator=g, dtype=torch.float64).float() / n**0.5
    else:
        W = decaying((m, n), a, seed).float()
    reached, X, images, values = _cold_krylov(W, svd_module._EARLY_CHECK, seed)
    expected = svd_module.default_n_iter(m, n)
    theta = (X * images).sum(-2)  # the Ritz values, descending
    residual = images[:, :k] - X[:, :k] * theta[:k]
    excess = residual_excess(residual, theta, k, tol, m, top_tol=tol / 10)
    if reached < expected:
        assert reached >= svd_module._EARLY_CHECK
        assert torch.all(excess <= 1 + 1e-3), (reached, excess.max())
    if a is not None and a >= 1.0:
        assert reached < expected, reached
    if a is None:
        assert reached >= expected, reached
    assert values is not None
    found, exact = torch.linalg.svdvals(values.double())[:k], reference(W, k)
    assert torch.all(found <= exact * (1 + 1e-5))
    # A pair whose residual is at the rounding floor m eps theta_1 counts as converged (i^-2's
    # tail: sigma_32 ~ 1e-3 sigma_1); theta_i is then within that floor, sigma_i within
    # sqrt(m eps) sigma_1.
    floor = math.sqrt(m * torch.finfo(torch.float32).eps) * float(exact[0])
    torch.testing.assert_close(found[0], exact[0], rtol=2.5e-3, atol=0)
    torch.testing.assert_close(found, exact, rtol=2.5e-2, atol=floor)
    if reached < expected:  # sigma_1 within 2.4 times its fraction (svd.DEFAULT_TOL's calibration)
        torch.testing.assert_close(found[0], exact[0], rtol=2.4 * tol / 10, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_early_test_that_finds_a_flat_matrix_far_from_its_bounds_changes_nothing_else(
    seed: int,
) -> None:
    # A Gaussian matrix's early test at depth 2 fails by far (sigma_1's excess 150 or more
    # against krylov._EARLY_REACH = 10): it tests no more before its expected depth and grows the
    # whole Krylov block, so the iteration, its depth and its values are those without it.
    W = torch.randn(600, 500, generator=torch.Generator().manual_seed(seed)) / 500**0.5
    reached, X, images, values = _cold_krylov(W, svd_module._EARLY_CHECK, seed)
    again, X0, images0, values0 = _cold_krylov(W, None, seed)
    assert reached == again >= svd_module.default_n_iter(*W.shape)
    assert values is not None and values0 is not None
    assert torch.equal(X, X0) and torch.equal(images, images0) and torch.equal(values, values0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("spectrum", ["flat", "power_law"])
@pytest.mark.parametrize("route", ["products", "gram"])
def test_a_cold_call_on_a_wide_matrix_iterates_in_its_smaller_side_from_a_start_drawn_there(
    route: str, spectrum: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wide W (m < n) cold: every Krylov block has m rows, whichever way W^T W is applied (by
    # products the right start cost a QR of an n x b block and a product with W to map it
    # across); a warm call by products starts from init in W's right space and stays there.
    # V is W's right subspace either way, orthonormal, and the values are within the rule.
    monkeypatch.setattr(svd_module, "randomized_costs", lambda *args, **kwargs: {route: 0.0})
    g = torch.Generator().manual_seed(seed)
    m, n = 300, 700
    W = flat_or_decaying(m, n, spectrum, seed, g)
    rows: list[int] = []
    original = svd_module.top_subspace

    def recording(apply: Callable, start: torch.Tensor, *args: object, **kwargs: object) -> object:
        rows.append(start.shape[-2])
        return original(apply, start, *args, **kwargs)

    monkeypatch.setattr(svd_module, "top_subspace", recording)
    cold = randomized_svd(W, method="randomized", generator=g)
    warm = randomized_svd(W, method="randomized", init=cold.V, generator=g)
    assert rows == [m, m if route == "gram" else n]
    exact = reference(W, 32)
    for top in (cold, warm):
        assert top.V is not None and top.V.shape == (n, 40)
        torch.testing.assert_close(top.V.mT @ top.V, torch.eye(40), atol=1e-4, rtol=0)
        assert torch.all(top.S.double() <= exact * (1 + 1e-5))
        assert_within_the_rule(top.S, exact)


def test_after_a_failed_test_only_the_failing_pairs_get_new_directions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A trained-looking matrix (init noise plus a rank-4 update whose directions then rotate):
    # after block 0 of the warm start only a few top pairs miss their bound.
    g = torch.Generator().manual_seed(random.randrange(2**31))
    m, n = 384, 256
    U, V = torch.randn(m, 4, generator=g), torch.randn(n, 4, generator=g)
    W = 0.02 * torch.randn(m, n, generator=g) + 0.004 * (U @ V.T) / 4
    previous = randomized_svd(W, method="randomized", generator=g)
    U2, V2 = (
        U + 0.5 * torch.randn(U.shape, generator=g),
        V + 0.5 * torch.randn(V.shape, generator=g),
    )
    W2 = W + 0.001 * (U2 @ V2.T) / 4 + 0.001 * torch.randn(m, n, generator=g)
    widths: list[int] = []
    original = svd_module._matmul

    def recording(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        out = original(A, B)
        widths.append(min(out.shape[-2:]))  # columns of the block (W X, Y^T W or X^T W^T)
        return out

    monkeypatch.setattr(svd_module, "_matmul", recording)
    warm = randomized_svd(W2, method="randomized", init=previous.V, generator=g)
    block = 32 + 8
    assert widths[:2] == [block, block]  # W Q_0 and W^T (W Q_0)
    assert len(widths) > 2 and max(widths[2:]) < block, widths  # then narrower blocks only
    exact = reference(W2, 32)
    torch.testing.assert_close(warm.S[0].double(), exact[0], rtol=2.5e-3, atol=0)
    torch.testing.assert_close(warm.S.double(), exact, rtol=2.5e-2, atol=0)


def test_an_explicit_n_iter_is_a_fixed_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    W = decaying((300, 200), 1.0, random.randrange(2**31)).float()  # converges at once
    previous = randomized_svd(W, 8, method="randomized")
    steps = _krylov_steps(monkeypatch)
    randomized_svd(W, 8, method="randomized", init=previous.V, n_iter=3)
    randomized_svd(W, 8, method="randomized", n_iter=3)
    assert steps == [3 + 1, 3 + 1]  # warm or cold, converged or not: blocks 0..3


def test_a_smaller_tol_goes_deeper_and_closer() -> None:
    # From the same start the tight rule's Krylov space holds the loose one's (it only adds
    # blocks), so each Ritz value is at least the loose one (Courant-Fischer) and at most the
    # singular value (Rayleigh-Ritz on W): closer, for every input, up to float32 rounding.
    seed = random.randrange(2**31)
    W = torch.randn(500, 400, generator=torch.Generator().manual_seed(seed))
    exact = reference(W, 32)
    loose, tight = (
        randomized_svd(
            W, method="randomized", tol=tol, generator=torch.Generator().manual_seed(seed)
        )
        for tol in (0.05, 1e-6)
    )
    assert torch.all(tight.S >= loose.S * (1 - 1e-5))
    assert torch.all(tight.S.double() <= exact * (1 + 1e-5))
    tight_error = (tight.S.double() / exact - 1).abs().max()
    assert tight_error < 1e-3  # tol 1e-6: the residual bound leaves sigma_i within ~1e-3


@pytest.mark.parametrize("generator", ["given", None])
def test_random_draws_never_touch_the_global_rng(generator: str | None) -> None:
    W = torch.randn(2, 300, 200)
    state = torch.get_rng_state()
    g = torch.Generator().manual_seed(3) if generator else None
    first = randomized_svd(W, 16, method="randomized", generator=g)
    stale = first.V.clone()
    stale[0, :, :5] = float("nan")  # redrawn columns come from the generator too
    randomized_svd(W, 24, method="randomized", generator=g, init=stale)  # topped up at random
    assert torch.equal(torch.get_rng_state(), state)


def test_without_a_generator_the_result_is_deterministic() -> None:
    W = torch.randn(300, 200)
    assert torch.equal(
        randomized_svd(W, method="randomized").S, randomized_svd(W, method="randomized").S
    )


def test_tf32_split_is_exact_and_recovers_float32_products() -> None:
    g = torch.Generator().manual_seed(random.randrange(2**31))
    A, B = torch.randn(64, 200, generator=g), torch.randn(200, 40, generator=g)
    head, tail = precision.split_tf32(A)
    assert torch.equal(head + tail, A)
    assert torch.all(head.view(torch.int32) & 0x1FFF == 0)  # 10 mantissa bits: exact in TF32
    B_head, B_tail = precision.split_tf32(B)
    three = head @ B_head + (head @ B_tail + tail @ B_head)
    exact = A.double() @ B.double()
    torch.testing.assert_close(three.double(), exact, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("api", ["legacy", "fp32_precision"])
def test_tf32_enabled_by_the_user_does_not_lower_the_svd_precision(
    api: str, restored_fp32_precision: None
) -> None:
    # Against the same call with TF32 off (same start block: the difference is the products'
    # precision alone), rtol 1e-5. Emulated on the CPU (..._keeps_float32_accuracy) TF32 with every
    # product split adds at most 1.1-1.6e-6, with the Krylov bookkeeping left in TF32 1.5-2.2e-4;
    # against float64 the cold depth 6 is itself up to 1.8e-5 off for some seeds, in float32 too.
    W = decaying((1024, 768), 0.5, random.randrange(2**31)).float().cuda()
    assert not precision.tf32_enabled()
    ieee = randomized_svd(W, 32, method="randomized", n_iter=6).S.double()
    previous = torch.get_float32_matmul_precision()
    if api == "legacy":
        torch.set_float32_matmul_precision("high")
    else:  # as transformers' TrainingArguments(tf32=True) does
        torch.backends.fp32_precision = "tf32"
    try:
        assert precision.tf32_enabled()
        top = randomized_svd(W, 32, method="randomized", n_iter=6)
    finally:
        if api == "legacy":
            torch.set_float32_matmul_precision(previous)
    torch.testing.assert_close(top.S.double(), ieee, rtol=1e-5, atol=0)


def test_auto_never_picks_the_float64_gram_path_on_an_accelerator() -> None:
    assert choose_method(64, 64, 40, 6, torch.float32, "cuda") == "svdvals"
    assert choose_method(3072, 768, 40, 5, torch.float32, "cuda") == "randomized"


@pytest.mark.parametrize("n_iter", [None, 4])
def test_a_non_finite_wide_matrix_on_the_gram_path_leaves_its_batch_alone(
    n_iter: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Price the Gram path in, so the wide iteration in the smaller (left) space runs.
    monkeypatch.setattr(
        svd_module, "randomized_costs", lambda *args, **kwargs: {"products": 2.0, "gram": 1.0}
    )
    W = decaying((3, 60, 500), 1.0, random.randrange(2**31)).float()
    W[1, 3, 3] = float("nan")
    top = randomized_svd(W, 4, method="randomized", n_iter=n_iter)
    assert torch.isnan(top.S[1]).all()
    torch.testing.assert_close(top.S[[0, 2]].double(), reference(W[[0, 2]], 4), rtol=1e-3, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rank", [20, 60, 150])
@pytest.mark.parametrize("shape", [(500, 300), (300, 500)])
def test_a_krylov_space_that_runs_out_keeps_its_basis_orthonormal(
    shape: tuple[int, int], rank: int, seed: int
) -> None:
    # A rank-deficient W (here with dead input units: zero columns, or dead outputs: zero rows):
    # past its rank the Krylov blocks lie inside the basis, and a basis that lost orthogonality
    # there once read sigma_1 up to 2.4x too large. Rayleigh-Ritz never exceeds the exact values.
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    W = torch.randn(m, n, generator=g)
    if m > n:
        W[:, rank:] = 0
    else:
        W[rank:] = 0
    exact = reference(W, 32)
    for n_iter in (None, 3, 5, 9):
        top = randomized_svd(W, method="randomized", n_iter=n_iter, generator=g)
        values = top.S.double()
        assert torch.all(values <= exact * (1 + 1e-5) + 1e-6), (n_iter, values[:3], exact[:3])
        kept = min(rank, 32)
        torch.testing.assert_close(values[:kept], exact[:kept], rtol=2e-2, atol=0)
        torch.testing.assert_close(values[0], exact[0], rtol=1e-3, atol=0)
        assert top.V is not None
        eye = torch.eye(top.V.shape[-1])
        torch.testing.assert_close(top.V.mT @ top.V, eye, atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("route", ["products", "gram", "rounded"])
@pytest.mark.parametrize("shape", [(3, 300, 200), (3, 200, 300)])
def test_every_way_to_apply_the_gram_matrix_reads_the_same_values(
    shape: tuple[int, ...], route: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost model picks one per shape and machine (bfloat16 products only where the CPU has
    # matrix tiles); each is forced here, cold (the stopping rule) and at a fixed depth, with a
    # NaN matrix in the batch. The values always come from W itself in float32.
    monkeypatch.setattr(svd_module, "randomized_costs", lambda *args, **kwargs: {route: 0.0})
    W = decaying(shape, 0.5, seed).float()
    W[1, 3, 3] = float("nan")
    rest = W[[0, 2]]
    for n_iter in (None, 5):
        top = randomized_svd(W, 10, method="randomized", n_iter=n_iter)
        assert torch.isnan(top.S[1]).all()
        if n_iter is None:
            assert_within_the_rule(top.S[[0, 2]], reference(rest, 10))
        else:
            torch.testing.assert_close(
                top.S[[0, 2]].double(), reference(rest, 10), rtol=1e-4, atol=0
            )
        assert top.V is not None and top.V.shape == (3, shape[-1], 18)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_start_block_is_orthonormal_whatever_init_it_gets(seed: int) -> None:
    from spectral_callbacks.functional.krylov import start_block

    g = torch.Generator().manual_seed(seed)
    W = torch.randn(3, 90, 60, generator=g)
    eye = torch.eye(20).expand(3, 20, 20)
    orthonormal = torch.linalg.qr(torch.randn(3, 60, 20, generator=g)).Q
    skewed = orthonormal @ torch.randn(20, 20, generator=g)  # the same span, not orthonormal
    short = orthonormal[..., :12]  # topped up at random
    stale = orthonormal.clone()
    stale[1, :, 4] = float("nan")  # redrawn
    for init in (orthonormal, skewed, short, stale, orthonormal[0]):
        start = start_block(W, 20, g, init)
        assert start.shape == (3, 60, 20)
        torch.testing.assert_close(start.mT @ start, eye, atol=1e-5, rtol=0)
    # An orthonormal init (the previous call's V) is used as it is, not re-factored.
    assert torch.equal(start_block(W, 20, g, orthonormal), orthonormal)
    # A skewed one keeps its span.
    start = start_block(W, 20, g, skewed)
    torch.testing.assert_close(start @ (start.mT @ orthonormal), orthonormal, atol=1e-4, rtol=0)


@pytest.mark.skipif(
    not hasattr(torch.backends, "fp32_precision"), reason="torch < 2.9 has only the legacy API"
)
@pytest.mark.parametrize(
    ("backend", "value", "enabled"),
    [
        ("backends", "tf32", True),  # transformers.TrainingArguments(tf32=True) sets this
        ("cuda.matmul", "tf32", True),
        ("cuda.matmul", "ieee", False),
        ("cudnn", "tf32", None),  # what it implies for matmuls is torch's to say (below)
    ],
)
def test_tf32_set_through_the_new_precision_api_is_read_without_an_error(
    backend: str, value: str, enabled: bool | None, restored_fp32_precision: None
) -> None:
    # Reading the legacy flags after the new API was used raises RuntimeError: on a GPU every
    # float32 product of every snapshot failed.
    target = torch.backends if backend == "backends" else torch.backends.cudnn
    if backend == "cuda.matmul":
        target = torch.backends.cuda.matmul
    target.fp32_precision = value
    expected = torch.backends.cuda.matmul.fp32_precision == "tf32" if enabled is None else enabled
    assert precision.tf32_enabled() is expected


@pytest.mark.parametrize("legacy", ["allow_tf32", "set_float32_matmul_precision"])
def test_tf32_set_through_the_legacy_api_is_read(
    legacy: str, restored_fp32_precision: None
) -> None:
    assert precision.tf32_enabled() is False
    previous = torch.get_float32_matmul_precision()
    try:
        if legacy == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.set_float32_matmul_precision("high")
        assert precision.tf32_enabled() is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_with_tf32_products_every_float32_product_keeps_float32_accuracy(
    warm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TF32 emulated on the CPU: every float32 product rounds its operands to 10 mantissa bits,
    # as cuBLAS does with TF32 on. With only the products with W split (3xTF32), the Krylov
    # iteration's own products (projections, combinations, Rayleigh quotients) still ran in TF32:
    # 1.5e-4 relative error on sigma_1..sigma_32 here, against 5e-7 in float32.
    # Measured against the same call in float32 (same start, same depth): a cold start's depth 6
    # is itself up to 1.8e-5 from exact here (convergence, not precision: 12 of 40 seeds were
    # over 1e-5 in float32 too), while TF32 with every product split adds at most 1.1e-6.
    W = decaying((1024, 768), 0.5, random.randrange(2**31)).float()
    exact = reference(W, 32)
    start = randomized_svd(W, 32, method="randomized", n_iter=2).V if warm else None
    in_float32 = randomized_svd(W, 32, method="randomized", n_iter=6, init=start)
    with tf32_matmuls(monkeypatch):
        top = randomized_svd(W, 32, method="randomized", n_iter=6, init=start)
        # The emulation itself works: a plain product is rounded.
        assert not torch.equal(W @ W.mT[:, :8], W.double().matmul(W.double().mT[:, :8]).float())
    relative = ((top.S.double() - in_float32.S.double()) / exact).abs().max().item()
    assert relative < 5e-6, relative


@pytest.mark.parametrize("bad", [{"tol": 0.0}, {"tol": True}, {"k": 0}, {"method": "qr"}])
def test_a_batch_held_as_factors_checks_its_arguments_like_a_dense_one(bad: dict) -> None:
    from spectral_callbacks.functional.lowrank import AdaptedMatrices

    W = torch.randn(1, 24, 16)
    factors = AdaptedMatrices((W[0],), (torch.randn(24, 2),), (torch.randn(2, 16),))
    for batch in (W, factors):
        with pytest.raises(ValueError, match=next(iter(bad))):
            randomized_svd(batch, **bad)


@pytest.mark.parametrize("wide", [False, True], ids=["tall", "wide"])
def test_with_tf32_products_the_gram_route_keeps_float32_accuracy(
    wide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The explicit Gram matrix B^T B from one split of B (head^T head + C + C^T, C = head^T tail)
    # under emulated TF32, against float64: as accurate as the products route (test above).
    monkeypatch.setattr(svd_module, "bf16_tiles", lambda device: False)
    W = decaying((1024, 256), 0.5, random.randrange(2**31)).float()
    W = W.mT.contiguous() if wide else W
    G = W.double().mT @ W.double()
    with tf32_matmuls(monkeypatch):
        found = precision.gram(W)
        top = randomized_svd(W, 32, method="randomized", n_iter=6)
    assert ((found.double() - G).abs().max() / G.abs().max()).item() < 1e-6
    relative = ((top.S.double() - reference(W, 32)) / reference(W, 32)).abs().max().item()
    assert relative < 1e-5, relative


def test_the_cublas_tf32_override_in_the_environment_counts_as_tf32_on(
    monkeypatch: pytest.MonkeyPatch, restored_fp32_precision: None
) -> None:
    assert not precision.tf32_enabled()
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")  # cuBLAS: TF32 whatever the flags
    assert precision.tf32_enabled()
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0")
    assert not precision.tf32_enabled()
