"""lr_balance: TempBalance's factors from the logged ESD α, applied around each optimizer step.

Each fit records, inside the optimizer's own ``step``, the learning rate every param group is used
with and the scheduler's value at that moment; the factor a group should carry is read back from
what the run logged (``spectral_lr_factor/...`` at the ESD snapshots), so the checks do not read the
balancer's own state.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gpt import GPT, GPTConfig
from lightning.pytorch import seed_everything
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tiny_models import RecordingLogger, TinyGPT, quiet_trainer, read_scalars, token_loader

from spectral_callbacks import LRBalance, SpectralTracker, balanced_param_groups
from spectral_callbacks.functional.balance import tempbalance_factors
from spectral_callbacks.integrations.lightning import SpectralMonitor
from spectral_callbacks.monitor.balancer import LRBalancer
from spectral_callbacks.monitor.options import ConfigurationError, MonitorOptions
from spectral_callbacks.names import parse_tag, scalar_tag
from spectral_callbacks.targets import find_targets

STEPS = 40
# Snapshots at 0, 5, ..., 40; the ESD on every second one (0, 10, 20, 30, 40), so between two ESD
# snapshots the factors are the latest α's.
BALANCED: dict[str, Any] = dict(
    every_n_steps=5,
    log_spaced_until=0,
    esd_every_n_snapshots=2,
    synchronous=True,  # each result is read at its own step: the factor's step is known
    figures=False,
    k=8,
)


class RecordingAdamW(torch.optim.AdamW):
    """AdamW that records, inside ``step``, each group's learning rate and the scheduler's values."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler: Any = None
        self.used: list[list[float]] = []  # per update: each group's lr as the step reads it
        self.scheduled: list[list[float]] = []  # per update: the scheduler's value of each group
        self.scheduler_states: list[dict[str, Any]] = []  # per update: the scheduler's state

    def step(self, closure: Any = None) -> Any:
        self.used.append([group["lr"] for group in self.param_groups])
        self.scheduled.append(list(self.scheduler.get_last_lr()))
        self.scheduler_states.append(copy.deepcopy(self.scheduler.state_dict()))
        return super().step(closure)


def _group_tags(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str | None]:
    """The logged factor tag of each param group (a watched matrix of it), ``None`` for the rest."""
    targets = find_targets(model)
    of_parameter = {id(target.parameter): target for target in targets}
    modules = list(model.modules())
    tags: list[str | None] = []
    for group in optimizer.param_groups:
        tag = None
        for parameter in group["params"]:
            for module in modules:
                if any(p is parameter for p in module.parameters(recurse=False)):
                    weight = getattr(module, "weight", None)
                    if weight is not None and id(weight) in of_parameter:
                        target = of_parameter[id(weight)]
                        tag = scalar_tag("lr_factor", target.layer, target.role)
        tags.append(tag)
    return tags


def _factor_at(series: dict[int, float]) -> Callable[[int], float]:
    """The factor in force at update ``t``: logged at the latest ESD step ``s < t - 1`` (else 1).

    The snapshot of step ``s`` is taken after update ``s``; even computed inline, its results are
    read at the next ``tracker.step``, after update ``s + 1``, so update ``s + 2`` is the first to
    carry them.
    """

    def factor(update: int) -> float:
        steps = [step for step in series if step < update - 1]
        return series[max(steps)] if steps else 1.0

    return factor


def _check_used_rates(
    optimizer: RecordingAdamW, tags: list[str | None], logged: dict[str, dict[int, float]]
) -> None:
    assert len(optimizer.used) == STEPS
    moved = 0
    for update, (used, scheduled) in enumerate(
        zip(optimizer.used, optimizer.scheduled, strict=True), start=1
    ):
        for group, tag in enumerate(tags):
            factor = 1.0 if tag is None else _factor_at(logged[tag])(update)
            assert used[group] == pytest.approx(scheduled[group] * factor, rel=1e-6), (
                update,
                group,
            )
            moved += factor != pytest.approx(1.0)
    assert moved > STEPS  # the factors were not all 1: the check above can fail


class BalancedGPT(TinyGPT):
    """TinyGPT with per-matrix groups (weight decay on matrices) and a 40-step cosine schedule."""

    def configure_optimizers(self) -> Any:
        optimizer = RecordingAdamW(balanced_param_groups(self, weight_decay=0.1), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS, eta_min=1e-4)
        optimizer.scheduler = scheduler
        self.recording = optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _lightning_fit(balance: LRBalance | None) -> tuple[BalancedGPT, RecordingLogger]:
    seed_everything(0, verbose=False)
    module = BalancedGPT()
    logger = RecordingLogger()
    monitor = SpectralMonitor(lr_balance=balance, **BALANCED)
    quiet_trainer(max_steps=STEPS, logger=logger, callbacks=[monitor]).fit(module, token_loader())
    return module, logger


def test_lightning_cosine_uses_the_scheduler_rate_times_the_factor_and_keeps_its_state() -> None:
    module, logger = _lightning_fit(LRBalance())
    optimizer = module.recording
    tags = _group_tags(module, optimizer)
    logged = {tag: logger.series(tag) for tag in tags if tag is not None}
    assert sorted(next(iter(logged.values()))) == [0, 10, 20, 30, 40]  # the ESD snapshots
    _check_used_rates(optimizer, tags, logged)
    plain, _ = _lightning_fit(None)
    # The scheduler's own values and state are those of the run without the balancer.
    assert optimizer.scheduled == plain.recording.scheduled
    assert optimizer.scheduler_states == plain.recording.scheduler_states
    assert optimizer.used != plain.recording.used
    assert [g["lr"] for g in optimizer.param_groups] == [
        g["lr"] for g in plain.recording.param_groups
    ]


def _plain_loop(
    logdir: Path | None, balance: LRBalance | None, steps: int = STEPS
) -> tuple[GPT, RecordingAdamW]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    optimizer = RecordingAdamW(balanced_param_groups(model, weight_decay=0.1), lr=1e-2)
    optimizer.scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
    tokens = torch.randint(0, 256, (steps, 4, 17), generator=torch.Generator().manual_seed(1))
    tracker = None
    if balance is not None:
        tracker = SpectralTracker(
            model, logdir=logdir, optimizer=optimizer, lr_balance=balance, **BALANCED
        )
    for step in range(1, steps + 1):
        _, loss = model(tokens[step - 1, :, :-1], tokens[step - 1, :, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.scheduler.step()
        if tracker is not None:
            tracker.step(step)
    if tracker is not None:
        tracker.close()
    return model, optimizer


def test_plain_loop_exponential_lr_uses_the_chained_rate_times_the_factor(tmp_path: Path) -> None:
    model, optimizer = _plain_loop(tmp_path, LRBalance())
    logged = read_scalars(tmp_path)
    tags = _group_tags(model, optimizer)
    _check_used_rates(optimizer, tags, logged)
    _, plain = _plain_loop(None, None)
    assert optimizer.scheduled == plain.scheduled  # ExponentialLR chains on group["lr"]
    assert optimizer.scheduler_states == plain.scheduler_states
    assert optimizer.scheduler.state_dict() == plain.scheduler.state_dict()


def _unit_alpha(alpha: dict[tuple[int, str], float], per: str) -> dict[Any, float]:
    """The α of each unit of the example GPT: c_attn holds Q, K and V, one unit per module
    (``per="matrix"``) or per block (``per="layer"``)."""
    module_of = {"Q": "c_attn", "K": "c_attn", "V": "c_attn", "O": "attn.c_proj"}
    units: dict[Any, list[float]] = {}
    for (layer, role), value in alpha.items():
        key = layer if per == "layer" else (layer, module_of.get(role, role))
        units.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in units.items()}


@pytest.mark.parametrize("fit", ["median", "xmin_scan"])
@pytest.mark.parametrize("per", ["matrix", "layer"])
def test_logged_factors_are_tempbalance_map_of_the_logged_alpha(
    tmp_path: Path, per: str, fit: str
) -> None:
    balance = LRBalance(low=0.6, high=1.4, per=per, fit=fit)
    _plain_loop(tmp_path, balance, steps=20)
    logged = read_scalars(tmp_path)
    read = f"spectral_{balance.alpha_metric}/L"  # esd_alpha_median, or esd_alpha
    alpha_tags = {tag: parse_tag(tag) for tag in logged if tag.startswith(read)}
    esd_steps = sorted(next(iter(logged[tag] for tag in alpha_tags)))
    assert esd_steps == [0, 10, 20]
    for step in esd_steps:
        alpha = {(p.layer, p.role): logged[tag][step] for tag, p in alpha_tags.items()}
        units = _unit_alpha(alpha, per)
        keys = list(units)
        # TempBalance's tb_linear_map, as its reference code computes it
        mapped = np.interp(
            [units[k] for k in keys], [min(units.values()), max(units.values())], [0.6, 1.4]
        )
        factor_of = dict(zip(keys, mapped, strict=True))
        for layer, role in alpha:
            key = (
                layer
                if per == "layer"
                else (
                    layer,
                    {"Q": "c_attn", "K": "c_attn", "V": "c_attn", "O": "attn.c_proj"}.get(
                        role, role
                    ),
                )
            )
            tag = scalar_tag("lr_factor", layer, role)
            assert logged[tag][step] == pytest.approx(factor_of[key], abs=1e-5), (step, tag)
        assert {round(float(f), 6) for f in mapped} >= {0.6, 1.4}


def test_tempbalance_factors_match_numpy_interp_in_float64() -> None:
    generator = torch.Generator().manual_seed(3)
    alpha = 2 + 4 * torch.rand(50, generator=generator, dtype=torch.float64)
    expected = np.interp(alpha.numpy(), [alpha.min().item(), alpha.max().item()], [0.7, 1.3])
    assert torch.allclose(
        tempbalance_factors(alpha), torch.from_numpy(expected), rtol=0, atol=1e-15
    )
    with_nan = torch.cat([alpha[:3], torch.tensor([math.nan], dtype=torch.float64)])
    factors = tempbalance_factors(with_nan, low=0.5, high=1.5)
    assert factors[3] == 1.0 and factors[:3].min() == 0.5 and factors[:3].max() == 1.5


def test_a_failed_fit_leaves_every_factor_as_it_was() -> None:
    """A NaN or infinite ESD α (a fit that failed at one snapshot) is no news: every unit keeps
    its latest α and factor. Taken as that unit's α, it would reset its factor to 1 and move the
    band's end for every other unit."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    targets = find_targets(model)
    balance = LRBalance()
    balancer = LRBalancer(balance, model, targets, "test")
    alphas = {t.name: 2.0 + 0.25 * i for i, t in enumerate(targets)}
    fitted = balance.alpha_metric  # the α of the balancer's fit (TempBalance's median by default)
    assert balancer.update({name: {fitted: alpha} for name, alpha in alphas.items()})
    before = list(balancer.factors)
    # The failed fits hit the units at both ends of the band: the case where the others move.
    ends = [targets[0].name, targets[-1].name]
    assert [balancer.factor_of(name) for name in ends] == [min(before), max(before)]
    assert min(before) < max(before)
    failed = {ends[0]: {fitted: math.nan}, ends[1]: {fitted: math.inf}}
    changed = balancer.update(failed)
    assert balancer.factors == before
    assert balancer.alpha == alphas and not changed


def test_a_tensor_learning_rate_is_scaled_in_place_and_keeps_its_object() -> None:
    # a compiled optimizer step or capturable=True holds lr as a Tensor: replacing it by a new
    # tensor (lr * factor) would recompile the step, or be ignored by a captured CUDA graph
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    targets = find_targets(model)
    groups = balanced_param_groups(model)
    for group in groups:
        group["lr"] = torch.tensor(0.1)
    optimizer = torch.optim.SGD(groups, lr=torch.tensor(0.1))
    balance = LRBalance()
    balancer = LRBalancer(balance, model, targets, "test")
    balancer.attach(optimizer)
    alphas = {t.name: {balance.alpha_metric: 2.0 + 0.25 * i} for i, t in enumerate(targets)}
    balancer.update(alphas)
    assert min(balancer.factors) < 1.0 < max(balancer.factors)
    objects = [group["lr"] for group in optimizer.param_groups]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert [group["lr"] for group in optimizer.param_groups] == objects  # the same objects
    assert all(bool(group["lr"] == torch.tensor(0.1)) for group in groups)  # its value put back
    for target in targets:
        factor = balancer.factor_of(target.name)
        moved = before[target.parameter_name] - target.parameter.detach()
        assert torch.allclose(moved, torch.full_like(moved, 0.1 * factor), rtol=1e-5), target.name


def test_a_param_group_mixing_a_watched_matrix_is_refused_in_one_line() -> None:
    seed_everything(0, verbose=False)
    trainer = quiet_trainer(
        max_steps=2, logger=RecordingLogger(), callbacks=[SpectralMonitor(lr_balance=LRBalance())]
    )
    with pytest.raises(
        MisconfigurationException, match=r"param group 0 holds '.*' together with"
    ) as error:
        trainer.fit(TinyGPT(), token_loader())  # one AdamW group of every parameter
    assert "\n" not in str(error.value) and "balanced_param_groups" in str(error.value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"low": 0}, r"`low` must be a finite factor > 0 .*, got 0$"),
        ({"low": -0.5}, r"`low` must be a finite factor > 0 .*, got -0.5$"),
        ({"low": float("nan")}, r"`low` must be a finite factor > 0 .*, got nan$"),
        ({"low": float("inf")}, r"`low` must be a finite factor > 0 .*, got inf$"),
        ({"low": "0.7"}, r"`low` must be a finite factor > 0 .*, got '0.7'$"),
        ({"low": True}, r"`low` must be a finite factor > 0 .*, got True$"),
        ({"low": 1.5, "high": 1.0}, r"`high` must be a finite factor >= low=1.5 .*, got 1.0$"),
        ({"high": float("nan")}, r"`high` must be a finite factor >= low=0.7 .*, got nan$"),
        ({"high": "1.3"}, r"`high` must be a finite factor >= low=0.7 .*, got '1.3'$"),
        ({"per": "block"}, r"`per` must be one of \('matrix', 'layer'\), got 'block'$"),
        ({"per": None}, r"`per` must be one of \('matrix', 'layer'\), got None$"),
    ],
)
def test_a_bad_band_or_granularity_fails_at_construction(
    arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as error:
        LRBalance(**arguments)  # type: ignore[arg-type]
    assert "\n" not in str(error.value)


def test_a_good_band_constructs_and_a_replaced_field_is_checked_again() -> None:
    assert LRBalance(low=1, high=1, per="layer") == LRBalance(low=1.0, high=1.0, per="layer")
    with pytest.raises(ConfigurationError, match=r"`low` must be a finite factor > 0"):
        dataclasses.replace(LRBalance(), low=0.0)


def test_lr_balance_must_be_an_lr_balance() -> None:
    with pytest.raises(ConfigurationError, match=r"`lr_balance` must be None or an LRBalance"):
        MonitorOptions(lr_balance=(0.7, 1.3))


def test_the_optimizer_is_needed_with_the_balancer_and_only_with_it(tmp_path: Path) -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(ConfigurationError, match="`lr_balance` needs the optimizer"):
        SpectralTracker(model, logdir=tmp_path, lr_balance=LRBalance(), figures=False)
    optimizer = torch.optim.SGD(balanced_param_groups(model), lr=0.1)
    with pytest.raises(ConfigurationError, match="`optimizer` must be None without `lr_balance`"):
        SpectralTracker(model, logdir=tmp_path, optimizer=optimizer, figures=False)


def test_the_factors_are_saved_and_restored_with_the_state(tmp_path: Path) -> None:
    model, optimizer = _plain_loop(tmp_path / "first", LRBalance(), steps=10)
    first = SpectralTracker(
        model,
        logdir=tmp_path / "again",
        optimizer=optimizer,
        lr_balance=LRBalance(),
        start_step=None,
        **BALANCED,
    )
    tracker = SpectralTracker(
        model, logdir=tmp_path / "run", optimizer=optimizer, lr_balance=LRBalance(), **BALANCED
    )
    tracker.close()
    state = tracker.state_dict()
    assert set(state["lr_balance"]["alpha"]) == {t.name for t in tracker.targets}
    first.load_state_dict(state)
    assert first._balancer is not None and tracker._balancer is not None
    assert first._balancer.factors == tracker._balancer.factors
    assert any(f != 1.0 for f in first._balancer.factors)
    first.close()


def test_hf_trainer_optimizer_uses_its_scheduler_rate_times_the_factor(tmp_path: Path) -> None:
    from hf_train import samples, tiny_gpt2
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from spectral_callbacks.hf import SpectralTrainerCallback

    class SchedulerIntoOptimizer(TrainerCallback):
        def on_train_begin(self, *args: Any, lr_scheduler: Any = None, **kwargs: Any) -> None:
            optimizer.scheduler = lr_scheduler

    model = tiny_gpt2()
    optimizer = RecordingAdamW(balanced_param_groups(model, weight_decay=0.01), lr=1e-2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        lr_scheduler_type="cosine",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = SpectralTrainerCallback(
        logdir=tmp_path / "spectral", lr_balance=LRBalance(), **BALANCED
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=samples(2 * STEPS),
        optimizers=(optimizer, None),  # the Trainer makes its cosine scheduler on it
        callbacks=[SchedulerIntoOptimizer(), callback],
    )
    trainer.train()
    tags = _group_tags(model, optimizer)
    _check_used_rates(optimizer, tags, read_scalars(tmp_path / "spectral"))
