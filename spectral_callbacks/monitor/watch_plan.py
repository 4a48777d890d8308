"""WatchPlan: what a tracker watches, decided in one place and handed over once.

The decision reads the names (``find_targets``), or the model's first training forward
(``targets/first_forward.py``) where the names leave weights unread or the user asks for the
forward's roles, or both ("auto": the names decide, the forward must confirm them); under several
processes the ranks agree on it or fail together; ``delta=``'s references and ``circuits=``'s heads
are added last. The tracker gets the final targets by one call of ``hand`` and builds everything
else from them.

The heads' logit scales come from the recorded forward where it shows them
(``targets/forward_scale.py``). Where the names decide before the first forward ("auto"), the
heads are handed over with their modules' declared scales and the forward's are set when it is
read; until then the tracker holds its first snapshot (:attr:`WatchPlan.scales_pending`), and
``release`` lets it go (the weights are still the initial ones: the first forward comes before the
first update).

Its safety rules live here together: a callback of the first forward runs inside the user's
forward, so nothing it raises is raised there (it is kept and raised by the tracker's next call,
:meth:`WatchPlan.raise_kept_error`); the recording itself keeps no activation and stays inert while
dynamo traces (``first_forward.py``); the checks of a module run with autocast off (``probe.py``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from spectral_callbacks.messages import rank_zero_info, rank_zero_warn
from spectral_callbacks.monitor.engines.distributed import world
from spectral_callbacks.monitor.engines.partitioned import (
    Gathering,
    gathering_of,
    held_in_gathers,
    partitioning,
)
from spectral_callbacks.monitor.engines.protocol import decomposed_here
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.targets.first_forward import COMPILED, FirstForward
from spectral_callbacks.targets.roles import FlowMap
from spectral_callbacks.targets.target import Target, TargetList

#: ``hand(targets, begin)``: the final targets; ``begin`` False when the first snapshot must wait
#: for the next step (the step came before any forward: the step asked for is already past).
Hand = Callable[[list[Target], bool], None]


def _forward_not_followed(model: torch.nn.Module, compiled: bool = False) -> str | None:
    """Why ``model``'s forward cannot be recorded (its roles then come from the names), or None;
    ``compiled``: a frontend says it will run compiled."""
    if compiled:
        return "the model's forward runs compiled (torch.compile): its forward runs a graph"
    for module in model.modules():
        if hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None):
            return "the model is compiled (torch.compile): its forward runs a graph"
        # Lightning's trainer.fit(torch.compile(module)) compiles the module's own methods
        # (forward, training_step) in place: dynamo's wrappers keep the callable they wrap.
        if any(hasattr(method, "_torchdynamo_orig_callable") for method in vars(module).values()):
            return "the model is compiled (torch.compile): its forward runs a graph"
    scheme = partitioning(model)
    if scheme is not None:
        return f"its parameters are partitioned ({scheme}): each rank's forward gathers them"
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        return (
            "its weights are sharded (DTensor: fully_shard / tensor parallel): each rank's "
            "forward sees its shards"
        )
    return None


def _first_line(error: BaseException | None) -> str:
    """An error's message as one line (its first, without a caller's ``Name:`` prefix), for a
    message that quotes it."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    caller, colon, rest = lines[0].partition(": ")
    return rest if colon and caller.isidentifier() else lines[0]


def _contradicts_names(error: BaseException) -> bool:
    """``error`` says the forward reads a weight otherwise than the names (see reconcile.py)."""
    return bool(getattr(error.__cause__, "contradicts_names", False))


class WatchPlan:
    """Decides which matrices a tracker watches and hands them to ``hand`` once.

    Args:
        model: the network.
        options: the tracker's options (``roles_from_first_forward``, ``example_input``, the
            ``find_targets`` options, ``delta``, ``circuits``).
        caller: the name messages use.
        hand: called with the final targets (see :data:`Hand`) once it returns; what it raises
            propagates (from :meth:`start` and :meth:`names_now`, or kept by the forward's
            callbacks like their own errors), and the names may then hand them again.
        release: called once the heads' logit scales are settled where the tracker held its
            first snapshot for them (:attr:`scales_pending`); default none.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        options: MonitorOptions,
        caller: str,
        hand: Hand,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.options = options
        self.caller = caller
        #: How FSDP1 / ZeRO-3 parameters are gathered (``None``: every rank holds its matrices or
        #: DTensor shards); the targets are found, and ``delta=``'s references copied, inside
        #: one gather of the whole model.
        self.gathering: Gathering | None = gathering_of(model, caller)
        self._hand: Hand | None = hand
        self._release = release
        #: The heads handed over wait for the first forward's logit scales (the tracker holds
        #: its first snapshot until :meth:`settle_scales` or the forward sets them).
        self.scales_pending = False
        self._heads: list[Target] = []
        self.first_forward: FirstForward | None = None
        # An error of the first forward's reading, kept to be raised by the tracker's next call
        # (step, forward_ends, close): nothing of ours is raised inside the user's forward.
        self._raise_later: Exception | None = None

    def start(self, forward_compiled: bool = False) -> None:
        """Decide now where the names (or ``example_input``) can, or wait for the first forward;
        ``forward_compiled``: a frontend says the forward will run compiled."""
        options, caller, model = self.options, self.caller, self.model
        follow = options.roles_from_first_forward if options.example_input is None else False
        why = _forward_not_followed(model, forward_compiled) if follow is not False else None
        if why is not None and follow is True:
            rank_zero_warn(
                f"{caller}: {why}, so its forward cannot be recorded; the roles come from the "
                "names (pass example_input= to read them from an eager forward of the same model)",
                category=RuntimeWarning,
            )
        elif why is not None:
            rank_zero_info(f"{caller}: roles from the names: {why}")
        if why is not None:
            follow = False
        if follow == "auto":  # the names first: the fast path, which the forward must confirm
            found = self._names_if_decided()
            if found is not None:
                self._hand_over(found, scales_later=True)
                confirm = functools.partial(self._in_forward, self._confirm, found)
                names_stand = functools.partial(self._in_forward, self._names_stand)
                self.first_forward = FirstForward(model, confirm, names_stand)
                return
        if follow is not False:
            # Everything that needs the targets waits for the forward (_on_first_forward).
            self.first_forward = FirstForward(
                model,
                functools.partial(self._in_forward, self._on_first_forward),
                functools.partial(self._in_forward, self._on_forward_unread),
            )
            return
        self._hand_over(self._find_targets())

    # --- the calls the tracker passes on -------------------------------------------------------

    def forward_begins(self) -> None:
        """Where the training step's forward begins: the first one is recorded whole."""
        if self.first_forward is not None and not self.first_forward.done:
            self.first_forward.open()

    def forward_ends(self) -> None:
        """... and where it ends: the roles are read now (and handed over if they waited)."""
        if self.first_forward is not None and not self.first_forward.done:
            self.first_forward.close()
        self.raise_kept_error()

    def cancel(self) -> None:
        """No forward will be read (the tracker closes): a later one has nothing to tell."""
        if self.first_forward is not None:
            self.first_forward.cancel()

    def settle_scales(self, scales: Mapping[str, Any] | None = None) -> None:
        """The heads' logit scales are final: the forward's (``FlowMap.logit_scales``) where
        given, else their modules' declarations; the held first snapshot is released. A no-op
        once settled."""
        if not self.scales_pending:
            return
        from spectral_callbacks.targets.circuits import settle_scales

        self.scales_pending = False
        settle_scales(self._heads, scales or {})  # type: ignore[arg-type]
        if self._release is not None:
            self._release()

    def raise_kept_error(self) -> None:
        """Raise the first forward's error, if its reading failed (once)."""
        error, self._raise_later = self._raise_later, None
        if error is not None:
            raise error

    def names_now(self, step: int) -> None:
        """``step`` came before any forward was recorded: the names decide, from this step."""
        assert self.first_forward is not None
        self.first_forward.cancel()
        rank_zero_warn(
            f"{self.caller}: step {step} came before any forward of the model was recorded, so "
            "the roles come from the names alone and the first snapshot is this step's",
            category=RuntimeWarning,
        )
        self._hand_over(self._find_targets(), begin=False)

    # --- the decision --------------------------------------------------------------------------

    def _hand_over(
        self,
        targets: TargetList,
        begin: bool = True,
        scales: Mapping[str, Any] | None = None,
        scales_later: bool = False,
    ) -> None:
        """The final targets: those decided, with ``delta=``'s references and ``circuits=``'s
        heads (their logit scales the forward's ``scales``, or set later: ``scales_later``),
        handed to the tracker."""
        final: list[Target] = targets
        if self.options.circuits is not False:  # first: the ranks' shares count the heads too
            self._heads = self._find_circuits(targets, targets.heads_read, scales, scales_later)
            self.scales_pending = scales_later and bool(self._heads)
        if self.options.delta is not None:
            final = self._with_references(final, self._heads)
        final = final + self._heads
        if self.gathering is not None:
            self.gathering.check(final, self.caller)
        assert self._hand is not None, "the targets are handed over once"
        self._hand(final, begin)
        self._hand = None  # handed over: the plan holds no reference to the tracker any more

    def _in_forward(self, reading: Callable[..., None], *args: Any) -> None:
        """Run ``reading`` (a callback of the first forward, inside the user's forward); what it
        raises is kept and raised by the tracker's next call, never inside the forward."""
        try:
            reading(*args)
        except Exception as error:
            self._raise_later = error

    def _names_if_decided(self) -> TargetList | None:
        """The targets the names give, or ``None`` where they leave weights of the blocks unread
        (none matched, several on one (layer, role), a layout or a module they cannot read) or,
        with ``circuits=``, a layer's head count: then the forward decides, and the names'
        warnings are not given (it may read them)."""
        from spectral_callbacks.targets.circuits import heads_unread
        from spectral_callbacks.targets.errors import TargetError

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                found = self._find_targets()
            except ConfigurationError as error:
                if isinstance(error.__cause__, TargetError) and error.__cause__.undecided:
                    return None
                raise
        if found.unread:
            return None
        if self.options.circuits is not False and heads_unread(
            self.model, found, self._circuit_heads()
        ):
            return None  # circuits=: a head count only the forward's shapes tell
        for warning in caught:  # the names decide: their warnings stand
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
        return found

    def _on_first_forward(self, flow: FlowMap) -> None:
        """The first forward has shown the roles: hand over what every rank agrees on."""
        try:
            read, problem = self._find_targets(flow), None
        except ConfigurationError as error:
            read, problem = None, error
        agreed = self._agreed(read, problem)
        self._hand_over(agreed, scales=flow.logit_scales if problem is None else None)

    def _on_forward_unread(self, why: str) -> None:
        """The first forward's roles could not be read (its recording failed, or it ran
        compiled): the names decide, with step 0 still the initial weights."""
        if why == COMPILED:  # every rank compiles alike: the names, without a collective
            if self.options.roles_from_first_forward is True:  # asked for the forward's roles
                rank_zero_warn(f"{self.caller}: roles from the names: {why}", RuntimeWarning)
            else:
                rank_zero_info(f"{self.caller}: roles from the names: {why}")
            targets = self._find_targets()
        else:
            targets = self._agreed(None, ConfigurationError(f"{self.caller}: {why}"))
        self._hand_over(targets)

    def _names_stand(self, why: str) -> None:
        """``"auto"``: the first forward, which was to confirm the names, could not be read."""
        self.settle_scales()
        if why == COMPILED:
            rank_zero_info(f"{self.caller}: the names are not checked by the forward: {why}")
        else:
            rank_zero_warn(
                f"{self.caller}: the first forward could not be read ({why}); the names decide",
                category=RuntimeWarning,
            )

    def _confirm(self, names: list[Target], flow: FlowMap) -> None:
        """The names decided (``"auto"``): the first forward must read the same roles, layers and
        rows. A weight it reads in another role is an error (``find_targets``' reconcile); one it
        reads where the names read none, or in another layer, is said in one warning, and so is
        a reading that failed otherwise (the names decide)."""
        from spectral_callbacks.targets.errors import PartialTargetWarning

        self.settle_scales(flow.logit_scales)  # first: the held first snapshot goes now
        with warnings.catch_warnings():  # what the names said is said; only the differences count
            warnings.simplefilter("ignore")
            try:
                read = self._find_targets(flow)
            except ConfigurationError as error:
                if _contradicts_names(error):
                    raise
                self._names_stand(_first_line(error))
                return
        watched = {(t.name, t.stack, t.layer, t.role, t.rows) for t in names}
        differences = sorted(
            f"{t.name}: layer {t.layer} {t.role}"
            for t in read
            if (t.name, t.stack, t.layer, t.role, t.rows) not in watched
        )
        if differences:
            rank_zero_warn(
                f"{self.caller}: the first forward reads {len(differences)} role(s) the names do "
                "not (this run watches what the names give):\n  "
                + "\n  ".join(differences[:20])
                + "\nPass roles_from_first_forward=True to watch what the forward reads.",
                category=PartialTargetWarning,
            )

    def _agreed(self, targets: TargetList | None, problem: ConfigurationError | None) -> TargetList:
        """What every rank watches: the roles its first forward read (``targets``), or why it
        could not read them (``problem``).

        One process: a reading that failed lets the names decide (said in one warning), unless
        the forward contradicts them. Several: every rank must watch the same matrices (the
        engine's collectives follow them), so each rank's reading or problem is exchanged
        unconditionally, and a rank that failed or read otherwise makes every rank raise the
        same error at once (never one rank raising while the others wait in the collective).
        """
        _, world_size = world()
        if world_size == 1:
            if problem is None:
                assert targets is not None
                return targets
            if _contradicts_names(problem):
                raise problem
            rank_zero_warn(
                f"{self.caller}: the roles could not be read from the first forward "
                f"({_first_line(problem)}); they come from the names",
                category=RuntimeWarning,
            )
            return self._find_targets()
        import torch.distributed as dist

        mine: tuple[bool, Any] = (
            (True, [(t.name, t.layer, t.role) for t in targets])
            if problem is None and targets is not None
            else (False, _first_line(problem))
        )
        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, mine)
        failed = [f"rank {rank}: {said}" for rank, (ok, said) in enumerate(every) if not ok]
        if failed:
            raise ConfigurationError(
                f"{self.caller}: the roles could not be read from the first forward on "
                f"{len(failed)} of {world_size} ranks ({'; '.join(failed)}); every rank stops. "
                "Pass example_input= (the same batch on every rank) or "
                "roles_from_first_forward=False (the names)"
            )
        if any(theirs != every[0] for theirs in every):
            raise ConfigurationError(
                f"{self.caller}: the ranks read different roles from their first forwards (a "
                "data-dependent path); pass example_input= (the same batch on every rank) or "
                "roles_from_first_forward=False (the names)"
            )
        assert targets is not None
        return targets

    def _find_targets(self, flow: FlowMap | None = None) -> TargetList:
        from spectral_callbacks.targets import UnwatchedExpertWarning, find_targets
        from spectral_callbacks.targets.find import TargetError, unwatched_experts_message

        options = self.options.target_options
        try:
            with warnings.catch_warnings(), self._whole():  # warnings: said once below
                warnings.simplefilter("ignore", UnwatchedExpertWarning)
                found = find_targets(self.model, **options, flow=flow)
                if self.gathering is not None:  # read while the parameters are whole
                    found[:] = held_in_gathers(found)
        except TargetError as error:  # nothing to watch, or a bad mapping: a configuration error
            raise ConfigurationError(
                f"{self.caller}: {error}\n{self.caller}(roles=, include=, exclude=, mapping=) "
                "passes these arguments on to find_targets."
            ) from error
        if found.unwatched_experts:  # training starts without them: say so where it starts
            rank_zero_warn(
                f"{self.caller}: {unwatched_experts_message(found.unwatched_experts)}",
                category=UnwatchedExpertWarning,
            )
        if not found:
            chosen = {key: value for key, value in options.items() if value is not None}
            raise ConfigurationError(
                f"{self.caller} found no matrix to watch with {chosen}; print the candidates with "
                "`spectral_callbacks.format_targets(find_targets(model))`, then pass `mapping=`"
            )
        return found

    def _whole(self) -> contextlib.AbstractContextManager[object]:
        """The whole model gathered where its parameters are partitioned (FSDP1, ZeRO-3)."""
        return contextlib.nullcontext() if self.gathering is None else self.gathering.whole()

    def _circuit_heads(self) -> Mapping[str, int] | None:
        """``circuits=``'s ``{pattern: num_heads}``, or ``None`` where it is ``True``."""
        return self.options.circuits if isinstance(self.options.circuits, Mapping) else None

    def _find_circuits(
        self,
        targets: list[Target],
        read: Mapping[tuple[str, str], int],
        scales: Mapping[str, Any] | None,
        scales_later: bool,
    ) -> list[Target]:
        """The heads of every attention layer among ``targets`` (``circuits=``); ``read``: the
        head counts a forward showed (``TargetList.heads_read``); ``scales``: the logit scales it
        showed (or ``scales_later``: set when it is read)."""
        from spectral_callbacks.targets.circuits import find_circuits
        from spectral_callbacks.targets.errors import TargetError

        try:
            return list(
                find_circuits(
                    self.model, targets, self._circuit_heads(), read, scales,
                    scales_later=scales_later,
                )
            )  # fmt: skip
        except TargetError as error:
            raise ConfigurationError(f"{self.caller}: {error}") from error

    def _with_references(self, targets: list[Target], heads: list[Target]) -> list[Target]:
        """The dense targets as ``DeltaTarget``s keeping their reference (``delta=``).

        Where the ranks split the matrices between them (DDP, FSDP1, ZeRO-3), a rank copies and
        decomposes only its own share (the engine's partition of ``targets`` followed by
        ``heads``, the order the engine gets them), so it keeps only their references: a copy
        of every watched matrix on every rank would cost world size times the watched bytes in
        all.
        """
        from spectral_callbacks.targets.delta import with_references
        from spectral_callbacks.targets.errors import TargetError

        assert self.options.delta is not None
        kept = decomposed_here(targets + heads, self.gathering)
        try:
            with self._whole():
                return with_references(targets, self.options.delta, self.caller, kept=kept)
        except TargetError as error:
            raise ConfigurationError(str(error)) from error
