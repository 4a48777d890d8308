"""Models whose parameters no rank holds a matrix of are refused by every frontend, with one message.

FSDP1 is tested for real (2 gloo processes on the CPU) in tests/integrations/test_sharded_frontends.py. DeepSpeed
is not installed here, so ZeRO-3 is tested the only honest way available: parameters that carry the
attributes DeepSpeed documents for a ZeRO-3 partitioned parameter (``ds_id``, ``ds_status``,
``ds_numel``, ``ds_shape``) and are emptied as ZeRO-3 empties them; a real DeepSpeed run is not.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tiny_models import TinyGPT

from spectral_callbacks import SpectralTracker
from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.engines.partitioned import partitioning
from spectral_callbacks.monitor.options import ConfigurationError


def zero3_partitioned(model: torch.nn.Module) -> torch.nn.Module:
    """What ZeRO-3 leaves of each parameter on a rank: an empty tensor with DeepSpeed's marks."""
    for number, parameter in enumerate(model.parameters()):
        parameter.ds_id, parameter.ds_status = number, "NOT_AVAILABLE"  # ZeroParamStatus
        parameter.ds_numel, parameter.ds_shape = parameter.numel(), parameter.shape
        parameter.data = torch.empty(0)
    return model


def test_the_tracker_refuses_zero3_partitioned_parameters_naming_fully_shard() -> None:
    model = zero3_partitioned(TinyGPT(n_layer=2, n_embd=32, n_head=2))
    with pytest.raises(
        ConfigurationError,
        match=r"^SpectralTracker cannot watch a model trained with DeepSpeed ZeRO-3: .*fully_shard"
        r".*`spectral-callbacks analyze`\.$",
    ):
        SpectralTracker(model, figures=False)


def test_the_hugging_face_callback_refuses_zero3_at_train_begin(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    model = zero3_partitioned(TinyGPT(n_layer=2, n_embd=32, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ConfigurationError, match="^SpectralTrainerCallback cannot watch .*ZeRO-3"):
        SpectralTrainerCallback(figures=False).on_train_begin(
            args, TrainerState(), TrainerControl(), model=model
        )


def test_lightning_and_the_tracker_say_the_same_thing() -> None:
    trainer = SimpleNamespace(strategy=FSDPStrategy(), world_size=2, loggers=[object()])
    with pytest.raises(MisconfigurationException) as lightning:
        SpectralMonitor().setup(trainer, TinyGPT(), "fit")
    with pytest.raises(ConfigurationError) as tracker:
        SpectralTracker(zero3_partitioned(TinyGPT()), figures=False)
    # Only the caller and the scheme differ: "<caller> cannot watch ... with <scheme>: <reason>".
    assert str(lightning.value).split(": ", 1)[1] == str(tracker.value).split(": ", 1)[1]


def test_an_ordinary_model_is_not_taken_for_a_partitioned_one() -> None:
    # FSDP2 (DTensor) models pass too: test_sharded_frontends.py builds trackers on them.
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2)
    assert partitioning(model) is None
    next(model.parameters()).ds_id = 0  # one attribute alone is not ZeRO-3's set
    assert partitioning(model) is None
