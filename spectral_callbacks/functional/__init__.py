"""Pure tensor math of the spectral metrics: no Lightning, no state.

``randomized_svd`` computes a top-k spectrum; the metric functions turn a spectrum (and the exact
squared Frobenius norm) into the numbers of docs/metrics.md (Definitions); ``spectral_metrics`` does both.
``esd`` fits the power-law tail of the full eigenvalue spectrum as WeightWatcher does;
``circuit_metrics`` gives the per-head QK and OV circuit spectra of an attention layer.

Example::

    >>> import torch
    >>> out = spectral_metrics(torch.eye(4))
    >>> out["stable_rank"], out["spectral_norm"]
    (tensor(4.), tensor(1.))
"""

from spectral_callbacks.functional.circuits import CIRCUIT_METRICS, circuit_metrics
from spectral_callbacks.functional.esd import (
    ESD_METRICS,
    EVALS_THRESHOLD,
    EsdFit,
    esd_eigenvalues,
    esd_fit,
    esd_metrics,
)
from spectral_callbacks.functional.exact import gram_singular_values
from spectral_callbacks.functional.lowrank import AdaptedMatrices, low_rank_singular_values
from spectral_callbacks.functional.metrics import (
    MIN_FIT_POINTS,
    UPDATE_METRICS,
    compression,
    energy_rank,
    energy_rank_key,
    frobenius_norm_sq,
    metrics_from_spectrum,
    powerlaw_alpha,
    spectral_metrics,
    stable_rank,
    update_metrics,
)
from spectral_callbacks.functional.svd import (
    DEFAULT_K,
    DEFAULT_N_ITER,
    DEFAULT_N_OVERSAMPLES,
    DEFAULT_TOL,
    METHODS,
    TopSVD,
    randomized_svd,
)

__all__ = [
    "CIRCUIT_METRICS",
    "circuit_metrics",
    "AdaptedMatrices",
    "UPDATE_METRICS",
    "low_rank_singular_values",
    "update_metrics",
    "DEFAULT_K",
    "DEFAULT_N_ITER",
    "DEFAULT_TOL",
    "DEFAULT_N_OVERSAMPLES",
    "ESD_METRICS",
    "EVALS_THRESHOLD",
    "METHODS",
    "MIN_FIT_POINTS",
    "EsdFit",
    "TopSVD",
    "compression",
    "energy_rank",
    "energy_rank_key",
    "esd_eigenvalues",
    "esd_fit",
    "esd_metrics",
    "frobenius_norm_sq",
    "gram_singular_values",
    "metrics_from_spectrum",
    "powerlaw_alpha",
    "randomized_svd",
    "spectral_metrics",
    "stable_rank",
]
