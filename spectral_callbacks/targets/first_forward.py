"""Roles read from the first forward the model makes anyway: no extra pass, no input to invent.

``FirstForward(model, done)`` waits for the model's next forward (the first training forward) and
records it with ``targets/dataflow.py``; when it returns, ``done`` gets the roles read from it
(``targets/roles.py``). Which forward that is:

* a call of the root or of one of its direct children, whichever comes first, to its end: a loop
  calls ``model(x)``, and a wrapper that holds the network (a LightningModule whose
  ``training_step`` calls ``self.model(x)``) calls a child;
* or the span a frontend marks with :meth:`open` and :meth:`close`, when it knows where the
  training step's forward begins and ends whatever the model calls (Lightning: from the batch's
  start to ``on_before_backward``), so a step that calls several children is recorded whole.

The hooks remove themselves after that one forward, even one that raised. Recording changes
nothing the forward computes and holds no activation memory beyond the forward's own (see
``dataflow.py``); the record is released as soon as the roles are read from it.

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

_WINDOW = "window"  # the owner of a recording a frontend opened (not a module's call)


class FirstForward:
    """Record ``model``'s next forward and call ``done(flow)`` with the roles it shows.

    Args:
        model: the module the tracker watches (the network, or a wrapper that holds it).
        done: called once, after that forward returns, with the :class:`FlowMap`.
    """

    def __init__(self, model: nn.Module, done: Callable[[FlowMap], None]) -> None:
        self.model = model
        self.done = False
        self._callback = done
        self._context: AbstractContextManager[Recording] | None = None
        self._recording: Recording | None = None
        self._owner: nn.Module | str | None = None  # what started the recording under way
        self._handles = []
        for module in (model, *model.children()):
            self._handles.append(
                module.register_forward_pre_hook(lambda m, args: self._start(m, running=m))
            )
            self._handles.append(
                module.register_forward_hook(
                    lambda m, args, output: self._finish(m, output), always_call=True
                )
            )

    @property
    def recording(self) -> bool:
        """A forward is being recorded now."""
        return self._context is not None

    def open(self) -> None:
        """Start recording now (a frontend at the start of a training step); a no-op once done
        or while a recording is under way."""
        self._start(_WINDOW, running=None)

    def close(self) -> None:
        """End the recording :meth:`open` started and read the roles (before the backward)."""
        self._finish(_WINDOW, True)

    def _start(self, owner: nn.Module | str, running: nn.Module | None) -> None:
        if self._context is not None or self.done:
            return  # a nested call, or a later forward: the recording under way covers it
        self._owner = owner
        self._context = record(self.model, running=running)
        self._recording = self._context.__enter__()

    def _finish(self, owner: nn.Module | str, output: Any) -> None:
        if self._context is None or self.done or owner is not self._owner:
            return  # not the call that started the recording (a child of a recorded window)
        context, recording = self._context, self._recording
        self._context = self._recording = None
        self.cancel()
        context.__exit__(None, None, None)  # the function mode and module hooks end here
        if output is None or recording is None:
            if recording is not None:
                recording.release()
            return  # the forward raised: nothing to read (the names decide, see the tracker)
        try:
            flow = roles_from_recording(recording)
        finally:
            recording.release()  # freed now, not by the cyclic collector some steps later
        self._callback(flow)

    def cancel(self) -> None:
        """Stop waiting for a forward (the hooks are removed; a recording under way ends)."""
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._context is not None:
            context, recording = self._context, self._recording
            self._context = self._recording = None
            context.__exit__(None, None, None)
            if recording is not None:
                recording.release()
