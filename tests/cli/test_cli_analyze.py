"""`spectral-callbacks analyze` and `targets` on small random-weight models saved to disk."""

from __future__ import annotations

from pathlib import Path

import lightning
import numpy as np
import pandas as pd
import pytest
import torch
from cli_runs import TinyTransformer, run_cli, training_runs
from safetensors.torch import save_file
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from spectral_callbacks import charts
from spectral_callbacks.cli.main import main
from spectral_callbacks.offline.events import read_runs
from spectral_callbacks.targets import find_targets

ROLES = ["Q", "K", "V", "O", "MLP_up", "MLP_down"]


def _exact_stable_ranks(model: torch.nn.Module) -> dict[tuple[int, str], float]:
    """Stable rank of every target from the exact float64 SVD."""
    ranks = {}
    for target in find_targets(model):
        s = torch.linalg.svdvals(target.matrix().detach().double())
        ranks[(target.layer, target.role)] = float((s.square().sum() / s[0] ** 2).item())
    return ranks


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT2LMHeadModel]:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=3,
        n_embd=64,
        n_head=4,
        vocab_size=96,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BertModel]:
    torch.manual_seed(1)
    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=96,
        max_position_embeddings=32,
    )
    model = BertModel(config).eval()
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path, safe_serialization=False)  # pytorch_model.bin, the other format
    return path, model


def _analyzed(logdir: Path) -> pd.DataFrame:
    result = read_runs([logdir])
    assert result.problems == [] and result.notes == []
    return result.rows


def _check_against_exact(
    rows: pd.DataFrame, model: torch.nn.Module, num_layers: int, rel: float = 0.01
) -> None:
    exact = _exact_stable_ranks(model)
    ranks = rows[(rows.metric == "stable_rank") & rows.layer.notna()]
    got = {(int(r.layer), r.role): r.value for r in ranks.itertuples()}
    assert (
        set(got) == {(layer, role) for layer in range(num_layers) for role in ROLES} == set(exact)
    )
    for key, value in got.items():
        assert value == pytest.approx(exact[key], rel=rel), key
    assert set(rows.metric) >= {
        "stable_rank",
        "alpha",
        "alpha_r2",
        "spectral_norm",
        "frobenius_norm",
    }
    np.testing.assert_allclose(ranks.depth, ranks.layer.astype(float) / (num_layers - 1))


@pytest.mark.parametrize("which", ["gpt2", "bert"])
def test_analyze_hf_directory_matches_exact_svd(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, model = request.getfixturevalue(which)
    num_layers = 3 if which == "gpt2" else 2
    assert main(["analyze", str(path), "--logdir", str(tmp_path / which), "--step", "7"]) == 0
    rows = _analyzed(tmp_path / which)
    assert set(rows.step) == {7} and set(rows.run) == {which}
    _check_against_exact(rows, model, num_layers)
    means = rows[(rows.metric == "stable_rank") & rows.layer.isna()].set_index("role").value
    per_layer = (
        rows[(rows.metric == "stable_rank") & rows.layer.notna()].groupby("role").value.mean()
    )
    np.testing.assert_allclose(
        means.sort_index(), per_layer.sort_index().astype(np.float32), rtol=1e-6
    )
    out = capsys.readouterr().out
    assert "MLP↑" in out and "stable rank / α" in out
    assert sum(line.strip("│ ").split(" ")[0].isdigit() for line in out.splitlines()) == num_layers


def test_analyzed_model_plots_beside_a_training_run(
    gpt2: tuple[Path, GPT2LMHeadModel], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    training = training_runs(tmp_path_factory) / "tb" / "a"
    assert main(["analyze", str(gpt2[0]), "--logdir", str(tmp_path / "gpt2")]) == 0
    out = tmp_path / "alpha.png"
    assert (
        main(
            ["plot", str(training), str(tmp_path / "gpt2"), "--kind", "alpha-depth", "-o", str(out)]
        )
        == 0
    )
    assert out.stat().st_size > 5000
    rows = read_runs([training, tmp_path / "gpt2"]).rows
    lines = charts.alpha_vs_depth(rows).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["a", "gpt2"]
    np.testing.assert_array_equal(lines[1].get_xdata(), [0.0, 0.5, 1.0])
    expected = rows[(rows.run == "gpt2") & (rows.metric == "alpha") & (rows.role == "Q")].dropna(
        subset=["layer"]
    )
    np.testing.assert_array_equal(lines[1].get_ydata(), expected.sort_values("layer").value)


def test_state_dict_and_checkpoints_with_an_architecture_hint(
    gpt2: tuple[Path, GPT2LMHeadModel], tmp_path: Path
) -> None:
    path, model = gpt2
    # A plain state_dict of the LM-head model ("transformer." prefix) into the bare GPT2Model.
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    assert (
        main(
            [
                "analyze",
                str(tmp_path / "weights.pt"),
                "--arch",
                f"hf:{path}",
                "--logdir",
                str(tmp_path / "pt"),
            ]
        )
        == 0
    )
    _check_against_exact(_analyzed(tmp_path / "pt"), model, 3)
    # safetensors, keys without a prefix.
    save_file(
        {k: v.contiguous() for k, v in model.transformer.state_dict().items()},
        tmp_path / "w.safetensors",
    )
    assert (
        main(
            [
                "analyze",
                str(tmp_path / "w.safetensors"),
                "--arch",
                f"hf:{path / 'config.json'}",
                "--logdir",
                str(tmp_path / "st"),
                "--method",
                "svdvals",
            ]
        )
        == 0
    )
    # An exact method: the only difference left is float32 storage in the event file.
    _check_against_exact(_analyzed(tmp_path / "st"), model, 3, rel=1e-5)
    # A Lightning-style checkpoint of a module holding the network as `model`.
    # Saved in torch's legacy (pre-zip) format: the loader sniffs the format before unpickling.
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save(
        {"state_dict": state, "hyper_parameters": {}},
        tmp_path / "hf.ckpt",
        _use_new_zipfile_serialization=False,
    )
    assert (
        main(
            [
                "analyze",
                str(tmp_path / "hf.ckpt"),
                "--arch",
                f"hf:{path}",
                "--logdir",
                str(tmp_path / "ck"),
            ]
        )
        == 0
    )
    _check_against_exact(_analyzed(tmp_path / "ck"), model, 3)


def test_lightning_checkpoint_rebuilt_from_hyper_parameters(tmp_path: Path) -> None:
    module = TinyTransformer(lr=1e-3, seed=5)
    checkpoint = {
        "state_dict": module.state_dict(),
        "hyper_parameters": dict(module.hparams),
        "pytorch-lightning_version": lightning.__version__,
    }
    torch.save(checkpoint, tmp_path / "last.ckpt")
    argv = [
        "analyze",
        str(tmp_path / "last.ckpt"),
        "--arch",
        "cli_runs:TinyTransformer",
        "--logdir",
        str(tmp_path / "run"),
        "--step",
        "30",
    ]
    assert main(argv) == 0
    rows = _analyzed(tmp_path / "run")
    _check_against_exact(rows, module, 3)
    assert set(rows.step) == {30}


def test_targets_prints_the_role_map(
    gpt2: tuple[Path, GPT2LMHeadModel], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["targets", str(gpt2[0])]) == 0
    out = capsys.readouterr().out
    assert (
        "h.2.attn.c_attn.weight[V]" in out
        and "(256, 64)" in out
        and "18 targets in 3 layers" in out
    )


def test_bad_models_one_line_each(
    gpt2: tuple[Path, GPT2LMHeadModel],
    bert: tuple[Path, BertModel],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    done = run_cli("analyze", notes, "--logdir", tmp_path / "x")
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 1
    assert line.startswith(
        f"spectral-callbacks analyze: error: {notes}: unknown model format '.txt'; give a Hugging Face"
    )
    assert not (tmp_path / "x").exists()

    torch.save(bert[1].state_dict(), tmp_path / "bert.pt")
    cases = {
        str(tmp_path / "missing"): ([], "missing: no such file or directory"),
        str(tmp_path): ([], "a directory without config.json is not a Hugging Face model"),
        str(tmp_path / "bert.pt"): (
            [],
            "a state_dict holds weights but not the architecture; give an architecture hint, "
            "hf:CONFIG_DIR or module:Class (set with --arch HINT)",
        ),
        str(tmp_path / "bert.pt") + " ": (
            ["--arch", "nocolon"],
            "must be hf:CONFIG_DIR or module:Class",
        ),
        str(tmp_path / "bert.pt") + "  ": (
            ["--arch", f"hf:{gpt2[0]}"],
            "the weights do not fit the architecture",
        ),
    }
    for source, (extra, message) in cases.items():
        assert main(["analyze", source.strip(), "--logdir", str(tmp_path / "x"), *extra]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, (source, err)
    assert main(["targets", str(notes)]) == 1
    assert "unknown model format" in capsys.readouterr().err


def test_write_scalars_leaves_out_values_that_are_not_finite(tmp_path: Path) -> None:
    from spectral_callbacks.offline.analysis import write_scalars

    rows = pd.DataFrame(
        {
            "layer": [0, 1, 0, 1],
            "role": ["Q", "Q", "K", "K"],
            "parameter": ["q0", "q1", "k0", "k1"],
            "shape": ["4x4"] * 4,
            "stable_rank": [2.0, np.nan, 3.0, 5.0],  # one matrix with NaN weights
            "energy_rank_90": [np.nan] * 4,  # beyond the top k everywhere
        }
    )
    tags = write_scalars(rows, num_layers=2, logdir=tmp_path)
    read = read_runs([tmp_path]).rows
    assert not any(tag.startswith("spectral_energy_rank_90/") for tag in tags)
    assert set(read["metric"]) == {"stable_rank"} and read["value"].notna().all()
    means = read[read["layer"].isna()].set_index("role")["value"]
    assert means.to_dict() == {"Q": 2.0, "K": 4.0}  # the mean of the finite layers
    assert len(read) == 3 + 2


def test_the_printed_table_has_a_row_per_stack_and_layer_and_the_experts_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: cells keyed by (layer, role), so T5's decoder overwrote its encoder's layers and an
    # MoE cell showed whichever expert came last.
    from transformers import MixtralConfig, MixtralForCausalLM, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3,
                 num_heads=4)
    )  # fmt: skip
    t5.save_pretrained(tmp_path / "t5")
    assert (
        main(["analyze", str(tmp_path / "t5"), "--logdir", str(tmp_path / "a"), "--method", "gram"])
        == 0
    )
    captured = capsys.readouterr()
    assert "matrices of 5 layers (enc 2, dec 3) written" in captured.err
    rows = _table_rows(captured.out)
    assert [row[:2] for row in rows if row[0] in ("enc", "dec")] == [
        ["enc", "0"], ["enc", "1"], ["dec", "0"], ["dec", "1"], ["dec", "2"]
    ]  # fmt: skip
    enc_q = t5.encoder.block[1].layer[0].SelfAttention.q.weight.detach().double()
    dec_q = t5.decoder.block[1].layer[0].SelfAttention.q.weight.detach().double()
    for stack, weight in (("enc", enc_q), ("dec", dec_q)):
        (row,) = [row for row in rows if row[:2] == [stack, "1"]]
        assert row[2].startswith(f"{_stable_rank(weight):.1f} / ")  # the first role column: Q

    mixtral = MixtralForCausalLM(
        MixtralConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=24, num_key_value_heads=2, num_local_experts=4,
                      num_experts_per_tok=2)
    )  # fmt: skip
    mixtral.save_pretrained(tmp_path / "moe")
    assert (
        main(
            ["analyze", str(tmp_path / "moe"), "--logdir", str(tmp_path / "b"), "--method", "gram"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "experts: mean (min-max)" in out
    block = mixtral.model.layers[0]
    if hasattr(block, "block_sparse_moe"):  # transformers 4.x: a list of MLPs, w2 the down one
        downs = [expert.w2.weight.detach() for expert in block.block_sparse_moe.experts]
    else:  # transformers 5: the experts' down projections as one 3-D parameter
        downs = list(block.mlp.experts.down_proj.detach())
    ranks = [_stable_rank(matrix.double()) for matrix in downs]
    expected = f"{np.mean(ranks):.1f} ({min(ranks):.1f}-{max(ranks):.1f})"
    (row,) = [
        line
        for line in out.splitlines()
        if line.startswith("│") and line.split("│")[1].strip() == "0"
    ]
    assert expected in row


def _table_rows(out: str) -> list[list[str]]:
    """The cells of each row of a printed rich table."""
    return [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in out.splitlines()
        if line.startswith("│")
    ]


def _stable_rank(weight: torch.Tensor) -> float:
    return float(weight.square().sum() / torch.linalg.matrix_norm(weight, 2) ** 2)


def test_analyze_esd_writes_what_rank_layers_reads(
    gpt2: tuple[Path, GPT2LMHeadModel], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: analyze had no way to fit the ESD family, and rank-layers of its output advised
    # training with esd_alpha
    assert main(["analyze", str(gpt2[0]), "--logdir", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(["rank-layers", str(tmp_path / "plain")]) == 1
    assert "write a model's with `analyze MODEL --esd`" in capsys.readouterr().err
    assert main(["analyze", str(gpt2[0]), "--logdir", str(tmp_path / "esd"), "--esd"]) == 0
    out = tmp_path / "ranks.json"
    assert main(["rank-layers", str(tmp_path / "esd"), "--json", str(out)]) == 0
    ranking = pd.read_json(out, typ="series")
    assert ranking["where"] == "logged at step 0" and len(ranking["matrices"]) == 3 * 6
    rows = _analyzed(tmp_path / "esd")
    logged = rows[(rows.metric == "esd_alpha") & (rows.layer == 1) & (rows.role == "V")].value
    weight = gpt2[1].transformer.h[1].attn.c_attn.weight.detach()[:, 128:].T  # V: (out, in)
    from spectral_callbacks.functional import esd_metrics

    assert float(logged.iloc[0]) == pytest.approx(
        float(esd_metrics(weight[None].float())["esd_alpha"][0]), rel=1e-4
    )
