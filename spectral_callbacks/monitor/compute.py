"""SpectrumCompute: the default compute function the engine runs on each shape group.

It turns a ``(B, m, n)`` stack of snapshots into metric tensors: a batched randomized top-k SVD,
warm-started from the previous snapshot's subspace, the exact ‖W‖_F², and the metrics of
``spectral_callbacks.functional``. It holds no Lightning or engine logic.
"""

from __future__ import annotations

from typing import Any

import torch

from spectral_callbacks.functional import frobenius_norm_sq, metrics_from_spectrum, randomized_svd
from spectral_callbacks.monitor.snapshot import ShapeGroup


class SpectrumCompute:
    """The default compute function: batched randomized top-k SVD, exact ‖W‖_F², the metrics.

    The right subspace ``V`` of each shape group is kept and passed back as ``init`` at the next
    snapshot (weights move little between snapshots, so a warm start reaches σ₁ in fewer power
    iterations). It runs on the engine's single worker thread, so that state needs no lock.

    Args:
        k: singular values computed per matrix (capped at the smaller side). Default ``32``.
        n_oversamples, n_iter, method: passed to ``randomized_svd``; ``None`` keeps its defaults.
        fit_window: passed to ``metrics_from_spectrum`` (ranks the α fit uses); ``None`` keeps its
            default.
        esd: also compute ``esd_alpha``. Default ``False``.
        warm_start: reuse the previous snapshot's subspace. Default ``True``.
    """

    def __init__(
        self,
        k: int = 32,
        *,
        n_oversamples: int | None = None,
        n_iter: int | None = None,
        method: str = "auto",
        fit_window: Any = None,
        esd: bool = False,
        warm_start: bool = True,
    ) -> None:
        self.k = k
        self.svd_options: dict[str, Any] = {"method": method}
        if n_oversamples is not None:
            self.svd_options["n_oversamples"] = n_oversamples
        if n_iter is not None:
            self.svd_options["n_iter"] = n_iter
        self.metric_options: dict[str, Any] = {"esd": esd}
        if fit_window is not None:
            self.metric_options["fit_window"] = fit_window
        self.warm_start = warm_start
        self._subspaces: dict[str, torch.Tensor] = {}

    def __call__(self, group: ShapeGroup, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        # ‖W‖_F² exactly from the snapshot, never from the truncated spectrum (DESIGN.md §2).
        frobenius_sq = frobenius_norm_sq(batch)
        k = min(self.k, *batch.shape[-2:])
        init = self._subspaces.get(group.key) if self.warm_start else None
        if init is not None and init.shape[0] != batch.shape[0]:
            init = None
        top = randomized_svd(batch, k, init=init, **self.svd_options)
        if self.warm_start and top.V is not None:
            self._subspaces[group.key] = top.V
        return metrics_from_spectrum(top.S, frobenius_sq, **self.metric_options)
