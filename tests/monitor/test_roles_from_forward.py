"""Roles read from the first training forward by default, through every frontend.

``roles_from_first_forward="auto"`` (the default): where the names place every weight of the
blocks they decide at construction and the first forward must agree; where they cannot (a model
with unhelpful names, torchtitan's ModuleDict of blocks) the targets wait for that forward, which
is recorded whatever the loop calls, and step 0 is still the initial weights.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import RecordingLogger, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from unhelpful_model import Unhelpful

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.targets import PartialTargetWarning, find_targets
from spectral_callbacks.targets.first_forward import FirstForward

VOCAB = 64


def tokens(batch: int = 2, length: int = 6, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def exact_stable_ranks(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """float64 stable rank of every matrix the forward reads, by logged tag."""
    result = {}
    for t in find_targets(model, example_input=x):
        matrix = t.matrix().detach().double()
        result[f"spectral_stable_rank/L{t.layer:02d}/{t.role}"] = float(
            (matrix**2).sum() / torch.linalg.svdvals(matrix)[0] ** 2
        )
    return result


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


# --- Lightning: the training step calls a child, not the LightningModule's own forward ----------


def _lightning_module(calls: str) -> Any:
    from lightning.pytorch import LightningModule

    class Wrapped(LightningModule):
        """``training_step`` runs ``self.net(x)`` (``"child"``) or the net's parts one by one
        (``"parts"``): the LightningModule's own forward never runs."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Unhelpful(vocab=VOCAB, layers=2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            if calls == "child":
                logits = self.net(x)
            else:  # the net's forward written out in the step: embedding, blocks, head
                net, size = self.net, self.net.size
                T = x.shape[1]
                angle = torch.arange(T)[:, None] / 10_000 ** (torch.arange(size // 2) / size)
                cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
                h = net.e(x)
                for block in net.z.values():
                    h = block(h, cos, sin)
                logits = net.o(net.f(h))
            return F.cross_entropy(logits.flatten(0, 1), x.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Wrapped()


@pytest.mark.parametrize("calls", ["child", "parts"])
def test_lightning_reads_the_roles_from_the_training_step_whatever_it_calls(calls: str) -> None:
    # before: the names found nothing in this model (MisconfigurationException), and with
    # roles_from_first_forward=True the root's hook never fired (training_step calls self.net)
    from spectral_callbacks.pl import SpectralMonitor

    module = _lightning_module(calls)
    x = tokens(batch=4)
    initial = exact_stable_ranks(copy.deepcopy(module.net), x)
    logger = RecordingLogger()
    monitor = SpectralMonitor(
        ["stable_rank"], every_n_steps=2, log_spaced_until=0, figures=False, svd_method="svdvals"
    )
    loader = DataLoader(TensorDataset(x), batch_size=4)
    quiet_trainer(max_steps=2, logger=logger, callbacks=[monitor]).fit(module, loader)
    assert len(monitor.targets) == 14  # Q K V O MLP_gate MLP_up MLP_down in 2 layers
    assert {t.role for t in monitor.targets} == {
        "Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down",
    }  # fmt: skip
    assert len(initial) == 14
    for tag, value in initial.items():  # step 0 is the initial weights, read after the forward
        assert logger.series(tag)[0] == pytest.approx(value, rel=1e-5), tag
        assert set(logger.series(tag)) == {0, 2}


def test_lightning_resume_keeps_the_references_of_a_run_whose_roles_wait(tmp_path: Path) -> None:
    from spectral_callbacks.pl import SpectralMonitor

    x = tokens(batch=4)
    loader = DataLoader(TensorDataset(x), batch_size=4)
    options = dict(metrics=["stable_rank", "compression"], every_n_steps=2, log_spaced_until=0)
    first = SpectralMonitor(**options, figures=False, svd_method="svdvals")
    trainer = quiet_trainer(
        max_steps=2,
        logger=RecordingLogger(),
        callbacks=[first],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    trainer.fit(_lightning_module("child"), loader)
    checkpoint = next(tmp_path.rglob("*.ckpt"))
    references = first.tracker.state_dict()["references"]
    assert len(references) == 14
    second = SpectralMonitor(**options, figures=False, svd_method="svdvals")
    logger = RecordingLogger()
    quiet_trainer(max_steps=4, logger=logger, callbacks=[second]).fit(
        _lightning_module("child"), loader, ckpt_path=checkpoint
    )
    assert second.tracker.state_dict()["references"] == references
    assert 0 not in logger.series("spectral_stable_rank/L00/Q")  # resumed, not started afresh
    assert set(logger.series("spectral_compression/L00/Q")) == {4}


# --- the Hugging Face Trainer -----------------------------------------------------------------


class _WithLoss(nn.Module):
    """The unhelpful model as the HF Trainer calls it: ``model(input_ids=, labels=)`` -> loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Unhelpful(vocab=VOCAB, layers=2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": loss_of(self.net, input_ids)}


def test_the_hugging_face_trainer_reads_the_roles_from_its_first_forward(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tiny_models import read_scalars

    from spectral_callbacks.hf import SpectralTrainerCallback

    model = _WithLoss()
    x = tokens(batch=8)
    initial = exact_stable_ranks(copy.deepcopy(model.net), x[:2])
    callback = SpectralTrainerCallback(
        ["stable_rank"],
        logdir=tmp_path / "tb",
        every_n_steps=2,
        log_spaced_until=0,
        figures=False,
        svd_method="svdvals",
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    data = [{"input_ids": row, "labels": row} for row in x]
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert len(callback.tracker.targets) == 14
    scalars = read_scalars(tmp_path / "tb")
    for tag, value in initial.items():
        assert scalars[tag][0] == pytest.approx(value, rel=1e-5), tag
        assert set(scalars[tag]) == {0, 2}


# --- a plain loop -------------------------------------------------------------------------------


def test_a_plain_loop_waits_for_the_first_forward_and_snapshots_the_initial_weights(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = Unhelpful(vocab=VOCAB, layers=2)
    x = tokens()
    initial = exact_stable_ranks(copy.deepcopy(model), x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    logger = RecordingLogger()
    tracker = SpectralTracker(
        model, ["stable_rank"], writers=[logger], figures=False, svd_method="svdvals"
    )
    assert tracker.targets == []  # the names cannot place these weights: the forward decides
    loss_of(model, x).backward()
    assert len(tracker.targets) == 14  # read at the end of the forward, before the update
    optimizer.step()
    tracker.step(1)
    tracker.close()
    for tag, value in initial.items():
        assert logger.series(tag)[0] == pytest.approx(value, rel=1e-5), tag


def test_a_first_forward_that_raises_leaves_no_hook_and_no_recording_behind() -> None:
    """The first forward raises halfway (an out-of-memory error in the second block, after the
    first block's attention was recorded): the recording ends and every hook is removed with it,
    the roles are not read from a partial forward, and a later forward is not recorded."""
    torch.manual_seed(0)
    model = Unhelpful(vocab=VOCAB, layers=2)
    found: list[Any] = []
    watch = FirstForward(model, found.append)

    def out_of_memory(module: nn.Module, args: Any) -> None:
        raise torch.OutOfMemoryError("CPU out of memory (simulated)")

    failing = model.z["q"].register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model(tokens())
    failing.remove()
    assert not watch.recording and watch.done
    # torch's own registries: no hook of the watch or of its recording, no function mode pushed
    assert [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks] == []
    assert torch._C._len_torch_function_stack() == 0
    model(tokens())
    assert found == []


def test_a_model_the_names_read_is_watched_at_construction_and_checked_by_the_forward(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward agrees: nothing to say
        tracker = SpectralTracker(model, writers=[RecordingLogger()], figures=False)
        assert len(tracker.targets) == 12  # the fast path: step 0 was taken at construction
        model(tokens())
    tracker.close()


def test_a_forward_that_contradicts_the_names_is_an_error_after_the_first_forward() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(16, 48)  # the rule reads [q; k; v]; this forward uses [k; q; v]
            self.c_proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            k, q, v = self.c_attn(x).split(16, dim=-1)
            heads = [t.view(*x.shape[:2], 2, 8).transpose(1, 2) for t in (q, k, v)]
            y = F.scaled_dot_product_attention(*heads, is_causal=True)
            return self.c_proj(y.transpose(1, 2).flatten(2))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList(nn.ModuleDict({"attn": Attention()}) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.h:
                x = x + block["attn"](x)
            return x

    model = Model()
    tracker = SpectralTracker(model, writers=[RecordingLogger()], figures=False)
    assert len(tracker.targets) == 8  # the names, at construction
    model(torch.randn(2, 5, 16))  # nothing of ours is raised inside the user's forward
    with pytest.raises(ConfigurationError, match=r"c_attn"):
        tracker.step(1)  # the tracker's next call raises it
    tracker.close()


def test_state_saved_before_the_first_forward_is_the_state_it_resumes_from(
    tmp_path: Path,
) -> None:
    # before: state_dict() returned {} until the first forward, so a checkpoint written then
    # lost the compression references of the run it resumed
    torch.manual_seed(0)
    model = Unhelpful(vocab=VOCAB, layers=2)
    x = tokens()
    metrics = ["stable_rank", "compression"]
    with SpectralTracker(model, metrics, logdir=tmp_path / "a", figures=False) as first:
        model(x)
        first.step(1)
        saved = first.state_dict()
    assert len(saved["references"]) == 14
    resumed = SpectralTracker(
        model, metrics, logdir=tmp_path / "b", start_step=1, state=saved, figures=False
    )
    assert resumed.targets == [] and resumed.state_dict() == saved
    later = SpectralTracker(model, metrics, logdir=tmp_path / "c", figures=False)
    later.load_state_dict(saved)  # a frontend that restores after construction (Lightning)
    assert later.state_dict() == saved
    model(x)
    assert resumed.state_dict()["references"] == saved["references"]
    resumed.close()
    later.close()


def test_a_step_before_any_forward_lets_the_names_decide_in_one_line(
    tmp_path: Path, caplog: Any
) -> None:
    model = Unhelpful(vocab=VOCAB, layers=2)
    tracker = SpectralTracker(model, logdir=tmp_path, figures=False)
    with (
        pytest.warns(RuntimeWarning, match="step 1 came before any forward") as caught,
        pytest.raises(ConfigurationError, match="no weight matched a known"),
    ):
        tracker.step(1)  # and these names place nothing
    assert len([w for w in caught if w.category is RuntimeWarning]) == 1


def test_a_compiled_or_sharded_model_is_read_by_the_names_said_in_one_line(
    tmp_path: Path, caplog: Any
) -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    model = torch.compile(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB)))
    with caplog.at_level(logging.INFO):
        tracker = SpectralTracker(model, logdir=tmp_path, figures=False)
    lines = [r.getMessage() for r in caplog.records if "roles from the names" in r.getMessage()]
    assert lines == ["SpectralTracker: roles from the names: the model is compiled "
                     "(torch.compile): its forward runs a graph"]  # fmt: skip
    assert len(tracker.targets) == 12
    tracker.close()


def test_partial_names_inside_the_blocks_wait_for_the_forward(tmp_path: Path) -> None:
    # the names read Q/K/V/O of this model, not its MLP: the forward decides, and finds it
    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from gpt import GPT, GPTConfig

    class Feed(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.w_a, self.w_b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w_b(F.gelu(self.w_a(x)))

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB))
    for block in model.transformer.h:
        block.mlp = Feed(32)
    tracker = SpectralTracker(model, logdir=tmp_path, figures=False)
    assert tracker.targets == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        model(tokens())
    assert sorted({t.role for t in tracker.targets}) == ["K", "MLP_down", "MLP_up", "O", "Q", "V"]
    tracker.close()


# --- logged names: unchanged for the models the names read -----------------------------------


def _named_model(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    x = tokens(batch=1, length=6)
    if name == "nanogpt":
        sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
        from gpt import GPT, GPTConfig

        config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=VOCAB)
        return GPT(config), {"idx": x}
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)
        return transformers.GPT2LMHeadModel(config), {"input_ids": x}
    if name == "llama":
        config = transformers.LlamaConfig(**sizes, num_key_value_heads=2, vocab_size=VOCAB)
        return transformers.LlamaForCausalLM(config), {"input_ids": x}
    if name == "bert":
        config = transformers.BertConfig(**sizes, vocab_size=VOCAB)
        return transformers.BertModel(config), {"input_ids": x}
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    # labels=input_ids, the same tensor: the decoder's stream starts from the encoder's ids
    return transformers.T5ForConditionalGeneration(config), {"input_ids": x, "labels": x}


def _logged_tags(model: nn.Module, batch: dict[str, torch.Tensor], option: Any) -> set[str]:
    logger = RecordingLogger()
    with SpectralTracker(
        model,
        writers=[logger],
        figures=False,
        svd_method="svdvals",
        roles_from_first_forward=option,
        alerts=None,
    ) as tracker:
        model(**batch)
        tracker.step(1)
    return {tag for _, metrics in logger.records for tag in metrics}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "nanogpt"])
def test_the_logged_names_are_those_of_the_names_alone(name: str) -> None:
    torch.manual_seed(0)
    model, batch = _named_model(name)
    tags = {option: _logged_tags(model, batch, option) for option in (False, "auto", True)}
    spectral = {tag for tag in tags[False] if tag.startswith("spectral_stable_rank/")}
    assert len(spectral) >= 12, sorted(tags[False])
    assert tags["auto"] == tags[False]
    assert tags[True] == tags[False]  # the forward alone gives the same tags
