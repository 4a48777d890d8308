"""A tiny GPT-2 (from a config) trained by the Hugging Face Trainer with SpectralTrainerCallback.

``python tests/hf_train.py OUTDIR [--steps S] [--accumulate A] [--save-steps N] [--resume]
[--logdir DIR] [--fsdp]`` - run directly or under ``torchrun --nproc_per_node 2`` (gloo, CPU;
``--fsdp``: the Trainer's ``fsdp=``, FSDP1 on 2 CUDA devices with NCCL). Used by
tests/integrations/test_hf.py: in-process through :func:`train`, and as a script for the multi-process run.
The watched matrices after every optimizer step are saved (rank 0) to ``OUTDIR/weights.pt``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spectral_callbacks.hf import SpectralTrainerCallback  # noqa: E402
from spectral_callbacks.monitor.engines import distributed  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402

# max_pending leaves room for every scheduled step: which steps are logged must not depend on the
# worker's speed on a loaded machine (the default of 2 once skipped a dense early step).
OPTIONS: dict[str, Any] = dict(
    every_n_steps=10, log_spaced_until=3, k=8, figure_every_n_steps=None, max_pending=16
)


def tiny_gpt2(width: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=width,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def samples(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (count, 16), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


class WeightRecorder(TrainerCallback):
    """The watched matrices at step 0 and after every optimizer step (what the snapshots hold)."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def _record(self, step: int, model: torch.nn.Module) -> None:
        with _gathered(model):
            self.weights[step] = {}
            for target in find_targets(model):
                self.weights[step].update(_effective(target))

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        self._record(state.global_step, model)

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        self._record(state.global_step, model)


def _effective(target: Any) -> dict[str, torch.Tensor]:
    """``{name: W}`` in float64; an adapted target's ``W_0 + s B A`` formed here from its base
    and factors, and its update ``s B A`` as ``name + ":update"``."""
    layer = getattr(target, "layer_module", None)
    if layer is None:
        return {target.name: target.matrix().detach().double().clone()}
    (adapter,) = target.adapters
    base = target.rows.take(target.parameter.detach()).double()
    rows = dataclasses.replace(target.rows, transposed=False)  # B's rows: the output's
    up = layer.scaling[adapter] * rows.take(layer.lora_B[adapter].weight.detach()).double()
    update = up @ layer.lora_A[adapter].weight.detach().double()
    return {target.name: base + update, f"{target.name}:update": update}


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT LoRA r = 2 on the fused ``c_attn`` (random ``B``: a non-zero update from step 0)."""
    import peft

    config = peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def _gathered(model: torch.nn.Module) -> contextlib.AbstractContextManager[object]:
    """ZeRO-3's partitions gathered with DeepSpeed's public ``GatheredParameters``, FSDP1's units
    inside ``model`` with its public ``summon_full_params`` (every rank)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        return FullyShardedDataParallel.summon_full_params(model, writeback=False)
    parameters = list(model.parameters())
    if not any(hasattr(parameter, "ds_id") for parameter in parameters):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=None)


def train(
    outdir: Path,
    *,
    steps: int = 40,
    accumulate: int = 1,
    save_steps: int | None = None,
    resume: bool = False,
    logdir: Path | None = None,
    report_to: list[str] | str | None = None,
    arguments: dict[str, Any] | None = None,
    width: int = 32,
    attach: bool = False,
    extra_callbacks: list[TrainerCallback] | None = None,
    lora: bool = False,
    **options: Any,
) -> WeightRecorder:
    """Train, and return the recorder of the weights (every rank records; rank 0 saves them).

    ``arguments`` override the ``TrainingArguments`` below (``use_cpu=False, bf16=True`` ...);
    ``width``: the model's ``n_embd``; ``attach``: ``callback.attach(trainer)`` (the spectra also
    go to ``report_to``); ``extra_callbacks`` follow the others; ``lora``: PEFT LoRA on ``c_attn``
    (:func:`with_lora`); ``options`` go to the callback.
    """
    defaults: dict[str, Any] = dict(
        output_dir=str(outdir),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_steps=10,
        report_to=report_to if report_to is not None else ["tensorboard"],
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # torchrun sets it
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    args = TrainingArguments(**{**defaults, **(arguments or {})})
    recorder = WeightRecorder()
    callback = SpectralTrainerCallback(logdir=logdir, **{**OPTIONS, **options})
    trainer = Trainer(
        model=with_lora(tiny_gpt2(width)) if lora else tiny_gpt2(width),
        args=args,
        train_dataset=samples(2 * steps * accumulate * 2),
        callbacks=[callback, recorder, *(extra_callbacks or [])],
    )
    if attach:
        callback.attach(trainer)
    trainer.train(resume_from_checkpoint=True if resume else None)
    # global rank 0 (the Trainer's is_world_process_zero is true on every rank under DeepSpeed's
    # CPU accelerator)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        torch.save(recorder.weights, outdir / "weights.pt")
    return recorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logdir", type=Path, default=None)
    parser.add_argument("--fsdp", action="store_true", help="the Trainer's fsdp= (FSDP1), CUDA")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes share a small machine
    # A loaded machine may make a worker miss the 1 s due wait; the test checks every value, so
    # give each rank more time (the late path has its own test in test_ddp.py).
    distributed.DUE_WAIT_SECONDS = 20.0
    # fsdp=: one FSDP1 unit per block through accelerate; it needs CUDA devices and NCCL (accelerate
    # turns FSDP on only for an accelerator's distributed type, never for MULTI_CPU).
    fsdp = dict(
        fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"], "use_orig_params": True},
        use_cpu=False,
        ddp_backend="nccl",
    )
    arguments = fsdp if args.fsdp else None
    train(args.outdir, steps=args.steps, logdir=args.logdir, figures=False, arguments=arguments)


if __name__ == "__main__":
    main()
