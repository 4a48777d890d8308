"""``find_targets``: map a model's weights to (layer, role) targets, say what was left out and why.

Steps:

1. Every 2-D parameter gets a decision: the user's ``mapping`` first, then the built-in rules of
   ``rules.py``, matched on the name with wrapper segments removed (``torch.compile``'s
   ``_orig_mod.``, DDP's leading ``module.``, FSDP/checkpoint wrappers, Lightning's
   ``_forward_module.``), so wrapped and bare models map alike.
2. Its layer is its index in the outermost ``ModuleList``/``Sequential`` on its path before the
   part the rule matched (so the ``0`` of GLA's ``kv_b_proj.0`` is a group, not a layer), counting
   only the entries of that list that hold targets; several lists (encoder and decoder) are
   numbered one after the other, with a warning.
3. ``include``/``exclude``/``roles`` filter the result; what they drop is listed, not warned about.
4. Anything that looks like a target but was not mapped is warned about (``PartialTargetWarning``);
   finding nothing raises ``TargetError`` with the candidate names and how to pass ``mapping=``.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spectral_callbacks.targets.rules import (
    BUILTIN_RULES,
    Context,
    Decision,
    Pattern,
    Skip,
    Split,
    is_transposed,
    match_length,
)
from spectral_callbacks.targets.target import Rows, Skipped, Target, TargetList, role_sort_key


class TargetError(ValueError):
    """``find_targets`` could not build a usable map: nothing found, a clash, or bad arguments."""


class TargetWarning(UserWarning):
    """Base class of the warnings ``find_targets`` emits."""


class PartialTargetWarning(TargetWarning):
    """Something that looks like a watched matrix was not mapped, or layers have different roles."""


class AmbiguousTargetWarning(TargetWarning):
    """A parameter matched several mapping patterns, or targets come from several lists of blocks."""


UserDecision = str | Split | Skip | None
MappingValue = UserDecision | Callable[[str, torch.Tensor], UserDecision]
UserMapping = Mapping[Pattern, MappingValue] | Callable[[str, torch.Tensor], UserDecision]
Patterns = Pattern | Iterable[Pattern] | None

# Module names that wrappers insert into parameter names; the rules never see them.
_WRAPPER_SEGMENTS = frozenset(
    {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)
_LIST_TYPES = (nn.ModuleList, nn.Sequential)
_HEAD_NAMES = frozenset({"lm_head", "head", "classifier", "score", "embed_out", "output"})
_MAX_LISTED = 30


def clean_name(name: str) -> str:
    """``name`` without wrapper segments (leading DDP ``module.``, ``_orig_mod.``, ...).

    >>> clean_name("module._orig_mod.transformer.h.0.attn.c_attn.weight")
    'transformer.h.0.attn.c_attn.weight'
    """
    segments = name.split(".")
    while len(segments) > 1 and segments[0] == "module":
        segments = segments[1:]
    return ".".join(s for s in segments if s not in _WRAPPER_SEGMENTS)


@dataclass
class _Candidate:
    """A 2-D parameter with its decision, before layers are numbered and filters applied."""

    name: str  # as in the model given
    clean: str
    parameter: torch.Tensor
    parts: list[tuple[str, Rows]]
    skip: Skip | None
    block: tuple[str, int] | None  # (list path, index in list)


def _as_patterns(value: Patterns, argument: str) -> list[Pattern]:
    if value is None:
        return []
    if isinstance(value, (str, re.Pattern)):
        items: list[object] = [value]
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        items = [value]
    for item in items:
        if not isinstance(item, (str, re.Pattern)):
            raise TargetError(
                f"`{argument}` must be a name pattern (fnmatch string or compiled regex) or a "
                f"list of them, got {item!r}"
            )
    return items  # type: ignore[return-value]


def _matches(patterns: list[Pattern], clean: str) -> Pattern | None:
    """The first pattern matching the parameter name, or the module name for a ``.weight``."""
    module = clean[: -len(".weight")] if clean.endswith(".weight") else None
    for pattern in patterns:
        if match_length(pattern, clean) is not None:
            return pattern
        if module and match_length(pattern, module) is not None:
            return pattern
    return None


def _user_decision(mapping: UserMapping, ctx: Context, name: str) -> tuple[Decision, int] | None:
    """The mapping's decision and how many trailing segments it matched, or None (no opinion)."""
    if callable(mapping) and not isinstance(mapping, Mapping):
        decision = mapping(name, ctx.parameter)
        return None if decision is None else (decision, 1)
    module = ctx.name[: -len(".weight")] if ctx.name.endswith(".weight") else None
    found: list[tuple[Pattern, Decision, int]] = []
    for pattern, value in mapping.items():
        length = match_length(pattern, ctx.name)
        if length is None and module:
            length = match_length(pattern, module)
            length = None if length is None else length + 1
        if length is None:
            continue
        decision = value(name, ctx.parameter) if callable(value) else value
        if decision is None and callable(value):
            continue  # a callable value returning None has no opinion on this parameter
        found.append(
            (pattern, Skip("mapped to None by mapping=") if decision is None else decision, length)
        )
    if not found:
        return None
    if len({repr(decision) for _, decision, _ in found}) > 1:
        warnings.warn(
            f"{name} matches several mapping= patterns with different roles: "
            + ", ".join(f"{p!r} -> {d!r}" for p, d, _ in found)
            + f"; using the first ({found[0][0]!r}). Make the patterns disjoint to silence this.",
            AmbiguousTargetWarning,
            stacklevel=4,
        )
    return found[0][1], found[0][2]


def _builtin_decision(ctx: Context) -> tuple[Decision, int] | None:
    for pattern, rule in BUILTIN_RULES:
        length = match_length(pattern, ctx.name)
        if length is not None:
            return (rule(ctx) if callable(rule) else rule), length
    return None


def _parts(decision: Decision, ctx: Context, name: str, from_user: bool) -> list[tuple[str, Rows]]:
    transposed = is_transposed(ctx.modules[0])
    if isinstance(decision, str):
        decision = Split((decision,), transposed=transposed)
    if not isinstance(decision, Split):
        raise TargetError(
            f"mapping= for {name} must give a role string, Split(...), Skip(...) or None, "
            f"got {decision!r}"
        )
    if decision.transposed is not None:
        transposed = decision.transposed
    rows, cols = ctx.parameter.shape
    shape = (cols, rows) if transposed else (rows, cols)
    try:
        return decision.parts(name, shape, transposed)
    except ValueError as error:
        if from_user:
            raise TargetError(f"mapping= gave an unusable Split: {error}") from error
        raise


def _block(name: str, matched: int, modules: Mapping[str, nn.Module]) -> tuple[str, int] | None:
    """(list path, index) of the outermost ModuleList/Sequential entry on the path before the match."""
    segments = name.split(".")
    clean_matched = min(matched, len(clean_name(name).split(".")))
    for i in range(len(segments) - clean_matched):
        if segments[i].isdigit():
            path = ".".join(segments[:i])
            if isinstance(modules.get(path), _LIST_TYPES):
                return path, int(segments[i])
    return None


def _reason_not_matched(ctx: Context, inside_blocks: bool) -> Skip:
    segments = ctx.name.split(".")
    if isinstance(ctx.modules[0], nn.Embedding) or any(
        "embed" in s or s in ("wte", "wpe") for s in segments
    ):
        return Skip("embedding")
    if set(segments[:-1]) & _HEAD_NAMES and not inside_blocks:
        return Skip("output head")
    if inside_blocks:
        return Skip("inside a block but no rule matched", warn=True)
    return Skip("outside the blocks; no rule matched")


def _candidate_error(candidates: list[_Candidate], filtered: bool) -> TargetError:
    names = [f"  {c.name} {tuple(c.parameter.shape)}" for c in candidates[:_MAX_LISTED]]
    if len(candidates) > _MAX_LISTED:
        names.append(f"  ... and {len(candidates) - _MAX_LISTED} more")
    if filtered:
        head = "find_targets: every target was removed by roles=/include=/exclude=."
    else:
        head = "find_targets: no weight matched a known Q/K/V/O/MLP name."
    return TargetError(
        f"{head} 2-D weights in the model:\n"
        + ("\n".join(names) if names else "  (none)")
        + "\nTell find_targets their roles with mapping=, e.g. "
        "find_targets(model, mapping={'*.attn.wq': 'Q', '*.attn.wkv': Split(('K', 'V')), "
        "'*.ffn.w_in': 'MLP_up', '*.ffn.w_out': 'MLP_down'}) (see docs/targets.md)."
    )


def find_targets(
    model: nn.Module,
    *,
    roles: str | Iterable[str] | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    mapping: UserMapping | None = None,
    builtin_rules: bool = True,
) -> TargetList:
    """The Q/K/V/O/MLP matrices of ``model``, one ``Target`` per (layer, role), in layer order.

    Fused projections are split (GPT-2 ``c_attn``, GPT-NeoX ``query_key_value`` per head,
    ``nn.MultiheadAttention.in_proj_weight``, timm ``qkv``, MLA ``kv_a_proj_with_mqa`` and
    ``kv_b_proj``); wrapped models (``torch.compile``, DDP, a LightningModule holding the network)
    map like the bare network. docs/targets.md lists architectures and roles.

    Args:
        model: the network or any module that holds it.
        roles: keep only these roles (fnmatch patterns such as ``"K_g*"`` allowed); default
            ``None`` keeps all.
        include: keep only parameters matching one of these patterns; default ``None`` keeps all.
        exclude: drop parameters matching one of these patterns; default ``None``.
            Patterns are fnmatch strings matched against the parameter name, its module name or
            any dotted suffix of them (``"h.0.*"``, ``"*.attn.*"``, ``"c_attn"``), or compiled
            regular expressions searched in the parameter name.
        mapping: overrides and extends the built-in rules: ``{pattern: value}`` where value is a
            role string, ``Split(...)`` for a fused parameter, ``None`` to leave it out, or a
            callable ``(parameter_name, parameter) -> role | Split | Skip | None`` (None: no
            opinion); or one such callable for every parameter. Default ``None``.
        builtin_rules: apply the built-in rules after ``mapping``; default ``True``.

    Returns:
        A ``TargetList`` (a ``list[Target]``) sorted by (layer, role); ``.skipped`` lists the
        weights that are not watched and why.

    Raises:
        TargetError: (a ``ValueError``) no target found (the message lists the 2-D weights and
            shows how to pass ``mapping=``), two targets with the same layer and role, an
            unusable ``Split``, or a bad argument.

    Warns:
        PartialTargetWarning: a weight inside the blocks matched no rule, a fused weight had an
            unknown layout, or some layers lack roles that others have.
        AmbiguousTargetWarning: a weight matched several ``mapping`` patterns, or targets come
            from several lists of blocks (numbered one after the other).

    Example::

        >>> import torch
        >>> layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
        >>> model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        >>> targets = find_targets(model, roles=["Q", "K", "MLP_down"])
        >>> [(t.layer, t.role, t.shape) for t in targets]
        [(0, 'Q', (8, 8)), (0, 'K', (8, 8)), (0, 'MLP_down', (8, 16)), (1, 'Q', (8, 8)), (1, 'K', (8, 8)), (1, 'MLP_down', (8, 16))]
        >>> targets[0].name
        'layers.0.self_attn.in_proj_weight[Q]'
    """
    if not isinstance(model, nn.Module):
        raise TargetError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(roles, str):
        roles = [roles]
    role_patterns = None if roles is None else list(roles)
    if role_patterns is not None and not all(isinstance(r, str) for r in role_patterns):
        raise TargetError(f"`roles` must be role names like 'Q' or 'MLP_up', got {roles!r}")
    includes, excludes = _as_patterns(include, "include"), _as_patterns(exclude, "exclude")
    if mapping is not None and not (isinstance(mapping, Mapping) or callable(mapping)):
        raise TargetError(
            f"`mapping` must be a dict {{pattern: role | Split | None}} or a callable, got "
            f"{type(mapping).__name__}"
        )

    modules = dict(model.named_modules(remove_duplicate=False))
    candidates, skipped, low_dim = [], [], 0
    first_name: dict[int, str] = {}
    position: dict[str, int] = {}  # parameter order, so the summary lists skipped weights in it
    for name, parameter in model.named_parameters(remove_duplicate=False):
        position[name] = len(position)
        if parameter.dim() < 2:
            low_dim += id(parameter) not in first_name
            first_name.setdefault(id(parameter), name)
            continue
        if id(parameter) in first_name:  # tied weights (GPT-2's lm_head is wte) are watched once
            tied = Skipped(name, tuple(parameter.shape), f"tied to {first_name[id(parameter)]}")
            skipped.append(tied)
            continue
        first_name[id(parameter)] = name
        if parameter.dim() > 2:
            what = "fused MoE experts" if "experts" in name else "not a matrix"
            reason = f"{parameter.dim()}-D ({what}): only 2-D weights are watched"
            skipped.append(Skipped(name, tuple(parameter.shape), reason))
            continue
        module_path = name.rpartition(".")[0]
        owners = []
        path = module_path
        while True:
            owners.append(modules[path])
            if not path:
                break
            path = path.rpartition(".")[0]
        ctx = Context(clean_name(name), parameter, tuple(owners))
        found = _user_decision(mapping, ctx, name) if mapping is not None else None
        from_user = found is not None
        if found is None and builtin_rules:
            found = _builtin_decision(ctx)
        if found is None:
            candidates.append(
                _Candidate(name, ctx.name, parameter, [], None, _block(name, 1, modules))
            )
            continue
        decision, matched = found
        if isinstance(decision, Skip):
            candidates.append(_Candidate(name, ctx.name, parameter, [], decision, None))
            continue
        parts = _parts(decision, ctx, name, from_user)
        candidates.append(
            _Candidate(name, ctx.name, parameter, parts, None, _block(name, matched, modules))
        )

    blocks_with_targets = {c.block for c in candidates if c.parts and c.block}
    chosen: list[_Candidate] = []
    unmapped: list[str] = []  # look like targets but could not be mapped: warned about below
    for candidate in candidates:
        shape = tuple(candidate.parameter.shape)
        skip = candidate.skip
        if not candidate.parts and skip is None:
            owner = (modules[candidate.name.rpartition(".")[0]],)
            inside = candidate.block in blocks_with_targets
            skip = _reason_not_matched(Context(candidate.clean, candidate.parameter, owner), inside)
        if (
            skip is not None and not skip.warn
        ):  # an embedding stays "embedding" whatever the filters
            skipped.append(Skipped(candidate.name, shape, skip.reason))
        elif _matches(excludes, candidate.clean) is not None:
            skipped.append(Skipped(candidate.name, shape, "excluded by exclude="))
        elif includes and _matches(includes, candidate.clean) is None:
            skipped.append(Skipped(candidate.name, shape, "not matched by include="))
        elif skip is not None:
            skipped.append(Skipped(candidate.name, shape, skip.reason))
            unmapped.append(f"{candidate.name} {shape}: {skip.reason}")
        else:
            chosen.append(candidate)

    if unmapped:
        warnings.warn(
            f"{len(unmapped)} weights that look like targets are not watched:\n  "
            + "\n  ".join(unmapped[:_MAX_LISTED])
            + "\nGive them roles with mapping={pattern: role or Split(...)}, or silence this "
            "with exclude=.",
            PartialTargetWarning,
            stacklevel=2,
        )
    kept = _number_layers(candidates, chosen)

    skipped.sort(key=lambda s: position[s.parameter_name])
    _warn_missing_roles(kept)
    if not kept:
        raise _candidate_error([c for c in candidates], filtered=any(c.parts for c in candidates))
    if role_patterns is not None:
        kept = _filter_roles(kept, role_patterns, skipped)
    _check_unique(kept)
    kept.sort(key=lambda t: (t.layer, role_sort_key(t.role), t.name))
    return TargetList(kept, skipped, low_dim)


def _number_layers(candidates: list[_Candidate], chosen: list[_Candidate]) -> list[Target]:
    """Targets of the ``chosen`` candidates with layer numbers.

    A layer is the rank of a block among the entries of its list that hold any target before
    include/exclude (so ``include="h.3.*"`` still reports layer 3 of L); lists left with no
    chosen target do not count (so ``include="encoder.*"`` numbers the encoder alone).
    """
    used: dict[str, set[int]] = defaultdict(set)
    for c in candidates:
        if c.parts:
            key, index = c.block if c.block else ("", 0)
            used[key].add(index)
    order = list(dict.fromkeys(c.block[0] if c.block else "" for c in chosen))
    if len(order) > 1:
        warnings.warn(
            f"targets come from {len(order)} lists of blocks ("
            + ", ".join(repr(k or "<outside any list>") for k in order)
            + "); their layers are numbered one list after the other. Pass include= to watch one.",
            AmbiguousTargetWarning,
            stacklevel=3,
        )
    offset, layer_of = 0, {}
    for key in order:
        for rank, index in enumerate(sorted(used[key])):
            layer_of[(key, index)] = offset + rank
        offset += len(used[key])
    targets: list[Target] = []
    for c in chosen:
        key, index = c.block if c.block else ("", 0)
        rows0 = c.parts[0][1]
        whole = rows0.groups == 1 and rows0.start == 0 and rows0.stop in (None, _out(c, rows0))
        fused = len(c.parts) > 1 or not whole
        targets += [
            Target.from_parameter(
                c.name,
                c.parameter,
                role=role,
                layer=layer_of[(key, index)],
                num_layers=offset,
                rows=rows,
                fused=fused,
            )
            for role, rows in c.parts
        ]
    return targets


def _out(candidate: _Candidate, rows: Rows) -> int:
    return candidate.parameter.shape[1 if rows.transposed else 0]


def _warn_missing_roles(targets: list[Target]) -> None:
    by_layer: dict[int, set[str]] = defaultdict(set)
    for t in targets:
        by_layer[t.layer].add(t.role)
    every = set().union(*by_layer.values()) if by_layer else set()
    missing = {layer: every - found for layer, found in by_layer.items() if every - found}
    if missing:
        text = "; ".join(
            f"layer {layer}: {', '.join(sorted(roles, key=role_sort_key))}"
            for layer, roles in sorted(missing.items())
        )
        warnings.warn(
            f"some layers lack roles that other layers have ({text}); their charts will have "
            "gaps. Check format_targets(...) and pass mapping= if a weight was not recognised.",
            PartialTargetWarning,
            stacklevel=3,
        )


def _filter_roles(
    targets: list[Target], patterns: list[str], skipped: list[Skipped]
) -> list[Target]:
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(t.role, p) for t in targets)]
    found = sorted({t.role for t in targets}, key=role_sort_key)
    if len(unused) == len(patterns):
        raise TargetError(
            f"`roles`={patterns!r} matched no target; roles found in this model: {', '.join(found)}"
        )
    if unused:
        warnings.warn(
            f"`roles` {unused!r} matched no target (roles found: {', '.join(found)})",
            PartialTargetWarning,
            stacklevel=3,
        )
    kept = []
    for t in targets:
        if any(fnmatch.fnmatchcase(t.role, p) for p in patterns):
            kept.append(t)
        else:
            skipped.append(Skipped(t.name, t.shape, f"role {t.role} not in roles="))
    return kept


def _check_unique(targets: list[Target]) -> None:
    seen: dict[tuple[int, str], str] = {}
    clashes = []
    for t in targets:
        key = (t.layer, t.role)
        if key in seen:
            clashes.append(f"  layer {t.layer} role {t.role}: {seen[key]} and {t.name}")
        seen[key] = t.name
    if clashes:
        raise TargetError(
            "find_targets: several weights map to the same (layer, role), so their charts would "
            "overwrite each other:\n"
            + "\n".join(clashes[:_MAX_LISTED])
            + "\nGive them distinct roles with mapping= or drop some with include=/exclude=."
        )
