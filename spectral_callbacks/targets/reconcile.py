"""Names and data flow together: the rules' decisions checked against the forward's, gaps filled.

The name rules (``rules.py``) are the fast path; the roles a forward shows (``roles.py``) are the
authority. For each weight:

* both have an opinion: they must agree - the same rows of the weight in the same role - or
  ``find_targets`` raises (a rule that reads a layout wrongly would chart the wrong matrix);
  a rule giving a finer role than the forward can tell (MLA's ``Q_up``, GTA's ``KV``) is kept;
* only the forward has one (a name no rule knows, a fused layout no head count describes): the
  forward's roles and rows are used;
* only the rules have one (a layer whose forward could not be followed): the rules are used, and
  ``find_targets`` says which layers in one line.

Layers are the forward's: the blocks of each stack numbered by the order of their attention
calls, whatever the container, so a weight in a block takes that block's number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from spectral_callbacks.targets.adapted import is_tuner_layer
from spectral_callbacks.targets.errors import TargetError
from spectral_callbacks.targets.lowrank import Layout, recognise
from spectral_callbacks.targets.matching import Candidate
from spectral_callbacks.targets.quantized import dequantizer
from spectral_callbacks.targets.roles import FlowMap, FlowRole
from spectral_callbacks.targets.target import Rows, Skip

__all__ = [
    "DATA_FLOW",
    "NAMES",
    "NAMES_AND_FLOW",
    "Reconciled",
    "indices_of",
    "reconcile",
    "rows_of",
]

NAMES = "names"
DATA_FLOW = "data flow"
NAMES_AND_FLOW = "names = data flow"

# Roles a forward can tell apart; a rule's other roles (MLA, GTA, TPA, GLA groups) refine them.
_READABLE = frozenset(
    {"Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down"}
    | {"Q_cross", "K_cross", "V_cross", "O_cross"}
)


@dataclass
class Reconciled:
    """Where each candidate's roles came from, and the layers whose forward was not followed."""

    sources: dict[str, str] = field(default_factory=dict)  # parameter name -> NAMES / DATA_FLOW ...
    unfollowed: list[str] = field(default_factory=list)


def indices_of(rows: Rows, out: int) -> list[int]:
    """The row indices ``rows`` selects from an ``(out, in)`` matrix, in ``take`` order.

    >>> indices_of(Rows(start=1, stop=2, groups=3), 6)
    [1, 3, 5]
    """
    chunk = out // rows.groups
    inside = range(chunk)[rows.start : rows.stop]
    return [group * chunk + row for group in range(rows.groups) for row in inside]


def rows_of(indices: Sequence[int] | None, out: int, transposed: bool) -> Rows | None:
    """The ``Rows`` that selects exactly ``indices`` (in that order), or ``None`` if none can.

    >>> rows_of([2, 3, 6, 7], 8, False)
    Rows(start=2, stop=4, groups=2, transposed=False)
    >>> rows_of(None, 8, True)
    Rows(start=0, stop=None, groups=1, transposed=True)
    """
    if indices is None or list(indices) == list(range(out)):
        return Rows(transposed=transposed)
    indices = list(indices)
    for groups in range(1, out + 1):
        if out % groups or len(indices) % groups:
            continue
        chunk, per = out // groups, len(indices) // groups
        start = indices[0]
        if start + per > chunk:
            continue
        rows = Rows(start, start + per, groups, transposed)
        if indices_of(rows, out) == indices:
            return rows
    return None


def reconcile(
    candidates: list[Candidate], flow: FlowMap, modules: Mapping[str, nn.Module]
) -> Reconciled:
    """Check the rules against ``flow``, fill what only the forward reads, number the layers.

    Changes ``candidates`` in place: ``parts`` (roles and rows), ``skip`` and ``block``.

    Raises:
        TargetError: a rule and the forward disagree on a weight's roles or rows.
    """
    result = Reconciled(unfollowed=list(flow.unfollowed))
    by_parameter = flow.of_parameter()
    blocks = {role.block: (role.stack, role.layer) for role in flow.roles if role.block}
    for candidate in candidates:
        block = _block_of(candidate.name, blocks)
        if block is not None:
            candidate.block = block
        found = by_parameter.get(candidate.name)
        if not found:
            if candidate.parts:
                result.sources[candidate.name] = NAMES
            continue
        parameter = candidate.parameter
        composite = [r for r in found if r.composite]
        # An adapter read with its factors (a PEFT tuner layer, a verified LoRA-style layer of
        # another library: lowrank.py) is watched as its effective weight, not refused.
        layer = modules.get(composite[0].module, nn.Module()) if composite else None
        if layer is not None and not (
            is_tuner_layer(layer) or isinstance(recognise(layer), Layout)
        ):
            module = composite[0].module
            candidate.parts = []
            candidate.skip = Skip(
                f"{module} adds other weights' products to this weight's x W^T (an adapter or "
                f"custom layer), so its output is not this weight's: not watched as "
                f"{'/'.join(r.role for r in composite)}",
                warn=True,
            )
            result.sources[candidate.name] = DATA_FLOW
            continue
        transposed = found[0].transposed
        out = parameter.shape[1] if transposed else parameter.shape[0]
        owner = modules.get(candidate.name.rpartition(".")[0])
        if owner is not None and dequantizer(owner) is not None:
            out = int(owner.out_features)  # type: ignore[arg-type]  # not the packed rows
        parts = [(r.role, rows_of(r.rows, out, transposed)) for r in found]
        readable = [(role, rows) for role, rows in parts if rows is not None]
        if len(readable) != len(parts):
            if candidate.parts:
                result.sources[candidate.name] = NAMES
            continue
        if candidate.parts:
            if all(role in _READABLE for role, _ in candidate.parts):
                _check_agreement(candidate, found, out)
                result.sources[candidate.name] = NAMES_AND_FLOW
            else:
                result.sources[candidate.name] = NAMES
            continue
        if candidate.skip is not None and not candidate.skip.warn:
            continue  # left out on purpose by a rule (a router, an adapter factor)
        candidate.parts = [(role, rows) for role, rows in readable if rows is not None]
        candidate.skip = None
        result.sources[candidate.name] = DATA_FLOW
    return result


def _block_of(name: str, blocks: Mapping[str, tuple[str, int]]) -> tuple[str, int] | None:
    """(stack, layer) of the deepest recorded block whose path prefixes ``name``."""
    best: str | None = None
    for block in blocks:
        if name.startswith(block + ".") and (best is None or len(block) > len(best)):
            best = block
    return None if best is None else blocks[best]


def _check_agreement(candidate: Candidate, found: list[FlowRole], out: int) -> None:
    """Raise where the forward uses some rows in another role than the rule gives them."""
    by_rule = {role: sorted(indices_of(rows, out)) for role, rows in candidate.parts}
    for role in found:
        rows = sorted(role.rows) if role.rows is not None else list(range(out))
        same = [rule_role for rule_role, indices in by_rule.items() if indices == rows]
        if role.role in same:
            continue
        said = ", ".join(
            f"{rule_role} rows {_span(indices)}" for rule_role, indices in by_rule.items()
        )
        error = TargetError(
            f"find_targets: the name rules and the model's forward disagree on {candidate.name}: "
            f"the rules read {said}, but the forward uses rows {_span(rows)} as {role.role} "
            f"(layer {role.layer}). Say which is right with mapping={{{candidate.clean!r}: "
            "Split(...)}, or find_targets(..., builtin_rules=False) to use the forward's."
        )
        error.contradicts_names = True
        raise error


def _span(indices: Sequence[int]) -> str:
    """``0..31`` for a contiguous run, else the count and the first and last rows."""
    if not indices:
        return "none"
    if list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}..{indices[-1]}"
    return f"{len(indices)} rows {indices[0]}..{indices[-1]}"
