"""Pure tensor math of the spectral metrics: no Lightning, no state.

``randomized_svd`` computes a top-k spectrum; the metric functions turn a spectrum (and the exact
squared Frobenius norm) into the numbers of DESIGN.md section 2; ``spectral_metrics`` does both.

Example::

    >>> import torch
    >>> out = spectral_metrics(torch.eye(4))
    >>> out["stable_rank"], out["spectral_norm"]
    (tensor(4.), tensor(1.))
"""

from spectral_callbacks.functional.exact import gram_singular_values
from spectral_callbacks.functional.lowrank import AdaptedMatrices, low_rank_singular_values
from spectral_callbacks.functional.metrics import (
    ESD_MIN_TAIL,
    MIN_FIT_POINTS,
    UPDATE_METRICS,
    compression,
    energy_rank,
    energy_rank_key,
    esd_alpha,
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
    "AdaptedMatrices",
    "UPDATE_METRICS",
    "low_rank_singular_values",
    "update_metrics",
    "DEFAULT_K",
    "DEFAULT_N_ITER",
    "DEFAULT_TOL",
    "DEFAULT_N_OVERSAMPLES",
    "ESD_MIN_TAIL",
    "METHODS",
    "MIN_FIT_POINTS",
    "TopSVD",
    "compression",
    "energy_rank",
    "energy_rank_key",
    "esd_alpha",
    "frobenius_norm_sq",
    "gram_singular_values",
    "metrics_from_spectrum",
    "powerlaw_alpha",
    "randomized_svd",
    "spectral_metrics",
    "stable_rank",
]
