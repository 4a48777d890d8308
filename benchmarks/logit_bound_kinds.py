"""What each QK value is on each kind of attention: the measured max logit against it, per kind.

Fresh random tiny models of each kind (tests/qk_logit_models.py), biases and norm gains moved off
their initial values; each layer's input searched (Adam) to make the measured maximum as large as
it gets. Printed per kind, over every head of every layer (two seeds):

* measured / ``qk_logit_bound``: at most 1 wherever that bound is logged (``-`` where it is not:
  QK-norm, MLA);
* measured / ``qk_spectral_norm`` (the distance-0 circuit times the module's own scale);
* measured / ``sigma_1(W_QK) / sqrt(d_h)``: the value with the scale assumed 1/sqrt(d_h) and the
  biases left out;
* for QK-norm, the largest |logit| / ``qk_norm_logit_bound``.

Run: ``python benchmarks/logit_bound_kinds.py`` (about 2 minutes on a shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

from qk_logit_models import KINDS, like_a_checkpoint, worst_inputs  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import smoke  # noqa: E402

from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.names import parse_tag  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402
from spectral_callbacks.targets.circuits import HeadCircuit, find_circuits  # noqa: E402


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.update(metrics)


def logged(model: torch.nn.Module) -> dict[str, dict[tuple[int, int], float]]:
    """metric -> (layer, head) -> the value logged at step 0."""
    writer = Recorder()
    SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, figures=False, start_step=0
    ).close()
    found: dict[str, dict[tuple[int, int], float]] = {}
    for tag, value in writer.logged.items():
        parsed = parse_tag(tag)
        if parsed is not None and parsed.head is not None:
            found.setdefault(parsed.metric, {})[(parsed.layer or 0, parsed.head)] = value
    return found


def assumed(model: torch.nn.Module) -> dict[tuple[int, int], float]:
    """(layer, head) -> sigma_1(W_Q^hT W_K^h) / sqrt(d_h): the scale assumed, no biases."""
    heads = find_circuits(model, find_targets(model))
    found = {}
    for layout in {id(h.layout): h.layout for h in heads}.values():
        members = [h for h in heads if h.layout is layout]
        metrics = HeadCircuit.stack_batch(members).exact_metrics()
        per_head = layout.query[0].shape[0] // layout.num_heads
        for target, value in zip(members, metrics["qk_spectral_norm"], strict=True):
            sigma = float(value) / (layout.scale or math.nan)
            found[(target.layer, target.head)] = sigma / math.sqrt(per_head)
    return found


def span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = smoke.parse_args(parser, argv, kinds=list(KINDS)[:1], seeds=[0])
    torch.set_num_threads(1)
    logging.getLogger("spectral_callbacks").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    print(
        "| model kind | measured / qk_logit_bound | measured / qk_spectral_norm "
        "| measured / (sigma_1 / sqrt(d_h)) | largest / qk_norm_logit_bound |"
    )
    print("|---|---|---|---|---|")
    for kind in args.kinds:
        build, logged_as = KINDS[kind]
        columns: dict[str, list[float]] = {"bound": [], "circuit": [], "assumed": [], "norm": []}
        for seed in args.seeds:
            torch.manual_seed(seed)
            model = like_a_checkpoint(build(), seed)
            values, old = logged(model), assumed(model)
            layers = worst_inputs(model, seed, per_unit=logged_as != "qk_norm")
            for (layer, h), value in old.items():
                per_unit = layers[layer]["per_unit"][h].item()
                columns["assumed"].append(per_unit / value)
                for key, metric in (("bound", "qk_logit_bound"), ("circuit", "qk_spectral_norm")):
                    if (layer, h) in values.get(metric, {}):
                        columns[key].append(per_unit / values[metric][(layer, h)])
                if (layer, h) in values.get("qk_norm_logit_bound", {}):
                    largest = layers[layer]["largest"][h].item()
                    columns["norm"].append(largest / values["qk_norm_logit_bound"][(layer, h)])
        print(f"| {kind} | " + " | ".join(span(columns[k]) for k in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
