"""Fine-tune a small Llama-shaped model with LoRA and watch the spectrum of the update.

``python examples/lora_finetune.py --logdir runs/lora [--steps 120] [--r 8] [--dora] [--rslora]
[--rank-pattern ranks.json]``

The base model is first trained briefly on one synthetic task (a fixed random permutation of the
vocabulary: predict ``perm[x]``), then wrapped with LoRA (r on q, k, v, o, gate, up, down) and
fine-tuned on a second one (another permutation), with ``SpectralTracker`` after every optimizer
step. The tracker logs each adapted matrix's effective weight under the usual names and its update
``ΔW = s B A`` under ``spectral_update_*``. Then::

    spectral-callbacks plot runs/lora --kind update-rank -o update_rank.png
    spectral-callbacks plot runs/lora --kind layer-steps --role V -o update_sr_V.png
    spectral-callbacks rank-layers runs/lora --lora --json ranks.json   # the r each module needs
    python examples/lora_finetune.py --logdir runs/lora-ranked --rank-pattern ranks.json

The last line fine-tunes again with the ``rank_pattern`` and ``alpha_pattern`` rank-layers printed
(read from its JSON), so the two losses can be compared; each run ends by printing its loss on
held-out sequences of the second task and its number of adapter parameters.

No network: the model is built from a config, the data is synthetic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from spectral_callbacks import SpectralTracker, find_targets, format_targets

VOCAB, LENGTH = 128, 32


def batches(permutation: torch.Tensor, steps: int, size: int, seed: int) -> list[torch.Tensor]:
    """Sequences x, perm[x], perm[perm[x]], ...: each next token is the permutation of the last."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = [torch.randint(0, VOCAB, (size,), generator=generator)]
        for _ in range(LENGTH - 1):
            tokens.append(permutation[tokens[-1]])
        out.append(torch.stack(tokens, dim=1))  # (size, LENGTH)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=120, help="LoRA optimizer steps")
    parser.add_argument(
        "--base-steps", type=int, default=60, help="steps of the base's pretraining"
    )
    parser.add_argument("--r", type=int, default=8, help="LoRA rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dora", action="store_true", help="DoRA instead of LoRA")
    parser.add_argument("--rslora", action="store_true", help="scaling alpha / sqrt(r)")
    parser.add_argument(
        "--rank-pattern",
        type=Path,
        default=None,
        help="rank-layers --lora --json output: its rank_pattern and alpha_pattern for LoraConfig",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    first, second = (torch.randperm(VOCAB, generator=generator) for _ in range(2))

    # 1. A base that knows the first task (dense training, not watched).
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for tokens in batches(first, args.base_steps, 16, seed=2):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    # 2. LoRA on every projection; only the adapters train.
    lora = LoraConfig(
        r=args.r,
        lora_alpha=2 * args.r,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        lora_dropout=0.0,
        use_dora=args.dora,
        use_rslora=args.rslora,
        **patterns(args.rank_pattern),
    )
    model = get_peft_model(model, lora)
    print(format_targets(find_targets(model)).split("\nnot watched:")[0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    with SpectralTracker(model, logdir=args.logdir, every_n_steps=10) as tracker:
        for step, tokens in enumerate(batches(second, args.steps, 16, seed=3), start=1):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
            if step % 20 == 0:
                print(f"step {step}: loss {loss.item():.3f}")
    with torch.no_grad():  # held-out sequences of the second task (another seed)
        held_out = [model(input_ids=t, labels=t).loss.item() for t in batches(second, 8, 16, 4)]
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"held-out loss {sum(held_out) / len(held_out):.4f}; {trained:,} adapter parameters")


def patterns(path: Path | None) -> dict[str, dict]:
    """``rank_pattern`` and ``alpha_pattern`` from ``rank-layers --lora --json``'s file."""
    if path is None:
        return {}
    saved = json.loads(path.read_text())
    return {"rank_pattern": saved["rank_pattern"], "alpha_pattern": saved["alpha_pattern"]}


if __name__ == "__main__":
    main()
