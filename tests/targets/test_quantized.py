"""bitsandbytes-quantized layers (QLoRA 4-bit NF4 / FP4 with and without double quantization,
8-bit LLM.int8()): the matrix a snapshot reads is the one the layer computes with.

The reference is each layer's own forward on the identity, in float64: ``forward(I) - forward(0)``
(its bias taken out), transposed to ``(out, in)``, with the LoRA's dropout off; the logged values
are checked against a float64 SVD of it. The models stand for a checkpoint: a tiny Llama with
non-zero biases, saved to a temporary directory and loaded back by ``from_pretrained`` with a
``BitsAndBytesConfig`` (bitsandbytes' CPU backend quantizes it; no hub is reached), then wrapped by
PEFT LoRA on some of its projections, as a QLoRA fine-tune is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from hf_models import tiny_llama  # noqa: E402
from tiny_models import RecordingLogger, assert_logged_exactly, exact_spectrum  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402
from spectral_callbacks.targets.adapted import AdaptedTarget  # noqa: E402
from spectral_callbacks.targets.quantized import QuantizedTarget  # noqa: E402

FORMATS = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "nf4-double": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    },
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
    "fp4-double": {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "fp4",
        "bnb_4bit_use_double_quant": True,
    },
    "int8": {"load_in_8bit": True},
}
FOUR_BIT = [name for name in FORMATS if name != "int8"]
ADAPTED = ["q_proj", "v_proj", "down_proj"]  # the others stay quantized bases without adapters
ROLES = {"Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down"}
WIDTH = 128  # two 4-bit blocks of 64 per row: a block scale read out of order shows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with non-zero biases (as every checkpoint's q/k/v/MLP), saved to disk."""
    torch.manual_seed(0)
    model = tiny_llama(width=WIDTH, bias=True)
    path = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(path)
    return path


def qlora(checkpoint: Path, fmt: str, compute: torch.dtype = torch.float32) -> Any:
    """The checkpoint loaded quantized as ``fmt`` and wrapped with LoRA on :data:`ADAPTED`
    (B away from zero, dropout on), in train mode, as a QLoRA fine-tune starts."""
    quantization = transformers.BitsAndBytesConfig(**FORMATS[fmt], bnb_4bit_compute_dtype=compute)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=quantization, device_map="cpu"
    )
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=ADAPTED, lora_dropout=0.1, init_lora_weights=False
    )
    return peft.get_peft_model(model, config).train()


def watched(model: Any) -> list[Any]:
    """``find_targets(model)``, asserting that nothing quantized was refused."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(model)
    refused = [str(w.message) for w in caught if "quantized" in str(w.message)]
    assert refused == []
    return list(targets)


def layer_of(target: Any) -> torch.nn.Module:
    """The module whose forward computes the target's matrix: the LoRA layer of an adapted
    target, the quantized layer itself otherwise."""
    return target.layer_module


def computed(target: Any, device: str = "cpu") -> torch.Tensor:
    """``forward(I) - forward(0)`` of the target's layer, float64 ``(out, in)``, dropout off.

    The product runs in float32: a bfloat16 compute dtype (QLoRA's) rounds the dequantized matrix
    and the output to bfloat16 in each product, as autocast does a float32 weight; the matrix
    is the one the layer's state holds (the layer is put back as it was).
    """
    layer = layer_of(target)
    base = layer.get_base_layer() if isinstance(target, AdaptedTarget) else layer
    dropouts = [m for m in layer.modules() if isinstance(m, torch.nn.Dropout)]
    modes = [m.training for m in dropouts]
    for dropout in dropouts:
        dropout.eval()  # the layer itself stays in train mode, as during the fit
    compute = getattr(base, "compute_dtype", None)  # 4-bit layers have one
    if compute is not None:
        base.compute_dtype = torch.float32
    try:
        with torch.no_grad():
            n = target.shape[1]
            eye = torch.eye(n, device=device)
            out = layer(eye).double() - layer(torch.zeros_like(eye[:1])).double()
    finally:
        if compute is not None:
            base.compute_dtype = compute
        for dropout, mode in zip(dropouts, modes, strict=True):
            dropout.train(mode)
    return out.T


def snapshot(target: Any) -> torch.Tensor:
    """The effective matrix the package snapshots for ``target``, float64."""
    batch = target.stack_batch([target])
    if isinstance(batch, torch.Tensor):
        return batch[0].double()
    return batch.dense(torch.float64)[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_quantized_layer_is_watched_as_the_matrix_its_forward_computes(
    checkpoint: Path, fmt: str
) -> None:
    model = qlora(checkpoint, fmt)
    targets = watched(model)
    assert {t.role for t in targets} == ROLES and len(targets) == 2 * len(ROLES)
    for target in targets:
        adapted = target.parameter_name.split(".")[-3] in ADAPTED
        assert isinstance(target, AdaptedTarget if adapted else QuantizedTarget), target.name
        layer = layer_of(target)
        base = layer.get_base_layer() if adapted else layer
        assert target.shape == (base.out_features, base.in_features)
        expected = computed(target)
        scale = float(expected.abs().max())
        assert torch.allclose(snapshot(target), expected, rtol=0, atol=1e-5 * scale), target.name
        assert target.snapshot_bytes() > 0


@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_a_4bit_weight_repacked_by_an_eval_forward_is_read_as_its_kernel_multiplies(
    checkpoint: Path, fmt: str
) -> None:
    # bitsandbytes' CPU backend repacks a 4-bit weight at its first forward in eval mode without
    # grad on a CPU with AVX512-BF16 (an evaluation or a generation during the fit): its codes
    # regrouped for the kernel, its block scales transposed and rounded to bfloat16. The layers
    # are told they run on such a CPU (the attribute bitsandbytes sets from has_avx512bf16()), so
    # their own forward repacks them; the kernel then multiplies by each block of the matrix with
    # its scale rounded to bfloat16, which is what a snapshot must read.
    model = qlora(checkpoint, fmt)
    targets = watched(model)  # the monitor is built first: the repacking comes mid-run
    before = {t.name: computed(t) for t in targets}  # what the layers computed until then
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    model.train()
    assert all(layer.weight.quant_state.packing_format_for_cpu for layer in layers)
    for target in targets:
        update = _update(target)
        expected = _bfloat16_scales(before[target.name] - update) + update
        scale = float(expected.abs().max())
        assert torch.allclose(snapshot(target), expected, rtol=0, atol=1e-5 * scale), target.name


def _update(target: Any) -> torch.Tensor:
    """``s B A`` of an adapted target in float64 (zero for a quantized layer without adapters)."""
    if not isinstance(target, AdaptedTarget):
        return torch.zeros(target.shape, dtype=torch.float64)
    lora = target.layer_module
    update = lora.lora_B["default"].weight.double() @ lora.lora_A["default"].weight.double()
    return lora.scaling["default"] * update.detach()


def _bfloat16_scales(matrix: torch.Tensor, blocksize: int = 64) -> torch.Tensor:
    """``matrix`` with each block's scale rounded to bfloat16. A block's scale is its largest
    magnitude: both codes (NF4, FP4) hold +-1, which the block's largest element quantizes to."""
    blocks = matrix.reshape(-1, blocksize)
    scales = blocks.abs().amax(dim=1, keepdim=True)
    return (blocks / scales * scales.bfloat16().double()).reshape(matrix.shape)


@pytest.mark.skipif(
    not bnb.functional.has_avx512bf16(), reason="needs a CPU with AVX512-BF16 (the packed kernel)"
)
@pytest.mark.parametrize("fmt", FOUR_BIT)
def test_on_a_cpu_with_avx512_bf16_a_repacked_layer_is_read_as_its_forward_computes(
    checkpoint: Path, fmt: str
) -> None:
    model = qlora(checkpoint, fmt)
    targets = [t for t in watched(model) if isinstance(t, QuantizedTarget)]
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])  # repacks every 4-bit weight (eval, no grad)
        for target in targets:
            layer = target.layer_module
            assert layer.weight.quant_state.packing_format_for_cpu
            n = target.shape[1]
            expected = (layer(torch.eye(n)).double() - layer(torch.zeros(1, n)).double()).T
            # the packed kernel rounds its output to bfloat16
            atol = 2**-8 * float(expected.abs().max())
            assert torch.allclose(snapshot(target), expected, rtol=0, atol=atol), target.name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("precision", ["float32", "bf16-autocast"])
def test_a_qlora_fit_logs_the_spectrum_of_what_each_layer_computes(
    checkpoint: Path, fmt: str, precision: str
) -> None:
    # QLoRA trains with a bfloat16 compute dtype under bf16 autocast; the reference is the
    # layer's forward on the identity outside autocast, its product in float32 (computed()).
    autocast = precision == "bf16-autocast"
    model = qlora(checkpoint, fmt, compute=torch.bfloat16 if autocast else torch.float32)
    logger = RecordingLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracker's notes on the CPU placement
        tracker = SpectralTracker(
            model, writers=[logger], every_n_steps=1, log_spaced_until=0, figures=False,
            synchronous=True,
        )  # fmt: skip
    targets = tracker.targets
    assert {t.role for t in targets} == ROLES and len(targets) == 2 * len(ROLES)
    expected = {0: {t.name: exact_spectrum(computed(t)) for t in targets}}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batches = torch.randint(0, 64, (3, 2, 16), generator=torch.Generator().manual_seed(0))
    for step, batch in enumerate(batches, start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected[step] = {t.name: exact_spectrum(computed(t)) for t in targets}
        tracker.step(step)
    tracker.close(3)
    assert sorted(expected) == [0, 1, 2, 3]
    assert_logged_exactly(logger, targets, expected, 2)
    adapted = [t for t in targets if isinstance(t, AdaptedTarget)]
    assert all(expected[3][t.name] != expected[0][t.name] for t in adapted)  # adapters trained


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_on_cuda_every_quantized_layer_is_watched_as_the_matrix_its_forward_computes(
    checkpoint: Path, fmt: str
) -> None:
    quantization = transformers.BitsAndBytesConfig(
        **FORMATS[fmt], bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=quantization, device_map="cuda:0"
    )
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=ADAPTED, lora_dropout=0.1, init_lora_weights=False
    )
    model = peft.get_peft_model(model, config).train()
    targets = watched(model)
    assert {t.role for t in targets} == ROLES
    for target in targets:
        assert target.parameter.device.type == "cuda"
        expected = computed(target, device="cuda")
        # 8-bit on CUDA multiplies in int8 and returns float16: each entry of forward(I) and
        # forward(0) rounded to 11 bits, around the bias
        layer = layer_of(target)
        base = layer.get_base_layer() if isinstance(target, AdaptedTarget) else layer
        scale = float(expected.abs().max())
        rounding = 2**-10 * (scale + float(base.bias.abs().max())) if fmt == "int8" else 0.0
        atol = 1e-5 * scale + rounding
        assert torch.allclose(snapshot(target).cpu(), expected.cpu(), rtol=0, atol=atol), (
            target.name
        )
