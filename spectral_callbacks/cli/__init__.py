"""The ``spectral-callbacks`` command line (``python -m spectral_callbacks.cli`` runs it too)."""

# Imported eagerly on purpose: importing the submodule `main` sets the package attribute `main` to
# that module, and only this import binds it back to the function that callers expect.
from spectral_callbacks.cli.main import main

__all__ = ["main"]
