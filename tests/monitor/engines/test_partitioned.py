"""How FSDP1 and ZeRO-3 parameters are recognised, and what a gather cannot serve yet.

FSDP1 runs for real (2 gloo processes on the CPU) in tests/integrations/test_fsdp1.py, ZeRO-3
(the Hugging Face Trainer with DeepSpeed's CPU accelerator) in tests/integrations/test_deepspeed.py.
Here, without processes: parameters that carry the attributes DeepSpeed documents for a ZeRO-3
partitioned parameter (``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``) are taken for ZeRO-3,
and the kinds of target a gather cannot serve are refused in one line.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyGPT

from spectral_callbacks.monitor.engines.partitioned import ZERO3, Zero3Gathering, partitioning
from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.targets import find_targets


def zero3_marked(model: torch.nn.Module) -> torch.nn.Module:
    """DeepSpeed's marks on each parameter, as ZeRO-3 leaves them (the values kept: no gather)."""
    for number, parameter in enumerate(model.parameters()):
        parameter.ds_id, parameter.ds_status = number, "NOT_AVAILABLE"  # ZeroParamStatus
        parameter.ds_numel, parameter.ds_shape = parameter.numel(), parameter.shape
    return model


def test_zero3_marks_are_recognised_and_an_ordinary_model_is_not() -> None:
    # FSDP2 (DTensor) models pass too: test_sharded_frontends.py builds trackers on them.
    model = TinyGPT(n_layer=2, n_embd=32, n_head=2)
    assert partitioning(model) is None
    next(model.parameters()).ds_id = 0  # one attribute alone is not ZeRO-3's set
    assert partitioning(model) is None
    assert partitioning(zero3_marked(model)) == ZERO3


def test_zero3_units_are_the_blocks_and_count_the_full_bytes_they_gather() -> None:
    model = zero3_marked(TinyGPT(n_layer=3, n_embd=32, n_head=2))
    targets = find_targets(model)
    units = Zero3Gathering(model).units(targets)
    assert [sorted({t.layer for t in unit.targets}) for unit in units] == [[0], [1], [2]]
    for unit in units:  # every watched parameter of the block, once, at its full size
        read = {id(t.parameter): t.parameter for t in unit.targets}.values()
        assert unit.gathered_bytes == sum(p.numel() * p.element_size() for p in read)


def test_adapted_layers_under_a_gather_are_refused_in_one_line() -> None:
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = peft.get_peft_model(
        GPT2LMHeadModel(config), peft.LoraConfig(r=2, target_modules=["c_attn"])
    )
    gathering = Zero3Gathering(zero3_marked(model))
    with pytest.raises(ConfigurationError) as refused:
        gathering.check(find_targets(model), "SpectralTracker")
    message = str(refused.value)
    assert message.startswith("SpectralTracker cannot watch a model trained with DeepSpeed ZeRO-3")
    assert "is an adapted layer" in message and "fully_shard" in message and "\n" not in message
