"""The SPECTRAL tab: a TensorBoard plugin serving the study's charts of spectral runs.

TensorBoard finds it through the ``tensorboard_plugins`` entry point of this package and shows a
SPECTRAL tab whenever the logdir holds scalars. The page (``static/index.js``, loaded by
TensorBoard in an iframe) asks these routes, under ``data/plugin/spectral/``, for JSON:

=============  ========================================================================
route          what it returns (query parameters; ``run`` repeatable)
=============  ========================================================================
``/runs``      what each run logged: spectral metrics, roles, layers, stacks, other scalars
``/wave``      heatmap layer x step (``run``, ``metric`` = compression, ``role`` = Q)
``/by_role``   metric of one layer vs step, a series per role (``layer`` = 0)
``/by_layer``  metric of one role vs step, a series per layer with its depth
``/depth``     metric vs relative depth at ``step`` (default: the last) per run and stack
``/bars``      metric (compression) by layer x role at ``step`` per run
``/diff``      metric minus the ``baseline`` run vs ``x`` (step or a scalar such as tokens)
``/alerts``    the alerts each run's monitor raised (its ``spectral_alerts`` text entries)
``/heads``     a per-head circuit metric (qk_spectral_norm) by layer x head at ``step`` per run
``/by_head``   a per-head circuit metric of one layer vs step, a series per head
=============  ========================================================================

The views of one layer or one role take ``stack`` (default ``""``: a model with one stack), the
stack of an encoder-decoder or two-tower run to show; a run with one stack is shown whatever
the stack asked (see ``views.py``).

Lines carry at most ``max_points`` points per series (default 2,000; first, last, min and max
of each bucket kept), heatmaps at most ``max_columns`` columns (default 400). Scalars are read
only through ``context.data_provider`` (see ``source.py``). Bad parameters answer HTTP 400 with
a one-line message saying what to pass: a malformed value, a run the logdir does not hold, or a
metric, stack, layer or role that none of the runs asked for logged at all (the message lists
what they did log). Values each logged but without a series together (the role ``Q`` of a
circuit metric) are an empty answer, which the page says in the view.
"""

from __future__ import annotations

import json
import mimetypes
import posixpath
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NoReturn

import pandas as pd
from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import Request, Response

from spectral_callbacks.names import SpectralTag, check_stack, parse_tag
from spectral_callbacks.tensorboard_plugin import views
from spectral_callbacks.tensorboard_plugin.source import SCALARS_PLUGIN, ScalarSource

STATIC = Path(__file__).parent / "static"
MAX_POINTS = 2_000
MAX_COLUMNS = 400
_CONTENT_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


class SpectralPlugin(base_plugin.TBPlugin):
    """The SPECTRAL tab of TensorBoard (registered through the ``tensorboard_plugins`` entry point).

    Args:
        context: the ``TBContext`` TensorBoard passes; only its ``data_provider`` is used.

    Example::

        tensorboard --logdir runs      # then open the SPECTRAL tab
    """

    plugin_name = "spectral"

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._source = ScalarSource(context.data_provider)

    def get_plugin_apps(self) -> dict[str, Callable]:
        routes = {
            "/runs": self._runs,
            "/wave": self._wave,
            "/by_role": self._by_role,
            "/by_layer": self._by_layer,
            "/depth": self._depth,
            "/bars": self._bars,
            "/diff": self._diff,
            "/alerts": self._alerts,
            "/heads": self._heads,
            "/by_head": self._by_head,
            "/static/*": self._static,
        }
        return {path: Request.application(handler) for path, handler in routes.items()}

    def is_active(self) -> bool:
        return False  # the tab shows when the logdir has scalars: see data_plugin_names

    def data_plugin_names(self) -> tuple[str, ...]:
        return (SCALARS_PLUGIN,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/static/index.js", tab_name="SPECTRAL")

    # --- routes -------------------------------------------------------------------------------

    def _runs(self, request: Request) -> Response:
        directory = self._source.list_tags(*_where(request))
        runs = views.catalog(directory)
        return _json(request, {"runs": runs, "role_order": views.role_order(runs)})

    def _wave(self, request: Request) -> Response:
        run = _one(request, "run")
        metric = request.args.get("metric", "compression")
        role = request.args.get("role", "Q")
        stack = _stack(request)
        wanted = self._wanted(request, [run], metric, role=role, stack=stack)
        rows = self._source.rows(*_where(request), wanted)
        columns = _int(request, "max_columns", MAX_COLUMNS, least=2)
        return _json(request, views.compression_wave(rows, run, metric, role, columns, stack))

    def _by_role(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "stable_rank")
        layer = _int(request, "layer", 0, least=0)
        stack = _stack(request)
        wanted = self._wanted(request, runs, metric, layer=layer, stack=stack)
        rows = self._source.rows(*_where(request), wanted)
        points = _int(request, "max_points", MAX_POINTS, least=4)
        series = views.curves_by_role(rows, runs, metric, layer, points, stack)
        return _json(request, {"series": series})

    def _by_layer(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "stable_rank")
        role = request.args.get("role", "Q")
        stack = _stack(request)
        wanted = self._wanted(request, runs, metric, role=role, stack=stack)
        rows = self._source.rows(*_where(request), wanted)
        points = _int(request, "max_points", MAX_POINTS, least=4)
        series = views.curves_by_layer(rows, runs, metric, role, points, stack)
        return _json(request, {"series": series})

    def _depth(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "alpha")
        role = request.args.get("role", "Q")
        step = _optional_int(request, "step", least=0)
        rows, steps = self._at_step(
            request, self._wanted(request, runs, metric, role=role), metric, step
        )
        return _json(request, views.depth_profile(rows, runs, metric, role, step, steps))

    def _bars(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "compression")
        step = _optional_int(request, "step", least=0)
        stack = _stack(request)
        wanted = self._wanted(request, runs, metric, stack=stack)
        rows, steps = self._at_step(request, wanted, metric, step)
        return _json(request, views.bars_by_layer(rows, runs, metric, step, steps, stack))

    def _diff(self, request: Request) -> Response:
        runs = _runs_of(request)
        baseline = _one(request, "baseline")
        metric = _one(request, "metric")
        x = request.args.get("x", "step")
        layer = _optional_int(request, "layer", least=0)
        role = request.args.get("role") or None
        stack = _stack(request)
        directory = self._source.directory(*_where(request), [baseline, *runs])
        wanted = {
            run: [
                t
                for t in directory.get(run, ())
                if t in (metric, x) or _is(t, metric, layer, role, stack)
            ]
            for run in dict.fromkeys([baseline, *runs])
        }
        if baseline in directory and not [t for t in wanted[baseline] if t != x]:
            where = f"{stack} layer {layer}" if stack else f"layer {layer}"
            what = metric if layer is None else f"{metric} of {where} {role}"
            raise errors.InvalidArgumentError(
                f"the baseline {baseline!r} has no {what}; pick a baseline that logged it"
            )
        rows = self._source.rows(*_where(request), wanted)
        points = _int(request, "max_points", MAX_POINTS, least=4)
        try:
            body = views.difference(
                rows, metric, baseline, x=x, layer=layer, role=role, max_points=points, stack=stack
            )
        except ValueError as error:
            raise errors.InvalidArgumentError(str(error)) from None
        return _json(request, {"baseline": baseline, "metric": metric, "x": x, **body})

    def _alerts(self, request: Request) -> Response:
        runs = _runs_of(request)
        where = _where(request)
        directory = self._source.directory(*where, runs)
        counted = {run: sorted(views.ALERT_COUNT_TAGS & directory.get(run, set())) for run in runs}
        counts, _ = self._source.last_rows(*where, counted)
        counts = counts[counts["metric"].isin(views.ALERT_COUNT_TAGS)]  # not the num_layers rows
        raised = counts.loc[counts["value"] > 0, "run"].unique().tolist()
        # Text entries only where a count says there are some: most polls of a healthy run
        # then cost no read of the text plugin.
        texts = self._source.texts(*where, raised, views.ALERT_TEXT_TAGS) if raised else {}
        return _json(request, {"runs": views.alerts(runs, texts, counts)})

    def _heads(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "qk_spectral_norm")
        step = _optional_int(request, "step", least=0)
        stack = _stack(request)
        wanted = self._wanted(request, runs, metric, stack=stack, heads=True)
        rows = self._source.rows(*_where(request), wanted)
        return _json(request, views.heads_by_layer(rows, runs, metric, step, stack))

    def _by_head(self, request: Request) -> Response:
        runs = _runs_of(request)
        metric = request.args.get("metric", "qk_spectral_norm")
        layer = _int(request, "layer", 0, least=0)
        stack = _stack(request)
        wanted = self._wanted(request, runs, metric, layer=layer, stack=stack, heads=True)
        rows = self._source.rows(*_where(request), wanted)
        points = _int(request, "max_points", MAX_POINTS, least=4)
        return _json(
            request, {"series": views.curves_by_head(rows, runs, metric, layer, points, stack)}
        )

    def _static(self, request: Request) -> Response:
        """A file of ``static/``; anything outside it (``..``) is not found."""
        relative = posixpath.normpath(request.path.split("/static/", 1)[1])
        path = STATIC / relative
        if relative.startswith(("..", "/")) or not path.is_file():
            return http_util.Respond(request, "Not found", "text/plain", code=404)
        kind = _CONTENT_TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "text/plain"
        return http_util.Respond(request, path.read_bytes(), kind)

    # --- helpers ------------------------------------------------------------------------------

    def _wanted(
        self,
        request: Request,
        runs: list[str],
        metric: str,
        *,
        layer: int | None = None,
        role: str | None = None,
        stack: str | None = None,
        heads: bool = False,
    ) -> dict[str, list[str]]:
        """The per-layer tags of ``metric`` of each of ``runs`` at ``layer``, of ``role`` and in
        ``stack`` (``None``: any): each head's own tags where ``heads``, else the other series,
        a layer's experts and heads read through their mean, min and max.

        Compression that was not logged is computed from stable rank (as the CLI charts do), so
        then the stable-rank tags are wanted: their whole series, for the first snapshot.

        Raises:
            errors.InvalidArgumentError: a run the logdir does not hold, or a metric, stack,
                layer or role that none of ``runs`` logged at all (the answer lists those they
                did); values each logged but without a series together are no error (an empty
                view).
        """
        directory = self._source.directory(*_where(request), runs)
        unknown = [run for run in runs if run not in directory]
        if unknown:
            known = ", ".join(sorted(directory)) or "none yet"
            raise errors.InvalidArgumentError(
                f"`run` must be a run of this logdir ({known}), got {', '.join(map(repr, unknown))}"
            )
        series = {run: _series_of(directory[run], metric, heads) for run in runs}
        wanted = {
            run: [t for t, p in of_run.items() if _at(p, layer, role, stack)]
            for run, of_run in series.items()
        }
        if not any(wanted.values()):
            _check_logged(directory, runs, metric, layer, role, stack, heads)
        return wanted

    def _at_step(
        self, request: Request, wanted: dict[str, list[str]], metric: str, step: int | None
    ) -> tuple[pd.DataFrame, list[int]]:
        """Rows for a view at one step, and the logged steps (for the slider).

        At the last step (``None``) one point per series is enough, and the steps are those of
        each run's first series; at an earlier step, or for compression computed from stable
        rank, the whole series are read.
        """
        where = _where(request)
        derived = metric == "compression" and any(
            _is(t, "stable_rank", None, None) for tags in wanted.values() for t in tags
        )
        if step is not None or derived:
            rows = self._source.rows(*where, wanted)
            return rows, rows["step"].unique().tolist()
        return self._source.last_rows(*where, wanted)


def _series_of(tags: Iterable[str], metric: str, heads: bool) -> dict[str, SpectralTag]:
    """The per-layer series of ``metric`` among ``tags`` (each head's where ``heads``, else the
    others, none of one expert), parsed; compression not logged is the stable rank's series."""
    parsed = {tag: parse_tag(tag) for tag in sorted(tags)}
    spectral = {
        t: p
        for t, p in parsed.items()
        if p is not None and p.layer is not None and p.expert is None
        and (p.head is not None) == heads
    }  # fmt: skip
    of_metric = {t: p for t, p in spectral.items() if p.metric == metric}
    if not of_metric and metric == "compression":
        return {
            t: p._replace(metric="compression")
            for t, p in spectral.items()
            if p.metric == "stable_rank"
        }
    return of_metric


def _at(parsed: SpectralTag, layer: int | None, role: str | None, stack: str | None) -> bool:
    """Whether a series is at ``layer``, of ``role`` and in ``stack`` (``None``: any)."""
    return (
        (layer is None or parsed.layer == layer)
        and (role is None or parsed.role == role)
        and (stack is None or _of(parsed, stack))
    )


def _check_logged(
    directory: Mapping[str, Iterable[str]],
    runs: list[str],
    metric: str,
    layer: int | None,
    role: str | None,
    stack: str | None,
    heads: bool,
) -> None:
    """Raise ``InvalidArgumentError`` for the first of ``metric``, ``stack``, ``layer``, ``role``
    that none of ``runs`` logged at all, listing the values they did log: a request for what
    does not exist, not a view of an empty series. Values each logged, but not together (Q of a
    circuit metric, a metric logged at some layers only), are no error: the view says it is empty.
    """
    logged = [
        p
        for run in runs
        for p in map(parse_tag, directory[run])
        if p is not None and p.layer is not None and p.expert is None
    ]
    named = "the runs asked for" if len(runs) > 1 else f"run {runs[0]!r}"
    metrics = {p.metric for p in logged if (p.head is not None) == heads}
    if not heads and "stable_rank" in metrics:
        metrics.add("compression")  # computed from the stable rank
    if metric not in metrics:
        what = "a per-head metric (circuits=True)" if heads else "a metric"
        _refuse("metric", metric, f"{what} {named} logged", metrics)
    if stack and not any(_of(p, stack) for p in logged):
        _refuse("stack", stack, f"a stack of {named}", {p.stack for p in logged})
    in_stack = [p for p in logged if stack is None or _of(p, stack)]
    if layer is not None and layer not in {p.layer for p in in_stack}:
        _refuse("layer", layer, f"a layer of {named}", {str(p.layer) for p in in_stack})
    if role is not None and role not in {p.role for p in logged}:
        _refuse("role", role, f"a role of {named}", {p.role for p in logged})


def _refuse(name: str, value: object, allowed: str, logged: Iterable[str]) -> NoReturn:
    """``InvalidArgumentError``: "`name` must be <allowed> (<logged>), got <value!r>"."""
    listed = ", ".join(sorted(set(logged) - {""}, key=_natural)) or "none"
    raise errors.InvalidArgumentError(f"`{name}` must be {allowed} ({listed}), got {value!r}")


def _natural(text: str) -> tuple[int, str]:
    """Layers in numeric order (2 before 10), names in alphabetical order."""
    return (int(text), "") if text.isdigit() else (1 << 30, text)


def _is(
    tag: str, metric: str, layer: int | None, role: str | None, stack: str | None = None
) -> bool:
    """Whether ``tag`` is a per-layer (or mean) series of spectral ``metric`` at ``layer``/``role``
    (of ``stack`` when given), not of one expert."""
    parsed = parse_tag(tag)
    return (
        parsed is not None
        and parsed.metric == metric
        and parsed.expert is None
        and (layer is None or parsed.layer == layer)
        and (role is None or parsed.role == role)
        and (stack is None or _of(parsed, stack))
    )


def _of(parsed: SpectralTag, stack: str) -> bool:
    """Whether a tag is of ``stack``: a tag of a model with one stack is of every stack."""
    return parsed.stack in ("", stack)


def _stack(request: Request) -> str:
    """The ``stack`` parameter (``""`` when absent: a model with one stack)."""
    stack = request.args.get("stack", "")
    try:
        return check_stack(stack)
    except ValueError:
        raise errors.InvalidArgumentError(
            f"`stack` must be a stack a run logged (e.g. enc, dec, text, vision), got {stack!r}"
        ) from None


def _where(request: Request) -> tuple[object, str]:
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)


def _json(request: Request, body: Mapping) -> Response:
    # Encoded here: the views already turned NaN into None, so TensorBoard's recursive cleaning
    # (a walk over every number, ~1/3 of a large response's time) has nothing to do.
    return http_util.Respond(request, json.dumps(body, allow_nan=False), "application/json")


def _one(request: Request, name: str) -> str:
    value = request.args.get(name)
    if not value:
        raise errors.InvalidArgumentError(f"`{name}` is required, e.g. ?{name}=... ; got none")
    return value


def _runs_of(request: Request) -> list[str]:
    runs = request.args.getlist("run")
    if not runs:
        raise errors.InvalidArgumentError("pass at least one `run` (repeatable: ?run=a&run=b)")
    return runs


def _int(request: Request, name: str, default: int, *, least: int) -> int:
    """The int query parameter ``name`` (``default`` when absent), at least ``least``."""
    value = _optional_int(request, name, least=least)
    return default if value is None else value


def _optional_int(request: Request, name: str, *, least: int) -> int | None:
    """The int query parameter ``name``, or ``None`` when absent.

    Raises:
        errors.InvalidArgumentError: not an int, or below ``least``.
    """
    text = request.args.get(name)
    if text is None or text == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise errors.InvalidArgumentError(f"`{name}` must be an int >= {least}, got {text!r}")
    return value
