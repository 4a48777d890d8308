"""SpectralMonitor for the ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

The same class body as :class:`spectral_callbacks.SpectralMonitor`, built on
``pytorch_lightning.Callback``, so that package's type checks see its own callback and its errors
are its own ``MisconfigurationException``.

Example::

    >>> import pytorch_lightning as pl
    >>> from spectral_callbacks.pl import SpectralMonitor
    >>> trainer = pl.Trainer(callbacks=[SpectralMonitor()], max_steps=100)  # doctest: +SKIP
"""

from __future__ import annotations

from spectral_callbacks.integrations.lightning_factory import monitor_class

SpectralMonitor = monitor_class("pytorch_lightning")

__all__ = ["SpectralMonitor"]
