"""The measured per-head maximum attention logit, where the attention call hands it out.

FlexAttention computes each query's maximum score on its way to the softmax and returns it when
asked (``flex_attention(..., return_aux=AuxRequest(max_scores=True))``: ``AuxOutput.max_scores``,
``(B, H, L)``; torchtitan's QK-clip reads it). Nothing here computes a logit: the user's attention
hands what its own call returned to :meth:`SpectralTracker.observe_max_logits`, which keeps the
running maximum per head **on the tensor's device** (no synchronization on the training path) and
logs it at the next snapshot as ``max_logit``, per head beside the weight-only values
(``spectral_max_logit/L00/H03/heads``): the largest logit of the forwards since the previous
snapshot. The host copy is made when that snapshot's results are logged.

torch 2.13 refuses ``max_scores`` on the CPU ("Returning max scores is not supported on CPU/MPS",
eager and compiled); any ``(..., H, L)`` tensor of per-query maxima is taken, so an attention that
writes its scores out can hand ``scores.amax(-1)`` of the scores it computes anyway.

Example::

    >>> import torch
    >>> from types import SimpleNamespace
    >>> heads = [SimpleNamespace(name=f"attn[head {h}]", head=h,
    ...                          layout=SimpleNamespace(name="attn", num_heads=2)) for h in range(2)]
    >>> watch = MaxLogits(heads)
    >>> watch.observe("attn", torch.tensor([[[1.0, 3.0], [2.0, 0.5]]]))  # (B, H, L)
    >>> watch.observe("attn", torch.tensor([[[4.0, 1.0], [1.0, 1.0]]]))
    >>> watch.take(5); watch.rows(5)
    {'attn[head 0]': {'max_logit': 4.0}, 'attn[head 1]': {'max_logit': 2.0}}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAX_LOGIT", "MaxLogits"]

MAX_LOGIT = "max_logit"


class MaxLogits:
    """Running per-head maxima of the logits handed out by attention calls, between snapshots.

    Args:
        heads: the ``HeadCircuit`` targets (``targets/circuits.py``): their attention layer's
            name, head index and target name give each value its tag.
    """

    def __init__(self, heads: Sequence[Any]) -> None:
        self._heads: dict[str, list[Any]] = {}
        for head in heads:
            self._heads.setdefault(head.layout.name, []).append(head)
        for found in self._heads.values():
            found.sort(key=lambda h: h.head)
        self._running: dict[str, Tensor] = {}
        self._taken: dict[int, dict[str, Tensor]] = {}

    @property
    def attention_layers(self) -> list[str]:
        return list(self._heads)

    def observe(self, attention: str, max_scores: Any) -> None:
        """Fold one call's per-query maxima (``(..., H, L)``, or an ``AuxOutput``) into the
        running maximum of ``attention``'s heads; device work only."""
        scores = getattr(max_scores, "max_scores", max_scores)
        heads = self._heads.get(attention)
        if heads is None:
            raise ValueError(
                f"`attention` must be an attention layer whose heads are watched (circuits=), "
                f"got {attention!r}; watched: {self.attention_layers[:6]}"
            )
        if not isinstance(scores, Tensor) or scores.dim() < 2 or scores.shape[-2] != len(heads):
            shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise ValueError(
                f"`max_scores` must be a (..., {len(heads)}, L) tensor of per-query maximum "
                f"logits of {attention}'s {len(heads)} heads (flex_attention's "
                f"AuxOutput.max_scores), got {shape}"
            )
        with torch.no_grad():
            per_head = scores.detach().transpose(-2, -1).reshape(-1, len(heads)).amax(0).float()
            previous = self._running.get(attention)
            self._running[attention] = (
                per_head if previous is None else torch.maximum(previous, per_head)
            )

    def take(self, step: int) -> None:
        """The maxima since the previous snapshot belong to the snapshot of ``step``."""
        if self._running:
            self._taken[step], self._running = self._running, {}

    def rows(self, step: int) -> dict[str, dict[str, float]]:
        """target name -> ``{"max_logit": value}`` of the snapshot of ``step`` (copied to the host
        now); finite values only (a query with every key masked has none). Results are logged in
        step order, so maxima taken for an earlier snapshot that was never logged (skipped) fold
        into this one: nothing is kept past the snapshot that logs it."""
        taken: dict[str, Tensor] = {}
        for earlier in sorted(s for s in self._taken if s <= step):
            for attention, per_head in self._taken.pop(earlier).items():
                before = taken.get(attention)
                taken[attention] = per_head if before is None else torch.maximum(before, per_head)
        rows: dict[str, dict[str, float]] = {}
        for attention, per_head in taken.items():
            for head, value in zip(self._heads[attention], per_head.tolist(), strict=True):
                if math.isfinite(value):
                    rows[head.name] = {MAX_LOGIT: value}
        return rows
