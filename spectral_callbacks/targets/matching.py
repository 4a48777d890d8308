"""Which decision each parameter gets: the user's ``mapping`` first, then the built-in rules.

Names are matched with wrapper segments removed (``torch.compile``'s ``_orig_mod.``, DDP's leading
``module.``, FSDP/checkpoint wrappers, Lightning's ``_forward_module.``), so wrapped and bare models
map alike; a weight's block is found on the real name, in the module tree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from spectral_callbacks.messages import rank_zero_warn
from spectral_callbacks.targets.errors import AmbiguousTargetWarning, TargetError
from spectral_callbacks.targets.experts import expert_parts, listed_expert
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
from spectral_callbacks.targets.target import Rows, Skipped

UserDecision = str | Split | Skip | None
MappingValue = UserDecision | Callable[[str, torch.Tensor], UserDecision]
UserMapping = Mapping[Pattern, MappingValue] | Callable[[str, torch.Tensor], UserDecision]
Patterns = Pattern | Iterable[Pattern] | None

# Module names that wrappers insert into parameter names; the rules never see them. A PEFT tuner
# layer's ``base_layer`` is one: ``q_proj.base_layer.weight`` maps like ``q_proj.weight``.
_WRAPPER_SEGMENTS = frozenset(
    {
        "_orig_mod",
        "_fsdp_wrapped_module",
        "_checkpoint_wrapped_module",
        "_forward_module",
        "base_layer",
    }
)
_LIST_TYPES = (nn.ModuleList, nn.Sequential)
# Modules that read the last hidden state out (outside the blocks): output heads, BERT's and
# ViT's `pooler`, BERT's `cls` prediction head, CLIP/SigLIP's projections into the shared space.
_HEAD_NAMES = frozenset(
    {"lm_head", "head", "classifier", "score", "embed_out", "output", "pooler", "cls"}
    | {"text_projection", "visual_projection", "vision_projection"}
)


def clean_name(name: str) -> str:
    """``name`` without wrapper segments (leading DDP ``module.``, ``_orig_mod.``, ...).

    >>> clean_name("module._orig_mod.transformer.h.0.attn.c_attn.weight")
    'transformer.h.0.attn.c_attn.weight'
    >>> clean_name("h.0.q_proj.modules_to_save.default.weight"), clean_name("h.0.q_proj.base_layer.weight")
    ('h.0.q_proj.weight', 'h.0.q_proj.weight')
    """
    segments = name.split(".")
    while len(segments) > 1 and segments[0] == "module":
        segments = segments[1:]
    # PEFT's trained full copy ``q_proj.modules_to_save.<adapter>.weight`` maps like ``q_proj``.
    while "modules_to_save" in segments[:-2]:
        at = segments.index("modules_to_save")
        segments = segments[:at] + segments[at + 2 :]
    return ".".join(s for s in segments if s not in _WRAPPER_SEGMENTS)


@dataclass
class Candidate:
    """A 2-D parameter with its decision, before layers are numbered and filters applied."""

    name: str  # as in the model given
    clean: str
    parameter: torch.Tensor
    parts: list[tuple[str, Rows]]
    skip: Skip | None
    block: tuple[str, int] | None  # (list path, index in list)
    experts: int = 0  # a 3-D experts tensor: its number of experts, each a target per part
    expert: int | None = None  # one expert's own Linear in a list of expert MLPs: its index


def as_patterns(value: Patterns, argument: str) -> list[Pattern]:
    """``include``/``exclude`` as a list of patterns; a TargetError naming ``argument`` otherwise."""
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


def matches(patterns: list[Pattern], clean: str) -> Pattern | None:
    """The first pattern matching the parameter name, or the module name for a ``.weight``."""
    module = clean[: -len(".weight")] if clean.endswith(".weight") else None
    for pattern in patterns:
        if match_length(pattern, clean) is not None:
            return pattern
        if module and match_length(pattern, module) is not None:
            return pattern
    return None


def user_decision(mapping: UserMapping, ctx: Context, name: str) -> tuple[Decision, int] | None:
    """The mapping's decision and how many trailing segments it names, or None (no opinion).

    Only the segments a pattern spells out are its own (see :func:`named_length`): the layer
    index a wildcard covers (``net.*``, ``*.weight``) still numbers the layers.
    """
    if callable(mapping) and not isinstance(mapping, Mapping):
        decision = mapping(name, ctx.parameter)
        return None if decision is None else (decision, 1)
    module = ctx.name[: -len(".weight")] if ctx.name.endswith(".weight") else None
    found: list[tuple[Pattern, Decision, int]] = []
    for pattern, value in mapping.items():
        length, named = match_length(pattern, ctx.name), named_length(pattern)
        if length is None and module:
            length = match_length(pattern, module)
            length, named = (None, named) if length is None else (length + 1, named + 1)
        if length is None:
            continue
        length = min(length, named)
        decision = value(name, ctx.parameter) if callable(value) else value
        if decision is None and callable(value):
            continue  # a callable value returning None has no opinion on this parameter
        found.append(
            (pattern, Skip("mapped to None by mapping=") if decision is None else decision, length)
        )
    if not found:
        return None
    if len({repr(decision) for _, decision, _ in found}) > 1:
        rank_zero_warn(
            f"{name} matches several mapping= patterns with different roles: "
            + ", ".join(f"{p!r} -> {d!r}" for p, d, _ in found)
            + f"; using the first ({found[0][0]!r}). Make the patterns disjoint to silence this.",
            category=AmbiguousTargetWarning,
        )
    return found[0][1], found[0][2]


def named_length(pattern: Pattern) -> int:
    """How many trailing segments ``pattern`` spells out without a wildcard (at least 1).

    A user's wildcard may stand for the index of a block (``net.*`` covers ``0.weight``), so only
    the literal tail of an fnmatch pattern, and only the weight itself for a regular expression,
    is kept out of the layer search.

    >>> named_length("mlp.0.weight"), named_length("net.*"), named_length("*.attn.q.weight")
    (3, 1, 3)
    >>> named_length(re.compile(r"net\\.\\d+\\.weight"))
    1
    """
    if isinstance(pattern, re.Pattern):
        return 1
    literal = 0
    for segment in reversed(pattern.split(".")):
        if any(char in segment for char in "*?["):
            break
        literal += 1
    return max(literal, 1)


def builtin_decision(ctx: Context) -> tuple[Decision, int] | None:
    """The first built-in rule's decision and how many trailing segments it matched, or None."""
    for pattern, rule in BUILTIN_RULES:
        length = match_length(pattern, ctx.name)
        if length is None:
            continue
        decision = rule(ctx) if callable(rule) else rule
        if decision is not None:
            return decision, length
    return None


def parts_of(
    decision: Decision, ctx: Context, name: str, from_user: bool
) -> list[tuple[str, Rows]]:
    """``(role, Rows)`` of each watched part; a bad user decision raises TargetError."""
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


def _user_expert_parts(
    mapping: UserMapping | None, name: str, parameter: torch.Tensor, owner: nn.Module | None
) -> list[tuple[str, Rows]] | Skip | None:
    """``mapping=``'s parts of every expert's slice of a 3-D experts tensor (each slice read as
    one ``(out, in)`` matrix, or ``(in, out)`` with ``Split(..., transposed=True)``), a Skip, or
    ``None`` where the mapping has no opinion."""
    if mapping is None or parameter.dim() != 3:
        return None
    ctx = Context(clean_name(name), parameter, (owner,) if owner is not None else (nn.Module(),))
    found = user_decision(mapping, ctx, name)
    if found is None:
        return None
    decision = found[0]
    if isinstance(decision, Skip):
        return decision
    if isinstance(decision, str):
        decision = Split((decision,))
    if not isinstance(decision, Split):
        raise TargetError(
            f"mapping= for {name} must give a role string, Split(...), Skip(...) or None, "
            f"got {decision!r}"
        )
    transposed = bool(decision.transposed)
    rows, cols = int(parameter.shape[1]), int(parameter.shape[2])
    try:
        return decision.parts(name, (cols, rows) if transposed else (rows, cols), transposed)
    except ValueError as error:
        raise TargetError(f"mapping= gave an unusable Split: {error}") from error


def _is_block_list(module: nn.Module | None) -> bool:
    """A list of blocks: a ModuleList/Sequential, or a ModuleDict keyed "0", "1", ...
    (torchtitan's ``layers``, keyed so pipeline stages keep the original numbers)."""
    if isinstance(module, _LIST_TYPES):
        return True
    return isinstance(module, nn.ModuleDict) and all(key.isdigit() for key in module)


def block_of(name: str, matched: int, modules: Mapping[str, nn.Module]) -> tuple[str, int] | None:
    """(list path, index) of the outermost ModuleList/Sequential entry on the path before the match."""
    segments = name.split(".")
    clean_matched = min(matched, len(clean_name(name).split(".")))
    for i in range(len(segments) - clean_matched):
        if segments[i].isdigit():
            path = ".".join(segments[:i])
            if _is_block_list(modules.get(path)):
                return path, int(segments[i])
    return None


def reason_not_matched(
    ctx: Context, inside_blocks: bool, vocab_sizes: frozenset[int] = frozenset()
) -> Skip:
    """Why a 2-D weight no rule matched is not watched; one that looks like a transformer weight
    (not an embedding, a head or a norm) is worth a warning.

    ``vocab_sizes``: the embeddings' numbers of rows; a weight outside the blocks with as many
    rows maps back to the vocabulary (an output head, whatever its name).
    """
    segments = ctx.name.split(".")
    if isinstance(ctx.modules[0], nn.Embedding) or any(
        "embed" in s or s in ("wte", "wpe") for s in segments
    ):
        return Skip("embedding")
    if not inside_blocks and (
        set(segments[:-1]) & _HEAD_NAMES or ctx.parameter.shape[0] in vocab_sizes
    ):
        return Skip("output head")
    if inside_blocks:
        return Skip("inside a block but no rule matched", warn=True)
    # Not an embedding, a head or a norm: a projection of its own (a pooler, an input or a
    # modality projection) that looks like a transformer weight, so it is named, not filed silently.
    return Skip("outside the blocks; no rule matched", warn=True)


def decide(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    mapping: UserMapping | None,
    builtin_rules: bool,
) -> tuple[list[Candidate], list[Skipped], int, dict[str, int]]:
    """A decision for every 2-D parameter: ``mapping`` first, then the built-in rules.

    Returns the 2-D candidates, the weights skipped outright (tied, not 2-D), the number of
    parameters with fewer than 2 dims, and every parameter's position in ``named_parameters``.
    """
    candidates, skipped, low_dim = [], [], 0
    first_name: dict[int, str] = {}
    position: dict[str, int] = {}  # parameter order, so the summary lists skipped weights in it
    # nn.Module's own walk: FSDP1 overrides named_parameters to drop its wrapper segments, and the
    # names must stay the paths of named_modules (clean_name removes the segments for the rules).
    for name, parameter in nn.Module.named_parameters(model, remove_duplicate=False):
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
        module_path = name.rpartition(".")[0]
        if parameter.dim() > 2:
            owner = modules.get(module_path)
            moe = modules.get(module_path.rpartition(".")[0]) if module_path else None
            parts = _user_expert_parts(mapping, name, parameter, owner)
            if parts is None:
                parts = expert_parts(clean_name(name), parameter, owner, moe)
            if isinstance(parts, Skip):
                if parts.warn:  # inside a block, looks like experts: listed and warned about
                    candidates.append(Candidate(name, clean_name(name), parameter, [], parts, None))
                else:
                    skipped.append(Skipped(name, tuple(parameter.shape), parts.reason))
                continue
            block = block_of(name, 2, modules)
            experts = parameter.shape[0]
            candidates.append(
                Candidate(name, clean_name(name), parameter, parts, None, block, experts)
            )
            continue
        owners = []
        path = module_path
        while True:
            owners.append(modules[path])
            if not path:
                break
            path = path.rpartition(".")[0]
        ctx = Context(clean_name(name), parameter, tuple(owners))
        found = user_decision(mapping, ctx, name) if mapping is not None else None
        from_user = found is not None
        if found is None and builtin_rules:
            found = builtin_decision(ctx)
        if found is None:
            candidates.append(
                Candidate(name, ctx.name, parameter, [], None, block_of(name, 1, modules))
            )
            continue
        decision, matched = found
        if isinstance(decision, Skip):
            candidates.append(Candidate(name, ctx.name, parameter, [], decision, None))
            continue
        parts = parts_of(decision, ctx, name, from_user)
        block = block_of(name, matched, modules)
        listed = listed_expert(ctx.name)
        expert = None if listed is None else listed[0]
        candidates.append(Candidate(name, ctx.name, parameter, parts, None, block, expert=expert))
    return candidates, skipped, low_dim, position
