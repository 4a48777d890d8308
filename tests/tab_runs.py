"""Runs of different models, written by the package itself, for the SPECTRAL tab's tests.

Each function writes one run directory under ``logdir`` (a short fit of a tiny model from a
``transformers`` config, watched by ``SpectralTracker`` with ``logdir=``, or ``analyze``'s
output), so the tab reads the names, stacks, experts and alerts exactly as a user's run has
them. The models are the ones the targets tests build (test_targets_stacks.py, test_experts.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spectral_callbacks import SpectralTracker
from spectral_callbacks.monitor.alerts import AlertRules

STEPS = 6  # snapshots at 0, 2, 4, 6
_MADE: dict[str, object] = {}


def _fit(model: torch.nn.Module, logdir: Path, vocab: int = 64) -> None:
    """``STEPS`` AdamW steps on random tokens, a snapshot every 2 (the tracker's own writer)."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with SpectralTracker(
        model,
        logdir=logdir,
        every_n_steps=2,
        log_spaced_until=0,
        synchronous=True,
        figures=False,
    ) as tracker:
        for step in range(1, STEPS + 1):
            tokens = torch.randint(0, vocab, (2, 8))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)


def several_models(factory: object) -> tuple[Path, list]:
    """Under ``<root>/tb``, made once per session (``factory`` is pytest's ``tmp_path_factory``):
    ``1-gpt2`` a decoder-only fit, ``2-t5`` an encoder-decoder fit, ``3-mixtral`` a
    mixture-of-experts fit, ``4-analyzed`` ``analyze``'s one snapshot, ``5-alerts`` a run that
    raised two alerts; and those alerts, as ``on_alert`` got them."""
    if "root" not in _MADE:
        from transformers import GPT2Config, GPT2LMHeadModel

        root = factory.mktemp("several_models")  # type: ignore[attr-defined]
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        _fit(GPT2LMHeadModel(config), root / "tb" / "1-gpt2")
        encoder_decoder_run(root / "tb" / "2-t5")
        mixture_of_experts_run(root / "tb" / "3-mixtral")
        analyzed_run(root / "tb" / "4-analyzed", root / "gpt2-model")
        _MADE["alerts"] = alerts_run(root / "tb" / "5-alerts")
        _MADE["root"] = root
    return _MADE["root"] / "tb", _MADE["alerts"]  # type: ignore[operator, return-value]


def encoder_decoder_run(logdir: Path) -> Path:
    """A T5 of 2 encoder and 3 decoder blocks: stacks ``enc`` and ``dec``, cross-attention."""
    from hf_models import t5

    torch.manual_seed(0)
    model = t5()
    model.config.decoder_start_token_id = model.config.pad_token_id = 0  # labels shift right
    _fit(model, logdir)
    return logdir


def mixture_of_experts_run(logdir: Path) -> Path:
    """A Mixtral of 3 layers x 4 experts: the experts' roles as mean, min and max."""
    from hf_models import mixtral

    torch.manual_seed(0)
    _fit(mixtral(), logdir)
    return logdir


def analyzed_run(logdir: Path, model_dir: Path) -> Path:
    """``spectral-callbacks analyze`` of a saved 3-layer GPT-2: one snapshot, at step 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from spectral_callbacks.cli.main import main

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(model_dir)
    assert main(["analyze", str(model_dir), "--logdir", str(logdir)]) == 0
    return logdir


def alerts_run(logdir: Path) -> list:
    """An encoder layer whose MLP weights are scaled up between snapshots: ``sigma_growth``
    alerts at steps 2 and 3 (rules armed from step 0, a window of 1 step); returns the alerts."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    rules = AlertRules(after_step=0, window=1)
    raised: list = []
    with SpectralTracker(
        model,
        logdir=logdir,
        figures=False,
        synchronous=True,
        alerts=rules,
        on_alert=raised.append,
    ) as tracker:
        tracker.step(1)
        with torch.no_grad():
            model.linear1.weight.mul_(4.0)  # sigma_1 x4 (> 3x)
        tracker.step(2)
        with torch.no_grad():
            model.linear2.weight.mul_(5.0)
        tracker.step(3)
    return raised


def circuits_run(logdir: Path, steps: int = 8) -> Path:
    """The example GPT with grouped-query attention (3 layers, 4 query heads over 2 K/V groups)
    watched with ``circuits=True`` at each of ``steps`` snapshots (0 .. steps - 1), its weights
    moved by fresh noise between them: each head's QK/OV metrics and their mean, min and max."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=16, attention="gqa")
    )
    with SpectralTracker(
        model,
        logdir=logdir,
        circuits=True,
        every_n_steps=1,
        log_spaced_until=0,
        synchronous=True,
        figures=False,
    ) as tracker:
        for step in range(1, steps):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=0.05)
            tracker.step(step)
    return logdir
