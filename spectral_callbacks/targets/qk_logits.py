r"""What an attention layer does to its logits between the Q/K projections and the softmax.

A head's logit between tokens i and j is :math:`s\,\hat q_i^\top P_{ij} \hat k_j`: the projections'
outputs (with their biases), normalized where the layer has QK-norm, rotated where it has RoPE,
times the logit scale :math:`s` the attention applies. Which bound on the logit the weights give
depends on each of these (``functional/circuits.py``), so each is read from the module, never
assumed:

* **the scale**: the attention module's own declaration - ``scaling`` (every Hugging Face
  attention: GPT-2's ``scale_attn_weights`` and ``scale_attn_by_inverse_layer_idx``, Gemma 2/3's
  ``query_pre_attn_scalar``, Granite's ``attention_multiplier`` and DeepSeek's mscale folded in),
  ``softmax_scale``, ``scale``, ``attention_multiplier``; its config's ``query_pre_attn_scalar``
  or ``attention_multiplier``; ``nn.MultiheadAttention``'s fixed :math:`1/\sqrt{d_h}`. Where none
  is found the scale is unknown, and no value is logged as scaled or called a bound.
* **a rotation** (RoPE): a rotary attribute of the module (``rope_dim``, ``qk_rope_head_dim``,
  ``rotary_dim``, ``rotary_ndims``: 0 means none; a ``rotary_emb`` submodule) or of its config
  (``rope_parameters``, ``rope_theta``, ``rotary_pct``, ``partial_rotary_factor``,
  ``position_embedding_type="rotary"``). A rotation the module does not declare is not seen.
* **QK-norm**: a ``q_norm``/``k_norm`` (``q_layernorm``/``k_layernorm``, ``query_layernorm``/
  ``key_layernorm``) submodule; its gain is read as ``weight`` or ``1 + weight`` (Gemma), whichever
  its own forward computes on a probe vector, and its shift as ``bias``.
* **the biases**: each projection module's ``bias``, the rows of the target's.

Example::

    >>> from torch import nn
    >>> read_scale(nn.MultiheadAttention(8, num_heads=2), head_rows=4)
    (0.5, 'nn.MultiheadAttention: 1/sqrt(head_dim)')
    >>> class Attention(nn.Module):
    ...     scaling = 0.125
    >>> read_scale(Attention(), head_rows=4)
    (0.125, 'scaling')
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from spectral_callbacks.targets.forward_scale import ForwardScale
from spectral_callbacks.targets.target import Target

__all__ = ["LogitScale", "NormGain", "bias_of", "norm_gains", "read_rotary", "read_scale"]

#: Attributes an attention module declares its logit scale under, in the order they are read.
SCALE_ATTRIBUTES = ("scaling", "softmax_scale", "scale", "attention_multiplier")
#: Integer attributes counting the rotated channels (0: no rotation).
_ROTARY_DIMS = ("rope_dim", "qk_rope_head_dim", "rotary_dim", "rotary_ndims")
_ROTARY_CONFIG = ("rope_parameters", "rope_theta", "rotary_pct", "partial_rotary_factor")
_QUERY_NORMS = ("q_norm", "q_layernorm", "query_layernorm", "query_norm")
_KEY_NORMS = ("k_norm", "k_layernorm", "key_layernorm", "key_norm")


def _number(value: Any) -> float | None:
    """``value`` as a positive finite float, or None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def read_scale(module: nn.Module, head_rows: int) -> tuple[float | None, str]:
    """The logit scale ``module`` declares and where it was read, or ``(None, "")``.

    Args:
        module: the attention module.
        head_rows: the query rows of one head (``nn.MultiheadAttention``'s ``d_h``).
    """
    if isinstance(module, nn.MultiheadAttention):  # its forward scales by 1/sqrt(head_dim)
        return 1.0 / math.sqrt(head_rows), "nn.MultiheadAttention: 1/sqrt(head_dim)"
    for attribute in SCALE_ATTRIBUTES:
        value = _number(getattr(module, attribute, None))
        if value is not None:
            return value, attribute
    config = getattr(module, "config", None)
    scalar = _number(getattr(config, "query_pre_attn_scalar", None))
    if scalar is not None:
        return scalar**-0.5, "config.query_pre_attn_scalar ** -0.5"
    multiplier = _number(getattr(config, "attention_multiplier", None))
    if multiplier is not None:
        return multiplier, "config.attention_multiplier"
    return None, ""


@dataclass(eq=False)
class LogitScale:
    """One attention layer's logit scale: what its module declares (``read_scale``) and what its
    recorded forward applies (``forward_scale.scale_of_call``), which wins where it is read.

    Mutable: a run whose targets come from the names reads the forward's scale at its first
    forward, after the layers are found and before their first snapshot copies the scale.
    """

    declared: float | None
    declared_as: str = ""
    applied: ForwardScale | None = None

    @property
    def value(self) -> float | None:
        """The scale the QK values are multiplied by (``None``: not read)."""
        return self.applied.value if self.applied is not None else self.declared

    @property
    def source(self) -> str:
        """Where ``value`` was read (``"forward: ..."`` or the module's attribute)."""
        if self.applied is not None:
            return f"forward: {self.applied.source}"
        return self.declared_as

    def contradiction(self) -> str:
        """``""``, or what the forward applies where the module declares another scale."""
        declared, applied = self.declared, self.applied
        if (
            declared is None
            or applied is None
            or math.isclose(declared, applied.value, rel_tol=1e-6)
        ):
            return ""
        return f"declares {declared:.6g} ({self.declared_as}), its forward applies {applied.value:.6g} ({applied.source})"


def read_rotary(module: nn.Module) -> bool:
    """Whether ``module`` declares a position-dependent rotation of its queries and keys."""
    for attribute in _ROTARY_DIMS:  # the module's own count decides, 0 included
        value = getattr(module, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value > 0
    if isinstance(getattr(module, "rotary_emb", None), nn.Module):
        return True
    config = getattr(module, "config", None)
    if config is None:
        return False
    if getattr(config, "position_embedding_type", None) == "rotary":
        return True
    return any(getattr(config, attribute, None) for attribute in _ROTARY_CONFIG)


@dataclass(frozen=True)
class NormGain:
    """A QK-norm module's parameters: gain ``weight + offset`` (1 where it has no weight) and
    shift ``bias`` (0 where it has none), over ``width`` channels."""

    weight: Tensor | None
    bias: Tensor | None
    offset: float
    width: int

    def copy(self) -> Tensor:
        """``(2, width)``: the current gain and shift, copied (the snapshot's copy)."""
        with torch.no_grad():
            gain = (
                torch.ones(self.width, dtype=torch.float64)
                if self.weight is None
                else self.weight.detach().double() + self.offset
            )
            shift = torch.zeros_like(gain) if self.bias is None else self.bias.detach().double()
        return torch.stack([gain, shift])

    def nbytes(self) -> int:
        return 2 * 8 * self.width


def norm_gains(module: nn.Module) -> tuple[NormGain, NormGain] | None | str:
    """The query and key norms' gains of an attention with QK-norm; ``None`` without QK-norm; a
    reason (``str``) where it has one whose gain is not read."""
    query_norm, key_norm = (_child(module, names) for names in (_QUERY_NORMS, _KEY_NORMS))
    if query_norm is None and key_norm is None:
        return None
    if query_norm is None or key_norm is None:
        return "only one of its query and key is normalized"
    gains = [_gain(norm) for norm in (query_norm, key_norm)]
    for gain in gains:
        if isinstance(gain, str):
            return gain
    query, key = gains
    assert isinstance(query, NormGain) and isinstance(key, NormGain)
    return query, key


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _gain(norm: nn.Module) -> NormGain | str:
    """How ``norm`` computes :math:`\\gamma \\odot u + \\beta`: read from its output on a probe
    (``+-c`` alternating, so mean 0 and RMS ``c``), as ``weight`` or ``1 + weight``."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    weight = weight if isinstance(weight, Tensor) and weight.ndim == 1 else None
    bias = bias if isinstance(bias, Tensor) and bias.ndim == 1 else None
    width = next((t.numel() for t in (weight, bias) if t is not None), None)
    name = type(norm).__name__
    if width is None or width % 2 or weight is None or weight.device.type == "meta":
        return f"its QK-norm ({name}) has no gain to read"
    probe = torch.ones(width, dtype=weight.dtype, device=weight.device)
    probe[1::2] = -1.0
    probe = probe * 1e3  # RMS 1e3: the norm's epsilon is negligible beside it
    try:
        with torch.no_grad():
            plus, minus = norm(probe).double(), norm(-probe).double()
    except Exception as error:  # a norm that takes other shapes: its gain is not read
        return f"its QK-norm ({name}) did not run on a ({width},) probe: {error}"
    unit = probe.double() / 1e3
    gain, shift = (plus - minus) / 2 * unit, (plus + minus) / 2
    stored = weight.detach().double()
    expected_shift = torch.zeros_like(shift) if bias is None else bias.detach().double()
    if not torch.allclose(shift, expected_shift, rtol=1e-3, atol=1e-5):
        return f"its QK-norm ({name}) shifts by other than its bias"
    for offset in (0.0, 1.0):
        if torch.allclose(gain, stored + offset, rtol=1e-3, atol=1e-5):
            return NormGain(weight, bias, offset, width)
    return f"its QK-norm ({name}) scales by neither its weight nor 1 + weight"


@dataclass(frozen=True)
class BiasRows:
    """The rows of a projection's bias that one target's rows are (fused weights split)."""

    bias: Tensor
    rows: Any  # targets.target.Rows, taken on the bias as on a (out, 1) weight

    def copy(self) -> Tensor:
        with torch.no_grad():
            return self.rows.take(self.bias.detach()[:, None])[:, 0].double()

    def nbytes(self) -> int:
        return 8 * self.rows.shape_of((self.bias.numel(), 1))[0]


def bias_of(target: Target, modules: dict[str, nn.Module]) -> BiasRows | None:
    """The bias of the projection ``target`` is the weight of, its rows as the target's."""
    owner = modules.get(target.parameter_name.rpartition(".")[0])
    bias = getattr(owner, "bias", None)
    if not isinstance(bias, Tensor) or bias.ndim != 1:
        return None
    rows = dataclasses.replace(target.rows, transposed=False)
    if rows.shape_of((bias.numel(), 1))[0] != target.shape[0]:
        return None  # not the bias of these rows (an unusual layout): none is read
    return BiasRows(bias, rows)
