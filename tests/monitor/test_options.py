"""One options surface: every frontend's signature lists every option, as the docs' table does."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import spectral_callbacks
from spectral_callbacks import SpectralMonitor, SpectralTracker
from spectral_callbacks.monitor.options import MonitorOptions, option_names

DOCS = Path(__file__).resolve().parents[2] / "docs" / "callback.md"


def _frontends() -> list[Any]:
    frontends: list[Any] = [SpectralMonitor, SpectralTracker]
    if importlib.util.find_spec("transformers") is not None:
        from spectral_callbacks.hf import SpectralTrainerCallback

        frontends.append(SpectralTrainerCallback)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from spectral_callbacks.pl import SpectralMonitor as PlSpectralMonitor

        frontends.append(PlSpectralMonitor)
    return frontends


@pytest.mark.parametrize("frontend", _frontends(), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_frontend_signature_lists_every_option_with_its_default(frontend: Any) -> None:
    parameters = inspect.signature(frontend).parameters
    for field in dataclasses.fields(MonitorOptions):
        parameter = parameters[field.name]
        assert parameter.default == field.default, field.name
        if field.name != "metrics":  # metrics is also positional
            assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, field.name
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert "every_n_steps: 'int' = 25" in str(inspect.signature(frontend))


def _table() -> dict[str, str]:
    """option -> the default the docs' parameter table gives it (backticks removed)."""
    text = DOCS.read_text()
    start = text.index("| parameter | default | what it does |")
    rows = text[start:].split("\n\n", 1)[0].splitlines()[2:]
    documented: dict[str, str] = {}
    for row in rows:
        names_cell, default_cell = (cell.strip() for cell in row.strip("|").split(" | ")[:2])
        names = re.findall(r"`([a-z_0-9]+)`", names_cell)
        default = default_cell.strip("`")
        parts = default.split(", ") if len(names) > 1 else [default]
        if len(parts) != len(names):
            parts = [default] * len(names)
        documented.update(zip(names, parts, strict=True))
    return documented


def _shown(name: str, default: Any) -> str:
    """A default as the table writes it."""
    if name == "metrics":
        return ", ".join(default)
    if dataclasses.is_dataclass(default) and default == type(default)():
        return f"{type(default).__name__}()"
    return repr(default).replace("'", '"')


def test_the_docs_option_table_and_the_signature_list_the_same_options_and_defaults() -> None:
    documented = _table()
    signature = inspect.signature(SpectralMonitor).parameters
    assert list(documented) == [name for name in signature if name in option_names()]
    for name in option_names():
        assert documented[name] == _shown(name, signature[name].default), name


def test_an_unknown_keyword_is_answered_with_the_closest_option() -> None:
    with pytest.raises(TypeError, match=r"'every_n_step' \(did you mean 'every_n_steps'\?\)"):
        SpectralMonitor(every_n_step=10)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) 'zzz'; it takes the options"):
        SpectralMonitor(zzz=1)


def test_a_mistyped_tracker_keyword_that_is_not_an_option_is_answered_too() -> None:
    # logdir is the tracker's own keyword, not an option: the answer names it all the same
    with pytest.raises(TypeError, match=r"'log_dir' \(did you mean 'logdir'\?\); it takes logdir"):
        SpectralTracker(torch.nn.Linear(4, 4), log_dir="runs")


def test_the_documented_user_types_are_exported() -> None:
    from spectral_callbacks.monitor.alerts import Alert, AlertRules
    from spectral_callbacks.monitor.dashboards import wait_for_figures
    from spectral_callbacks.offline.events import read_runs

    assert spectral_callbacks.AlertRules is AlertRules
    assert spectral_callbacks.Alert is Alert
    assert spectral_callbacks.wait_for_figures is wait_for_figures
    assert spectral_callbacks.read_runs is read_runs
    assert {"AlertRules", "Alert", "wait_for_figures", "read_runs"} <= set(
        spectral_callbacks.__all__
    )


def test_alert_rules_check_themselves_where_they_are_built() -> None:
    from spectral_callbacks import AlertRules, ConfigurationError

    with pytest.raises(
        ConfigurationError, match=r"`window` must be a positive int of steps, got 0"
    ):
        AlertRules(window=0)
