"""torchtitan's tiny models (tests/stack_models.py) with the attention torchtitan's own helper
gives a language model: what holds on the CPU with its FlexAttention.

torchtitan 0.3.0's ``get_attention_config`` refuses ``"sdpa"`` for language models; its default
is ``"flex"`` (``FlexAttention``: a compiled ``flex_attention`` that needs ``positions`` and
``model.get_attention_masks(positions)``). stacks_table.py builds the same models with
torchtitan's ``ScaledDotProductAttention`` inner attention instead; this script builds them with
``get_attention_config("flex")`` and reports, per model: whether a forward runs with and without
gradients, the roles the names find, the found matrices that reproduce their module's output
(``y[..., rows] - x W^T`` one bias for every token, as stacks_table.py checks), what
``find_targets(example_input=...)`` reads from the forward, and whether ``SpectralTracker``'s
recorded first forward runs.

Run: ``python benchmarks/titan_flex.py`` (CPU; the first forward compiles flex_attention, tens of
seconds); ``--smoke``: the first model only.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import stack_models  # noqa: E402
import stacks_table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402

from spectral_callbacks.monitor.tracker import SpectralTracker  # noqa: E402
from spectral_callbacks.targets import find_targets  # noqa: E402

MODELS = ("torchtitan llama3 fused", "torchtitan llama3 unfused", "torchtitan deepseek-v3")


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def _attempt(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what happens is the measurement
        return _first_line(error)
    return "runs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = smoke.parse_args(parser, argv, models=list(MODELS)[:1])
    import torchtitan.models.common.attention as attention
    from torchtitan.models.common.config_utils import get_attention_config

    print(f"get_attention_config('sdpa'): {_attempt(lambda: get_attention_config('sdpa'))}")
    # The builders of stack_models.py, given the inner attention torchtitan's helper gives.
    attention.ScaledDotProductAttention.Config = lambda: get_attention_config("flex")  # type: ignore[assignment, method-assign]
    for name in args.models:
        stack = stack_models.BUILDERS[name]()
        model = stack.model
        tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(8).repeat(2, 1)
        masks = model.get_attention_masks(positions)
        example = (tokens, positions, masks)
        start = time.perf_counter()
        with torch.no_grad():
            model(*example)
        compiled = time.perf_counter() - start
        with_grad = _attempt(lambda model=model, example=example: model(*example))
        targets = list(find_targets(model))
        found = {(t.stack, t.layer, t.role) for t in targets}
        owners = {t.name: stacks_table._owner(model, t) for t in targets}

        def forward(tokens: torch.Tensor, model=model, example=example) -> torch.Tensor:
            return model(tokens, *example[1:])

        seen, calls = stacks_table._record(model, forward, tokens, set(owners.values()))
        exact = [stacks_table._module_exact(t, seen, owners[t.name]) for t in targets]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flow = _attempt(
                lambda model=model, example=example: find_targets(model, example_input=example)
            )
        followed = [str(w.message) for w in caught if "could not be followed" in str(w.message)]

        def recorded(model=model, example=example) -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tracker = SpectralTracker(model, ("stable_rank",), writers=[stacks_table.Recorder()],
                                          figures=False, synchronous=True)  # fmt: skip
                try:
                    with torch.no_grad():
                        model(*example)  # the first training forward, recorded for the roles
                finally:
                    tracker.close()

        print(f"== {name} (FlexAttention)")
        print(
            f"   forward without grad: runs (first call {compiled:.1f} s, compiling); with grad: {with_grad}"
        )
        print(f"   roles found by the names: {len(found & set(stack.expected))}/{len(stack.expected)}"
              f" (+{len(found - set(stack.expected))} not expected)")  # fmt: skip
        print(f"   module output = x W^T + b: {sum(1 for e in exact if e)}/"
              f"{sum(1 for e in exact if e is not None)} recorded; "
              f"F.scaled_dot_product_attention calls seen: {len(calls)}")  # fmt: skip
        print(f"   find_targets(example_input=): {flow}"
              + (f"; {followed[0][:110]}" if followed else ""))  # fmt: skip
        print(f"   SpectralTracker's recorded first forward: {_attempt(recorded)}")


if __name__ == "__main__":
    main()
