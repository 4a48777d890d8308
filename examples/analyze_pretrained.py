"""Analyze a pretrained Hugging Face model and chart its alpha against depth beside training runs.

``spectral-callbacks analyze`` computes the spectral metrics of every Q/K/V/O/MLP matrix of the
model and writes them as the scalars a training run logs; ``spectral-callbacks plot --kind
alpha-depth`` then draws the model and the runs together (the GPT-2 / Pythia comparison of
arXiv:2604.22778).

    python examples/analyze_pretrained.py ./gpt2 --run runs/d8-mha-gpt/version_0
    python examples/analyze_pretrained.py EleutherAI/pythia-160m --run runs/d12  # needs the Hub

A local directory (``config.json`` + weights, e.g. from ``save_pretrained``) needs no network. Any
other name is fetched with ``transformers``' ``from_pretrained`` (Hugging Face Hub access needed)
and saved under ``--cache``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from spectral_callbacks.cli import main as cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", help="a local Hugging Face model directory, or a Hub name such as gpt2"
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        type=Path,
        help="a training run to draw beside it (repeatable)",
    )
    parser.add_argument(
        "--logdir", type=Path, default=Path("runs/pretrained"), help="where the model's scalars go"
    )
    parser.add_argument("--role", default="Q", help="the role whose alpha is drawn (default Q)")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="chart file (default <logdir>/alpha_vs_depth_<role>.png)",
    )
    parser.add_argument(
        "--cache", type=Path, default=Path("models"), help="where a Hub model is saved"
    )
    return parser


def local_copy(model: str, cache: Path) -> Path:
    """``model`` itself if it is a local directory, else a saved copy of the Hub model of that name."""
    path = Path(model)
    if path.is_dir():
        return path
    target = cache / re.sub(r"[^A-Za-z0-9_.-]", "_", model)
    if not (target / "config.json").exists():
        from transformers import AutoModel

        print(
            f"[analyze_pretrained] {model} is not a local directory: fetching it from the Hugging Face Hub"
        )
        AutoModel.from_pretrained(model).save_pretrained(target)
    return target


def main(argv: list[str] | None = None) -> Path:
    """Analyze the model, draw its alpha-vs-depth beside the runs; return the chart's path."""
    args = build_parser().parse_args(argv)
    source = local_copy(args.model, args.cache)
    model_logdir = args.logdir / source.name
    output = args.output or args.logdir / f"alpha_vs_depth_{args.role}.png"
    for command in (
        ["analyze", str(source), "--logdir", str(model_logdir)],
        [
            "plot",
            *map(str, args.run),
            str(model_logdir),
            "--kind",
            "alpha-depth",
            "--role",
            args.role,
            "-o",
            str(output),
        ],
    ):
        if cli(command) != 0:
            raise RuntimeError(
                f"`spectral-callbacks {' '.join(command)}` failed; its message is above"
            )
    print(f"chart: {output}")
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
