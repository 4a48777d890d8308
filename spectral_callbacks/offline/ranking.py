"""Layers ranked by ESD α, and AlphaPruning's layer-wise sparsity for a target sparsity.

AlphaPruning (Lu, Zhou, Liu, Wang, Mahoney, Yang: "AlphaPruning: Using Heavy-Tailed Self
Regularization Theory for Improved Layer-wise Pruning of Large Language Models", NeurIPS 2024)
gives each transformer block a sparsity from the mean ESD α of its matrices: a block with a small
α (heavy-tailed, well trained) keeps more of its weights, one with a large α loses more.

1. block α = the mean ESD α of the block's matrices;
2. mapped linearly onto [1 − ε, 1 + ε]: s = 1 − ε + 2ε (α − α_min) / (α_max − α_min)
   (all s = 1 when every block has the same α);
3. rescaled so the parameter-weighted mean sparsity is the target:
   r = target · s · Σ p / Σ p s, with p the block's parameters.

The ranked matrices also carry WeightWatcher's label of their α (``warning``: "over-trained" below
2, "under-trained" above 6), as its ``analyze()`` writes it for a model at rest.

Example::

    >>> import pandas as pd
    >>> rows = pd.DataFrame({"stack": "", "layer": [0, 0, 1, 1], "role": ["Q", "K", "Q", "K"],
    ...                      "alpha": [2.0, 4.0, 5.0, 7.0], "params": [100, 100, 100, 100]})
    >>> blocks = block_sparsity(rows, sparsity=0.5, epsilon=0.2)
    >>> blocks[["layer", "block_alpha", "sparsity"]].to_string(index=False)
    ' layer  block_alpha  sparsity\\n     0          3.0       0.4\\n     1          6.0       0.6'
"""

from __future__ import annotations

import math

import pandas as pd


class RankingError(ValueError):
    """Bad input to the ranking; the message names the argument and says what to pass."""

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


def check_allocation(sparsity: float, epsilon: float) -> None:
    """Refuse a target sparsity outside (0, 1) or an ε outside [0, 1) (``RankingError``)."""
    if not 0 < sparsity < 1:
        raise RankingError(f"`sparsity` must be a fraction in (0, 1), got {sparsity!r}", "sparsity")
    if not 0 <= epsilon < 1:
        raise RankingError(f"`epsilon` must be in [0, 1), got {epsilon!r}", "epsilon")


def block_sparsity(rows: pd.DataFrame, sparsity: float, epsilon: float = 0.2) -> pd.DataFrame:
    """AlphaPruning's sparsity per block (see the module docstring).

    Args:
        rows: one row per matrix with ``stack, layer, role, alpha, params``.
        sparsity: the target, the parameter-weighted mean of the result, in (0, 1).
        epsilon: half the width of the band the block α are mapped onto, in [0, 1). Default ``0.2``
            (the value AlphaPruning reports for LLaMA at 70 % sparsity).

    Returns:
        One row per block ``stack, layer, block_alpha, params, sparsity``, in stack and layer order.

    Raises:
        RankingError: a target or ε out of range, no finite α, or a result above 1 (the band is
            too wide for the target).
    """
    check_allocation(sparsity, epsilon)
    finite = rows[rows["alpha"].notna() & (rows["alpha"] != float("inf"))]
    if finite.empty:
        raise RankingError("no matrix has a finite ESD α to rank", "alpha")
    blocks = (
        finite.groupby(["stack", "layer"], sort=True)
        .agg(block_alpha=("alpha", "mean"), params=("params", "sum"))
        .reset_index()
    )
    low, high = blocks["block_alpha"].min(), blocks["block_alpha"].max()
    spread = high - low
    scale = (
        1 - epsilon + 2 * epsilon * (blocks["block_alpha"] - low) / spread if spread > 0 else 1.0
    )
    weights = blocks["params"].astype(float)
    blocks["sparsity"] = sparsity * scale * weights.sum() / (weights * scale).sum()
    if (blocks["sparsity"] >= 1).any():
        raise RankingError(
            f"`epsilon`={epsilon!r} gives a block a sparsity of "
            f"{blocks['sparsity'].max():.3f} >= 1 at target {sparsity!r}; pass a smaller --epsilon",
            "epsilon",
        )
    return blocks


def rank_matrices(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with ``rank`` (1 for the smallest ESD α, the most heavy-tailed; NaN α last) and
    ``warning``, WeightWatcher's label (:func:`weightwatcher_label`)."""
    ranked = rows.sort_values("alpha", kind="stable", na_position="last").reset_index(drop=True)
    ranked["rank"] = range(1, len(ranked) + 1)
    ranked["warning"] = ranked["alpha"].map(weightwatcher_label)
    return ranked


#: WeightWatcher's thresholds (its ``analyze()`` column ``warning``), for a trained model.
OVER_TRAINED_BELOW, UNDER_TRAINED_ABOVE = 2.0, 6.0


def weightwatcher_label(alpha: float) -> str:
    """WeightWatcher's label of a matrix by its ESD α: "over-trained" below 2, "under-trained"
    above 6, none between (or for NaN), as its ``analyze()`` writes the column ``warning``.

    >>> weightwatcher_label(1.9), weightwatcher_label(4.0), weightwatcher_label(6.1)
    ('over-trained', '', 'under-trained')
    """
    if alpha < OVER_TRAINED_BELOW:
        return "over-trained"
    if alpha > UNDER_TRAINED_ABOVE:
        return "under-trained"
    return ""


#: The columns :func:`lora_ranks` returns, one row per adapted module.
LORA_COLUMNS: tuple[str, ...] = (
    "module",
    "stack",
    "layer",
    "roles",
    "shape",
    "r",
    "energy_rank_90",
    "energy_rank",
    "bound",
    "suggested_r",
    "params_saved",
    "scaling",
    "scaling_rule",
)


def module_key(matrix: str) -> str:
    """The module name a PEFT ``rank_pattern`` key matches, from a watched matrix's name.

    PEFT matches a key against the end of each adapted module's name (``(.*\\.)?<key>$``), so the
    wrapper's ``base_model.model.`` prefix is dropped, as are ``.base_layer.weight`` and ``[Q]``.

    >>> module_key("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj'
    >>> module_key("base_model.model.transformer.h.1.attn.c_attn.base_layer.weight[K]")
    'transformer.h.1.attn.c_attn'
    """
    name = matrix.split("[", 1)[0]
    name = name.removeprefix("base_model.model.")
    for suffix in (".weight", ".base_layer"):
        name = name.removesuffix(suffix)
    return name


def round_rank(rank: int, step: int | None = None) -> int:
    """``rank`` rounded up to a power of two (``step=None``) or to a multiple of ``step``; >= 1.

    >>> round_rank(3), round_rank(5), round_rank(8), round_rank(0), round_rank(5, step=4)
    (4, 8, 8, 1, 8)
    """
    rank = max(1, int(rank))
    if step is None:
        return 1 << (rank - 1).bit_length()
    return -(-rank // step) * step


def energy_rank_from_top(
    top: list[float], frobenius: float, energy: float
) -> tuple[int | None, int]:
    """The energy rank at ``energy`` from the top singular values and ‖ΔW‖_F, if they reach it.

    Returns ``(rank, len(top))``: the smallest i with Σ_{j<=i} σ_j² >= energy·‖ΔW‖_F², or
    ``None`` when the given values do not reach it (the rank is then beyond them).

    >>> energy_rank_from_top([3.0, 2.0, 1.0], frobenius=(14.0) ** 0.5, energy=0.9)
    (2, 3)
    >>> energy_rank_from_top([3.0, 1.0], frobenius=4.0, energy=0.9)
    (None, 2)
    """
    total = energy * frobenius**2
    accumulated = 0.0
    for i, sigma in enumerate(top, start=1):
        if math.isnan(sigma):  # beyond the adapter's rank: nothing more to add
            break
        accumulated += sigma**2
        if accumulated >= total * (1 - 1e-6):  # the logged values are float32
            return i, len(top)
    return None, len(top)


def lora_ranks(rows: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """Per adapted module: its update's energy ranks, its r and the r it needs.

    Args:
        rows: one row per adapted matrix with ``matrix, stack, layer, role, out, in, r, scaling,
            energy_rank_90, energy_rank, bound`` (``energy_rank`` at ``energy``; ``bound`` True
            where it is only an upper bound) and optionally ``scaling_rule`` (``"lora"``,
            ``"rslora"``, ``""`` unknown).
        step: round the suggestion up to a multiple of ``step``; ``None``: a power of two.

    Returns:
        ``LORA_COLUMNS``, one row per module (the parts of a fused projection, e.g. Q, K and V of
        one ``c_attn`` adapter, are one module: the largest rank of its parts, its rows summed).
        ``suggested_r`` is ``energy_rank`` rounded up, never above ``r`` (ΔW = s B A cannot use
        more than r directions); ``params_saved`` = (r − suggested_r)·(out + in), the parameters
        of B (out × r) and A (r × in) saved.
    """
    out = []
    for key, parts in rows.assign(module=rows["matrix"].map(module_key)).groupby(
        "module", sort=False
    ):
        first = parts.iloc[0]
        rank = int(first["r"])
        needed = parts["energy_rank"].max()
        suggested = rank if needed != needed else min(rank, round_rank(int(needed), step))
        rows_out, columns_in = int(parts["out"].sum()), int(first["in"])
        out.append(
            {
                "module": key,
                "stack": first["stack"],
                "layer": int(first["layer"]),
                "roles": ",".join(parts["role"]),
                "shape": f"{rows_out}x{columns_in}",
                "r": rank,
                "energy_rank_90": parts["energy_rank_90"].max(),
                "energy_rank": needed,
                "bound": bool(parts["bound"].any()),
                "suggested_r": suggested,
                "params_saved": (rank - suggested) * (rows_out + columns_in),
                "scaling": first["scaling"],
                "scaling_rule": first.get("scaling_rule", ""),
            }
        )
    return pd.DataFrame(out, columns=list(LORA_COLUMNS))


def lora_patterns(modules: pd.DataFrame) -> tuple[dict[str, int], dict[str, float]]:
    r"""``rank_pattern`` and ``alpha_pattern`` for ``peft.LoraConfig`` from :func:`lora_ranks`.

    Every module gets its suggested r; its ``lora_alpha`` keeps the scaling s the run had under
    the run's own rule, so each kept direction of ΔW starts as strong as before:

    .. math:: \alpha = s \cdot r_{\text{suggested}} \ \text{(LoRA, DoRA: } s = \alpha / r),
        \qquad \alpha = s \sqrt{r_{\text{suggested}}} \ \text{(rsLoRA: } s = \alpha / \sqrt{r})

    (a module whose ``scaling_rule`` is unknown, ``""``, is given LoRA's). The alpha pattern is
    empty where the scaling is not known.

    >>> modules = pd.DataFrame({"module": ["a.q_proj", "a.v_proj"], "suggested_r": [4, 4],
    ...                         "scaling": [2.0, 2.0], "scaling_rule": ["lora", "rslora"]})
    >>> lora_patterns(modules)
    ({'a.q_proj': 4, 'a.v_proj': 4}, {'a.q_proj': 8.0, 'a.v_proj': 4.0})
    """
    ranks = {str(row.module): int(row.suggested_r) for row in modules.itertuples()}
    rules = modules["scaling_rule"] if "scaling_rule" in modules else [""] * len(modules)
    alphas = {
        str(row.module): float(row.scaling) * _rank_factor(int(row.suggested_r), rule)
        for row, rule in zip(modules.itertuples(), rules, strict=True)
        if row.scaling == row.scaling and row.scaling is not None
    }
    return ranks, alphas


def _rank_factor(rank: int, rule: str) -> float:
    """alpha / s at rank ``rank``: sqrt(r) under rsLoRA, r under LoRA (and DoRA)."""
    return math.sqrt(rank) if rule == "rslora" else float(rank)
