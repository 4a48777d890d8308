"""The spectral metrics of docs/metrics.md (Definitions) as pure functions of a top-k spectrum.

Every function takes ``S``, the ``(..., k)`` singular values in descending order (as returned by
``randomized_svd``), and works batched: a leading batch shape carries through to the result. The
rules for undefined values are the same everywhere: a metric that is undefined (a zero matrix, a
spectrum with NaN, too few nonzero values to fit a line, an energy fraction not reached within the
top-k) is NaN, never a made-up number. Singular values of exactly 0 (below the rank tolerance, see
``randomized_svd``) take no part in the log-log fits.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from spectral_callbacks.functional.batch import MatrixBatch
from spectral_callbacks.functional.esd import esd_metrics
from spectral_callbacks.functional.svd import DEFAULT_K, randomized_svd

__all__ = [
    "MIN_FIT_POINTS",
    "compression",
    "energy_rank",
    "energy_rank_key",
    "frobenius_norm_sq",
    "metrics_from_spectrum",
    "powerlaw_alpha",
    "spectral_metrics",
    "stable_rank",
    "update_metrics",
    "UPDATE_METRICS",
    "UPDATE_TOP",
]

# A line through two points always has R^2 = 1; three is the least that can show a poor fit.
MIN_FIT_POINTS = 3

#: What the metrics' private cores compute on: torch tensors (any device), or numpy views of CPU
#: tensors (``metrics_from_spectrum``'s host path). Each core is written once against the
#: namespace of its input (``_namespace``), with the functions both share.
Array = Tensor | np.ndarray
#: One of the two, the same throughout a call of a core.
A = TypeVar("A", Tensor, np.ndarray)


#: How many of the update's top singular values are logged (``update_sv_1`` ...): r = 8 .. 64
#: adapters have a few dominant directions; the whole spectrum feeds the stable and energy ranks.
UPDATE_TOP = 4
#: The update family of an adapted layer or a fine-tune, logged as ``spectral_update_<...>``
#: (docs/fine-tuning.md; docs/logged-names.md).
UPDATE_METRICS: tuple[str, ...] = (
    "update_stable_rank",
    "update_spectral_norm",
    "update_frobenius_norm",
    "update_energy_rank_90",
    "update_relative_size",
    "update_rank",
    *(f"update_sv_{i}" for i in range(1, UPDATE_TOP + 1)),
)


def stable_rank(S: Tensor, frobenius_sq: Tensor) -> Tensor:
    r"""Stable rank: squared Frobenius norm over squared spectral norm.

    .. math:: \mathrm{sr}(W) = \frac{\lVert W \rVert_F^2}{\sigma_1^2}

    Args:
        S: ``(..., k)`` singular values, descending (only ``S[..., 0]`` is used).
        frobenius_sq: ``(...)`` exact :math:`\lVert W \rVert_F^2`, computed from W itself.

    Returns:
        ``(...)`` stable rank; NaN for a zero matrix.

    Example::

        >>> stable_rank(torch.tensor([2.0, 2.0, 2.0]), torch.tensor(12.0))
        tensor(3.)
        >>> stable_rank(torch.zeros(3), torch.tensor(0.0))
        tensor(nan)
    """
    return _stable_rank(S[..., 0], frobenius_sq, positive=False)


def _stable_rank(sigma_1: A, frobenius_sq: A, *, positive: bool) -> A:
    """``stable_rank`` from ``sigma_1`` (...); ``positive``: it is known to be > 0 (no mask)."""
    xp = _namespace(sigma_1)
    ratio = frobenius_sq / xp.square(sigma_1)
    return ratio if positive else xp.where(sigma_1 > 0, ratio, math.nan)


def _namespace(X: Array) -> ModuleType:
    """``numpy`` for a numpy array or scalar, else ``torch``: the functions and methods a core
    calls exist in both, with the same arguments (``axis``, ``keepdims``, ``dtype``)."""
    return np if isinstance(X, np.ndarray | np.generic) else torch


def powerlaw_alpha(S: Tensor, fit_window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    r"""Rank-decay exponent :math:`\alpha` of :math:`\sigma_i \approx C\, i^{-\alpha}`, with the R² of the fit.

    Least squares of :math:`y_i = \log \sigma_i` on :math:`x_i = \log i` over the ranks of the
    window:

    .. math::

        \alpha = -\frac{\operatorname{cov}(x, y)}{\operatorname{var}(x)}, \qquad
        R^2 = \frac{\operatorname{cov}(x, y)^2}{\operatorname{var}(x)\,\operatorname{var}(y)}

    The window is given in ranks, so the result does not depend on which SVD method computed the
    spectrum. Ranks with :math:`\sigma_i = 0` are left out; with fewer than 3 points left both
    results are NaN. A perfectly flat window (``var(y) = 0``) is fit exactly: R² = 1.

    Args:
        S: ``(..., k)`` singular values, descending.
        fit_window: 1-based inclusive ranks ``(first, last)``; default ``None`` = all of ranks
            ``1..k``. ``last`` is clamped to ``k``.

    Returns:
        ``(alpha, r2)``, each of shape ``(...)``.

    Raises:
        ValueError: ``fit_window`` is not two ints with ``1 <= first <= last``.

    Example::

        >>> alpha, r2 = powerlaw_alpha(torch.tensor([1.0, 1 / 4, 1 / 9, 1 / 16]))  # i^(-2)
        >>> alpha, r2
        (tensor(2.), tensor(1.))
    """
    first, last = _window(fit_window, S.shape[-1])
    window = S[..., first - 1 : last].to(torch.float64)
    alpha, r2 = _fit(window, first, _all_positive(window))
    return alpha.float(), r2.float()


def _all_positive(S: Tensor) -> bool:
    """Whether every value of ``S`` is known to be > 0 (a NaN is not): on the CPU one host read
    of its least value; elsewhere never assumed (that read would make the device wait)."""
    return S.device.type == "cpu" and S.amin().item() > 0


def _fit(S: A, first: int, positive: bool) -> tuple[A, A]:
    """``powerlaw_alpha`` on the float64 window ``S`` (..., size) of ranks ``first ..``: float64
    ``(alpha, r2)``. ``positive``: every value is known to be > 0, so every rank takes part; then
    ``S`` may be a numpy array (``metrics_from_spectrum``'s host path), else it is a tensor.

    Few operations, each over k numbers: on a small matrix these, not the SVD, are most of a
    call. With every rank in the fit the masks are all ones and the centered log ranks are the
    same at every call (kept), which leaves about a third of the operations.
    """
    size = S.shape[-1]
    if positive:
        xp = _namespace(S)
        if size < MIN_FIT_POINTS:
            nan = xp.full_like(xp.sum(S, axis=-1), math.nan)  # (...), whatever the size
            return nan, nan
        dx, var_x = _centered_log_ranks(first, size, S.device if xp is torch else None)
        # Shifted by the first value first: the fit is the same, and a flat window's deviations
        # are then exactly 0 (R^2 = 1) whichever order the sum below adds its values in.
        y = xp.log(S / S[..., :1])
        dy = y - y.sum(axis=-1, keepdims=True) / size  # (..., size)
        cov = dy @ dx
        var_y = xp.linalg.vecdot(dy, dy)
        r2 = xp.square(cov) / (var_y * var_x)  # 0 / 0 for a flat window: R^2 = 1 below
        return cov / -var_x, xp.where(var_y > 0, r2, 1.0)
    assert isinstance(S, Tensor)  # the masked fit runs in torch
    x = _log_ranks(first, size, S.device)  # (k,)
    valid = S > 0  # NaN compares False, so a NaN spectrum has no valid point
    weight = valid.to(torch.float64)
    count = weight.sum(-1)
    y = torch.where(valid, S.log(), 0.0)
    dx = (x - (weight @ x / count.clamp_min(1))[..., None]) * weight
    dy = (y - (y.sum(-1) / count.clamp_min(1))[..., None]) * weight
    cov = torch.linalg.vecdot(dx, dy)
    var_x = torch.linalg.vecdot(dx, dx)
    var_y = torch.linalg.vecdot(dy, dy)
    alpha = -cov / var_x
    r2 = torch.where(var_y > 0, cov.square() / (var_x * var_y), 1.0)
    enough = count >= MIN_FIT_POINTS
    return torch.where(enough, alpha, math.nan), torch.where(enough, r2, math.nan)


@functools.lru_cache(maxsize=256)  # bounded: a caller may ask for ever new windows
def _log_ranks(first: int, size: int, device: torch.device) -> Tensor:
    """``log i`` for the ranks ``first .. first + size - 1`` in float64 (kept: the same few
    windows come back at every call)."""
    ranks = torch.arange(first, first + size, dtype=torch.float64, device=device)
    return ranks.log()


@functools.lru_cache(maxsize=256)
def _centered_log_ranks(first: int, size: int, device: torch.device | None) -> tuple[Array, float]:
    """``log i`` of the ranks ``first .. first + size - 1`` minus their mean, and the sum of its
    squares: the fit's ``dx`` and ``var(x)`` when every rank takes part (``device`` ``None``: a
    numpy array, for numpy spectra)."""
    x = _log_ranks(first, size, device or torch.device("cpu"))
    dx = x - x.sum() / size
    return dx if device is not None else dx.numpy(), float(dx @ dx)


def compression(stable_rank: Tensor, reference: Tensor | float) -> Tensor:
    r"""Percent of stable rank lost since a reference snapshot (normally the initialization).

    .. math:: \mathrm{compression} = 100 \left(1 - \frac{\mathrm{sr}_t}{\mathrm{sr}_{\mathrm{ref}}}\right)

    Args:
        stable_rank: ``(...)`` stable rank now.
        reference: stable rank of the same matrix at the first snapshot (tensor or float).

    Returns:
        ``(...)`` percent; NaN where the reference is not positive or either input is NaN.

    Example::

        >>> compression(torch.tensor([20.0, 200.0]), torch.tensor(200.0))
        tensor([90.,  0.])
    """
    reference = torch.as_tensor(reference, dtype=stable_rank.dtype, device=stable_rank.device)
    percent = 100.0 * (1.0 - stable_rank / reference)
    return torch.where(reference > 0, percent, torch.full_like(percent, float("nan")))


def energy_rank(S: Tensor, frobenius_sq: Tensor, energy: float = 0.9) -> Tensor:
    r"""Smallest rank holding a fraction of the squared Frobenius norm.

    .. math:: r = \min \Big\{ r : \sum_{i \le r} \sigma_i^2 \ge \mathrm{energy} \cdot \lVert W \rVert_F^2 \Big\}

    Args:
        S: ``(..., k)`` singular values, descending (the top-k of W).
        frobenius_sq: ``(...)`` exact :math:`\lVert W \rVert_F^2`.
        energy: fraction in ``(0, 1]`` (default 0.9).

    Returns:
        ``(...)`` float rank; NaN when the fraction is not reached within the top-k (the answer is
        then > k, not known), for a zero matrix, or for a NaN spectrum.

    Raises:
        ValueError: ``energy`` is not in ``(0, 1]``.

    Example::

        >>> energy_rank(torch.tensor([3.0, 1.0]), torch.tensor(10.0))  # 9 / 10 of the energy at rank 1
        tensor(1.)
        >>> energy_rank(torch.tensor([1.0, 1.0]), torch.tensor(10.0))  # not within the top 2
        tensor(nan)
    """
    _check_energy(energy)
    return _energy_rank(S.to(torch.float64), frobenius_sq.to(torch.float64), energy)


def _energy_rank(S: A, frobenius_sq: A, energy: float) -> A:
    """``energy_rank`` of the float64 ``S`` and ``frobenius_sq``: float32."""
    xp = _namespace(S)
    # Squares summed in float64 so the threshold comparison is not decided by float32 rounding.
    cumulative = xp.square(S).cumsum(axis=-1)  # (..., k), non-decreasing
    target = (energy * (1 - 1e-12)) * frobenius_sq
    short = cumulative < target[..., None]  # a prefix: the ranks before the first one reached
    rank = short.sum(axis=-1, dtype=xp.float32) + 1
    defined = (cumulative[..., -1] >= target) & (frobenius_sq > 0)  # False for a NaN spectrum
    return xp.where(defined, rank, math.nan)


def energy_rank_key(energy: float) -> str:
    """Metric name of an energy fraction: 0.9 -> ``energy_rank_90``, 0.999 -> ``energy_rank_99_9``.

    >>> energy_rank_key(0.9), energy_rank_key(0.5), energy_rank_key(0.999)
    ('energy_rank_90', 'energy_rank_50', 'energy_rank_99_9')
    """
    _check_energy(energy)
    return _energy_key(energy)


@functools.lru_cache(maxsize=256)
def _energy_key(energy: float) -> str:
    """``energy_rank_key`` of a checked fraction (kept: the same one comes back at every call)."""
    percent = round(energy * 100, 6)
    text = str(int(percent)) if percent == int(percent) else f"{percent:g}".replace(".", "_")
    return f"energy_rank_{text}"


def metrics_from_spectrum(
    S: Tensor,
    frobenius_sq: Tensor,
    *,
    fit_window: tuple[int, int] | None = None,
    energy: float = 0.9,
) -> dict[str, Tensor]:
    r"""Every top-k metric of docs/metrics.md, Definitions (not ``compression``, not the ESD family).

    Args:
        S: ``(..., k)`` singular values, descending.
        frobenius_sq: ``(...)`` exact :math:`\lVert W \rVert_F^2`.
        fit_window: ranks of the power-law fit (default ``None`` = ``1..k``, see ``powerlaw_alpha``).
        energy: energy fraction of ``energy_rank`` (default 0.9 -> key ``energy_rank_90``).

    Returns:
        ``{"stable_rank", "alpha", "alpha_r2", "spectral_norm", "frobenius_norm",
        "energy_rank_90"}``, each float32 of shape ``(...)``.

    Example::

        >>> S = torch.tensor([4.0, 2.0, 1.0])  # 2^(-(i-1)): not a power law in i
        >>> out = metrics_from_spectrum(S, torch.tensor(21.0))
        >>> out["stable_rank"], out["spectral_norm"], out["frobenius_norm"], out["energy_rank_90"]
        (tensor(1.3125), tensor(4.), tensor(4.5826), tensor(2.))
    """
    S = S if S.dtype in (torch.float32, torch.float64) else S.float()
    frobenius_sq = torch.as_tensor(frobenius_sq, device=S.device)
    first, last = _window(fit_window, S.shape[-1])
    key = energy_rank_key(energy)
    host = _host_arrays(S, frobenius_sq)
    values: tuple[Array, ...]
    if host is not None:
        values = _metrics(*host, first, last, energy, positive=True)
    else:
        S64, frobenius_64 = S.to(torch.float64), frobenius_sq.to(torch.float64)
        values = _metrics(S64, frobenius_64, first, last, energy, positive=False)
    stable, alpha, r2, norm, rank = values
    return {
        "stable_rank": _float32(stable),
        "alpha": _float32(alpha),
        "alpha_r2": _float32(r2),
        "spectral_norm": _float32(S[..., 0]),
        # In the given dtype: torch's float32 square root is not always the rounded float64 one.
        "frobenius_norm": _float32(
            norm if frobenius_sq.dtype == torch.float64 else frobenius_sq.sqrt()
        ),
        key: _float32(rank),
    }


def _host_arrays(S: Tensor, frobenius_sq: Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """``S`` and ``frobenius_sq`` as float64 numpy arrays where every metric can be computed on
    the host without a mask: on the CPU (and without a graph to keep), where every value of ``S``
    is > 0 (one host read; a NaN is not); else ``None``.

    Every metric is a few operations on k numbers: on a 2-core EPYC after a decomposition a
    torch kernel on 32 numbers costs about 5 us of dispatch, numpy about half of that (a 64 x 64
    call's metrics, ~35 torch kernels, took longer than its eigvalsh). Masks to apply, or an
    accelerator (where a host read would make the device wait): torch, in the same cores.
    """
    if S.device.type != "cpu" or S.requires_grad or frobenius_sq.requires_grad:
        return None
    s = S.numpy().astype(np.float64, copy=False)
    if s.size == 0 or not s.min() > 0:  # an empty batch: nothing to read
        return None
    return s, frobenius_sq.numpy().astype(np.float64, copy=False)


def _metrics(
    S: A, frobenius_sq: A, first: int, last: int, energy: float, *, positive: bool
) -> tuple[A, A, A, A, A]:
    """``(stable rank, alpha, R^2, frobenius norm, energy rank)`` of the float64 ``S`` (..., k) and
    ``frobenius_sq`` (...), numpy arrays or tensors; ``positive``: every value of ``S`` is > 0."""
    window = S if (first, last) == (1, S.shape[-1]) else S[..., first - 1 : last]
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0: a flat window, a zero matrix
        alpha, r2 = _fit(window, first, positive)
        # sigma_1 squared in float64: in float32 it overflows past ~1.8e19 (stable rank 0).
        stable = _stable_rank(S[..., 0], frobenius_sq, positive=positive)
        norm = _namespace(frobenius_sq).sqrt(frobenius_sq)
        return stable, alpha, r2, norm, _energy_rank(S, frobenius_sq, energy)


def _float32(X: Array) -> Tensor:
    """``X`` as a float32 tensor (a numpy result on the CPU, without a copy where it is one)."""
    if isinstance(X, Tensor):
        return X if X.dtype == torch.float32 else X.float()
    return torch.from_numpy(np.asarray(X, dtype=np.float32))


def spectral_metrics(
    W: Tensor | MatrixBatch,
    *,
    k: int = DEFAULT_K,
    fit_window: tuple[int, int] | None = None,
    energy: float = 0.9,
    esd: bool = False,
    **svd_options: object,
) -> dict[str, Tensor]:
    r"""All metrics of ``W``: top-k SVD, exact :math:`\lVert W \rVert_F^2`, ``metrics_from_spectrum``.

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` float matrix (any float dtype; computed in float32 or better),
            or a ``functional.batch.MatrixBatch``.
        k: ranks computed (default 32); also the default fit window ``1..k``.
        fit_window, energy: as in ``metrics_from_spectrum``.
        esd: also the ESD family of the full spectrum (``esd_alpha``, ``esd_ks_distance``,
            ``esd_xmin``, ``esd_tail_size``; see :func:`~spectral_callbacks.functional.esd_metrics`).
            Default False.
        **svd_options: passed to ``randomized_svd`` (``n_oversamples``, ``n_iter``, ``generator``,
            ``init``, ``method``).

    Returns:
        Metric name -> float32 tensor, scalar for ``(m, n)``, ``(B,)`` for ``(B, m, n)``. A matrix
        with a NaN/Inf entry gets NaN for every metric; a zero matrix gets 0 norms and NaN for the
        rest.

    Raises:
        TypeError, ValueError: as ``randomized_svd``, for bad ``W`` or options.

    Example::

        >>> W = torch.diag(torch.tensor([2.0, 2.0, 1.0, 1.0]))
        >>> out = spectral_metrics(W)
        >>> out["stable_rank"], out["frobenius_norm"], out["energy_rank_90"]
        (tensor(2.5000), tensor(3.1623), tensor(3.))
    """
    top = randomized_svd(W, k, **svd_options)  # type: ignore[arg-type]
    frobenius_sq = frobenius_norm_sq(W)
    out = metrics_from_spectrum(top.S, frobenius_sq, fit_window=fit_window, energy=energy)
    if esd:
        out.update(esd_metrics(W if isinstance(W, Tensor) else W.dense()))
    return out


def frobenius_norm_sq(W: Tensor | MatrixBatch) -> Tensor:
    r"""Exact squared Frobenius norm of each matrix, accumulated in float64.

    .. math:: \lVert W \rVert_F^2 = \sum_{i,j} W_{ij}^2

    Computed from W itself, never from a truncated spectrum (which would miss the tail's energy).

    Args:
        W: ``(m, n)`` or ``(B, m, n)`` float tensor, or an ``AdaptedMatrices`` batch.

    Returns:
        ``(...)`` float64; NaN where W has a NaN or Inf entry.

    Example::

        >>> frobenius_norm_sq(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
        tensor(25., dtype=torch.float64)
    """
    if not isinstance(W, Tensor):  # held as factors: exact from r-sized products
        return W.frobenius_norm_sq()
    if W.device.type == "cpu" and W.dtype == torch.float32:
        # Row norms in float32, their squares summed in float64: relative error ~1e-8, and 20x
        # faster on a 4096x4096 than an exact float64 pass. A float32 row norm overflows past
        # ~1e19: those matrices are redone exactly, decided by a host read (free on the CPU, and
        # the usual all-finite batch then needs no mask: fewer small kernels per call).
        rows = torch.linalg.vector_norm(W, dim=-1).double()  # (..., m): no copy of W
        frobenius_sq = torch.linalg.vecdot(rows, rows)
        # The batch's total is finite exactly when each is (each is below 2^256 m).
        total = frobenius_sq if frobenius_sq.ndim == 0 else frobenius_sq.sum()
        if math.isfinite(total.item()):
            return frobenius_sq
        overflowed = ~torch.isfinite(frobenius_sq)
        frobenius_sq = torch.where(overflowed, _float64_by_rows(W), frobenius_sq)
    else:
        # On an accelerator that read would make the worker wait for its stream, so the exact
        # sum is the only pass; other dtypes are exact in float64 too.
        frobenius_sq = _float64_by_rows(W)
    return torch.where(torch.isfinite(frobenius_sq), frobenius_sq, float("nan"))


def update_metrics(
    S: Tensor,
    base_frobenius: Tensor,
    rank: Tensor,
    frobenius_sq: Tensor | None = None,
    energy: float = 0.9,
) -> dict[str, Tensor]:
    r"""The update family from the spectrum of each update :math:`\Delta W`.

    .. math::

        \mathrm{sr}(\Delta W) = \frac{\sum_i \sigma_i^2}{\sigma_1^2}, \qquad
        \text{relative size} = \frac{\lVert \Delta W \rVert_F}{\lVert W_0 \rVert_F}

    Args:
        S: ``(B, r)`` singular values of each update, descending: every nonzero one for a low-rank
            update (zero-padded), the top k of a dense one.
        base_frobenius: ``(B,)`` :math:`\lVert W_0 \rVert_F`.
        rank: ``(B,)`` the adapter's rank r (NaN where there is no adapter, a dense fine-tune; 0
            where the layer has no active adapter: the whole family is NaN there).
        frobenius_sq: ``(B,)`` exact :math:`\lVert \Delta W \rVert_F^2` when ``S`` is only a top-k
            (a dense update); default ``None``: ``S`` is the whole spectrum, summed.
        energy: the energy fraction of ``update_energy_rank_90``.

    Returns:
        The ``UPDATE_METRICS``, float32 ``(B,)`` each; the stable and energy ranks are NaN for a
        zero update (a LoRA before its first step: B = 0), ``update_sv_i`` NaN beyond the spectrum.

    Example::

        >>> out = update_metrics(torch.tensor([[2.0, 1.0]]), torch.tensor([10.0]), torch.tensor([8.0]))
        >>> out["update_stable_rank"], out["update_relative_size"], out["update_sv_2"]
        (tensor([1.2500]), tensor([0.2236]), tensor([1.]))
    """
    S = S.to(torch.float64)
    if S.shape[-1] == 0:  # no layer of the batch has an active adapter: zero-width factors
        S = S.new_zeros((*S.shape[:-1], 1))
    if frobenius_sq is None:
        frobenius_sq = S.square().sum(-1)  # exact: S is the whole spectrum of the update
    frobenius_sq = frobenius_sq.to(torch.float64)
    nan = torch.full_like(frobenius_sq, float("nan"))
    out = {
        "update_stable_rank": stable_rank(S, frobenius_sq),
        "update_spectral_norm": S[..., 0],
        "update_frobenius_norm": frobenius_sq.sqrt(),
        "update_energy_rank_90": energy_rank(S, frobenius_sq, energy),
        "update_relative_size": frobenius_sq.sqrt() / base_frobenius.to(torch.float64),
        "update_rank": rank.to(torch.float64),
    }
    for i in range(1, UPDATE_TOP + 1):
        out[f"update_sv_{i}"] = S[..., i - 1] if S.shape[-1] >= i else nan
    absent = rank.to(torch.float64) == 0  # a layer whose adapters are all inactive: no update
    return {name: torch.where(absent, nan, value).float() for name, value in out.items()}


# Rows converted to float64 at a time: a bounded transient (32 MiB) whatever the size of W, where
# ``vector_norm(W, dtype=torch.float64)`` converts all of W first (8 bytes per entry: 23 GB for
# a 7B model's gate+up group).
_FLOAT64_CHUNK_ELEMENTS = 1 << 22


def _float64_by_rows(W: Tensor) -> Tensor:
    """Exact ‖W‖_F² of each matrix, summed in float64 over slices of rows of every matrix."""
    m, n = W.shape[-2:]
    batch = W[..., 0, 0].numel() if m and n else 1
    step = max(1, _FLOAT64_CHUNK_ELEMENTS // max(1, batch * n))
    total = torch.zeros(W.shape[:-2], dtype=torch.float64, device=W.device)
    for start in range(0, m, step):
        rows = W[..., start : start + step, :]  # a view: (..., <= step, n)
        total += torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float64).square().sum(-1)
    return total


def _window(fit_window: tuple[int, int] | None, k: int) -> tuple[int, int]:
    if fit_window is None:
        return 1, k
    ok = isinstance(fit_window, tuple | list) and len(fit_window) == 2
    ok = ok and all(isinstance(r, int) and not isinstance(r, bool) for r in fit_window)
    if not ok or not 1 <= fit_window[0] <= fit_window[1]:
        raise ValueError(
            f"`fit_window` must be None or 1-based ranks (first, last) with 1 <= first <= last, "
            f"got {fit_window!r}"
        )
    return fit_window[0], min(fit_window[1], k)


def _check_energy(energy: float) -> None:
    if isinstance(energy, bool) or not isinstance(energy, int | float) or not 0 < energy <= 1:
        raise ValueError(f"`energy` must be a fraction in (0, 1], got {energy!r}")
    if math.isnan(energy):
        raise ValueError(f"`energy` must be a fraction in (0, 1], got {energy!r}")
