r"""LoRA-style layers of any library: recognised by their structure, verified by their own output.

PEFT's tuner layers are read by their API (``targets/adapted.py``). Other libraries write their
own: torchtune's ``LoRALinear`` (``weight`` + ``lora_a``/``lora_b``) and ``DoRALinear`` (and a
``magnitude``), litgpt's ``LoRALinear`` (``linear`` + ``lora_A``/``lora_B``) and ``LoRAQKVLinear``
(one ``A`` block and one ``B`` block per adapted part of a fused ``[q; k; v]``, the update
zero-padded where a part has none), and hand-written ones. A module is taken for such a layer by
what it holds, never by its class or names:

1. structure: exactly three matrices of its own (as parameters, or as the weights of child
   ``Linear`` layers with nothing below them; never a container such as ``nn.Sequential``): a
   base ``W_0`` (m x n), a down factor ``A`` (R x n, 2 R <= min(m, n)) and an up factor ``B`` (m' x r, m' <= m, r dividing R); optionally a
   magnitude vector of length m (DoRA);
2. verification, once, on the module's own forward in eval mode with random factors (and
   magnitude) in place of its own (``torch.func.functional_call``: its parameters are never
   written): the output on random inputs minus
   ``W_0 x + b`` is read as ``U (A x)`` (a least-squares solve for U), and U must be B scaled by
   one ``s`` and placed row by row: each row of B in one output row and against one block of
   r rows of A, in order (for a plain layer: ``U = s B``). DoRA's output
   ``diag(g / ||W_0 + s B A||_row) (W_0 x + b + s B A x)`` is checked with the ``s`` the module
   states (``scaling``, or ``alpha / rank``). The form found must then reproduce the module's
   output on fresh inputs to the tolerance of the arithmetic the module computes in.

Both run in their own numerics (``probe.py``): autocast off whatever the caller's (the
verification may run inside the first training forward), the formula in float64.

A layer whose verification fails is refused in one line naming its type and why, never watched as
its base. A verified one is watched through the adapted path (:class:`LowRankTarget`, an
:class:`~spectral_callbacks.targets.adapted.AdaptedTarget`): its effective weight
``W_0 + U A`` (or DoRA's) decomposed from the factors, and the update ``U A`` with its own exact
spectrum. A layer that says it is ``merged`` (litgpt) holds the update in its base; one that says
it is ``disabled`` (torchtune) adds none, and is verified with its adapter on.

Example::

    >>> import torch
    >>> class Adapted(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.base = torch.nn.Linear(8, 6)
    ...         self.down = torch.nn.Parameter(torch.randn(2, 8))
    ...         self.up = torch.nn.Parameter(torch.zeros(6, 2))
    ...     def forward(self, x):
    ...         return self.base(x) + 0.5 * (x @ self.down.T) @ self.up.T
    >>> layout = recognise(Adapted())
    >>> layout.base, layout.down, layout.up, round(layout.scale, 6)  # s solved from the output
    ('base.weight', 'down', 'up', 0.5)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from spectral_callbacks.targets.adapted import AdaptedTarget, _Copies, is_tuner_layer
from spectral_callbacks.targets.probe import probing, unit_roundoff
from spectral_callbacks.targets.target import Target

__all__ = ["Layout", "LowRankTarget", "adapt_lowrank", "recognise"]


@dataclass(frozen=True)
class Layout:
    """How a verified LoRA-style module holds its effective weight ``D (W_0 + U A)``.

    Attributes:
        base, down, up: paths of ``W_0``, ``A`` and ``B`` inside the module (``"linear.weight"``).
        bias: path of the base's bias, or ``None``.
        magnitude: path of DoRA's magnitude vector, or ``None`` (then ``D`` is the identity).
        scale: ``s`` with ``U = s B`` placed.
        rows: the output row of each row of ``B``; ``None`` where they are the output rows.
        blocks: the block of ``A``'s rows each row of ``B`` reads; ``None`` for all of A.
        block: rows of A per block (``r``).
    """

    base: str
    down: str
    up: str
    bias: str | None
    magnitude: str | None
    scale: float
    rows: tuple[int, ...] | None = None
    blocks: tuple[int, ...] | None = None
    block: int = 0

    def place(self, up: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """``s B`` placed into an ``(rows, columns)`` matrix (``B`` itself scaled when plain)."""
        if self.rows is None or self.blocks is None:
            return up * self.scale
        placed = up.new_zeros((rows, columns))
        at = torch.tensor(self.rows, device=up.device)
        columns_of = torch.tensor(self.blocks, device=up.device)[:, None] * self.block
        columns_of = columns_of + torch.arange(self.block, device=up.device)
        placed[at[:, None], columns_of] = up * self.scale
        return placed


# Verified (a Layout) or refused (the one-line reason) modules, each verified once.
_RESULTS: weakref.WeakKeyDictionary[nn.Module, Layout | str | None] = weakref.WeakKeyDictionary()


def recognise(module: nn.Module) -> Layout | str | None:
    """The verified :class:`Layout` of a LoRA-style ``module``, the one-line reason it is refused
    (it has the structure but its output is not ``W_0 x + s B A x`` placed), or ``None`` (it does
    not have the structure). Each module is verified once."""
    if module in _RESULTS:
        return _RESULTS[module]
    parts = _structure(module)
    result: Layout | str | None = None if parts is None else _verify(module, *parts)
    _RESULTS[module] = result
    return result


def _own_matrices(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own 2-D parameters, and those of child Linear-like leaves."""
    found: dict[str, torch.Tensor] = {
        name: p for name, p in module.named_parameters(recurse=False) if p.dim() == 2
    }
    for child_name, child in module.named_children():
        if any(True for _ in child.children()):
            continue
        for name, p in child.named_parameters(recurse=False):
            if p.dim() == 2:
                found[f"{child_name}.{name}"] = p
    return found


def _structure(module: nn.Module) -> tuple[str, str, str, str | None, str | None] | None:
    """(base, down, up, bias, magnitude) paths when ``module`` holds a base and two low-rank
    factors, else None."""
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    if isinstance(module, containers) or is_tuner_layer(module):
        return None
    if any(is_tuner_layer(child) for child in module.children()):
        return None
    matrices = _own_matrices(module)
    if len(matrices) != 3:
        return None
    base = max(matrices, key=lambda name: matrices[name].numel())
    m, n = matrices[base].shape
    others = [name for name in matrices if name != base]
    for down, up in (others, others[::-1]):
        a, b = matrices[down], matrices[up]
        rank, width = a.shape
        if (
            width == n
            and 2 * rank <= min(m, n)
            and b.shape[0] <= m
            and b.shape[1] <= rank
            and rank % b.shape[1] == 0
            and not (b.shape[1] == n and b.shape[0] == rank)
        ):
            break
    else:
        return None
    owner = base.rpartition(".")[0]
    bias_path = f"{owner}.bias" if owner else "bias"
    bias = bias_path if _parameter(module, bias_path) is not None else None
    magnitudes = [
        name
        for name, p in module.named_parameters(recurse=False)
        if p.dim() == 1 and p.shape[0] == m and name != "bias"
    ]
    magnitude = magnitudes[0] if len(magnitudes) == 1 else None
    return base, down, up, bias, magnitude


def _parameter(module: nn.Module, path: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(path)
    except AttributeError:
        return None


def _stated_scale(module: nn.Module) -> float | None:
    """The scaling the module states: ``scaling``, or ``alpha / rank`` (``lora_alpha / r``)."""
    scaling = getattr(module, "scaling", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        return float(scaling)
    for alpha, rank in (("alpha", "rank"), ("lora_alpha", "r")):
        a, r = getattr(module, alpha, None), getattr(module, rank, None)
        if isinstance(a, (int, float)) and isinstance(r, int) and r > 0:
            return float(a) / r
    return None


def _kind(module: nn.Module) -> str:
    return f"{type(module).__module__.partition('.')[0]}.{type(module).__name__}"


def _verify(
    module: nn.Module, base: str, down: str, up: str, bias: str | None, magnitude: str | None
) -> Layout | str:
    """The layout the module's own output shows, or why it is refused (module docstring).

    The probe factors are passed to the module's forward by ``torch.func.functional_call``: its
    own parameters are never written (a discovery between a training forward and its backward
    leaves autograd's saved tensors as they were).
    """
    kind = _kind(module)
    weight = module.get_parameter(base).detach()
    a, b = module.get_parameter(down), module.get_parameter(up)
    if getattr(module, "merged", False):
        return f"{kind} is merged (its base holds the update): cannot verify it as W0 + s B A; not watched"
    generator = torch.Generator(device="cpu").manual_seed(0)

    def random(shape: Sequence[int], scale: float) -> torch.Tensor:
        sample = torch.randn(tuple(shape), generator=generator, dtype=torch.float64)
        return (scale * sample).to(weight.device, a.dtype)

    n, rank = weight.shape[1], a.shape[0]
    probe = {
        down: random(a.shape, n**-0.5),
        up: random(b.shape, float(weight.double().std()) + 1e-3),
    }
    if magnitude is not None:
        rows = (weight.double() ** 2).sum(1).sqrt()
        jitter = 1.0 + 0.5 * torch.rand(rows.shape, generator=generator, dtype=torch.float64)
        probe[magnitude] = (rows * jitter.to(rows.device)).to(weight.dtype)
    tensors = {name: module.get_parameter(name).detach() for name in (base, bias) if name}
    tensors.update(probe)
    was_training = module.training
    eps = unit_roundoff(module, weight)
    # A layer found while its adapter is off (torchtune's disable_adapter, a DPO reference
    # forward) shows no update; the layout is the adapter's, so the probe runs with it on. Each
    # snapshot reads the flag again (LowRankTarget._snapshot).
    disabled = getattr(module, "disabled", None) is True
    flagged: Any = module  # the flag is an attribute nn.Module's type does not declare
    try:
        module.eval()
        if disabled:
            flagged.disabled = False
        with probing(weight.device):
            x = random((1, 2 * rank + 8, n), 1.0)
            y = torch.func.functional_call(module, probe, (x,))
            if not isinstance(y, torch.Tensor) or y.shape[-1] != weight.shape[0]:
                return f"{kind}: its output is not the base's {weight.shape[0]} rows; not watched"
            layout = _layout_from_output(
                module, tensors, x, y, base, down, up, bias, magnitude, eps
            )
            if isinstance(layout, str):
                return f"{kind}: {layout}; not watched"
            x = random((1, 5, n), 1.0)
            expected = _formula(layout, tensors, x)
            got = torch.func.functional_call(module, probe, (x,))
            if not _close(got.double(), expected, eps):
                return (
                    f"{kind}: its output is not W0 x + s B A x (s={layout.scale:.4g}) on fresh "
                    "inputs; not watched"
                )
            return layout
    except Exception as error:  # a forward that cannot run on a probe: refused, named
        return f"{kind}: its forward could not be probed ({type(error).__name__}: {error}); not watched"
    finally:
        module.train(was_training)
        if disabled:
            flagged.disabled = True


def _formula(layout: Layout, tensors: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``D (W_0 x + b + U A x)`` in float64 from ``tensors`` (the module's, by path)."""
    weight = tensors[layout.base].double()
    a = tensors[layout.down].double()
    u = layout.place(tensors[layout.up].double(), weight.shape[0], a.shape[0])
    bias = 0.0 if layout.bias is None else tensors[layout.bias].double()
    x = x.double()
    out = x @ weight.T + bias + (x @ a.T) @ u.T
    if layout.magnitude is not None:
        effective = weight + u @ a
        out = out * (tensors[layout.magnitude].double() / effective.norm(dim=1))
    return out


def _close(value: torch.Tensor, expected: torch.Tensor, eps: float) -> bool:
    """Within 50 rounding units of the module's arithmetic (``eps``), relative to the largest."""
    tolerance = 50 * eps * (1.0 + float(expected.abs().max()))
    return value.shape == expected.shape and float((value - expected).abs().max()) <= tolerance


def _layout_from_output(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    base: str,
    down: str,
    up: str,
    bias: str | None,
    magnitude: str | None,
    eps: float,
) -> Layout | str:
    """Solve the probe's output for ``U`` (LoRA) or check DoRA's form with the stated ``s``;
    ``eps``: the rounding unit of the module's arithmetic."""
    weight, a, b = (tensors[name].double() for name in (base, down, up))
    if magnitude is not None:
        scale = _stated_scale(module)
        if scale is None or b.shape != (weight.shape[0], a.shape[0]):
            return "a magnitude vector but no stated scaling (scaling, alpha / rank) or a placed B"
        return Layout(base, down, up, bias, magnitude, scale)
    offset = 0.0 if bias is None else tensors[bias].double()
    x2 = x.double().reshape(-1, x.shape[-1])
    delta = y.double().reshape(-1, y.shape[-1]) - x2 @ weight.T - offset  # (k, m)
    u = torch.linalg.lstsq(x2 @ a.T, delta).solution.T  # (m, R)
    return _placement(u, b, base, down, up, bias, max(1e-4, eps))


def _placement(
    u: torch.Tensor,
    b: torch.Tensor,
    base: str,
    down: str,
    up: str,
    bias: str | None,
    rtol: float = 1e-4,
) -> Layout | str:
    """``U`` as ``s B`` placed: each row of B in one output row against one block of A, to a
    relative ``rtol`` (the solve's noise in the module's arithmetic)."""
    m, total = u.shape
    rows_b, block = b.shape
    if (rows_b, block) == (m, total):  # a plain layer
        scale = float((u * b).sum() / (b * b).sum())
        if not torch.allclose(
            u, scale * b, rtol=rtol, atol=rtol * float(u.abs().max() + 1e-12) / 100
        ):
            return "its update is not s B A for one s"
        return Layout(base, down, up, bias, None, scale)
    blocks = u.reshape(m, total // block, block)
    norms = blocks.norm(dim=2)  # (m, blocks)
    live = norms > 1e-6 * float(norms.max() + 1e-30)
    used = [int(i) for i in torch.nonzero(live.any(dim=1)).flatten()]
    if len(used) != rows_b or any(int(live[i].sum()) != 1 for i in used):
        return f"its update has {len(used)} rows reading one block of A each, B has {rows_b}"
    which = [int(torch.nonzero(live[i]).flatten()[0]) for i in used]
    placed = torch.stack([blocks[i, j] for i, j in zip(used, which, strict=True)])
    scale = float((placed * b).sum() / (b * b).sum())
    if not torch.allclose(placed, scale * b, rtol=rtol, atol=rtol * float(u.abs().max()) / 100):
        return "its update's rows are not B's rows, in order, times one s"
    return Layout(base, down, up, bias, None, scale, tuple(used), tuple(which), block)


@dataclass(frozen=True)
class LowRankTarget(AdaptedTarget):
    """A watched matrix of a verified LoRA-style layer (:func:`recognise`): its effective weight
    ``D (W_0 + U A)``, its update ``U A``. ``layer_module`` is the layer; ``layout`` how it holds
    the factors."""

    layout: Layout = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    @property
    def description(self) -> str:
        """``torchtune.LoRALinear lora r=4 s=2``: what ``format_targets`` prints."""
        kind = "dora" if self.layout.magnitude is not None else "lora"
        return f"{_kind(self.layer_module)} {kind} r={self.rank} s={self.layout.scale:.4g}"

    def _snapshot(self, copies: _Copies, dequantize: bool = True) -> tuple[Any, ...]:
        layer = self.layer_module
        rows = replace(self.rows, transposed=False)
        weight = self.parameter.detach()
        merged = bool(getattr(layer, "merged", False))
        base = rows.take(weight)
        if merged or self.parameter.requires_grad or rows.groups > 1 or self.in_gather:
            # the base moves under the snapshot, its rows are gathered, or it is whole only in
            # the gather (FSDP1, ZeRO-3)
            base = copies.copy(base)
        # The parameters themselves: a factor several targets share is then one object, copied once.
        return (base, *self._factors(copies, self.factor_parameters().__getitem__, weight))

    def factor_names(self) -> list[str]:
        """``up``, ``down`` and, for DoRA, ``magnitude``."""
        return ["up", "down"] + (["magnitude"] if self.layout.magnitude else [])

    def factor_parameters(self) -> dict[str, torch.Tensor]:
        """The parameters the update is read from, by name: ``B``, ``A`` and DoRA's magnitude."""
        layer, layout = self.layer_module, self.layout
        paths = {"up": layout.up, "down": layout.down, "magnitude": layout.magnitude}
        return {name: layer.get_parameter(paths[name]) for name in self.factor_names()}  # type: ignore[arg-type]

    def _factors(
        self, copies: _Copies, read: Callable[[str], torch.Tensor], like: torch.Tensor
    ) -> tuple[Any, ...]:
        layer, layout = self.layer_module, self.layout
        rows = replace(self.rows, transposed=False)
        m = self.parameter.shape[0]
        down = copies.concat([read("down")], dim=0, shared=True)
        if layout.rows is None:
            up = copies.copy(rows.take(read("up").detach()), layout.scale)
        elif copies.count_only:
            up = copies.copy(rows.take(like.new_empty((m, down.shape[0]))))
        else:
            up = copies.copy(rows.take(layout.place(read("up").detach(), m, down.shape[0])))
        magnitude = None
        if layout.magnitude is not None:
            magnitude = copies.copy(rows.take(read("magnitude").detach()[:, None]))[:, 0]
        merged = bool(getattr(layer, "merged", False))
        add = not merged and not getattr(layer, "disabled", False)
        return up, down, magnitude, add


def adapt_lowrank(target: Target, modules: Mapping[str, nn.Module]) -> Target:
    """``target`` as a :class:`LowRankTarget` when its parameter is the base of a verified
    LoRA-style layer (its owner, or the owner's parent as litgpt's ``linear``)."""
    if isinstance(target, AdaptedTarget):
        return target
    owner = target.parameter_name.rpartition(".")[0]
    for path in (owner, owner.rpartition(".")[0] if "." in owner else ""):
        layer = modules.get(path)
        if layer is None:
            continue
        layout = recognise(layer)
        if not isinstance(layout, Layout):
            continue
        if layer.get_parameter(layout.base) is not target.parameter:
            continue
        rank = int(layer.get_parameter(layout.up).shape[1])
        return LowRankTarget(**target.fields(), layer_module=layer, rank=rank, layout=layout)
    return target


def lowrank_role(module: nn.Module, parameter: torch.Tensor) -> tuple[str, Layout | str] | None:
    """For a parameter of a LoRA-style ``module``: ``("base", layout or reason)`` for its base
    weight, ``("factor", ...)`` for an adapter factor; ``None`` when the module is not one."""
    result = recognise(module)
    if result is None:
        return None
    parts = _structure(module)
    assert parts is not None
    base, down, up, _, magnitude = parts
    if module.get_parameter(base) is parameter:
        return "base", result
    if any(module.get_parameter(p) is parameter for p in (down, up, magnitude) if p):
        return "factor", result
    return None
