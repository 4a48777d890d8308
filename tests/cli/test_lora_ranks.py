"""``rank-layers RUN --lora``: each adapted module's update energy rank, its suggested r, and a
rank_pattern that PEFT applies to the same modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from spectral_callbacks import SpectralTracker
from spectral_callbacks.cli.main import main as cli
from spectral_callbacks.offline.ranking import module_key, round_rank

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R = 8


def _base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    logdir = tmp_path_factory.mktemp("lora")
    model = get_peft_model(_base(), LoraConfig(r=R, lora_alpha=16, target_modules=MODULES))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    tokens = torch.randint(0, 64, (12, 4, 16), generator=torch.Generator().manual_seed(1))
    with SpectralTracker(model, logdir=logdir, every_n_steps=4, figures=False) as tracker:
        for step in range(1, 13):
            model(input_ids=tokens[step - 1], labels=tokens[step - 1]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
    return logdir, model


def _exact_energy_rank(layer: torch.nn.Module, energy: float) -> int:
    """The energy rank of s·B·A in float64 from the layer's factors (the reference)."""
    delta = layer.scaling["default"] * (
        layer.lora_B["default"].weight.double() @ layer.lora_A["default"].weight.double()
    )
    squares = torch.linalg.svdvals(delta) ** 2
    share = torch.cumsum(squares, 0) / squares.sum()
    return int((share < energy - 1e-6).sum()) + 1


def _adapted(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {
        module_key(f"{name}.base_layer.weight"): module
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "base_layer")
    }


def test_lora_ranks_are_the_exact_energy_ranks_and_the_pattern_pastes(
    lora_run: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir, model = lora_run
    out = tmp_path / "ranks.json"
    assert cli(["rank-layers", str(logdir), "--lora", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["where"] == "logged at step 12"
    layers = _adapted(model)
    modules = {row["module"]: row for row in saved["modules"]}
    assert set(modules) == set(layers)  # every adapted module, by the name PEFT gives it
    suggested_below_r = 0
    for key, row in modules.items():
        exact = _exact_energy_rank(layers[key], 0.9)
        assert row["energy_rank_90"] == exact, key
        assert row["r"] == R
        assert row["suggested_r"] == min(R, round_rank(exact))
        out_features, in_features = (int(n) for n in row["shape"].split("x"))
        assert row["params_saved"] == (R - row["suggested_r"]) * (out_features + in_features)
        assert saved["alpha_pattern"][key] == pytest.approx(2.0 * row["suggested_r"])
        suggested_below_r += row["suggested_r"] < R
    assert suggested_below_r > 0  # the check of the pattern below can fail
    assert "rank_pattern = {" in printed and "alpha_pattern = {" in printed
    # Pasted into a LoraConfig, the pattern gives each module exactly its suggested r.
    config = LoraConfig(
        r=R,
        lora_alpha=16,
        target_modules=MODULES,
        rank_pattern=saved["rank_pattern"],
        alpha_pattern=saved["alpha_pattern"],
    )
    again = _adapted(get_peft_model(_base(), config))
    for key, layer in again.items():
        assert layer.r["default"] == modules[key]["suggested_r"], key
        assert layer.scaling["default"] == pytest.approx(2.0), key  # s = alpha / r kept


def test_another_threshold_is_exact_within_the_logged_singular_values(
    lora_run: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    logdir, model = lora_run
    out = tmp_path / "ranks.json"
    assert cli(["rank-layers", str(logdir), "--lora", "--energy", "0.5", "--round-to", "3",
                "--json", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    layers = _adapted(model)
    exact_rows = [row for row in saved["modules"] if not row["bound"]]
    assert exact_rows
    for row in exact_rows:
        exact = _exact_energy_rank(layers[row["module"]], 0.5)
        assert row["energy_rank"] == exact, row["module"]
        assert row["suggested_r"] == min(R, -(-exact // 3) * 3)
    for row in saved["modules"]:
        if row["bound"]:  # beyond the 4 logged values: the 90 % rank bounds it
            assert row["energy_rank"] == row["energy_rank_90"] >= 4


def test_a_bad_threshold_and_a_run_without_adapters_are_refused(
    lora_run: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logdir, _ = lora_run
    assert cli(["rank-layers", str(logdir), "--lora", "--energy", "1.5"]) != 0
    assert "`--energy` must be a fraction in (0, 1], got 1.5" in capsys.readouterr().err
    dense = tmp_path / "dense"
    with SpectralTracker(_base(), logdir=dense, figures=False) as tracker:
        tracker.step(1)
    assert cli(["rank-layers", str(dense), "--lora"]) != 0
    assert "no adapted matrix" in capsys.readouterr().err


@pytest.mark.parametrize("use_dora", [False, True], ids=["rsLoRA", "rsLoRA+DoRA"])
def test_an_rslora_runs_alpha_pattern_keeps_every_modules_scaling_when_pasted(
    tmp_path: Path, use_dora: bool
) -> None:
    # Under rsLoRA s = lora_alpha / sqrt(r): alphas of s * r (LoRA's relation) would change each
    # module's scaling by sqrt(r_suggested) (2.8x at r = 8).
    config = dict(r=R, lora_alpha=16, target_modules=MODULES, use_rslora=True, use_dora=use_dora)
    model = get_peft_model(_base(), LoraConfig(**config))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    tokens = torch.randint(0, 64, (8, 4, 16), generator=torch.Generator().manual_seed(2))
    with SpectralTracker(model, logdir=tmp_path / "run", every_n_steps=4, figures=False) as tracker:
        for step in range(1, 9):
            model(input_ids=tokens[step - 1], labels=tokens[step - 1]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.step(step)
    out = tmp_path / "ranks.json"
    assert cli(["rank-layers", str(tmp_path / "run"), "--lora", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert {row["scaling_rule"] for row in saved["modules"]} == {"rslora"}
    assert any(row["suggested_r"] < R for row in saved["modules"])  # the scalings can differ
    pasted = LoraConfig(
        **config, rank_pattern=saved["rank_pattern"], alpha_pattern=saved["alpha_pattern"]
    )
    run_layers, again = _adapted(model), _adapted(get_peft_model(_base(), pasted))
    assert set(again) == set(run_layers)
    for key, layer in again.items():
        assert layer.r["default"] == saved["rank_pattern"][key], key
        want = run_layers[key].scaling["default"]  # 16 / sqrt(8), as the run had it
        assert layer.scaling["default"] == pytest.approx(want, rel=1e-5), key
