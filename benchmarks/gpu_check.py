"""`make gpu-check`: prove or disprove the CUDA path in one call, and print ONE table.

Runs on the device machine as it is (its system ``python3`` with torch, lightning, tensorboard,
transformers, pandas, matplotlib, pytest; no venv, no network), from the repository root with
``PYTHONPATH=.``, in at most ~8 minutes on an H200: every part has its own time budget and reports
"over budget" instead of running late; the table is printed row by row as results come. Rows:

* GPU tests: ``pytest -m gpu``, one subprocess per test file (its ``-v`` lines parsed, so a
  file stopped at the budget keeps what it finished): passed / failed, and each failure's reason;
  among them the training-configuration cells of tests/cuda/test_cuda_configurations.py (bf16
  autocast on biased weights, a compiled wrapper, activation checkpointing);
* training overhead at defaults for a GPU-sized GPT (12 x 768, ``bf16-mixed``, >= 300 steps),
  with and without the callback alternating in one process (``benchmarks/overhead.py``'s code);
* main-thread ms per snapshot beside the host time of launching the same copies in a bare loop
  (like with like: both are launches), with the copy kernels' own device time;
* side-stream SVD ms per snapshot (busy time, from the callback's health scalars);
* randomized SVD (the defaults) against the best exact CUDA method (``svdvals`` of either
  orientation, ``eigvalsh`` of the smaller Gram matrix) on benchmarks/svd_accuracy.py's shapes:
  stable-rank error against float64 and time;
* figure drawing on a thread: how much it slows a launch-bound main thread (the GIL it holds).

On a machine without CUDA it prints ``no CUDA device: nothing measured`` and exits 0.

Run::

    make gpu-check                                   # = PYTHONPATH=. python3 benchmarks/gpu_check.py
    PYTHONPATH=. python3 benchmarks/gpu_check.py --parts svd,figures --steps 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import smoke

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "overhead", "svd", "figures")
# Seconds each part may take on an H200 (8 minutes in all, with start-up to spare). The tests get
# the most: one pytest per file (sixteen runs), each with ~5-10 s of imports and CUDA start-up, and
# two files spawn ranks; an overhead run is ~10 s on an H200.
BUDGETS = {"tests": 320.0, "overhead": 85.0, "svd": 35.0, "figures": 20.0}
# Seconds kept for each GPU test run still to come, so one slow file cannot take the time of all
# the files after it (each is stopped at its share and reports what it finished): a pytest's
# imports and CUDA start-up, with room for a few tests.
RESERVED_PER_RUN = 15.0
# What marks a file as holding GPU tests: the marker itself, or the NCCL params that carry it.
GPU_MARKS = ("mark.gpu", "backend_params(")
# The stream and memory tests run first: what no CPU test can show (overlap with training, the
# allocator's peak against the budget's bound, cold and warm), before the per-kind value checks.
FIRST = ("tests/cuda/test_cuda.py", "svd_runs_while or peak or memory or cold_snapshot")


@dataclass
class Row:
    """One line of the table: what was checked, what came out, the target, a note."""

    check: str
    result: str
    target: str = ""
    note: str = ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0].replace("%", "%%"))
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated subset of {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps per overhead run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating overhead rounds")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--block", type=int, default=256, help="tokens per sequence")
    args = smoke.parse_args(parser, argv, steps=4, rounds=1, layers=2, width=64, batch=2, block=16)
    parts = [part for part in args.parts.split(",") if part]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown {unknown or parts!r}; choose from {', '.join(PARTS)}")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be positive")
    args.parts = parts
    return args


def format_table(rows: Sequence[Row], title: str) -> str:
    """A Markdown table of ``rows`` under ``title``.

    >>> print(format_table([Row("a", "1", "<= 2")], "T"))
    T
    <BLANKLINE>
    | check | result | target | note |
    |---|---|---|---|
    | a | 1 | <= 2 |  |
    """
    lines = [title, "", "| check | result | target | note |", "|---|---|---|---|"]
    for row in rows:
        cells = [row.check, row.result, row.target, row.note]
        lines.append(
            "| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |"
        )
    return "\n".join(lines)


def gpu_test_files() -> list[Path]:
    """The test files that hold GPU tests (``@pytest.mark.gpu``, or NCCL params from
    ``spawn_ranks.backend_params``, which carry that mark), in every folder of tests/, in path
    order."""
    return [
        path
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if any(mark in path.read_text(encoding="utf-8") for mark in GPU_MARKS)
    ]


def gpu_test_runs() -> list[tuple[str, str]]:
    """(file, ``-k`` expression) of each pytest run: :data:`FIRST`'s stream and memory tests, the
    rest of that file, then every other GPU test file in path order (``""``: the whole file).

    >>> runs = gpu_test_runs()
    >>> runs[0] == FIRST and runs[1] == (FIRST[0], f"not ({FIRST[1]})")
    True
    """
    files = [path.relative_to(ROOT).as_posix() for path in gpu_test_files()]
    first, expression = FIRST
    runs = [FIRST, (first, f"not ({expression})")] if first in files else []
    return runs + [(name, "") for name in files if name != first]


def verbose_rows(output: str) -> list[Row]:
    """Rows from ``pytest -v -rfE`` output: the totals, then one per failed or erroring test.

    Read line by line, so the output of a run stopped at its budget still counts every test that
    finished before it (a JUnit report is written only at the end).

    >>> out = ("tests/t.py::ok PASSED  [ 33%]\\ntests/t.py::bad FAILED  [ 66%]\\n"
    ...        "tests/t.py::s SKIPPED (no)  [100%]\\nFAILED tests/t.py::bad - assert 1 == 2\\n")
    >>> [(row.check, row.result, row.note) for row in verbose_rows(out)]
    [('GPU tests', '1 passed, 1 failed, 1 skipped', ''), ('  tests/t.py::bad', 'failed', 'assert 1 == 2')]
    """
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in _OUTCOMES:
            outcomes[parts[0]] = _OUTCOMES[parts[1]]
        elif len(parts) >= 2 and parts[0] in ("FAILED", "ERROR") and "::" in parts[1]:
            reasons[parts[1]] = line.partition(" - ")[2]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in outcomes.values():
        counts[outcome] += 1
    summary = ", ".join(
        f"{count} {name}" for name, count in counts.items() if count or name != "skipped"
    )
    failures = [
        Row(f"  {test}", "failed", "", reasons.get(test, "")[:160])
        for test, outcome in outcomes.items()
        if outcome == "failed"
    ]
    return [Row("GPU tests", summary, "", ""), *failures]


_OUTCOMES = {
    "PASSED": "passed",
    "XPASS": "passed",
    "FAILED": "failed",
    "ERROR": "failed",
    "SKIPPED": "skipped",
    "XFAIL": "skipped",
}


def run_gpu_tests(budget: float, emit: Callable[[Row], None]) -> list[Row]:
    """``pytest -m gpu``, one run per test file (:func:`gpu_test_runs`: the stream and memory
    tests first), within ``budget`` seconds in all.

    Each run's rows are emitted as soon as it is done; each may take what is left less
    :data:`RESERVED_PER_RUN` per run after it, so every file gets time; a run stopped at its share
    keeps the tests it finished.
    """
    deadline = time.monotonic() + budget
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rows: list[Row] = []
    runs = gpu_test_runs()
    for index, (name, expression) in enumerate(runs):
        label = f"{name} -k '{expression}'" if expression else name
        # This run's share: what is left, less a floor kept for each run after it.
        left = deadline - time.monotonic() - RESERVED_PER_RUN * (len(runs) - index - 1)
        if left < 5:
            rows.append(Row(f"GPU tests {label}", "not run: over budget", "all green"))
            emit(rows[-1])
            continue
        command = [
            sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rfE", "-p", "no:cacheprovider",
            name, *(["-k", expression] if expression else []),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left
            )
            output, stopped = done.stdout, ""
        except subprocess.TimeoutExpired as timeout:
            out = timeout.stdout or b""
            output = out.decode(errors="replace") if isinstance(out, bytes) else out
            stopped = f"; stopped at its share of the budget ({left:.0f} s)"
        file_rows = verbose_rows(output)
        file_rows[0] = Row(f"GPU tests {label}", file_rows[0].result + stopped, "all green")
        for row in file_rows:
            emit(row)
        rows += file_rows
    return rows


def timed_cuda(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``fn`` on the current stream (CUDA events, after one warm-up)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_of_watched_weights_ms(args: argparse.Namespace) -> tuple[float, float]:
    """The copies a snapshot makes of the overhead model's watched matrices, one per matrix:
    (host ms to launch them all, in a bare loop; device ms the copy kernels take)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    from spectral_callbacks.targets import find_targets

    config = GPTConfig(
        n_layer=args.layers, n_head=args.width // 64, n_embd=args.width, block_size=args.block
    )
    model = GPT(config).cuda()
    sources = [target.matrix() for target in find_targets(model)]
    copies = [torch.empty_like(source) for source in sources]

    def copy_all() -> None:
        for out, source in zip(copies, sources, strict=True):
            out.copy_(source)

    device_ms = timed_cuda(copy_all, repeats=10)
    launches = []
    for _ in range(10):
        torch.cuda.synchronize()  # an empty queue: the launches never wait for room
        start = time.perf_counter()
        copy_all()
        launches.append(1000 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(launches), device_ms


def run_overhead(args: argparse.Namespace, budget: float) -> list[Row]:
    """With / without the callback at defaults, alternating, medians of the ratios."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import overhead

    options = argparse.Namespace(
        layers=args.layers,
        width=args.width,
        block=args.block,
        batch=args.batch,
        steps=args.steps,
        precision="bf16-mixed",
    )
    deadline = time.monotonic() + budget
    results: dict[str, list[dict[str, float]]] = {"none": [], "default": []}
    with tempfile.TemporaryDirectory() as logdir:
        overhead.run_once("default", argparse.Namespace(**{**vars(options), "steps": 20}), logdir)
        for _ in range(args.rounds):
            if time.monotonic() > deadline:
                break
            for variant in results:
                results[variant].append(overhead.run_once(variant, options, logdir))
    rounds = min(len(results["none"]), len(results["default"]))
    shape = f"{args.layers} x {args.width}, bf16-mixed, {args.batch} x {args.block} tokens, {args.steps} steps"
    if rounds == 0:
        return [Row("training overhead", f"over budget ({budget:.0f} s)", "<= 1.01", shape)]
    ratio = statistics.median(
        d["train"] / n["train"]
        for d, n in zip(results["default"][:rounds], results["none"][:rounds], strict=True)
    )
    step_ms = 1000 * statistics.median(n["train"] for n in results["none"]) / args.steps
    default = results["default"][-1]
    launch_ms, copy_ms = copy_of_watched_weights_ms(args)
    main_ms = statistics.median(r["main_ms"] for r in results["default"])
    return [
        Row(
            "training overhead (train-time ratio)",
            f"{ratio:.3f}",
            "<= 1.01",
            f"{shape}; {rounds} round(s); {step_ms:.1f} ms/step without",
        ),
        Row(
            "main-thread ms per snapshot",
            f"{main_ms:.2f}",
            f"<= 2 x launches = {2 * launch_ms:.2f}",
            f"host time of the same copy launches in a bare loop: {launch_ms:.2f} ms; "
            f"the copy kernels take {copy_ms:.2f} ms on the device",
        ),
        Row(
            "side-stream SVD ms per snapshot",
            f"{statistics.median(r['svd_ms'] for r in results['default']):.1f}",
            "",
            f"{default['snapshots']:.0f} snapshots, {default['skipped']:.0f} skipped",
        ),
    ]


def run_svd(budget: float) -> list[Row]:
    """The defaults against the best exact CUDA method, per shape of svd_accuracy.py (Gaussian)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from svd_accuracy import SHAPES

    from spectral_callbacks.functional import spectral_metrics

    deadline = time.monotonic() + budget
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    previous: tuple[float, float] | None = None  # (seconds, m n min(m, n)) of the last shape
    for m, n in SHAPES:
        # The exact contenders cost ~ m n min(m, n): a shape that would end past the budget, by
        # the last one's rate, is not started (4096 x 4096 costs ~ 20x 1024 x 4096).
        expected = 0.0 if previous is None else previous[0] * m * n * min(m, n) / previous[1]
        if time.monotonic() + expected > deadline:
            rows.append(Row(f"SVD {m}x{n}", f"not run: would pass the {budget:.0f} s budget", ""))
            continue
        began = time.monotonic()
        W = torch.randn(m, n, device="cuda", generator=generator) / n**0.5
        small = W.T if m >= n else W  # (min, max)
        # Float64 truth from the smaller Gram matrix: exact for sigma_1 and ||W||_F, and fast.
        gram = small.double() @ small.double().T
        truth = float(gram.trace() / torch.linalg.eigvalsh(gram)[-1])
        ours = float(spectral_metrics(W)["stable_rank"])
        contenders = {
            "svdvals(W)": lambda W=W: torch.linalg.svdvals(W),
            "svdvals(W.T)": lambda W=W: torch.linalg.svdvals(W.T),
            "eigvalsh(gram)": lambda small=small: torch.linalg.eigvalsh(small @ small.T),
        }
        repeats = 1 if m * n > 8_000_000 else 3  # svdvals of 4096 x 4096 takes seconds
        times = {name: timed_cuda(fn, repeats=repeats) for name, fn in contenders.items()}
        best = min(times, key=times.__getitem__)
        ours_ms = timed_cuda(lambda W=W: spectral_metrics(W), repeats=3)
        rows.append(
            Row(
                f"SVD {m}x{n}: defaults vs {best}",
                f"{ours_ms:.1f} ms vs {times[best]:.1f} ms",
                "defaults not slower",
                f"stable rank error {100 * (ours / truth - 1):+.3f} % (target 1 %)",
            )
        )
        previous = (time.monotonic() - began, m * n * min(m, n))
    return rows


def figure_rows() -> object:
    """Tidy rows of a 12-layer, 1,000-step run (40 snapshots): what the callback draws from."""
    import pandas as pd

    return pd.DataFrame(
        [
            {
                "run": "r",
                "step": step,
                "metric": metric,
                "layer": layer,
                "depth": layer / 11,
                "role": role,
                "value": 1.0 + 0.01 * step + layer,
                "wall_time": 0.0,
            }
            for step in range(0, 1000, 25)
            for layer in range(12)
            for role in ("Q", "K", "V", "O", "MLP_up", "MLP_down")
            for metric in ("stable_rank", "alpha", "compression")
        ]
    )


def run_figures(budget: float, device: str = "cuda") -> list[Row]:
    """How much figure drawing slows a launch-bound main thread (the GIL it holds).

    The main thread launches tiny kernels as fast as it can (a loop bound by Python and launch
    time, like a small model's training step): alone, while every figure of a 12-layer run is drawn
    on a thread of this process (the old design), and while the callback's ``FigureWriter`` draws
    them (in its child process). ``device="cpu"`` measures the same with tiny CPU ops.
    """
    import torch

    from spectral_callbacks.monitor.dashboards import FigureWriter
    from spectral_callbacks.monitor.figures import render

    rows = figure_rows()
    x = torch.zeros(1, device=device)
    deadline = time.monotonic() + budget

    def launches_per_ms(seconds: float) -> float:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(100):
                x.add_(1.0)  # a tiny kernel: the loop is bound by Python and launch time
            count += 100
        if device == "cuda":
            torch.cuda.synchronize()
        return count / (1000 * seconds)

    writer = FigureWriter(roles=None)
    writer.submit([], rows, 0)  # start the figure process and warm it up
    writer.wait(max(1.0, deadline - time.monotonic()))
    alone = launches_per_ms(1.0)
    # The old design's work on a thread: draw and render every figure to PNG.
    drawing = threading.Thread(target=lambda: render(rows, None), daemon=True)
    start = time.perf_counter()
    drawing.start()
    on_thread = launches_per_ms(1.5)
    drawing.join(max(0.0, deadline - time.monotonic()))
    thread_seconds = time.perf_counter() - start
    start = time.perf_counter()
    writer.submit([], rows, 1)
    in_process = launches_per_ms(1.5)
    writer.wait(max(0.0, deadline - time.monotonic()))
    process_seconds = time.perf_counter() - start
    writer.close()
    note = (
        f"{alone:.0f} launches/ms alone; drawing every figure took {thread_seconds:.1f} s on a "
        f"thread, {process_seconds:.1f} s in the process"
    )
    return [
        Row(
            "figures on a thread (old): main-thread launch rate",
            f"{on_thread / alone:.2f} x alone",
            "",
            note,
        ),
        Row(
            "figures in FigureWriter's process: main-thread launch rate",
            f"{in_process / alone:.2f} x alone",
            "close to 1",
            "",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("no CUDA device: nothing measured (this python has no torch)")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 0
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started = time.monotonic()
    title = f"gpu-check on {torch.cuda.get_device_name()}, torch {torch.__version__}"
    # The table is written row by row as each result comes: a run stopped at any point keeps
    # every row measured before it.
    print(format_table([], title), flush=True)

    def emit(row: Row) -> None:
        print(format_table([row], "").splitlines()[-1], flush=True)

    for part in args.parts:
        budget = BUDGETS[part]
        try:
            if part == "tests":
                run_gpu_tests(budget, emit)  # emits each file's rows itself
            else:
                if part == "overhead":
                    part_rows = run_overhead(args, budget)
                elif part == "svd":
                    part_rows = run_svd(budget)
                else:
                    part_rows = run_figures(budget)
                for row in part_rows:
                    emit(row)
        except Exception as error:  # noqa: BLE001 - one broken part must not hide the others
            first = str(error).strip().splitlines()[:1] or [""]
            emit(Row(part, f"error: {type(error).__name__}", "", first[0][:160]))
        print(f"[{part} done at {time.monotonic() - started:.0f} s]", file=sys.stderr, flush=True)
    print(f"\n{time.monotonic() - started:.0f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
