"""Which role each weight plays: built-in name rules per architecture and fused-projection splits.

A rule maps a name pattern to a role (``"O"``), a ``Split`` (one stored parameter holding several
matrices along its output dimension), a ``Skip`` (deliberately not watched, with the reason), or a
function of the ``Context`` that returns one of those (for layouts that depend on head counts).
Patterns are fnmatch-style and match the parameter name or any dotted suffix of it, so
``attn.c_proj.weight`` matches ``transformer.h.3.attn.c_proj.weight`` but not
``transformer.h.3.mlp.c_proj.weight``. Built-in rules are tried in order; the first match wins.

Head and latent sizes come from the owning module or its ancestors, by attribute (``num_heads``,
``n_head``, ``kv_lora_rank`` ...) or from their ``config`` (Hugging Face ``config.num_attention_heads``).
docs/targets.md has the table of architectures and roles.

Example::

    >>> import torch
    >>> Split(("Q", "K", "V")).parts("c_attn.weight", (96, 32))
    [('Q', Rows(start=0, stop=32, groups=1, transposed=False)), ('K', Rows(start=32, stop=64, groups=1, transposed=False)), ('V', Rows(start=64, stop=96, groups=1, transposed=False))]
    >>> Split(("K", "V"), sizes=(8, 6), groups=4).parts("kv_b_proj.weight", (56, 8))[1]
    ('V', Rows(start=8, stop=14, groups=4, transposed=False))
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from spectral_callbacks.targets.adapted import is_tuner_layer, unsupported_reason
from spectral_callbacks.targets.experts import listed_expert
from spectral_callbacks.targets.lowrank import Layout, lowrank_role
from spectral_callbacks.targets.quantized import unreadable_reason
from spectral_callbacks.targets.target import Rows, Skip, check_role


@dataclass(frozen=True)
class Split:
    """One stored parameter holding several matrices stacked along its output dimension.

    The output dimension is ``groups`` equal chunks (1 = one block of rows; the number of heads for
    per-head interleaving like GPT-NeoX ``(heads, 3, head_dim)``); each chunk holds the parts in
    order with ``sizes`` rows each (equal parts when ``None``).

    Args:
        roles: the role of each part; ``None`` leaves that part unwatched.
        sizes: rows of each part within one chunk; default ``None`` splits the chunk equally.
        groups: number of interleaved chunks along the output dimension; default 1.
        transposed: the weight is stored ``(in, out)``; default ``None`` detects Hugging Face
            ``Conv1D`` (GPT-2) and assumes ``(out, in)`` otherwise.

    Example::

        >>> Split(("Q", "K", "V"), groups=4).parts("query_key_value.weight", (96, 32))[0]
        ('Q', Rows(start=0, stop=8, groups=4, transposed=False))
    """

    roles: tuple[str | None, ...]
    sizes: tuple[int, ...] | None = None
    groups: int = 1
    transposed: bool | None = None

    def parts(
        self, parameter_name: str, shape: tuple[int, int], transposed: bool = False
    ) -> list[tuple[str, Rows]]:
        """``(role, Rows)`` of each watched part of an ``(out, in)`` matrix of ``shape``.

        Raises:
            ValueError: the sizes do not add up to the parameter's output dimension.
        """
        roles = tuple(self.roles)
        for role in roles:
            if role is not None:
                check_role(role, f"Split for {parameter_name}")
        out = shape[0]
        if not roles or self.groups < 1 or out % self.groups:
            raise ValueError(
                f"Split{roles} with groups={self.groups} does not fit {parameter_name} with "
                f"{out} output rows: `groups` must divide {out} and `roles` must not be empty"
            )
        chunk = out // self.groups
        sizes = self.sizes
        if sizes is None:
            if chunk % len(roles):
                raise ValueError(
                    f"{parameter_name}: {chunk} rows per group do not split into {len(roles)} "
                    f"equal parts {roles}; pass Split(..., sizes=...)"
                )
            sizes = (chunk // len(roles),) * len(roles)
        if len(sizes) != len(roles) or sum(sizes) != chunk:
            raise ValueError(
                f"{parameter_name}: Split sizes {tuple(sizes)} for roles {roles} must have one "
                f"size per role and add up to the {chunk} rows of each of {self.groups} groups"
            )
        result, start = [], 0
        for role, size in zip(roles, sizes, strict=True):
            if role is not None:
                result.append((role, Rows(start, start + size, self.groups, transposed)))
            start += size
        return result


@dataclass(frozen=True)
class Context:
    """What a rule function sees: the parameter and the modules that own it.

    Attributes:
        name: the parameter name with wrapper segments (``_orig_mod.``, DDP ``module.``) removed.
        parameter: the parameter itself.
        modules: the module that owns the parameter first, then each ancestor up to the root.
    """

    name: str
    parameter: torch.Tensor
    modules: tuple[nn.Module, ...]

    def lookup(self, *attributes: str) -> int | None:
        """The first int found under one of ``attributes`` on the owner, its ancestors, or their ``config``."""
        for module in self.modules:
            for source in (module, getattr(module, "config", None)):
                if source is None:
                    continue
                for attribute in attributes:
                    value = getattr(source, attribute, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        return value
        return None

    @property
    def in_features(self) -> int:
        """Input columns of the parameter as an ``(out, in)`` matrix."""
        return (
            self.parameter.shape[0] if is_transposed(self.modules[0]) else self.parameter.shape[1]
        )

    @property
    def out_features(self) -> int:
        """Output rows of the parameter as an ``(out, in)`` matrix (``Conv1D`` is stored transposed)."""
        return (
            self.parameter.shape[1] if is_transposed(self.modules[0]) else self.parameter.shape[0]
        )


Decision = str | Split | Skip
# A rule is a decision, or a function of the context giving one (None: the rule does not apply,
# try the next; fnmatch's `*` also spans dots, so a function checks what its pattern cannot).
Rule = Decision | Callable[[Context], Decision | None]

HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
# litgpt's Config names the K/V heads n_query_groups.
KV_HEADS = ("num_key_value_heads", "n_kv_head", "n_kv_heads", "num_kv_heads", "n_query_groups")
HEAD_DIM = ("head_dim", "head_size")


def is_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight ``(in, out)``: Hugging Face ``Conv1D`` (GPT-2)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _fused_qkv(ctx: Context) -> Decision:
    """Rows ``[q; k; v]`` one after the other (GPT-2/nanoGPT ``c_attn``, timm ``qkv``, MHA ``in_proj``).

    Equal thirds only when that is certain (out = 3 * in, or 3 * heads * head_dim); grouped K/V
    (Phi-3 ``qkv_proj``) is sized from the head counts; anything else is left out with a warning
    rather than split wrongly (e.g. a multi-query ``c_attn`` of d + 2 * head_dim rows).
    """
    out, inp = ctx.out_features, ctx.in_features
    heads, kv_heads = ctx.lookup(*HEADS), ctx.lookup(*KV_HEADS)
    head_dim = ctx.lookup(*HEAD_DIM)
    if heads and kv_heads and kv_heads != heads:
        if out % (heads + 2 * kv_heads) == 0:
            head_dim = out // (heads + 2 * kv_heads)
            sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
            return Split(("Q", "K", "V"), sizes=sizes)
    elif out == 3 * inp or (heads and head_dim and out == 3 * heads * head_dim):
        return Split(("Q", "K", "V"))
    return Skip(
        f"fused QKV of unknown layout ({out} rows for {inp} inputs, heads={heads}, "
        f"kv_heads={kv_heads}); describe it with mapping={{pattern: Split(...)}}",
        warn=True,
    )


def _per_head_qkv(ctx: Context) -> Decision:
    """GPT-NeoX/Pythia/Bloom ``query_key_value``: rows ``(heads, 3, head_dim)``."""
    out, inp = ctx.out_features, ctx.in_features
    heads, kv_heads = ctx.lookup(*HEADS), ctx.lookup(*KV_HEADS)
    head_dim = ctx.lookup(*HEAD_DIM)
    if heads is None and head_dim and out % (3 * head_dim) == 0:
        heads = out // (3 * head_dim)
    if heads and head_dim is None and inp % heads == 0:
        head_dim = inp // heads
    grouped = kv_heads is not None and kv_heads != heads  # Falcon-style layouts differ
    if heads and head_dim and out == 3 * heads * head_dim and not grouped:
        return Split(("Q", "K", "V"), groups=heads)
    return Skip(
        f"per-head fused QKV but {out} rows are not (heads={heads}, 3, head_dim={head_dim})"
        f"{' with grouped K/V' if grouped else ''}; describe it with mapping={{pattern: Split(...)}}",
        warn=True,
    )


def _falcon_qkv(ctx: Context) -> Decision | None:
    """Falcon ``query_key_value``, split as ``FalconAttention.forward`` reads it.

    ``new_decoder_architecture`` (40B/180B): per K/V group ``[q x heads/kv_heads; k; v]``;
    ``multi_query`` (7B): ``[q x heads; k; v]`` with one K/V head; else per head ``[q; k; v]``.
    Only where the attention module carries those flags (so the split is the model's, never
    guessed); other models fall through to the GPT-NeoX rule.
    """
    attention = next((m for m in ctx.modules if hasattr(m, "new_decoder_architecture")), None)
    if attention is None:
        return None
    heads, head_dim = getattr(attention, "num_heads", None), getattr(attention, "head_dim", None)
    kv_heads = getattr(attention, "num_kv_heads", None)
    out = ctx.out_features
    if not (isinstance(heads, int) and isinstance(head_dim, int) and isinstance(kv_heads, int)):
        return None
    if attention.new_decoder_architecture:
        per_group = heads // kv_heads
        if out == kv_heads * (per_group + 2) * head_dim:
            sizes = (per_group * head_dim, head_dim, head_dim)
            return Split(("Q", "K", "V"), sizes=sizes, groups=kv_heads)
    elif attention.multi_query:
        if out == (heads + 2) * head_dim:
            return Split(("Q", "K", "V"), sizes=(heads * head_dim, head_dim, head_dim))
    elif out == 3 * heads * head_dim:
        return Split(("Q", "K", "V"), groups=heads)
    return Skip(
        f"Falcon query_key_value with {out} rows does not fit heads={heads}, "
        f"num_kv_heads={kv_heads}, head_dim={head_dim}; describe it with mapping=",
        warn=True,
    )


_LISTS = (nn.Sequential, nn.ModuleList)


def _mlp_linears(entries: list[nn.Module]) -> list[nn.Linear]:
    """The Linear layers of an MLP written as a list of entries, in order: each entry a Linear,
    an activation that carries its own input projection as ``proj`` (diffusers' ``GELU``,
    ``GEGLU``, ``SwiGLU``, x-transformers' ``GLU``), or a list of such (x-transformers'
    ``Sequential(Linear, act)`` as its first entry); norms, activations and dropouts hold none."""
    found = []
    for entry in entries:
        if isinstance(entry, _LISTS):
            found += _mlp_linears(list(entry))
            continue
        linear = entry if isinstance(entry, nn.Linear) else getattr(entry, "proj", None)
        if isinstance(linear, nn.Linear):
            found.append(linear)
    return found


def _flat(entries: list[nn.Module]) -> list[nn.Module]:
    """The entries with those of any list among them, one level down."""
    return [
        inner for entry in entries for inner in (entry if isinstance(entry, _LISTS) else [entry])
    ]


def _is_glu(entries: list[nn.Module]) -> bool:
    """An entry names itself a gated linear unit (``GEGLU``, ``SwiGLU``, ``GLU``): it halves its
    input by ``chunk(2)`` into ``[value; gate]`` (diffusers, x-transformers, lucidrains)."""
    return any("GLU" in type(entry).__name__ for entry in entries)


def _sequential_mlp(ctx: Context, shaped_only: bool = False) -> Decision | None:
    """An MLP written as a list of entries, ``nn.Sequential(Linear, act, Dropout, Linear)`` or
    diffusers' ``ff.net = ModuleList([GELU(proj), Dropout, Linear])``: first Linear up, last down.

    A first Linear with twice the rows the last one reads, beside an entry named a GLU, holds
    ``[value; gate]`` (``hidden, gate = proj(x).chunk(2)``): ``MLP_up`` then ``MLP_gate``.
    ``shaped_only``: for a generic container name (``net``), decide only where the two Linears
    have an MLP's shapes (d -> f -> d, or d -> 2f -> d with a GLU), else leave it to other rules.
    """
    # The Linear is an entry of the list (``ff.3``), or an entry's ``proj`` (``ff.net.0.proj``).
    segments = ctx.name.split(".")[-3:-1]
    if segments[-1].isdigit():
        at = 1
    elif segments[-1] == "proj" and segments[0].isdigit():
        at = 2
    else:
        return None
    container = ctx.modules[at] if len(ctx.modules) > at else None
    if not isinstance(container, _LISTS):
        return None  # not a Linear directly inside a list: let the other rules decide
    # A list inside the MLP's list (x-transformers' ``ff.0 = Sequential(Linear, act)``): the
    # outer list holds the MLP.
    outer = ctx.modules[at + 1] if len(ctx.modules) > at + 1 else None
    if isinstance(outer, _LISTS) and len(_mlp_linears(list(container))) < 2:
        container = outer
    entries = list(container)
    linears = _mlp_linears(entries)
    if len(linears) != 2 or ctx.modules[0] not in linears:
        if shaped_only:
            return None
        return Skip(
            f"an MLP Sequential with {len(linears)} Linear layers (2 expected: up, down); give "
            "their roles with mapping=",
            warn=True,
        )
    up, down = linears
    gated = up.out_features == 2 * down.in_features and _is_glu(_flat(entries))
    shaped = up.in_features == down.out_features and (up.out_features == down.in_features or gated)
    if shaped_only and not shaped:
        return None
    if ctx.modules[0] is down:
        return "MLP_down"
    return Split(("MLP_up", "MLP_gate")) if gated else "MLP_up"


def _named_mlp_net(ctx: Context) -> Decision | None:
    """``net.<i>`` of a module whose class names it an MLP (lucidrains' ``FeedForward.net``,
    ``Mlp``, ``FFN``): a list MLP, where its two Linears have an MLP's shapes."""
    holder = next(
        (m for m in ctx.modules[2:4] if isinstance(getattr(m, "net", None), nn.Module)), None
    )
    if holder is None or not re.search(r"feed_?forward|mlp|ffn|^ff$", type(holder).__name__, re.I):
        return None
    return _sequential_mlp(ctx, shaped_only=True)


def _is_cross_attention(ctx: Context) -> bool:
    """The attention module owning the weight says it attends to another stream: diffusers'
    ``Attention.is_cross_attention`` (``attn2`` of a ``BasicTransformerBlock`` with a context)."""
    return any(getattr(module, "is_cross_attention", False) is True for module in ctx.modules[1:4])


def _to(role: str) -> Callable[[Context], Decision]:
    """``to_q``/``to_k``/``to_v``/``to_out`` (diffusers, lucidrains, x-transformers): ``role``,
    ``_cross`` where the attention module declares itself cross-attention."""

    def rule(ctx: Context) -> Decision:
        return f"{role}_cross" if _is_cross_attention(ctx) else role

    return rule


def _to_qkv(ctx: Context) -> Decision:
    """lucidrains' and x-transformers' fused ``to_qkv``: ``q, k, v = to_qkv(x).chunk(3, dim=-1)``,
    rows ``[q; k; v]`` in equal thirds of heads x dim_head each (which need not equal the model
    width), unless the module declares grouped K/V heads (then sized from them)."""
    heads, kv_heads = ctx.lookup(*HEADS, "heads"), ctx.lookup(*KV_HEADS)
    if (kv_heads is None or kv_heads == heads) and ctx.out_features % 3 == 0:
        return Split(("Q", "K", "V"))
    return _fused_qkv(ctx)


def _to_kv(ctx: Context) -> Decision:
    """Fused ``to_kv``: ``k, v = to_kv(context).chunk(2, dim=-1)``, rows ``[k; v]``."""
    roles = ("K_cross", "V_cross") if _is_cross_attention(ctx) else ("K", "V")
    if ctx.out_features % 2 == 0:
        return Split(roles)
    return Skip(
        f"fused to_kv with an odd number of rows ({ctx.out_features}); describe it with "
        "mapping={pattern: Split(...)}",
        warn=True,
    )


def _gate_up(ctx: Context) -> Decision:
    """Phi-3 style ``gate_up_proj``: rows ``[gate; up]``."""
    return Split(("MLP_gate", "MLP_up"))


def _kv_a(ctx: Context) -> Decision:
    """MLA / GLA ``kv_a_proj_with_mqa``: rows ``[latent (kv_lora_rank); shared rope key]``."""
    rank, rope = ctx.lookup("kv_lora_rank"), ctx.lookup("qk_rope_head_dim")
    if rank is not None and rope is not None and rank + rope == ctx.out_features:
        return Split(("KV_down", "K_rope"), sizes=(rank, rope))
    return Skip(
        f"MLA down-projection with {ctx.out_features} rows but kv_lora_rank={rank} + "
        f"qk_rope_head_dim={rope} do not add up; describe it with mapping=",
        warn=True,
    )


def _kv_b(ctx: Context, suffix: str = "") -> Decision:
    """MLA ``kv_b_proj``: rows per head ``[k_nope; v]`` (DeepSeek-V2/V3)."""
    nope, value = ctx.lookup("qk_nope_head_dim"), ctx.lookup("v_head_dim")
    out = ctx.out_features
    if nope and value and out % (nope + value) == 0:
        return Split(
            (f"K{suffix}", f"V{suffix}"), sizes=(nope, value), groups=out // (nope + value)
        )
    return Skip(
        f"MLA up-projection with {out} rows is not a multiple of qk_nope_head_dim={nope} + "
        f"v_head_dim={value}; describe it with mapping=",
        warn=True,
    )


def _kv_b_group(ctx: Context) -> Decision | None:
    """GLA ``kv_b_proj.<j>``: the up-projection of latent group j, rows per head ``[k_nope; v]``."""
    group = ctx.name.split(".")[-2]
    return _kv_b(ctx, suffix=f"_g{group}") if group.isdigit() else None


def _active_copies(wrapper: nn.Module) -> list[str]:
    """The adapter names whose copy a PEFT ``ModulesToSaveWrapper`` uses: its ``active_adapters``
    (peft 0.15 on), else its one ``active_adapter`` (a name, or a list of them)."""
    active = getattr(wrapper, "active_adapters", None)
    if active is None:
        active = getattr(wrapper, "active_adapter", None)
    if active is None:
        return []
    return [active] if isinstance(active, str) else list(active)


def _adapter_part(ctx: Context) -> Skip | None:
    """The built-in rule for the parameters of a tuner layer other than its base weight.

    Adapter factors (``lora_A``, ``lora_B``, DoRA's magnitude) are watched through the adapted
    target; an adapted layer that cannot be read as base + factors is refused here, on its base
    weight, with the reason (warned about, since it looks like a target).
    """
    for position, module in enumerate(ctx.modules[1:], start=1):
        copies = getattr(module, "modules_to_save", None)
        if isinstance(copies, nn.ModuleDict) and hasattr(module, "original_module"):
            # PEFT modules_to_save: the active trained copy is a plain target (its name is
            # cleaned to the module's own); the frozen original and inactive copies are not.
            child = ctx.modules[position - 1]
            active = _active_copies(module)
            if child is copies and position >= 2:
                name = next((k for k, v in copies.items() if v is ctx.modules[position - 2]), None)
                if name in active:
                    return None
                return Skip(f"modules_to_save copy of inactive adapter {name!r}")
            return Skip("original of a PEFT modules_to_save copy (the trained copy is watched)")
        if not is_tuner_layer(module):
            continue
        child = ctx.modules[position - 1]
        if child is getattr(module, "base_layer", None):
            reason = unsupported_reason(module)
            return None if reason is None else Skip(reason, warn=True)
        return Skip(f"adapter of the PEFT layer {type(module).__name__}: watched through its base")
    return None


def _lowrank_part(ctx: Context) -> Decision | None:
    """The built-in rule for a LoRA-style layer of another library (targets/lowrank.py).

    Its base weight maps by the rules of the layer's own name, as if the layer were a plain
    Linear (litgpt's ``attn.qkv.linear.weight`` as ``attn.qkv.weight``); its factors are watched
    through it. A layer whose output is not ``W_0 x + s B A x`` is refused on its base weight,
    with the reason (warned about, since it looks like a target).
    """
    for position, module in enumerate(ctx.modules[:2]):
        found = lowrank_role(module, ctx.parameter)
        if found is None:
            continue
        part, result = found
        if part == "factor":
            if isinstance(result, Layout):
                return Skip(f"adapter factor of {type(module).__name__}: watched through its base")
            return Skip(result)
        if isinstance(result, str):
            return Skip(result, warn=True)
        segments = ctx.name.split(".")
        name = ".".join([*segments[: len(segments) - 1 - position], "weight"])
        inner = Context(name, ctx.parameter, ctx.modules[position:])
        for pattern, rule in BUILTIN_RULES:
            if rule is _lowrank_part or match_length(pattern, inner.name) is None:
                continue
            decision = rule(inner) if callable(rule) else rule
            if decision is not None:
                return decision
        return None
    return None


def _titan_wqkv(ctx: Context) -> Decision:
    """torchtitan ``FusedQKVLinear.wqkv``: rows ``(n_kv_heads, heads/kv_heads + 2, head_dim)``,
    per K/V group ``[q x heads/kv_heads; k; v]`` (its forward's view and split)."""
    fused = ctx.modules[1] if len(ctx.modules) > 1 else None
    per_kv, width = getattr(fused, "heads_per_kv", None), getattr(fused, "head_dim", None)
    out = ctx.out_features
    if isinstance(per_kv, int) and isinstance(width, int) and out % ((per_kv + 2) * width) == 0:
        groups = out // ((per_kv + 2) * width)
        return Split(("Q", "K", "V"), sizes=(per_kv * width, width, width), groups=groups)
    return Skip(
        f"torchtitan wqkv with {out} rows but heads_per_kv={per_kv}, head_dim={width}; "
        "describe it with mapping=",
        warn=True,
    )


def _feed_forward_w1(ctx: Context) -> Decision:
    """torchtune ``FeedForward``: ``w2(act(w1 x) * w3 x)``; without ``w3`` (CLIP) w1 is the up."""
    feed_forward = ctx.modules[1] if len(ctx.modules) > 1 else None
    return "MLP_gate" if getattr(feed_forward, "w3", None) is not None else "MLP_up"


def _quantized(ctx: Context) -> Skip | None:
    """The built-in rule for a weight stored quantized that no adapter wraps: a bitsandbytes
    4-/8-bit weight maps by the rules of its name and is dequantized per snapshot
    (``targets/quantized.py``); a format without a public dequantization (HQQ, GPTQ, AWQ, float8
    storage) is refused (warned about, since it looks like a target)."""
    reason = unreadable_reason(ctx.modules[0])
    if reason is None or any(is_tuner_layer(module) for module in ctx.modules[1:]):
        return None  # a tuner layer's base: _adapter_part decided (dequantized, or refused)
    return Skip(reason, warn=True)


# A cross-attention module is written like the block's self-attention under another name: its
# weights map by the self-attention's rule, with each role marked ``_cross``.
_SELF_OF_CROSS = {
    "EncDecAttention": "SelfAttention",  # T5
    "encoder_attn": "self_attn",  # BART, mBART, Whisper, Marian, Pegasus
    "multihead_attn": "self_attn",  # torch.nn.TransformerDecoderLayer
    "crossattention": "attention",  # BERT-style decoders (BertGeneration, RoBERTa as decoder)
}


def _cross(ctx: Context) -> Decision | None:
    """The self-attention rule of the same weight, each role with ``_cross`` appended."""
    segments = ctx.name.split(".")
    at = max(i for i, segment in enumerate(segments) if segment in _SELF_OF_CROSS)
    segments[at] = _SELF_OF_CROSS[segments[at]]
    inner = Context(".".join(segments), ctx.parameter, ctx.modules)
    for pattern, rule in BUILTIN_RULES:
        if pattern.startswith("crossattention.") or match_length(pattern, inner.name) is None:
            continue
        decision = rule(inner) if callable(rule) else rule
        if decision is None:
            continue
        if isinstance(decision, str):
            return f"{decision}_cross"
        if isinstance(decision, Split):
            cross = tuple(None if role is None else f"{role}_cross" for role in decision.roles)
            return replace(decision, roles=cross)
        return decision
    return None


def _listed_expert(ctx: Context) -> Decision | None:
    """One expert's Linear in a list of expert MLPs: its role (``find_targets`` numbers the
    expert), or a warned skip for a module name no rule reads."""
    found = listed_expert(ctx.name)
    if found is not None and found[1] is not None:
        return found[1]
    return Skip(
        "MoE expert of unknown layout (not w1/w2/w3, gate/up/down_proj, wi/wo, fc1/fc2); "
        "describe it with mapping=",
        warn=True,
    )


def _router(ctx: Context) -> Decision | None:
    """A Linear d -> E beside a mixture's experts (E rows: a 3-D experts tensor of E slices, or
    a list of E expert MLPs, in the same module): the router."""
    moe = ctx.modules[1] if len(ctx.modules) > 1 else None
    if moe is None:
        return None
    experts = ctx.out_features
    for name, child in moe.named_children():
        if child is ctx.modules[0]:
            continue
        if "experts" in name and isinstance(child, nn.ModuleList) and len(child) == experts:
            return "Router"
        if any(p.dim() == 3 and p.shape[0] == experts for p in child.parameters()):
            return "Router"
    return None


_ROUTER = Skip("MoE router")

# (pattern, rule), first match wins. Shared leaf names (c_proj, dense, proj) carry their parent.
BUILTIN_RULES: tuple[tuple[str, Rule], ...] = (
    # PEFT tuner layers (targets/adapted.py): their adapter factors are watched through the base.
    ("*", _adapter_part),
    # LoRA-style layers of other libraries (torchtune, litgpt, hand-written): targets/lowrank.py.
    ("*", _lowrank_part),
    # Quantized layers outside PEFT (inside it, _adapter_part refuses them naming the tuner layer).
    ("*", _quantized),
    # Left out on purpose: listed in the summary, not warned about.
    # Mixture of experts: the router, and shared experts under roles of their own (DeepSeek's
    # shared_experts, Qwen2-MoE's shared_expert and its one-row gate). Routed experts are expert
    # targets (targets/experts.py), stored as 3-D tensors or as a list of expert MLPs.
    ("experts.*", _listed_expert),
    ("mlp.gate.weight", "Router"),
    ("block_sparse_moe.gate.weight", "Router"),
    ("moe.router.gate.weight", "Router"),  # torchtitan
    ("router.*", _ROUTER),
    ("shared_expert_gate.weight", Skip("MoE shared expert's gate (one row)")),
    ("shared_expert*.gate_proj.weight", "MLP_shared_gate"),
    ("shared_expert*.up_proj.weight", "MLP_shared_up"),
    ("shared_expert*.down_proj.weight", "MLP_shared_down"),
    ("shared_experts.w1.weight", "MLP_shared_gate"),  # torchtitan's FeedForward
    ("shared_experts.w3.weight", "MLP_shared_up"),
    ("shared_experts.w2.weight", "MLP_shared_down"),
    # Cross-attention (decoders of encoder-decoder models): Q_cross, K_cross, V_cross, O_cross.
    # GPT-2 as a decoder (VisionEncoderDecoder): q_attn alone, c_attn rows [k; v] (Conv1D).
    ("crossattention.q_attn.weight", "Q_cross"),
    ("crossattention.c_attn.weight", Split(("K_cross", "V_cross"))),
    ("crossattention.c_proj.weight", "O_cross"),
    ("EncDecAttention.*", _cross),
    ("encoder_attn.*", _cross),
    ("multihead_attn.*", _cross),
    ("crossattention.*", _cross),
    # GPT-2 (Conv1D, stored (in, out)) and nanoGPT (Linear): c_attn rows [q; k; v].
    ("attn.c_attn.weight", _fused_qkv),
    ("attn.c_proj.weight", "O"),
    ("mlp.c_fc.weight", "MLP_up"),
    ("mlp.c_proj.weight", "MLP_down"),
    # timm ViT and most vision transformers.
    ("attn.qkv.weight", _fused_qkv),
    ("attn.proj.weight", "O"),
    ("fc1.weight", "MLP_up"),  # also OPT/BART/Whisper (fc1/fc2 directly in the layer), Phi
    ("fc2.weight", "MLP_down"),
    ("mlp.fc_in.weight", "MLP_up"),  # GPT-J
    ("mlp.fc_out.weight", "MLP_down"),
    # GPT-NeoX / Pythia / Bloom: query_key_value interleaved per head.
    ("self_attention.query_key_value.weight", _falcon_qkv),  # Falcon: layout from its flags
    ("query_key_value.weight", _per_head_qkv),
    ("attention.dense.weight", "O"),
    ("self_attention.dense.weight", "O"),
    ("self_attn.dense.weight", "O"),  # Phi
    ("mlp.dense_h_to_4h.weight", "MLP_up"),
    ("mlp.dense_4h_to_h.weight", "MLP_down"),
    # BERT / RoBERTa / ViT before transformers 5 (attention.output.dense before output.dense).
    ("attention.output.dense.weight", "O"),
    ("intermediate.dense.weight", "MLP_up"),
    ("output.dense.weight", "MLP_down"),
    ("query.weight", "Q"),
    ("key.weight", "K"),
    ("value.weight", "V"),
    # torch.nn.MultiheadAttention / TransformerEncoderLayer.
    ("in_proj_weight", _fused_qkv),
    ("q_proj_weight", "Q"),
    ("k_proj_weight", "K"),
    ("v_proj_weight", "V"),
    ("out_proj.weight", "O"),
    ("linear1.weight", "MLP_up"),
    ("linear2.weight", "MLP_down"),
    # Llama / Mistral / Qwen2 / ViT (transformers 5) / DeepSeek; GQA and MQA keep their shapes.
    ("q_proj.weight", "Q"),
    ("k_proj.weight", "K"),
    ("v_proj.weight", "V"),
    ("o_proj.weight", "O"),
    ("qkv_proj.weight", _fused_qkv),
    ("Wqkv.weight", _fused_qkv),
    ("gate_proj.weight", "MLP_gate"),
    ("up_proj.weight", "MLP_up"),
    ("down_proj.weight", "MLP_down"),
    ("gate_up_proj.weight", _gate_up),
    # torchtune (llama2/3, CLIP ...): attn.output_proj; FeedForward w2(act(w1 x) * w3 x).
    ("attn.output_proj.weight", "O"),
    ("mlp.w1.weight", _feed_forward_w1),
    ("mlp.w3.weight", "MLP_up"),
    ("mlp.w2.weight", "MLP_down"),
    # litgpt: attn.qkv rows [q; k; v] (K/V sized by n_query_groups, above), attn.proj (timm's
    # rule), GptNeoxMLP fc -> act -> proj, LLaMAMLP proj(silu(fc_1 x) * fc_2 x).
    ("mlp.fc.weight", "MLP_up"),
    ("mlp.fc_1.weight", "MLP_gate"),
    ("mlp.fc_2.weight", "MLP_up"),
    ("mlp.proj.weight", "MLP_down"),
    # Attention projections named for what they do wherever they sit (diffusers, lucidrains,
    # x-transformers: to_out is [Linear, Dropout]; to_qkv chunked in three, to_kv in two).
    ("to_q.weight", _to("Q")),
    ("to_k.weight", _to("K")),
    ("to_v.weight", _to("V")),
    ("to_out.0.weight", _to("O")),
    ("to_out.weight", _to("O")),
    ("to_qkv.weight", _to_qkv),
    ("to_kv.weight", _to_kv),
    # Hand-written MLPs as a list: nn.Sequential(Linear, act, Dropout, Linear) (Karpathy's
    # ffwd.net, many ViTs), diffusers' ff.net = [GELU/GEGLU with its proj, Dropout, Linear],
    # lucidrains' FeedForward.net (a class named for an MLP: the shapes must be an MLP's too).
    # (fnmatch's `*` spans dots: `ff.[0-9]*.weight` also matches ff.0.0 and ff.0.proj.)
    *(
        (f"{mlp}.{net}[0-9]*.weight", _sequential_mlp)
        for mlp in ("mlp", "ffn", "ff", "ffwd", "feed_forward")
        for net in ("", "net.")
    ),
    ("net.[0-9]*.weight", _named_mlp_net),
    # Hugging Face DistilBERT.
    ("attention.q_lin.weight", "Q"),
    ("attention.k_lin.weight", "K"),
    ("attention.v_lin.weight", "V"),
    ("attention.out_lin.weight", "O"),
    ("ffn.lin1.weight", "MLP_up"),
    ("ffn.lin2.weight", "MLP_down"),
    # Hand-written attention: attn.q/k/v/o, attn.wq/wk/wv/wo, and an ``out`` beside
    # query/key/value.
    *(
        (f"{attn}.{q}.weight", role)
        for attn in ("attn", "attention")
        for q, role in (
            ("q", "Q"),
            ("k", "K"),
            ("v", "V"),
            ("o", "O"),
            ("wq", "Q"),
            ("wk", "K"),
            ("wv", "V"),
            ("wo", "O"),
            ("out", "O"),
        )
    ),
    # Hand-written MLPs: up/down, w_in/w_out, dense_in/dense_out.
    *(
        (f"{mlp}.{name}.weight", role)
        for mlp in ("mlp", "ffn", "ff", "feed_forward")
        for name, role in (
            ("up", "MLP_up"),
            ("down", "MLP_down"),
            ("w_in", "MLP_up"),
            ("w_out", "MLP_down"),
            ("dense_in", "MLP_up"),
            ("dense_out", "MLP_down"),
        )
    ),
    # torchtitan (its blocks in a ModuleDict keyed "0", "1", ...): attention.qkv_linear.wq/wk/wv
    # or the fused wqkv per K/V group, attention.wo and feed_forward.w1/w2/w3 (below); MLA's
    # wq_a/wq_b, wkv_a [latent; rope key], wkv_b per head [k_nope; v].
    ("qkv_linear.wq.weight", "Q"),
    ("qkv_linear.wk.weight", "K"),
    ("qkv_linear.wv.weight", "V"),
    ("qkv_linear.wqkv.weight", _titan_wqkv),
    ("attention.wq_a.weight", "Q_down"),
    ("attention.wq_b.weight", "Q_up"),
    ("attention.wkv_a.weight", _kv_a),
    ("attention.wkv_b.weight", _kv_b),
    # Meta's reference Llama.
    ("attention.wq.weight", "Q"),
    ("attention.wk.weight", "K"),
    ("attention.wv.weight", "V"),
    ("attention.wo.weight", "O"),
    ("feed_forward.w1.weight", "MLP_gate"),
    ("feed_forward.w3.weight", "MLP_up"),
    ("feed_forward.w2.weight", "MLP_down"),
    # T5 (gated variants: wi_0 is the gate, wi_1 the linear half).
    ("SelfAttention.q.weight", "Q"),
    ("SelfAttention.k.weight", "K"),
    ("SelfAttention.v.weight", "V"),
    ("SelfAttention.o.weight", "O"),
    ("DenseReluDense.wi.weight", "MLP_up"),
    ("DenseReluDense.wi_0.weight", "MLP_gate"),
    ("DenseReluDense.wi_1.weight", "MLP_up"),
    ("DenseReluDense.wo.weight", "MLP_down"),
    ("mlp.wi.weight", "MLP_up"),  # Switch Transformers' dense layers (its experts: experts.*)
    ("mlp.wo.weight", "MLP_down"),
    # MLA (DeepSeek-V2/V3), GLA (kv_b_proj per latent group), MFA (low-rank Q).
    ("q_a_proj.weight", "Q_down"),
    ("q_b_proj.weight", "Q_up"),
    ("kv_a_proj_with_mqa.weight", _kv_a),
    ("kv_b_proj.weight", _kv_b),
    ("kv_b_proj.[0-9]*.weight", _kv_b_group),
    # GTA: tied K/V and one shared rope key.
    ("kv_proj.weight", "KV"),
    ("k_rope_proj.weight", "K_rope"),
    # A router named only by its place: a Linear d -> E beside E experts (grouped-GEMM MoEs).
    ("gate.weight", _router),
    ("gating.weight", _router),
    ("wg.weight", _router),
    # TPA factor matrices.
    ("W_A_q.weight", "Q_A"),
    ("W_B_q.weight", "Q_B"),
    ("W_A_k.weight", "K_A"),
    ("W_B_k.weight", "K_B"),
    ("W_A_v.weight", "V_A"),
    ("W_B_v.weight", "V_B"),
)

Pattern = str | re.Pattern[str]


def match_length(pattern: Pattern, name: str) -> int | None:
    """How many trailing dotted segments of ``name`` the pattern matched, or ``None`` if none.

    A string is an fnmatch pattern (case-sensitive) tried on the dotted suffixes of ``name``,
    shortest first; a compiled regular expression is searched in the whole name and covers the
    segments from its match on.

    >>> match_length("attn.c_proj.weight", "transformer.h.3.attn.c_proj.weight")
    3
    >>> match_length("attn.c_proj.weight", "transformer.h.3.mlp.c_proj.weight") is None
    True
    >>> match_length(re.compile(r"h\\.\\d+\\.attn"), "transformer.h.3.attn.c_proj.weight")
    5
    """
    if isinstance(pattern, re.Pattern):
        found = pattern.search(name)
        return None if found is None else name[found.start() :].count(".") + 1
    segments = name.split(".")
    for length in range(1, len(segments) + 1):
        if fnmatch.fnmatchcase(".".join(segments[-length:]), pattern):
            return length
    return None
