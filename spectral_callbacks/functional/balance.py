r"""TempBalance's map from each layer's ESD α to a learning-rate factor.

Temperature Balancing (Zhou, Pang, Liu, Martin, Mahoney & Yang, NeurIPS 2023, "Temperature
Balancing, Layer-wise Weight Analysis, and Neural Network Training"; applied to language-model
fine-tuning as "Model Balancing", Liu et al., EMNLP 2024) gives each layer a learning rate from the
power-law exponent α of its weights' empirical spectral density: a heavier tail (smaller α, a layer
"more trained") gets less, a lighter tail more. Its default assignment, ``tb_linear_map``, maps the
α of the balanced layers linearly onto a band of factors of the base learning rate:

.. math::

    f_i = \mathrm{low} + \frac{\alpha_i - \min_j \alpha_j}{\max_j \alpha_j - \min_j \alpha_j}
          \,(\mathrm{high} - \mathrm{low})

so the layer of the smallest α gets ``low``, that of the largest ``high`` (the reference code's
``np.interp(alphas, [min, max], [lr_min_ratio, lr_max_ratio])``; its transformer scripts use about
``[0.7, 1.3]``).

Two cases the reference leaves to ``np.interp`` are decided here: where every α is the same the map
carries no information and every factor is the middle of the band (``np.interp`` would give
``high``); a layer whose α is not finite (no fit) keeps the base learning rate, factor ``1``, and
is left out of the min and max.

Example::

    >>> import torch
    >>> tempbalance_factors(torch.tensor([2.0, 3.0, 4.0, float("nan")]), low=0.7, high=1.3)
    tensor([0.7000, 1.0000, 1.3000, 1.0000], dtype=torch.float64)
    >>> tempbalance_factors(torch.tensor([3.0, 3.0]), low=0.5, high=1.5)
    tensor([1., 1.], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tempbalance_factors"]


def tempbalance_factors(alpha: Tensor, *, low: float = 0.7, high: float = 1.3) -> Tensor:
    r"""The learning-rate factor of each layer from its ESD α (TempBalance's linear map).

    Args:
        alpha: ``(n,)`` the ESD α of each balanced layer (``esd_alpha``); NaN where no fit.
        low: the factor of the smallest α (TempBalance's ``lr_min_ratio``). Default ``0.7``.
        high: the factor of the largest α (``lr_max_ratio``). Default ``1.3``.

    Returns:
        ``(n,)`` float64 factors in ``[low, high]``; ``1`` where α is not finite, the middle of
        the band where every finite α is the same.
    """
    alpha = alpha.detach().to(dtype=torch.float64, device="cpu")
    finite = torch.isfinite(alpha)
    factors = torch.ones_like(alpha)
    if not bool(finite.any()):
        return factors
    smallest, largest = alpha[finite].min(), alpha[finite].max()
    span = largest - smallest
    if float(span) == 0.0:
        factors[finite] = (low + high) / 2
        return factors
    # 1. the position of each α between the smallest and the largest, in [0, 1]
    position = (alpha[finite] - smallest) / span
    # 2. the same position in the band
    factors[finite] = low + position * (high - low)
    return factors
