"""Attention heads read from the targets, and their circuits logged along a short fit, checked
against float64 SVDs of the explicitly formed d x d products at every scheduled step."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, GPTConfig

from spectral_callbacks.monitor.options import ConfigurationError
from spectral_callbacks.monitor.tracker import SpectralTracker
from spectral_callbacks.names import parse_tag
from spectral_callbacks.targets import find_targets
from spectral_callbacks.targets.circuits import HeadCircuit, find_circuits
from spectral_callbacks.targets.errors import PartialTargetWarning, TargetError

TINY = dict(n_layer=2, n_head=8, n_embd=64, block_size=16)


def example_gpt(attention: str) -> GPT:
    n_kv_head = {"gqa": 2, "mqa": 1}.get(attention)  # GQA: groups of 4 query heads
    return GPT(GPTConfig(**TINY, attention=attention, n_kv_head=n_kv_head))  # type: ignore[arg-type]


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=16, vocab_size=64)
    return GPT2LMHeadModel(config)


def formed_heads(model: torch.nn.Module) -> dict[int, tuple[list, float]]:
    """Per layer: each query head's (W_Q^h, W_K^g, W_V^g, W_O^h) in float64 read straight from the
    module weights (not from the targets), and the logit scale."""
    layers = {}
    blocks = model.transformer.h
    for layer, block in enumerate(blocks):
        attn = block.attn
        if hasattr(attn, "c_attn") and type(attn.c_attn).__name__ == "Conv1D":  # GPT-2, (in, out)
            heads, d = attn.num_heads, attn.embed_dim
            q, k, v = attn.c_attn.weight.detach().double().T.split(d)
            o = attn.c_proj.weight.detach().double().T
            kv_heads, rows = heads, d // heads
        elif hasattr(attn, "c_attn"):  # the example's MHA: Linear rows [q; k; v]
            heads = attn.num_heads
            q, k, v = attn.c_attn.weight.detach().double().chunk(3)
            o = attn.c_proj.weight.detach().double()
            kv_heads, rows = heads, q.shape[0] // heads
        elif hasattr(attn, "kv_b_proj"):  # MLA: factored, rotary rows of q left out
            heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
            r = attn.kv_lora_rank
            q_up = attn.q_b_proj.weight.detach().double().view(heads, nope + rope, -1)[:, :nope]
            q = (q_up @ attn.q_a_proj.weight.detach().double()).reshape(heads * nope, -1)
            latent = attn.kv_a_proj_with_mqa.weight.detach().double()[:r]
            kv = attn.kv_b_proj.weight.detach().double().view(heads, nope + attn.v_head_dim, r)
            k = (kv[:, :nope] @ latent).reshape(heads * nope, -1)
            v = (kv[:, nope:] @ latent).reshape(heads * attn.v_head_dim, -1)
            o = attn.o_proj.weight.detach().double()
            kv_heads, rows = heads, nope
            layers[layer] = (_split(q, k, v, o, heads, kv_heads, rows), 1 / math.sqrt(nope + rope))
            continue
        else:  # q/k/v/o_proj: MHA, GQA, MQA
            heads, kv_heads = attn.num_heads, attn.num_key_value_heads
            q, k, v, o = (
                getattr(attn, f"{n}_proj").weight.detach().double() for n in ("q", "k", "v", "o")
            )
            rows = q.shape[0] // heads
        layers[layer] = (_split(q, k, v, o, heads, kv_heads, rows), 1 / math.sqrt(rows))
    return layers


def _split(q, k, v, o, heads, kv_heads, rows):
    d_v = v.shape[0] // kv_heads
    group = heads // kv_heads
    return [
        (
            q[h * rows : (h + 1) * rows],
            k[(h // group) * rows : (h // group + 1) * rows],
            v[(h // group) * d_v : (h // group + 1) * d_v],
            o[:, h * d_v : (h + 1) * d_v],
        )
        for h in range(heads)
    ]


def query_key_biases(model: torch.nn.Module, layer: int, head: int) -> tuple[torch.Tensor, ...]:
    """Head ``head``'s query and key biases in float64 (zeros where the projections have none)."""
    attn = model.transformer.h[layer].attn
    if type(getattr(attn, "c_attn", None)).__name__ == "Conv1D":  # GPT-2: [q; k; v] biases
        rows = attn.embed_dim // attn.num_heads
        b_q, b_k, _ = attn.c_attn.bias.detach().double().split(attn.embed_dim)
        return b_q[head * rows : (head + 1) * rows], b_k[head * rows : (head + 1) * rows]
    return (), ()


def reference_spectra(model: torch.nn.Module) -> dict[tuple[int, int], dict[str, object]]:
    """(layer, head) -> the singular values of the formed d x d products and the four metrics,
    and the logit bound from the formed (d + 1) x (d + 1) product of the bias-augmented maps."""
    found = {}
    for layer, (heads, scale) in formed_heads(model).items():
        for h, (W_q, W_k, W_v, W_o) in enumerate(heads):
            rows, d_v = W_q.shape[0], W_v.shape[0]
            qk = torch.linalg.svdvals(W_q.T @ W_k)[:rows]  # (d, d) formed: the reference only
            ov = torch.linalg.svdvals(W_o @ W_v)[:d_v]
            b_q, b_k = query_key_biases(model, layer, h)
            if len(b_q):  # [W b] acting on [x; 1]
                W_q, W_k = torch.cat([W_q, b_q[:, None]], 1), torch.cat([W_k, b_k[:, None]], 1)
            found[(layer, h)] = {
                "qk_logit_bound": scale * torch.linalg.svdvals(W_q.T @ W_k)[0].item(),
                "qk": qk,
                "ov": ov,
                "qk_spectral_norm": scale * qk[0].item(),
                "qk_stable_rank": (qk.square().sum() / qk[0].square()).item(),
                "ov_spectral_norm": ov[0].item(),
                "ov_stable_rank": (ov.square().sum() / ov[0].square()).item(),
            }
    return found


MODELS = {
    "MHA": lambda: example_gpt("mha"),
    "GQA4": lambda: example_gpt("gqa"),
    "MQA": lambda: example_gpt("mqa"),
    "MLA": lambda: example_gpt("mla"),
    "GPT-2": gpt2,
}


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.setdefault(step, {}).update(metrics)


@pytest.mark.parametrize("kind", list(MODELS))
def test_every_heads_singular_values_equal_the_formed_products(kind: str) -> None:
    torch.manual_seed(0)
    model = MODELS[kind]()
    heads = find_circuits(model, find_targets(model))
    batch = HeadCircuit.stack_batch(heads)
    query, key, value, output = batch.projections()
    layout = heads[0].layout
    from spectral_callbacks.functional.circuits import (
        circuit_singular_values,
        key_factors,
        output_factors,
        query_factors,
    )

    qk = circuit_singular_values(
        query_factors(query, layout.num_heads),
        key_factors(key, layout.num_kv_heads, layout.num_heads),
    )  # (L, H, d_h)
    ov = circuit_singular_values(
        output_factors(output, layout.num_heads),
        key_factors(value, layout.num_kv_heads, layout.num_heads),
    )
    reference = reference_spectra(model)
    assert len(heads) == len(reference)
    for target in heads:
        want = reference[(target.layer, target.head)]
        torch.testing.assert_close(qk[target.layer, target.head], want["qk"], rtol=1e-5, atol=0)
        torch.testing.assert_close(ov[target.layer, target.head], want["ov"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_the_logged_circuits_equal_the_formed_products_at_every_scheduled_step(kind: str) -> None:
    torch.manual_seed(0)
    model = MODELS[kind]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    writer = Recorder()
    tracker = SpectralTracker(
        model,
        writers=[writer],
        circuits=True,
        synchronous=True,
        figures=False,
        every_n_steps=3,
        log_spaced_until=0,
    )
    references = {}
    tracker.begin(0)
    references[0] = reference_spectra(model)
    for step in range(1, 8):
        idx = torch.randint(0, 64, (4, 16))
        out = model(idx, labels=idx) if kind == "GPT-2" else model(idx, idx)
        loss = out.loss if kind == "GPT-2" else out[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        references[step] = reference_spectra(model)
        tracker.step(step)
    tracker.close()
    checked = set()
    for step, scalars in writer.logged.items():
        for tag, value in scalars.items():
            parsed = parse_tag(tag)
            if parsed is None or parsed.head is None:
                continue
            want = references[step][(parsed.layer, parsed.head)][parsed.metric]
            assert value == pytest.approx(want, rel=1e-5), (step, tag)
            checked.add(step)
    assert checked == {0, 3, 6, 7}  # every scheduled step (the last step is always one)


def test_layer_aggregates_histograms_and_rows_over_heads() -> None:
    model = example_gpt("gqa")
    writer = Recorder()
    tracker = SpectralTracker(
        model, writers=[writer], circuits=True, synchronous=True, start_step=0
    )
    tracker.close()
    logged = writer.logged[0]
    per_head = [logged[f"spectral_qk_spectral_norm/L01/H{h:02d}/heads"] for h in range(8)]
    assert logged["spectral_qk_spectral_norm/L01/heads/max"] == max(per_head)
    assert logged["spectral_qk_spectral_norm/L01/heads/mean"] == pytest.approx(sum(per_head) / 8)
    assert logged["spectral_qk_spectral_norm/L01/heads/min"] == min(per_head)
    rows = tracker._reporter.rows()
    heads = rows[rows["role"] == "heads"]
    assert sorted(heads["head"].dropna().unique().tolist()) == list(range(8))
    assert rows[rows["role"] == "Q"]["head"].isna().all()
    histograms = tracker._reporter.expert_values(tracker._reporter.latest)
    assert sorted(histograms["spectral_qk_spectral_norm/L01/heads"]) == sorted(per_head)


def test_layouts_that_are_not_read_are_refused_naming_the_layer() -> None:
    model = example_gpt("gta")
    with (
        pytest.warns(PartialTargetWarning, match=r"layer 1 \(transformer.h.1.attn\): tied K/V"),
        pytest.raises(TargetError, match=r"layer 0 \(transformer.h.0.attn\): tied K/V \(GTA\)"),
    ):
        find_circuits(model, find_targets(model))
    with (
        pytest.warns(PartialTargetWarning, match=r"transformer.h.0.attn\): TPA factors"),
        pytest.raises(ConfigurationError, match="circuits: no attention layer could be read"),
    ):
        SpectralTracker(example_gpt("tpa"), writers=[Recorder()], circuits=True)


@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_sharded_q_k_v_o_are_refused_naming_the_layer(tmp_path: Path, how: str) -> None:
    """A DTensor holds a shard of each matrix on each rank (FSDP2 rows, tensor parallel heads):
    the circuits are never read from a local shard as if it were the layer. One rank and a
    one-device mesh are enough to make the DTensors the check reads."""
    import sharded_models
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = sharded_models.TinyTPGPT(d=32, heads=4, fused=False)
        sharded_models.shard(model, how, init_device_mesh("cpu", (1,)))
        targets = find_targets(model)
        assert {type(t.parameter).__name__ for t in targets if t.role == "Q"} == {"DTensor"}
        with (
            pytest.warns(PartialTargetWarning, match=r"layer 1 \(layers.1.attention\): sharded"),
            pytest.raises(
                TargetError,
                match=r"layer 0 \(layers.0.attention\): sharded \(DTensor\) weights are not gathered",
            ),
        ):
            find_circuits(model, targets)
    finally:
        dist.destroy_process_group()


def test_a_head_count_the_modules_lack_is_given_by_pattern() -> None:
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(16, 16) for _ in range(4))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for block in model.layers:
        block.attn = Attention()
    targets = find_targets(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTargetWarning)
        with pytest.raises(
            PartialTargetWarning, match=r"layer 0 \(layers.0.attn\): its head count"
        ):
            find_circuits(model, targets)
    heads = find_circuits(model, targets, {"layers.*.attn": 4})
    assert [(h.layer, h.head) for h in heads][-1] == (1, 3)
    with pytest.raises(
        TargetError, match=r"`heads` must be a dict \{pattern: number of query heads\}"
    ):
        find_circuits(model, targets, {"*.attn": 0})
    with pytest.raises(ConfigurationError, match=r"`circuits` must be True, False or a dict"):
        SpectralTracker(model, writers=[Recorder()], circuits={"*.attn": "4"})


def test_a_head_count_that_contradicts_the_module_or_matches_nothing_is_refused() -> None:
    model = example_gpt("gqa")  # 8 query heads, 2 K/V heads on each attention module
    targets = find_targets(model)
    with pytest.raises(
        TargetError,
        match=r"circuits=\{'transformer.h.\*.attn': 4\} gives transformer.h.0.attn 4 query heads, "
        r"but the module has 8 .* and 2 K/V heads",
    ):
        find_circuits(model, targets, {"transformer.h.*.attn": 4})
    with pytest.raises(
        TargetError, match=r"pattern\(s\) \['blocks.\*.attn'\] match no attention layer; .*"
        r"the attention modules are transformer.h.0.attn, transformer.h.1.attn$"
    ):  # fmt: skip
        find_circuits(model, targets, {"blocks.*.attn": 8})
    heads = find_circuits(model, targets, {"transformer.h.*.attn": 8})  # the module's own count
    assert heads[0].layout.num_kv_heads == 2


def test_a_layer_whose_scale_is_not_declared_logs_no_scaled_value_and_no_bound() -> None:
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(16, 16) for _ in range(4))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for block in model.layers:
        block.attn = Attention()
    writer = Recorder()
    with pytest.warns(
        PartialTargetWarning, match=r"the logit scale of layer 0 \(layers.0.attn\), layer 1 .* "
        r"is not declared on its module"
    ):  # fmt: skip
        SpectralTracker(
            model, writers=[writer], circuits={"layers.*.attn": 4}, synchronous=True, start_step=0
        ).close()
    metrics = {parse_tag(tag).metric for tag in writer.logged[0] if "/heads" in tag}
    assert metrics == {"qk_stable_rank", "ov_spectral_norm", "ov_stable_rank"}


def test_the_heads_read_the_snapshots_dense_copies_before_anything_computes_them() -> None:
    # Q/K/V/O watched as dense matrices are copied once: the heads' batch holds views of those
    # stacks, and is computed first, so a compute function that overwrites the dense stacks it is
    # given (as scratch) cannot change what the heads log.
    from spectral_callbacks.monitor.engines.compute import SpectrumCompute
    from spectral_callbacks.monitor.snapshot import group_by_shape, take_snapshot
    from spectral_callbacks.targets.circuits import CircuitBatch

    torch.manual_seed(0)
    model = MODELS["GQA4"]()
    targets = find_targets(model)
    snapshot = take_snapshot(group_by_shape([*targets, *find_circuits(model, targets)]), step=0)
    first = next(iter(snapshot.tensors.values()))
    assert isinstance(first, CircuitBatch)
    dense = {
        stack.untyped_storage().data_ptr()
        for stack in snapshot.tensors.values()
        if isinstance(stack, torch.Tensor)
    }
    assert all(copy.untyped_storage().data_ptr() in dense for copy in first.copies)

    spectra = SpectrumCompute()

    def overwriting(group, batch):
        values = spectra(group, batch)
        if isinstance(batch, torch.Tensor):
            batch.zero_()
        return values

    writer = Recorder()
    tracker = SpectralTracker(
        model, writers=[writer], circuits=True, compute=overwriting, synchronous=True,
        figures=False, start_step=0,
    )  # fmt: skip
    tracker.close()
    want = reference_spectra(model)
    checked = 0
    for tag, value in writer.logged[0].items():
        parsed = parse_tag(tag)
        if parsed is not None and parsed.head is not None:
            assert value == pytest.approx(
                want[(parsed.layer, parsed.head)][parsed.metric], rel=1e-5
            )
            checked += 1
    assert checked >= 4 * len(want)
