"""Read a model at rest: a Hugging Face model directory, a Lightning checkpoint or a state_dict.

``load_model`` is the one entry; the last two need an architecture hint (``arch``):

* ``hf:PATH`` - a Hugging Face config (a directory holding ``config.json``, or the file itself);
  the model is built from it with ``AutoModel.from_config`` and the weights loaded into it.
* ``module:Class`` - an import path. A ``LightningModule`` subclass given a ``.ckpt`` is rebuilt
  with ``Class.load_from_checkpoint`` (its ``hyper_parameters``); any other class is called with
  the checkpoint's ``hyper_parameters`` if it has them, else with no arguments.

State-dict keys are matched to the model's up to a common prefix (``model.``, ``transformer.``...),
so a LightningModule's ``state_dict`` loads into the bare network it wraps. Everything that can go
wrong with a file or a hint is a :class:`ModelLoadError` naming the path or hint and what to do;
messages name this module's parameters, never a command-line option (the CLI adds those).
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import struct
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


class AnalysisError(ValueError):
    """Input the offline modules (loading, analysis) cannot use; the message names the path or
    value and what to do.

    Messages name the functions' parameters, never a command-line option: a front end (the CLI)
    names its own option for :attr:`argument`.

    Attributes:
        argument: the parameter whose value is at fault (``"arch"``, ``"logdir"``) when the fix is
            another value of it, else ``None``.
    """

    def __init__(self, message: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.argument = argument


class ModelLoadError(AnalysisError):
    """A model source this module cannot read or build."""


# What reading a damaged, empty or foreign file raises from torch.load (pickle, a zip archive);
# anything else is a bug and keeps its traceback. Found by fuzzing torch.load with random bytes:
# its weights-only unpickler also lets IndexError, KeyError and struct.error out, the full one
# MemoryError and OverflowError (huge lengths).
_READ_ERRORS: tuple[type[BaseException], ...] = (
    pickle.UnpicklingError,
    EOFError,
    zipfile.BadZipFile,
    RuntimeError,  # torch's zip reader: "PytorchStreamReader failed reading zip archive"
    ValueError,  # UnicodeDecodeError among them
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    MemoryError,
    OverflowError,
    ImportError,  # a full pickle naming a module that is not importable here
    AttributeError,  # ... or a class that module no longer has
)
# What building an architecture from a hint raises when the hint does not fit.
_BUILD_ERRORS: tuple[type[BaseException], ...] = (TypeError, ValueError, KeyError, RuntimeError)
# ... and reading a Hugging Face config that is missing or not JSON.
_CONFIG_ERRORS: tuple[type[BaseException], ...] = (OSError, *_BUILD_ERRORS)


def load_model(
    source: str | Path, arch: str | None = None, base: str | Path | None = None
) -> nn.Module:
    """The model stored at ``source``, on the CPU, in eval mode.

    Args:
        source: a Hugging Face model directory (``config.json`` plus ``*.safetensors`` or
            ``pytorch_model.bin``), a PEFT adapter directory (``adapter_config.json`` plus
            ``adapter_model.safetensors``; with ``base``), a Lightning checkpoint (``.ckpt``) or
            a state_dict file (``.pt``, ``.pth``, ``.bin``, ``.safetensors``).
        arch: architecture hint, ``hf:PATH`` or ``module:Class`` (default None: only for Hugging
            Face directories and checkpoints whose class can be rebuilt without one).
        base: the base model directory a PEFT adapter directory adapts (default None: the
            adapter config's ``base_model_name_or_path`` where that is a local directory).

    Raises:
        ModelLoadError: missing path, unknown format, a damaged, empty or foreign file, no or a
            bad architecture hint (``argument == "arch"``), or weights that do not fit it.
    """
    path = Path(source)
    if not path.exists():
        raise ModelLoadError(
            f"{source}: no such file or directory; give a Hugging Face model directory, a .ckpt "
            "or a state_dict file"
        )
    arch_help = "an architecture hint, hf:CONFIG_DIR or module:Class"
    if path.is_dir() and (path / "adapter_config.json").is_file():
        model = _peft_from_pretrained(path, base)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{source}: a directory without config.json is not a Hugging Face model; save one "
                f"with model.save_pretrained(DIR) or give a .ckpt / state_dict file and {arch_help}"
            )
        model = _hf_from_pretrained(path)
    elif path.suffix == ".ckpt":
        model = _from_checkpoint(path, arch)
    elif path.suffix in STATE_DICT_SUFFIXES:
        if arch is None:
            raise ModelLoadError(
                f"{source}: a state_dict holds weights but not the architecture; give {arch_help}",
                argument="arch",
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
    # transformers reads the weight files with torch.load / safetensors: the same damage, plus
    # OSError for a missing weight file.
    advice = "check config.json and the weight files (save them with model.save_pretrained)"
    with _reading(path, "Hugging Face model directory", advice, also=(OSError,)):
        return transformers.AutoModel.from_pretrained(str(path), local_files_only=True)


def _peft_from_pretrained(path: Path, base: str | Path | None) -> nn.Module:
    """A saved PEFT adapter on its base model (not merged: watched as adapted layers)."""
    import json

    config = json.loads((path / "adapter_config.json").read_text())
    if base is None:
        named = config.get("base_model_name_or_path")
        if not named or not Path(named).is_dir():
            where = (
                f"its adapter_config.json names {named!r}, which is not a local directory"
                if named
                else "its adapter_config.json names no base_model_name_or_path"
            )
            raise ModelLoadError(
                f"{path}: a PEFT adapter directory needs its base model; give `base`, its "
                f"directory ({where})",
                argument="base",
            )
        base = named
    base_path = Path(base)
    if not (base_path / "config.json").is_file():
        raise ModelLoadError(
            f"base {str(base)!r}: not a Hugging Face model directory (no config.json)",
            argument="base",
        )
    try:
        import peft
    except ImportError as error:
        raise ModelLoadError(
            f"{path}: a PEFT adapter needs peft; pip install 'spectral-callbacks[hf]'"
        ) from error
    transformers = _transformers(base_path)
    saved = _adapter_keys(path)
    auto = _adapter_head(transformers, config.get("task_type"), base_path, saved)
    advice = "check the adapter and base directories (save them with save_pretrained)"
    with _reading(path, "PEFT adapter directory", advice, also=(OSError, ValueError, KeyError)):
        model = auto.from_pretrained(str(base_path), local_files_only=True)
        with warnings.catch_warnings():  # the missing keys are refused below, in one line
            warnings.filterwarnings("ignore", "Found missing adapter keys")
            model = peft.PeftModel.from_pretrained(model, str(path), is_trainable=False)
    loaded = set(peft.utils.get_peft_model_state_dict(model))
    missing = [key for key in saved if key not in loaded]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} of the adapter's {len(saved)} weights found no layer in the "
            f"base {str(base_path)!r} loaded as {auto.__name__} (first: {missing[0]!r}); give the "
            "base model it was trained on, or set `task_type` in its adapter_config.json"
        )
    return model


# PEFT's task types and the head each one wraps; an adapter's weight names carry its head's
# module path (a causal LM's "model." prefix).
_TASK_HEADS = {
    "CAUSAL_LM": "AutoModelForCausalLM",
    "SEQ_CLS": "AutoModelForSequenceClassification",
    "SEQ_2_SEQ_LM": "AutoModelForSeq2SeqLM",
    "TOKEN_CLS": "AutoModelForTokenClassification",
    "QUESTION_ANS": "AutoModelForQuestionAnswering",
    "FEATURE_EXTRACTION": "AutoModel",
}
# How PEFT prefixes the base model's module names in a saved adapter.
_PEFT_PREFIX = "base_model.model."


def _adapter_keys(path: Path) -> list[str]:
    """The weight names of a saved adapter (``adapter_model.safetensors`` or ``.bin``)."""
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (path / name).is_file():
            return list(_read_state_dict(path / name))
    raise ModelLoadError(
        f"{path}: no adapter_model.safetensors or adapter_model.bin beside adapter_config.json; "
        "save the adapter with model.save_pretrained(DIR)"
    )


def _adapter_head(transformers: Any, task_type: Any, base_path: Path, keys: list[str]) -> Any:
    """The auto class to load the base with: the adapter's ``task_type`` when it names one, else
    the first of the base's ``architectures`` (then the bare ``AutoModel``) whose module names
    hold every adapted layer the adapter's keys name."""
    if task_type in _TASK_HEADS:
        return getattr(transformers, _TASK_HEADS[task_type])
    advice = "check config.json (save it with model.save_pretrained)"
    with _reading(base_path, "Hugging Face model directory", advice, also=(OSError,)):
        base_config = transformers.AutoConfig.from_pretrained(str(base_path), local_files_only=True)
    heads = [getattr(transformers, name, None) for name in base_config.architectures or ()]
    candidates = [head for head in heads if head is not None] + [transformers.AutoModel]
    for head in candidates:
        if _names_every_layer(head, base_config, keys):
            return head
    return candidates[0]  # none fits: the load below names the missing keys


def _names_every_layer(head: Any, base_config: Any, keys: list[str]) -> bool:
    """Each adapter key is ``<module path>.<tuner weight>[.weight]`` on a module of ``head``
    (built on the meta device: names only, no memory)."""
    try:
        with torch.device("meta"):
            # an auto class builds from a config, a model class is called with one
            build = getattr(head, "from_config", head)
            skeleton = build(base_config)
    except _BUILD_ERRORS:
        return False
    modules = {name for name, _ in skeleton.named_modules()}
    for key in keys:
        inner = key.removeprefix(_PEFT_PREFIX)
        parents = {inner.rsplit(".", drop)[0] for drop in (1, 2) if inner.count(".") >= drop}
        if not parents & modules:
            return False
    return True


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
    checkpoint = _torch_load(path, weights_only=False, kind="Lightning checkpoint")
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise ModelLoadError(
            f"{path}: not a Lightning checkpoint (no 'state_dict' entry); save it with "
            "Trainer.save_checkpoint, or give a state_dict file and an architecture hint"
        )
    hyper_parameters = dict(checkpoint.get("hyper_parameters") or {})
    if arch is None:
        raise ModelLoadError(
            f"{path}: a checkpoint does not name its class; give an architecture hint, "
            "module:Class (your LightningModule) or hf:CONFIG_DIR",
            argument="arch",
        )
    cls: Any = _import(arch) if not arch.startswith("hf:") else None
    if cls is not None and _is_lightning_module(cls):
        try:
            return cls.load_from_checkpoint(path, map_location="cpu", weights_only=False)
        except _BUILD_ERRORS as error:
            raise ModelLoadError(
                f"architecture {arch!r}: {cls.__name__}.load_from_checkpoint({path}) failed "
                f"({_first_line(error)}); give the LightningModule that saved this checkpoint",
                argument="arch",
            ) from error
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
            f"architecture hint {arch!r}: must be hf:CONFIG_DIR or module:Class (e.g. gpt:GPT)",
            argument="arch",
        )
    try:
        value: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as error:
        raise ModelLoadError(
            f"architecture {arch!r}: cannot import it ({_first_line(error)}); check the module is "
            "on PYTHONPATH",
            argument="arch",
        ) from error
    return value


def _build(arch: str, hyper_parameters: dict | None) -> nn.Module:
    """An untrained model of architecture ``arch`` (weights are loaded afterwards)."""
    if arch.startswith("hf:"):
        config_path = Path(arch[3:])
        transformers = _transformers(config_path)
        if not config_path.exists():
            raise ModelLoadError(
                f"architecture {arch!r}: {config_path} does not exist; give a Hugging Face config "
                "directory (or its config.json)",
                argument="arch",
            )
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(config_path), local_files_only=True
            )
            return transformers.AutoModel.from_config(config)
        except _CONFIG_ERRORS as error:
            raise ModelLoadError(
                f"architecture {arch!r}: transformers could not build a model from it "
                f"({_first_line(error)}); give a directory holding a valid config.json",
                argument="arch",
            ) from error
    cls = _import(arch)
    arguments = (
        f"the checkpoint's hyper_parameters {sorted(hyper_parameters)}"
        if hyper_parameters
        else "no arguments"
    )
    try:
        model = cls(**hyper_parameters) if hyper_parameters else cls()
    except _BUILD_ERRORS as error:
        raise ModelLoadError(
            f"architecture {arch!r}: cannot build it with {arguments} ({_first_line(error)}); give "
            "a class that builds that way (a LightningModule rebuilds itself from its checkpoint)",
            argument="arch",
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"architecture {arch!r}: built a {type(model).__name__}, not a torch.nn.Module",
            argument="arch",
        )
    return model


def _read_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        advice = "save the weights with safetensors.torch.save_file, or copy the file again if it was cut short"
        with _reading(path, "safetensors file", advice):
            return load_file(str(path))
    state = _torch_load(path, weights_only=True, kind="state_dict file")
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
            f"{len(list(model.parameters()))} parameters missing (e.g. {missing[0]}); check the "
            "architecture hint",
            argument="arch",
        )
    try:
        model.load_state_dict({k: v for k, v in renamed.items() if k in wanted}, strict=False)
    except (RuntimeError, TypeError) as error:  # shapes that differ, entries that are no tensors
        raise ModelLoadError(
            f"{path}: the weights do not fit the architecture ({_first_line(error)}); check the "
            "architecture hint",
            argument="arch",
        ) from error


@contextlib.contextmanager
def _reading(
    path: Path, kind: str, advice: str, also: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Turn what reading a damaged, empty or foreign file raises into a ModelLoadError.

    What torch warns about a file it then fails to read ("Detected pickle protocol 222") is
    dropped: the error says it all. A file that loads gets its warnings.

    Args:
        path: the file or directory read.
        kind: what it should be, for the message ("Lightning checkpoint").
        advice: what to do, for the message.
        also: more exception types that mean "cannot read it" here (default none).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except ModelLoadError:
            raise
        except (*_READ_ERRORS, _safetensor_error(), *also) as error:
            raise ModelLoadError(
                f"{path}: not a readable {kind} ({_first_line(error)}); {advice}"
            ) from error
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def _torch_load(path: Path, *, weights_only: bool, kind: str) -> Any:
    """``torch.load`` on the CPU; a damaged, empty or foreign file is a ModelLoadError."""
    advice = (
        "save it with torch.save / Trainer.save_checkpoint, or copy it again if it was cut short"
    )
    with _reading(path, kind, advice):
        if path.is_file() and not _is_torch_save_file(path):
            # Unpickling arbitrary bytes can do anything (huge allocations, errors printed from C
            # as the pickle machine unwinds), so a file torch.save cannot have written is refused
            # before torch.load sees it.
            raise ModelLoadError(
                f"{path}: not a readable {kind} (neither a zip archive nor torch's legacy format);"
                f" {advice}"
            )
        return torch.load(path, map_location="cpu", weights_only=weights_only)


# torch.save's legacy (pre-1.6) format opens with its magic number, pickled with protocol 2.
_LEGACY_TORCH_HEADER = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]  # without STOP


def _is_torch_save_file(path: Path) -> bool:
    """Whether ``path`` is in a format torch.save writes: a zip archive, or the legacy pickle."""
    if zipfile.is_zipfile(path):
        return True
    with path.open("rb") as file:
        return file.read(len(_LEGACY_TORCH_HEADER)) == _LEGACY_TORCH_HEADER


def _safetensor_error() -> type[Exception]:
    """safetensors' error class (it derives from Exception only)."""
    from safetensors import SafetensorError

    return SafetensorError


def _first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type name when it has none.

    torch's weights-only unpickler opens with a paragraph suggesting ``weights_only=False`` (never
    the fix for a damaged file); its own diagnosis comes after ``WeightsUnpickler error:``.
    """
    text = str(error).strip()
    _, found, diagnosis = text.partition("WeightsUnpickler error:")
    if found and diagnosis.strip():
        text = diagnosis.strip()
    return text.splitlines()[0] if text else type(error).__name__


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
