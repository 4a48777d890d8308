"""SpectralMonitor for ``lightning.pytorch`` (``from spectral_callbacks import SpectralMonitor``).

The class body, and why each hook is the right one, are in ``lightning_factory.py``; the same body
is built for the ``pytorch_lightning`` package in ``pytorch_lightning.py``.

Example::

    >>> from lightning.pytorch import Trainer
    >>> from lightning.pytorch.loggers import TensorBoardLogger
    >>> trainer = Trainer(callbacks=[SpectralMonitor()], logger=TensorBoardLogger("runs"))  # doctest: +SKIP
"""

from __future__ import annotations

from spectral_callbacks.integrations.lightning_factory import check_strategy, monitor_class
from spectral_callbacks.monitor.options import DEFAULT_METRICS

SpectralMonitor = monitor_class("lightning.pytorch")

__all__ = ["DEFAULT_METRICS", "SpectralMonitor", "check_strategy"]
