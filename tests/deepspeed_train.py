"""The tiny GPT-2 of hf_train.py trained by the Hugging Face Trainer under DeepSpeed ZeRO, on CPUs.

``torchrun --nproc_per_node 2 tests/deepspeed_train.py OUTDIR STAGE [lora] [delta] [resume]
[then-lora]`` (``DS_ACCELERATOR=cpu``; ``lora``: PEFT LoRA on ``c_attn``; ``delta``: the callback's
``delta="first"``, the update ``W_t - W_0`` from references it copies at the start):
6 optimizer steps with SpectralTrainerCallback writing to ``OUTDIR/spectral``; rank 0 saves the
watched matrices after every step to ``OUTDIR/weights.pt`` and each rank prints the optimizer
DeepSpeed wraps and the size of a watched weight it holds. ``resume``: the 6 steps end with a
Trainer checkpoint, and a second Trainer in the same processes resumes from it to step 10, logging
to ``OUTDIR/resumed`` and saving its weights to ``OUTDIR/resumed.pt``. ``then-lora``: last, a
third Trainer in the same processes trains a fresh model with PEFT LoRA (no ``delta``), logging to
``OUTDIR/lora/spectral`` and saving its weights to ``OUTDIR/lora/weights.pt`` (one launch, its
start-up paid once, for both the dense and the LoRA checks). Used by
tests/integrations/test_deepspeed.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_train import train  # noqa: E402


class ShowZero(TrainerCallback):
    """Prints, after the first step, what DeepSpeed runs and the watched weight this rank holds."""

    def on_step_end(
        self,
        args: Any,
        state: Any,
        control: Any,
        optimizer: Any = None,
        model: Any = None,
        **kw: Any,
    ) -> None:
        if state.global_step == 1:
            inner = getattr(optimizer, "optimizer", optimizer)
            stage = args.hf_deepspeed_config.config["zero_optimization"]["stage"]
            weight = model.transformer.h[0].attn.c_attn.weight
            print(
                f"rank {os.environ.get('RANK')}: {type(inner).__name__}, ZeRO stage {stage}, "
                f"c_attn holds {weight.numel()} values",
                flush=True,
            )


def main() -> None:
    outdir, stage = Path(sys.argv[1]), int(sys.argv[2])
    flags = set(sys.argv[3:])
    options = {"delta": "first"} if "delta" in flags else {}
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    }
    train(
        outdir,
        steps=6,
        save_steps=6 if "resume" in flags else None,
        report_to=[],
        every_n_steps=5,
        logdir=outdir / "spectral",
        figures=False,
        arguments=dict(deepspeed=config, use_cpu=False),  # DS_ACCELERATOR=cpu places it
        extra_callbacks=[ShowZero()],
        lora="lora" in flags,
        **options,
    )
    if "resume" in flags:
        if os.environ.get("RANK") == "0":  # the first run's weights, kept from the second's
            (outdir / "weights.pt").rename(outdir / "first.pt")
        train(
            outdir,
            steps=10,
            save_steps=6,
            resume=True,
            report_to=[],
            every_n_steps=5,
            logdir=outdir / "resumed",
            figures=False,
            arguments=dict(deepspeed=config, use_cpu=False),
            lora="lora" in flags,
            **options,
        )
        if os.environ.get("RANK") == "0":
            (outdir / "weights.pt").rename(outdir / "resumed.pt")
            (outdir / "first.pt").rename(outdir / "weights.pt")
    if "then-lora" in flags:
        (outdir / "lora").mkdir(exist_ok=True)
        train(
            outdir / "lora",
            steps=6,
            report_to=[],
            every_n_steps=5,
            logdir=outdir / "lora" / "spectral",
            figures=False,
            arguments=dict(deepspeed=config, use_cpu=False),
            extra_callbacks=[ShowZero()],
            lora=True,
        )


if __name__ == "__main__":
    main()
