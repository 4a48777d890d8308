"""PEFT adapters (LoRA, DoRA, rsLoRA) as targets: found, copied as factors, measured exactly.

References are float64: the effective weight is compared with ``merge_and_unload()``'s weights
of a copy of the model, the update with PEFT's own ``get_delta_weight``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from hf_models import tiny_llama  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from tiny_models import RecordingLogger, quiet_trainer, read_scalars  # noqa: E402

from spectral_callbacks import SpectralTracker  # noqa: E402
from spectral_callbacks.functional import (  # noqa: E402
    low_rank_singular_values,
    powerlaw_alpha,
    randomized_svd,
)
from spectral_callbacks.integrations.lightning import SpectralMonitor  # noqa: E402
from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot  # noqa: E402
from spectral_callbacks.names import scalar_tag  # noqa: E402
from spectral_callbacks.targets import TargetWarning, find_targets, format_targets  # noqa: E402
from spectral_callbacks.targets.adapted import AdaptedTarget, DenseAdaptedTarget  # noqa: E402

LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_MODULES = ["c_attn", "c_proj", "c_fc"]
K = 32


def tiny_gpt2(width: int = 64, layers: int = 2) -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=width, n_layer=layers, n_head=4, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def adapted(arch: str, *, width: int = 64, random_b: bool = True, **lora: Any) -> Any:
    """A tiny model wrapped with LoRA r=8 on q, k, v, o, gate, up, down (GPT-2: c_attn, c_proj,
    c_fc with fan_in_fan_out); ``random_b`` starts B away from zero so the update is nonzero."""
    torch.manual_seed(0)
    if arch == "llama":
        model, modules, extra = tiny_llama(width), LLAMA_MODULES, {}
    else:
        model, modules, extra = tiny_gpt2(width), GPT2_MODULES, {"fan_in_fan_out": True}
    config = peft.LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=modules,
        lora_dropout=0.0,
        init_lora_weights=not random_b,
        **extra,
        **lora,
    )
    return peft.get_peft_model(model, config)


def merged_matrices(model: Any) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, role) -> float64 weight of ``merge_and_unload()`` of a copy: the reference."""
    merged = copy.deepcopy(model).merge_and_unload()
    return {(t.layer, t.role): t.matrix().double() for t in find_targets(merged)}


def deltas(model: Any) -> dict[str, torch.Tensor]:
    """Target name -> float64 ``get_delta_weight`` rows of that target, as (out, in)."""
    out = {}
    for target in find_targets(model):
        layer = target.layer_module
        delta = layer.get_delta_weight("default").detach().double()
        stored = delta  # in the base weight's stored layout (Conv1D: (in, out))
        out[target.name] = target.rows.take(stored)
    return out


VARIANTS = {
    "lora": {},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapted_layers_are_targets_with_their_roles_layers_and_rank(arch: str) -> None:
    model = adapted(arch, random_b=False)
    targets = find_targets(model)
    assert all(isinstance(t, AdaptedTarget) and t.rank == 8 for t in targets)
    assert all(t.adapters == ("default",) for t in targets)
    roles = ["Q", "K", "V", "O", "MLP_up", "MLP_down"]
    if arch == "llama":
        roles.insert(4, "MLP_gate")
    assert [(t.layer, t.role) for t in targets] == [(i, r) for i in range(2) for r in roles]
    # The same roles and shapes as the bare model's.
    bare = find_targets(model.get_base_model().__class__(model.get_base_model().config))
    assert [(t.layer, t.role, t.shape) for t in bare] == [
        (t.layer, t.role, t.shape) for t in targets
    ]
    skipped = {s.parameter_name for s in targets.skipped}
    assert any(".lora_A." in name for name in skipped)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_effective_weight_equals_merge_and_unload(arch: str, variant: str) -> None:
    model = adapted(arch, **VARIANTS[variant])
    reference = merged_matrices(model)
    for target in find_targets(model):
        expected = reference[(target.layer, target.role)]
        batch = target.stack_batch([target])
        assert torch.allclose(batch.dense(torch.float64)[0], expected, atol=1e-5, rtol=0)
        exact = expected.square().sum()
        assert float(batch.frobenius_norm_sq()[0]) == pytest.approx(float(exact), rel=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_update_singular_values_equal_svd_of_get_delta_weight(arch: str, variant: str) -> None:
    model = adapted(arch, **VARIANTS[variant])
    expected = deltas(model)
    for target in find_targets(model):
        batch = target.stack_batch([target])
        found = low_rank_singular_values(batch.ups, batch.downs)[0]
        exact = torch.linalg.svdvals(expected[target.name])[: found.shape[-1]]
        assert torch.allclose(found, exact, rtol=1e-5, atol=1e-5 * float(exact[0]))


def test_snapshot_copies_the_adapters_only_and_never_the_base() -> None:
    from torch.profiler import ProfilerActivity, profile

    model = adapted("llama", use_dora=True)
    targets = find_targets(model)
    groups = group_by_shape(targets)
    # Measured: every byte the snapshot allocates, as the profiler counts it (self allocations).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        snapshot = take_snapshot(groups, step=0)
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in profiler.events())
    copied = sum(batch.nbytes for batch in snapshot.tensors.values())
    adapters = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if "lora_" in name  # lora_A, lora_B, lora_magnitude_vector
    )
    assert copied == adapters
    assert adapters <= allocated <= adapters + 1024  # a few scalars beside the factors
    bases = {t.parameter.data_ptr() for t in targets}
    for batch in snapshot.tensors.values():
        # Each base is the live frozen parameter itself; each owned tensor is a fresh copy.
        assert {b.data_ptr() for b in batch.bases} <= bases
        assert not {o.data_ptr() for o in batch.owned} & bases
        live = {p.data_ptr() for p in model.parameters()}
        assert not {o.data_ptr() for o in batch.owned} & live
    dense = sum(t.parameter.numel() * t.parameter.element_size() for t in targets)
    assert copied < dense / 3


def test_gpt2_fused_adapter_factor_is_copied_once() -> None:
    model = adapted("gpt2")
    targets = find_targets(model)
    snapshot = take_snapshot(group_by_shape(targets), step=0)
    copied = sum(batch.nbytes for batch in snapshot.tensors.values())
    adapters = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n
    )
    assert copied == adapters


def test_a_merged_layer_is_not_added_twice() -> None:
    model = adapted("llama")
    reference = merged_matrices(model)
    model.base_model.model.model.layers[0].self_attn.q_proj.merge()
    for target in find_targets(model):
        batch = target.stack_batch([target])
        expected = reference[(target.layer, target.role)]
        assert torch.allclose(batch.dense(torch.float64)[0], expected, atol=1e-5, rtol=0)


def two_active_adapters() -> Any:
    """A tiny Llama with LoRA adapters "first" (r=8, every projection) and "second" (r=4, q and v) both
    active, B away from zero."""
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=LLAMA_MODULES, init_lora_weights=False
    )
    model = peft.get_peft_model(tiny_llama(), config, adapter_name="first")
    extra = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model.add_adapter("second", extra)
    model.base_model.set_adapter(["first", "second"])
    return model


def test_every_tensor_a_batch_of_two_active_adapters_reads_is_owned_or_a_parameter() -> None:
    model = two_active_adapters()
    targets = find_targets(model)
    assert {t.adapters for t in targets} == {("first",), ("first", "second")}
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for batch in take_snapshot(group_by_shape(targets), step=0).tensors.values():
        owned = {o.untyped_storage().data_ptr() for o in batch.owned}
        read = [
            *batch.bases,
            *batch.ups,
            *batch.downs,
            *(g for g in batch.magnitudes if g is not None),
        ]
        # What the compute stream reads is either a live parameter or a copy the batch owns
        # (record_stream marks only the owned ones: anything else could be reused by training).
        loose = [t for t in read if t.untyped_storage().data_ptr() not in owned | live]
        assert loose == []
    reference = merged_matrices(model)
    for target in targets:
        batch = target.stack_batch([target])
        assert batch.ups[0].shape[1] == target.rank == (12 if target.role in ("Q", "V") else 8)
        expected = reference[(target.layer, target.role)]
        assert torch.allclose(batch.dense(torch.float64)[0], expected, atol=1e-5, rtol=0)
        assert batch.nbytes == target.snapshot_bytes()


def forward_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The float64 (out, in) weight a tuner layer's own forward applies: f(I) - f(0), in eval mode."""
    n = layer.get_base_layer().in_features
    training = layer.training
    layer.eval()
    with torch.no_grad():
        eye = torch.eye(n, dtype=torch.float64)
        weight = (layer.double()(eye) - layer(torch.zeros_like(eye))).T
    layer.float().train(training)
    return weight


def check_watched_spectrum(target: AdaptedTarget) -> torch.Tensor:
    """The singular values the engine computes from the target's snapshot (products with its
    factors, nothing formed) against float64 SVD of what the layer's forward applies; returns that."""
    expected = forward_weight(target.layer_module)
    k = min(target.shape) // 2
    found = randomized_svd(target.stack_batch([target]), k).S[0].double()
    exact = torch.linalg.svdvals(expected)[:k]
    assert torch.allclose(found, exact, rtol=1e-4, atol=1e-6), (target.name, found, exact)
    return expected


def test_a_dora_adapter_active_beside_a_lora_adapter_is_refused_never_misread() -> None:
    """PEFT adds the second adapter's update after DoRA's rescaling, which the one magnitude
    vector of a snapshot cannot express: those layers are refused; every other is exact."""
    torch.manual_seed(0)
    dora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=LLAMA_MODULES, init_lora_weights=False, use_dora=True
    )
    model = peft.get_peft_model(tiny_llama(bias=True), dora, adapter_name="first")
    lora = peft.LoraConfig(
        r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model.add_adapter("second", lora)
    model.base_model.set_adapter(["first", "second"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(model)
    for target in targets:  # what is watched is exact (a DoRA + LoRA layer watched is not)
        check_watched_spectrum(target)
    assert [(t.layer, t.role) for t in targets if t.role in ("Q", "V")] == []
    assert any(issubclass(w.category, TargetWarning) and "DoRA" in str(w.message) for w in caught)
    refused = [
        s.reason for s in targets.skipped if s.parameter_name.endswith("proj.base_layer.weight")
    ]
    assert len(refused) == 4 and all(
        "DoRA adapter 'first' active together with others (first, second)" in r for r in refused
    )


def test_a_lora_layer_under_disable_adapter_is_watched_as_its_base() -> None:
    """PEFT's ``disable_adapter()`` (DPO's reference forward) makes each layer's forward
    ``W_0 x + b``: so is the watched matrix, for LoRA and DoRA; enabled again, the effective one."""
    torch.manual_seed(0)
    for variant in ({}, {"use_dora": True}):
        config = peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=LLAMA_MODULES, init_lora_weights=False, **variant
        )
        model = peft.get_peft_model(tiny_llama(bias=True), config)
        targets = find_targets(model)
        with model.disable_adapter():
            bases = [check_watched_spectrum(target) for target in targets]
        for target, base in zip(targets, bases, strict=True):
            torch.testing.assert_close(base, target.parameter.detach().double(), rtol=0, atol=1e-6)
            adapted = check_watched_spectrum(target)
            assert not torch.allclose(adapted, base, atol=1e-3), target.name  # a real update


def test_a_lora_layer_with_no_active_adapter_is_a_plain_target_with_a_nan_update_family() -> None:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), config)
    extra = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False)
    model.add_adapter("b", extra)
    model.base_model.set_adapter("b")  # q_proj keeps its "default" adapter, inactive now
    logger = RecordingLogger()
    tracker = SpectralTracker(
        model,
        writers=[logger],
        every_n_steps=1,
        log_spaced_until=0,
        figures=False,
        synchronous=True,
    )
    tracker.step(0)
    model.base_model.set_adapter(["default", "b"])  # active again: its update is logged again
    tracker.step(1)
    tracker.close(1)
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach()
    effective = merged_matrices(model)[(0, "Q")]
    for step, weight in ((0, base.double()), (1, effective)):
        exact = torch.linalg.svdvals(weight)
        expected = float(exact.square().sum() / exact[0] ** 2)
        found = logger.series(scalar_tag("stable_rank", 0, "Q"))[step]
        assert found == pytest.approx(expected, rel=1e-3)
    update = logger.series(scalar_tag("update_stable_rank", 0, "Q"))
    assert set(update) == {0, 1}
    assert update[0] != update[0] and update[1] == update[1]  # NaN while inactive, then a value
    assert logger.series(scalar_tag("update_rank", 0, "Q"))[1] == 8
    assert logger.series(scalar_tag("update_rank", 0, "V"))[0] == 4


# The additive tuner types without factors, each on q, k, v, o, gate, up, down of a tiny Llama
# (width 64: every in/out size is a multiple of 16, as C3A's block_size and VB-LoRA's vectors need).
DENSE_TUNERS = {
    "loha": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=LLAMA_MODULES),
    "lokr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=LLAMA_MODULES),
    "adalora": lambda: peft.AdaLoraConfig(
        init_r=6, target_r=4, total_step=100, target_modules=LLAMA_MODULES
    ),
    "vera": lambda: peft.VeraConfig(r=16, target_modules=LLAMA_MODULES),
    "randlora": lambda: peft.RandLoraConfig(r=8, target_modules=LLAMA_MODULES),
    "vblora": lambda: peft.VBLoRAConfig(
        r=4, num_vectors=32, vector_length=16, target_modules=LLAMA_MODULES
    ),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=100, target_modules=LLAMA_MODULES),
    "c3a": lambda: peft.C3AConfig(block_size=16, target_modules=LLAMA_MODULES),
    "shira": lambda: peft.ShiraConfig(r=4, target_modules=LLAMA_MODULES),
}
# The tuner types newer than peft's lower bound: the config class and the release that added it.
TUNERS_ADDED_IN = {
    "randlora": ("RandLoraConfig", "0.16"),
    "c3a": ("C3AConfig", "0.16"),
    "shira": ("ShiraConfig", "0.17"),
}


def tuners(names: Any) -> list[Any]:
    """``names`` as parameters, each skipped where this peft has no such tuner type."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not hasattr(peft, TUNERS_ADDED_IN[name][0]),
                reason=f"{name} needs peft {TUNERS_ADDED_IN[name][1]}",
            ),
        )
        if name in TUNERS_ADDED_IN
        else name
        for name in names
    ]


def dense_adapted(tuner: str, *, width: int = 64, **config: Any) -> Any:
    """A tiny Llama under ``tuner`` with every adapter weight random (most types start at a zero
    update, or at fixed random projections scaled by zero), so the update is not zero."""
    torch.manual_seed(0)
    made = DENSE_TUNERS[tuner]()
    for key, value in config.items():
        setattr(made, key, value)
    model = peft.get_peft_model(tiny_llama(width), made)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.normal_(0.0, 0.2)
    return model


def summed_deltas(model: Any) -> dict[str, torch.Tensor]:
    """Target name -> float64 sum of ``get_delta_weight`` over the layer's active adapters."""
    out = {}
    for target in find_targets(model):
        layer = target.layer_module
        parts = [layer.get_delta_weight(a).detach() for a in target.adapters]
        total = sum(
            p.to_dense() if p.layout != torch.strided else p for p in parts
        )  # SHiRA: sparse
        out[target.name] = target.rows.take(total.double())
    return out


@pytest.mark.parametrize("tuner", tuners(sorted(DENSE_TUNERS)))
def test_additive_tuner_types_are_read_through_get_delta_weight(tuner: str) -> None:
    model = dense_adapted(tuner)
    reference, expected = merged_matrices(model), summed_deltas(model)
    targets = find_targets(model)
    assert len(targets) == 2 * 7
    assert all(isinstance(t, DenseAdaptedTarget) for t in targets)
    for target in targets:
        batch = target.stack_batch([target])
        exact = reference[(target.layer, target.role)]
        assert torch.allclose(batch.dense(torch.float64)[0], exact, atol=1e-5, rtol=0), target.name
        assert float(batch.frobenius_norm_sq()[0]) == pytest.approx(
            float(exact.square().sum()), rel=1e-5
        )
        # The update: its top-k against float64 exact SVD of get_delta_weight.
        found, _, rank, frobenius_sq = batch.update_spectrum()
        singular = torch.linalg.svdvals(expected[target.name])[: found.shape[-1]]
        assert torch.allclose(
            found[0].double(), singular, rtol=1e-5, atol=1e-5 * float(singular[0])
        ), target.name
        assert float(frobenius_sq[0]) == pytest.approx(
            float(expected[target.name].square().sum()), rel=1e-5
        )
        assert batch.nbytes == target.snapshot_bytes()
        assert float(rank[0]) == (target.rank or pytest.approx(float("nan"), nan_ok=True))


def test_a_dense_update_is_formed_once_per_snapshot_and_the_base_is_never_copied() -> None:
    model = dense_adapted("loha")
    targets = find_targets(model)
    snapshot = take_snapshot(group_by_shape(targets), step=0)
    bases = {t.parameter.data_ptr() for t in targets}
    live = {p.data_ptr() for p in model.parameters()}
    copied = 0
    for batch in snapshot.tensors.values():
        assert {b.data_ptr() for b in batch.bases} <= bases  # the live frozen parameters
        assert not {o.data_ptr() for o in batch.owned} & live
        copied += batch.nbytes
    # One m x n update per adapted matrix (float32), nothing else.
    assert copied == sum(4 * t.shape[0] * t.shape[1] for t in targets)
    assert "loha r=4 (default)" in format_targets(targets)


def test_a_merged_or_disabled_dense_adapter_is_not_added_twice() -> None:
    model = dense_adapted("lokr")
    reference, expected = merged_matrices(model), summed_deltas(model)
    model.base_model.model.model.layers[0].self_attn.q_proj.merge()
    for target in find_targets(model):
        batch = target.stack_batch([target])
        exact = reference[(target.layer, target.role)]
        assert torch.allclose(batch.dense(torch.float64)[0], exact, atol=1e-5, rtol=0)
        top = torch.linalg.svdvals(expected[target.name])[0]
        assert float(batch.update_spectrum()[0][0, 0]) == pytest.approx(float(top), rel=1e-5)
    with model.disable_adapter():
        (target,) = find_targets(model, roles=["K"], include="*layers.1.*")
        batch = target.stack_batch([target])
        assert torch.equal(batch.dense()[0], target.parameter.detach())


def test_a_dense_adapter_fit_matches_merged_weights_at_every_scheduled_step() -> None:
    from spectral_callbacks import SpectralTracker

    for tuner in ("loha", "lokr"):
        model = dense_adapted(tuner, width=128)
        logger = RecordingLogger()
        tracker = SpectralTracker(
            model,
            writers=[logger],
            every_n_steps=10,
            log_spaced_until=0,
            svd_method="randomized",
            figures=False,
            synchronous=True,
        )
        merged, updates = {0: merged_matrices(model)}, {0: summed_deltas(model)}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        tokens = torch.randint(0, 64, (20, 2, 16), generator=torch.Generator().manual_seed(0))
        for step, batch in enumerate(tokens, start=1):
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 10 == 0:
                merged[step], updates[step] = merged_matrices(model), summed_deltas(model)
            tracker.step(step)
        tracker.close(20)
        targets = find_targets(model)
        checked = check_against_merged(logger.series, merged, updates, targets, [0, 10, 20])
        assert checked == len(targets) * 3, tuner


def test_a_tuner_layer_that_is_not_additive_is_refused_in_one_line_naming_its_type() -> None:
    torch.manual_seed(0)
    # OFT has a get_delta_weight, but it is a rotation the base is multiplied by, not added to it.
    # OFT blocks of 16 rows: oft_block_size is in peft 0.14 on; before it, r counts the blocks.
    fields = {f.name for f in dataclasses.fields(peft.OFTConfig)}
    blocks = dict(r=0, oft_block_size=16) if "oft_block_size" in fields else dict(r=4)
    oft = peft.get_peft_model(tiny_llama(), peft.OFTConfig(**blocks, target_modules=["q_proj"]))
    with pytest.warns(
        UserWarning,
        match=r"PEFT layer oft\.Linear: its get_delta_weight is not read as an update added",
    ) as caught:
        targets = find_targets(oft)
    assert "Q" not in {t.role for t in targets} and {t.role for t in targets} >= {"K", "V", "O"}
    lines = [line for w in caught for line in str(w.message).splitlines() if "oft.Linear" in line]
    assert len(lines) == 2 and all(line.count("oft.Linear") == 1 for line in lines)  # one a layer
    ia3 = peft.get_peft_model(
        tiny_llama(), peft.IA3Config(target_modules=["k_proj"], feedforward_modules=[])
    )
    with pytest.warns(UserWarning, match=r"PEFT layer ia3\.Linear has no get_delta_weight"):
        targets = find_targets(ia3)
    assert "K" not in {t.role for t in targets}


# --- along real fits --------------------------------------------------------------------------


class PeftModule(LightningModule):
    def __init__(self, model: Any, lr: float = 1e-2) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr)


class MergedRecorder(Callback):
    """The merged weights and the updates at the points SpectralMonitor snapshots."""

    def __init__(self) -> None:
        self.merged: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
        self.deltas: dict[int, dict[str, torch.Tensor]] = {}

    def _record(self, trainer: Trainer, pl_module: Any) -> None:
        step = trainer.global_step
        if step not in self.merged:
            self.merged[step] = merged_matrices(pl_module.model)
            self.deltas[step] = deltas(pl_module.model)

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self._record(trainer, pl_module)


def _exact(matrix: torch.Tensor) -> tuple[float, float]:
    singular = torch.linalg.svdvals(matrix)
    return float((singular**2).sum() / singular[0] ** 2), float(powerlaw_alpha(singular[:K])[0])


def check_against_merged(
    logged: Any,
    merged: dict[int, Any],
    updates: dict[int, Any],
    targets: list[Any],
    steps: list[int],
) -> int:
    """Every logged effective-weight and update value against the float64 references."""
    checked = 0
    for target in targets:

        def tag(metric: str, t: Any = target) -> str:
            return scalar_tag(metric, t.layer, t.role, t.num_layers)

        stable_ranks = logged(tag("stable_rank"))
        assert sorted(stable_ranks) == steps, target.name
        alphas, top = logged(tag("alpha")), logged(tag("update_sv_1"))
        update_ranks = logged(tag("update_stable_rank"))
        for step, value in stable_ranks.items():
            exact_sr, exact_alpha = _exact(merged[step][(target.layer, target.role)])
            assert value == pytest.approx(exact_sr, rel=0.01), (target.name, step)
            assert alphas[step] == pytest.approx(exact_alpha, abs=0.02), (target.name, step)
            singular = torch.linalg.svdvals(updates[step][target.name])
            assert top[step] == pytest.approx(float(singular[0]), rel=1e-5, abs=1e-12)
            if singular[0] > 0:
                exact_update_sr = float((singular**2).sum() / singular[0] ** 2)
                assert update_ranks[step] == pytest.approx(exact_update_sr, rel=1e-4)
            checked += 1
    return checked


FIT_CASES = {
    "llama-lora": ("llama", {}),
    "gpt2-lora": ("gpt2", {}),
    "llama-dora-rslora": ("llama", {"use_dora": True, "use_rslora": True}),
}


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_lightning_fit_matches_merged_weights_at_every_scheduled_step(case: str) -> None:
    arch, lora = FIT_CASES[case]
    # Width 256 and the randomized path: the Krylov products run on base + factors.
    model = adapted(arch, width=256, random_b=False, **lora)
    logger, recorder = RecordingLogger(), MergedRecorder()
    monitor = SpectralMonitor(
        every_n_steps=10,
        log_spaced_until=0,
        svd_method="randomized",
        figures=False,
        synchronous=True,
    )
    tokens = torch.randint(0, 64, (40 * 2, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)
    trainer = quiet_trainer(max_steps=40, logger=logger, callbacks=[monitor, recorder])
    trainer.fit(PeftModule(model), loader)
    targets = find_targets(model)
    checked = check_against_merged(
        logger.series, recorder.merged, recorder.deltas, targets, [0, 10, 20, 30, 40]
    )
    assert checked == len(targets) * 5


HF_CASES = {
    "gpt2-lora": ("gpt2", {}),
    "llama-lora": ("llama", {}),
    "llama-dora": ("llama", {"use_dora": True}),
    "llama-rslora": ("llama", {"use_rslora": True}),
}


def hf_fit(
    model: Any, output_dir: Any, logdir: Any, steps: int, save_steps: int = 0, resume: Any = None
) -> tuple[dict[int, Any], dict[int, Any]]:
    """Train ``model`` with the Hugging Face Trainer and SpectralTrainerCallback (every 10 steps);
    the merged weights and updates at each multiple of 10, as float64 references."""
    from transformers import Trainer as HFTrainer
    from transformers import TrainerCallback, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    merged: dict[int, Any] = {}
    updates: dict[int, Any] = {}

    class Recorder(TrainerCallback):
        def _record(self, step: int, model: Any) -> None:
            if step % 10 == 0:
                merged[step], updates[step] = merged_matrices(model), deltas(model)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._record(state.global_step, kw["model"])

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._record(state.global_step, kw["model"])

    callback = SpectralTrainerCallback(
        logdir=logdir,
        every_n_steps=10,
        log_spaced_until=0,
        svd_method="randomized",
        figures=False,
        synchronous=True,
    )
    tokens = torch.randint(0, 64, (2 * steps, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = HFTrainer(
        model=model,
        args=args,
        train_dataset=[{"input_ids": row, "labels": row} for row in tokens],
        callbacks=[callback, Recorder()],
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return merged, updates


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_trainer_on_a_peft_model_matches_merged_weights_at_every_scheduled_step(
    tmp_path: Any, case: str
) -> None:
    arch, lora = HF_CASES[case]
    model = adapted(arch, width=256, random_b=False, **lora)
    merged, updates = hf_fit(model, tmp_path, tmp_path / "runs", steps=40)
    scalars = read_scalars(tmp_path / "runs")
    targets = find_targets(model)
    steps = [0, 10, 20, 30, 40]
    checked = check_against_merged(
        lambda tag: scalars.get(tag, {}), merged, updates, targets, steps
    )
    assert checked == len(targets) * 5


def test_hf_trainer_saves_the_tracker_beside_the_adapter_checkpoint_and_resumes_from_it(
    tmp_path: Any,
) -> None:
    from spectral_callbacks.integrations.hf import STATE_FILE

    model = adapted("llama", width=64, random_b=False)
    hf_fit(model, tmp_path, tmp_path / "first", steps=40, save_steps=20)
    first = read_scalars(tmp_path / "first")
    for step in (20, 40):
        saved = {path.name for path in (tmp_path / f"checkpoint-{step}").iterdir()}
        # PEFT's adapter checkpoint (no full model weights), and the tracker beside it.
        assert {"adapter_model.safetensors", "adapter_config.json", STATE_FILE} <= saved
        assert "model.safetensors" not in saved
    resumed = adapted("llama", width=64, random_b=False)
    merged, updates = hf_fit(
        resumed, tmp_path, tmp_path / "second", steps=40, resume=tmp_path / "checkpoint-20"
    )
    second = read_scalars(tmp_path / "second")
    targets = find_targets(resumed)
    checked = check_against_merged(
        lambda tag: second.get(tag, {}), merged, updates, targets, [30, 40]
    )
    assert checked == len(targets) * 2
    # Compression is still against the first run's step 0, restored from the checkpoint.
    for target in targets:
        tag = scalar_tag("stable_rank", target.layer, target.role, target.num_layers)
        reference = first[tag][0]
        compression = second[
            scalar_tag("compression", target.layer, target.role, target.num_layers)
        ]
        for step, stable_rank in second[tag].items():
            assert compression[step] == pytest.approx(100 * (1 - stable_rank / reference), abs=1e-3)


def _rows(values: dict[tuple[str, int, str, int], float]) -> Any:
    import pandas as pd

    records = [
        ("run", step, metric, layer, layer / 1.0, role, value, 0.0)
        for (metric, layer, role, step), value in values.items()
    ]
    columns = ["run", "step", "metric", "layer", "depth", "role", "value", "wall_time"]
    return pd.DataFrame.from_records(records, columns=columns)


def test_update_rank_chart_draws_the_last_energy_rank_beside_r() -> None:
    from spectral_callbacks.charts import update_rank_vs_r

    values = {}
    for layer in range(2):
        for j, role in enumerate(["Q", "V"]):
            values[("update_energy_rank_90", layer, role, 0)] = 1.0
            values[("update_energy_rank_90", layer, role, 40)] = 2.0 + layer + j
            values[("update_rank", layer, role, 40)] = 8.0
    fig = update_rank_vs_r(_rows(values))
    ax = fig.axes[0]
    heights = sorted(round(patch.get_height(), 6) for patch in ax.patches)
    assert heights == [2.0, 3.0, 3.0, 4.0]  # the last step's values, not step 0's
    ticks = [offsets[:, 1].tolist() for offsets in (c.get_offsets() for c in ax.collections)]
    assert [value for tick in ticks for value in tick] == [8.0] * 4
    assert "step 40" in ax.get_title()


def test_layer_steps_chart_draws_one_line_per_layer() -> None:
    from spectral_callbacks.charts import metric_vs_steps_by_layer

    values = {
        ("update_stable_rank", layer, "Q", step): float(layer + step)
        for layer in range(3)
        for step in (0, 10, 20)
    }
    fig = metric_vs_steps_by_layer(_rows(values), role="Q")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["L0", "L1", "L2"]
    assert lines[2].get_ydata().tolist() == [2.0, 12.0, 22.0]
    with pytest.raises(ValueError, match="per-layer `update_stable_rank` rows with role='K'"):
        metric_vs_steps_by_layer(_rows(values), role="K")


def test_the_live_figures_of_an_adapted_run_draw_the_update_rank_and_its_stable_rank(
    tmp_path: Any,
) -> None:
    from tensorboard.backend.event_processing import event_accumulator

    from spectral_callbacks import SpectralTracker
    from spectral_callbacks.monitor import dashboards
    from spectral_callbacks.monitor.figures import draw_figures

    model = adapted("llama", random_b=False)
    tracker = SpectralTracker(
        model,
        logdir=tmp_path,
        every_n_steps=4,
        log_spaced_until=0,
        figure_roles=["Q", "V"],
        synchronous=True,
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, 64, (8, 2, 16), generator=torch.Generator().manual_seed(0))
    for step, batch in enumerate(tokens, start=1):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tracker.step(step)
    tracker.close(8)
    rows = tracker._figure_rows()
    assert dashboards.wait_for_figures(timeout=120)
    reader = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    reader.Reload()
    images = set(reader.Tags()["images"])
    update = {
        "spectral_figures/update_rank_vs_r",
        "spectral_figures/update_stable_rank_vs_steps/Q",
        "spectral_figures/update_stable_rank_vs_steps/V",
    }
    assert update <= images, images
    (final,) = [i for i in reader.Images("spectral_figures/update_rank_vs_r") if i.step == 8]
    assert final.width > 100
    # What they draw: the last energy rank of every (layer, role) beside r = 8.
    figure = draw_figures(rows, ("Q",))["spectral_figures/update_rank_vs_r"]
    heights = sorted(patch.get_height() for patch in figure.axes[0].patches)
    last = rows[(rows["metric"] == "update_energy_rank_90") & rows["layer"].notna()]
    expected = last[last["step"] == 8]["value"].to_numpy(dtype=float)
    assert heights == sorted(expected) and len(heights) == 14
    # A dense fine-tune's update has no adapter r: no update-rank figure, the stable rank still.
    dense = rows.copy()
    dense.loc[dense["metric"] == "update_rank", "value"] = float("nan")
    drawn = draw_figures(dense, ("Q",))
    assert "spectral_figures/update_rank_vs_r" not in drawn
    assert "spectral_figures/update_stable_rank_vs_steps/Q" in drawn


def test_the_lora_example_logs_both_spectra_and_draws_the_update_rank(tmp_path: Any) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    logdir = tmp_path / "lora"
    command = [sys.executable, str(root / "examples" / "lora_finetune.py"), "--logdir", str(logdir)]
    command += ["--steps", "12", "--base-steps", "2", "--width", "64", "--layers", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lora r=8 (default)" in done.stdout
    scalars = read_scalars(logdir)
    assert sorted(scalars["spectral_update_energy_rank_90/L01/MLP_down"]) == [0, 1, 2, 4, 8, 10, 12]
    assert set(scalars["spectral_update_rank/L00/Q"].values()) == {8.0}
    assert "spectral_stable_rank/L01/V" in scalars
    from spectral_callbacks.cli import main

    out = tmp_path / "update_rank.png"
    assert main(["plot", str(logdir), "--kind", "update-rank", "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_analyze_an_adapter_directory_on_its_base(tmp_path: Any, capsys: Any) -> None:
    from spectral_callbacks.cli import main

    torch.manual_seed(0)
    base = tiny_llama(width=64)
    base.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(
        r=8, target_modules=LLAMA_MODULES, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, config)
    model.save_pretrained(tmp_path / "adapter")
    reference, expected = merged_matrices(model), deltas(model)
    names = {(t.layer, t.role): t.name for t in find_targets(model)}
    logdir = tmp_path / "runs"
    argv = ["analyze", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")]
    assert main([*argv, "--logdir", str(logdir), "--method", "gram"]) == 0
    scalars = read_scalars(logdir)
    for (layer, role), matrix in reference.items():
        exact_sr, _ = _exact(matrix)
        assert scalars[f"spectral_stable_rank/L{layer:02d}/{role}"][0] == pytest.approx(
            exact_sr, rel=1e-4
        )
        top = float(torch.linalg.svdvals(expected[names[(layer, role)]])[0])
        assert scalars[f"spectral_update_sv_1/L{layer:02d}/{role}"][0] == pytest.approx(
            top, rel=1e-5
        )
    assert main(["targets", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")]) == 0
    capsys.readouterr()
    # The adapter config names the base by the object it was built from, not a directory.
    assert main(["analyze", str(tmp_path / "adapter"), "--logdir", str(tmp_path / "x")]) == 1
    assert "needs its base model" in capsys.readouterr().err


def test_an_adapter_without_task_type_loads_on_the_head_its_keys_name(
    tmp_path: Any, capsys: Any
) -> None:
    # LoraConfig() without task_type (the usual spelling): the saved keys carry the causal LM's
    # "model." prefix. Before, the base was loaded bare (AutoModel), no adapter weight found its
    # layer, and the base's own spectrum was reported with exit 0.
    from spectral_callbacks.cli import main

    torch.manual_seed(0)
    base = tiny_llama(width=64)
    base.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=8, target_modules=LLAMA_MODULES, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    model.save_pretrained(tmp_path / "adapter")
    reference = merged_matrices(model)
    logdir = tmp_path / "runs"
    argv = ["analyze", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")]
    assert main([*argv, "--logdir", str(logdir), "--method", "gram"]) == 0
    scalars = read_scalars(logdir)
    for (layer, role), matrix in reference.items():
        exact_sr, _ = _exact(matrix)
        assert scalars[f"spectral_stable_rank/L{layer:02d}/{role}"][0] == pytest.approx(
            exact_sr, rel=1e-4
        )
    assert scalars["spectral_update_rank/L00/Q"][0] == 8.0


def test_an_adapter_whose_weights_find_no_layer_is_refused(tmp_path: Any, capsys: Any) -> None:
    # An adapter trained on the bare LlamaModel but saved with task_type="CAUSAL_LM": loaded on the
    # causal LM, none of its weights finds a layer (before: the base's spectrum, exit 0).
    from spectral_callbacks.cli import main

    torch.manual_seed(0)
    causal = tiny_llama(width=64)
    causal.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=8, target_modules=["q_proj"])
    bare = peft.get_peft_model(copy.deepcopy(causal.model), config)
    bare.save_pretrained(tmp_path / "adapter")
    saved = tmp_path / "adapter" / "adapter_config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "task_type": "CAUSAL_LM"}))
    argv = ["analyze", str(tmp_path / "adapter"), "--base", str(tmp_path / "base")]
    assert main([*argv, "--logdir", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err
    assert "4 of the adapter's 4 weights found no layer in the base" in err
    assert "loaded as AutoModelForCausalLM" in err and "`task_type`" in err
    assert not (tmp_path / "runs").exists()


def test_an_adapter_naming_no_base_says_so(tmp_path: Any, capsys: Any) -> None:
    # before: "its adapter_config.json names None"
    from spectral_callbacks.cli import main

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    saved = tmp_path / "adapter" / "adapter_config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "base_model_name_or_path": None}))
    assert main(["targets", str(tmp_path / "adapter")]) == 1
    error = capsys.readouterr().err
    assert "its adapter_config.json names no base_model_name_or_path" in error
    assert "None" not in error


def test_a_modules_to_save_copy_is_a_plain_target_and_its_original_is_left_out() -> None:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["k_proj"], modules_to_save=["q_proj", "lm_head"])
    model = peft.get_peft_model(tiny_llama(), config)
    targets = find_targets(model)
    queries = [t for t in targets if t.role == "Q"]
    assert [t.layer for t in queries] == [0, 1]
    assert all(not isinstance(t, AdaptedTarget) and t.parameter.requires_grad for t in queries)
    assert all(".modules_to_save.default." in t.name for t in queries)
    assert all(isinstance(t, AdaptedTarget) for t in targets if t.role == "K")
    reasons = {s.parameter_name: s.reason for s in targets.skipped}
    original = "base_model.model.model.layers.0.self_attn.q_proj.original_module.weight"
    assert reasons[original].startswith("original of a PEFT modules_to_save copy")


# --- quantized bases --------------------------------------------------------------------------


class Linear4bit(torch.nn.Linear):
    """Stand-in for bitsandbytes' ``Linear4bit`` (a ``Linear`` subclass; here its weight stays
    float, as the real one's does until it is moved to its device): known by its class."""


class Linear8bitLt(torch.nn.Linear):
    """Stand-in for bitsandbytes' ``Linear8bitLt``, whose weight is stored as int8."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        scale = linear.weight.detach().abs().amax() / 127
        packed = torch.round(linear.weight.detach() / scale).to(torch.int8)
        self.weight = torch.nn.Parameter(packed, requires_grad=False)


def _quantize(model: Any, names: dict[str, Any]) -> Any:
    for layer in model.model.layers:
        for path, kind in names.items():
            owner, _, leaf = path.rpartition(".")
            parent = layer.get_submodule(owner)
            linear = getattr(parent, leaf)
            if kind is Linear4bit:
                swapped = Linear4bit(linear.in_features, linear.out_features, bias=False)
                swapped.weight = torch.nn.Parameter(linear.weight.detach(), requires_grad=False)
            else:
                swapped = kind(linear)
            setattr(parent, leaf, swapped)
    return model


def test_a_quantized_base_is_refused_in_one_line_naming_its_type() -> None:
    torch.manual_seed(0)
    model = _quantize(tiny_llama(), {"self_attn.q_proj": Linear4bit, "mlp.gate_proj": Linear8bitLt})
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    qlora = peft.get_peft_model(model, config)
    with pytest.warns(UserWarning) as caught:
        targets = find_targets(qlora)
    lines = [line.strip() for w in caught for line in str(w.message).splitlines()]
    q = [line for line in lines if ".q_proj.base_layer.weight" in line]
    assert len(q) == 2 and all(
        "PEFT layer lora.Linear over a quantized base (Linear4bit, weight float32): not watched"
        in line
        for line in q
    )
    # Outside PEFT: the int8 weight of a quantized layer that no adapter wraps.
    gate = [line for line in lines if ".mlp.gate_proj.weight" in line]
    assert len(gate) == 2 and all(
        "quantized layer (Linear8bitLt, weight int8): not watched" in line for line in gate
    )
    assert {t.role for t in targets} == {"K", "V", "O", "MLP_up", "MLP_down"}
    assert all(isinstance(t, AdaptedTarget) for t in targets if t.role == "V")


def qlora_llama(bnb: Any) -> Any:
    """A tiny Llama whose q_proj is a bitsandbytes NF4 ``Linear4bit`` and gate_proj an 8-bit
    ``Linear8bitLt`` (bitsandbytes' CPU backend quantizes them on the move to the device)."""
    torch.manual_seed(0)
    model = tiny_llama()
    for layer in model.model.layers:
        q, gate = layer.self_attn.q_proj, layer.mlp.gate_proj
        four = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
        four.weight = bnb.nn.Params4bit(q.weight.detach().clone(), requires_grad=False)
        eight = bnb.nn.Linear8bitLt(64, 128, bias=False, has_fp16_weights=False)
        eight.weight = bnb.nn.Int8Params(
            gate.weight.detach().clone(), requires_grad=False, has_fp16_weights=False
        )
        layer.self_attn.q_proj, layer.mlp.gate_proj = four.to("cpu"), eight.to("cpu")
    return model


def test_a_real_bitsandbytes_qlora_model_is_read_through_its_dequantized_bases() -> None:
    # The QLoRA setup itself (bitsandbytes is in [dev]; its CPU backend quantizes here).
    bnb = pytest.importorskip("bitsandbytes")
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "gate_proj", "v_proj"], init_lora_weights=False
    )
    qlora = peft.get_peft_model(qlora_llama(bnb), config)  # train mode, as in a QLoRA fit
    targets = find_targets(qlora)
    assert {t.role for t in targets} == {"Q", "K", "V", "O", "MLP_gate", "MLP_up", "MLP_down"}

    def independent(layer: Any) -> torch.Tensor:
        """W_deq + s B A in float64, dequantized by bitsandbytes' functions directly."""
        weight = layer.get_base_layer().weight
        if weight.dtype == torch.uint8:
            dequantized = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
        else:
            scales = weight.SCB if weight.SCB is not None else layer.get_base_layer().state.SCB
            dequantized = bnb.functional.int8_vectorwise_dequant(weight.data, scales)
        lora = layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
        return dequantized.double() + layer.scaling["default"] * lora.detach()

    checked = 0
    for target in targets:
        if target.role not in ("Q", "MLP_gate"):
            continue
        assert isinstance(target, AdaptedTarget) and target.shape == (
            target.layer_module.out_features,
            target.layer_module.in_features,
        )
        layer = target.layer_module
        expected = independent(layer)
        batch = target.stack_batch([target])
        effective = batch.dense(torch.float64)[0]
        assert torch.allclose(effective, expected, atol=1e-6, rtol=0), target.name
        # What the layer computes, to its kernel's precision. In eval mode the CPU backend
        # repacks a 4-bit weight at its first forward; read back, its base differs from the
        # original only by the re-quantization of its block scales.
        x = torch.randn(5, target.shape[1])
        with torch.no_grad():
            layer.eval()
            computed = layer(x).double()
            layer.train()
        after = target.stack_batch([target]).dense(torch.float64)[0]
        assert torch.allclose(after, expected, atol=1e-3, rtol=0), target.name
        with torch.no_grad():  # reading it back left the layer's own (repacked) state alone
            layer.eval()
            assert torch.equal(layer(x).double(), computed)
            layer.train()
        assert torch.allclose(computed, x.double() @ after.T, atol=1e-2, rtol=0), target.name
        found = low_rank_singular_values(batch.ups, batch.downs)[0]
        delta = target.layer_module.get_delta_weight("default").detach().double()
        exact = torch.linalg.svdvals(delta)[: found.shape[-1]]
        assert torch.allclose(found, exact, rtol=1e-5, atol=1e-5 * float(exact[0]))
        assert batch.nbytes == target.snapshot_bytes()  # the dequantized base and the factors
        checked += 1
    assert checked == 4
    # A QLoRA fit through the engine (a fresh model, never in eval mode: no repacking), the
    # logged effective weight against the independent dequantization at every scheduled step.
    qlora = peft.get_peft_model(qlora_llama(bnb), config)
    watched = [t for t in find_targets(qlora) if t.role in ("Q", "MLP_gate")]

    def exact() -> dict[str, tuple[float, float]]:
        return {t.name: _exact(independent(t.layer_module)) for t in watched}

    logger, expected_at = RecordingLogger(), {}
    tracker = SpectralTracker(
        qlora, writers=[logger], every_n_steps=5, log_spaced_until=0, figures=False,
        synchronous=True,
    )  # fmt: skip
    expected_at[0] = exact()
    optimizer = torch.optim.AdamW([p for p in qlora.parameters() if p.requires_grad], lr=1e-2)
    batches = torch.randint(0, 64, (10, 2, 16), generator=torch.Generator().manual_seed(0))
    for step, batch in enumerate(batches, start=1):
        qlora(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0:
            expected_at[step] = exact()
        tracker.step(step)
    tracker.close(10)
    for target in watched:
        tag = scalar_tag("stable_rank", target.layer, target.role, target.num_layers)
        alphas = logger.series(scalar_tag("alpha", target.layer, target.role, target.num_layers))
        assert sorted(logger.series(tag)) == [0, 5, 10]
        for step, value in logger.series(tag).items():
            stable_rank, alpha = expected_at[step][target.name]
            assert value == pytest.approx(stable_rank, rel=0.01), (target.name, step)
            assert alphas[step] == pytest.approx(alpha, abs=0.02), (target.name, step)
    assert expected_at[10] != expected_at[0]  # the adapters trained


def test_roles_from_the_forward_of_hand_built_bitsandbytes_layers() -> None:
    # A bitsandbytes kernel multiplies by a dequantized copy of its weight, which the record
    # cannot tie to the parameter: the layer's call is recorded as one projection by its weight
    # (dataflow.py). Without that, q was read from the LoRA factor lora_B, the second layer's
    # attention was not followed and both layers were numbered 0.
    bnb = pytest.importorskip("bitsandbytes")
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "gate_proj", "v_proj"], init_lora_weights=False
    )
    qlora = peft.get_peft_model(qlora_llama(bnb), config)
    tracker = SpectralTracker(qlora, writers=[RecordingLogger()], figures=False, synchronous=True)
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    qlora(input_ids=batch, labels=batch).loss.backward()  # the recorded first forward
    tracker.step(1)
    tracker.close(1)
    assert sorted((t.layer, t.role) for t in tracker.targets) == sorted(
        (t.layer, t.role) for t in find_targets(qlora)
    )


def test_an_older_loha_without_apply_rank_dropout_is_read_without_rank_dropout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Older PEFT: get_delta_weight(adapter) drops ranks in train mode (a global RNG draw that
    # would change the run and the update read). Read in eval mode for the call, then put back.
    from peft.tuners.loha.layer import Linear as LoHaLinear

    model = dense_adapted("loha")
    current = LoHaLinear.get_delta_weight

    def older(self, adapter_name):  # type: ignore[no-untyped-def]
        delta = current(self, adapter_name)
        if self.training:  # as the older LoHa did: a dropout mask drawn from the global RNG
            delta = delta * (torch.rand(delta.shape[0], 1) > 0.5)
        return delta

    monkeypatch.setattr(LoHaLinear, "get_delta_weight", older)
    model.train()
    expected = summed_deltas(copy.deepcopy(model).eval())
    state = torch.get_rng_state()
    for target in find_targets(model):
        update = target.stack_batch([target]).updates[0]
        assert torch.allclose(update.double(), expected[target.name], atol=1e-6), target.name
    assert torch.equal(torch.get_rng_state(), state)  # no draw from the global generator
    assert all(module.training for module in model.modules())  # every mode put back
