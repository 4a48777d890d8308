"""``find_targets``: map a model's weights to (layer, role) targets, say what was left out and why.

Steps:

1. Every 2-D parameter gets a decision (``matching.py``): the user's ``mapping`` first, then the
   built-in rules of ``rules.py``, matched on the name with wrapper segments removed (``torch.compile``'s
   ``_orig_mod.``, DDP's leading ``module.``, FSDP/checkpoint wrappers, Lightning's
   ``_forward_module.``), so wrapped and bare models map alike.
2. Its layer is its index in the outermost ``ModuleList``/``Sequential`` on its path before the
   part the rule matched (so the ``0`` of GLA's ``kv_b_proj.0`` is a group, not a layer; of a
   ``mapping`` pattern only the part it spells out, so ``net.*`` keeps ``net``'s layers), counting
   only the entries of that list that hold targets. Several lists (encoder and decoder, text and
   vision towers) are several stacks: each target carries its stack's name (``enc``, ``dec``,
   ``text``, ``vision``, else the list's own name) and is numbered within it.
3. ``include``/``exclude``/``roles`` filter the result; what they drop is listed, not warned about.
4. Anything that looks like a target but was not mapped is warned about (``PartialTargetWarning``);
   finding nothing raises ``TargetError`` with the candidate names and how to pass ``mapping=``.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from spectral_callbacks.messages import count, rank_zero_warn
from spectral_callbacks.targets.adapted import adapt
from spectral_callbacks.targets.errors import (
    AmbiguousTargetWarning,
    PartialTargetWarning,
    SharedLayerWarning,
    TargetError,
    TargetWarning,
    UnwatchedExpertWarning,
)
from spectral_callbacks.targets.experts import ExpertTarget, is_routed_expert
from spectral_callbacks.targets.lowrank import adapt_lowrank, lowrank_role
from spectral_callbacks.targets.matching import (
    Candidate,
    Patterns,
    UserMapping,
    as_patterns,
    decide,
    matches,
    reason_not_matched,
)
from spectral_callbacks.targets.quantized import watch_quantized
from spectral_callbacks.targets.reconcile import NAMES, Reconciled, reconcile
from spectral_callbacks.targets.roles import FlowMap, discover_roles
from spectral_callbacks.targets.rules import Context, Skip
from spectral_callbacks.targets.target import Rows, Skipped, Target, TargetList, role_sort_key
from spectral_callbacks.targets.verify import computes_weight

__all__ = [
    "AmbiguousTargetWarning",
    "PartialTargetWarning",
    "TargetError",
    "TargetWarning",
    "UnwatchedExpertWarning",
    "find_targets",
]

_MAX_LISTED = 30  # names listed in an error or warning before "... and N more"


def _candidate_error(candidates: list[Candidate], filtered: bool) -> TargetError:
    names = [f"  {c.name} {tuple(c.parameter.shape)}" for c in candidates[:_MAX_LISTED]]
    if len(candidates) > _MAX_LISTED:
        names.append(f"  ... and {len(candidates) - _MAX_LISTED} more")
    if filtered:
        head = "find_targets: every target was removed by roles=/include=/exclude=."
    else:
        head = "find_targets: no weight matched a known Q/K/V/O/MLP name."
    error = TargetError(
        f"{head} 2-D weights in the model:\n"
        + ("\n".join(names) if names else "  (none)")
        + "\nTell find_targets their roles with mapping=, e.g. "
        "find_targets(model, mapping={'*.attn.wq': 'Q', '*.attn.wkv': Split(('K', 'V')), "
        "'*.ffn.w_in': 'MLP_up', '*.ffn.w_out': 'MLP_down'}) (see docs/targets.md)."
    )
    error.undecided = not filtered
    return error


def find_targets(
    model: nn.Module,
    *,
    roles: str | Iterable[str] | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    mapping: UserMapping | None = None,
    builtin_rules: bool = True,
    example_input: Any = None,
    flow: FlowMap | None = None,
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
        example_input: a batch for one forward of ``model`` (a tensor, a tuple of arguments or a
            dict of keyword arguments) from which roles, fused layouts and layers are read
            (``targets/roles.py``); the pass runs without gradients and leaves the random state
            as it was. Default ``None``: the rules alone.
        flow: roles already read from a forward (``discover_roles``, or the recording of a
            training forward) instead of ``example_input``; default ``None``.

    Returns:
        A ``TargetList`` (a ``list[Target]``) sorted by (layer, role); ``.skipped`` lists the
        weights that are not watched and why, ``.sources`` where each target's role came from
        (``"names"``, ``"data flow"``, or ``"names = data flow"`` where both agree).

    Raises:
        TargetError: (a ``ValueError``) no target found (the message lists the 2-D weights and
            shows how to pass ``mapping=``), two targets with the same layer and role, an
            unusable ``Split``, a rule that disagrees with the forward, or a bad argument.

    Warns:
        PartialTargetWarning: a weight inside the blocks matched no rule, a fused weight had an
            unknown layout, some layers lack roles that others have, a module does not compute
            ``x W^T`` for the weight it owns (refused), or layers whose forward could not be
            followed (their roles from the names alone).
        AmbiguousTargetWarning: a weight matched several ``mapping`` patterns.
        SharedLayerWarning: the forward runs one layer's weights as several layers (ALBERT's
            shared layer): they are watched once, as the layer of their first call.
        UnwatchedExpertWarning: a mixture's routed experts in a layout no rule reads (also
            listed in ``.unwatched_experts``; the frontends warn again when training starts).

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
    includes, excludes = as_patterns(include, "include"), as_patterns(exclude, "exclude")
    if mapping is not None and not (isinstance(mapping, Mapping) or callable(mapping)):
        raise TargetError(
            f"`mapping` must be a dict {{pattern: role | Split | None}} or a callable, got "
            f"{type(mapping).__name__}"
        )

    modules = dict(model.named_modules(remove_duplicate=False))
    candidates, skipped, low_dim, position = decide(model, modules, mapping, builtin_rules)
    if flow is None and example_input is not None:
        flow = discover_roles(model, example_input)
    reconciled = reconcile(candidates, flow, modules) if flow is not None else Reconciled()

    blocks_with_targets = {c.block for c in candidates if c.parts and c.block}
    vocab_sizes = frozenset(
        m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)
    )
    chosen: list[Candidate] = []
    unmapped: list[str] = []  # look like targets but could not be mapped: warned about below
    unread: list[str] = []  # of those, the ones inside the blocks (a forward may read them)
    unwatched_experts: list[str] = []  # routed experts no rule reads: warned about on their own
    for candidate in candidates:
        shape = tuple(candidate.parameter.shape)
        skip = candidate.skip
        if not candidate.parts and skip is None:
            owner = (modules[candidate.name.rpartition(".")[0]],)
            inside = candidate.block in blocks_with_targets
            context = Context(candidate.clean, candidate.parameter, owner)
            skip = reason_not_matched(context, inside, vocab_sizes)
        # A deliberate skip keeps its own reason ("embedding") whatever include/exclude say.
        if skip is not None and not skip.warn:
            skipped.append(Skipped(candidate.name, shape, skip.reason))
        elif matches(excludes, candidate.clean) is not None:
            skipped.append(Skipped(candidate.name, shape, "excluded by exclude="))
        elif includes and matches(includes, candidate.clean) is None:
            skipped.append(Skipped(candidate.name, shape, "not matched by include="))
        elif skip is not None:
            skipped.append(Skipped(candidate.name, shape, skip.reason))
            experts = is_routed_expert(candidate.clean)
            (unwatched_experts if experts else unmapped).append(
                f"{candidate.name} {shape}: {skip.reason}"
            )
            if not experts and candidate.block in blocks_with_targets:
                unread.append(candidate.name)
        elif (refused := _not_its_matrix(candidate, modules)) is not None:
            skipped.append(Skipped(candidate.name, shape, refused.reason))
            unmapped.append(f"{candidate.name} {shape}: {refused.reason}")
            unread.append(candidate.name)
        else:
            chosen.append(candidate)

    if unwatched_experts:
        rank_zero_warn(
            unwatched_experts_message(unwatched_experts), category=UnwatchedExpertWarning
        )
    # A tuner layer's base weight becomes an adapted target (its effective weight, its update),
    # as does a verified LoRA-style layer's of another library (targets/lowrank.py); a quantized
    # layer's weight a dequantized one (targets/quantized.py).
    kept = [
        watch_quantized(adapt_lowrank(adapt(target, modules), modules), modules)
        for target in _number_layers(candidates, chosen)
    ]

    skipped.sort(key=lambda s: position[s.parameter_name])
    _warn_missing_roles(kept)
    if not kept:
        raise _candidate_error(candidates, filtered=any(c.parts for c in candidates))
    if unmapped:  # (when nothing is kept, the error above lists every weight)
        what = (
            "weight that looks like a target is"
            if len(unmapped) == 1
            else "weights that look like targets are"
        )
        rank_zero_warn(
            f"{len(unmapped)} {what} not watched:\n  "
            + "\n  ".join(unmapped[:_MAX_LISTED])
            + "\nGive them roles with mapping={pattern: role or Split(...)}, or silence this "
            "with exclude=.",
            category=PartialTargetWarning,
        )
    if role_patterns is not None:
        kept = _filter_roles(kept, role_patterns, skipped)
    _check_unique(kept)
    if flow is not None:
        _warn_unfollowed(kept, reconciled, flow)
    stack_order = {stack: i for i, stack in enumerate(dict.fromkeys(t.stack for t in kept))}
    kept.sort(
        key=lambda t: (stack_order[t.stack], t.layer, role_sort_key(t.role), t.expert or 0, t.name)
    )
    found = TargetList(kept, skipped, low_dim, unwatched_experts)
    found.sources = {t.name: reconciled.sources.get(t.parameter_name, NAMES) for t in kept}
    found.unread = unread
    if flow is not None:
        found.heads_read = {
            (role.parameter, role.role): role.heads
            for role in flow.roles
            if role.role.removesuffix("_cross") in ("Q", "K", "V")
        }
    if flow is not None and flow.shared:
        rank_zero_warn("; ".join(flow.shared), category=SharedLayerWarning)
    return found


def _not_its_matrix(candidate: Candidate, modules: Mapping[str, nn.Module]) -> Skip | None:
    """A skip when the weight's module does not compute ``x W^T`` for it (``verify.py``)."""
    if candidate.experts or not candidate.parts:
        return None
    path = candidate.name.rpartition(".")[0]
    owner = modules.get(path)
    if owner is None:
        return None
    if lowrank_role(owner, candidate.parameter) is not None:
        return None  # the base of a LoRA-style layer: verified with its factors (lowrank.py)
    reason = computes_weight(owner, candidate.parameter, candidate.parts[0][1].transposed)
    if reason is None:
        return None
    roles = "/".join(role for role, _ in candidate.parts)
    return Skip(f"{path or 'the model'} ({type(owner).__name__}): {reason}; {roles} not watched")


def _warn_unfollowed(targets: list[Target], reconciled: Reconciled, flow: FlowMap) -> None:
    """One line naming the layers whose roles came from the names alone, and why."""
    by_flow = {t.name for t in targets if reconciled.sources.get(t.parameter_name, NAMES) != NAMES}
    followed = {(t.stack, t.layer) for t in targets if t.name in by_flow}
    by_names = sorted({(t.stack, t.layer) for t in targets} - followed)
    if not by_names and not reconciled.unfollowed:
        return
    layers = ", ".join(f"{stack + ' ' if stack else ''}layer {layer}" for stack, layer in by_names)
    why = "; ".join(reconciled.unfollowed[:3])
    rank_zero_warn(
        f"the forward could not be followed for {layers or 'some attention calls'} (a compiled "
        f"graph or a custom kernel?){': ' + why if why else ''}; their roles come from the "
        "names alone",
        category=PartialTargetWarning,
    )


def unwatched_experts_message(unwatched: list[str]) -> str:
    """The warning that routed experts (``name shape: reason`` each) are not watched."""
    listed = unwatched[:_MAX_LISTED] + (
        [f"... and {len(unwatched) - _MAX_LISTED} more"] if len(unwatched) > _MAX_LISTED else []
    )
    return (
        f"MoE experts are not watched (no spectra for them), {count(len(unwatched), 'weight')}:\n  "
        + "\n  ".join(listed)
        + "\nDescribe them with mapping={pattern: role or Split(...)}, or silence this with "
        "exclude=."
    )


# The words that name a stack, first match wins: two towers, then encoder and decoder.
_STACK_WORDS = (
    ("text", "text"),
    ("vision", "vision"),
    ("visual", "vision"),
    ("image", "vision"),
    ("audio", "audio"),
    ("decoder", "dec"),
    ("encoder", "enc"),
)


def stack_names(paths: list[str]) -> dict[str, str]:
    """A short, distinct stack name for each list of blocks (its path in the model).

    One list is the unnamed stack ``""`` (a decoder-only model keeps its names). Several get the
    first of text/vision/audio/dec/enc their path names, else the first segment that tells them
    apart (lowercased); a clash takes the list's position as a suffix.

    >>> stack_names(["encoder.block", "decoder.block"])
    {'encoder.block': 'enc', 'decoder.block': 'dec'}
    >>> stack_names(["text_model.encoder.layers", "vision_model.encoder.layers"])
    {'text_model.encoder.layers': 'text', 'vision_model.encoder.layers': 'vision'}
    >>> stack_names(["transformer.h"])
    {'transformer.h': ''}
    >>> stack_names(["backbone.blocks", "neck.Blocks", ""])
    {'backbone.blocks': 'backbone', 'neck.Blocks': 'neck', '': 'top'}
    """
    if len(paths) < 2:
        return dict.fromkeys(paths, "")
    names: dict[str, str] = {}
    split = [path.split(".") if path else [] for path in paths]
    for path, segments in zip(paths, split, strict=True):
        lowered = [segment.lower() for segment in segments]
        word = next(
            (name for key, name in _STACK_WORDS if any(key in seg for seg in lowered)), None
        )
        if word is None:
            others = [o for o in split if o is not segments]
            distinct = [
                seg
                for i, seg in enumerate(lowered)
                if all(i >= len(o) or o[i].lower() != seg for o in others)
            ]
            word = re.sub(r"[^a-z0-9_]", "_", distinct[0]) if distinct else "top"
            if not word[0].isalpha():
                word = f"s{word}"
        names[path] = word
    counts = Counter(names.values())
    return {
        path: f"{name}{i}" if counts[name] > 1 else name
        for i, (path, name) in enumerate(names.items())
    }


def _number_layers(candidates: list[Candidate], chosen: list[Candidate]) -> list[Target]:
    """Targets of the ``chosen`` candidates with stacks and layer numbers.

    A layer is the rank of a block among the entries of its list that hold any target before
    include/exclude (so ``include="h.3.*"`` still reports layer 3 of L); each list is a stack,
    numbered on its own; lists left with no chosen target do not count (so ``include="encoder.*"``
    watches the encoder as the one unnamed stack).
    """
    used: dict[str, dict[int, set[bool]]] = defaultdict(lambda: defaultdict(set))
    for c in candidates:
        if c.parts:
            key, index = c.block if c.block else ("", 0)
            used[key][index] |= {_is_mlp_role(role) for role, _ in c.parts}
    order = list(dict.fromkeys(c.block[0] if c.block else "" for c in chosen))
    stack_of = stack_names(order)
    layer_of: dict[tuple[str, int], int] = {}
    num_layers: dict[str, int] = {}
    for key in order:
        ranks = _block_ranks(used[key])
        layer_of.update({(key, index): rank for index, rank in ranks.items()})
        num_layers[key] = len(set(ranks.values()))
    targets: list[Target] = []
    for c in chosen:
        key, index = c.block if c.block else ("", 0)
        if c.experts:  # a 3-D experts tensor: one target per expert and role
            targets += [
                ExpertTarget.of_expert(
                    c.name,
                    c.parameter,
                    role=role,
                    rows=rows,
                    expert=expert,
                    layer=layer_of[(key, index)],
                    num_layers=num_layers[key],
                    stack=stack_of[key],
                )
                for expert in range(c.experts)
                for role, rows in c.parts
            ]
            continue
        rows0 = c.parts[0][1]
        whole = rows0.groups == 1 and rows0.start == 0 and rows0.stop in (None, _out(c, rows0))
        fused = len(c.parts) > 1 or not whole
        targets += [
            Target.from_parameter(
                c.name,
                c.parameter,
                role=role,
                layer=layer_of[(key, index)],
                num_layers=num_layers[key],
                rows=rows,
                fused=fused,
                stack=stack_of[key],
                expert=c.expert,
            )
            for role, rows in c.parts
        ]
    return targets


def _is_mlp_role(role: str) -> bool:
    """A role of the feed-forward half of a block (its MLP, experts or router)."""
    return role.startswith("MLP_") or role == "Router"


def _block_ranks(halves: Mapping[int, set[bool]]) -> dict[int, int]:
    """The layer of each entry of a list of blocks, from which halves of a block each holds
    (``True``: MLP roles, ``False``: attention roles).

    Entries are numbered in order; where the list alternates attention-only and MLP-only
    entries, attention first (``layers = ModuleList([Attention, FeedForward] * L)``), each MLP
    is the second half of the block its attention began.

    >>> _block_ranks({0: {False, True}, 1: {False, True}})
    {0: 0, 1: 1}
    >>> _block_ranks({0: {False}, 1: {True}, 2: {False}, 3: {True}})
    {0: 0, 1: 0, 2: 1, 3: 1}
    """
    indices = sorted(halves)
    alternating = len(indices) > 1 and all(
        halves[index] == {rank % 2 == 1} for rank, index in enumerate(indices)
    )
    return {index: rank // 2 if alternating else rank for rank, index in enumerate(indices)}


def _out(candidate: Candidate, rows: Rows) -> int:
    return candidate.parameter.shape[1 if rows.transposed else 0]


def _warn_missing_roles(targets: list[Target]) -> None:
    """Warn where a layer lacks roles other layers of its stack have (an encoder has no cross
    attention, a DeepSeek's dense first layers no experts: compared within a stack and kind)."""
    # A layer with experts is compared with the other layers with experts only (DeepSeek's dense
    # first layers have no router, no shared experts).
    with_experts = {(t.stack, t.layer) for t in targets if t.expert is not None}
    by_layer: dict[tuple[str, bool, int], set[str]] = defaultdict(set)
    for t in targets:
        by_layer[(t.stack, (t.stack, t.layer) in with_experts, t.layer)].add(t.role)
    missing = {}
    for (stack, experts, layer), found in by_layer.items():
        every = set().union(
            *(roles for (s, e, _), roles in by_layer.items() if (s, e) == (stack, experts))
        )
        if every - found:
            missing[(stack, layer)] = every - found
    if missing:
        text = "; ".join(
            f"{stack + ' ' if stack else ''}layer {layer}: "
            f"{', '.join(sorted(roles, key=role_sort_key))}"
            for (stack, layer), roles in sorted(missing.items())
        )
        rank_zero_warn(
            f"some layers lack roles that other layers have ({text}); their charts will have "
            "gaps. Check format_targets(...) and pass mapping= if a weight was not recognised.",
            category=PartialTargetWarning,
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
        rank_zero_warn(
            f"`roles` {unused!r} matched no target (roles found: {', '.join(found)})",
            category=PartialTargetWarning,
        )
    kept = []
    for t in targets:
        if any(fnmatch.fnmatchcase(t.role, p) for p in patterns):
            kept.append(t)
        else:
            skipped.append(Skipped(t.name, t.shape, f"role {t.role} not in roles="))
    return kept


def _check_unique(targets: list[Target]) -> None:
    seen: dict[tuple[str, int, str, int | None], str] = {}
    clashes = []
    for t in targets:
        key = (t.stack, t.layer, t.role, t.expert)
        if key in seen:
            where = f"{t.stack} " if t.stack else ""
            expert = "" if t.expert is None else f" expert {t.expert}"
            clashes.append(
                f"  {where}layer {t.layer} role {t.role}{expert}: {seen[key]} and {t.name}"
            )
        seen[key] = t.name
    if clashes:
        error = TargetError(
            "find_targets: several weights map to the same (layer, role), so their charts would "
            "overwrite each other:\n"
            + "\n".join(clashes[:_MAX_LISTED])
            + "\nGive them distinct roles with mapping= or drop some with include=/exclude=."
        )
        error.undecided = True
        raise error
