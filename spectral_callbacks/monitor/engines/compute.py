"""SpectrumCompute: the default compute function the engine runs on each shape group, and
ComputeFunction: what the engine, the budget and the tracker call on any compute function.

It turns a ``(B, m, n)`` stack of snapshots into metric tensors: a batched randomized top-k SVD,
warm-started from the previous snapshot's subspace, the exact ‖W‖_F², and the metrics of
``spectral_callbacks.functional``; for a batch that carries an update (``update_spectrum()``: an
adapted layer's factors) also the ``update_*`` family. It holds no Lightning or engine logic.

Observing must not change the run: the Gaussian start blocks come from generators the compute owns
(one per device, seeded deterministically), never from torch's default generator, whose draws would
otherwise interleave with training's dropout and data shuffling at moments that depend on timing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from spectral_callbacks.functional import (
    DEFAULT_N_OVERSAMPLES,
    esd_metrics,
    frobenius_norm_sq,
    metrics_from_spectrum,
    randomized_svd,
    update_metrics,
)
from spectral_callbacks.functional.batch import MeasuredBatch, Stack
from spectral_callbacks.functional.calibration import MethodCalibration
from spectral_callbacks.functional.memory import subspace_bytes, svd_working_bytes
from spectral_callbacks.monitor.snapshot import ShapeGroup

#: The value a compute adds for the matrices whose SVD solver raised and whose spectrum came from
#: the exact float64 path instead (1.0; 0.0 for the rest of their group): counted and said by the
#: reporting (``spectral_monitor/svd_fallbacks``), never logged as a metric of its own.
SVD_FALLBACK = "svd_fallback"

#: ``compute(group, batch)``: ``batch`` is a float ``(B, m, n)`` stack of the group's matrices (or
#: the ``functional.batch.MatrixBatch`` a kind of target snapshots itself as); returns metric
#: name -> ``(B,)`` tensor. On CUDA it runs with the compute stream current.
Compute = Callable[[ShapeGroup, Stack], dict[str, torch.Tensor]]


class ComputeFunction:
    """A compute function and every member the budget and the tracker call on it, each declared
    here with the default of a plain ``(group, batch) -> {metric: (B,) tensor}`` function (the
    ``compute=`` option): its working set is the default SVD's bound, it keeps nothing between
    snapshots and has no state to save. :class:`SpectrumCompute` overrides them; so may a user's
    compute that keeps state (subclass this class), and :func:`as_compute_function` gives a plain
    function the defaults.
    """

    def __call__(self, group: ShapeGroup, batch: Stack) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must define __call__(group, batch)")

    def working_bytes(self, group: ShapeGroup, batch: int) -> int:
        """Upper bound of the bytes one call allocates on ``batch`` matrices of ``group``: the
        default SVD's (``functional.memory.svd_working_bytes``)."""
        m, n = group.shape
        dtype = torch.float64 if group.dtype == torch.float64 else torch.float32
        return svd_working_bytes(m, n, batch, dtype, device_type=group.device.split(":")[0])

    def kept_bytes(self, group: ShapeGroup) -> int:
        """The bytes kept for ``group`` between snapshots (a warm start's subspace): none."""
        return 0

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run needs to continue as this one would (saved in the tracker's
        ``state_dict`` under ``"compute"``); ``None``: nothing."""
        return None

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def continue_after(self, snapshots: int) -> None:
        """``snapshots`` were taken before this run (a resume): a cadence counted in snapshots
        continues from there."""

    def release(self) -> None:
        """Drop what only the run needed, once it is over."""


class _PlainFunction(ComputeFunction):
    """A plain compute function, with :class:`ComputeFunction`'s defaults."""

    def __init__(self, function: Compute) -> None:
        self.function = function

    def __call__(self, group: ShapeGroup, batch: Stack) -> dict[str, torch.Tensor]:
        return self.function(group, batch)


def as_compute_function(compute: Compute) -> ComputeFunction:
    """``compute`` as a :class:`ComputeFunction`: itself, or a plain function with the defaults.

    >>> as_compute_function(lambda group, batch: {}).kept_bytes(ShapeGroup("2x2/float32/cpu", ()))
    0
    """
    return compute if isinstance(compute, ComputeFunction) else _PlainFunction(compute)


class SpectrumCompute(ComputeFunction):
    """The default compute function: batched randomized top-k SVD, exact ‖W‖_F², the metrics.

    The right subspace ``V`` of each shape group is kept and passed back as ``init`` at the next
    snapshot (weights move little between snapshots, so a warm start reaches σ₁ in fewer power
    iterations). With ``method="auto"`` the randomized and the exact Gram path are timed against
    each other at a group's first cold and first warm snapshot, on the group's first matrix, and
    the faster one runs on the rest and is kept
    (:class:`~spectral_callbacks.functional.calibration.MethodCalibration`). It runs on one thread
    at a time (the engine's worker, or training's when inline), so that state needs no lock.

    Args:
        k: singular values computed per matrix (capped at the smaller side). Default ``32``.
        n_oversamples, n_iter, method: passed to ``randomized_svd``; ``None`` keeps its defaults.
        fit_window: passed to ``metrics_from_spectrum`` (ranks the α fit uses); ``None`` keeps its
            default.
        esd: also fit the full eigenvalue spectrum (``esd_alpha``, ``esd_ks_distance``,
            ``esd_xmin``, ``esd_tail_size``). Default ``False``.
        esd_median: with ``esd``, also TempBalance's fit ``esd_alpha_median``. Default ``False``.
        esd_every_n_snapshots: with ``esd``, on the first snapshot and every this many after it;
            the other snapshots carry no ESD metric (so nothing is logged for them). Default ``10``.
        warm_start: reuse the previous snapshot's subspace. Default ``True``.
        seed: seed of the compute's own random generators (one per device, created at first use).
            Default ``0``.

    Example::

        >>> compute = SpectrumCompute(k=2, method="randomized")
        >>> group = ShapeGroup("3x3/float32/cpu", ())
        >>> batch = torch.diag(torch.tensor([3.0, 2.0, 1.0]))[None]
        >>> [round(v, 4) for v in compute(group, batch)["spectral_norm"].tolist()]
        [3.0]
        >>> sorted(compute.state_dict()["generators"])
        ['cpu']
    """

    def __init__(
        self,
        k: int = 32,
        *,
        n_oversamples: int | None = None,
        n_iter: int | None = None,
        method: str = "auto",
        fit_window: Any = None,
        esd: bool = False,
        esd_every_n_snapshots: int = 10,
        esd_median: bool = False,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        self.k = k
        self.svd_options: dict[str, Any] = {"method": method}
        if n_oversamples is not None:
            self.svd_options["n_oversamples"] = n_oversamples
        if n_iter is not None:
            self.svd_options["n_iter"] = n_iter
        self.metric_options: dict[str, Any] = {}
        if fit_window is not None:
            self.metric_options["fit_window"] = fit_window
        self.esd = esd
        self.esd_median = esd_median
        self.esd_every_n_snapshots = esd_every_n_snapshots
        # Snapshots seen per shape group: every group is in every snapshot, so the counts agree
        # and the ESD lands on the same snapshots for all of them. A resumed run counts on from
        # the snapshots taken before it (continue_after).
        self._seen: dict[str, int] = {}
        self._taken_before = 0
        # Set at the end of a run: the final snapshot carries the ESD family whatever the cadence.
        self._esd_from: int | None = None
        self.warm_start = warm_start
        self._subspaces: dict[str, torch.Tensor] = {}
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._restored_states: dict[str, torch.Tensor] = {}
        # Which path is fastest for each kind of call, timed on this machine at its first
        # snapshot (on the thread that runs the compute: the worker or, inline, training's).
        self.calibration = MethodCalibration()

    def __call__(self, group: ShapeGroup, batch: Stack) -> dict[str, torch.Tensor]:
        # A batch whose metrics are exact from its own structure (a layer's attention heads,
        # targets/circuits.py) needs no SVD.
        if isinstance(batch, MeasuredBatch):
            return batch.exact_metrics()
        # ‖W‖_F² exactly from the snapshot, never from the truncated spectrum (docs/metrics.md, Definitions).
        frobenius_sq = frobenius_norm_sq(batch)
        k = min(self.k, *batch.shape[-2:])
        init = self._subspaces.get(group.key) if self.warm_start else None
        if init is not None and init.shape[0] != batch.shape[0]:
            init = None
        top = randomized_svd(
            batch,
            k,
            init=init,
            generator=self._generator(batch.device),
            calibration=self.calibration,
            **self.svd_options,
        )
        if self.warm_start and top.V is not None:
            self._subspaces[group.key] = top.V
        metrics = metrics_from_spectrum(top.S, frobenius_sq, **self.metric_options)
        if top.fell_back is not None:  # a solver raised: the exact path stood in, said in the log
            metrics[SVD_FALLBACK] = top.fell_back.to(top.S.dtype)
        # A batch held as an operator carries an update (an adapted layer's s B A, a fine-tune's
        # W_t - W_ref): its spectrum adds the update family. A dense stack has none.
        if not isinstance(batch, torch.Tensor):
            metrics.update(update_metrics(*batch.update_spectrum()))
        seen = self._seen.get(group.key, self._taken_before)
        self._seen[group.key] = seen + 1
        final = self._esd_from is not None and seen >= self._esd_from
        if self.esd and (final or seen % self.esd_every_n_snapshots == 0):
            # The ESD needs every eigenvalue: an adapted layer's effective W0 + s B A is formed.
            dense = batch if isinstance(batch, torch.Tensor) else batch.dense()
            metrics.update(esd_metrics(dense, median=self.esd_median))
        return metrics

    def esd_due(self, snapshot: int) -> bool:
        """Whether the run's snapshot number ``snapshot`` (0 = its first) carries the ESD family
        on the cadence."""
        return self.esd and snapshot % self.esd_every_n_snapshots == 0

    def esd_from(self, snapshot: int) -> None:
        """The run's snapshot number ``snapshot`` and any after it carry the ESD family: its last
        one, so a reading of the run's end (``rank-layers``) reads its last step, not an earlier
        one (snapshots still in flight before it keep the cadence)."""
        self._esd_from = snapshot

    def continue_after(self, snapshots: int) -> None:
        """Resume the ESD cadence: ``snapshots`` were taken before this run (the tracker counts
        them), so the next snapshot seen is number ``snapshots`` of the run, not its first."""
        self._seen.clear()
        self._taken_before = snapshots

    def working_bytes(self, group: ShapeGroup, batch: int) -> int:
        """Upper bound of the bytes one call allocates on ``batch`` matrices of ``group`` (given in
        float32, or float64): ``functional.memory.svd_working_bytes`` with these SVD options, or
        what a kind of target that computes its own metrics says (attention heads)."""
        own = group.targets[0].working_bytes(batch)
        if own is not None:
            return own
        m, n = group.shape
        dtype = torch.float64 if group.dtype == torch.float64 else torch.float32
        return svd_working_bytes(
            m,
            n,
            batch,
            dtype,
            k=self.k,
            device_type=group.device.split(":")[0],
            esd=self.esd,
            **self._sizes(),
        )

    def kept_bytes(self, group: ShapeGroup) -> int:
        """The bytes of the warm-start subspace kept for ``group`` between snapshots."""
        if not self.warm_start or group.targets[0].working_bytes(len(group.targets)) is not None:
            return 0  # nothing kept (a kind that computes its own metrics: attention heads)
        m, n = group.shape
        dtype = torch.float64 if group.dtype == torch.float64 else torch.float32
        width = self.k + self.svd_options.get("n_oversamples", DEFAULT_N_OVERSAMPLES)
        return subspace_bytes(m, n, len(group.targets), dtype, width=width)

    def _sizes(self) -> dict[str, Any]:
        return {
            "n_oversamples": self.svd_options.get("n_oversamples", DEFAULT_N_OVERSAMPLES),
            "n_iter": self.svd_options.get("n_iter"),
            "method": self.svd_options["method"],
        }

    def release(self) -> None:
        """Forget the warm-start subspaces (at the end of a run: they hold device memory)."""
        self._subspaces.clear()

    def state_dict(self) -> dict[str, Any]:
        """The generators' states (device -> ByteTensor), so a resumed run continues their streams.

        Read while the worker may be drawing, a state is still one between two draws (a generator
        locks itself per draw); a snapshot in flight at checkpoint time draws after it.
        """
        states = dict(self._restored_states)
        states.update({device: gen.get_state() for device, gen in self._generators.items()})
        return {"seed": self.seed, "generators": states}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the generators' states (applied to a device's generator when it is created)."""
        self.seed = int(state_dict.get("seed", self.seed))
        self._restored_states = dict(state_dict.get("generators", {}))
        self._generators.clear()

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(self.seed)
            if key in self._restored_states:
                generator.set_state(self._restored_states.pop(key))
            self._generators[key] = generator
        return generator
