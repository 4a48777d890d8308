"""The architecture table of docs/targets.md: what find_targets watches in tiny models built from
transformers configs (no hub; the tests' own, tests/hf_models.py's TABLE): targets per role, stacks
with their layers, experts, and what is left out and why. Run: python benchmarks/targets_table.py
(``--smoke``: the first two models)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import TABLE  # noqa: E402  (the models the tests build)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402

from spectral_callbacks.targets import find_targets, role_sort_key  # noqa: E402

MODELS = TABLE


def row(name: str) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(MODELS[name]())
    roles = Counter(t.role for t in targets)
    per_role = " ".join(f"{r}×{roles[r]}" for r in sorted(roles, key=role_sort_key))
    stacks = {t.stack or "(one)": t.num_layers for t in targets}
    stack_text = ", ".join(f"{s} {n}" for s, n in stacks.items())
    experts = {t.expert for t in targets if t.expert is not None}
    expert_layers = len({(t.stack, t.layer) for t in targets if t.expert is not None})
    expert_text = f"{len(experts)} in {expert_layers} layers" if experts else "-"
    reasons = Counter(s.reason for s in targets.skipped)
    skipped = "; ".join(f"{reason} ×{n}" for reason, n in reasons.items()) or "-"
    warned = sum(1 for w in caught if "spectral_callbacks" in type(w.message).__module__)
    return f"| {name} | {stack_text} | {per_role} | {expert_text} | {skipped} | {warned} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = smoke.parse_args(parser, argv, models=list(MODELS)[:2])
    T.logging.set_verbosity_error()
    print(
        "| architecture | stacks (layers) | targets per role | experts | not watched (why) | warnings |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models:
        print(row(name))


if __name__ == "__main__":
    main()
