"""The one shape of every argument check: :func:`require` and the :class:`ConfigurationError` it raises.

Below both ``options.py`` (every frontend's options) and ``alerts.py`` (``AlertRules`` checks
itself), so neither imports the other to check an argument.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Sequence
from typing import Any


class ConfigurationError(ValueError):
    """A bad argument or a setup that cannot work; the message says which and what to do.

    The Lightning frontends raise it as a subclass that is also their package's
    ``MisconfigurationException`` (what Lightning users catch); the core does not import Lightning.
    """


def require(name: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise :class:`ConfigurationError` "`name` must be <allowed>, got <value!r>" unless ``ok``.

    The one helper every argument check goes through, so every message has the same shape.

    >>> require("k", 0, False, "a positive int")
    Traceback (most recent call last):
    ...
    spectral_callbacks.monitor.checks.ConfigurationError: `k` must be a positive int, got 0
    """
    if not ok:
        raise ConfigurationError(f"`{name}` must be {allowed}, got {value!r}")


def is_int(value: Any, minimum: int) -> bool:
    """An int (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def is_real(value: Any) -> bool:
    """A real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_names(value: Any) -> bool:
    """A list or tuple of strings (a bare string is a common slip: ``roles="Q"``)."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, str) for item in value)
    )


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'every_n_steps'?)`` for the closest of ``known``, or ``""`` if none is close.

    >>> did_you_mean("every_n_step", ["every_n_steps", "k"])
    " (did you mean 'every_n_steps'?)"
    """
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
