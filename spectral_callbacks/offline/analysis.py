"""Spectral metrics of a model at rest, written as the same scalars a training run logs.

``load_model`` reads a Hugging Face model directory, a Lightning checkpoint or a plain state_dict
(the last two with an architecture hint); ``analyze_model`` computes ``spectral_metrics`` of every
matrix ``find_targets`` maps; ``write_scalars`` writes them with a TensorBoard ``SummaryWriter``
under the tags of ``spectral_callbacks.names`` at one step, plus ``spectral_monitor/num_layers``,
so ``spectral-callbacks plot`` draws GPT-2 or Pythia beside a custom run.

Architecture hints (``arch``):

* ``hf:PATH`` - a Hugging Face config (a directory holding ``config.json``, or the file itself);
  the model is built from it with ``AutoModel.from_config`` and the weights loaded into it.
* ``module:Class`` - an import path. A ``LightningModule`` subclass given a ``.ckpt`` is rebuilt
  with ``Class.load_from_checkpoint`` (its ``hyper_parameters``); any other class is called with
  the checkpoint's ``hyper_parameters`` if it has them, else with no arguments.

State-dict keys are matched to the model's up to a common prefix (``model.``, ``transformer.``...),
so a LightningModule's ``state_dict`` loads into the bare network it wraps.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from spectral_callbacks.names import NUM_LAYERS_TAG, relative_depth

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
# Matrices analysed together; bounds the memory of the stacked copies for large models.
BATCH_MATRICES = 8


class ModelLoadError(ValueError):
    """A model source this module cannot read; the message names the path and what to do."""


def load_model(source: str | Path, arch: str | None = None) -> nn.Module:
    """The model stored at ``source``, on the CPU, in eval mode.

    Args:
        source: a Hugging Face model directory (``config.json`` plus ``*.safetensors`` or
            ``pytorch_model.bin``), a Lightning checkpoint (``.ckpt``) or a state_dict file
            (``.pt``, ``.pth``, ``.bin``, ``.safetensors``).
        arch: architecture hint, ``hf:PATH`` or ``module:Class`` (default None: only for Hugging
            Face directories and checkpoints whose class can be rebuilt without one).

    Raises:
        ModelLoadError: missing path, unknown format, no or a bad architecture hint, or weights
            that do not fit the architecture.
    """
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(
            f"{source}: no such file or directory; give a Hugging Face model directory, a .ckpt "
            "or a state_dict file"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{source}: a directory without config.json is not a Hugging Face model; save one "
                "with model.save_pretrained(DIR) or give a .ckpt / state_dict file with --arch"
            )
        model = _hf_from_pretrained(path)
    elif path.suffix == ".ckpt":
        model = _from_checkpoint(path, arch)
    elif path.suffix in STATE_DICT_SUFFIXES:
        if arch is None:
            raise ModelLoadError(
                f"{source}: a state_dict holds weights but not the architecture; pass --arch "
                "hf:CONFIG_DIR or --arch module:Class"
            )
        model = _build(arch, hyper_parameters=None)
        _load_weights(model, _read_state_dict(path), path)
    else:
        raise ModelLoadError(
            f"{source}: unknown model format {path.suffix or '(no extension)'!r}; give a Hugging "
            f"Face model directory, a Lightning .ckpt or a state_dict ({', '.join(STATE_DICT_SUFFIXES)})"
        )
    return model.eval()


def _hf_from_pretrained(path: Path) -> nn.Module:
    transformers = _transformers(path)
    try:
        return transformers.AutoModel.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        first_line = (
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise ModelLoadError(
            f"{path}: transformers could not load it ({first_line}); check config.json and the "
            "weight files"
        ) from error


def _transformers(path: Path) -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ModelLoadError(
            f"{path}: Hugging Face models need transformers; pip install 'spectral-callbacks[hf]'"
        ) from error
    # "Weights not used" chatter and loading bars are not the user's business on a CLI.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def _from_checkpoint(path: Path, arch: str | None) -> nn.Module:
    # A Lightning checkpoint is a pickle (hyper_parameters may hold any object): only analyze
    # files you trust, as with torch.load itself.
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise ModelLoadError(
            f"{path}: not a Lightning checkpoint (no 'state_dict' entry); save it with "
            "Trainer.save_checkpoint, or give a state_dict file with --arch"
        )
    hyper_parameters = dict(checkpoint.get("hyper_parameters") or {})
    if arch is None:
        raise ModelLoadError(
            f"{path}: a checkpoint does not name its class; pass --arch module:Class (your "
            "LightningModule) or --arch hf:CONFIG_DIR"
        )
    cls: Any = _import(arch) if not arch.startswith("hf:") else None
    if cls is not None and _is_lightning_module(cls):
        return cls.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    model = _build(arch, hyper_parameters=hyper_parameters)
    _load_weights(model, checkpoint["state_dict"], path)
    return model


def _is_lightning_module(cls: object) -> bool:
    try:
        from lightning.pytorch import LightningModule
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, LightningModule)


def _import(arch: str) -> Callable[..., nn.Module]:
    module_name, sep, attribute = arch.partition(":")
    if not sep or not module_name or not attribute:
        raise ModelLoadError(
            f"--arch {arch}: must be hf:CONFIG_DIR or module:Class (e.g. gpt:GPT), got {arch!r}"
        )
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as error:
        raise ModelLoadError(
            f"--arch {arch}: cannot import it ({error}); check the module is on PYTHONPATH"
        ) from error
    return value


def _build(arch: str, hyper_parameters: dict | None) -> nn.Module:
    """An untrained model of architecture ``arch`` (weights are loaded afterwards)."""
    if arch.startswith("hf:"):
        config_path = Path(arch[3:])
        transformers = _transformers(config_path)
        if not config_path.exists():
            raise ModelLoadError(f"--arch {arch}: {config_path} does not exist; give a config dir")
        config = transformers.AutoConfig.from_pretrained(str(config_path), local_files_only=True)
        return transformers.AutoModel.from_config(config)
    cls = _import(arch)
    model = cls(**hyper_parameters) if hyper_parameters else cls()
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"--arch {arch}: built a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ModelLoadError(f"{path}: holds a {type(state).__name__}, not a state_dict")
    return state


def _load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Load ``state`` into ``model`` after matching key prefixes; every parameter must be found."""
    wanted = model.state_dict()
    rename = _prefix_rename(list(state), list(wanted))
    renamed = {rename(key): value for key, value in state.items()}
    missing = [name for name, _ in model.named_parameters() if name not in renamed]
    if missing:
        raise ModelLoadError(
            f"{path}: the weights do not fit the architecture: {len(missing)} of "
            f"{len(list(model.parameters()))} parameters missing (e.g. {missing[0]}); check --arch"
        )
    model.load_state_dict({k: v for k, v in renamed.items() if k in wanted}, strict=False)


def _prefix_rename(keys: list[str], model_keys: list[str]) -> Callable[[str], str]:
    """The key rename (strip or add one prefix) that matches the most of ``model_keys``."""
    known = set(model_keys)
    votes: Counter[tuple[str, str]] = Counter()
    for key in keys:
        for model_key in model_keys:
            if key.endswith("." + model_key):
                votes[(key[: -len(model_key)], "")] += 1
            elif model_key.endswith("." + key):
                votes[("", model_key[: -len(key)])] += 1
    strip, add = max(votes, key=votes.__getitem__) if votes else ("", "")
    if sum(key in known for key in keys) >= votes.get((strip, add), 0):
        return lambda key: key
    return lambda key: add + key[len(strip) :] if key.startswith(strip) else key


def analyze_model(
    model: nn.Module,
    *,
    progress: Callable[[int], None] | None = None,
    **options: Any,
) -> tuple[pd.DataFrame, int]:
    """``spectral_metrics`` of every matrix ``find_targets`` maps in ``model``.

    Matrices are grouped by shape as a training snapshot groups them (``group_by_shape``) and
    analysed in batches of at most ``BATCH_MATRICES``, which bounds the memory of the stacks.

    Args:
        model: the network.
        progress: called with the number of matrices done after each batch (default None).
        **options: passed to ``spectral_metrics`` (e.g. the SVD method).

    Returns:
        Rows ``layer, role, parameter, shape, <metric>...`` in target order, and the number of
        layers L of the model.
    """
    from spectral_callbacks.functional import spectral_metrics
    from spectral_callbacks.monitor.snapshot import ShapeGroup, group_by_shape, take_snapshot
    from spectral_callbacks.targets import find_targets

    targets = find_targets(model)
    results: dict[str, dict[str, float]] = {}
    for group in group_by_shape(targets):
        for start in range(0, len(group.targets), BATCH_MATRICES):
            chunk = ShapeGroup(group.key, group.targets[start : start + BATCH_MATRICES])
            snapshot = take_snapshot([chunk], step=0)
            metrics = spectral_metrics(snapshot.tensors[chunk.key].float(), **options)  # (B,) each
            for position, name in enumerate(chunk.names):
                results[name] = {
                    metric: float(value[position]) for metric, value in metrics.items()
                }
            if progress is not None:
                progress(len(chunk.targets))
    rows = pd.DataFrame(
        [
            {
                "layer": t.layer,
                "role": t.role,
                "parameter": t.name,
                "shape": "x".join(map(str, t.shape)),
                **results[t.name],
            }
            for t in targets
        ]
    )
    return rows, targets[0].num_layers


def write_scalars(
    rows: pd.DataFrame, num_layers: int, logdir: str | Path, step: int = 0
) -> list[str]:
    """Write ``analyze_model`` rows to ``logdir`` as the callback's scalars at ``step``.

    The scalars are built by the training run's ``Reporter`` - one per (metric, layer, role) and
    the mean over layers per (metric, role) - and written as one event like a snapshot's, with
    ``spectral_monitor/num_layers``, so the names and means are the same by construction.
    Returns the tags written.
    """
    from types import SimpleNamespace

    from spectral_callbacks import tensorboard_adapter as tb
    from spectral_callbacks.monitor.reporting import Reporter, num_layers_scalar

    metrics = [c for c in rows.columns if c not in ("layer", "role", "parameter", "shape")]
    targets = [
        SimpleNamespace(
            name=row.parameter,
            layer=int(row.layer),
            role=str(row.role),
            num_layers=num_layers,
            depth=relative_depth(int(row.layer), num_layers),
        )
        for row in rows.itertuples(index=False)
    ]
    values = {row["parameter"]: {m: float(row[m]) for m in metrics} for _, row in rows.iterrows()}
    scalars = Reporter(targets, metrics).scalars(step, values)
    writer = tb.LogdirWriter(str(logdir))
    try:
        tb.log_scalars([writer], num_layers_scalar(num_layers), step)
        tb.log_scalars([writer], scalars, step)
    finally:
        writer.finalize()
    return [NUM_LAYERS_TAG, *scalars]
