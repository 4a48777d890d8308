"""The ``spectral-callbacks`` command line."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run ``spectral-callbacks``; imported on call so ``python -m spectral_callbacks.cli.main`` does not warn."""
    from spectral_callbacks.cli.main import main as _main

    return _main(argv)


__all__ = ["main"]
