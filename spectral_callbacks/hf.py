"""``spectral_callbacks.hf.SpectralTrainerCallback``: the Hugging Face ``Trainer`` frontend.

Needs only the ``[hf]`` extra (``pip install 'spectral-callbacks[hf]'``).
"""

from spectral_callbacks.integrations.hf import SpectralTrainerCallback

__all__ = ["SpectralTrainerCallback"]
