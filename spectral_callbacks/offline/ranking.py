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
