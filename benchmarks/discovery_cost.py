"""What reading roles from the forward costs: a recording forward against a plain one.

``python benchmarks/discovery_cost.py [--tokens T] [--batch B] [--rounds R]``: a 12-layer x 768-wide
GPT (nanoGPT layout, ``examples/gpt.py``; and the same size with the deliberately unhelpful names
of ``tests/unhelpful_model.py``) on the CPU, one thread. Per model, the median over ``--rounds`` of:

* ``plain``: one training forward (with gradients) as the model runs it;
* ``recorded``: the same forward under ``targets.dataflow.record`` (the recording pass);
* ``read``: reading the roles from that record (``roles_from_recording``: attention calls,
  projections, index provenance, layers);
* ``find``: all of ``find_targets(model, example_input=...)`` (recording without gradients,
  reading, the rules' check, the W x check of every watched module).

Prints one row per model with the times in ms and the median of the per-round ratios
``recorded / plain`` (each round runs one of each, back to back).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]
from gpt import GPT, GPTConfig  # noqa: E402
from unhelpful_model import Unhelpful  # noqa: E402

from spectral_callbacks.targets import find_targets  # noqa: E402
from spectral_callbacks.targets.dataflow import record  # noqa: E402
from spectral_callbacks.targets.roles import roles_from_recording  # noqa: E402


def _median_ms(run: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {
        "nanoGPT 12x768": GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=args.tokens)),
        "unhelpful 12x768": Unhelpful(vocab=256, width=768, heads=12, groups=4, layers=12),
    }
    x = torch.randint(0, 256, (args.batch, args.tokens))
    header = ("model", "plain ms", "recorded ms", "read ms", "find ms", "recorded/plain")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name, model in models.items():
        model.train()

        def plain(model: torch.nn.Module = model) -> None:
            model(x)

        def recorded(model: torch.nn.Module = model) -> None:
            with record(model):
                model(x)

        plain(), recorded()  # warm-up: allocator, kernels
        # Side by side, alternating, so machine load hits both alike.
        pairs = [(_median_ms(plain, 1), _median_ms(recorded, 1)) for _ in range(args.rounds)]
        plain_ms = statistics.median(p for p, _ in pairs)
        recorded_ms = statistics.median(r for _, r in pairs)
        ratio = statistics.median(r / p for p, r in pairs)
        with torch.no_grad(), record(model) as rec:
            model(x)
        read_ms = _median_ms(lambda rec=rec: roles_from_recording(rec), args.rounds)
        find_ms = _median_ms(lambda model=model: find_targets(model, example_input=x), 1)
        print(
            f"{name} | {plain_ms:.0f} | {recorded_ms:.0f} | {read_ms:.0f} | {find_ms:.0f} | "
            f"{ratio:.2f}"
        )


if __name__ == "__main__":
    main()
