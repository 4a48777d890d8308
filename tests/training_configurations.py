"""The training-configuration matrix: the runs people launch, as data, and one harness that runs
and checks a cell.

A :class:`Cell` is one training configuration: a frontend (a plain loop, Lightning Fabric,
``lightning.pytorch``, the Hugging Face ``Trainer``), a precision, a compilation, an activation
checkpointing and an adapter, on a tiny model (2 layers, width 32) whose biases are non-zero, as a
checkpoint's are. :data:`CELLS` lists them; a new configuration is one more entry.

:func:`run_cell` trains a cell twice from the same initial weights and batches, with and without
the monitor, and checks three things:

1. the run with the monitor computes exactly what it computes without it: the same loss at every
   step, step 0 included (bit for bit);
2. every scheduled step is logged;
3. each logged stable rank and σ₁ equals a float64 SVD of the matrix the layer computes at that
   step: its own forward on the identity, autocast off, in float64 where the layer's parameters
   are floating point (a LoRA layer: ``W0 + s B A``), at float32 compute where they are quantized
   (the dequantized matrix).

Or the monitor refuses the configuration at construction, in one line that names the layer, the
reason and what to do (a :class:`Refused` outcome, checked as such).

``python benchmarks/training_configurations.py`` prints the table of docs/training-configurations.md
from the same cells; tests/integrations/test_training_configurations.py runs each as a test.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import math
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, GPTConfig
from tiny_models import QUIET_TRAINER, RecordingLogger, read_scalars
from torch import nn

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.checks import ConfigurationError
from spectral_callbacks.names import parse_tag

# --- the axes -------------------------------------------------------------------------------------

FRONTENDS = ("plain", "fabric", "lightning", "hf")
#: "32"; "bf16-mixed" / "16-mixed": autocast (fp16 with a GradScaler where the frontend has one on a
#: CPU); "bf16-true": the weights themselves in bfloat16.
PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
#: "module": the tracker is given the compiled module; "wrapper": the tracker watches the module
#: and training runs through ``torch.compile`` of it; "hf": ``TrainingArguments(torch_compile=True)``;
#: "configure_model": a LightningModule compiles its network in ``configure_model``.
COMPILES = ("none", "module", "wrapper", "hf", "configure_model")
#: "reentrant" / "non-reentrant": ``gradient_checkpointing_enable`` of a transformers model (the
#: Trainer's ``gradient_checkpointing=True``); "block": ``torch.utils.checkpoint`` in hand-written
#: blocks (examples/gpt.py's).
CHECKPOINTING = ("none", "reentrant", "non-reentrant", "block")
#: PEFT LoRA on float weights; QLoRA: LoRA over a bitsandbytes base loaded by transformers'
#: ``BitsAndBytesConfig`` (4-bit NF4 / FP4, "-dq" with double quantization; 8-bit ``Linear8bitLt``).
ADAPTERS = ("none", "lora", "nf4", "fp4", "nf4-dq", "fp4-dq", "int8")
MODELS = ("gpt2", "llama", "nanogpt")

# --- one cell's run -------------------------------------------------------------------------------

STEPS, BATCH, BLOCK, VOCAB, LR = 5, 2, 8, 64, 1e-2
#: The monitor's options in every cell: an exact SVD (so the logged values can be compared with
#: float64 at a tolerance of float32), a schedule that snapshots steps 0, 1, 2, 3 and the last (5),
#: room for every scheduled step whatever the machine's load.
OPTIONS: dict[str, Any] = dict(
    metrics=("stable_rank", "spectral_norm"),
    svd_method="gram",
    k=8,
    every_n_steps=3,
    log_spaced_until=3,
    figures=False,
    max_pending=16,
)
SCHEDULED = [0, 1, 2, 3, 5]
#: Logged against float64: float32 snapshots and an exact float64 Gram eigensolver.
RELATIVE_TOLERANCE = 1e-4
#: The step whose gradients are made infinite in the cells with ``skip=True``: the GradScaler skips
#: its update, the step is counted all the same and scheduled (its weights are step 1's).
SKIPPED_STEP = 2


@dataclass(frozen=True)
class Cell:
    """One training configuration (see the axes above) and what the monitor must do with it."""

    frontend: str
    model: str = "gpt2"
    precision: str = "32"
    compile: str = "none"
    checkpointing: str = "none"
    adapter: str = "none"
    skip: bool = False  # one step's gradients made infinite: the GradScaler skips its update
    #: The monitor's options besides OPTIONS (e.g. roles_from_first_forward=False).
    options: tuple[tuple[str, Any], ...] = ()
    #: ``None``: exact; else a phrase the one-line refusal at construction must contain.
    refused: str | None = None
    #: A known failure (the cell is landed strict-xfail with it until its fix lands).
    known: str | None = None
    slow: bool = False

    def __post_init__(self) -> None:
        for axis, value, allowed in (
            ("frontend", self.frontend, FRONTENDS),
            ("model", self.model, MODELS),
            ("precision", self.precision, PRECISIONS),
            ("compile", self.compile, COMPILES),
            ("checkpointing", self.checkpointing, CHECKPOINTING),
            ("adapter", self.adapter, ADAPTERS),
        ):
            if value not in allowed:
                raise ValueError(f"Cell `{axis}` must be one of {allowed}, got {value!r}")
        if self.checkpointing in ("reentrant", "non-reentrant") and self.model == "nanogpt":
            raise ValueError("gradient_checkpointing_enable needs a transformers model")
        if self.checkpointing == "block" and self.model != "nanogpt":
            raise ValueError("checkpointing='block' is examples/gpt.py's blocks: model='nanogpt'")
        if self.adapter in QUANTIZED and self.model != "llama":
            raise ValueError("the quantized cells load the tiny Llama (nn.Linear projections)")

    @property
    def id(self) -> str:
        """A short name: the frontend and every axis that is not at its default."""
        parts = [self.frontend, self.model]
        if self.precision != "32":
            parts.append(self.precision)
        if self.compile != "none":
            parts.append(f"compile={self.compile}")
        if self.checkpointing != "none":
            parts.append(f"ckpt={self.checkpointing}")
        if self.adapter != "none":
            parts.append(self.adapter)
        if self.skip:
            parts.append("scaler-skip")
        parts += [f"{key}={value}" for key, value in self.options]
        return "-".join(parts)

    @property
    def needs(self) -> str | None:
        """A package the cell needs that is not installed, or None."""
        if self.adapter in QUANTIZED and importlib.util.find_spec("bitsandbytes") is None:
            return "bitsandbytes"
        return None


QUANTIZED = ("nf4", "fp4", "nf4-dq", "fp4-dq", "int8")


# --- the models: tiny, with non-zero biases ----------------------------------------------------------


def with_biases(model: nn.Module) -> nn.Module:
    """Every bias drawn at the scale of a pretrained checkpoint's (GPT-2's c_attn biases reach
    ~0.5): a model built from a config starts with zero biases, which hides what autocast does to
    a biased product."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def gpt2() -> nn.Module:
    """GPT-2 (fused ``c_attn``, ``Conv1D`` layers), dropout off."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=BLOCK,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    """Llama with biases on every projection (as Qwen2's q/k/v), GQA."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=BLOCK,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


class CheckpointedGPT(GPT):
    """examples/gpt.py's GPT whose blocks run under ``torch.utils.checkpoint`` (hand-written, as
    nanoGPT-style code does it)."""

    def __init__(self, config: GPTConfig, checkpointed: bool) -> None:
        super().__init__(config)
        self.checkpointed = checkpointed

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        if not self.checkpointed:
            return super().forward(idx, targets)
        from torch.utils.checkpoint import checkpoint

        positions = self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = self.transformer.drop(self.transformer.wte(idx) + positions)  # (B, T, d)
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


class NanoLM(nn.Module):
    """:class:`CheckpointedGPT` with the Hugging Face calling convention (``input_ids``,
    ``labels`` shifted inside, a dict with ``loss``), so every frontend trains it alike."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, bias=True)
        self.gpt = CheckpointedGPT(config, checkpointed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        _, loss = self.gpt(input_ids[:, :-1], labels[:, 1:])
        return {"loss": loss}


_INITIAL: dict[str, nn.Module] = {}


def initial_model(cell: Cell) -> nn.Module:
    """The cell's model with the same initial weights every time (cached per model kind)."""
    key = cell.model
    if key not in _INITIAL:
        torch.manual_seed(0)
        built = {"gpt2": gpt2, "llama": llama, "nanogpt": NanoLM}[key]()
        _INITIAL[key] = with_biases(built)
    model = copy.deepcopy(_INITIAL[key])
    if cell.checkpointing == "block":
        model.gpt.checkpointed = True
    return model


def quantized_llama(cell: Cell) -> nn.Module:
    """The tiny Llama saved and loaded back through ``BitsAndBytesConfig`` (as QLoRA users load a
    checkpoint), prepared for k-bit training."""
    import transformers
    from peft import prepare_model_for_kbit_training

    folder = _saved_llama()
    four_bit = cell.adapter != "int8"
    # QLoRA computes in bfloat16 when the run autocasts to it, else in float32.
    compute = torch.bfloat16 if cell.precision == "bf16-mixed" else torch.float32
    quantization = (
        transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cell.adapter.removesuffix("-dq"),
            bnb_4bit_use_double_quant=cell.adapter.endswith("-dq"),
            bnb_4bit_compute_dtype=compute,
        )
        if four_bit
        else transformers.BitsAndBytesConfig(load_in_8bit=True)
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quantization, device_map={"": "cpu"}, dtype=torch.float32
    )
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


_SAVED: dict[str, str] = {}


def _saved_llama() -> str:
    if "llama" not in _SAVED:
        folder = tempfile.mkdtemp(prefix="training-configurations-")
        initial_model(Cell("plain", model="llama")).save_pretrained(folder)
        _SAVED["llama"] = folder
    return _SAVED["llama"]


LORA_MODULES = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def cell_model(cell: Cell) -> nn.Module:
    """The network a cell trains: the model, its precision, checkpointing and adapters applied
    (compilation is the frontend's)."""
    model = quantized_llama(cell) if cell.adapter in QUANTIZED else initial_model(cell)
    if cell.precision == "bf16-true" and cell.frontend in ("plain", "hf"):
        model = model.to(torch.bfloat16)  # Fabric and Lightning convert it themselves
    if cell.checkpointing in ("reentrant", "non-reentrant") and cell.frontend != "hf":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": cell.checkpointing == "reentrant"}
        )
    if cell.adapter != "none":
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=LORA_MODULES[cell.model],
            fan_in_fan_out=cell.model == "gpt2",
        )
        torch.manual_seed(2)
        model = get_peft_model(model, config)
    return model


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (STEPS, BATCH, BLOCK), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def loss_of(output: Any) -> torch.Tensor:
    return output["loss"]


# --- what a run leaves -----------------------------------------------------------------------------


@dataclass
class Run:
    """One training run of a cell: its losses, and with the monitor what it logged, the watched
    targets and the matrices the layers computed after each optimizer step."""

    losses: list[float] = field(default_factory=list)
    logged: dict[tuple[str, int], float] = field(default_factory=dict)
    targets: list[Any] = field(default_factory=list)
    #: step -> id(parameter) -> the (out, in) float64 matrix its layer computes.
    matrices: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    #: Whether training ran compiled code (dynamo handed graphs to the backend).
    compiled: bool = False


@dataclass(frozen=True)
class Outcome:
    """What the monitor did with a cell: ``"exact"``, ``"refused"`` (with its message) or
    ``"failed"`` (with what failed)."""

    status: str
    detail: str = ""
    watched: int = 0


class Refused(Exception):
    """The monitor refused the cell at construction (before any training step)."""


# --- the matrix a layer computes ----------------------------------------------------------------


def computing_layers(model: nn.Module) -> dict[int, tuple[nn.Module, int]]:
    """id(weight) -> (the layer that applies it, its input width), for every projection-like
    layer: the outermost of a PEFT tuner layer and its base, so an adapted weight maps to
    ``W0 + s B A``."""
    parents = {id(child): module for module in model.modules() for child in module.children()}
    found: dict[int, tuple[nn.Module, int]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or weight.dim() != 2 or isinstance(module, nn.Embedding):
            continue
        layer = module
        parent = parents.get(id(module))
        if parent is not None and getattr(parent, "base_layer", None) is module:
            layer = parent
        width = getattr(module, "in_features", None)
        if type(module).__name__ == "Conv1D":
            width = weight.shape[0]
        if width is not None:
            found[id(weight)] = (layer, int(width))
    return found


def layer_matrix(layer: nn.Module, width: int) -> torch.Tensor:
    """The ``(out, in)`` matrix ``layer`` applies: its forward on the identity minus its forward
    on zero (the bias), with autocast off and in eval mode (no dropout); in float64 on a copy where
    every parameter is floating point, else (a quantized base) the layer itself at float32
    compute."""
    # A copy: a quantized layer's first forward can change its state (the CPU backend repacks a
    # 4-bit weight in eval mode), and the run must go on exactly as without this reference.
    replica = copy.deepcopy(layer).eval()
    dtype = torch.float32
    if all(p.is_floating_point() for p in replica.parameters()):
        replica, dtype = replica.double(), torch.float64
    with torch.no_grad(), torch.autocast("cpu", enabled=False), _float32_compute(replica):
        identity, zero = torch.eye(width, dtype=dtype), torch.zeros(1, width, dtype=dtype)
        out = replica.forward(identity).double() - replica.forward(zero).double()
    return out.t().contiguous()


@contextlib.contextmanager
def _float32_compute(layer: nn.Module) -> Iterator[None]:
    """bitsandbytes layers computing in float32 for the reference (the dequantized matrix, not its
    bfloat16 product)."""
    changed = [
        (module, module.compute_dtype)
        for module in layer.modules()
        if getattr(module, "compute_dtype", None) is not None
    ]
    for module, _ in changed:
        module.compute_dtype = torch.float32
    try:
        yield
    finally:
        for module, dtype in changed:
            module.compute_dtype = dtype


def record_matrices(run: Run, step: int, model: nn.Module) -> None:
    """The matrix every projection-like layer of ``model`` computes now, as of ``step``."""
    run.matrices[step] = {
        key: layer_matrix(layer, width) for key, (layer, width) in computing_layers(model).items()
    }


def spectral(records: list[tuple[int | None, dict[str, float]]]) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of the per-layer spectral scalars."""
    return {
        (tag, int(step)): value
        for step, metrics in records
        for tag, value in metrics.items()
        if step is not None and (parsed := parse_tag(tag)) is not None and parsed.layer is not None
    }


# --- the frontends -------------------------------------------------------------------------------


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)


def poison_gradients(model: nn.Module) -> None:
    """Make one gradient infinite: the GradScaler must skip this step's update."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.view(-1)[0] = float("inf")
            return


#: Graphs dynamo handed to the backend, so a compiled cell checks that it compiled something.
COMPILED_GRAPHS: list[int] = [0]


def _counting_eager(graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
    """torch.compile's "eager" backend (the traced graph run as it is), counting its graphs."""
    COMPILED_GRAPHS[0] += 1
    return graph.forward


def compiled(module: nn.Module) -> nn.Module:
    """``torch.compile`` with the "eager" backend: dynamo's tracing, guards and graph breaks, which
    is where the monitor meets compilation, in seconds (inductor's code generation takes minutes
    per cell on a small CPU)."""
    return torch.compile(module, backend=_counting_eager)


def autocast(cell: Cell) -> contextlib.AbstractContextManager[Any]:
    if cell.precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if cell.precision == "16-mixed":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def plain_loop(cell: Cell, monitor: bool, root: Path) -> Run:
    """A hand-written loop: ``torch.autocast``, ``GradScaler``, ``torch.compile`` as users write
    them, ``tracker.step(step)`` after each optimizer step."""
    run = Run()
    model = cell_model(cell)
    optimizer = optimizer_for(model)
    scaler = torch.amp.GradScaler("cpu") if cell.precision == "16-mixed" else None
    watched = compiled(model) if cell.compile == "module" else model
    trained = compiled(model) if cell.compile == "wrapper" else watched
    writer = RecordingLogger()
    tracker = None
    if monitor:
        try:
            tracker = SpectralTracker(watched, writers=[writer], **OPTIONS, **dict(cell.options))
        except ConfigurationError as error:
            raise Refused(str(error)) from error
        record_matrices(run, 0, model)
    for step, batch in enumerate(batches(), start=1):
        with autocast(cell):
            loss = loss_of(trained(**batch))
        run.losses.append(loss.item())
        if scaler is not None:
            scaler.scale(loss).backward()
            if cell.skip and step == SKIPPED_STEP:
                poison_gradients(model)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
        if tracker is not None:
            tracker.step(step)
            record_matrices(run, step, model)
    if tracker is not None:
        tracker.close()
        run.targets, run.logged = list(tracker.targets), spectral(writer.records)
    return run


def fabric_loop(cell: Cell, monitor: bool, root: Path) -> Run:
    """Lightning Fabric: its precision plugins (fp16 with a GradScaler on the CPU given as a plugin,
    since ``precision="16-mixed"`` falls back to bf16 there), ``fabric.setup`` of a compiled
    module or a compiled wrapper around the set-up one."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    run = Run()
    writer = RecordingLogger()
    precision: dict[str, Any] = {"precision": cell.precision}
    if cell.precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu")
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    fabric = Fabric(accelerator="cpu", devices=1, loggers=writer, **precision)
    model = cell_model(cell)
    network = compiled(model) if cell.compile == "module" else model
    optimizer = optimizer_for(model)
    wrapped, optimizer = fabric.setup(network, optimizer)
    trained = compiled(wrapped) if cell.compile == "wrapper" else wrapped
    tracker = None
    if monitor:
        try:
            tracker = SpectralTracker(
                wrapped, writers=fabric.loggers, **OPTIONS, **dict(cell.options)
            )
        except ConfigurationError as error:
            raise Refused(str(error)) from error
        record_matrices(run, 0, model)
    for step, batch in enumerate(batches(), start=1):
        loss = loss_of(trained(**batch))
        run.losses.append(loss.item())
        fabric.backward(loss)
        if cell.skip and step == SKIPPED_STEP:
            poison_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        if tracker is not None:
            tracker.step(step)
            record_matrices(run, step, model)
    if tracker is not None:
        tracker.close()
        run.targets, run.logged = list(tracker.targets), spectral(writer.records)
    return run


def lightning_fit(cell: Cell, monitor: bool, root: Path) -> Run:
    """``lightning.pytorch``: ``Trainer(precision=...)`` (fp16 with a GradScaler given as a plugin
    on the CPU), ``trainer.fit(torch.compile(module))`` or a network compiled in
    ``configure_model``; SpectralMonitor among the callbacks."""
    import lightning.pytorch as lp
    from lightning.pytorch.plugins.precision import MixedPrecision

    from spectral_callbacks import SpectralMonitor

    run = Run()
    network = cell_model(cell)

    class Module(lp.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network = network

        def configure_model(self) -> None:
            if cell.compile == "configure_model" and not isinstance(
                self.network, torch._dynamo.eval_frame.OptimizedModule
            ):
                self.network = compiled(self.network)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = loss_of(self.network(**batch))
            run.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            # Before the scaler unscales (on_before_optimizer_step comes after): it sees the inf.
            if cell.skip and self.global_step + 1 == SKIPPED_STEP:
                poison_gradients(network)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(network)

    class Recorder(lp.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            record_matrices(run, trainer.global_step, network)

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            record_matrices(run, trainer.global_step, network)

    precision: dict[str, Any] = {"precision": cell.precision}
    if cell.precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu")
        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    logger = RecordingLogger()
    spectral_monitor = SpectralMonitor(**OPTIONS, **dict(cell.options))
    callbacks = [spectral_monitor, Recorder()] if monitor else []
    trainer = lp.Trainer(
        **dict(QUIET_TRAINER, max_steps=STEPS),
        logger=logger if monitor else False,
        callbacks=callbacks,
        **precision,
    )
    module: nn.Module = Module()
    if cell.compile == "module":
        module = compiled(module)
    loader = torch.utils.data.DataLoader(batches(), batch_size=None)
    try:
        trainer.fit(module, loader)
    except ConfigurationError as error:
        if run.losses:
            raise
        raise Refused(str(error)) from error
    if monitor:
        run.targets, run.logged = list(spectral_monitor.targets), spectral(logger.records)
    return run


def hf_train(cell: Cell, monitor: bool, root: Path) -> Run:
    """The Hugging Face ``Trainer``: ``bf16=`` / ``fp16=`` (autocast; no GradScaler on a CPU),
    ``torch_compile=True``, ``gradient_checkpointing=True``; a model whose weights are bf16 for
    "bf16-true"; SpectralTrainerCallback among the callbacks."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    run = Run()

    class RecordingTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            run.losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    class Recorder(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record_matrices(run, state.global_step, kwargs["model"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record_matrices(run, state.global_step, kwargs["model"])

    class InOrder(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return (
                {key: value[i] for key, value in batch.items()}
                for batch in batches()
                for i in range(BATCH)
            )

    checkpointing = cell.checkpointing in ("reentrant", "non-reentrant")
    args = TrainingArguments(
        output_dir=str(root / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        bf16=cell.precision == "bf16-mixed",
        fp16=cell.precision == "16-mixed",
        torch_compile=cell.compile == "hf",
        torch_compile_backend="eager" if cell.compile == "hf" else None,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs=(
            {"use_reentrant": cell.checkpointing == "reentrant"} if checkpointing else None
        ),
    )
    logdir = root / "hf-runs"
    callback = SpectralTrainerCallback(logdir=logdir, **OPTIONS, **dict(cell.options))
    callbacks = [callback, Recorder()] if monitor else []
    trainer = RecordingTrainer(
        model=cell_model(cell), args=args, train_dataset=InOrder(), callbacks=callbacks
    )
    try:
        trainer.train()
    except ConfigurationError as error:
        if run.losses:
            raise
        raise Refused(str(error)) from error
    # accelerate compiles the model it trains (its backend is one of its own names: not counted)
    run.compiled = isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    if monitor:
        logged = read_scalars(logdir)
        run.targets = list(callback.tracker.targets)
        run.logged = spectral(
            [
                (step, {tag: value})
                for tag, series in logged.items()
                for step, value in series.items()
            ]
        )
    return run


TRAIN: dict[str, Callable[[Cell, bool, Path], Run]] = {
    "plain": plain_loop,
    "fabric": fabric_loop,
    "lightning": lightning_fit,
    "hf": hf_train,
}


# --- the checks ------------------------------------------------------------------------------------


def run_cell(cell: Cell, root: Path) -> Outcome:
    """Train ``cell`` with and without the monitor and check it (see the module docstring)."""
    torch.compiler.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        COMPILED_GRAPHS[0] = 0
        try:
            monitored = TRAIN[cell.frontend](cell, True, root / "monitored")
            monitored.compiled |= COMPILED_GRAPHS[0] > 0
        except Refused as refusal:
            return Outcome("refused", str(refusal))
        except Exception as error:  # the fit ended: what the table shows, and the test's failure
            first_line = str(error).strip().partition("\n")[0]
            return Outcome("failed", f"the fit ended: {type(error).__name__}: {first_line}")
        torch.compiler.reset()
        alone = TRAIN[cell.frontend](cell, False, root / "alone")
    problems = compare_losses(monitored, alone) + compare_spectra(cell, monitored)
    if cell.compile != "none" and not monitored.compiled:
        problems.append("nothing was compiled")
    if problems:
        return Outcome("failed", "; ".join(problems[:3]), len(monitored.targets))
    return Outcome("exact", watched=len(monitored.targets))


def compare_losses(monitored: Run, alone: Run) -> list[str]:
    """The run with the monitor computes exactly what it computes without it, bit for bit."""
    if len(monitored.losses) != STEPS or len(alone.losses) != STEPS:
        return [f"{len(monitored.losses)} losses with the monitor, {len(alone.losses)} without"]
    return [
        f"loss at step {step}: {a!r} with the monitor, {b!r} without"
        for step, (a, b) in enumerate(zip(monitored.losses, alone.losses, strict=True))
        if a != b and not (math.isnan(a) and math.isnan(b))
    ]


def compare_spectra(cell: Cell, run: Run) -> list[str]:
    """Every scheduled step logged for every watched matrix, each stable rank and σ₁ equal to the
    float64 SVD of the matrix its layer computes at that step."""
    if not run.targets:
        return ["no matrix watched"]
    problems: list[str] = []
    if cell.skip:  # the cell tests what it says: the scaler did skip that update
        before, skipped = run.matrices[SKIPPED_STEP - 1], run.matrices[SKIPPED_STEP]
        if not all(torch.equal(before[key], skipped[key]) for key in before):
            problems.append(f"the GradScaler did not skip step {SKIPPED_STEP}")
    logged: dict[tuple[str, str, int, str], dict[int, float]] = {}
    for (tag, step), value in run.logged.items():
        parsed = parse_tag(tag)
        assert parsed is not None and parsed.layer is not None
        key = (parsed.metric, parsed.stack, parsed.layer, parsed.role)
        logged.setdefault(key, {})[step] = value
    for target in run.targets:
        where = (target.stack, target.layer, target.role)
        series = {metric: logged.get((metric, *where), {}) for metric in OPTIONS["metrics"]}
        steps = sorted(series["stable_rank"])
        if steps != SCHEDULED or sorted(series["spectral_norm"]) != SCHEDULED:
            problems.append(f"{target.name}: logged at steps {steps}, scheduled {SCHEDULED}")
            continue
        for step in SCHEDULED:
            computed = run.matrices[step].get(id(target.parameter))
            if computed is None:
                problems.append(f"{target.name}: no layer of the model computes its weight")
                break
            matrix = dataclasses.replace(target.rows, transposed=False).take(computed)
            singular = torch.linalg.svdvals(matrix)
            expected = {
                "stable_rank": float((singular**2).sum() / singular[0] ** 2),
                "spectral_norm": float(singular[0]),
            }
            for metric, value in expected.items():
                got = series[metric][step]
                if abs(got - value) > RELATIVE_TOLERANCE * abs(value):
                    problems.append(
                        f"{target.name} {metric} at step {step}: logged {got:.6g}, "
                        f"float64 of the layer's matrix {value:.6g}"
                    )
    return problems


def check_refusal(cell: Cell, message: str) -> list[str]:
    """A refusal is one line that names the reason the cell expects."""
    problems = []
    if "\n" in message.strip():
        problems.append(f"the refusal is not one line: {message!r}")
    if cell.refused is not None and cell.refused not in message:
        problems.append(f"the refusal does not say {cell.refused!r}: {message!r}")
    return problems


# --- the cells -------------------------------------------------------------------------------------


#: Why a cell fails today: a cell with a reason (``Cell(known=...)``) is landed strict-xfail (the
#: day it passes it fails the suite until its reason is removed), or, where it takes minutes to
#: fail, kept in :data:`PENDING` (the table shows it, the tests do not run it). None fails today.


def _cells() -> list[Cell]:
    """Every value of every axis at least once with each frontend, and the pairs that interact:
    autocast x biases (every mixed-precision cell: the models' biases are non-zero), compile x the
    first forward (the compiled cells read roles from it by default), checkpointing x recording,
    QLoRA x autocast, GradScaler skips x the step count."""
    cells: list[Cell] = []
    for frontend in FRONTENDS:
        cells += [
            Cell(frontend),
            Cell(frontend, precision="bf16-mixed"),
            Cell(frontend, model="llama", precision="bf16-mixed"),
            Cell(frontend, precision="16-mixed", skip=frontend != "hf"),
            Cell(frontend, model="llama", precision="bf16-true"),
            Cell(frontend, model="nanogpt", checkpointing="block"),
            Cell(frontend, model="llama", checkpointing="reentrant"),
            Cell(
                frontend,
                model="llama",
                checkpointing="non-reentrant",
                precision="bf16-mixed",
            ),
            Cell(frontend, model="llama", adapter="lora"),
            Cell(frontend, model="gpt2", adapter="lora", precision="bf16-mixed"),
        ]
        # examples/gpt.py's model: dynamo traces it in seconds, transformers' in a minute.
        compiles = {
            "plain": ("module", "wrapper"),
            "fabric": ("module", "wrapper"),
            "lightning": ("configure_model", "module"),
            "hf": ("hf",),
        }[frontend]
        for how in compiles:
            cells.append(Cell(frontend, model="nanogpt", compile=how, slow=True))
        cells.append(
            Cell(frontend, model="nanogpt", compile=compiles[0], precision="bf16-mixed", slow=True)
        )
        for adapter in QUANTIZED:
            precision = "bf16-mixed" if adapter == "nf4-dq" else "32"  # QLoRA x autocast
            cells.append(Cell(frontend, model="llama", adapter=adapter, precision=precision))
    cells.append(
        Cell(
            "plain",
            model="nanogpt",
            checkpointing="block",
            compile="wrapper",
            slow=True,
        )
    )
    return cells


#: The cells the tests run, and those that take minutes to fail today (shown in the table only).
CELLS = _cells()
PENDING: list[Cell] = []
