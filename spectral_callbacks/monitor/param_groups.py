"""Which parameters each learning-rate factor of ``lr_balance`` scales, and optimizer groups for it.

An optimizer has one learning rate per *parameter group*, so a factor can only reach a watched
matrix whose parameters sit in groups of their own. The unit a factor belongs to is the module that
holds the watched weight - its weight and bias, or a PEFT tuner layer with its adapters - so a fused
``c_attn`` (Q, K and V in one parameter) is one unit; with ``per="layer"`` every watched module of a
block is one unit. :func:`group_units` refuses, in one line, an optimizer whose groups mix a unit
with anything else; :func:`balanced_param_groups` builds groups that never do, from the user's own
split (weight decay on matrices, none on norms and biases), for ``configure_optimizers``, the
Hugging Face ``Trainer`` (``optimizers=(optimizer, None)``) or a plain loop.

Example::

    >>> import torch
    >>> model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    >>> groups = balanced_param_groups(model, weight_decay=0.1)
    >>> [(len(group["params"]), group["weight_decay"]) for group in groups]
    [(1, 0.1), (1, 0.1), (1, 0.1), (1, 0.1), (1, 0.0), (1, 0.0), (1, 0.0), (1, 0.0), (4, 0.0)]
    >>> optimizer = torch.optim.AdamW(groups, lr=1e-3)  # the norms share the last group
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.names import layer_label
from spectral_callbacks.targets.target import Target


@dataclass(frozen=True)
class BalanceUnit:
    """The parameters one learning-rate factor scales, and the watched matrices it is read from.

    Attributes:
        name: the module's name (``per="matrix"``) or the block's (``L03``, ``dec/L03``).
        targets: the names of the watched matrices whose ESD α the factor comes from.
        parameters: every parameter of its modules (frozen ones included, so a frozen base
            weight in the group of its adapters is no mix).
    """

    name: str
    targets: tuple[str, ...]
    parameters: tuple[torch.Tensor, ...]


def balance_units(model: torch.nn.Module, targets: Sequence[Target], per: str) -> list[BalanceUnit]:
    """The units of ``targets`` (``per``: ``"matrix"`` or ``"layer"``), in the targets' order."""
    owners = _owners(model)
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    by_module: dict[int, tuple[torch.nn.Module, list[Target]]] = {}
    for target in targets:
        module = target.adapter_layer() or owners.get(id(target.parameter))
        if module is None:  # a parameter no module of `model` holds: nothing to scale
            continue
        by_module.setdefault(id(module), (module, []))[1].append(target)
    units: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    for module, held in by_module.values():
        if per == "layer":
            first = held[0]
            stack = first.stack
            label = layer_label(first.layer, first.num_layers)
            key = f"{stack}/{label}" if stack else label
        else:
            key = names.get(id(module), held[0].parameter_name)
        names_of, parameters = units.setdefault(key, ([], []))
        names_of.extend(target.name for target in held)
        adapted = held[0].adapter_layer() is not None
        parameters.extend(module.parameters(recurse=adapted))
    return [
        BalanceUnit(key, tuple(names_of), tuple(parameters))
        for key, (names_of, parameters) in units.items()
    ]


def group_units(
    param_groups: Sequence[Mapping[str, Any]],
    units: Sequence[BalanceUnit],
    names: Mapping[int, str],
    caller: str,
) -> dict[int, int]:
    """Each param group's unit (``{group index: unit index}``; groups of no unit left out).

    Args:
        param_groups: the optimizer's ``param_groups``.
        units: from :func:`balance_units`.
        names: parameter id -> name, for the message.
        caller: the frontend's name, for the message.

    Raises:
        ConfigurationError: a group holding parameters of a unit together with parameters of
            another unit or of no unit (one factor could not be applied to the group).
    """
    unit_of = {id(parameter): i for i, unit in enumerate(units) for parameter in unit.parameters}
    found: dict[int, int] = {}
    for index, group in enumerate(param_groups):
        params = list(group["params"])
        held = sorted({unit_of[id(p)] for p in params if id(p) in unit_of})
        if not held:
            continue
        others = [units[i].name for i in held[1:]]
        others += [names.get(id(p), "an unnamed parameter") for p in params if id(p) not in unit_of]
        if others:
            raise ConfigurationError(
                f"{caller}: `lr_balance` scales the learning rate of each watched matrix, but "
                f"param group {index} holds {units[held[0]].name!r} together with {others[0]!r}; "
                "give each its own groups with spectral_callbacks.balanced_param_groups(model)"
            )
        found[index] = held[0]
    return found


def balanced_param_groups(
    model: torch.nn.Module,
    param_groups: Iterable[Any] | None = None,
    *,
    weight_decay: float | None = None,
    roles: Sequence[str] | None = None,
    include: Any = None,
    exclude: Any = None,
    mapping: Any = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups in which each watched matrix's parameters are on their own.

    Every group is split into one group per watched module (its weight and bias, or its
    adapters), each keeping the options of the group it came from, and one group of the rest.

    Args:
        model: the model (or the ``LightningModule``) the monitor watches.
        param_groups: the user's groups (dicts with ``params`` and options, e.g. a weight-decay
            split) or an iterable of parameters. Default ``None``: every trainable parameter.
        weight_decay: with ``param_groups=None``, the nanoGPT split: this decay on the parameters
            of two or more dimensions, ``0.0`` on the others. Default ``None`` (one group).
        roles, include, exclude, mapping: which matrices are watched; pass the monitor's own
            (:func:`~spectral_callbacks.targets.find_targets` arguments). Default ``None``.

    Returns:
        The groups for ``torch.optim.<Optimizer>(groups, lr=...)``.

    Raises:
        ConfigurationError: ``weight_decay`` together with ``param_groups``.
    """
    from spectral_callbacks.targets import find_targets

    if param_groups is not None and weight_decay is not None:
        raise ConfigurationError(
            f"`weight_decay` must be None when `param_groups` are given (they carry their own "
            f"decay), got {weight_decay!r}"
        )
    if param_groups is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        if weight_decay is None:
            groups: list[dict[str, Any]] = [{"params": trainable}]
        else:
            groups = [
                {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
            ]
    else:
        given = list(param_groups)
        as_dicts = all(isinstance(group, Mapping) for group in given)
        groups = [dict(group) for group in given] if as_dicts else [{"params": given}]
    targets = find_targets(model, roles=roles, include=include, exclude=exclude, mapping=mapping)
    units = balance_units(model, list(targets), "matrix")
    unit_of = {id(parameter): i for i, unit in enumerate(units) for parameter in unit.parameters}
    split: list[dict[str, Any]] = []
    for group in groups:
        params = list(group["params"])
        options = {key: value for key, value in group.items() if key != "params"}
        own: dict[int, list[torch.Tensor]] = {}
        for parameter in params:
            if id(parameter) in unit_of:
                own.setdefault(unit_of[id(parameter)], []).append(parameter)
        rest = [p for p in params if id(p) not in unit_of]
        split += [{"params": held, **options} for held in own.values()]
        if rest:
            split.append({"params": rest, **options})
    return split


def _owners(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Parameter id -> the module holding it directly (the first, for a shared one)."""
    owners: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), module)
    return owners
