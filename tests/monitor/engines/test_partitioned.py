"""How FSDP1 and ZeRO-3 parameters are recognised, and how an adapted layer is snapshotted in a gather.

FSDP1 runs for real (2 gloo processes on the CPU) in tests/integrations/test_fsdp1.py, ZeRO-3
(the Hugging Face Trainer with DeepSpeed's CPU accelerator) in tests/integrations/test_deepspeed.py.
Here, without processes: parameters that carry the attributes DeepSpeed documents for a ZeRO-3
partitioned parameter (``ds_id``, ``ds_status``, ``ds_numel``, ``ds_shape``) are taken for ZeRO-3,
and an adapted layer's snapshot inside a gather copies its base (whole only there).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import TinyGPT

from spectral_callbacks.monitor.engines.partitioned import (
    ZERO3,
    Zero3Gathering,
    held_in_gathers,
    partitioning,
)
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


def test_adapted_layers_under_a_gather_copy_their_base_and_count_it() -> None:
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    lora = peft.LoraConfig(
        r=2, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False
    )  # random B: a non-zero update
    model = peft.get_peft_model(GPT2LMHeadModel(config), lora)
    found = find_targets(zero3_marked(model))
    held = held_in_gathers(found)
    adapted = [(t, h) for t, h in zip(found, held, strict=True) if t.adapter_layer() is not None]
    assert len(adapted) == 6  # Q, K, V of each block
    for target, in_gather in adapted:
        m, n = target.shape
        elsewhere, inside = (type(t).stack_batch([t]) for t in (target, in_gather))
        live = target.parameter.untyped_storage().data_ptr()
        # Elsewhere the frozen base is referenced; inside a gather (whole only there) copied ...
        assert elsewhere.bases[0].untyped_storage().data_ptr() == live
        assert inside.bases[0].untyped_storage().data_ptr() != live
        assert target.snapshot_bytes() == (2 * m + 2 * n) * 4
        assert in_gather.snapshot_bytes() == (m * n + 2 * m + 2 * n) * 4  # ... and counted
        # ... and the copy is the same effective weight, W_0 + s B A
        expected = elsewhere.dense(torch.float64)[0]
        assert torch.equal(inside.dense(torch.float64)[0], expected)
        layer = target.adapter_layer()
        update = layer.scaling["default"] * (
            layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
        )
        base = target.parameter.detach().double().t()  # Conv1D: (in, out)
        rows = slice(target.rows.start, target.rows.stop)
        torch.testing.assert_close(expected, (base + update)[rows], rtol=1e-6, atol=1e-6)
