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

``--baseline REV``: the reader of git revision ``REV`` (its ``targets/roles.py``, loaded beside
this checkout's, on this checkout's recording and replay) reads the same record, alternating with
this one round by round; the row adds its ms and the median ratio ``read / read at REV``.

Then what the default costs a run at step 0: per model and ``roles_from_first_forward`` value
(``False``, ``"auto"``, ``True``), the median over ``--rounds`` of constructing a
``SpectralTracker`` and running the first training forward and backward (a compute that does no
SVD, so only what finds the targets and copies the snapshot is timed), side by side with the
same forward and backward without a tracker. Where the names find nothing (``False`` is refused:
the unhelpful model), the differences are taken to the run without a tracker.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from unhelpful_model import Unhelpful  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.monitor.options import ConfigurationError  # noqa: E402
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


def _reader_at(revision: str) -> Callable[..., object]:
    """``roles_from_recording`` as ``targets/roles.py`` of ``revision`` has it (a module of its
    own, importing this checkout's recording and replay)."""
    path = "spectral_callbacks/targets/roles.py"
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"roles_at_{revision}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:{path}", "exec"), module.__dict__)
    return module.roles_from_recording  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--baseline", default=None, help="a git revision whose reader to compare")
    args = smoke.parse_args(parser, argv, tokens=16, batch=1, rounds=1, layers=2, width=128)
    baseline = None if args.baseline is None else _reader_at(args.baseline)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    size, heads = f"{args.layers}x{args.width}", max(4, args.width // 64)  # 4 groups
    models = {
        f"nanoGPT {size}": GPT(
            GPTConfig(n_layer=args.layers, n_head=heads, n_embd=args.width, block_size=args.tokens)
        ),
        f"unhelpful {size}": Unhelpful(
            vocab=256, width=args.width, heads=heads, groups=4, layers=args.layers
        ),
    }
    x = torch.randint(0, 256, (args.batch, args.tokens))
    header: tuple[str, ...] = ("model", "plain ms", "recorded ms", "read ms", "find ms")
    header += ("recorded/plain",)
    if baseline is not None:
        header += (f"read ms at {args.baseline}", f"read / read at {args.baseline}")
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
        extra = ""
        if baseline is None:
            read_ms = _median_ms(lambda rec=rec: roles_from_recording(rec), args.rounds)
        else:  # both readers on the same record, alternating, so load hits both alike
            reads = [
                (
                    _median_ms(lambda rec=rec: roles_from_recording(rec), 1),
                    _median_ms(lambda rec=rec: baseline(rec), 1),
                )
                for _ in range(args.rounds)
            ]
            read_ms = statistics.median(now for now, _ in reads)
            before_ms = statistics.median(then for _, then in reads)
            read_ratio = statistics.median(now / then for now, then in reads)
            extra = f" | {before_ms:.0f} | {read_ratio:.2f}"
        find_ms = _median_ms(lambda model=model: find_targets(model, example_input=x), 1)
        print(
            f"{name} | {plain_ms:.0f} | {recorded_ms:.0f} | {read_ms:.0f} | {find_ms:.0f} | "
            f"{ratio:.2f}{extra}"
        )

    print()
    _step_zero(models, x, args.rounds)


def _no_svd(group: object, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """A compute that reads nothing: the tracker's own work is what is timed."""
    return {"stable_rank": torch.zeros(batch.shape[0])}


class _Discard:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


def _step_zero(models: dict[str, torch.nn.Module], x: torch.Tensor, rounds: int) -> None:
    """Construction + first forward + backward, with each option and without a tracker."""
    options: dict[str, object] = {"none": None, "False": False, "auto": "auto", "True": True}
    header = ("model", *(f"{name} ms" for name in options), "auto - False ms", "True - False ms")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name, model in models.items():

        def run(option: object, model: torch.nn.Module = model) -> None:
            tracker = None
            if option is not None:
                tracker = SpectralTracker(
                    model,
                    ["stable_rank"],
                    writers=[_Discard()],
                    figures=False,
                    alerts=None,
                    compute=_no_svd,
                    synchronous=True,
                    roles_from_first_forward=option,
                )
            out = model(x)
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            model.zero_grad(set_to_none=True)
            if tracker is not None:
                tracker.close()

        times: dict[str, list[float]] = {key: [] for key in options}
        for _ in range(rounds):  # each round runs every option once, so load hits all alike
            for key, option in options.items():
                try:
                    times[key].append(_median_ms(lambda option=option: run(option), 1))
                except ConfigurationError:  # the names alone find nothing in this model
                    times[key].append(float("nan"))
        medians = {key: statistics.median(values) for key, values in times.items()}
        # Without the names (False refused), the difference is taken to the run with no tracker.
        base = medians["False"] if medians["False"] == medians["False"] else medians["none"]
        print(
            f"{name} | "
            + " | ".join(f"{medians[key]:.0f}" for key in options)
            + f" | {medians['auto'] - base:.0f} | {medians['True'] - base:.0f}"
        )


if __name__ == "__main__":
    main()
