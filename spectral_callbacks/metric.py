"""A torchmetrics ``Metric`` for the stable rank of a matrix whose rows arrive in batches.

Typical use: the stable rank of a model's embeddings (or any activations) over a validation epoch,
where the whole ``(N, d)`` matrix never fits in memory at once. The metric accumulates the
``(d, d)`` Gram matrix ``X^T X`` in float64, which is all the stable rank needs, and syncs it across
processes by summation like any torchmetrics state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from spectral_callbacks.functional import gram_singular_values, stable_rank

__all__ = ["StableRank"]


class StableRank(Metric):
    r"""Stable rank of the matrix of all rows seen by ``update``, from its accumulated Gram matrix.

    .. math::

        G = \sum_{\text{batches}} X_b^\top X_b, \qquad
        \mathrm{sr} = \frac{\operatorname{tr} G}{\lambda_{\max}(G)}
                    = \frac{\lVert X \rVert_F^2}{\sigma_1(X)^2}

    With ``center=True`` the rows are centered by their running mean first
    (:math:`G - N \mu \mu^\top`), the stable rank of the covariance's square root: a collapse
    measure for embeddings that ignores a shared offset.

    Args:
        num_features: ``d``, the row length (the Gram state is ``d x d`` float64).
        center: subtract the mean row before measuring (default False).
        **kwargs: passed to ``torchmetrics.Metric`` (e.g. ``sync_on_compute``).

    Raises:
        ValueError: ``num_features`` is not a positive int; ``update`` gets rows of another length
            or a non-float tensor.

    Example::

        >>> metric = StableRank(num_features=3)
        >>> metric.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
        >>> metric.update(torch.tensor([[0.0, 0.0, 1.0]]))
        >>> metric.compute()  # (4 + 4 + 1) / 4
        tensor(2.2500, dtype=torch.float64)
    """

    is_differentiable = False
    higher_is_better: bool | None = None
    full_state_update = False

    gram: Tensor
    row_sum: Tensor
    rows: Tensor

    def __init__(self, num_features: int, center: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"`num_features` must be a positive int, got {num_features!r}")
        self.num_features = num_features
        self.center = center
        d = num_features
        self.add_state("gram", torch.zeros(d, d, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("row_sum", torch.zeros(d, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, rows: Tensor) -> None:
        """Add rows: a ``(..., d)`` float tensor; leading dimensions are flattened into rows."""
        if not isinstance(rows, Tensor) or not rows.is_floating_point():
            raise ValueError(f"`rows` must be a floating-point tensor, got {type(rows).__name__}")
        if rows.ndim < 1 or rows.shape[-1] != self.num_features:
            raise ValueError(
                f"`rows` must have last dimension num_features={self.num_features}, got shape "
                f"{tuple(rows.shape)}"
            )
        X = rows.detach().reshape(-1, self.num_features).to(torch.float64)  # (N, d)
        self.gram += X.T @ X
        self.row_sum += X.sum(0)
        self.rows += X.shape[0]

    def compute(self) -> Tensor:
        """The stable rank (float64 scalar); NaN before any nonzero row."""
        gram = self.gram
        if self.center:
            mean = self.row_sum / self.rows.clamp_min(1)
            gram = gram - self.rows * torch.outer(mean, mean)
        S = gram_singular_values(gram)  # (d,) singular values of the stacked rows
        return stable_rank(S, torch.trace(gram).clamp_min(0))
