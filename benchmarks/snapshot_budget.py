"""The snapshot budget on Llama-shaped stacks: memory held, what is logged, and what it costs.

Two parts, each run in its own process (peak memory is a per-process number):

``train`` (the default: 8 layers x 2048, GQA with 4 K/V heads, FFN 5632; 1.4 GiB of float32
watched weights): trains with SGD in a plain loop, first ``--baseline-steps`` steps without the
tracker, then with ``SpectralTracker(max_snapshot_bytes=--budget)``, and reports

* the engine's ledger at every step (asserted never above the budget),
* the process's RSS, sampled every 2 ms by a thread (paused while the reference is computed):
  the peak with the tracker minus the peak of the same loop without it,
* every matrix logged (for the snapshot due at step 0 and the final one), and each logged
  ``stable_rank``, ``spectral_norm`` and ``alpha`` against float64 ``torch.linalg.svdvals`` of the
  weights at the step the matrix was logged at (recorded as the engine copies it).

``stack`` (``--layers 22``: TinyLlama-1.1B's shapes; ``--dtype bfloat16``): the model at rest,
``tracker.step`` called every ``--step-seconds`` as a loop would, once with no budget and once per
``--budgets``; per configuration the peak RSS growth over the model alone, the wall time from
step 0 until the cold snapshot's last matrix is logged and the steps it spans, the time of the
final (warm) snapshot taken inside ``close()``, and the main-thread ms per step.

    python benchmarks/snapshot_budget.py train --budget 256MiB
    python benchmarks/snapshot_budget.py stack --layers 22 --dtype bfloat16 --budgets 256MiB,1GiB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

import smoke
import torch

from spectral_callbacks import SpectralTracker
from spectral_callbacks.names import scalar_tag


def parse_bytes(text: str) -> int | None:
    """``"256MiB"``, ``"1GiB"``, ``"1000000"``, ``"none"``."""
    if text.lower() == "none":
        return None
    for suffix, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def llama(layers: int, dtype: torch.dtype, width: int = 2048, seed: int = 0) -> torch.nn.Module:
    """A Llama with TinyLlama's proportions (at 2048 its widths: 32 heads of 64, 4 K/V heads, FFN
    5632 = 2.75 x 2048), from a config."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=width * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


class Recorder:
    """A writer keeping every scalar (tag -> step -> value) and how often each tag was written."""

    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = {}
        self.writes: dict[str, int] = {}
        self.times: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        now = time.perf_counter()
        for tag, value in metrics.items():
            self.scalars.setdefault(tag, {})[step] = value
            self.writes[tag] = self.writes.get(tag, 0) + 1
            self.times[f"{tag}@{step}"] = now


class RssSampler:
    """The process's resident set size, sampled every ``interval`` seconds on a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak = 0
        self.paused = threading.Event()
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self._page

    def reset(self) -> None:
        self.peak = self.rss()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.paused.is_set():
                self.peak = max(self.peak, self.rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def record_copies(tracker: SpectralTracker, copied: list[str]) -> None:
    """Note each target's name as the engine copies it (``copy_into`` runs at the copy's step)."""
    for target in tracker.targets:
        original = target.copy_into

        def copy_into(out: torch.Tensor, original: Any = original, name: str = target.name) -> Any:
            copied.append(name)
            return original(out)

        object.__setattr__(target, "copy_into", copy_into)  # a frozen dataclass: shadow the method


def reference(matrix: torch.Tensor, k: int = 32) -> dict[str, float]:
    """stable rank, sigma_1 and alpha (ranks 1..k) from float64 svdvals of the tall orientation."""
    from spectral_callbacks.functional import powerlaw_alpha

    W = matrix.detach().double()
    S = torch.linalg.svdvals(W if W.shape[0] >= W.shape[1] else W.T)
    frobenius_sq = float(W.square().sum())
    alpha, _ = powerlaw_alpha(S[:k])
    return {
        "stable_rank": frobenius_sq / float(S[0]) ** 2,
        "spectral_norm": float(S[0]),
        "alpha": float(alpha),
    }


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = llama(args.layers, torch.float32, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    sampler = RssSampler()

    def update() -> None:
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    for _ in range(args.baseline_steps):  # the loop's own peak, gradients allocated
        update()
    sampler.reset()
    for _ in range(args.baseline_steps):
        update()
    baseline = sampler.peak

    writer = Recorder()
    copied: list[str] = []
    references: dict[tuple[str, int], dict[str, float]] = {}
    sampler.reset()
    tracker = SpectralTracker(
        model,
        metrics=["stable_rank", "spectral_norm", "alpha"],
        writers=[writer],
        figures=False,
        every_n_steps=10**6,
        log_spaced_until=0,
        max_snapshot_bytes=args.budget,
        start_step=None,
    )
    engine_ledger: list[int] = []
    record_copies(tracker, copied)
    by_name = {target.name: target for target in tracker.targets}

    def check_copies(step: int) -> None:
        sampler.paused.set()
        for name in copied:
            references[(name, step)] = reference(by_name[name].matrix())
        copied.clear()
        sampler.paused.clear()

    tracker.begin(0)
    engine = tracker._engine
    assert engine is not None
    check_copies(0)
    engine_ledger.append(engine.ledger.held)
    for step in range(1, args.steps + 1):
        update()
        tracker.step(step)
        check_copies(step)
        engine_ledger.append(engine.ledger.held)
        assert engine.ledger.held <= args.budget, (step, engine.ledger.held)
    # The final snapshot is copied inside close(): references for it come from the final weights.
    tracker.close()
    for name in dict.fromkeys(copied):
        references[(name, args.steps)] = reference(by_name[name].matrix())
    copied.clear()
    with_tracker = sampler.peak
    sampler.stop()
    assert engine.ledger.peak <= args.budget

    num_layers = tracker.targets[0].num_layers
    worst = {"stable_rank": 0.0, "spectral_norm": 0.0, "alpha": 0.0}
    logged = 0
    for name, target in by_name.items():
        for metric in worst:
            tag = scalar_tag(metric, target.layer, target.role, num_layers)
            for step, value in writer.scalars.get(tag, {}).items():
                exact = references[(name, step)][metric]
                error = abs(value - exact) if metric == "alpha" else abs(value / exact - 1)
                worst[metric] = max(worst[metric], error)
        logged += writer.writes.get(
            scalar_tag("stable_rank", target.layer, target.role, num_layers), 0
        )
    delays = writer.scalars.get("spectral_monitor/coverage_delay", {})
    return {
        "model": f"{args.layers} x {args.width} Llama (GQA, 4 K/V heads), float32, SGD",
        "watched_bytes": sum(t.snapshot_bytes() for t in tracker.targets),
        "budget": args.budget,
        "parts": len(engine.plan.parts),
        "ledger_peak": engine.ledger.peak,
        "rss_peak_baseline": baseline,
        "rss_peak_with_tracker": with_tracker,
        "rss_growth": with_tracker - baseline,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "matrices": len(by_name),
        "logged_matrix_steps": logged,
        "expected_matrix_steps": 2 * len(by_name),
        "skipped": engine.skipped,
        "skipped_matrices": engine.skipped_matrices,
        "max_coverage_delay": max(delays.values(), default=0),
        "worst_rel_error_stable_rank": worst["stable_rank"],
        "worst_rel_error_spectral_norm": worst["spectral_norm"],
        "worst_abs_error_alpha": worst["alpha"],
    }


def stack(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = llama(args.layers, dtype, args.width)
    sampler = RssSampler()
    time.sleep(0.05)
    sampler.reset()
    before = sampler.peak
    writer = Recorder()
    start = time.perf_counter()
    main_thread = 0.0
    tracker = SpectralTracker(
        model,
        metrics=["stable_rank", "alpha"],
        writers=[writer],
        figures=False,
        every_n_steps=10**6,
        log_spaced_until=0,
        max_snapshot_bytes=args.budget,
        max_pending=1,
    )
    main_thread += time.perf_counter() - start
    engine = tracker._engine
    assert engine is not None
    num_layers = tracker.targets[0].num_layers
    tags = [scalar_tag("stable_rank", t.layer, t.role, num_layers) for t in tracker.targets]
    step = 0
    # Cold: the snapshot due at step 0, its parts copied at the steps that follow as room frees.
    while sum(writer.writes.get(tag, 0) for tag in tags) < len(tags):
        time.sleep(args.step_seconds)  # a training step's time; the worker runs in it
        step += 1
        began = time.perf_counter()
        tracker.step(step)
        main_thread += time.perf_counter() - began
    cold_seconds, cold_steps = time.perf_counter() - start, step
    # Warm: the final snapshot, every part at the last step (close waits for room), warm-started.
    began = time.perf_counter()
    tracker.close()
    warm_seconds = time.perf_counter() - began
    peak = sampler.peak
    sampler.stop()
    return {
        "model": f"{args.layers} x {args.width} Llama (GQA, 4 K/V heads), {args.dtype}",
        "watched_bytes": sum(t.snapshot_bytes() for t in tracker.targets),
        "budget": args.budget,
        "parts": len(engine.plan.parts),
        "ledger_peak": engine.ledger.peak,
        "rss_growth": peak - before,
        "cold_seconds": cold_seconds,
        "cold_steps": cold_steps,
        "warm_seconds_at_close": warm_seconds,
        "main_thread_ms_per_step": 1000 * main_thread / (step + 1),
        "skipped_matrices": engine.skipped_matrices,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="?", choices=("train", "stack"), default="train")
    parser.add_argument("--layers", type=int, default=None, help="default 8 (train), 22 (stack)")
    parser.add_argument("--budget", type=parse_bytes, default=256 * 2**20)
    parser.add_argument("--budgets", default="256MiB,1GiB", help="stack: budgets besides none")
    parser.add_argument("--steps", type=int, default=40, help="train: steps with the tracker")
    parser.add_argument("--baseline-steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", help="stack: the weights' dtype")
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=2048, help="TinyLlama's; FFN 2.75 x width")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = smoke.parse_args(
        parser, argv, layers=1, width=256, steps=3, baseline_steps=1, budget=12 * 2**20
    )
    if args.layers is None:
        args.layers = 8 if args.part == "train" else 22
    if args.child:
        result = train(args) if args.part == "train" else stack(args)
        print(json.dumps(result))
        return
    if args.part == "train":
        rows = [_child(argv or sys.argv[1:], [])]
    else:
        rows = []
        for budget in ["none", *args.budgets.split(",")]:
            rows.append(_child(argv or sys.argv[1:], ["--budget", budget]))
            print(json.dumps(rows[-1]), flush=True)  # each as it comes: a later one may fail
    _table(rows)


def _child(argv: list[str], extra: list[str]) -> dict[str, Any]:
    """One configuration in a fresh process (its peak memory is its own)."""
    command = [sys.executable, __file__, *argv, *extra, "--child"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{' '.join(command)} failed with exit status {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows: list[dict[str, Any]]) -> None:
    def cell(key: str, value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, int) and (
            "bytes" in key or "rss" in key or key.endswith("peak") or key == "budget"
        ):
            return f"{value / 2**20:.0f} MiB"
        if isinstance(value, float):
            return f"{value:.3g}" if not math.isnan(value) else "nan"
        return str(value)

    keys = list(rows[0])
    width = max(len(key) for key in keys)
    for key in keys:
        print(f"{key.ljust(width)}  " + "  ".join(cell(key, row[key]).rjust(14) for row in rows))


if __name__ == "__main__":
    main()
