"""Mixture-of-experts models of transformers 5 (3-D expert tensors): each expert a target, the
values checked against float64 exact SVD of each expert's slice at every scheduled step of a fit
under each frontend (SpectralTracker, Lightning, the Hugging Face Trainer), and the aggregates and
the histograms over experts in the event files against the per-expert values."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import pytest
import torch
from hf_models import (
    SMALL,
    deepseek_v3,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
    switch_transformers,
)
from hf_train import WeightRecorder as HFWeightRecorder
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from tiny_models import WeightRecorder, quiet_trainer, read_histograms, read_scalars
from torch.utils.data import DataLoader, TensorDataset

from spectral_callbacks import SpectralMonitor, SpectralTracker
from spectral_callbacks.functional import powerlaw_alpha
from spectral_callbacks.hf import SpectralTrainerCallback
from spectral_callbacks.names import histogram_tag, parse_tag, scalar_tag
from spectral_callbacks.targets import TargetWarning, UnwatchedExpertWarning, find_targets

transformers = pytest.importorskip("transformers")
# transformers 5 keeps a mixture's experts as 3-D parameters (experts.gate_up_proj, down_proj);
# before it, as a list of MLPs (the layout of test_experts_kept_as_a_list_of_mlps_...).
needs_fused_experts = pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="reads the experts as 3-D parameters: needs transformers 5.0",
)
MODELS = {
    "mixtral": mixtral,
    "qwen3-moe": qwen3_moe,
    "qwen2-moe": qwen2_moe,
    "olmoe": olmoe,
    "deepseek-v3": deepseek_v3,
}
EXPERT_ROLES = {"MLP_gate", "MLP_up", "MLP_down"}
# The first release with each model class (where the lower bound of transformers is older).
ADDED_IN = {"qwen3-moe": ("Qwen3MoeConfig", "4.51"), "deepseek-v3": ("DeepseekV3Config", "4.51")}


def models(*names):
    """``names`` as parameters, each skipped where this transformers has no such model."""
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                not hasattr(transformers, ADDED_IN[name][0]),
                reason=f"{name} needs transformers {ADDED_IN[name][1]}",
            ),
        )
        if name in ADDED_IN
        else name
        for name in names
    ]


def _find(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=TargetWarning)
        return find_targets(model)


@needs_fused_experts
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_expert_is_a_view_of_its_slice(name):
    model = MODELS[name]()
    targets = _find(model)
    experts = [t for t in targets if t.expert is not None]
    moe_layers = sorted({t.layer for t in experts})
    assert moe_layers == ([1, 2] if name == "deepseek-v3" else [0, 1, 2])  # dense first layer
    for layer in moe_layers:
        block = model.model.layers[layer].mlp
        for role in EXPERT_ROLES:
            found = sorted(t.expert for t in experts if (t.layer, t.role) == (layer, role))
            assert found == list(range(4))
        routers = [t for t in targets if (t.layer, t.role) == (layer, "Router")]
        assert len(routers) == 1
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        for t in (t for t in experts if t.layer == layer):
            half = gate_up.shape[1] // 2
            expected = {
                "MLP_gate": gate_up[t.expert, :half],
                "MLP_up": gate_up[t.expert, half:],
                "MLP_down": down[t.expert],
            }[t.role]
            assert t.matrix().data_ptr() == expected.data_ptr() and t.shape == expected.shape
    shared = {t.role for t in targets if "shared" in t.role}
    if name in ("deepseek-v3", "qwen2-moe"):
        assert shared == {"MLP_shared_gate", "MLP_shared_up", "MLP_shared_down"}
    else:
        assert not shared


class Recorder:
    def __init__(self) -> None:
        self.logged: dict[int, dict[str, float]] = defaultdict(dict)

    def log_metrics(self, metrics, step):
        self.logged[step].update(metrics)


def _exact(matrix: torch.Tensor, k: int) -> tuple[float, float]:
    s = torch.linalg.svdvals(matrix.double())
    stable = float((s**2).sum() / s[0] ** 2)
    alpha, _ = powerlaw_alpha(s[:k])
    return stable, float(alpha)


FIT = dict(
    metrics=["stable_rank", "alpha"],
    every_n_steps=2,
    log_spaced_until=0,
    synchronous=True,
    figures=False,
    experts="each",
)
STEPS = 8
SCHEDULED = [0, 2, 4, 6, 8]


def check_experts(logdir, weights, targets) -> None:
    """The checks of an expert fit, from its event files in ``logdir``: at every scheduled step
    each expert's stable rank within 1 % and alpha within 0.02 of float64 exact SVD of its matrix
    then (``weights``: step -> target name -> matrix), the mean/min/max scalars of each (layer,
    role) those of its experts' values, and its histogram over experts holding exactly them."""
    by_where = {(t.stack, t.layer, t.role, t.expert): t for t in targets if t.expert is not None}
    scalars, histograms = read_scalars(logdir), read_histograms(logdir)
    checked_steps = set()
    for step in SCHEDULED:
        experts: dict[tuple[str, int, str], list[float]] = defaultdict(list)
        for tag, series in scalars.items():
            parsed = parse_tag(tag)
            if parsed is None or parsed.expert is None or step not in series:
                continue
            value = series[step]
            t = by_where[(parsed.stack, parsed.layer, parsed.role, parsed.expert)]
            stable, alpha = _exact(weights[step][t.name], k=32)
            if parsed.metric == "stable_rank":
                assert value == pytest.approx(stable, rel=0.01), (tag, step)
            else:
                assert abs(value - alpha) <= 0.02, (tag, step)
            experts[(parsed.metric, parsed.layer, parsed.role)].append(value)
            checked_steps.add(step)
        assert len(experts) == 2 * len({(t.layer, t.role) for t in by_where.values()})
        for (metric, layer, role), values in experts.items():
            assert len(values) == 4
            for aggregate, expected in (
                ("mean", sum(values) / 4),
                ("min", min(values)),
                ("max", max(values)),
            ):
                tag = scalar_tag(metric, layer, role, aggregate=aggregate)
                assert math.isclose(scalars[tag][step], expected, rel_tol=1e-6), tag
            histogram = histograms[histogram_tag(metric, layer, role)][step]
            assert histogram.num == 4 and sum(histogram.bucket) == 4
            for got, expected in (
                (histogram.min, min(values)),
                (histogram.max, max(values)),
                (histogram.sum, sum(values)),
                (histogram.sum_squares, sum(v * v for v in values)),
            ):
                assert math.isclose(got, expected, rel_tol=1e-6), (metric, layer, role, step)
    assert sorted(checked_steps) == SCHEDULED


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2 * STEPS, 8), generator=torch.Generator().manual_seed(seed))


def _expert_matrices(model) -> dict[str, torch.Tensor]:
    return {
        t.name: t.matrix().detach().double().clone()
        for t in find_targets(model)
        if t.expert is not None
    }


# Each fit returns where it wrote, the experts' matrices at every step (when ``record``; the
# recorders find targets too) and the watched targets.


def fit_tracker(model, logdir, record=True):
    weights = {0: _expert_matrices(model)} if record else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with SpectralTracker(model, logdir=logdir, **FIT) as tracker:
        for step, tokens in enumerate(_tokens().split(2), start=1):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if record:
                weights[step] = _expert_matrices(model)
            tracker.step(step)
    return logdir, weights, tracker.targets


class MoEModule(LightningModule):
    """A transformers causal LM as a LightningModule (next-token loss on the batch)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_lightning(model, logdir, record=True):
    recorder = WeightRecorder()
    monitor = SpectralMonitor(**FIT)
    logger = TensorBoardLogger(str(logdir))
    loader = DataLoader(TensorDataset(_tokens()), batch_size=2)
    callbacks = [monitor, recorder] if record else [monitor]
    quiet_trainer(max_steps=STEPS, logger=logger, callbacks=callbacks).fit(MoEModule(model), loader)
    return logger.log_dir, recorder.weights, monitor.targets


def fit_hf(model, logdir, record=True):
    from transformers import Trainer, TrainingArguments

    recorder = HFWeightRecorder()
    callback = SpectralTrainerCallback(logdir=logdir, **FIT)
    args = TrainingArguments(
        output_dir=str(logdir.parent / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    samples = [{"input_ids": row, "labels": row} for row in _tokens()]
    callbacks = [callback, recorder] if record else [callback]
    Trainer(model=model, args=args, train_dataset=samples, callbacks=callbacks).train()
    assert callback.tracker is not None
    return logdir, recorder.weights, callback.tracker.targets


FRONTENDS = {"tracker": fit_tracker, "lightning": fit_lightning, "hf": fit_hf}


@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
@pytest.mark.parametrize("name", models("mixtral", "qwen3-moe", "deepseek-v3"))
def test_experts_along_a_fit_match_exact_svd_and_the_aggregates_their_experts(
    name, frontend, tmp_path
):
    torch.manual_seed(0)
    logdir, weights, targets = FRONTENDS[frontend](MODELS[name](), tmp_path / "runs")
    check_experts(logdir, weights, targets)


CALLERS = {
    "tracker": "SpectralTracker",
    "lightning": "SpectralMonitor",
    "hf": "SpectralTrainerCallback",
}


@needs_fused_experts
@pytest.mark.parametrize("frontend", sorted(FRONTENDS))
def test_experts_no_rule_reads_are_warned_about_once_when_training_starts(frontend, tmp_path):
    model = mixtral()
    unknown = torch.nn.Parameter(torch.randn(4, 8, 16))  # a layout no rule reads (and unused)
    model.model.layers[0].mlp.experts.register_parameter("scale_proj", unknown)
    with pytest.warns(UnwatchedExpertWarning):  # at build, by find_targets
        (listed,) = find_targets(model).unwatched_experts
    assert listed.startswith("model.layers.0.mlp.experts.scale_proj (4, 8, 16): 3-D")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FRONTENDS[frontend](model, tmp_path / "runs", record=False)
    said = [str(w.message) for w in caught if issubclass(w.category, UnwatchedExpertWarning)]
    assert len(said) == 1, said  # once, by the frontend, not once more by find_targets
    assert said[0].startswith(f"{CALLERS[frontend]}: MoE experts are not watched")
    assert "model.layers.0.mlp.experts.scale_proj (4, 8, 16)" in said[0]


def test_default_logs_aggregates_not_each_expert():
    model = mixtral()
    recorder = Recorder()
    with SpectralTracker(
        model, ["stable_rank"], writers=[recorder], synchronous=True, figures=False
    ) as tracker:
        tracker.step(1)
    tags = set().union(*recorder.logged.values())
    parsed = [parse_tag(tag) for tag in tags]
    assert not any(p is not None and p.expert is not None for p in parsed)
    assert "spectral_stable_rank/L01/MLP_down/max" in tags
    assert "spectral_stable_rank/L01/Q" in tags
    rows = tracker._reporter.rows()
    assert sorted(rows[rows.role == "MLP_down"].expert.dropna().unique()) == [0, 1, 2, 3]


def test_qwen2_moes_one_row_shared_expert_gate_is_left_out_without_a_warning():
    # Qwen2-MoE's `shared_expert_gate` is a Linear(hidden, 1): a 1 x 64 matrix here, as in the
    # report. Without its rule it was listed as a weight that "looks like a target".
    config = transformers.Qwen2MoeConfig(
        **{**SMALL, "hidden_size": 64}, intermediate_size=24, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.Qwen2MoeForCausalLM(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        targets = find_targets(model)
    assert [str(w.message) for w in caught if issubclass(w.category, TargetWarning)] == []
    gates = [s for s in targets.skipped if s.parameter_name.endswith("shared_expert_gate.weight")]
    assert [(s.shape, s.reason) for s in gates] == [
        ((1, 64), "MoE shared expert's gate (one row)")
    ] * SMALL["num_hidden_layers"]
    assert not [t.name for t in targets if "shared_expert_gate" in t.name]


class _Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.w2 = torch.nn.Linear(24, 16, bias=False)


class _Block(torch.nn.Module):
    """Attention and a mixture whose experts are a list of MLPs, as Mixtral was first written."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, name, torch.nn.Linear(16, 16, bias=False))
        self.block_sparse_moe = torch.nn.Module()
        self.block_sparse_moe.gate = torch.nn.Linear(16, 4, bias=False)
        self.block_sparse_moe.experts = torch.nn.ModuleList(_Expert() for _ in range(4))


def test_experts_kept_as_a_list_of_mlps_are_each_a_target_of_its_own():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(_Block() for _ in range(2))
    targets = _find(model)
    for layer, block in enumerate(model.layers):
        assert [t.role for t in targets if t.layer == layer and t.expert is None] == [
            "Q", "K", "V", "O", "Router",
        ]  # fmt: skip
        for expert, mlp in enumerate(block.block_sparse_moe.experts):
            found = {t.role: t for t in targets if (t.layer, t.expert) == (layer, expert)}
            assert sorted(found) == ["MLP_down", "MLP_gate", "MLP_up"]
            for role, linear in (("MLP_gate", mlp.w1), ("MLP_up", mlp.w3), ("MLP_down", mlp.w2)):
                assert found[role].matrix().data_ptr() == linear.weight.data_ptr()
    recorder = Recorder()
    with SpectralTracker(
        model, ["stable_rank"], writers=[recorder], synchronous=True, figures=False
    ) as tracker:
        tracker.step(1)
    exact = [
        _exact(mlp.w2.weight.detach(), k=32)[0] for mlp in model.layers[1].block_sparse_moe.experts
    ]
    logged = recorder.logged[0]
    assert logged["spectral_stable_rank/L01/MLP_down/mean"] == pytest.approx(
        sum(exact) / 4, rel=0.01
    )
    assert logged["spectral_stable_rank/L01/MLP_down/max"] == pytest.approx(max(exact), rel=0.01)


def test_switch_transformers_experts_are_watched_in_each_stack():
    model = switch_transformers()
    targets = _find(model)
    for stack, blocks in (("enc", model.encoder.block), ("dec", model.decoder.block)):
        dense = blocks[0].layer[-1].mlp  # sparse_step=2: every other block holds experts
        for role, linear in (("MLP_up", dense.wi), ("MLP_down", dense.wo)):
            (found,) = [t for t in targets if (t.stack, t.layer, t.role) == (stack, 0, role)]
            assert found.expert is None and found.matrix().data_ptr() == linear.weight.data_ptr()
        for layer, block in enumerate(blocks):
            if not block.is_sparse:
                continue
            experts = block.layer[-1].mlp.experts
            for role, leaf in (("MLP_up", "wi"), ("MLP_down", "wo")):
                found = sorted(
                    (t.expert, t.matrix().data_ptr())
                    for t in targets
                    if (t.stack, t.layer, t.role) == (stack, layer, role)
                )
                expected = [
                    (e, getattr(experts[f"expert_{e}"], leaf).weight.data_ptr()) for e in range(4)
                ]
                assert found == expected, (stack, layer, role)


@needs_fused_experts
def test_an_analyzed_mixture_logs_its_experts_aggregates_and_histograms(tmp_path):
    from spectral_callbacks.offline.analysis import analyze_model, write_scalars

    model = mixtral()
    rows, num_layers = analyze_model(model)
    write_scalars(rows, num_layers, tmp_path)
    scalars, histograms = read_scalars(tmp_path), read_histograms(tmp_path)
    down = [_exact(e, k=32)[0] for e in model.model.layers[1].mlp.experts.down_proj.detach()]
    tag = "spectral_stable_rank/L01/MLP_down"
    assert scalars[f"{tag}/mean"][0] == pytest.approx(sum(down) / 4, rel=0.01)
    assert scalars[f"{tag}/min"][0] == pytest.approx(min(down), rel=0.01)
    assert tag not in scalars  # one expert would have overwritten the next under one tag
    assert histograms[tag][0].num == 4
    assert histograms[tag][0].max == pytest.approx(max(down), rel=0.01)
