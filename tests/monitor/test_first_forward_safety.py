"""The first training forward as users run it: mixed precision, compiled, several ranks.

The roles are read from the first training forward, inside the user's forward. Whatever that
forward runs under, the monitor watches every projection exactly from step 0 or says in one line
why the names decide; nothing of ours is raised inside the user's forward:

* bf16 / fp16 autocast on a model with non-zero biases (every checkpoint's): the checks of
  ``targets/verify.py`` run with autocast off, at the tolerance of the arithmetic the module
  computes in, so no biased projection is refused (before: every one was, and the fit ended with a
  ConfigurationError raised inside the model's forward);
* ``torch.compile`` of a wrapper around the watched module: the recording hooks are no-ops while
  dynamo traces, and the names decide at the first gradient, said in one line (before: dynamo
  traced the hook and the model's first forward raised);
* a reading that fails inside the forward: a warning, then the names; an error that stands (a
  forward that contradicts the names, nothing to watch) is raised by the tracker's next call;
* several ranks: a rank whose first forward reads no roles makes every rank raise the same error
  within seconds (before: it raised alone, and the others waited in the collective until the
  process group's timeout).
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import RecordingLogger
from torch import nn
from unhelpful_model import Unhelpful

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.targets import find_targets

VOCAB = 50
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPTIONS: dict[str, Any] = dict(metrics=["stable_rank"], figures=False, svd_method="svdvals")


def biased_gpt2(seed: int = 0) -> nn.Module:
    """A tiny GPT-2 whose biases are non-zero, as in a checkpoint (from a config they are 0)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    return model


def biased_nanogpt(seed: int = 0) -> nn.Module:
    """examples/gpt.py's GPT with biases, non-zero: a model dynamo traces quickly."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB, bias=True)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    return model


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The language-model loss of either model (Hugging Face's or examples/gpt.py's)."""
    if isinstance(model, transformers.PreTrainedModel) or isinstance(
        getattr(model, "_orig_mod", None), transformers.PreTrainedModel
    ):
        return model(x, labels=x).loss
    return model(x, x)[1]


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def exact_initial(model: nn.Module) -> dict[str, float]:
    """float64 stable rank of every watched matrix of ``model`` now, by logged tag."""
    result = {}
    for target in find_targets(model):
        matrix = target.matrix().detach().double()
        value = (matrix**2).sum() / torch.linalg.svdvals(matrix)[0] ** 2
        result[f"spectral_stable_rank/L{target.layer:02d}/{target.role}"] = float(value)
    return result


def assert_step_zero_exact(logger: RecordingLogger, initial: dict[str, float]) -> None:
    assert len(initial) == 12  # Q, K, V, O, MLP_up, MLP_down of both layers
    for tag, value in initial.items():
        assert logger.series(tag)[0] == pytest.approx(value, rel=1e-5), tag


# --- mixed precision on biased weights --------------------------------------------------------


@pytest.mark.parametrize("follow", ["auto", True])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_autocast_on_biased_weights_watches_every_projection_from_step_0(
    dtype: str, follow: Any
) -> None:
    # before: every biased projection was refused inside the autocast forward, and the fit ended
    # with "every target was removed by roles=/include=/exclude=" raised from the model's forward
    model = biased_gpt2()
    initial = exact_initial(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = RecordingLogger()
    tracker = SpectralTracker(model, writers=[logger], roles_from_first_forward=follow, **OPTIONS)
    for step in range(1, 3):
        with torch.autocast("cpu", dtype=DTYPES[dtype]):
            loss = model(tokens(step), labels=tokens(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    assert len(tracker.targets) == 12
    assert_step_zero_exact(logger, initial)
    assert set(logger.series("spectral_stable_rank/L01/Q")) == {0, 1, 2}


def test_fabric_bf16_mixed_on_biased_weights(tmp_path: Path) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = biased_gpt2()
    initial = exact_initial(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped, optimizer = fabric.setup(model, optimizer)
    logger = RecordingLogger()
    tracker = SpectralTracker(model, writers=[logger], roles_from_first_forward=True, **OPTIONS)
    for step in range(1, 3):
        loss = wrapped(tokens(step), labels=tokens(step)).loss  # Fabric's autocast
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close()
    assert_step_zero_exact(logger, initial)


def test_lightning_bf16_mixed_on_biased_weights() -> None:
    from lightning.pytorch import LightningModule
    from tiny_models import quiet_trainer

    from spectral_callbacks import SpectralMonitor

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = biased_gpt2()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x, labels=x).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    initial = exact_initial(copy.deepcopy(module.net))
    logger = RecordingLogger()
    batches = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.cat([tokens(s) for s in range(2)])), batch_size=2
    )
    trainer = quiet_trainer(
        max_steps=2,
        precision="bf16-mixed",
        logger=logger,
        callbacks=[SpectralMonitor(**OPTIONS)],
    )
    trainer.fit(module, batches)
    assert_step_zero_exact(logger, initial)


# --- compiled ---------------------------------------------------------------------------------


def _train_compiled(
    follow: Any, backend: str, caplog: Any, build: Any = biased_nanogpt
) -> list[str]:
    """Train 2 steps through ``torch.compile`` of the watched model; the lines that say so."""
    model = build()
    initial = exact_initial(copy.deepcopy(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = RecordingLogger()
    tracker = SpectralTracker(model, writers=[logger], roles_from_first_forward=follow, **OPTIONS)
    compiled = torch.compile(model, backend=backend)  # a wrapper around the watched module
    with caplog.at_level(logging.INFO):
        for step in range(1, 3):
            loss_of(compiled, tokens(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
    tracker.close()
    assert_step_zero_exact(logger, initial)
    assert set(logger.series("spectral_stable_rank/L01/Q")) == {0, 1, 2}
    return [r.getMessage() for r in caplog.records if "compiled" in r.getMessage()]


COMPILED_LINE = (
    "the model's forward ran compiled (torch.compile of a module that calls it): dynamo "
    "traces a graph, not a recording"
)


def test_a_compiled_wrapper_around_a_hugging_face_model_trains(caplog: Any) -> None:
    # before: dynamo traced the recording hook, and the model's first forward raised inside
    # GPT-2's own code (TypeError: arange() received an invalid combination of arguments)
    lines = _train_compiled("auto", "eager", caplog, build=biased_gpt2)
    assert lines == [f"SpectralTracker: the names are not checked by the forward: {COMPILED_LINE}"]


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)  # inductor compiles C++ for the CPU: ~2 minutes here
def test_a_compiled_wrapper_lets_the_names_decide_before_the_first_update(
    backend: str, caplog: Any
) -> None:
    lines = _train_compiled("auto", backend, caplog)
    assert lines == [f"SpectralTracker: the names are not checked by the forward: {COMPILED_LINE}"]
    caplog.clear()
    with pytest.warns(RuntimeWarning, match="roles from the names: the model's forward ran"):
        _train_compiled(True, backend, caplog)  # the forward was asked for: a warning


def _frames_compiled(with_tracker: bool) -> list[int]:
    """Frames dynamo has compiled after each of 3 steps and a later forward (after close)."""
    from torch._dynamo.testing import CompileCounter

    model = biased_nanogpt()
    tracker = (
        SpectralTracker(model, writers=[RecordingLogger()], **OPTIONS) if with_tracker else None
    )
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    frames = []
    for step in range(1, 4):
        loss_of(compiled, tokens(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if tracker is not None:
            tracker.step(step)
        frames.append(counter.frame_count)
    if tracker is not None:
        tracker.close()
    loss_of(compiled, tokens(9))
    return [*frames, counter.frame_count]


def test_a_compiled_forward_is_not_recompiled_for_the_hooks() -> None:
    # the recording hooks stay, inert, after a compiled forward: removing them would change what
    # dynamo guards on and recompile the model's graph at the next step
    assert _frames_compiled(with_tracker=True) == _frames_compiled(with_tracker=False)


def test_the_hugging_face_trainer_with_torch_compile(tmp_path: Path, caplog: Any) -> None:
    from spectral_callbacks.hf import SpectralTrainerCallback

    model = biased_gpt2()
    data = [{"input_ids": tokens(s)[0], "labels": tokens(s)[0]} for s in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        torch_compile=True,
        torch_compile_backend="eager",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    callback = SpectralTrainerCallback(logdir=tmp_path / "runs", **OPTIONS)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    with caplog.at_level(logging.INFO):
        trainer.train()
    assert callback.tracker is not None and len(callback.tracker.targets) == 12
    said = [r.getMessage() for r in caplog.records if "roles from the names" in r.getMessage()]
    assert said == [
        "SpectralTrainerCallback: roles from the names: the model's forward runs compiled "
        "(torch.compile): its forward runs a graph"
    ]


# --- nothing of ours raised inside the user's forward -------------------------------------------


def test_a_reading_that_fails_inside_the_forward_warns_once_and_the_names_decide(
    monkeypatch: Any,
) -> None:
    from spectral_callbacks.targets import first_forward

    def broken(recording: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(first_forward, "roles_from_recording", broken)
    model = biased_gpt2()
    initial = exact_initial(copy.deepcopy(model))
    logger = RecordingLogger()
    tracker = SpectralTracker(model, writers=[logger], roles_from_first_forward=True, **OPTIONS)
    with pytest.warns(RuntimeWarning) as caught:
        model(tokens(), labels=tokens()).loss.backward()  # raises nothing
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert said == [
        "SpectralTracker: the roles could not be read from the first forward (its roles could "
        "not be read (RuntimeError: a bug of ours)); they come from the names"
    ]
    tracker.step(1)
    tracker.close()
    assert_step_zero_exact(logger, initial)


def test_an_error_found_inside_the_forward_is_raised_by_the_next_call_not_by_the_forward() -> None:
    # the names place nothing of this model, and the forward shows no attention: nothing to watch
    class Skipping(Unhelpful):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.o(self.f(self.e(x)))

    model = Skipping(vocab=64, layers=2)
    tracker = SpectralTracker(model, writers=[RecordingLogger()], **OPTIONS)
    with pytest.warns(RuntimeWarning, match="could not be read from the first forward"):
        logits = model(torch.randint(0, 64, (2, 6)))  # raises nothing
    F.cross_entropy(logits.flatten(0, 1), torch.zeros(12, dtype=torch.long)).backward()
    with pytest.raises(ConfigurationError, match="no weight matched a known"):
        tracker.step(1)
    tracker.close()


# --- several ranks ----------------------------------------------------------------------------


class _SkipsItsBlocks(Unhelpful):
    """Rank 1's forward goes from the embedding straight to the head: it reads no roles."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.f(self.e(x)))


def _one_rank_reads_nothing(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = (Unhelpful if rank == 0 else _SkipsItsBlocks)(vocab=64, layers=2)
    tracker = SpectralTracker(model, writers=[RecordingLogger()], **OPTIONS)
    x = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    start = time.monotonic()
    model(x).sum().backward()  # rank 0 enters the agreement inside its forward
    try:
        tracker.step(1)
    except ConfigurationError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    finally:
        tracker.close(error=RuntimeError("stopped"))
    return {"error": None, "seconds": time.monotonic() - start}


def test_ranks_whose_first_forwards_disagree_fail_together_within_seconds(
    tmp_path: Path,
) -> None:
    # before: rank 1 raised before the collective and rank 0 waited in all_gather_object until
    # the process group's timeout (10-30 minutes)
    from spawn_ranks import run_ranks

    rank0, rank1 = run_ranks(_one_rank_reads_nothing, 2, tmp_path, timeout=90)
    assert rank0["error"] is not None and rank0["error"] == rank1["error"]
    assert "could not be read from the first forward on 1 of 2 ranks (rank 1: " in rank0["error"]
    assert max(rank0["seconds"], rank1["seconds"]) < 30
