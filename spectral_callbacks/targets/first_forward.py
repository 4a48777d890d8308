"""Roles read from the first forward the model makes anyway: no extra pass, no input to invent.

``FirstForward(model, done)`` hooks the model's root: its next forward (the first training
forward) runs under the recorder of ``targets/dataflow.py``, and when it returns ``done`` gets the
roles read from it (``targets/roles.py``). The hooks remove themselves after that one forward, even
one that raised. Recording changes nothing the forward computes and holds no activation memory
beyond the forward's own (see ``dataflow.py``).

Example::

    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    >>> found = []
    >>> watch = FirstForward(layer, found.append)
    >>> _ = layer(torch.randn(1, 3, 8))          # the training forward: recorded once
    >>> _ = layer(torch.randn(1, 3, 8))          # later ones are not
    >>> len(found), watch.done
    (1, True)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from spectral_callbacks.targets.dataflow import Recording, record
from spectral_callbacks.targets.roles import FlowMap, roles_from_recording

__all__ = ["FirstForward"]


class FirstForward:
    """Record ``model``'s next forward and call ``done(flow)`` with the roles it shows.

    Args:
        model: the module whose forward the training loop calls (its root).
        done: called once, after that forward returns, with the :class:`FlowMap`.
    """

    def __init__(self, model: nn.Module, done: Callable[[FlowMap], None]) -> None:
        self.model = model
        self.done = False
        self._callback = done
        self._context: AbstractContextManager[Recording] | None = None
        self._recording: Recording | None = None
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._finish, always_call=True),
        ]

    def _start(self, module: nn.Module, args: Any) -> None:
        if self._context is not None or self.done:
            return  # a nested call of the root: one recording covers it
        self._context = record(self.model, hook_root=False)
        self._recording = self._context.__enter__()

    def _finish(self, module: nn.Module, args: Any, output: Any = None) -> None:
        if self._context is None or self.done:
            return
        context, recording = self._context, self._recording
        self._context = self._recording = None
        self.cancel()
        context.__exit__(None, None, None)  # the function mode and module hooks end here
        if output is None or recording is None:
            return  # the forward raised: nothing to read (the names decide, see the tracker)
        self._callback(roles_from_recording(recording))

    def cancel(self) -> None:
        """Stop waiting for a forward (the hooks are removed; a recording under way ends)."""
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._context is not None:
            context, self._context, self._recording = self._context, None, None
            context.__exit__(None, None, None)
