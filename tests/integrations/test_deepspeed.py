"""DeepSpeed ZeRO with the Hugging Face Trainer, two CPU processes (DeepSpeed's CPU accelerator,
gloo; stage 3 with ``delta="first"`` and with PEFT LoRA on four as well): stages 1 and 2 keep every
weight whole on every rank, stage 3 partitions them and each snapshot gathers them block by block
(``deepspeed.zero.GatheredParameters``); at every stage the callback logs each scheduled step's
spectrum equal to the float64 SVD of the weights; under stage 3 with ``delta="first"`` the update
``W_t - W_0`` too, and with PEFT LoRA the effective weight ``W_0 + s B A`` and the update ``s B A``.
Stage 3 with ``delta="first"`` logs what the unwrapped model logs in one process (this one) on the
same weights.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from browser import free_port
from sharded_models import exact_metrics
from spawn_ranks import run_session
from tiny_models import exact_stable_rank, read_scalars

from spectral_callbacks import SpectralTracker
from spectral_callbacks.functional.metrics import UPDATE_METRICS, UPDATE_TOP
from spectral_callbacks.integrations.hf import STATE_FILE
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import find_targets

pytest.importorskip("deepspeed", reason="deepspeed is not installed: pip install -e .[dev]")
pytestmark = pytest.mark.slow  # three 2-process DeepSpeed runs and one 4-process, 1-4 min each

TESTS = Path(__file__).resolve().parents[1]
SCRIPT = TESTS / "deepspeed_train.py"
Q0 = scalar_tag("stable_rank", 0, "Q")
REQUIRED = ("stable_rank", "spectral_norm", "frobenius_norm", "alpha")  # logged for every matrix
# the role of each watched matrix of a GPT-2 block, by the end of its name
ROLES = {
    "attn.c_attn.weight[Q]": "Q",
    "attn.c_attn.weight[K]": "K",
    "attn.c_attn.weight[V]": "V",
    "attn.c_proj.weight": "O",
    "mlp.c_fc.weight": "MLP_up",
    "mlp.c_proj.weight": "MLP_down",
}


def zero_run(tmp_path: Path, stage: int, *extra: str, processes: int = 2) -> tuple[int, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    command += ["--master_port", str(free_port()), str(SCRIPT), str(tmp_path), str(stage), *extra]
    finished = run_session(command, 400, env)
    return finished.returncode, finished.stdout


@pytest.fixture(scope="module")
def zero3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One ZeRO-3 launch (tens of seconds) for its dense, update and resume tests: ``delta="first"``,
    6 steps and a checkpoint, then a second Trainer resumed from it to step 10."""
    outdir = tmp_path_factory.mktemp("zero3")
    return (outdir, *zero_run(outdir, 3, "delta", "resume"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_log_the_exact_spectrum_of_whole_weights(
    request: pytest.FixtureRequest, tmp_path: Path, stage: int
) -> None:
    if stage == 3:
        tmp_path, returncode, output = request.getfixturevalue("zero3")
    else:
        returncode, output = zero_run(tmp_path, stage)
    assert returncode == 0, output[-3000:]
    # DeepSpeed's ZeRO optimizer; stages 1-2 keep the whole 32 x 96 c_attn on each rank, stage 3
    # an empty placeholder (the snapshot gathers it with deepspeed.zero.GatheredParameters)
    optimizer = "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer"
    held = 0 if stage == 3 else 3072
    for rank in (0, 1):
        assert f"rank {rank}: {optimizer}, ZeRO stage {stage}, c_attn holds {held} values" in output
    logged = read_scalars(tmp_path / "spectral")
    weights = torch.load(tmp_path / "weights.pt")  # gathered by the test (hf_train.py)
    assert sorted(logged[Q0]) == [0, 1, 2, 5, 6]
    for step, value in logged[Q0].items():
        exact = exact_stable_rank(weights[step]["transformer.h.0.attn.c_attn.weight[Q]"])
        assert value == pytest.approx(exact, rel=0.01)


def test_zero3_delta_logs_the_exact_update_of_every_gathered_matrix(
    zero3: tuple[Path, int, str],
) -> None:
    outdir, returncode, output = zero3
    assert returncode == 0, output[-3000:]
    check_every_update(outdir)


@pytest.fixture(scope="module")
def zero3_on_four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """One ZeRO-3 launch on 4 CPU processes: the Trainer run with ``delta="first"`` (in OUTDIR),
    then, in the same processes, a fresh model with PEFT LoRA (in OUTDIR/lora)."""
    outdir = tmp_path_factory.mktemp("zero3-on-four")
    return (outdir, *zero_run(outdir, 3, "delta", "then-lora", processes=4))


def test_zero3_on_four_processes_logs_the_exact_spectrum_and_update(
    zero3_on_four: tuple[Path, int, str],
) -> None:
    # The same stage-3 run (delta="first") on 4 CPU processes: each rank holds an empty c_attn.
    outdir, returncode, output = zero3_on_four
    assert returncode == 0, output[-3000:]
    for rank in range(4):
        said = f"rank {rank}: DeepSpeedZeroOptimizer_Stage3, ZeRO stage 3, c_attn holds 0 values"
        assert said in output
    logged = read_scalars(outdir / "spectral")
    weights = torch.load(outdir / "weights.pt")  # gathered by the test (hf_train.py)
    for name in weights[0]:
        layer = int(name.split(".")[2])
        role = next(role for suffix, role in ROLES.items() if name.endswith(suffix))
        for metric in ("stable_rank", "spectral_norm"):
            values = logged[scalar_tag(metric, layer, role)]
            assert sorted(values) == [0, 1, 2, 5, 6], (name, metric)
            for step, value in values.items():
                exact = exact_metrics(weights[step][name], 8)[metric]
                assert value == pytest.approx(exact, rel=1e-4), (name, metric, step)
    check_every_update(outdir)


@pytest.mark.parametrize("launch", ["zero3", "zero3_on_four"])
def test_zero3_logs_what_the_unwrapped_model_logs_on_the_same_weights(
    request: pytest.FixtureRequest, tmp_path: Path, launch: str
) -> None:
    outdir, returncode, output = request.getfixturevalue(launch)
    assert returncode == 0, output[-3000:]
    zero3 = read_scalars(outdir / "spectral")
    single = single_process_logs(torch.load(outdir / "weights.pt"), tmp_path / "single")
    spectral = [tag for tag in single if tag.startswith("spectral_") and "monitor" not in tag]
    assert len(spectral) > 12 * 4
    assert scalar_tag("update_spectral_norm", 1, "MLP_down") in spectral  # the update family too
    for tag in spectral:
        assert sorted(zero3[tag]) == sorted(single[tag]), tag
        for step, value in single[tag].items():
            assert zero3[tag][step] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), tag


def single_process_logs(
    weights: dict[int, dict[str, torch.Tensor]], logdir: Path
) -> dict[str, dict[int, float]]:
    """What the unwrapped tiny GPT-2 logs in this process (no process group: the single-process
    engine) under the callback's options and ``delta="first"``, its watched matrices set at each
    step to ``weights[step]`` (the ZeRO-3 run's, gathered by its test callback) and the tracker
    stepped as the Trainer's callback steps it: begun at 0, stepped at 1 to 6, closed at 6."""
    sys.path.insert(0, str(TESTS))
    from hf_train import OPTIONS, tiny_gpt2

    model = tiny_gpt2()
    targets = find_targets(model)
    assert sorted(target.name for target in targets) == sorted(weights[0])

    def set_weights(step: int) -> None:
        with torch.no_grad():
            for target in targets:
                target.matrix().copy_(weights[step][target.name])  # a view of the parameter
                assert target.matrix().double().equal(weights[step][target.name]), target.name

    options = dict(OPTIONS, every_n_steps=5, figures=False, delta="first", synchronous=True)
    set_weights(0)
    tracker = SpectralTracker(model, logdir=logdir, **options)
    tracker.begin(0)
    for step in range(1, 7):
        set_weights(step)
        tracker.step(step)
    tracker.close(6)
    return read_scalars(logdir)


def check_every_update(outdir: Path) -> None:
    """Every logged update metric of every watched matrix at every scheduled step against the
    float64 SVD of ``W_t - W_0``, both gathered by the test with ``GatheredParameters``."""
    logged = read_scalars(outdir / "spectral")
    weights = torch.load(outdir / "weights.pt")  # gathered by the test (hf_train.py)
    assert len(weights[0]) == len(ROLES) * 2  # every watched matrix of blocks 0 and 1
    checked = set()
    for name in weights[0]:
        layer = int(name.split(".")[2])
        role = next(role for suffix, role in ROLES.items() if name.endswith(suffix))
        tags = {metric: scalar_tag(metric, layer, role) for metric in UPDATE_METRICS}
        checked |= set(tags.values())
        base = weights[0][name]
        assert weights[6][name].ne(base).any(), name  # the weight trained: a real update
        for tag in tags.values():
            assert sorted(logged[tag]) == [0, 1, 2, 5, 6], tag
        for step in (0, 1, 2, 5, 6):
            seen = {metric: logged[tag][step] for metric, tag in tags.items()}
            assert math.isnan(seen["update_rank"])  # a dense fine-tune: no adapter rank
            expected = exact_update(weights[step][name] - base, base)
            for metric, exact in expected.items():
                if math.isnan(exact):  # a zero update (step 0): no stable or energy rank
                    assert math.isnan(seen[metric]), (name, metric, step)
                elif metric != "update_energy_rank_90":
                    close = pytest.approx(exact, rel=1e-4, abs=1e-6)
                    assert seen[metric] == close, (name, metric, step)
            if not math.isnan(expected["update_energy_rank_90"]):  # within float32 rounding
                low = energy_rank_90(weights[step][name] - base, 1 - 1e-4)
                high = energy_rank_90(weights[step][name] - base, 1 + 1e-4)
                assert low <= seen["update_energy_rank_90"] <= high, (name, step)
    # no update metric is logged that this test does not compare
    assert {tag for tag in logged if tag.startswith("spectral_update_") and "/L" in tag} <= checked


def energy_rank_90(update: torch.Tensor, scale: float = 1.0) -> float:
    """The smallest r whose top-r squared singular values hold ``0.9 * scale`` of ‖ΔW‖_F²."""
    squares = torch.linalg.svdvals(update.double()).square()
    total = float(squares.sum())
    if total == 0:
        return math.nan
    return float((squares.cumsum(0) < 0.9 * scale * total).sum() + 1)


def exact_update(update: torch.Tensor, base: torch.Tensor) -> dict[str, float]:
    """The update family of ``ΔW = W_t - W_0`` from its float64 full SVD (NaN ranks if ΔW = 0)."""
    values = torch.linalg.svdvals(update.double())
    frobenius = float(values.square().sum().sqrt())
    out = {
        "update_stable_rank": frobenius**2 / float(values[0]) ** 2 if frobenius else math.nan,
        "update_spectral_norm": float(values[0]),
        "update_frobenius_norm": frobenius,
        "update_energy_rank_90": energy_rank_90(update),
        "update_relative_size": frobenius / float(base.double().norm()),
    }
    out.update({f"update_sv_{i}": float(values[i - 1]) for i in range(1, UPDATE_TOP + 1)})
    return out


def test_zero3_lora_logs_the_exact_spectrum_and_update_of_the_effective_weights(
    tmp_path: Path,
) -> None:
    returncode, output = zero_run(tmp_path, 3, "lora")
    assert returncode == 0, output[-3000:]
    for rank in (0, 1):  # the base is partitioned: an empty placeholder on each rank
        assert f"rank {rank}: DeepSpeedZeroOptimizer_Stage3, ZeRO stage 3, c_attn holds 0" in output
    logged = read_scalars(tmp_path / "spectral")
    weights = torch.load(tmp_path / "weights.pt")  # W0 + s B A from GatheredParameters (hf_train)
    names = [name for name in weights[0] if name.endswith("c_attn.base_layer.weight[Q]")]
    assert len(names) == 2  # blocks 0 and 1, adapted
    for layer, name in enumerate(sorted(names)):
        for metric in (
            "stable_rank",
            "spectral_norm",
            "update_stable_rank",
            "update_spectral_norm",
        ):
            values = logged[scalar_tag(metric, layer, "Q")]
            assert sorted(values) == [0, 1, 2, 5, 6], metric
            for step, value in values.items():
                key = f"{name}:update" if metric.startswith("update_") else name
                exact = exact_metrics(weights[step][key], 8)[metric.removeprefix("update_")]
                assert value == pytest.approx(exact, rel=1e-4), (metric, layer, step)


def test_zero3_lora_on_four_processes_logs_the_exact_spectrum_and_update_of_the_effective_weights(
    zero3_on_four: tuple[Path, int, str],
) -> None:
    outdir, returncode, output = zero3_on_four
    assert returncode == 0, output[-3000:]
    for rank in range(4):  # the base is partitioned: an empty placeholder on each rank, each run
        said = f"rank {rank}: DeepSpeedZeroOptimizer_Stage3, ZeRO stage 3, c_attn holds 0 values"
        assert output.count(said) == 2, rank  # the dense run, then the LoRA one
    logged = read_scalars(outdir / "lora" / "spectral")
    weights = torch.load(outdir / "lora" / "weights.pt")  # W0 + s B A, gathered (hf_train.py)
    names = [name for name in weights[0] if not name.endswith(":update")]
    assert len(names) == len(ROLES) * 2  # every watched matrix of blocks 0 and 1
    adapted = [name for name in names if f"{name}:update" in weights[0]]
    assert len(adapted) == 3 * 2  # Q, K and V of the fused c_attn in both blocks
    checked = set()
    for name in names:
        layer = int(re.search(r"\.h\.(\d+)\.", name)[1])
        role = next(
            r for suffix, r in ROLES.items() if name.replace("base_layer.", "").endswith(suffix)
        )
        for step in (0, 1, 2, 5, 6):
            # every logged metric of the top-8 spectrum (the REQUIRED ones at least)
            for metric, exact in exact_metrics(weights[step][name], 8).items():
                tag = scalar_tag(metric, layer, role)
                if tag not in logged and metric not in REQUIRED:
                    continue
                assert sorted(logged[tag]) == [0, 1, 2, 5, 6], (name, metric)
                close = pytest.approx(exact, rel=1e-4, abs=1e-6, nan_ok=True)
                assert logged[tag][step] == close, (name, metric, step)
                checked.add(tag)
            # compression: against this run's step-0 stable rank (checked above)
            stable_rank = logged[scalar_tag("stable_rank", layer, role)]
            compression = logged[scalar_tag("compression", layer, role)][step]
            assert compression == pytest.approx(
                100 * (1 - stable_rank[step] / stable_rank[0]), abs=1e-3
            )
            checked.add(scalar_tag("compression", layer, role))
            if name not in adapted:  # a frozen matrix with no adapter: no update family
                assert scalar_tag("update_stable_rank", layer, role) not in logged, name
                continue
            update = weights[step][f"{name}:update"]
            seen = {m: logged[scalar_tag(m, layer, role)][step] for m in UPDATE_METRICS}
            checked |= {scalar_tag(m, layer, role) for m in UPDATE_METRICS}
            expected = exact_update(update, weights[step][name] - update)  # base W_0
            assert seen["update_rank"] == 2, name  # r = 2 (hf_train.with_lora)
            for metric in ("update_sv_3", "update_sv_4"):  # a rank-2 update has two
                assert math.isnan(seen[metric]), (name, metric, step)
            for metric in UPDATE_METRICS:
                if metric in ("update_rank", "update_sv_3", "update_sv_4"):
                    continue
                if metric == "update_energy_rank_90":  # an integer: within float32 rounding
                    low = energy_rank_90(update, 1 - 1e-4)
                    high = energy_rank_90(update, 1 + 1e-4)
                    assert low <= seen[metric] <= high, (name, step)
                    continue
                close = pytest.approx(expected[metric], rel=1e-4, abs=1e-6)
                assert seen[metric] == close, (name, metric, step)
    # no per-matrix value is logged that this test does not compare (the monitor's own aside)
    per_matrix = {tag for tag in logged if "/L" in tag and not tag.startswith("spectral_monitor/")}
    assert per_matrix == checked, per_matrix ^ checked


def test_a_resumed_zero3_run_keeps_the_step_0_compression_references(
    zero3: tuple[Path, int, str],
) -> None:
    outdir, returncode, output = zero3
    assert returncode == 0, output[-3000:]
    assert (outdir / "checkpoint-6" / STATE_FILE).is_file()  # the tracker's state, beside it
    first, resumed = read_scalars(outdir / "spectral"), read_scalars(outdir / "resumed")
    step0 = torch.load(outdir / "weights.pt")[0]  # the first run's, gathered by the test
    weights = torch.load(outdir / "resumed.pt")  # the resumed run's, steps 6 to 10
    for name in step0:
        layer = int(name.split(".")[2])
        role = next(role for suffix, role in ROLES.items() if name.endswith(suffix))
        assert weights[6][name].equal(torch.load(outdir / "weights.pt")[6][name]), name
        stable_rank = resumed[scalar_tag("stable_rank", layer, role)]
        assert sorted(stable_rank) == [10], name  # no new reference snapshot at the resumed step
        exact = exact_metrics(weights[10][name], 8)["stable_rank"]
        assert stable_rank[10] == pytest.approx(exact, rel=0.01), name
        # compression against the first run's step 0, not against step 6's weights
        reference = first[scalar_tag("stable_rank", layer, role)][0]
        compression = resumed[scalar_tag("compression", layer, role)][10]
        assert compression == pytest.approx(100 * (1 - stable_rank[10] / reference), abs=1e-3)
        # delta="first" of a resumed run: W_10 - W_6, the weights it resumes from
        # (docs/fine-tuning.md)
        expected = exact_update(weights[10][name] - weights[6][name], weights[6][name])
        for metric in ("update_stable_rank", "update_spectral_norm", "update_frobenius_norm"):
            logged = resumed[scalar_tag(metric, layer, role)][10]
            assert logged == pytest.approx(expected[metric], rel=1e-4), (name, metric)
