"""The attention catalogue table of docs/targets.md: each form of tests/attention_forms.py (written
from the math) read from its recorded forward, and a short fit checked against float64.

Per form: the kind of each attention call, its query and K/V heads, the layers (and calls, where a
layer is shared), the roles of one layer with the weight behind each, whether every role is the
weight and rows the math says (with the name rules off), and the largest relative difference, over
a ``--steps``-step fit with ``roles_from_first_forward=True`` and every step logged, between each
logged stable rank and σ₁ and a float64 SVD of the same matrix.

Run: ``python benchmarks/attention_catalogue.py`` (``--smoke``: the first two forms, two steps).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
import smoke  # noqa: E402
from attention_forms import FORMS, Form, example_input  # noqa: E402
from tiny_models import RecordingLogger, exact_spectrum  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.names import scalar_tag  # noqa: E402
from spectral_callbacks.targets import find_targets, role_sort_key  # noqa: E402
from spectral_callbacks.targets.roles import discover_roles  # noqa: E402


def _as_math_says(form: Form) -> bool:
    """Every role of every layer is the weight and rows the form's math says (rules off)."""
    torch.manual_seed(0)
    model = form.build()
    found = find_targets(model, example_input=example_input(), builtin_rules=False)
    expected = {
        (layer, role): weight
        for layer in range(form.layers)
        for role, weight in form.weights(layer).items()
    }
    if sorted((t.layer, t.role) for t in found) != sorted(expected):
        return False
    for target in found:
        name, rows = expected[(target.layer, target.role)]
        weight = model.get_parameter(name)
        if target.parameter_name != name or not torch.equal(
            target.matrix(), weight if rows is None else weight[list(rows)]
        ):
            return False
    return True


def _worst_error(form: Form, steps: int) -> float:
    """The largest relative difference of a logged stable rank or σ₁ from float64, any step."""
    torch.manual_seed(0)
    model = form.build()
    x = example_input()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = RecordingLogger()
    tracker = SpectralTracker(
        model,
        ["stable_rank", "spectral_norm"],
        writers=[logger],
        figures=False,
        every_n_steps=1,
        synchronous=True,
        roles_from_first_forward=True,
    )
    expected: dict[int, dict[str, tuple[float, float]]] = {}
    for step in range(steps):
        model(x).pow(2).mean().backward()
        if step == 0:
            expected[0] = {t.name: exact_spectrum(t.matrix()) for t in tracker.targets}
        optimizer.step()
        optimizer.zero_grad()
        expected[step + 1] = {t.name: exact_spectrum(t.matrix()) for t in tracker.targets}
        tracker.step(step + 1)
    tracker.close()
    worst = 0.0
    for target in tracker.targets:
        for metric, index in (("stable_rank", 0), ("spectral_norm", 1)):
            tag = scalar_tag(metric, target.layer, target.role, form.layers)
            logged = logger.series(tag)
            if sorted(logged) != sorted(expected):
                return float("inf")  # a step missing: not exact
            for step, value in logged.items():
                reference = expected[step][target.name][index]
                worst = max(worst, abs(value - reference) / reference)
    return worst


def row(form: Form, steps: int) -> str:
    torch.manual_seed(0)
    flow = discover_roles(form.build(), example_input())
    kinds = ", ".join(sorted({call.kind for call in flow.calls}))
    heads = ", ".join(sorted({f"{call.heads}/{call.kv_heads}" for call in flow.calls}))
    layers = f"{form.layers}" + (
        f" ({len(flow.calls)} calls)" if len(flow.calls) > form.layers else ""
    )
    first = {r.role: r.parameter for r in flow.roles if r.layer == 0}
    roles = " ".join(
        f"{role}={first[role].removesuffix('.weight')}" for role in sorted(first, key=role_sort_key)
    )
    exact = "yes" if _as_math_says(form) else "NO"
    return (
        f"| {form.name} | {kinds} | {heads} | {layers} | {roles} | {exact} | "
        f"{_worst_error(form, steps):.1e} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", type=int, default=len(FORMS), help="the first N forms")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each fit")
    args = smoke.parse_args(parser, argv, forms=2, steps=2)
    torch.set_num_threads(1)
    print(
        "| form | kind | Q/KV heads | layers | layer 0's roles (the weight behind each) | "
        "roles as the math says | logged vs float64 (max rel.) |"
    )
    print("|---|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # a shared layer and unread logit scales are said, not timed
        for form in FORMS[: args.forms]:
            print(row(form, args.steps))


if __name__ == "__main__":
    main()
