"""The logged-name contract: how a (metric, layer, role) becomes a TensorBoard tag and back.

The callback writes these names and the command line parses them, so both import this module and
neither spells a tag by hand (see docs/logged-names.md).

Tags:

* ``spectral_<metric>/L<layer>/<role>`` - one chart per (layer, role), e.g.
  ``spectral_stable_rank/L00/Q``. The layer index is zero-padded to at least two digits so charts
  sort by depth.
* ``spectral_<metric>/mean/<role>`` - the mean over layers of one role.
* ``spectral_monitor/<name>`` - the callback's own health (main-thread ms, SVD ms, pending, skipped;
  ``sent_bytes`` with sharded weights)
  and ``spectral_monitor/num_layers``, which lets readers compute relative depth.
* ``spectral_monitor/reference_step/L<layer>/<role>`` - the step of the snapshot whose stable rank
  is that matrix's compression reference (0 normally; later for a matrix that starts at zero).

Example::

    >>> scalar_tag("stable_rank", 7, "MLP_down")
    'spectral_stable_rank/L07/MLP_down'
    >>> parse_tag("spectral_alpha/L12/Q")
    SpectralTag(metric='alpha', layer=12, role='Q')
    >>> parse_tag("spectral_alpha/mean/Q")
    SpectralTag(metric='alpha', layer=None, role='Q')
    >>> parse_tag("train/loss") is None
    True
    >>> parse_tag(reference_step_tag(3, "O"))
    SpectralTag(metric='reference_step', layer=3, role='O')
"""

from __future__ import annotations

import re
from typing import NamedTuple

METRIC_PREFIX = "spectral_"
MONITOR_SECTION = "spectral_monitor"
MEAN = "mean"
NUM_LAYERS_TAG = f"{MONITOR_SECTION}/num_layers"
#: Read back as the per-matrix metric ``reference_step`` (see :func:`reference_step_tag`).
REFERENCE_STEP = "reference_step"

# Canonical roles of DESIGN.md section 3, in chart order. Variants add documented extra roles.
ROLES: tuple[str, ...] = ("Q", "K", "V", "O", "MLP_up", "MLP_down")

# The columns of tidy rows (the callback's figure history, export, charts), in this order.
TIDY_COLUMNS: tuple[str, ...] = (
    "run",
    "step",
    "metric",
    "layer",
    "depth",
    "role",
    "value",
    "wall_time",
)

_TAG = re.compile(
    r"^spectral_(?P<metric>[a-z0-9_]+)/(?:L(?P<layer>\d+)|(?P<mean>mean))/(?P<role>[A-Za-z0-9_]+)$"
)

_REFERENCE_STEP_TAG = re.compile(
    rf"^{MONITOR_SECTION}/{REFERENCE_STEP}/L(?P<layer>\d+)/(?P<role>[A-Za-z0-9_]+)$"
)


class SpectralTag(NamedTuple):
    """A parsed spectral tag; ``layer`` is ``None`` for the mean over layers."""

    metric: str
    layer: int | None
    role: str


def layer_label(layer: int, num_layers: int | None = None) -> str:
    """``L`` plus the layer index, zero-padded to the digits of the deepest layer (at least two).

    >>> layer_label(3), layer_label(3, num_layers=120)
    ('L03', 'L003')
    """
    if layer < 0:
        raise ValueError(f"`layer` must be a non-negative int, got {layer}")
    width = max(2, len(str(num_layers - 1))) if num_layers else 2
    return f"L{layer:0{width}d}"


def scalar_tag(metric: str, layer: int | None, role: str, num_layers: int | None = None) -> str:
    """The tag of one metric of one (layer, role); ``layer=None`` gives the mean over layers."""
    where = MEAN if layer is None else layer_label(layer, num_layers)
    return f"{METRIC_PREFIX}{metric}/{where}/{role}"


def monitor_tag(name: str) -> str:
    """The tag of one of the callback's health scalars, e.g. ``spectral_monitor/svd_ms``."""
    return f"{MONITOR_SECTION}/{name}"


def reference_step_tag(layer: int, role: str, num_layers: int | None = None) -> str:
    """The tag of the step whose stable rank is the compression reference of one (layer, role).

    >>> reference_step_tag(0, "O")
    'spectral_monitor/reference_step/L00/O'
    """
    return f"{MONITOR_SECTION}/{REFERENCE_STEP}/{layer_label(layer, num_layers)}/{role}"


def parse_tag(tag: str) -> SpectralTag | None:
    """The (metric, layer, role) of a spectral tag, or ``None`` for any other tag.

    A reference-step tag reads as the per-matrix metric ``reference_step``.
    """
    reference = _REFERENCE_STEP_TAG.match(tag)
    if reference is not None:
        return SpectralTag(REFERENCE_STEP, int(reference["layer"]), reference["role"])
    match = _TAG.match(tag)
    if match is None or match["metric"] == "monitor":
        return None
    layer = None if match["mean"] else int(match["layer"])
    return SpectralTag(match["metric"], layer, match["role"])


def relative_depth(layer: int, num_layers: int) -> float:
    """Relative depth ``i / (L - 1)`` of layer ``i`` in an ``L``-layer model (0 for a 1-layer model).

    >>> relative_depth(0, 8), relative_depth(7, 8), relative_depth(0, 1)
    (0.0, 1.0, 0.0)
    """
    return layer / (num_layers - 1) if num_layers > 1 else 0.0
