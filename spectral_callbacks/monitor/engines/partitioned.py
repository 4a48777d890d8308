"""Parameters no rank holds a matrix of: FSDP1's flat parameters and DeepSpeed ZeRO-3's partitions.

The monitor decomposes a watched matrix where it lives: whole on every rank (one process, DDP), or
as DTensor shards whose global positions are known (FSDP2 ``fully_shard``, tensor parallelism;
see ``shards.py``). FSDP1 (``FullyShardedDataParallel``) concatenates a module's parameters into
one 1-D ``FlatParameter`` and gives each rank a slice of it; with ``use_orig_params=True`` each
original parameter is a 1-D view of that slice, often empty. ZeRO-3 replaces every parameter by an
empty placeholder with its partition kept aside. Neither leaves a matrix, or a block of one with
known rows and columns, on any rank, and gathering them would move every watched weight at every
snapshot. So every frontend refuses them, with one message (:func:`partitioned_error`): the
tracker when it finds them on the model (:func:`refuse_partitioned`, which the Hugging Face
callback, Fabric and raw loops go through), Lightning's ``check_strategy`` earlier, from the
strategy, before the model is wrapped.

How they are recognised, the one place that reads other libraries' markers:

* FSDP1: a ``FullyShardedDataParallel`` module (public), else a parameter FSDP1 marked as
  flattened - the ``FlatParameter`` itself (``_is_flat_param``) or an original parameter under
  ``use_orig_params`` - through the private ``_fsdp_flattened`` / ``_is_flat_param`` attributes
  (torch's ``fsdp._common_utils.FSDP_FLATTENED``; FSDP2 sets neither). If torch renames them,
  a wrapped model is still caught by its wrapper; only a module taken out of its wrapper is not.
* ZeRO-3: DeepSpeed's documented parameter attributes ``ds_id``, ``ds_status`` and ``ds_numel``
  (what ``deepspeed.zero.Init`` and the ZeRO-3 engine add to every partitioned parameter, and
  what ``deepspeed.zero.GatheredParameters`` users test for).

Example::

    >>> import torch
    >>> partitioning(torch.nn.Linear(4, 4)) is None
    True
    >>> layer = torch.nn.Linear(4, 4)
    >>> layer.weight.ds_id, layer.weight.ds_status, layer.weight.ds_numel = 0, "NOT_AVAILABLE", 16
    >>> partitioning(layer)
    'DeepSpeed ZeRO-3'
"""

from __future__ import annotations

import torch

from spectral_callbacks.monitor.options import ConfigurationError

__all__ = ["partitioned_error", "partitioning", "refuse_partitioned"]

FSDP1 = "FSDP1 (FullyShardedDataParallel)"
ZERO3 = "DeepSpeed ZeRO-3"

# FSDP1's marks on the parameters it flattened (private: torch.distributed.fsdp._common_utils).
_FSDP1_FLATTENED = ("_fsdp_flattened", "_is_flat_param")
# DeepSpeed's documented attributes of a ZeRO-3 partitioned parameter.
_ZERO3_PARAMETER = ("ds_id", "ds_status", "ds_numel")


def partitioning(model: torch.nn.Module) -> str | None:
    """Which scheme flattened or partitioned ``model``'s parameters: ``FSDP1``, ``ZERO3`` or ``None``.

    Args:
        model: the model as the training loop holds it (a wrapper or the module inside it).
    """
    if any(isinstance(module, _fsdp1_wrapper()) for module in model.modules()):
        return FSDP1
    for parameter in model.parameters():
        if any(getattr(parameter, mark, False) for mark in _FSDP1_FLATTENED):
            return FSDP1
        if all(hasattr(parameter, attribute) for attribute in _ZERO3_PARAMETER):
            return ZERO3
    return None


def partitioned_error(caller: str, scheme: str) -> ConfigurationError:
    """The one error every frontend raises for a model trained with ``scheme``.

    Args:
        caller: the frontend's name (``SpectralMonitor``, ``SpectralTracker``, ...).
        scheme: what partitions the parameters (``FSDP1``, ``ZERO3``, a Lightning strategy name).
    """
    return ConfigurationError(
        f"{caller} cannot watch a model trained with {scheme}: it flattens and partitions the "
        "parameters, so no rank holds a matrix or a DTensor shard of one, and gathering them would "
        "move every weight at every snapshot. Shard with FSDP2 instead "
        "(torch.distributed.fsdp.fully_shard; under Lightning, ModelParallelStrategy with "
        "fully_shard in configure_model), whose DTensor shards are decomposed where they live, or "
        "save a full checkpoint and decompose it offline with `spectral-callbacks analyze`."
    )


def refuse_partitioned(model: torch.nn.Module, caller: str) -> None:
    """Raise :func:`partitioned_error` if FSDP1 or ZeRO-3 holds ``model``'s parameters.

    Raises:
        ConfigurationError: see :func:`partitioned_error`.
    """
    scheme = partitioning(model)
    if scheme is not None:
        raise partitioned_error(caller, scheme)


def _fsdp1_wrapper() -> tuple[type, ...]:
    """``FullyShardedDataParallel``, or nothing where torch is built without distributed."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return (FullyShardedDataParallel,)
