"""The ``lr_balance`` option: TempBalance's per-layer learning rates, set from each ESD snapshot.

``SpectralTracker(model, lr_balance=LRBalance(), optimizer=optimizer)`` (and the same option of
both ``SpectralMonitor`` classes and of ``SpectralTrainerCallback``) turns the ESD α each ESD
snapshot logs into a learning-rate factor per watched matrix - TempBalance's linear map into
``[low, high]`` (``functional/balance.py``) - and applies it to the learning rate of that matrix's
parameter groups around each optimizer step (``monitor/balancer.py``). The schedulers keep their
own values: the factor is multiplied in just before the step and taken out right after it.

Each field is checked where it enters, at ``LRBalance(...)`` itself; ``MonitorOptions(lr_balance=...)``
checks only that an ``LRBalance`` (or ``None``) came.

Example::

    >>> LRBalance()
    LRBalance(low=0.7, high=1.3, per='matrix', fit='median', skip_first_last=False, min_eigenvalues=0)
    >>> LRBalance.language_model()  # TempBalance's language-model recipe
    LRBalance(low=1.0, high=2.0, per='matrix', fit='median', skip_first_last=True, min_eigenvalues=50)
    >>> LRBalance(low=1.5, high=1.0)
    Traceback (most recent call last):
    ...
    spectral_callbacks.monitor.checks.ConfigurationError: `high` must be a finite factor >= low=1.5 (TempBalance's lr_max_ratio), e.g. 1.3, got 1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spectral_callbacks.monitor.checks import is_int, is_real, require

#: What one factor is shared by: ``"matrix"`` one per module whose weight is watched (a fused
#: ``c_attn`` holding Q, K and V is one), ``"layer"`` one per block.
BALANCE_UNITS: tuple[str, ...] = ("matrix", "layer")
#: How each matrix's α is fitted: ``"median"`` TempBalance's (x_min the median eigenvalue, a Hill
#: estimate: ``functional.esd.esd_fit_median``, logged as ``esd_alpha_median``), ``"xmin_scan"``
#: WeightWatcher's (x_min by the smallest KS distance over every eigenvalue: ``esd_alpha``).
BALANCE_FITS: tuple[str, ...] = ("median", "xmin_scan")


@dataclass(frozen=True)
class LRBalance:
    """TempBalance's learning-rate factors from each watched matrix's ESD α.

    Args:
        low: the factor of the smallest α (the heaviest tail: the most trained matrix gets the
            least learning rate); TempBalance's ``lr_min_ratio``. Default ``0.7``.
        high: the factor of the largest α; TempBalance's ``lr_max_ratio``. Default ``1.3``
            (the band of TempBalance's transformer scripts).
        per: ``"matrix"``: a factor for each module whose weight is watched, from its own α (the
            mean of its parts' where one parameter holds several matrices, e.g. GPT-2's fused
            ``c_attn``), as TempBalance balances each ``Linear``; ``"layer"``: one factor per
            block, from the mean α of its watched matrices. Default ``"matrix"``
            (docs/lr-balance.md compares both).
        fit: how α is fitted, one of :data:`BALANCE_FITS`. Default ``"median"``, TempBalance's
            own (every configuration its reference code ships); ``"xmin_scan"`` is
            WeightWatcher's search over x_min.
        skip_first_last: leave the first and the last unit (in the targets' order: the first
            and last watched module, or block) out of the map, at factor 1, as TempBalance's
            ``remove_first_layer`` / ``remove_last_layer``. Default ``False``.
        min_eigenvalues: leave out, at factor 1, the units with a matrix of fewer eigenvalues
            (``min(out, in)``) than this: too few for a tail fit. Default ``0`` (none).

    Between ESD snapshots each factor holds its value (TempBalance's language-model
    ``tb_update='stage'``): the factors change only when an ESD snapshot brings new α.

    Raises:
        ConfigurationError: ``low`` not a finite real number > 0, ``high`` not a finite real
            number >= ``low``, ``per`` not one of :data:`BALANCE_UNITS`, ``fit`` not one of
            :data:`BALANCE_FITS`, ``skip_first_last`` not a bool, or ``min_eigenvalues`` not an
            int >= 0.
    """

    low: float = 0.7
    high: float = 1.3
    per: str = "matrix"
    fit: str = "median"
    skip_first_last: bool = False
    min_eigenvalues: int = 0

    @classmethod
    def language_model(cls, per: str = "matrix") -> LRBalance:
        """TempBalance's language-model recipe (its Transformer scripts on Penn Treebank): band
        ``[1.0, 2.0]`` (``lr_min_ratio=1.0``, ``lr_slope=1.0``), the median fit, the first and
        last layer left out and every matrix with fewer than 50 eigenvalues."""
        return cls(
            low=1.0, high=2.0, per=per, fit="median", skip_first_last=True, min_eigenvalues=50
        )

    def __post_init__(self) -> None:
        low, high = self.low, self.high
        require(
            "low",
            low,
            is_real(low) and math.isfinite(low) and low > 0,
            "a finite factor > 0 (TempBalance's lr_min_ratio), e.g. 0.7",
        )
        require(
            "high",
            high,
            is_real(high) and math.isfinite(high) and high >= low,
            f"a finite factor >= low={low!r} (TempBalance's lr_max_ratio), e.g. 1.3",
        )
        require("per", self.per, self.per in BALANCE_UNITS, f"one of {BALANCE_UNITS}")
        require("fit", self.fit, self.fit in BALANCE_FITS, f"one of {BALANCE_FITS}")
        require(
            "skip_first_last",
            self.skip_first_last,
            isinstance(self.skip_first_last, bool),
            "a bool",
        )
        require(
            "min_eigenvalues",
            self.min_eigenvalues,
            is_int(self.min_eigenvalues, 0),
            "an int >= 0, e.g. 50",
        )

    @property
    def alpha_metric(self) -> str:
        """The logged metric the factors are mapped from (``esd_alpha_median`` or ``esd_alpha``)."""
        return "esd_alpha_median" if self.fit == "median" else "esd_alpha"
