"""What the monitor watches in tiny models built by torchtitan, torchtune and litgpt's own config
code (tests/stack_models.py): per stack, roles found / expected, found matrices that are exactly
what the library's forward computes, the largest relative error of a logged stable rank against
float64 along a short fit, and LoRA-style adapters recognised.

"exact" is checked on one recorded forward, independently of how the targets were found:

* every found matrix W (the effective weight for an adapter) reproduces its module's output rows:
  ``y[..., rows] - x W^T`` is the same for every token (a bias at most);
* Q, K, V (and MLA's up-projections) are the rows that land in the query, key and value of the
  layer's attention call (``F.scaled_dot_product_attention``, recorded by a function mode), at
  sequence position 0 where rotary embeddings are the identity (grouped K/V repeated per head);
* O's input is that call's output; the MLP's down projection reads ``act(gate) * up`` (``act(up)``
  without a gate) of the found gate and up; a 3-D expert tensor is run by its module on tokens
  split evenly over the experts and compared with ``down_e(act(gate_e x) * up_e x)`` (to
  bfloat16 precision: torchtitan's grouped experts multiply in bfloat16).

Run: ``python benchmarks/stacks_table.py`` (a few seconds per model, CPU).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from spectral_callbacks.monitor.tracker import SpectralTracker
from spectral_callbacks.names import scalar_tag
from spectral_callbacks.targets import TargetError, find_targets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import smoke  # noqa: E402
from stack_models import BUILDERS, StackModel  # noqa: E402  (the builders the tests use)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class AttentionCalls(TorchFunctionMode):
    """Records the query, key, value and output of every scaled-dot-product attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append(
                {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": out.detach()}
            )
        return out


def _owner(model: nn.Module, target: Any) -> nn.Module:
    """The module whose forward applies the target's matrix: an adapter layer, else the module
    holding the parameter."""
    layer = getattr(target, "layer_module", None)
    if layer is not None:
        return layer
    path = target.parameter_name.rpartition(".")[0]
    return model.get_submodule(path)


def _record(model: nn.Module, forward: Callable, tokens: torch.Tensor, modules: set[nn.Module]):
    seen: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if module not in seen and args and isinstance(output, torch.Tensor):
            seen[module] = (args[0].detach(), output.detach())

    handles = [m.register_forward_hook(hook) for m in modules]
    mode = AttentionCalls()
    try:
        with torch.no_grad(), mode:
            forward(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen, mode.calls


def _close(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> bool:
    """Equal to float32 rounding, relative to ``scale`` (default: the largest entry of ``b``)."""
    scale = max(float(b.abs().max()) if scale is None else scale, 1e-12)
    return a.shape == b.shape and float((a - b).abs().max()) <= 2e-5 * scale


def _module_exact(target: Any, seen: dict, owner: nn.Module) -> bool | None:
    """Whether ``y[..., rows] - x W^T`` is one bias for all tokens (None: the module's forward
    was not recorded, e.g. grouped experts)."""
    if owner not in seen or target.parameter.dim() != 2:
        return None
    x, y = seen[owner]
    weight = target.matrix().detach().double()
    x2 = x.double().reshape(-1, x.shape[-1])
    y2 = y.double().reshape(-1, y.shape[-1])
    rows = target.rows
    out = rows.take(torch.eye(y2.shape[1], dtype=torch.float64))  # selects the rows
    picked = y2 @ out.T
    residual = picked - x2 @ weight.T
    scale = float(picked.abs().max())
    return _close(residual, residual[:1].expand_as(residual), scale)


def _projection_at_zero(target: Any, seen: dict, owner: nn.Module) -> torch.Tensor | None:
    if owner not in seen:
        return None
    x, y = seen[owner]
    x0 = x.double()[:, 0]  # (B, in): position 0, where rotary embeddings are the identity
    weight = target.matrix().detach().double()
    rows = target.rows
    picked = y.double()[:, 0] @ rows.take(torch.eye(y.shape[-1], dtype=torch.float64)).T
    bias = picked - x0 @ weight.T  # the module's own bias rows, if any
    return x0 @ weight.T + bias


def _lands_in(projection: torch.Tensor, call: dict[str, torch.Tensor]) -> set[str]:
    """Which of q, k, v the projection's rows are, per head (a leading slice of each head for
    MLA's K, whose rope part comes from elsewhere), grouped K/V repeated over the heads."""
    found = set()
    for name in ("q", "k", "v"):
        tensor = call[name].double()[:, :, 0]  # (B, H, d)
        heads, width = tensor.shape[1], tensor.shape[2]
        for per_head in {width, projection.shape[1] // heads if heads else 0} | {
            projection.shape[1] // h for h in range(1, heads + 1) if heads % h == 0
        }:
            if per_head <= 0 or per_head > width or projection.shape[1] % per_head:
                continue
            ours = projection.reshape(projection.shape[0], -1, per_head)
            if heads % ours.shape[1]:
                continue
            ours = ours.repeat_interleave(heads // ours.shape[1], dim=1)
            if _close(ours, tensor[..., :per_head]):
                found.add(name)
    return found


def exact_targets(stack: StackModel, targets: list[Any]) -> dict[str, bool]:
    """Target name -> whether it is exactly what the library's forward uses (see the module
    docstring)."""
    model = stack.model
    model.eval()
    owners = {t.name: _owner(model, t) for t in targets}
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    seen, calls = _record(model, stack.forward, tokens, set(owners.values()))
    by_layer: dict[tuple[str, int], dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for t in targets:
        by_layer[(t.stack, t.layer)][t.role].append(t)
    order = sorted({(t.stack, t.layer) for t in targets if t.role in ("Q", "Q_up", "K", "V")})
    call_of = dict(zip(order, calls, strict=False))
    result: dict[str, bool] = {}
    for t in targets:
        owner = owners[t.name]
        ok = _module_exact(t, seen, owner)
        call = call_of.get((t.stack, t.layer))
        if t.role in ("Q", "Q_up", "K", "V"):
            want = {"Q": "q", "Q_up": "q", "K": "k", "V": "v"}[t.role]
            projection = _projection_at_zero(t, seen, owner)
            ok = bool(ok) and call is not None and projection is not None
            ok = ok and _lands_in(projection, call) == {want}
        elif t.role == "O" and call is not None and owner in seen:
            o = call["o"]  # (B, H, T, d)
            reads = o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)
            ok = bool(ok) and _close(seen[owner][0].double(), reads.double())
        elif t.parameter.dim() == 3:  # one expert's slice of a 3-D experts tensor
            ok = _expert_exact(t, by_layer[(t.stack, t.layer)], model)
        result[t.name] = bool(ok)
    for roles in by_layer.values():
        listed = {t.expert for ts in roles.values() for t in ts if t.parameter.dim() == 2}
        for expert in listed:  # None, or each expert that is its own MLP module
            mine = {role: [t for t in ts if t.expert == expert] for role, ts in roles.items()}
            for prefix in ("MLP_", "MLP_shared_"):
                _check_mlp(mine, prefix, seen, owners, result)
    return result


def _check_mlp(roles: dict, prefix: str, seen: dict, owners: dict, result: dict) -> None:
    """``down`` reads ``act(gate) * up`` (or ``act(up)``) of the found gate and up."""
    downs, ups = roles.get(f"{prefix}down", []), roles.get(f"{prefix}up", [])
    gates = roles.get(f"{prefix}gate", [])
    if len(downs) != 1 or len(ups) != 1 or len(gates) > 1:
        return
    down, up = downs[0], ups[0]
    gate = gates[0] if gates else None
    if any(owners[t.name] not in seen for t in (down, up, *([gate] if gate else []))):
        return
    h = seen[owners[down.name]][0].double()
    u = _rows_output(up, seen, owners)
    g = _rows_output(gate, seen, owners) if gate else None
    fits = any(_close(act(g) * u if g is not None else act(u), h) for act in ACTIVATIONS.values())
    for t in (down, up, *([gate] if gate else [])):
        result[t.name] = result[t.name] and fits


def _rows_output(target: Any, seen: dict, owners: dict) -> torch.Tensor:
    y = seen[owners[target.name]][1].double()
    select = target.rows.take(torch.eye(y.shape[-1], dtype=torch.float64))
    return y @ select.T


def _expert_exact(target: Any, roles: dict, model: nn.Module) -> bool:
    """Run the experts module on tokens split evenly over the experts (torchtitan's
    ``GroupedExperts(x, num_tokens_per_expert)``) and compare with the found matrices."""
    module = model.get_submodule(target.parameter_name.rpartition(".")[0])
    experts = target.parameter.shape[0]
    dim = target.shape[1] if target.role != "MLP_down" else target.shape[0]
    per = 3
    x = torch.randn(experts * per, dim, generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            y = module(x, torch.full((experts,), per, dtype=torch.int64)).double()
    except Exception:
        return False
    mats = {
        role: {t.expert: t.matrix().double() for t in ts if t.expert is not None}
        for role, ts in roles.items()
    }
    e = target.expert
    xe = x[e * per : (e + 1) * per].double()
    try:
        gate, up, down = mats["MLP_gate"][e], mats["MLP_up"][e], mats["MLP_down"][e]
    except KeyError:
        return False
    expected = (F.silu(xe @ gate.T) * (xe @ up.T)) @ down.T
    # torchtitan's grouped experts multiply in bfloat16 (grouped_mm): to its precision; a wrong
    # or swapped matrix is off by the size of the output.
    got = y[e * per : (e + 1) * per]
    return float((got - expected).norm()) <= 3e-2 * float(expected.norm())


class Recorder:
    """A writer for SpectralTracker that keeps every logged scalar."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for tag, value in metrics.items():
            self.values[(tag, int(step or 0))] = float(value)


def _stable_rank64(matrix: torch.Tensor) -> float:
    s = torch.linalg.svdvals(matrix.detach().double())
    return float((s**2).sum() / s[0] ** 2)


def fit_error(stack: StackModel, steps: int = 3) -> float:
    """The largest relative error of a logged stable rank against float64, over a short fit."""
    model = stack.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.05)
    recorder = Recorder()
    generator = torch.Generator().manual_seed(3)
    references: dict[tuple[str, int], float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker = SpectralTracker(
            model,
            ("stable_rank",),
            writers=[recorder],
            every_n_steps=1,
            log_spaced_until=0,
            figures=False,
            synchronous=True,
            experts="each",
        )
        targets = tracker.targets
        with tracker:
            for step in range(steps + 1):
                for t in targets:
                    tag = scalar_tag(
                        "stable_rank", t.layer, t.role, t.num_layers, stack=t.stack, expert=t.expert
                    )
                    references[(tag, step)] = _stable_rank64(t.matrix())
                if step == steps:
                    break
                tokens = torch.randint(0, 100, (2, 9), generator=generator)
                logits = stack.forward(tokens[:, :-1])
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                tracker.step(step + 1)
    errors = [
        abs(recorder.values[key] - ref) / ref
        for key, ref in references.items()
        if key in recorder.values
    ]
    missing = [key for key in references if key not in recorder.values]
    if missing or not errors:
        return math.nan
    return max(errors)


def row(name: str, build: Callable[[], StackModel]) -> dict[str, Any]:
    try:
        stack = build()
    except ImportError as error:
        return {"stack": name, "note": f"not installed: {error}"}
    note = ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            targets = list(find_targets(stack.model))
        except TargetError as error:
            targets = []
            note = str(error).splitlines()[0][:90]
    expected = set(stack.expected)
    found = {(t.stack, t.layer, t.role) for t in targets}
    exact = exact_targets(stack, targets) if targets else {}
    adapted = sum(1 for t in targets if getattr(t, "has_update", False) and t.expert is None)
    adapter_layers = len(
        {
            id(getattr(t, "layer_module", None))
            for t in targets
            if getattr(t, "layer_module", None) is not None
        }
    )
    error = fit_error(build()) if targets and not note else math.nan
    warned = sum(
        1 for w in caught if "not watched" in str(w.message) or "lack roles" in str(w.message)
    )
    return {
        "stack": stack.name,
        "roles": f"{len(found & expected)}/{len(expected)}",
        "wrong": len(found - expected),
        "exact": f"{sum(exact.values())}/{len(exact)}",
        "sr_err": error,
        "adapters": f"{adapter_layers}/{stack.adapters}" if stack.adapters else "-",
        "adapted_targets": adapted,
        "warnings": warned,
        "note": note,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", help="builders to run (names in tests/stack_models.py)"
    )
    args = smoke.parse_args(parser, argv, only=list(BUILDERS)[:1])
    torch.manual_seed(0)
    names = args.only or list(BUILDERS)
    header = (
        "stack",
        "roles found/expected",
        "extra",
        "exact/found",
        "max rel err SR",
        "adapters",
        "note",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        r = row(name, BUILDERS[name])
        if "roles" not in r:
            lines.append(f"| {name} | - | - | - | - | - | {r['note']} |")
        else:
            err = "-" if math.isnan(r["sr_err"]) else f"{r['sr_err']:.1e}"
            lines.append(
                f"| {r['stack']} | {r['roles']} | {r['wrong']} | {r['exact']} | {err} | "
                f"{r['adapters']} | {r['note']} |"
            )
        print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
