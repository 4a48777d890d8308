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


def test_an_ill_conditioned_factor_keeps_its_small_singular_values_accurate():
    # cond(left) = 1e7 in rotated directions: a Gram route alone loses the small values (cond^2).
    generator = torch.Generator().manual_seed(5)
    U = torch.linalg.qr(torch.randn(2, 64, 8, generator=generator, dtype=torch.float64)).Q
    V = torch.linalg.qr(torch.randn(2, 8, 8, generator=generator, dtype=torch.float64)).Q
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
    U = torch.linalg.qr(torch.randn(heads, d, d_h, dtype=torch.float64, generator=generator)).Q
    V = torch.linalg.qr(torch.randn(heads, d, d_h, dtype=torch.float64, generator=generator)).Q
    C = torch.linalg.qr(torch.randn(heads, d_h, d_h, dtype=torch.float64, generator=generator)).Q
    q = (U * s[:, None, :]) @ C  # (H, d, d_h): W_Q^T of each head
    k = V @ C  # W_Q^T W_K = U diag(s) C C^T V^T = U diag(s) V^T
    query, key = q.mT.reshape(heads * d_h, d), k.mT.reshape(heads * d_h, d)
    metrics = circuit_metrics(query, key, key, key.T, heads, heads, scale=1.0)

    torch.testing.assert_close(metrics["qk_spectral_norm"], s[:, 0], rtol=1e-12, atol=0)
    known_rank = s.square().sum(-1) / s[:, 0].square()
    torch.testing.assert_close(metrics["qk_stable_rank"], known_rank, rtol=1e-12, atol=0)
