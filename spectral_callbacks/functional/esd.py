"""The empirical spectral density's power-law tail, fitted as WeightWatcher fits it.

WeightWatcher (Martin & Mahoney 2021, "Implicit self-regularization in deep neural networks";
the ``weightwatcher`` package, version 0.7.7) reads a weight matrix by the eigenvalues
:math:`\\lambda_i = \\sigma_i^2` of :math:`W^\\top W` - the *whole* spectrum, not a top-k - and fits a
power law :math:`p(\\lambda) \\propto \\lambda^{-\\alpha}` to its tail by the method of Clauset,
Shalizi & Newman (2009, "Power-law distributions in empirical data", sections 3.1 and 3.3):

1. drop the eigenvalues at or below ``EVALS_THRESHOLD`` (WeightWatcher's ``EVALS_THRESH``; it does
   not divide by N in 0.7.7, so the threshold is on the raw :math:`\\sigma^2`);
2. for every candidate :math:`x_{\\min}` among the sorted eigenvalues but the largest, the
   maximum-likelihood exponent of the tail :math:`\\lambda \\ge x_{\\min}` (``n`` values)
   :math:`\\hat\\alpha = 1 + n / \\sum \\log(\\lambda / x_{\\min})`;
3. its Kolmogorov-Smirnov distance
   :math:`D = \\max_j |1 - (\\lambda_j / x_{\\min})^{1-\\hat\\alpha} - j/n|` (``j = 0..n-1``, the
   empirical CDF at the left of each step, as WeightWatcher writes it; :math:`D = 1` where
   :math:`\\hat\\alpha \\le 1`);
4. the :math:`x_{\\min}` of the smallest D (the first, on a tie).

With fewer than 20 eigenvalues left WeightWatcher switches to its small-sample fit: the
bias-corrected :math:`1 + (n - 1) / \\sum \\log(\\lambda / x_{\\min})`, tails of at least 8, and
:math:`x_{\\min}` again by the smallest D (its score :math:`D - 0.868 / \\sqrt n` is computed and
then overridden), and the whole spectrum where no tail qualifies; that is reproduced too.

TempBalance (Zhou et al., NeurIPS 2023) fits the same tail without the search: every shipped
configuration of its reference code uses ``pl_fitting='median'``, :math:`x_{\\min}` the median
eigenvalue and the Hill (maximum-likelihood) exponent of the values above it
(:func:`esd_fit_median`, logged as ``esd_alpha_median``); the learning-rate balancer uses that
fit unless told otherwise.

Everything is a tensor operation over a batch of spectra and all candidates at once (the
``(candidates, values)`` KS table is built in chunks of candidates so its memory stays bounded);
there is no Python loop over candidates or matrices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ESD_METRICS",
    "EVALS_THRESHOLD",
    "EsdFit",
    "esd_eigenvalues",
    "esd_fit",
    "esd_fit_median",
    "esd_metrics",
]

#: The logged ESD family: the fit's exponent, KS distance, x_min and tail size.
ESD_METRICS: tuple[str, ...] = ("esd_alpha", "esd_ks_distance", "esd_xmin", "esd_tail_size")
#: TempBalance's exponent (:func:`esd_fit_median`): logged where asked for, or for the balancer.
ESD_MEDIAN_ALPHA = "esd_alpha_median"
#: WeightWatcher's ``EVALS_THRESH``: eigenvalues at or below it are left out of the fit.
EVALS_THRESHOLD = 1e-5
# WeightWatcher's ``SMALL_N_CUTOFF`` and the small-sample fit's ``k_min``.
_SMALL_N = 20
_SMALL_N_MIN_TAIL = 8
# Elements of one chunk of the (batch, candidates, values) KS table: 32 MiB of float64.
_CHUNK_ELEMENTS = 1 << 22


class EsdFit(NamedTuple):
    """One power-law fit per spectrum; every field ``(...)`` float64, NaN where no fit exists."""

    alpha: Tensor  #: the exponent of :math:`p(\lambda) \propto \lambda^{-\alpha}`
    ks_distance: Tensor  #: D, the KS distance of the chosen fit
    xmin: Tensor  #: the chosen :math:`x_{\min}` (an eigenvalue)
    tail_size: Tensor  #: eigenvalues at or above :math:`x_{\min}`


def esd_eigenvalues(W: Tensor) -> Tensor:
    r"""Every eigenvalue :math:`\sigma_i^2` of ``W``, ascending, in float64.

    The exact ``eigvalsh`` of the smaller Gram matrix (:math:`W^\top W` or :math:`W W^\top`,
    ``min(m, n)`` eigenvalues), computed in float64 so the small eigenvalues near
    ``EVALS_THRESHOLD`` are read to ~1e-16 of :math:`\sigma_1^2` (a float32 Gram matrix would blur
    everything below ~1e-7 of it). Round-off below zero is clamped to 0.

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` float matrix.

    Returns:
        ``(min(m, n),)`` or ``(B, min(m, n))`` float64; NaN rows for matrices holding a NaN or Inf.

    Example::

        >>> esd_eigenvalues(torch.diag(torch.tensor([3.0, 1.0, 2.0])))
        tensor([1., 4., 9.], dtype=torch.float64)
    """
    W = W.to(torch.float64)
    m, n = W.shape[-2:]
    gram = W.mT @ W if n <= m else W @ W.mT  # (..., min(m, n), min(m, n))
    finite = torch.isfinite(W).flatten(-2).all(-1)  # (...)
    # eigvalsh refuses NaN input: decompose a zero in its place, then mark the row NaN.
    gram = torch.where(finite[..., None, None], gram, 0.0)
    evals = torch.linalg.eigvalsh(gram).clamp_min(0.0)
    return torch.where(finite[..., None], evals, float("nan"))


def esd_fit(evals: Tensor, threshold: float = EVALS_THRESHOLD) -> EsdFit:
    r"""WeightWatcher 0.7.7's default power-law fit of each spectrum (see the module docstring).

    Args:
        evals: ``(..., N)`` eigenvalues, ascending (as ``esd_eigenvalues`` returns them).
        threshold: eigenvalues at or below it are dropped first. Default ``EVALS_THRESHOLD``.

    Returns:
        An :class:`EsdFit` of ``(...)`` float64 tensors; NaN for a spectrum with fewer than two
        eigenvalues above ``threshold`` or holding a NaN.

    Example::

        >>> u = torch.linspace(0.0, 1.0, 1001, dtype=torch.float64)[1:-1]
        >>> fit = esd_fit((1 - u).pow(-1 / 2))  # quantiles of p(x) ~ x^-3 on [1, inf)
        >>> round(float(fit.alpha), 2), int(fit.tail_size)
        (3.01, 999)
    """
    evals = evals.to(torch.float64)
    size = evals.shape[-1]
    nan_row = torch.isnan(evals).any(-1)  # (...)
    # Dropped values become +0 at the front (the array stays sorted), marked invalid.
    valid = (evals > threshold) & ~nan_row[..., None]  # (..., N)
    data = torch.where(valid, evals, 0.0).sort(-1).values
    valid = valid.sum(-1, keepdim=True) > (size - 1 - torch.arange(size, device=evals.device))
    count = valid.sum(-1)  # (...) eigenvalues kept, N_b
    log_data = torch.where(valid, data.clamp_min(torch.finfo(torch.float64).tiny).log(), 0.0)
    index = torch.arange(size, device=evals.device)
    tail = (size - index).to(torch.float64)  # (N,) values at or above candidate i
    # 1. sum_{j >= i} log(lambda_j / lambda_i), for every candidate i at once.
    suffix = log_data.flip(-1).cumsum(-1).flip(-1)  # (..., N)
    log_sum = suffix - tail * log_data
    # 2. the MLE exponent; the small-sample fit's bias-corrected one beside it.
    alpha = 1 + tail / log_sum
    alpha_small = 1 + (tail - 1) / log_sum
    small = count < _SMALL_N  # (...)
    alpha = torch.where(small[..., None], alpha_small, alpha)
    # Candidates: every kept value but the largest.
    candidate = valid & (index < size - 1)
    alpha = torch.where(candidate, alpha, float("nan"))
    # 3. the KS distance of each candidate's fit.
    raw_alpha = alpha
    raw_ks = _ks_distances(log_data, alpha, candidate)  # (..., N), inf where not a candidate
    # WeightWatcher keeps D = 1 where alpha <= 1. Its small-sample fit also skips tails shorter
    # than 8 or with a log-sum <= 1e-12 (their alpha stays 0); where it skips every candidate it
    # fits the whole spectrum instead (the first kept value as x_min).
    fitted = torch.where(small[..., None], (tail >= _SMALL_N_MIN_TAIL) & (log_sum > 1e-12), True)
    alpha = torch.where(fitted, raw_alpha, 0.0)
    ks = torch.where(fitted & (alpha > 1), raw_ks, 1.0)
    first = (size - count).clamp_max(size - 1)[..., None]  # (..., 1) the smallest kept value
    none_usable = small & ~(candidate & fitted & (alpha > 1)).any(-1)
    whole = none_usable & (log_sum.gather(-1, first)[..., 0] > 1e-12)  # (...)
    at_first = whole[..., None] & (index == first)
    alpha = torch.where(at_first, raw_alpha, alpha)
    ks = torch.where(at_first, raw_ks, ks)
    # 4. the first candidate of the smallest D: WeightWatcher picks by D in both fits (its
    # small-sample score D - 0.868 / sqrt(n) is computed and then overridden by argmin D).
    best = torch.where(candidate, ks, float("inf")).argmin(-1, keepdim=True)  # (..., 1)
    chosen_alpha = alpha.gather(-1, best)[..., 0]
    chosen_ks = ks.gather(-1, best)[..., 0]
    xmin = data.gather(-1, best)[..., 0]
    tail_size = (valid & (data >= xmin[..., None])).sum(-1).to(torch.float64)
    found = count >= 2
    nan = torch.full_like(chosen_alpha, float("nan"))
    return EsdFit(
        torch.where(found, chosen_alpha, nan),
        torch.where(found, chosen_ks, nan),
        torch.where(found, xmin, nan),
        torch.where(found, tail_size, nan),
    )


def esd_fit_median(evals: Tensor) -> EsdFit:
    r"""TempBalance's power-law fit (``pl_fitting='median'``): :math:`x_{\min}` the median
    eigenvalue, the Hill estimate of the tail above it, no search over :math:`x_{\min}`.

    With the ``N`` eigenvalues ascending, :math:`i = \lfloor N / 2 \rfloor`,
    :math:`x_{\min} = \lambda_i`, :math:`n = N - i`:

    .. math::

        \hat\alpha = 1 + \frac{n}{\sum_{j \ge i} \log(\lambda_j / \lambda_i)}, \qquad
        D = \max_{0 \le k < n} \left| 1 - (\lambda_{i+k} / \lambda_i)^{1 - \hat\alpha}
            - k / n \right|

    Every eigenvalue counts, zeros included (TempBalance's default ``filter_zeros=False``); a
    spectrum whose median is not positive has no fit (NaN).

    Args:
        evals: ``(..., N)`` eigenvalues, ascending (as ``esd_eigenvalues`` returns them).

    Returns:
        An :class:`EsdFit` of ``(...)`` float64 tensors; NaN rows where no fit exists.

    Example::

        >>> u = torch.linspace(0.0, 1.0, 2001, dtype=torch.float64)[1:-1]
        >>> fit = esd_fit_median((1 - u).pow(-1 / 2))  # quantiles of p(x) ~ x^-3 on [1, inf)
        >>> round(float(fit.alpha), 2), int(fit.tail_size)
        (3.01, 1000)
    """
    evals = evals.to(torch.float64)
    size = evals.shape[-1]
    start = size // 2  # TempBalance's xmin_pos = 2: the index int(N / 2)
    tail = evals[..., start:]  # (..., n)
    xmin = tail[..., 0]
    n = tail.shape[-1]
    usable = (xmin > 0) & ~torch.isnan(evals).any(-1)
    safe = torch.where(usable[..., None], tail, 1.0)
    log_ratio = safe.log() - safe[..., :1].log()  # (..., n) log(lambda_j / x_min)
    alpha = 1 + n / log_ratio.sum(-1)
    k = torch.arange(n, dtype=torch.float64, device=evals.device)
    fitted = 1 - torch.exp((1 - alpha)[..., None] * log_ratio)
    ks = (fitted - k / n).abs().amax(-1)
    nan = torch.full_like(alpha, float("nan"))
    return EsdFit(
        torch.where(usable, alpha, nan),
        torch.where(usable, ks, nan),
        torch.where(usable, xmin, nan),
        torch.where(usable, torch.full_like(alpha, float(n)), nan),
    )


def esd_metrics(
    W: Tensor, threshold: float = EVALS_THRESHOLD, *, median: bool = False
) -> dict[str, Tensor]:
    """The logged ESD family of each matrix: ``esd_alpha, esd_ks_distance, esd_xmin, esd_tail_size``.

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` float matrix.
        threshold: as in :func:`esd_fit`.
        median: also ``esd_alpha_median``, TempBalance's fit (:func:`esd_fit_median`).

    Returns:
        Metric name -> float32 tensor of shape ``()`` or ``(B,)``.

    Example::

        >>> out = esd_metrics(torch.eye(4))  # a flat spectrum: every candidate tail is flat
        >>> sorted(out), float(out["esd_tail_size"])
        (['esd_alpha', 'esd_ks_distance', 'esd_tail_size', 'esd_xmin'], 4.0)
    """
    evals = esd_eigenvalues(W)
    fit = esd_fit(evals, threshold)
    metrics = {name: value.float() for name, value in zip(ESD_METRICS, fit, strict=True)}
    if median:
        metrics[ESD_MEDIAN_ALPHA] = esd_fit_median(evals).alpha.float()
    return metrics


def _ks_distances(log_data: Tensor, alpha: Tensor, candidate: Tensor) -> Tensor:
    """``max_j |1 - (x_j / x_i)^(1 - alpha_i) - (j - i) / (N - i)|`` over ``j >= i``, per candidate i.

    Built as a ``(..., candidates, values)`` table, a chunk of candidates at a time.
    """
    size = log_data.shape[-1]
    batch = log_data.shape[:-1].numel() if log_data.dim() > 1 else 1
    chunk = max(1, _CHUNK_ELEMENTS // max(1, batch * size))
    index = torch.arange(size, device=log_data.device)
    out = torch.full_like(log_data, float("inf"))
    for start in range(0, size, chunk):
        rows = index[start : start + chunk]  # candidates i of this chunk
        offset = index[None, :] - rows[:, None]  # (c, N): j - i
        in_tail = offset >= 0
        tail = (size - rows).to(torch.float64)[:, None]  # (c, 1)
        ratio = log_data[..., None, :] - log_data[..., rows, None]  # (..., c, N) log(x_j / x_i)
        exponent = (1 - alpha[..., rows])[..., None]  # (..., c, 1)
        # ratio 0 (a repeated eigenvalue) with an infinite exponent: numpy's 1 ** -inf = 1.
        fitted = 1 - torch.exp(torch.where(in_tail & (ratio != 0), exponent * ratio, 0.0))
        gap = (fitted - offset.to(torch.float64) / tail).abs()
        gap = torch.where(in_tail, gap, 0.0).amax(-1)  # (..., c)
        out[..., start : start + chunk] = torch.where(candidate[..., rows], gap, float("inf"))
    return out
