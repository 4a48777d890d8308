"""Watch the spectra of a transformer's weight matrices change during training.

``SpectralTracker`` is the framework-agnostic core (``tracker.step(step)`` after each optimizer
step); ``SpectralMonitor`` is the ``lightning.pytorch`` callback, ``spectral_callbacks.pl`` the
``pytorch_lightning`` one and ``spectral_callbacks.hf`` the Hugging Face ``Trainer`` callback;
``find_targets`` maps a model's Q/K/V/O/MLP matrices; ``spectral_callbacks.functional`` holds the
math as pure tensor functions.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Public names and the module that defines each, imported on first use so `import
# spectral_callbacks` stays cheap (the CLI's --help should not pay for Lightning).
_EXPORTS = {
    "SpectralMonitor": "spectral_callbacks.integrations.lightning",
    "SpectralTracker": "spectral_callbacks.monitor.tracker",
    "MonitorOptions": "spectral_callbacks.monitor.options",
    "ConfigurationError": "spectral_callbacks.monitor.options",
    "LRBalance": "spectral_callbacks.monitor.lr_balance",
    "balanced_param_groups": "spectral_callbacks.monitor.param_groups",
    "AlertRules": "spectral_callbacks.monitor.alerts",
    "Alert": "spectral_callbacks.monitor.alerts",
    "wait_for_figures": "spectral_callbacks.monitor.dashboards",
    "read_runs": "spectral_callbacks.offline.events",
    "find_targets": "spectral_callbacks.targets",
    "Target": "spectral_callbacks.targets",
    "format_targets": "spectral_callbacks.targets",
    "Split": "spectral_callbacks.targets",
    "TargetError": "spectral_callbacks.targets",
    "spectral_metrics": "spectral_callbacks.functional",
    "StableRank": "spectral_callbacks.metric",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'spectral_callbacks' has no attribute {name!r}")
