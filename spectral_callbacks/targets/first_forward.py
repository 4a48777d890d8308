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

Nothing of ours is raised inside the user's forward: where the recording or the reading of its
roles fails, ``unread(why)`` is called instead of ``done`` (the tracker then lets the names
decide). A forward that dynamo traces (the model called through ``torch.compile`` of a wrapper
around it, as the Hugging Face Trainer's ``torch_compile=True`` does) runs a graph, not our
hooks: they are no-ops while it traces (``torch.compiler.is_compiling()``), and the first
gradient accumulated (a hook on one trained parameter, run eagerly by autograd before any update)
calls ``unread`` with the reason, so the names decide with step 0 still before the first update.
The forward hooks of a compiled forward are then left in place, inert: removing them would make
dynamo recompile the model's graph.

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

import torch
from torch import nn

from spectral_callbacks.targets.dataflow import Recording, record
from spectral_callbacks.targets.roles import FlowMap, roles_from_recording

__all__ = ["FirstForward"]

_WINDOW = "window"  # the owner of a recording a frontend opened (not a module's call)

COMPILED = (
    "the model's forward ran compiled (torch.compile of a module that calls it): dynamo traces "
    "a graph, not a recording"
)


def _is_compiling() -> bool:
    """Dynamo is tracing the code that calls this (a constant inside the traced graph)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    return bool(torch._dynamo.is_compiling())  # torch < 2.3


class FirstForward:
    """Record ``model``'s next forward and call ``done(flow)`` with the roles it shows.

    Args:
        model: the module the tracker watches (the network, or a wrapper that holds it).
        done: called once, after that forward returns, with the :class:`FlowMap`.
        unread: called once instead of ``done`` with why the roles could not be read from it
            (the recording or its reading raised; the forward ran compiled). Default: none.
    """

    def __init__(
        self,
        model: nn.Module,
        done: Callable[[FlowMap], None],
        unread: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        self.done = False
        self.compiled = False  # set (as a side effect dynamo replays) by a traced forward
        self._callback: Callable[[FlowMap], None] | None = done
        self._unread = unread
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
        trained = next((p for p in model.parameters() if p.requires_grad), None)
        self._gradient_hook = (
            None
            if trained is None
            else trained.register_post_accumulate_grad_hook(lambda p: self._after_backward())
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
        if _is_compiling():  # first, reading no state: dynamo would guard the graph on it
            self.compiled = True
            return
        if self._context is not None or self.done:
            return  # a nested call, or a later forward: the recording under way covers it
        try:
            context = record(self.model, running=running)
            recording = context.__enter__()
        except Exception as error:  # ours: never raised inside the user's forward
            self._give_up(f"its recording could not start ({type(error).__name__}: {error})")
            return
        self._owner, self._context, self._recording = owner, context, recording

    def _finish(self, owner: nn.Module | str, output: Any) -> None:
        if _is_compiling():
            return
        if self._context is None or self.done or owner is not self._owner:
            return  # not the call that started the recording (a child of a recorded window)
        context, recording = self._context, self._recording
        self._context = self._recording = None
        callback, unread = self._callback, self._unread
        self.cancel()
        try:
            context.__exit__(None, None, None)  # the function mode and module hooks end here
            if output is None or recording is None:
                return  # the forward raised: nothing to read (the names decide, see the tracker)
            flow = roles_from_recording(recording)
        except Exception as error:  # ours: never raised inside the user's forward
            if unread is not None:
                unread(f"its roles could not be read ({type(error).__name__}: {error})")
            return
        finally:
            if recording is not None:
                recording.release()  # freed now, not by the cyclic collector some steps later
        if callback is not None:
            callback(flow)

    def _after_backward(self) -> None:
        """The first gradient, before any update: a forward that passed by the hooks (compiled)
        leaves the roles to the names now."""
        if self.done or self._context is not None:
            return
        self._give_up(COMPILED if self.compiled else "the model's forward did not run its hooks")

    def _give_up(self, why: str) -> None:
        unread = self._unread
        self.cancel()
        if unread is not None:
            unread(why)

    def cancel(self) -> None:
        """Stop waiting for a forward (the hooks are removed; a recording under way ends).

        After a compiled forward the forward hooks stay, inert (``done``): a compiled graph
        guards on the model's hooks, and removing them would recompile it."""
        self.done = True
        self._callback = self._unread = None
        if self._gradient_hook is not None:
            self._gradient_hook.remove()
            self._gradient_hook = None
        if not self.compiled:
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if self._context is not None:
            context, recording = self._context, self._recording
            self._context = self._recording = None
            context.__exit__(None, None, None)
            if recording is not None:
                recording.release()
