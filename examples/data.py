"""Byte-level training text that needs no download: the Python standard library's own source.

Any machine that runs these examples has Python, so its standard library (every ``*.py`` file
below ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages``: about 30 MB of real, varied
text for CPython 3.11) is a corpus that is always there. Bytes are the tokens (vocabulary 256), so there is no tokenizer to fetch either.
Pass ``text=`` to train on a file of your own instead.

Example::

    >>> data = load_bytes(max_bytes=1000)
    >>> data.dtype, data.numel()
    (torch.uint8, 1000)
    >>> x, y = next(iter(RandomWindows(data, block_size=8, seed=0)))
    >>> x.shape, bool((x[1:] == y[:-1]).all())
    (torch.Size([8]), True)
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import IterableDataset


def stdlib_sources() -> list[Path]:
    """The ``*.py`` files of the running Python's standard library, sorted by path.

    Installed packages (``site-packages``, ``dist-packages``) are left out: they differ between
    machines, and the same seed should see the same bytes everywhere the Python version agrees.
    """
    sources = []
    for directory, subdirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [name for name in subdirs if name not in ("site-packages", "dist-packages")]
        sources += [Path(directory, name) for name in files if name.endswith(".py")]
    return sorted(sources)


def load_bytes(text: str | Path | None = None, max_bytes: int | None = None) -> Tensor:
    """The training text as a 1-D ``uint8`` tensor of bytes.

    Args:
        text: a file to read; ``None`` (default) reads the standard library's sources, in path
            order, joined by blank lines.
        max_bytes: keep only the first ``max_bytes`` bytes; ``None`` (default) keeps all.

    Raises:
        FileNotFoundError: ``text`` does not exist.
        ValueError: fewer than 2 bytes of text, or ``max_bytes`` is not positive.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"`max_bytes` must be a positive int or None, got {max_bytes}")
    if text is None:
        parts, size = [], 0
        for path in stdlib_sources():  # read only as many files as max_bytes needs
            parts.append(path.read_bytes())
            size += len(parts[-1]) + 2
            if max_bytes is not None and size >= max_bytes:
                break
        raw = b"\n\n".join(parts)
    else:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(
                f"`text` file {str(path)!r} not found: pass an existing text file or omit it"
            )
        raw = path.read_bytes()
    raw = raw[:max_bytes] if max_bytes is not None else raw
    if len(raw) < 2:
        raise ValueError(
            f"the training text has {len(raw)} bytes; it needs at least 2 (input and target)"
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class RandomWindows(IterableDataset):
    """An endless stream of ``(x, y)`` windows at random offsets, ``y`` being ``x`` shifted by one.

    Sampling is seeded, so two runs with the same seed see the same bytes in the same order
    (nanoGPT's ``get_batch``, as a dataset the Lightning Trainer can batch).

    Args:
        data: 1-D ``uint8`` bytes from ``load_bytes``.
        block_size: window length in bytes.
        seed: seed of the offsets (default 0).

    Raises:
        ValueError: the text is not longer than ``block_size``.
    """

    def __init__(self, data: Tensor, block_size: int, seed: int = 0) -> None:
        if data.numel() <= block_size:
            raise ValueError(
                f"the text has {data.numel()} bytes, not more than `block_size` ({block_size}): "
                "use a longer text or a smaller block size"
            )
        self.data, self.block_size, self.seed = data, block_size, seed

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        generator = torch.Generator().manual_seed(self.seed)
        high = self.data.numel() - self.block_size
        while True:
            start = int(torch.randint(high, (1,), generator=generator))
            window = self.data[start : start + self.block_size + 1].long()
            yield window[:-1], window[1:]
