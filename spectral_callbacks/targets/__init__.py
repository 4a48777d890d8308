"""Which matrices to watch: ``find_targets`` maps a model's weights to (layer, role) ``Target``s.

``Target.matrix()`` reads the live weight as an ``(out_features, in_features)`` matrix;
``format_targets`` prints the map and what was left out; ``Split`` and ``Skip`` describe a fused or
unwatched weight in a user ``mapping``. docs/targets.md has the architecture table.
"""

from spectral_callbacks.targets.errors import (
    AmbiguousTargetWarning,
    PartialTargetWarning,
    SharedLayerWarning,
    TargetError,
    TargetWarning,
    UnwatchedExpertWarning,
)
from spectral_callbacks.targets.find import find_targets
from spectral_callbacks.targets.matching import clean_name
from spectral_callbacks.targets.rules import BUILTIN_RULES, Context, Skip, Split
from spectral_callbacks.targets.target import (
    ROLE_ORDER,
    Rows,
    Skipped,
    Target,
    TargetList,
    format_targets,
    role_sort_key,
)

__all__ = [
    "BUILTIN_RULES",
    "ROLE_ORDER",
    "AmbiguousTargetWarning",
    "Context",
    "PartialTargetWarning",
    "Rows",
    "SharedLayerWarning",
    "Skip",
    "Skipped",
    "Split",
    "Target",
    "TargetError",
    "TargetList",
    "TargetWarning",
    "UnwatchedExpertWarning",
    "clean_name",
    "find_targets",
    "format_targets",
    "role_sort_key",
]
