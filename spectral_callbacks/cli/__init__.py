"""The ``spectral-callbacks`` command line."""

from spectral_callbacks.cli.main import main

__all__ = ["main"]
