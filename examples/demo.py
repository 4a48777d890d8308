"""``make demo``: a short D8-shaped run watched by SpectralMonitor, then its CSV and charts.

1. Train an 8-layer, narrow GPT on the Python standard library's source (bytes; nothing to
   download) with ``SpectralMonitor`` and a ``TensorBoardLogger`` (a few minutes on 2 CPU cores).
2. ``spectral-callbacks export``: every logged spectral point as tidy rows in a CSV.
3. ``spectral-callbacks plot``: the standard charts as PNGs - stable rank of layer 0's matrices
   against steps (the early drop of Q/K/V/O), compression by layer, the compression wave of Q
   across layers and steps, and alpha against relative depth.
4. Print the paths and the commands that open the live dashboards and run the CLI, spelled so
   they work from here: ``make demo`` installs into ``.venv`` without activating it, so neither
   ``tensorboard`` nor ``spectral-callbacks`` is on PATH; the commands name ``.venv/bin/...``
   (the bin folder of the Python that runs the demo) unless that is what PATH finds anyway.

The learning rate is high for the width on purpose: the stable-rank collapse the reference D8 run
shows over ~1,000 steps at width 768 (arXiv:2604.22778) then happens within the demo's few
hundred steps.

    python examples/demo.py                 # what `make demo` runs
    python examples/demo.py --steps 1000    # longer, clearer curves
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import train_gpt

from spectral_callbacks.cli import main as cli

RUN_NAME = "d8-demo"
# (file name, plot arguments): the four charts of the reference paper the demo reproduces.
CHARTS = (
    ("rank_steps_L00.png", ["--kind", "rank-steps", "--layer", "0"]),
    ("compression_by_layer.png", ["--kind", "compression"]),
    ("compression_wave_Q.png", ["--kind", "compression-wave", "--role", "Q"]),
    ("alpha_vs_depth_Q.png", ["--kind", "alpha-depth", "--role", "Q"]),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output", type=Path, default=Path("demo_output"), help="folder for runs, CSV, charts"
    )
    parser.add_argument("--depth", type=int, default=8, help="D8 shape")
    parser.add_argument(
        "--width", type=int, default=128, help="narrow, so a CPU trains it in minutes"
    )
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--tokens-per-step", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument(
        "--max-bytes", type=int, default=None, help="use only the first bytes of the stdlib text"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="training's intra-op threads: one leaves the second core to the callback's SVD worker, "
        "and on a busy machine a second thread spins against other processes (6x slower measured)",
    )
    parser.add_argument("--every-n-steps", type=int, default=10, help="snapshot interval")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    return parser


def shell_command(script: str, module: str) -> str:
    """How to run console script ``script`` of this Python's environment from the shell, here.

    The bare name if PATH finds this environment's script (an activated venv); else the script's
    path in the bin folder of ``sys.executable`` (``.venv/bin/tensorboard`` under ``make demo``,
    relative to the working directory when inside it); else ``python -m module`` with this Python.

    Args:
        script: the console script, e.g. ``"tensorboard"``.
        module: the module ``python -m`` runs instead, e.g. ``"tensorboard.main"``.
    """
    bin_dir = Path(sys.executable).parent  # not resolved: a venv's python is a symlink
    path = bin_dir / script
    if not path.is_file():
        return f"{_here(Path(sys.executable))} -m {module}"
    found = shutil.which(script)
    if found and os.path.samefile(found, path):
        return script
    return _here(path)


def _here(path: Path) -> str:
    """``path`` relative to the working directory when inside it (``.venv/bin/x``), else absolute."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path.absolute())


def spectral_cli(*args: str) -> None:
    """Run one ``spectral-callbacks`` command in-process, printing it first; fail loudly."""
    command = f"{shell_command('spectral-callbacks', 'spectral_callbacks.cli')} {' '.join(args)}"
    print(f"$ {command}", flush=True)
    if cli(list(args)) != 0:
        raise RuntimeError(f"`{command}` failed; its message is above")


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """Run the demo; return the paths it wrote (``run``, ``csv`` and one per chart)."""
    args = build_parser().parse_args(argv)
    runs = args.output / "runs"
    shutil.rmtree(
        runs / RUN_NAME, ignore_errors=True
    )  # a rerun starts a fresh run, not a mixed one
    started = time.perf_counter()
    run = train_gpt.main(
        [
            *("--depth", str(args.depth), "--width", str(args.width), "--heads", str(args.heads)),
            *("--steps", str(args.steps), "--block-size", str(args.block_size)),
            *("--tokens-per-step", str(args.tokens_per_step), "--lr", str(args.lr)),
            *(
                "--warmup-steps",
                str(max(1, args.steps // 30)),
                "--every-n-steps",
                str(args.every_n_steps),
            ),
            *("--log-every-n-steps", "5", "--accelerator", "cpu", "--threads", str(args.threads)),
            *("--logdir", str(runs), "--name", RUN_NAME, "--version", ""),
            "--progress" if args.progress else "--no-progress",
            *(["--max-bytes", str(args.max_bytes)] if args.max_bytes else []),
        ]
    )
    trained = time.perf_counter() - started
    written = {"run": run, "csv": args.output / "spectral.csv"}
    spectral_cli("export", str(run), "-o", str(written["csv"]))
    for file_name, plot_args in CHARTS:
        written[file_name] = args.output / file_name
        spectral_cli("plot", str(run), *plot_args, "-o", str(written[file_name]))
    print(f"\ntrained {args.steps} steps in {trained:.0f} s; wrote:")
    for path in written.values():
        print(f"  {path}")
    tensorboard = shell_command("tensorboard", "tensorboard.main")
    shortcut = " (or: make tensorboard)" if runs == Path("demo_output/runs") else ""
    print(
        f"\nopen the dashboards{shortcut}:\n  {tensorboard} --logdir {runs}\n"
        "then the SPECTRAL tab: http://localhost:6006/#spectral (docs/dashboards.md)"
    )
    return written


if __name__ == "__main__":
    main(sys.argv[1:])
