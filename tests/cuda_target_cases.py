"""One short Lightning fit per target kind, for the GPU tests of tests/cuda/test_cuda_targets.py: every
hook of the monitor inside the sync detector (cuda_checks.SyncDetector), every logged value beside
a float64 reference of the weights at its step.

Kinds: a PEFT Llama with two active LoRA adapters, with DoRA, with LoHa (the effective weight read
from ``merge_and_unload()`` of a copy, the update from its difference with the base); a tiny
Qwen3-MoE (each expert's slice); ``delta="first"`` (the update against the first weights); the
ESD family; TF32 on. ``run(kind, accelerator="cpu")`` runs the same fit on the CPU (the detector
then watches the meta device): how the helper itself is checked without a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from cuda_checks import CheckedMonitor, SyncDetector
from lightning.pytorch import Callback, LightningModule
from tiny_models import RecordingLogger, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

from spectral_callbacks.functional import esd_metrics, metrics_from_spectrum
from spectral_callbacks.names import parse_tag
from spectral_callbacks.targets import find_targets

KINDS = ("lora-two-adapters", "dora", "loha", "moe", "delta-first", "esd", "tf32")
STEPS = 6
SCHEDULE = [0, 1, 2, 4, 6]  # every_n_steps=2, log_spaced_until=2, and the last step
LLAMA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_of(kind: str) -> torch.nn.Module:
    """The tiny model of ``kind``, built from a config (no download)."""
    import transformers

    torch.manual_seed(0)
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
        return transformers.Qwen3MoeForCausalLM(config)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if kind not in ("lora-two-adapters", "dora", "loha"):
        return model
    import peft

    if kind == "loha":
        return peft.get_peft_model(
            model, peft.LoHaConfig(r=4, alpha=8, target_modules=LLAMA_MODULES)
        )
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=LLAMA_MODULES, init_lora_weights=False,
        use_dora=kind == "dora",
    )  # fmt: skip
    model = peft.get_peft_model(model, lora, adapter_name="first")
    if kind == "lora-two-adapters":
        second = peft.LoraConfig(
            r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
        model.add_adapter("second", second)
        model.base_model.set_adapter(["first", "second"])
    return model


class CausalLM(LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=1e-2)


class References(Callback):
    """Float64 copies, on the host, of what each watched matrix is at each step, keyed by
    (layer, role, expert): the merged weight of a PEFT model (``merge_and_unload()`` of a copy,
    PEFT's own arithmetic) and its update (PEFT's ``get_delta_weight``); the plain weights
    otherwise."""

    def __init__(self, adapted: bool) -> None:
        self.adapted = adapted
        self.weights: dict[int, dict[tuple, torch.Tensor]] = {}
        self.updates: dict[int, dict[tuple, torch.Tensor]] = {}

    def _record(self, trainer: Any, module: LightningModule) -> None:
        step = trainer.global_step
        if step in self.weights:
            return
        model: Any = module.model
        source = copy.deepcopy(model).merge_and_unload() if self.adapted else model
        self.weights[step] = {
            _key(t): t.matrix().detach().double().cpu() for t in find_targets(source)
        }
        if self.adapted:
            # The update, by PEFT: the sum of get_delta_weight over the layer's active adapters
            # (s B A for LoRA and DoRA, the Hadamard product for LoHa), the target's rows of it.
            self.updates[step] = {_key(t): _update(t) for t in find_targets(model)}

    def on_train_start(self, trainer: Any, module: LightningModule) -> None:
        self._record(trainer, module)

    def on_train_batch_end(self, trainer: Any, module: LightningModule, *args: Any) -> None:
        self._record(trainer, module)


def _update(target: Any) -> torch.Tensor:
    layer = target.layer_module
    names = [name for name in layer.active_adapters if name in layer.r]
    delta = sum(layer.get_delta_weight(name).detach().double() for name in names)
    return target.rows.take(delta).cpu()


def _key(target: Any) -> tuple:
    return (target.layer, target.role, target.expert)


def run(kind: str, accelerator: str = "gpu") -> dict[str, Any]:
    """Fit ``kind`` for :data:`STEPS` steps; return what was logged, the references and the waits."""
    import peft  # noqa: F401 - the PEFT kinds need it; imported here so a missing one skips

    model = model_of(kind)
    detector = SyncDetector("cuda" if accelerator == "gpu" else "meta")
    options: dict[str, Any] = dict(
        every_n_steps=2, log_spaced_until=2, k=16, max_pending=16, figures=False,
        svd_method="randomized",
    )  # fmt: skip
    if kind == "delta-first":
        options["delta"] = "first"
    if kind == "esd":
        options.update(metrics=("stable_rank", "esd_alpha"), esd_every_n_snapshots=1)
    if kind == "tf32" and accelerator == "gpu":  # the caller restores it
        if hasattr(torch.backends, "fp32_precision"):
            torch.backends.fp32_precision = "tf32"
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
    monitor = CheckedMonitor(detector, **options)
    logger = RecordingLogger()
    references = References(adapted=kind in ("lora-two-adapters", "dora", "loha"))
    tokens = torch.randint(0, 64, (4 * STEPS, 17), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=4)
    trainer = quiet_trainer(
        accelerator=accelerator, max_steps=STEPS, logger=logger, callbacks=[monitor, references]
    )
    with detector.active():
        trainer.fit(CausalLM(model), loader)
    on_device = all(
        p.device.type == ("cuda" if accelerator == "gpu" else "cpu") for p in model.parameters()
    )
    return {
        "logged": logger.records,
        "weights": references.weights,
        "updates": references.updates,
        "syncs": detector.found,
        "on_device": on_device,
        "targets": [_key(t) for t in find_targets(model)],
    }


def float64_metrics(matrix: torch.Tensor, esd: bool = False) -> dict[str, float]:
    """Stable rank (and ESD α) of a float64 full SVD: the reference."""
    values = metrics_from_spectrum(torch.linalg.svdvals(matrix)[:16], matrix.square().sum())
    out = {"stable_rank": float(values["stable_rank"])}
    if esd:
        out["esd_alpha"] = float(esd_metrics(matrix[None])["esd_alpha"][0])
    return out


def compared(outcome: dict[str, Any], metric: str, references: dict[int, dict[tuple, Any]]) -> list:
    """(step, key, logged, float64) for every per-matrix value of ``metric`` logged.

    Per-expert values are logged as histograms, not scalars: an expert's layer and role have the
    mean, min and max over experts, compared with the reference's over the same experts.
    """
    rows = []
    for step, metrics in outcome["logged"]:
        for tag, value in metrics.items():
            parsed = parse_tag(tag)
            if parsed is None or parsed.metric != metric or parsed.layer is None:
                continue
            at_step = references.get(step)
            if at_step is None:
                continue
            keys = [k for k in at_step if k[0] == parsed.layer and k[1] == parsed.role]
            if not keys:
                continue
            esd = metric == "esd_alpha"
            name = "esd_alpha" if esd else "stable_rank"
            if metric.startswith("update_"):
                values = [_update_stable_rank(at_step[k]) for k in keys]
            else:
                values = [float64_metrics(at_step[k], esd)[name] for k in keys]
            aggregate = getattr(parsed, "aggregate", None) or "mean"
            expected = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
            rows.append((step, (parsed.layer, parsed.role, aggregate), value, expected[aggregate]))
    return rows


def _update_stable_rank(update: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(update)
    return float(singular.square().sum() / singular[0] ** 2)
