"""Mixture-of-experts weights: one target per expert's slice of a 3-D tensor, or per expert's own
Linear layer where the experts are a list of MLPs (``experts.3.w1``, :func:`listed_expert`).

``transformers`` 5 keeps a layer's routed experts as ``experts.gate_up_proj`` of shape
``(E, 2 I, H)`` (each expert's gate and up rows stacked, ``[gate; up]``) and ``experts.down_proj``
``(E, H, I)``, for Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, OLMoE and the other models built
on the same experts module (stored ``(E, in, out)`` where the module says ``is_transposed``).
:func:`expert_parts` reads which roles a tensor holds; :class:`ExpertTarget` is one expert's
``(out, in)`` matrix of one role, a view of ``parameter[expert]``. The experts of one shape are
snapshotted into one ``(E, m, n)`` stack, one copy per slice, and decomposed as one batch like
any group of equal matrices: the engine never learns that they are experts.

Example::

    >>> import torch
    >>> experts = torch.nn.Parameter(torch.arange(24.0).reshape(2, 4, 3))  # (E, [gate; up], H)
    >>> [role for role, _ in expert_parts("mlp.experts.gate_up_proj", experts, None)]
    ['MLP_gate', 'MLP_up']
    >>> up = ExpertTarget.of_expert("mlp.experts.gate_up_proj", experts, role="MLP_up",
    ...                             rows=Rows(2, 4), expert=1)
    >>> up.name, up.shape, up.matrix().data_ptr() == experts[1, 2:].data_ptr()
    ('mlp.experts.gate_up_proj[E001/MLP_up]', (2, 3), True)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from spectral_callbacks.targets.target import Rows, Skip, Target, check_role

__all__ = ["ExpertTarget", "expert_parts", "is_routed_expert", "listed_expert"]

# The leaf name of each 3-D experts tensor and the roles its rows hold (equal parts, in order).
_EXPERT_ROLES: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("MLP_gate", "MLP_up"),
    "gate_proj": ("MLP_gate",),
    "up_proj": ("MLP_up",),
    "down_proj": ("MLP_down",),
    "w1": ("MLP_gate",),  # MLP_up where there is no w3 (a plain MLP: w2(act(w1 x)))
    "w3": ("MLP_up",),
    "w2": ("MLP_down",),
    # torchtitan's GroupedExperts: (E, hidden, dim) and (E, dim, hidden), named by their axes.
    "w1_EFD": ("MLP_gate",),
    "w3_EFD": ("MLP_up",),
    "w2_EDF": ("MLP_down",),
    # vLLM's FusedMoE: w13_weight rows [w1; w3], w2_weight.
    "w13_weight": ("MLP_gate", "MLP_up"),
    "w2_weight": ("MLP_down",),
    # Grouped-GEMM experts of research code.
    "w13": ("MLP_gate", "MLP_up"),
    "gate": ("MLP_gate",),
    "up": ("MLP_up",),
    "down": ("MLP_down",),
    "w_in": ("MLP_up",),
    "w_out": ("MLP_down",),
    "fc1": ("MLP_up",),
    "fc2": ("MLP_down",),
    "wi": ("MLP_up",),
    "wo": ("MLP_down",),
}
# The names a mixture gives its router, a Linear d -> E beside the experts (or within a router
# module: torchtitan's router.gate, Switch's router.classifier).
_ROUTER_NAMES = frozenset({"gate", "router", "gating", "wg", "classifier"})


def is_routed_expert(name: str) -> bool:
    """Whether parameter ``name`` lies in a mixture's routed experts (``mlp.experts``,
    ``block_sparse_moe.experts.3``), not its shared experts or router.

    >>> is_routed_expert("mlp.experts.gate_up_proj"), is_routed_expert("mlp.shared_experts.up_proj.weight")
    (True, False)
    """
    return any(
        segment.endswith("experts") and not segment.startswith("shared")
        for segment in name.split(".")[:-1]
    )


# The role of each Linear layer of one expert, by module name, where a mixture keeps its routed
# experts as separate MLPs: experts.3.w1 (Mixtral as first written), experts.expert_3.wi (Switch);
# the one-role names of the 3-D tensors, and the names of T5-style and fc MLPs.
_LISTED_EXPERT_ROLES: dict[str, str] = {
    **{leaf: roles[0] for leaf, roles in _EXPERT_ROLES.items() if len(roles) == 1},
    "wi": "MLP_up",
    "wo": "MLP_down",
    "wi_0": "MLP_gate",
    "wi_1": "MLP_up",
    "fc1": "MLP_up",
    "fc2": "MLP_down",
    "fc_1": "MLP_gate",  # litgpt's LLaMAMLP experts: proj(silu(fc_1 x) * fc_2 x)
    "fc_2": "MLP_up",
    "proj": "MLP_down",
}


def listed_expert(name: str) -> tuple[int, str | None] | None:
    """``(expert, role)`` of one expert's weight in a list of expert MLPs (``role`` ``None`` for
    a module name no rule reads), or ``None`` for a weight that is not in such a list.

    >>> listed_expert("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    (3, 'MLP_gate')
    >>> listed_expert("encoder.block.1.layer.1.mlp.experts.expert_2.wo.weight")
    (2, 'MLP_down')
    >>> listed_expert("mlp.experts.0.linear.weight"), listed_expert("mlp.shared_experts.w1.weight")
    ((0, None), None)
    """
    segments = name.split(".")
    if "experts" not in segments[:-2]:
        return None
    at = len(segments) - 1 - segments[::-1].index("experts")
    index = re.fullmatch(r"(?:expert_?)?(\d+)", segments[at + 1])
    if index is None:
        return None
    module = ".".join(segments[at + 2 : -1])
    return int(index[1]), _LISTED_EXPERT_ROLES.get(module)


def router_width(moe: nn.Module | None, experts: int, skip: nn.Module | None = None) -> int | None:
    """The model width ``d`` the router of ``moe`` reads: the input size of its Linear d -> E
    (a child, or a child's child, named like a router, with ``experts`` rows), or ``None``.

    >>> moe = torch.nn.Module()
    >>> moe.gate = torch.nn.Linear(8, 4)
    >>> router_width(moe, experts=4), router_width(moe, experts=5)
    (8, None)
    """
    if moe is None:
        return None
    for name, child in moe.named_children():
        if child is skip:
            continue
        for inner_name, inner in [(name, child), *child.named_children()]:
            weight = getattr(inner, "weight", None)
            if (
                inner_name in _ROUTER_NAMES
                and isinstance(weight, torch.Tensor)
                and weight.dim() == 2
                and weight.shape[0] == experts
            ):
                return int(weight.shape[1])
    return None


def _transposed_by_width(side_in: bool, shape: tuple[int, int], width: int) -> bool | None:
    """Whether one expert's ``shape`` is stored ``(in, out)``: an up/gate reads the width the
    router reads (``side_in``), a down writes it; ``None`` where neither side is that width."""
    rows_are_width, cols_are_width = shape[0] == width, shape[1] == width
    if not (rows_are_width or cols_are_width):
        return None
    if rows_are_width and cols_are_width:
        return False  # square: either reading gives the same matrix up to a transpose
    return rows_are_width if side_in else cols_are_width


def expert_parts(
    name: str, parameter: torch.Tensor, owner: nn.Module | None, moe: nn.Module | None = None
) -> list[tuple[str, Rows]] | Skip:
    """``(role, Rows)`` of each role in every expert's slice of a 3-D experts tensor, or a Skip.

    Rows are those of one expert's ``(out, in)`` matrix. How a slice is stored: the experts
    module's own ``is_transposed`` flag where it has one; else from the router (a Linear d -> E
    in ``moe``, the module holding the experts, or in ``owner`` itself): an up or gate reads d,
    a down writes it, so the side that is d says whether the slice is ``(in, out)`` (a
    grouped-GEMM kernel's ``x @ w1[e]``, ``(E, d, f)``) or ``(out, in)``; else ``(out, in)``.
    A tensor of experts that no name places is refused with the ``mapping=`` that places it.
    """
    owner_path, _, leaf = name.rpartition(".")
    experts = parameter.shape[0]
    width = router_width(moe, experts, skip=owner) or router_width(owner, experts)
    in_experts = "experts" in owner_path.rpartition(".")[2]
    if parameter.dim() != 3 or not (in_experts or width is not None):
        what = "fused MoE experts of unknown layout" if "experts" in name else "not a matrix"
        return Skip(
            f"{parameter.dim()}-D ({what}): only 2-D weights are watched", warn="experts" in name
        )
    roles = _EXPERT_ROLES.get(leaf)
    siblings = dict(owner.named_parameters(recurse=False)) if owner is not None else {}
    if leaf == "w1" and "w3" not in siblings:
        roles = ("MLP_up",)
    slice_shape = (int(parameter.shape[1]), int(parameter.shape[2]))
    if roles is None:
        return Skip(_unplaced(name, slice_shape, experts, width), warn=True)
    if hasattr(owner, "is_transposed"):
        transposed = bool(owner.is_transposed)  # type: ignore[union-attr]
    elif width is not None:
        found = _transposed_by_width(roles[0] != "MLP_down", slice_shape, width)
        if found is None:
            return Skip(_unplaced(name, slice_shape, experts, width), warn=True)
        transposed = found
    else:
        transposed = False
    out = slice_shape[1] if transposed else slice_shape[0]
    if out % len(roles):
        return Skip(
            f"MoE experts {leaf} with {out} output rows do not split into {roles}; describe "
            "them with mapping=",
            warn=True,
        )
    size = out // len(roles)
    return [(role, Rows(i * size, (i + 1) * size, 1, transposed)) for i, role in enumerate(roles)]


def _unplaced(name: str, shape: tuple[int, int], experts: int, width: int | None) -> str:
    """The one line that refuses a 3-D experts tensor no rule places, with the ``mapping=``."""
    owner_path, _, leaf = name.rpartition(".")
    pattern = f"*.{owner_path.rpartition('.')[2]}.{leaf}" if owner_path else leaf
    router = f" (the router maps d={width} to {experts} experts)" if width else ""
    if width is not None and shape[0] == width != shape[1]:
        up, down = "Split(('MLP_up',), transposed=True)", "'MLP_down'"
        how = f"if each {shape} slice feeds the hidden layer (x @ w[e]), else {down}"
    elif width is not None and shape[1] == width != shape[0]:
        up, down = "'MLP_up'", "Split(('MLP_down',), transposed=True)"
        how = f"if each {shape} slice feeds the hidden layer, else {down} (h @ w[e] writes d)"
    else:
        up = "'MLP_up'"
        how = "(or 'MLP_gate', 'MLP_down'; Split((role,), transposed=True) for slices stored (in, out))"
    return (
        f"3-D MoE experts tensor whose role no rule knows{router}; give it with "
        f"mapping={{{pattern!r}: {up}}} {how}"
    )


@dataclass(frozen=True)
class ExpertTarget(Target):
    """One expert's matrix of one role: rows of ``parameter[expert]`` (a view, never a copy).

    ``expert`` is set (the index along the tensor's first dimension); the name is the parameter's
    with ``[E007/MLP_up]``.
    """

    @classmethod
    def of_expert(
        cls,
        parameter_name: str,
        parameter: torch.Tensor,
        *,
        role: str,
        rows: Rows,
        expert: int,
        layer: int = 0,
        num_layers: int = 1,
        stack: str = "",
    ) -> ExpertTarget:
        """The target of expert ``expert``'s ``rows`` of a 3-D ``(E, out, in)`` tensor."""
        check_role(role, f"target {parameter_name}")
        shape = rows.shape_of(tuple(parameter.shape[1:]))
        name = f"{parameter_name}[E{expert:03d}/{role}]"
        return cls(
            name, parameter_name, layer, num_layers, role, shape, parameter, rows, stack, expert
        )

    def stored(self) -> torch.Tensor:
        """The expert's slice ``parameter[expert]``, ``(out, in)`` or ``(in, out)``: a view."""
        assert self.expert is not None
        return self.parameter.detach()[self.expert]
