"""Figures rendered in a child process: PNGs back, errors re-raised, a dead child restarted."""

from __future__ import annotations

import io
from typing import Any

import pandas as pd
import pytest
from matplotlib.image import imread

from spectral_callbacks.monitor.dashboards import add_pngs
from spectral_callbacks.monitor.figure_process import FigureProcess, png_size


def _rows() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "run": "r",
                "step": step,
                "metric": metric,
                "layer": layer,
                "depth": layer / 2,
                "role": "Q",
                "value": 1.0 + step + layer,
                "wall_time": 0.0,
            }
            for step in (0, 10, 20)
            for layer in range(3)
            for metric in ("stable_rank", "alpha", "compression")
        ]
    )


def test_the_child_renders_every_figure_and_survives_an_error_and_a_death() -> None:
    process = FigureProcess()
    try:
        pngs = process.render(_rows(), ("Q",))
        assert "spectral_figures/compression_wave/Q" in pngs
        for png in pngs.values():
            width, height = png_size(png)
            assert imread(io.BytesIO(png), format="png").shape[:2] == (height, width)
        with pytest.raises(RuntimeError, match="KeyError|metric"):
            process.render(pd.DataFrame({"nothing": [1.0]}), ("Q",))
        assert process.render(_rows(), ("Q",)).keys() == pngs.keys()  # still serving
        process._child.kill()  # type: ignore[union-attr]
        process._child.wait()  # type: ignore[union-attr]
        assert process.render(_rows(), ("Q",)).keys() == pngs.keys()  # restarted
    finally:
        process.close()


class _ImageOnlyWriter:
    """A writer without an event-file writer: gets decoded pixels through add_image."""

    def __init__(self) -> None:
        self.images: list[tuple[str, Any, int]] = []

    def add_image(self, tag: str, pixels: Any, global_step: int, dataformats: str) -> None:
        self.images.append((tag, pixels.shape, global_step, dataformats))


def test_a_writer_without_an_event_file_writer_gets_add_image() -> None:
    process = FigureProcess()
    try:
        pngs = process.render(_rows(), ("Q",))
    finally:
        process.close()
    writer = _ImageOnlyWriter()
    add_pngs([writer], pngs, step=20)
    assert len(writer.images) == len(pngs)
    tag, shape, step, layout = writer.images[0]
    width, height = png_size(pngs[tag])
    assert shape[:2] == (height, width) and step == 20 and layout == "HWC"
