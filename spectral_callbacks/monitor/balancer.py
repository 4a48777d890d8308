"""LRBalancer: TempBalance's factors applied to the optimizer around each of its steps.

The tracker hands it each snapshot's results on the main thread (:meth:`LRBalancer.update`); the
ESD α among them (a snapshot computes it every ``esd_every_n_snapshots``-th time) become one factor
per unit (``param_groups.py``) by TempBalance's linear map (``functional/balance.py``). Reading the
results is all it does with them: Python floats, no device work on the training thread.

The factors reach the optimizer by two hooks on it, not by writing ``param_groups[i]["lr"]`` once:

1. ``register_step_pre_hook``: just before ``optimizer.step()`` runs, each balanced group's ``lr``
   becomes ``lr * factor`` - so the update uses the scaled rate;
2. ``register_step_post_hook``: right after it, the group's ``lr`` is put back to the very object
   it was - so a learning-rate scheduler that reads ``group["lr"]`` to compute the next one
   (``ExponentialLR``, ``CosineAnnealingLR``'s recursive form, any chained scheduler) and one that
   writes it in closed form (``LambdaLR``) both see and keep only their own values, and the
   scheduler's state is the same as without the balancer.

A group whose ``lr`` the optimizer itself changed during the step (an optimizer that adapts its
own rate) is left as the optimizer made it.

A Tensor ``lr`` (a compiled optimizer step, ``capturable=True``) is scaled in place and its value
put back in place: the object stays the one the optimizer was built with, which a compiled step
guards on and a captured CUDA graph reads by address (a new tensor would recompile the step, or be
ignored by the graph). Both are device ops queued on the stream: no wait of the training thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spectral_callbacks.functional.balance import tempbalance_factors
from spectral_callbacks.monitor.lr_balance import LRBalance
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.monitor.param_groups import balance_units, group_units


class LRBalancer:
    """TempBalance's per-unit learning-rate factors, from the latest ESD α, on an optimizer.

    Args:
        balance: the :class:`~spectral_callbacks.monitor.lr_balance.LRBalance` option.
        model: the watched model (its modules hold the parameters each factor scales).
        targets: the watched matrices.
        caller: the frontend's name, for messages.

    Until a snapshot has brought an ESD α every factor is ``1``.
    """

    def __init__(
        self, balance: LRBalance, model: torch.nn.Module, targets: Sequence[Any], caller: str
    ) -> None:
        self.balance = balance
        self.caller = caller
        self.units = balance_units(model, targets, balance.per)
        if not self.units:
            raise ConfigurationError(
                f"{caller}: `lr_balance` found no module of the model holding a watched matrix"
            )
        self._unit_of = {name: i for i, unit in enumerate(self.units) for name in unit.targets}
        self._metric = balance.alpha_metric
        #: Units the map leaves out at factor 1 (``skip_first_last``, ``min_eigenvalues``).
        self.left_out = self._left_out(targets)
        self._names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        #: The latest finite ESD α of each watched matrix (target name -> α).
        self.alpha: dict[str, float] = {}
        #: The factor of each unit, in the order of ``units``.
        self.factors: list[float] = [1.0] * len(self.units)
        self._optimizer: torch.optim.Optimizer | None = None
        self._handles: tuple[Any, ...] = ()
        self._groups: dict[int, int] = {}
        self._group_count = 0
        self._scaled: list[tuple[dict[str, Any], Any, Any]] = []

    @property
    def attached(self) -> bool:
        """Whether an optimizer's steps are being balanced."""
        return self._optimizer is not None

    def attach(self, optimizer: Any) -> None:
        """Balance ``optimizer``'s steps from now on (a wrapper such as Accelerate's is unwrapped).

        Raises:
            ConfigurationError: not a ``torch.optim.Optimizer``; a param group mixing a watched
                matrix with other parameters; no watched matrix among its parameters.
        """
        inner = optimizer
        # accelerate's AcceleratedOptimizer (an Optimizer subclass that never ran its __init__,
        # so it has no hooks of its own) steps the optimizer it wraps: the hooks go on that one.
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise ConfigurationError(
                f"`optimizer` must be a torch.optim.Optimizer (whose learning rates lr_balance "
                f"scales), got {optimizer!r}"
            )
        groups = group_units(inner.param_groups, self.units, self._names, self.caller)
        if not groups:
            raise ConfigurationError(
                f"{self.caller}: `lr_balance` found none of the watched matrices' parameters in the "
                "optimizer; build its groups with spectral_callbacks.balanced_param_groups(model)"
            )
        self.detach()
        self._optimizer, self._groups, self._group_count = inner, groups, len(inner.param_groups)
        self._handles = (
            inner.register_step_pre_hook(self._scale),
            inner.register_step_post_hook(self._restore),
        )

    def detach(self) -> None:
        """Remove the hooks (the optimizer's learning rates are its own again)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._optimizer = (), None

    def update(self, metrics: Mapping[str, Mapping[str, float]]) -> bool:
        """Read one snapshot's results; ``True`` when an ESD α among them changed the factors."""
        changed = False
        for name, values in metrics.items():
            alpha = values.get(self._metric)
            if name in self._unit_of and alpha is not None and math.isfinite(alpha):
                self.alpha[name] = float(alpha)
                changed = True
        if changed:
            self._refactor()
        return changed

    def factor_of(self, target: str) -> float:
        """The current factor of the watched matrix named ``target``."""
        return self.factors[self._unit_of[target]]

    def summary(self) -> str:
        """A Markdown line: the band, and the units at its two ends."""
        low, high = self.balance.low, self.balance.high
        text = (
            f"TempBalance linear map per {self.balance.per} of {self._metric}: band "
            f"[{low:g}, {high:g}], {len(self.units)} unit(s)"
            + (f", {len(self.left_out)} left out" if self.left_out else "")
        )
        scored = [(self._unit_alpha(i), i) for i in range(len(self.units))]
        scored = [(alpha, i) for alpha, i in scored if math.isfinite(alpha)]
        if scored:
            (a_low, i_low), (a_high, i_high) = min(scored), max(scored)
            text += (
                f"; smallest α {a_low:.3f} ({self.units[i_low].name}) → "
                f"{self.factors[i_low]:.3f}, largest α {a_high:.3f} "
                f"({self.units[i_high].name}) → {self.factors[i_high]:.3f}"
            )
        return text

    def state_dict(self) -> dict[str, Any]:
        """The latest α of each matrix (the factors follow from them)."""
        return {"alpha": dict(self.alpha)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s α (of the matrices still watched) and their factors."""
        self.alpha = {
            name: float(alpha)
            for name, alpha in dict(state.get("alpha", {})).items()
            if name in self._unit_of
        }
        self._refactor()

    # --- the hooks -------------------------------------------------------------------------------

    def _scale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._restore(optimizer, args, kwargs)  # a step that raised never ran the post hook
        if len(optimizer.param_groups) != self._group_count:  # add_param_group since attach
            self._groups = group_units(optimizer.param_groups, self.units, self._names, self.caller)
            self._group_count = len(optimizer.param_groups)
        for index, unit in self._groups.items():
            factor = self.factors[unit]
            if factor == 1.0:
                continue
            group = optimizer.param_groups[index]
            original = group["lr"]
            if isinstance(original, torch.Tensor):  # scaled in place: the object is kept
                saved = original.detach().clone()
                with torch.no_grad():
                    original.mul_(factor)
                self._scaled.append((group, saved, original))
                continue
            scaled = original * factor
            group["lr"] = scaled
            self._scaled.append((group, original, scaled))

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, original, scaled in self._scaled:
            if group["lr"] is not scaled:  # changed by the optimizer itself: left as it made it
                continue
            if isinstance(scaled, torch.Tensor):
                with torch.no_grad():
                    scaled.copy_(original)  # the value as it was, in the same object
            else:
                group["lr"] = original
        self._scaled.clear()

    def _unit_alpha(self, index: int) -> float:
        known = [self.alpha[name] for name in self.units[index].targets if name in self.alpha]
        return sum(known) / len(known) if known else math.nan

    def _left_out(self, targets: Sequence[Any]) -> frozenset[int]:
        """The units the map leaves out: the first and the last (``skip_first_last``), those with
        a matrix of fewer than ``min_eigenvalues`` eigenvalues."""
        balance = self.balance
        shapes = {target.name: target.shape for target in targets}
        out = {
            i
            for i, unit in enumerate(self.units)
            if any(min(shapes[name]) < balance.min_eigenvalues for name in unit.targets)
        }
        if balance.skip_first_last and self.units:
            out |= {0, len(self.units) - 1}
        return frozenset(out)

    def _refactor(self) -> None:
        # A unit left out has no α in the map: factor 1, outside the min and the max.
        alpha = torch.tensor(
            [
                math.nan if i in self.left_out else self._unit_alpha(i)
                for i in range(len(self.units))
            ],
            dtype=torch.float64,
        )
        factors = tempbalance_factors(alpha, low=self.balance.low, high=self.balance.high)
        self.factors = [float(factor) for factor in factors]
