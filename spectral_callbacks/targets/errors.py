"""What ``find_targets`` raises and warns."""

from __future__ import annotations


class TargetError(ValueError):
    """``find_targets`` could not build a usable map: nothing found, a clash, or bad arguments.

    ``undecided`` is ``True`` where the names alone could not place the weights (none matched a
    rule, or several fell on one (layer, role)), so a forward may still read them.
    ``contradicts_names`` is ``True`` where a forward reads a weight in another role or rows than
    the name rules do: the names cannot stand in for the forward then.
    """

    undecided = False
    contradicts_names = False


class TargetWarning(UserWarning):
    """Base class of the warnings ``find_targets`` emits."""


class PartialTargetWarning(TargetWarning):
    """Something that looks like a watched matrix was not mapped, or layers have different roles."""


class AmbiguousTargetWarning(TargetWarning):
    """A parameter matched several mapping patterns, or targets come from several lists of blocks."""


class UnwatchedExpertWarning(PartialTargetWarning):
    """A mixture's routed experts are not watched: stored in a layout no rule reads (describe
    them with ``mapping=``). The frontends say it once more when training starts."""


class SharedLayerWarning(TargetWarning):
    """The forward runs one layer's weights as several layers (ALBERT-style sharing): they are
    one set of targets, numbered as the first of those calls."""
