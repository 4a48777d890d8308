"""``spectral_callbacks.pl.SpectralMonitor``: the callback for the ``pytorch_lightning`` package."""

from spectral_callbacks.integrations.pytorch_lightning import SpectralMonitor

__all__ = ["SpectralMonitor"]
