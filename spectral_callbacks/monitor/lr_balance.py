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
    LRBalance(low=0.7, high=1.3, per='matrix')
    >>> LRBalance(low=1.5, high=1.0)
    Traceback (most recent call last):
    ...
    spectral_callbacks.monitor.checks.ConfigurationError: `high` must be a finite factor >= low=1.5 (TempBalance's lr_max_ratio), e.g. 1.3, got 1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spectral_callbacks.monitor.checks import is_real, require

#: What one factor is shared by: ``"matrix"`` one per module whose weight is watched (a fused
#: ``c_attn`` holding Q, K and V is one), ``"layer"`` one per block.
BALANCE_UNITS: tuple[str, ...] = ("matrix", "layer")


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

    Raises:
        ConfigurationError: ``low`` not a finite real number > 0, ``high`` not a finite real
            number >= ``low``, or ``per`` not one of :data:`BALANCE_UNITS`.
    """

    low: float = 0.7
    high: float = 1.3
    per: str = "matrix"

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
