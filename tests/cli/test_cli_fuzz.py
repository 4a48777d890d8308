"""Every command (export, plot, analyze, targets) on garbage: damaged and empty files of each
accepted suffix, directories where files are expected and files where directories are, wrong
``--arch``. Each must exit non-zero with exactly one line on stderr and no traceback.

In-process through ``main`` (capsys sees everything written to stderr, warnings included); one
subprocess checks the real entry point."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from cli_runs import run_cli
from seeds import run_seed
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from spectral_callbacks.cli.main import main
from spectral_callbacks.names import NUM_LAYERS_TAG, scalar_tag
from spectral_callbacks.offline.loading import ModelLoadError, load_model

MODEL_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors", ".txt")
EXPORT_SUFFIXES = (".csv", ".parquet", ".pq", ".json", ".jsonl")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
EVENT_FILE = "events.out.tfevents.1700000000.host.1.0"
# What torch.save's legacy format opens with: its magic number pickled with protocol 2.
LEGACY_TORCH_HEADER = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


def contents() -> dict[str, bytes]:
    """Random bytes (fresh each run, from the run's seed: tests/seeds.py) followed by every byte
    value, and nothing."""
    garbage = random.Random(run_seed()).randbytes(64)
    return {"garbage": garbage + bytes(range(256)) * 4, "empty": b""}


def random_files(count: int, seed: int = 0) -> list[bytes]:
    """Seeded random contents, some behind a pickle or zip header so parsing goes deeper."""
    rng = random.Random(seed)
    files = []
    for _ in range(count):
        data = rng.randbytes(rng.choice([1, 2, 8, 64, 300]))
        header = rng.choice([b"", b"\x80\x02", b"PK\x03\x04", LEGACY_TORCH_HEADER])
        files.append(header + data + (bytes(range(256)) if rng.random() < 0.5 else b""))
    return files


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Garbage and empty files of every suffix, a config, a state_dict, a good run and a file."""
    root = tmp_path_factory.mktemp("fuzz")
    for kind, data in contents().items():
        for suffix in MODEL_SUFFIXES:
            (root / f"{kind}{suffix}").write_bytes(data)
        run = root / f"{kind}_run"
        run.mkdir()
        (run / EVENT_FILE).write_bytes(data)
        (root / f"{kind}_config").mkdir()
        (root / f"{kind}_config" / "config.json").write_bytes(data)
    config = root / "config"
    config.mkdir()
    (config / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16})
    )
    for kind, data in contents().items():  # Hugging Face directories with damaged weights
        for weights in ("model.safetensors", "pytorch_model.bin"):
            model_dir = root / f"hf_{kind}_{weights.replace('.', '_')}"
            model_dir.mkdir()
            (model_dir / "config.json").write_text((config / "config.json").read_text())
            (model_dir / weights).write_bytes(data)
    torch.save(torch.nn.Linear(4, 4).state_dict(), root / "linear.pt")
    with SummaryWriter(str(root / "good_run")) as writer:
        writer.add_scalar(NUM_LAYERS_TAG, 1, 0)
        for step in (0, 10):
            writer.add_scalar(scalar_tag("stable_rank", 0, "Q"), 3.0 - step / 10, step)
            writer.add_scalar(scalar_tag("compression", 0, "Q"), float(step), step)
    (root / "no_events").mkdir()
    (root / "notes.txt").write_text("not a run")
    for name in ("dir.ckpt", "dir.pt", "dir.safetensors", *(f"out{s}" for s in EXPORT_SUFFIXES)):
        (root / name).mkdir()
    for suffix in PLOT_SUFFIXES:
        (root / f"out{suffix}").mkdir()
    return root


def assert_one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with warnings.catch_warnings(record=True) as caught:  # pytest would hide them from capsys
        warnings.simplefilter("always")
        # What a shell user sees: Python's default filters hide DeprecationWarnings outside
        # __main__, such as torchao's import-time ones that transformers reaches when torchao
        # is installed (it is, for the training stacks' tests).
        warnings.simplefilter("ignore", DeprecationWarning)
        status = main(argv)
    err = capsys.readouterr().err + "".join(f"warning: {w.message}\n" for w in caught)
    lines = err.strip().splitlines()
    assert status != 0, (argv, err)
    assert "Traceback" not in err, (argv, err)
    assert len(lines) == 1, (argv, err)
    assert lines[0].startswith(f"spectral-callbacks {argv[0]}: error: "), (argv, err)
    return lines[0]


@pytest.mark.parametrize("kind", ["garbage", "empty"])
@pytest.mark.parametrize("suffix", MODEL_SUFFIXES)
@pytest.mark.parametrize("arch", [None, "torch.nn:Identity", "hf:{root}/config"])
def test_model_commands_on_damaged_and_empty_files(
    inputs: Path, capsys: pytest.CaptureFixture[str], kind: str, suffix: str, arch: str | None
) -> None:
    model = str(inputs / f"{kind}{suffix}")
    hint = [] if arch is None else ["--arch", arch.format(root=inputs)]
    logdir = str(inputs / "analyzed")
    assert_one_line_error(["targets", model, *hint], capsys)
    assert_one_line_error(["analyze", model, "--logdir", logdir, *hint], capsys)
    assert not Path(logdir).exists()  # nothing half-written


@pytest.mark.parametrize(
    "model",
    [
        "config",  # a config without weights
        "garbage_config",  # config.json not JSON
        "empty_config",
        *(
            f"hf_{kind}_{weights}"
            for kind in ("garbage", "empty")
            for weights in ("model_safetensors", "pytorch_model_bin")
        ),
    ],
)
def test_hugging_face_directories_without_readable_weights(
    inputs: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    assert_one_line_error(["targets", str(inputs / model)], capsys)
    assert_one_line_error(
        ["analyze", str(inputs / model), "--logdir", str(inputs / "analyzed")], capsys
    )


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".safetensors"])
def test_load_model_turns_random_bytes_into_model_load_errors(tmp_path: Path, suffix: str) -> None:
    # torch's weights-only unpickler lets IndexError, KeyError and struct.error out on some of
    # these, the full unpickler MemoryError and OverflowError: all must become ModelLoadError.
    path = tmp_path / f"random{suffix}"
    for data in random_files(300):
        path.write_bytes(data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ModelLoadError, match=r"random\.\w+: not a readable"):
                load_model(path, "torch.nn:Identity")
        assert not caught, [str(w.message) for w in caught]


def test_a_file_torch_save_cannot_have_written_is_refused_before_unpickling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # These 64 bytes once sent the full unpickler into a MemoryError, with a SystemError printed
    # from C as it unwound: two lines of stderr, where one is promised.
    head = bytes.fromhex(
        "952c23b65bb8783f0ae4b32b78448d0408b483b40456ff23de6b9abd100959379efdd3c6e7a1849d8dfc7ab5b46331b2016c70e62864404da017d1e0413f8944"
    )
    path = tmp_path / "foreign.ckpt"
    path.write_bytes(head + bytes(range(256)) * 4)
    line = assert_one_line_error(["targets", str(path)], capsys)
    assert "neither a zip archive nor torch's legacy format" in line
    # A file in torch's legacy format is still read (a damaged one is still a ModelLoadError).
    legacy = tmp_path / "legacy.pt"
    saved = ThreeToTwo()
    torch.save(saved.state_dict(), legacy, _use_new_zipfile_serialization=False)
    assert legacy.read_bytes().startswith(LEGACY_TORCH_HEADER)
    loaded = load_model(legacy, f"{__name__}:ThreeToTwo")
    assert torch.equal(loaded.weight, saved.weight)


class ThreeToTwo(nn.Linear):
    """A model class an architecture hint can build without arguments."""

    def __init__(self) -> None:
        super().__init__(3, 2)


@pytest.mark.parametrize(
    "arch",
    [
        "torch.nn:Linear",  # needs arguments
        "torch:nn",  # a module, not a class
        "builtins:dict",  # not an nn.Module
        "no_such_module:Model",
        "torch.nn:NoSuchClass",
        "nocolon",
        "hf:{root}/missing",
        "hf:{root}/garbage_config",
        "hf:{root}/empty_config",
        "hf:{root}/notes.txt",  # a file where a config directory is expected
        "torch.nn:Identity",  # builds, holds no matrix to analyse
    ],
)
def test_wrong_arch(inputs: Path, capsys: pytest.CaptureFixture[str], arch: str) -> None:
    hint = ["--arch", arch.format(root=inputs)]
    for model in ("linear.pt", "garbage.ckpt"):
        assert_one_line_error(["targets", str(inputs / model), *hint], capsys)
        argv = ["analyze", str(inputs / model), "--logdir", str(inputs / "analyzed"), *hint]
        assert_one_line_error(argv, capsys)


def test_directories_where_files_are_expected_and_the_reverse(
    inputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for model in ("dir.ckpt", "dir.pt", "dir.safetensors"):
        assert_one_line_error(
            ["targets", str(inputs / model), "--arch", "torch.nn:Identity"], capsys
        )
    line = assert_one_line_error(
        [
            "analyze",
            str(inputs / "linear.pt"),
            "--arch",
            "torch.nn:Linear",
            "--logdir",
            str(inputs / "notes.txt"),
        ],
        capsys,
    )
    assert "is a file, not a directory" in line and "--logdir" in line
    good = str(inputs / "good_run")
    for suffix in EXPORT_SUFFIXES:
        assert_one_line_error(["export", good, "-o", str(inputs / f"out{suffix}")], capsys)
    for suffix in PLOT_SUFFIXES:
        argv = ["plot", good, "--kind", "compression", "-o", str(inputs / f"out{suffix}")]
        assert_one_line_error(argv, capsys)


@pytest.mark.parametrize(
    "logdir",
    [
        "garbage_run",
        "empty_run",
        f"garbage_run/{EVENT_FILE}",
        f"empty_run/{EVENT_FILE}",
        "no_events",
        "notes.txt",  # a file where a run directory is expected
        "missing",
    ],
)
def test_run_commands_on_damaged_empty_and_wrong_paths(
    inputs: Path, capsys: pytest.CaptureFixture[str], logdir: str
) -> None:
    path = str(inputs / logdir)
    for suffix in (".csv", ".parquet"):
        assert_one_line_error(["export", path, "-o", str(inputs / f"exported{suffix}")], capsys)
    for kind in ("rank-steps", "compression", "compression-wave", "alpha-depth"):
        argv = ["plot", path, "--kind", kind, "-o", str(inputs / "plotted.png")]
        assert_one_line_error(argv, capsys)
    assert not (inputs / "plotted.png").exists()


def test_the_real_entry_point_prints_one_line(inputs: Path) -> None:
    done = run_cli(
        "analyze",
        inputs / "garbage.safetensors",
        "--arch",
        f"hf:{inputs / 'config'}",
        "--logdir",
        inputs / "analyzed",
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "not a readable safetensors file" in line
