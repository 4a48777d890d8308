"""What recording the first training forward costs in memory, with activation checkpointing and without.

``python benchmarks/recording_memory.py [--smoke]``: per model, the bytes of tensors alive (every
tensor object the interpreter tracks, counted once per storage: activations held by Python or
saved by autograd; a gradient not yet read from Python has no object and is not counted) above
those alive before the forward, measured with the cyclic garbage collector off (so nothing is
freed that reference counting alone would not free):

* ``inside``: in the forward, at the head's input (the last block done, the record still open);
* ``end``: when the forward has returned (the roles read, the record released);
* ``backward``: after ``loss.backward()``, the loss and the logits dropped;

for one training step without a tracker, and with a ``SpectralTracker`` made before it under each
``roles_from_first_forward`` (``False``: the names alone, no recording; ``"auto"``: the names,
checked by the recorded forward; ``True``: the recorded forward decides), each with the time of
that first forward and backward (the tracker's construction not included; with ``True`` the
step-0 snapshot and its SVD run when the forward returns, so inside that time, where ``False``
and ``"auto"`` take them at construction). Models: a Hugging Face
Llama built from a config (4 layers x 256 wide) with ``gradient_checkpointing_enable`` non-reentrant
and reentrant at 2 x 512 and 2 x 1024 tokens, and the 12 x 768 nanoGPT of ``examples/gpt.py``
without checkpointing at 2 x 256. The SVD of the step-0 snapshot runs inline (``synchronous``),
so no worker thread allocates while a point is measured. ``--tokens``, ``--llama LAYERS WIDTH``
and ``--gpt LAYERS WIDTH TOKENS`` change the sizes; ``--smoke``: toy sizes, seconds long.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]
import smoke  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from tensor_memory import bytes_alive, collector_off  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402

VOCAB = 512
FOLLOW: tuple[Any, ...] = (False, "auto", True)


class _Discard:
    """A writer that drops what it is given (only the measurement matters here)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


def hf_llama(layers: int, width: int, tokens: int, reentrant: bool) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 128 or 1,
        vocab_size=VOCAB,
        max_position_embeddings=tokens,
    )
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model, model.lm_head


def nanogpt(layers: int, width: int, tokens: int) -> Any:
    config = GPTConfig(
        n_layer=layers, n_head=width // 64, n_embd=width, block_size=tokens, vocab_size=VOCAB
    )
    model = GPT(config)
    return model, model.lm_head


def measure(build: Callable[[], Any], batch: int, tokens: int, follow: Any) -> dict[str, float]:
    """One training step of a fresh model (the same weights each time): bytes above the start
    at each point, and the step's seconds. ``follow`` is ``None`` for no tracker."""
    torch.manual_seed(0)
    model, head = build()
    model.train()
    ids = torch.randint(0, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(1))
    with collector_off():
        tracker = None
        if follow is not None:
            tracker = SpectralTracker(
                model, writers=[_Discard()], roles_from_first_forward=follow, synchronous=True
            )
        start = bytes_alive()
        inside: list[int] = []
        head.register_forward_pre_hook(lambda module, args: inside.append(bytes_alive()))
        began = time.perf_counter()
        out = model(ids)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        end = bytes_alive()
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        del out, logits
        loss.backward()
        del loss
        seconds = time.perf_counter() - began
        after = bytes_alive()
        if tracker is not None:
            tracker.close()
    return {
        "inside": (inside[0] - start) / 2**20,
        "end": (end - start) / 2**20,
        "backward": (after - start) / 2**20,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--llama", type=int, nargs=2, default=[4, 256], help="layers, width")
    parser.add_argument(
        "--gpt", type=int, nargs=3, default=[12, 768, 256], help="layers, width, tokens"
    )
    args = smoke.parse_args(parser, argv, tokens=[64], llama=[2, 128], gpt=[2, 128, 32])
    torch.set_num_threads(1)
    layers, width = args.llama
    cases: list[tuple[str, Callable[[], Any], int, int]] = []
    for tokens in args.tokens:
        for reentrant in (False, True):
            kind = "reentrant" if reentrant else "non-reentrant"
            cases.append(
                (
                    f"HF Llama {layers} x {width}, {kind} checkpointing",
                    lambda tokens=tokens, reentrant=reentrant: hf_llama(
                        layers, width, tokens, reentrant
                    ),
                    2,
                    tokens,
                )
            )
    gpt_layers, gpt_width, gpt_tokens = args.gpt
    cases.append(
        (
            f"nanoGPT {gpt_layers} x {gpt_width}, no checkpointing",
            lambda: nanogpt(gpt_layers, gpt_width, gpt_tokens),
            2,
            gpt_tokens,
        )
    )
    print(
        "| model | batch x tokens | tracker | MiB alive inside the forward | at its end "
        "| after the backward | forward + backward s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, build, batch, tokens in cases:
        for follow in (None, *FOLLOW):
            got = measure(build, batch, tokens, follow)
            label = "none" if follow is None else f"`{follow!r}`".replace("'", '"')
            print(
                f"| {name} | {batch} x {tokens} | {label} | {got['inside']:.1f} | {got['end']:.1f} "
                f"| {got['backward']:.1f} | {got['seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
