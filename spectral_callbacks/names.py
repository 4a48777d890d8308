"""The logged-name contract: how a (metric, layer, role) becomes a TensorBoard tag and back.

The callback writes these names and the command line parses them, so both import this module and
neither spells a tag by hand (see docs/logged-names.md).

Tags:

* ``spectral_<metric>/L<layer>/<role>`` - one chart per (layer, role), e.g.
  ``spectral_stable_rank/L00/Q``. The layer index is zero-padded to at least two digits so charts
  sort by depth.
* ``spectral_<metric>/mean/<role>`` - the mean over layers of one role.
* Several stacks of blocks (encoder and decoder, text and vision towers): the stack after the
  metric, ``spectral_<metric>/<stack>/L<layer>/<role>`` and ``spectral_<metric>/<stack>/mean/<role>``
  (e.g. ``spectral_stable_rank/dec/L03/Q_cross``); a model with one stack keeps the names above.
* Mixture-of-experts: per (layer, role) the ``mean``, ``min`` and ``max`` over experts,
  ``spectral_<metric>/L<layer>/<role>/<mean|min|max>``, and with ``experts="each"`` one chart per
  expert, ``spectral_<metric>/L<layer>/E<expert>/<role>`` (expert index zero-padded to 3 digits).
  The per-expert values of one (layer, role) are also a TensorBoard *histogram* (the distribution
  over experts at each snapshot) under the tag a lone matrix's scalar would have,
  ``spectral_<metric>/L<layer>/<role>`` (:func:`histogram_tag`); no scalar of an expert role has it.
* Attention heads (``circuits=True``): the QK/OV circuit metrics of each query head under the role
  ``heads`` (``heads_cross`` for cross-attention), ``spectral_<metric>/L<layer>/H<head>/heads``
  (head index zero-padded to 2 digits), their ``mean``, ``min`` and ``max`` over the layer's heads,
  ``spectral_<metric>/L<layer>/heads/<mean|min|max>``, and the histogram over heads at
  ``spectral_<metric>/L<layer>/heads``.
* ``spectral_monitor/<name>`` - the callback's own health (main-thread ms, SVD ms, pending, skipped;
  ``sent_bytes`` with sharded weights)
  and ``spectral_monitor/num_layers`` (``spectral_monitor/num_layers/<stack>`` per stack where there
  are several), which lets readers compute relative depth within a stack.
* ``spectral_alerts/<kind>`` - how many alerts of one kind were raised so far (``rank_collapse``,
  ``sigma_growth``, ``esd_alpha_low``, ``esd_alpha_high``, ``non_finite``, ``logit_growth``); each alert is also a
  text entry under ``spectral_alerts``.
* ``spectral_lr_factor/L<layer>/<role>`` - with ``lr_balance``, the learning-rate factor applied to
  that matrix's parameter groups from the next optimizer step on (logged at the step of the ESD
  snapshot it comes from); the band and the units at its ends are a text entry under
  ``spectral_lr_balance``.
* ``spectral_monitor/targets`` (text) - the watched matrices when the run begins: name, stack,
  layer, role, expert, shape, and an adapted layer's rank r and scaling (``rank-layers --lora``
  reads it back).
* ``spectral_monitor/reference_step/[<stack>/]L<layer>/[E<expert>/]<role>`` - the step of the snapshot whose stable rank
  is that matrix's compression reference (0 normally; later for a matrix that starts at zero).

Example::

    >>> scalar_tag("stable_rank", 7, "MLP_down")
    'spectral_stable_rank/L07/MLP_down'
    >>> parse_tag("spectral_alpha/L12/Q")
    SpectralTag(metric='alpha', layer=12, role='Q', stack='', expert=None, aggregate='', head=None)
    >>> parse_tag("spectral_alpha/mean/Q").layer is None
    True
    >>> scalar_tag("stable_rank", 3, "Q_cross", stack="dec")
    'spectral_stable_rank/dec/L03/Q_cross'
    >>> parse_tag("spectral_stable_rank/dec/L03/Q_cross")[:4]
    ('stable_rank', 3, 'Q_cross', 'dec')
    >>> scalar_tag("stable_rank", 3, "MLP_down", aggregate="max"), scalar_tag("alpha", 3, "MLP_up", expert=7)
    ('spectral_stable_rank/L03/MLP_down/max', 'spectral_alpha/L03/E007/MLP_up')
    >>> parse_tag("spectral_alpha/L03/E007/MLP_up").expert, parse_tag("spectral_alpha/L03/MLP_up/min").aggregate
    (7, 'min')
    >>> scalar_tag("qk_spectral_norm", 0, "heads", head=3), parse_tag("spectral_qk_spectral_norm/L00/H03/heads").head
    ('spectral_qk_spectral_norm/L00/H03/heads', 3)
    >>> parse_tag("train/loss") is None
    True
    >>> parse_tag(reference_step_tag(3, "O"))[:3]
    ('reference_step', 3, 'O')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # pandas and numpy are imported where rows are built (tidy_rows)
    import numpy as np
    import pandas as pd

METRIC_PREFIX = "spectral_"
MONITOR_SECTION = "spectral_monitor"
#: The section of the alert counts and of the alerts' text entries.
ALERT_SECTION = "spectral_alerts"
MEAN = "mean"
NUM_LAYERS_TAG = f"{MONITOR_SECTION}/num_layers"
#: The learning-rate factor ``lr_balance`` applies to a matrix: ``spectral_lr_factor/L<layer>/<role>``.
LR_FACTOR = "lr_factor"
#: The text entries of ``lr_balance`` (the band, the units at its ends) at each change of factors.
LR_BALANCE_SECTION = "spectral_lr_balance"
#: The text entry of the watched matrices (:func:`format_target_map`), written when a run begins.
TARGET_MAP_TAG = f"{MONITOR_SECTION}/targets"
#: Its columns: the matrix's name, where it is logged, its ``out x in`` shape, and for an adapted
#: layer its adapter's rank r, scaling s (ΔW = s B A) and the rule s was computed by
#: (``lora``: lora_alpha / r; ``rslora``: lora_alpha / sqrt(r)); empty where they do not apply.
TARGET_MAP_COLUMNS: tuple[str, ...] = (
    "matrix",
    "stack",
    "layer",
    "role",
    "expert",
    "shape",
    "r",
    "scaling",
    "scaling_rule",
)
#: Read back as the per-matrix metric ``reference_step`` (see :func:`reference_step_tag`).
REFERENCE_STEP = "reference_step"

# Canonical roles (docs/targets.md, Roles), in chart order. Variants add documented extra roles.
ROLES: tuple[str, ...] = ("Q", "K", "V", "O", "MLP_up", "MLP_down")
#: The role of a layer's per-head circuit values (``spectral_qk_spectral_norm/L00/heads/max``);
#: ``heads_cross`` for cross-attention.
HEADS_ROLE = "heads"


def is_heads_role(role: str) -> bool:
    """Whether ``role`` holds a layer's attention heads (``heads``, ``heads_cross``), whose
    aggregates are over heads, not over experts.

    >>> is_heads_role("heads"), is_heads_role("heads_cross"), is_heads_role("MLP_up")
    (True, True, False)
    """
    return role == HEADS_ROLE or role.startswith(f"{HEADS_ROLE}_")


# The columns of tidy rows (the callback's figure history, export, charts), in this order.
# ``stack`` is "" for a model with one stack; ``expert`` is empty (<NA>) outside experts, and an
# aggregate over experts is a row whose role carries it (``MLP_down/mean``); ``head`` is the query
# head of a per-head circuit value (``heads`` role), else empty. Read columns as ``rows["head"]``:
# ``rows.head`` is ``DataFrame.head``, the method (docs/cli.md says so where it shows pandas).
TIDY_COLUMNS: tuple[str, ...] = (
    "run",
    "step",
    "metric",
    "stack",
    "layer",
    "depth",
    "role",
    "expert",
    "head",
    "value",
    "wall_time",
)
#: What experts aggregate to by default, one scalar each per (layer, role).
EXPERT_AGGREGATES: tuple[str, ...] = ("mean", "min", "max")
_STACK = r"(?:(?P<stack>[a-z][a-z0-9_]*)/)?"
_EXPERT = r"(?:E(?P<expert>\d+)/)?"
_HEAD = r"(?:H(?P<head>\d+)/)?"
_ROLE = r"(?P<role>[A-Za-z0-9_]+)(?:/(?P<aggregate>mean|min|max))?"

_TAG = re.compile(
    rf"^spectral_(?P<metric>[a-z0-9_]+)/{_STACK}(?:L(?P<layer>\d+)|(?P<mean>mean))/{_EXPERT}{_HEAD}{_ROLE}$"
)

_REFERENCE_STEP_TAG = re.compile(
    rf"^{MONITOR_SECTION}/{REFERENCE_STEP}/{_STACK}L(?P<layer>\d+)/{_EXPERT}{_ROLE}$"
)
_NUM_LAYERS_OF_STACK = re.compile(rf"^{NUM_LAYERS_TAG}/(?P<stack>[a-z][a-z0-9_]*)$")


class TaggedMatrix(Protocol):
    r"""What names one watched matrix in the logged tags (``spectral_callbacks.targets.Target`` is
    one; a table's rows read back offline are :class:`MatrixLabel`\ s)."""

    @property
    def name(self) -> str: ...

    @property
    def layer(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def role(self) -> str: ...

    @property
    def stack(self) -> str: ...

    @property
    def expert(self) -> int | None: ...

    @property
    def head(self) -> int | None: ...

    @property
    def depth(self) -> float:
        """Relative depth ``layer / (num_layers - 1)`` (``relative_depth``)."""
        ...

    @property
    def attention_layer(self) -> str | None:
        """The attention module whose heads this matrix is one of (a head's circuits), else
        ``None``: the logit-growth alert takes the max over a layer's heads."""
        ...


@dataclass(frozen=True)
class MatrixLabel:
    """A :class:`TaggedMatrix` without its weights: what a logged row says of its matrix."""

    name: str
    layer: int
    role: str
    num_layers: int = 1
    stack: str = ""
    expert: int | None = None
    head: int | None = None
    attention_layer: str | None = None

    @property
    def depth(self) -> float:
        """Relative depth ``layer / (num_layers - 1)``, 0 for a one-layer model."""
        return relative_depth(self.layer, self.num_layers)


class SpectralTag(NamedTuple):
    """A parsed spectral tag; ``layer`` is ``None`` for the mean over layers.

    ``stack`` is ``""`` for a model with one stack; ``expert`` the expert index of a per-expert
    tag; ``aggregate`` ``"mean"``/``"min"``/``"max"`` for an aggregate over experts (or heads),
    else ``""``; ``head`` the query head of a per-head circuit tag.
    """

    metric: str
    layer: int | None
    role: str
    stack: str = ""
    expert: int | None = None
    aggregate: str = ""
    head: int | None = None

    @property
    def series_role(self) -> str:
        """The role as a tidy row has it: ``MLP_down/mean`` for an aggregate over experts."""
        return f"{self.role}/{self.aggregate}" if self.aggregate else self.role


def layer_label(layer: int, num_layers: int | None = None) -> str:
    """``L`` plus the layer index, zero-padded to the digits of the deepest layer (at least two).

    >>> layer_label(3), layer_label(3, num_layers=120)
    ('L03', 'L003')
    """
    if layer < 0:
        raise ValueError(f"`layer` must be a non-negative int, got {layer}")
    width = max(2, len(str(num_layers - 1))) if num_layers else 2
    return f"L{layer:0{width}d}"


def check_stack(stack: str) -> str:
    """``stack`` if it can name a stack in a tag (lowercase letters, digits, ``_``), else ValueError."""
    if stack and (not re.fullmatch(r"[a-z][a-z0-9_]*", stack) or stack == MEAN):
        raise ValueError(
            f"`stack` must be lowercase letters, digits and '_' starting with a letter (not "
            f"'mean'), got {stack!r}"
        )
    return stack


def _where(
    stack: str,
    layer: int | None,
    num_layers: int | None,
    expert: int | None,
    head: int | None = None,
) -> str:
    where = MEAN if layer is None else layer_label(layer, num_layers)
    if stack:
        where = f"{stack}/{where}"
    where = where if expert is None else f"{where}/E{expert:03d}"
    return where if head is None else f"{where}/H{head:02d}"


def scalar_tag(
    metric: str,
    layer: int | None,
    role: str,
    num_layers: int | None = None,
    *,
    stack: str = "",
    expert: int | None = None,
    aggregate: str = "",
    head: int | None = None,
) -> str:
    """The tag of one metric of one (layer, role); ``layer=None`` gives the mean over layers.

    ``stack`` names the stack where a model has several; ``expert`` gives a per-expert tag and
    ``aggregate`` (``mean``/``min``/``max``) the aggregate over a layer's experts (or heads);
    ``head`` a per-head circuit tag (``spectral_qk_spectral_norm/L00/H03/heads``).
    """
    tail = f"/{aggregate}" if aggregate else ""
    where = _where(stack, layer, num_layers, expert, head)
    return f"{METRIC_PREFIX}{metric}/{where}/{role}{tail}"


def histogram_tag(
    metric: str, layer: int, role: str, num_layers: int | None = None, *, stack: str = ""
) -> str:
    """The tag of the histogram over the experts of one (layer, role): the tag a lone matrix's
    scalar would have (the experts' scalars all carry ``E<expert>`` or an aggregate).

    >>> histogram_tag("stable_rank", 3, "MLP_down"), histogram_tag("alpha", 1, "MLP_up", stack="dec")
    ('spectral_stable_rank/L03/MLP_down', 'spectral_alpha/dec/L01/MLP_up')
    """
    return scalar_tag(metric, layer, role, num_layers, stack=stack)


def num_layers_tag(stack: str = "") -> str:
    """``spectral_monitor/num_layers``, or ``spectral_monitor/num_layers/<stack>`` for one stack."""
    return f"{NUM_LAYERS_TAG}/{stack}" if stack else NUM_LAYERS_TAG


def parse_num_layers_tag(tag: str) -> str | None:
    """The stack a ``num_layers`` tag is for (``""`` for the whole model), or ``None``.

    >>> parse_num_layers_tag("spectral_monitor/num_layers"), parse_num_layers_tag(num_layers_tag("enc"))
    ('', 'enc')
    """
    if tag == NUM_LAYERS_TAG:
        return ""
    match = _NUM_LAYERS_OF_STACK.match(tag)
    return None if match is None else match["stack"]


def monitor_tag(name: str) -> str:
    """The tag of one of the callback's health scalars, e.g. ``spectral_monitor/svd_ms``."""
    return f"{MONITOR_SECTION}/{name}"


def alert_tag(kind: str) -> str:
    """The tag of the count of one kind of alert.

    >>> alert_tag("rank_collapse")
    'spectral_alerts/rank_collapse'
    """
    return f"{ALERT_SECTION}/{kind}"


def reference_step_tag(
    layer: int,
    role: str,
    num_layers: int | None = None,
    *,
    stack: str = "",
    expert: int | None = None,
) -> str:
    """The tag of the step whose stable rank is the compression reference of one (layer, role).

    >>> reference_step_tag(0, "O"), reference_step_tag(1, "O_cross", stack="dec")
    ('spectral_monitor/reference_step/L00/O', 'spectral_monitor/reference_step/dec/L01/O_cross')
    """
    return f"{MONITOR_SECTION}/{REFERENCE_STEP}/{_where(stack, layer, num_layers, expert)}/{role}"


def format_target_map(rows: Sequence[tuple[object, ...]]) -> str:
    """The Markdown table of the watched matrices (``TARGET_MAP_COLUMNS``, one tuple per matrix).

    >>> text = format_target_map([("h.0.attn.c_attn.weight[Q]", "", 0, "Q", "", "64x64", 8, 2.0, "lora")])
    >>> parse_target_map(text)[0]["shape"], parse_target_map(text)[0]["r"]
    ('64x64', '8')
    """
    lines = [
        "| " + " | ".join(TARGET_MAP_COLUMNS) + " |",
        "|" + "---|" * len(TARGET_MAP_COLUMNS),
    ]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_target_map(text: str) -> list[dict[str, str]]:
    """The rows of a :func:`format_target_map` table, each ``{column: text}``."""
    lines = [line.strip() for line in text.strip().splitlines()]
    header = [c.strip() for c in lines[0].strip("|").split("|")] if lines else []
    # A run written before the scaling rule was a column: its rows without one (empty).
    if header not in (list(TARGET_MAP_COLUMNS), list(TARGET_MAP_COLUMNS[:-1])):
        return []
    return [
        {
            **dict.fromkeys(TARGET_MAP_COLUMNS, ""),
            **dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=False)),
        }
        for line in lines[2:]
        if line.startswith("|")
    ]


def parse_tag(tag: str) -> SpectralTag | None:
    """The (metric, layer, role) of a spectral tag, or ``None`` for any other tag.

    A reference-step tag reads as the per-matrix metric ``reference_step``.
    """
    reference = _REFERENCE_STEP_TAG.match(tag)
    if reference is not None:
        return _parsed(REFERENCE_STEP, reference, int(reference["layer"]))
    match = _TAG.match(tag)
    if match is None or match["metric"] == "monitor" or match["stack"] == MEAN:
        return None
    return _parsed(match["metric"], match, None if match["mean"] else int(match["layer"]))


def tidy_rows(
    run: str,
    tags: Sequence[str] | np.ndarray,
    steps: Sequence[int] | np.ndarray,
    values: Sequence[float] | np.ndarray,
    wall_times: Sequence[float] | np.ndarray,
    *,
    all_scalars: bool = True,
    listed: Iterable[str] = (),
) -> tuple[pd.DataFrame, dict[str, int]]:
    """The tidy rows (:data:`TIDY_COLUMNS`) of one run's scalar points, one row per point in the
    order given: what ``export`` writes and the SPECTRAL tab reads.

    Each distinct tag is parsed once (:func:`parse_tag`). ``depth`` is the layer's relative depth
    within its stack, the stack's layer count being the last logged ``spectral_monitor/num_layers``
    (``/<stack>``) among the points, else the deepest layer of that stack among the points' tags
    and ``listed`` (the run's other tags) plus one.

    Args:
        run: the run's name (the ``run`` column).
        tags, steps, values, wall_times: the points, one entry each.
        all_scalars: keep the points of other tags as rows whose ``metric`` is the tag (stack,
            layer, role, expert and head empty); ``False`` drops them.
        listed: more tags of the run, read for the layer-count fallback only.

    Returns:
        The rows, and per stack with spectral rows whose layer count was not logged, the count
        used (the caller may say so).

    >>> rows, guessed = tidy_rows("a", ["spectral_alpha/L01/Q", "train/loss"], [5, 5], [2.0, 0.1],
    ...                           [0.0, 0.0])
    >>> rows[["metric", "layer", "depth"]].to_dict("records"), guessed
    ([{'metric': 'alpha', 'layer': 1, 'depth': 1.0}, \
{'metric': 'train/loss', 'layer': None, 'depth': nan}], {'': 2})
    >>> rows["role"][0], rows["role"].isna().tolist()  # a missing role: nan, or None before pandas 3
    ('Q', [False, True])
    """
    import numpy as np
    import pandas as pd

    codes, uniques = pd.factorize(np.asarray(tags, dtype=object), sort=False)
    parsed = [parse_tag(str(tag)) for tag in uniques]
    # The layer count of each stack: its last logged num_layers, else the deepest layer + 1.
    logged: dict[str, int] = {}
    value_array = np.asarray(values, dtype=np.float64)
    for index, tag in enumerate(uniques):
        stack = parse_num_layers_tag(str(tag))
        if stack is not None:
            logged[stack] = int(value_array[np.flatnonzero(codes == index)[-1]])
    deepest: dict[str, int] = {}
    for label in [*parsed, *map(parse_tag, listed)]:
        if label is not None and label.layer is not None:
            deepest[label.stack] = max(deepest.get(label.stack, 0), label.layer + 1)
    guessed = {
        stack: layers
        for stack, layers in deepest.items()
        if stack not in logged and any(p is not None and p.stack == stack for p in parsed)
    }
    num_layers = {**deepest, **logged}

    def column(of: Callable[[SpectralTag], Any], other: Any, dtype: Any = object) -> np.ndarray:
        per_tag = [other if label is None else of(label) for label in parsed]
        return np.asarray(per_tag, dtype=dtype)[codes]

    keep = np.asarray([all_scalars or label is not None for label in parsed], dtype=bool)[codes]
    layer = column(lambda label: label.layer, None)

    def nullable(column_values: np.ndarray) -> pd.arrays.IntegerArray:
        missing = np.asarray([value is None for value in column_values], dtype=bool)
        filled = np.where(missing, 0, column_values).astype(np.int64)
        return pd.arrays.IntegerArray(filled, missing)

    frame = pd.DataFrame(
        {
            "run": np.full(len(codes), run, dtype=object),
            "step": np.asarray(steps, dtype=np.int64),
            "metric": np.asarray(
                [
                    str(tag) if label is None else label.metric
                    for tag, label in zip(uniques, parsed, strict=True)
                ],
                dtype=object,
            )[codes],
            "stack": column(lambda label: label.stack, None),
            "layer": nullable(layer),
            "depth": column(
                lambda label: (
                    np.nan
                    if label.layer is None
                    else relative_depth(label.layer, num_layers.get(label.stack) or 1)
                ),
                np.nan,
                np.float64,
            ),
            "role": column(lambda label: label.series_role, None),
            "expert": nullable(column(lambda label: label.expert, None)),
            "head": nullable(column(lambda label: label.head, None)),
            "value": value_array,
            "wall_time": np.asarray(wall_times, dtype=np.float64),
        },
        columns=list(TIDY_COLUMNS),
    )
    rows = frame[keep].reset_index(drop=True) if not keep.all() else frame
    return rows, guessed


def _parsed(metric: str, match: re.Match[str], layer: int | None) -> SpectralTag:
    expert = None if match["expert"] is None else int(match["expert"])
    head = match.groupdict().get("head")
    return SpectralTag(
        metric,
        layer,
        match["role"],
        match["stack"] or "",
        expert,
        match["aggregate"] or "",
        None if head is None else int(head),
    )


def relative_depth(layer: int, num_layers: int) -> float:
    """Relative depth ``i / (L - 1)`` of layer ``i`` in an ``L``-layer model (0 for a 1-layer model).

    >>> relative_depth(0, 8), relative_depth(7, 8), relative_depth(0, 1)
    (0.0, 1.0, 0.0)
    """
    return layer / (num_layers - 1) if num_layers > 1 else 0.0


#: Stacks in the order a reader expects them (every chart, view and table); any other stack name
#: after these, sorted.
STACK_ORDER: tuple[str, ...] = ("enc", "dec", "text", "vision", "audio", "top")


def ordered_stacks(stacks: Iterable[object]) -> list[str]:
    """The stacks among ``stacks`` in :data:`STACK_ORDER` (``""``, a model's one stack, first).

    >>> ordered_stacks(["dec", "enc", "dec", "tower"])
    ['enc', 'dec', 'tower']
    """
    present = {stack for stack in stacks if isinstance(stack, str)}
    known = ("", *STACK_ORDER)
    return [s for s in known if s in present] + sorted(present - set(known))


# Chart order of roles: the six canonical ones (names.ROLES) with each variant's extra roles placed
# beside the canonical role they refine (docs/targets.md lists them all). Unknown roles sort last.
ROLE_ORDER: tuple[str, ...] = (
    "Q_down",
    "Q_up",
    "Q",
    "Q_A",
    "Q_B",
    "KV_down",
    "K_rope",
    "K",
    "K_A",
    "K_B",
    "KV",
    "V",
    "V_A",
    "V_B",
    "O",
    "Q_cross",
    "K_cross",
    "V_cross",
    "O_cross",
    "Router",
    "MLP_gate",
    "MLP_up",
    "MLP_down",
    "MLP_shared_gate",
    "MLP_shared_up",
    "MLP_shared_down",
)
_GROUP_SUFFIX = re.compile(r"^(?P<base>.+)_g(?P<group>\d+)$")


def split_group(role: str) -> tuple[str, int | None]:
    """``(base role, latent group)`` of a GLA group role such as ``K_g1``; ``(role, None)`` else.

    >>> split_group("K_g1"), split_group("Q"), split_group("zz_g1")
    (('K', 1), ('Q', None), ('zz_g1', None))
    """
    match = _GROUP_SUFFIX.match(role)
    if match and match["base"] in ROLE_ORDER:
        return match["base"], int(match["group"])
    return role, None


def role_sort_key(role: str) -> tuple[int, int, str]:
    """Sort key putting roles in chart order; ``K_g1`` (latent group 1 of GLA) sorts with ``K``.

    >>> sorted(["MLP_down", "V_g0", "K_g1", "Q", "K_g0", "zz"], key=role_sort_key)
    ['Q', 'K_g0', 'K_g1', 'V_g0', 'MLP_down', 'zz']
    """
    base, group = split_group(role)
    position = ROLE_ORDER.index(base) if base in ROLE_ORDER else len(ROLE_ORDER)
    return (position, group or 0, role)


def stack_of(target: object) -> str:
    """The stack a watched matrix belongs to (``""``: the model's one stack)."""
    return str(getattr(target, "stack", ""))
