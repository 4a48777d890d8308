"""Per-head QK/OV circuit spectra against float64 SVDs of the explicitly formed d x d products."""

from __future__ import annotations

import math

import pytest
import torch

from spectral_callbacks.functional.circuits import (
    circuit_metrics,
    circuit_singular_values,
    key_factors,
    output_factors,
    query_factors,
)


def _formed_spectra(q, k, v, o, heads, kv_heads):
    """Every head's circuits formed as (d, d) float64 matrices, then svdvals: the reference."""
    d_h, d_v = q.shape[0] // heads, v.shape[0] // kv_heads
    per_group = heads // kv_heads
    qk, ov = [], []
    for h in range(heads):
        g = h // per_group
        W_q = q[h * d_h : (h + 1) * d_h].double()  # (d_h, d)
        W_k = k[g * d_h : (g + 1) * d_h].double()
        W_v = v[g * d_v : (g + 1) * d_v].double()
        W_o = o[:, h * d_v : (h + 1) * d_v].double()  # (d, d_v)
        qk.append(torch.linalg.svdvals(W_q.T @ W_k)[:d_h])  # (d, d) formed: the reference only
        ov.append(torch.linalg.svdvals(W_o @ W_v)[:d_v])
    return torch.stack(qk), torch.stack(ov)


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1)], ids=["MHA", "GQA4", "MQA"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_circuit_spectra_equal_the_formed_products(heads, kv_heads, seed):
    generator = torch.Generator().manual_seed(seed)
    d, d_h = 96, 12
    q = torch.randn(heads * d_h, d, generator=generator)
    k = torch.randn(kv_heads * d_h, d, generator=generator)
    v = torch.randn(kv_heads * d_h, d, generator=generator)
    o = torch.randn(d, heads * d_h, generator=generator)
    qk, ov = _formed_spectra(q, k, v, o, heads, kv_heads)

    got_qk = circuit_singular_values(query_factors(q, heads), key_factors(k, kv_heads, heads))
    got_ov = circuit_singular_values(output_factors(o, heads), key_factors(v, kv_heads, heads))
    torch.testing.assert_close(got_qk, qk, rtol=1e-5, atol=0)
    torch.testing.assert_close(got_ov, ov, rtol=1e-5, atol=0)

    metrics = circuit_metrics(q, k, v, o, heads, kv_heads)
    torch.testing.assert_close(
        metrics["qk_spectral_norm"], qk[:, 0] / math.sqrt(d_h), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(metrics["ov_spectral_norm"], ov[:, 0], rtol=1e-5, atol=0)
    torch.testing.assert_close(
        metrics["qk_stable_rank"], qk.square().sum(-1) / qk[:, 0].square(), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        metrics["ov_stable_rank"], ov.square().sum(-1) / ov[:, 0].square(), rtol=1e-5, atol=0
    )


def test_a_low_rank_circuit_has_its_rank_of_nonzero_values_and_batches_over_layers():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4 * 8, 40, generator=generator)  # two layers at once
    k = torch.randn(2, 4 * 8, 40, generator=generator)
    k[:, :8] = 0.0
    k[:, 0] = 1.0  # head 0's key has rank 1
    S = circuit_singular_values(query_factors(q, 4), key_factors(k, 4, 4))  # (2, 4, 8)
    assert S.shape == (2, 4, 8)
    assert (S[:, 0, 1:] < 1e-10 * S[:, 0, :1]).all()
    for layer in range(2):
        formed = q[layer, 8:16].double().T @ k[layer, 8:16].double()
        torch.testing.assert_close(S[layer, 1], torch.linalg.svdvals(formed)[:8], rtol=1e-5, atol=0)


def test_a_zero_circuit_has_nan_stable_rank_not_a_made_up_number():
    zero = torch.zeros(8, 8)
    metrics = circuit_metrics(zero, zero, torch.eye(8), torch.eye(8), 2, 2)
    assert metrics["qk_spectral_norm"].tolist() == [0.0, 0.0]
    assert metrics["qk_stable_rank"].isnan().all()
    assert metrics["ov_stable_rank"].tolist() == [4.0, 4.0]


def test_heads_that_do_not_divide_the_rows_are_refused():
    with pytest.raises(ValueError, match=r"10 head channels do not split into 3 heads"):
        query_factors(torch.zeros(10, 4), 3)
    with pytest.raises(ValueError, match=r"must be a multiple of the K/V heads \(3\)"):
        key_factors(torch.zeros(6, 4), 3, 4)
    with pytest.raises(ValueError, match="must share the batch shape and r"):
        circuit_singular_values(torch.zeros(2, 5, 3), torch.zeros(2, 5, 4))


def _orthonormal_columns(*shape, generator):
    """float64 ``(..., rows, columns)`` with orthonormal columns, drawn from ``generator``."""
    return torch.linalg.qr(torch.randn(*shape, dtype=torch.float64, generator=generator)).Q


def test_an_ill_conditioned_factor_keeps_its_small_singular_values_accurate():
    # cond(left) = 1e7 in rotated directions: a Gram route alone loses the small values (cond^2).
    generator = torch.Generator().manual_seed(5)
    U = _orthonormal_columns(2, 64, 8, generator=generator)
    V = _orthonormal_columns(2, 8, 8, generator=generator)
    left = U @ torch.diag(torch.logspace(0, -7, 8, dtype=torch.float64)) @ V.mT
    right = torch.randn(2, 64, 8, generator=generator, dtype=torch.float64)
    formed = torch.linalg.svdvals(left @ right.mT)[..., :8]
    torch.testing.assert_close(circuit_singular_values(left, right), formed, rtol=1e-5, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_keep_float64_accuracy_on_circuits_of_known_spectrum(seed):
    # Each head's QK circuit is U diag(s) V^T with s known (spread over 12 decades, two nearly
    # equal at the top), reached through random orthonormal factors: sigma_1 and the stable rank
    # are known exactly and must come out to float64 accuracy, not just float32's.
    generator = torch.Generator().manual_seed(seed)
    heads, d, d_h = 3, 48, 8
    s = torch.logspace(0, -12, d_h, dtype=torch.float64)
    s[1] = 1.0 - 1e-9
    s = s * torch.rand(heads, 1, dtype=torch.float64, generator=generator).add(0.5)  # per head
    U = _orthonormal_columns(heads, d, d_h, generator=generator)
    V = _orthonormal_columns(heads, d, d_h, generator=generator)
    C = _orthonormal_columns(heads, d_h, d_h, generator=generator)
    q = (U * s[:, None, :]) @ C  # (H, d, d_h): W_Q^T of each head
    k = V @ C  # W_Q^T W_K = U diag(s) C C^T V^T = U diag(s) V^T
    query, key = q.mT.reshape(heads * d_h, d), k.mT.reshape(heads * d_h, d)
    metrics = circuit_metrics(query, key, key, key.T, heads, heads, scale=1.0)

    torch.testing.assert_close(metrics["qk_spectral_norm"], s[:, 0], rtol=1e-12, atol=0)
    known_rank = s.square().sum(-1) / s[:, 0].square()
    torch.testing.assert_close(metrics["qk_stable_rank"], known_rank, rtol=1e-12, atol=0)


def _formed_metrics(q, k, v, o, heads, kv_heads, q_bias, k_bias):
    """σ₁ and stable ranks from float64 SVDs of each head's formed (d, d) circuits, and the biased
    QK circuit's σ₁ (the bound without rotation) from the formed augmented product."""
    qk, ov = _formed_spectra(q, k, v, o, heads, kv_heads)
    qa = torch.cat([q.double(), q_bias.double()[:, None]], dim=1)  # [W_Q b_Q]
    ka = torch.cat([k.double(), k_bias.double()[:, None]], dim=1)
    biased, _ = _formed_spectra(qa, ka, v, o, heads, kv_heads)
    return {
        "qk_spectral_norm": qk[:, 0] / math.sqrt(q.shape[0] // heads),
        "qk_logit_bound": biased[:, 0] / math.sqrt(q.shape[0] // heads),
        "qk_stable_rank": qk.square().sum(-1) / qk[:, 0].square(),
        "ov_spectral_norm": ov[:, 0],
        "ov_stable_rank": ov.square().sum(-1) / ov[:, 0].square(),
    }


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(8, 8), (8, 2), (8, 1)], ids=["MHA", "GQA4", "MQA"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_metrics_with_biases_equal_the_float64_formed_products(
    heads, kv_heads, dtype, seed
):
    # Weights like a checkpoint's: a decaying spectrum per projection and non-zero biases; the
    # metrics of half/single-precision weights are computed in float32 and must agree with float64
    # SVDs of the products of the very same (rounded) weights.
    generator = torch.Generator().manual_seed(seed)
    d, d_h = 128, 16

    def weight(rows, columns):
        U = (
            torch.linalg.qr(torch.randn(rows, columns, generator=generator)).Q
            if rows >= columns
            else torch.linalg.qr(torch.randn(columns, rows, generator=generator)).Q.T
        )
        decay = torch.logspace(0, -1.5, min(rows, columns))
        W = (
            torch.randn(rows, min(rows, columns), generator=generator)
            * decay
            @ (torch.randn(min(rows, columns), columns, generator=generator))
        )
        return (W + 0.1 * U).to(dtype)

    q, k, v = weight(heads * d_h, d), weight(kv_heads * d_h, d), weight(kv_heads * d_h, d)
    o = weight(d, heads * d_h)
    q_bias = (0.3 * torch.randn(heads * d_h, generator=generator)).to(dtype)
    k_bias = (0.3 * torch.randn(kv_heads * d_h, generator=generator)).to(dtype)
    want = _formed_metrics(q, k, v, o, heads, kv_heads, q_bias, k_bias)
    got = circuit_metrics(q, k, v, o, heads, kv_heads, query_bias=q_bias, key_bias=k_bias)
    for name, value in want.items():
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=0, msg=name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float32_metrics_on_circuits_of_known_spectrum(seed):
    # As the float64 test above, on float32 weights: the reference is the known spectrum of the
    # rounded weights' products (float64 SVD), to the tests' float32 tolerance.
    generator = torch.Generator().manual_seed(seed)
    heads, d, d_h = 3, 96, 8
    s = torch.logspace(0, -3, d_h, dtype=torch.float64)
    s[1] = 1.0 - 1e-4
    U = _orthonormal_columns(heads, d, d_h, generator=generator)
    V = _orthonormal_columns(heads, d, d_h, generator=generator)
    query = (U * s).mT.reshape(heads * d_h, d).float()
    key = V.mT.reshape(heads * d_h, d).float()
    metrics = circuit_metrics(query, key, key, key.T, heads, heads, scale=1.0)
    qk, _ = _formed_spectra(query, key, key, key.T, heads, heads)
    torch.testing.assert_close(qk[:, 0], s[0].expand(heads), rtol=1e-6, atol=0)  # known, rounded
    torch.testing.assert_close(metrics["qk_spectral_norm"], qk[:, 0], rtol=1e-5, atol=0)
    known_rank = qk.square().sum(-1) / qk[:, 0].square()
    torch.testing.assert_close(metrics["qk_stable_rank"], known_rank, rtol=1e-5, atol=0)


def _conditioned(heads, d, d_h, condition, generator):
    """(heads, d, d_h) factors U diag(s) V^T with s from 1 down to 1 / condition, and U, V."""
    U = _orthonormal_columns(heads, d, d_h, generator=generator)
    V = _orthonormal_columns(heads, d_h, d_h, generator=generator)
    s = torch.logspace(0, -math.log10(condition), d_h, dtype=torch.float64)
    return U * s @ V.mT, U, V, s


def test_float32_heads_float32_cannot_carry_are_redone_in_float64():
    # Head 0's query factor has condition number 1e5 and its key reads the query's weakest
    # directions most (sigma_1 of the product is 1e-5 ||W_Q|| ||W_K||: the float32 Gram route
    # would lose it entirely); head 1's query is zero; head 2 is a plain random head. In float32
    # the first two fail the conditioning check and are redone in float64.
    generator = torch.Generator().manual_seed(7)
    d, d_h = 64, 8
    A, U, V, s = _conditioned(1, d, d_h, 1e5, generator)
    W = _orthonormal_columns(1, d, d_h, generator=generator)
    B = W * s.flip(0) @ V.mT  # A B^T = U diag(s * s.flip) W^T: every value 1e-5
    q_factors = torch.cat(
        [
            A,
            torch.zeros(1, d, d_h, dtype=torch.float64),
            torch.randn(1, d, d_h, dtype=torch.float64, generator=generator),
        ]
    )
    k_factors = torch.cat([B, torch.randn(2, d, d_h, dtype=torch.float64, generator=generator)])
    query = q_factors.mT.reshape(3 * d_h, d).float()
    key = k_factors.mT.reshape(3 * d_h, d).float()
    value = torch.randn(3 * d_h, d, generator=generator)
    output = torch.randn(d, 3 * d_h, generator=generator)
    output[:, d_h : 2 * d_h] = 0.0  # head 1's output factor is zero too

    from spectral_callbacks.functional.circuits import _FLOAT32_CONDITION, _triangle

    R = _triangle(query_factors(query, 3), torch.float32)
    assert R.dtype == torch.float64  # some heads were redone: the batch comes back float64
    L, info = torch.linalg.cholesky_ex(query_factors(query, 3).mT @ query_factors(query, 3))
    diagonal = L.diagonal(dim1=-2, dim2=-1)
    poor = (info != 0) | (diagonal.amin(-1) * _FLOAT32_CONDITION <= diagonal.amax(-1))
    assert poor.tolist() == [True, True, False]  # the check sees both heads float32 cannot carry

    got = circuit_metrics(query, key, value, output, 3, 3, scale=1.0)
    qk, ov = _formed_spectra(query, key, value, output, 3, 3)
    torch.testing.assert_close(got["qk_spectral_norm"], qk[:, 0], rtol=1e-5, atol=0)
    assert got["qk_spectral_norm"][0].item() == pytest.approx(1e-5, rel=1e-3)
    assert got["qk_spectral_norm"][1].item() == 0.0 and got["qk_stable_rank"][1].isnan()
    torch.testing.assert_close(
        got["qk_stable_rank"][[0, 2]],
        (qk.square().sum(-1) / qk[:, 0].square())[[0, 2]],
        rtol=1e-5,
        atol=0,
    )
    assert got["ov_spectral_norm"][1].item() == 0.0 and got["ov_stable_rank"][1].isnan()
    torch.testing.assert_close(got["ov_spectral_norm"][[0, 2]], ov[[0, 2], 0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_error_stays_within_its_bound_for_factors_it_keeps(seed):
    # The worst case float32 keeps: a query factor whose condition number is just under the
    # threshold, read by a key aligned with its weakest directions (sigma_1 of the product is
    # 1 / cond of ||W_Q|| ||W_K||). The error bound the threshold is chosen from, eps32 * cond^2
    # <= 1e-3, holds for every logged value.
    from spectral_callbacks.functional.circuits import _FLOAT32_CONDITION, _triangle

    generator = torch.Generator().manual_seed(seed)
    d, d_h = 96, 8
    condition = 0.9 * _FLOAT32_CONDITION
    A, U, V, s = _conditioned(4, d, d_h, condition, generator)
    W = _orthonormal_columns(4, d, d_h, generator=generator)
    B = W * s.flip(0) @ V.mT
    query, key = A.mT.reshape(4 * d_h, d).float(), B.mT.reshape(4 * d_h, d).float()
    assert _triangle(query_factors(query, 4), torch.float32).dtype == torch.float32  # kept
    got = circuit_metrics(query, key, key, key.T, 4, 4, scale=1.0)
    qk, _ = _formed_spectra(query, key, key, key.T, 4, 4)
    torch.testing.assert_close(got["qk_spectral_norm"], qk[:, 0], rtol=1e-3, atol=0)
    rank = qk.square().sum(-1) / qk[:, 0].square()
    torch.testing.assert_close(got["qk_stable_rank"], rank, rtol=1e-3, atol=0)
