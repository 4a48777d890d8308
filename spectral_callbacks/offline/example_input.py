"""An example input for one forward of a model at rest, so its roles can be read from the forward.

``spectral-callbacks targets`` and ``analyze`` take ``--example-input``: ``auto`` builds a batch
from the model's configuration (token ids below ``vocab_size``; decoder ids for an encoder-decoder;
pixel values of ``image_size`` for a vision tower; mel features for a speech encoder), and a path
reads a batch saved with ``torch.save`` (a tensor, a tuple of positional arguments or a dict of
keyword arguments). The values do not matter - only which weights the forward multiplies them by.

Example::

    >>> import torch
    >>> class Tiny(torch.nn.Module):
    ...     class config:
    ...         vocab_size = 50
    >>> batch = example_input(Tiny(), "auto")  # not a Hugging Face model: the token ids alone
    >>> batch.shape, int(batch.max()) < 50
    (torch.Size([1, 8]), True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["ExampleInputError", "example_input"]

_TOKENS = 8  # enough for every attention call to run; short enough to cost nothing


class ExampleInputError(ValueError):
    """No example input could be built or read (the message says what to pass instead)."""


def example_input(model: nn.Module, spec: str) -> Any:
    """The batch ``spec`` names for ``model``: ``"auto"`` (from its config) or a saved file.

    Raises:
        ExampleInputError: ``auto`` for a model whose config says nothing of its inputs, or a
            file that does not exist or does not hold a tensor, tuple or dict.
    """
    if spec != "auto":
        path = Path(spec)
        if not path.is_file():
            raise ExampleInputError(
                f"--example-input {spec!r}: no such file; give 'auto' or a file saved with "
                "torch.save(batch, path) (a tensor, a tuple of arguments or a dict of keyword "
                "arguments)"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(saved, (torch.Tensor, tuple, list, dict)):
            raise ExampleInputError(
                f"--example-input {spec!r} holds a {type(saved).__name__}; save a tensor, a tuple "
                "of arguments or a dict of keyword arguments"
            )
        return tuple(saved) if isinstance(saved, list) else saved
    config = getattr(model, "config", None)
    generator = torch.Generator().manual_seed(0)
    batch: dict[str, torch.Tensor] = {}
    text = getattr(config, "text_config", config)
    vision = getattr(config, "vision_config", None) or getattr(config, "encoder", None)
    vocab = getattr(text, "vocab_size", None)
    image = getattr(vision if vision is not None else config, "image_size", None)
    mels = getattr(config, "num_mel_bins", None)
    if isinstance(mels, int):
        frames = 2 * int(getattr(config, "max_source_positions", _TOKENS))
        batch["input_features"] = torch.randn(1, mels, frames, generator=generator)
    elif isinstance(image, int):
        channels = int(getattr(vision if vision is not None else config, "num_channels", 3))
        batch["pixel_values"] = torch.randn(1, channels, image, image, generator=generator)
    if isinstance(vocab, int) and "input_features" not in batch:
        ids = torch.randint(0, vocab, (1, _TOKENS), generator=generator)
        if "pixel_values" not in batch or getattr(config, "text_config", None) is not None:
            batch["input_ids"] = ids
    decoder = getattr(config, "decoder", None)
    decoder_vocab = getattr(decoder, "vocab_size", vocab)
    if getattr(config, "is_encoder_decoder", False) and isinstance(decoder_vocab, int):
        batch["decoder_input_ids"] = torch.randint(
            0, decoder_vocab, (1, _TOKENS // 2), generator=generator
        )
    if not batch:
        raise ExampleInputError(
            f"--example-input auto: the {type(model).__name__}'s config names no vocab_size, "
            "image_size or num_mel_bins to build a batch from; save one with "
            "torch.save(batch, 'batch.pt') and pass --example-input batch.pt"
        )
    if getattr(config, "model_type", None) is None and list(batch) == ["input_ids"]:
        return batch["input_ids"]  # not a Hugging Face model: its forward takes the tokens
    return batch
