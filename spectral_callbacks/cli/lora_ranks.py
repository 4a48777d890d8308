"""``spectral-callbacks rank-layers RUN --lora``: the LoRA rank each adapted module needs.

For each adapted module of a run (a PEFT LoRA fine-tune watched by the monitor), at the latest step
that logged its update: the energy rank of ΔW = s·B·A at 90 % (``update_energy_rank_90``) and at
``--energy``, the r it has, the r it needs (that rank rounded up to a power of two or a multiple of
``--round-to``, never above r) and the parameters that saves, then a ``rank_pattern`` and an
``alpha_pattern`` for ``peft.LoraConfig``, printed ready to paste: each alpha keeps the module's
scaling s under the run's own rule (s = lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA: the
target map's ``scaling_rule``, read from PEFT's ``use_rslora``). A run still training gives its
newest step. See ``spectral_callbacks.offline.ranking.lora_ranks``.

At a threshold other than 90 % the run's four logged singular values (``update_sv_1..4``) and
‖ΔW‖_F give the rank where they reach it; beyond them it is an upper bound (the 90 % rank for a
lower threshold, r for a higher one), marked ``≤``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from spectral_callbacks.cli.common import CommandError, read_whole, say
from spectral_callbacks.functional.metrics import UPDATE_TOP
from spectral_callbacks.messages import count
from spectral_callbacks.names import TARGET_MAP_TAG, parse_target_map

_KEYS = ["stack", "layer", "role"]


def run(args: argparse.Namespace) -> int:
    from spectral_callbacks.offline.ranking import lora_patterns, lora_ranks

    energy = args.energy
    if not 0 < energy <= 1:
        raise CommandError(f"`--energy` must be a fraction in (0, 1], got {energy!r}")
    step = args.round_to
    if step is not None and step < 1:
        raise CommandError(f"`--round-to` must be a positive int, got {step!r}")
    rows, where = adapted_rows(args.source, energy)
    modules = lora_ranks(rows, step)
    ranks, alphas = lora_patterns(modules)
    print_lora(modules, f"{args.source}: LoRA ranks ({where})", energy)
    print("rank_pattern = " + json.dumps(ranks, indent=1))
    print("alpha_pattern = " + json.dumps(alphas, indent=1))
    rules = sorted(set(modules["scaling_rule"]) - {""})
    if rules:
        say("rank-layers", "note", f"alpha_pattern keeps each module's scaling under the run's "
            f"rule ({', '.join(rules)}): paste it into a LoraConfig with the same use_rslora")  # fmt: skip
    if (modules["scaling_rule"] == "").any():
        say("rank-layers", "note", "the run's target map does not say whether its scaling is "
            "lora_alpha / r or lora_alpha / sqrt(r) (rsLoRA) for some modules: their alphas keep "
            "s = lora_alpha / r; under rsLoRA multiply each by 1 / sqrt(its suggested r)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "source": args.source,
                    "where": where,
                    "energy": energy,
                    "round_to": step,
                    "modules": modules.to_dict(orient="records"),
                    "rank_pattern": ranks,
                    "alpha_pattern": alphas,
                },
                indent=1,
                default=float,
            )
        )
    if args.csv:
        modules.to_csv(args.csv, index=False)
    saved = int(modules["params_saved"].sum())
    total = int((modules["r"] * modules["shape"].map(_side_sum)).sum())
    say("rank-layers", "done", f"{count(len(modules), 'adapted module')}; the suggested ranks keep "
        f"{total - saved:,} of {total:,} adapter parameters ({saved:,} saved)")  # fmt: skip
    return 0


def adapted_rows(source: str, energy: float) -> tuple[pd.DataFrame, str]:
    """One row per adapted matrix at the run's latest step with its update logged (see
    :func:`spectral_callbacks.offline.ranking.lora_ranks`), and where it came from."""
    from spectral_callbacks.offline.events import find_runs, read_texts

    runs, _ = find_runs([source]) if Path(source).is_dir() else ([], [])
    if len(runs) != 1:
        raise CommandError(
            f"{source}: --lora reads one run's directory (the log directory a LoRA fine-tune "
            f"watched by the monitor wrote), found {len(runs)} runs"
        )
    rows = read_whole("rank-layers", source, "no rank was suggested").rows
    texts = [entry for path in runs[0].files for entry in read_texts(path, TARGET_MAP_TAG)]
    targets = pd.DataFrame(parse_target_map(texts[-1][1])) if texts else pd.DataFrame()
    if targets.empty or not (targets["r"] != "").any():
        raise CommandError(
            f"{source}: the run has no adapted matrix in its {TARGET_MAP_TAG} entry (written when a "
            "run begins); --lora reads a PEFT LoRA fine-tune watched by the monitor"
        )
    targets = targets[targets["r"] != ""]
    metrics = ["update_energy_rank_90", "update_frobenius_norm"]
    metrics += [f"update_sv_{i}" for i in range(1, UPDATE_TOP + 1)]
    rows = rows[rows["metric"].isin(metrics) & rows["layer"].notna()]
    logged = rows[rows["metric"] == "update_energy_rank_90"].dropna(subset=["value"])
    if logged.empty:
        raise CommandError(
            f"{source}: the run logged no finite update_energy_rank_90 yet (ΔW = 0 before the "
            "first step); read it again after some steps"
        )
    step = int(logged["step"].max())
    latest = rows[rows["step"] == step].assign(stack=lambda r: r["stack"].fillna(""))
    wide = latest.pivot_table(index=_KEYS, columns="metric", values="value", aggfunc="last")
    wide = wide.reset_index()
    wide["layer"] = wide["layer"].astype(int)
    targets = targets.assign(
        layer=targets["layer"].astype(int),
        out=targets["shape"].map(lambda s: int(s.split("x")[0])),
        **{"in": targets["shape"].map(lambda s: int(s.split("x")[1]))},
        r=targets["r"].astype(int),
        scaling=pd.to_numeric(targets["scaling"], errors="coerce"),
        scaling_rule=targets["scaling_rule"].fillna(""),
    )
    merged = targets.merge(wide, on=_KEYS, how="inner")
    ranked = [_energy_rank(row, energy) for row in merged.itertuples(index=False)]
    merged["energy_rank_90"] = merged["update_energy_rank_90"]
    merged["energy_rank"] = [rank for rank, _ in ranked]
    merged["bound"] = [bound for _, bound in ranked]
    return merged, f"logged at step {step}"


def _energy_rank(row: Any, energy: float) -> tuple[float, bool]:
    """The energy rank at ``energy`` of one matrix's update, and whether it is only a bound."""
    from spectral_callbacks.offline.ranking import energy_rank_from_top

    at_90 = float(row.update_energy_rank_90)
    if math.isclose(energy, 0.9):
        return at_90, False
    top = [float(getattr(row, f"update_sv_{i}", math.nan)) for i in range(1, UPDATE_TOP + 1)]
    rank, _ = energy_rank_from_top(top, float(row.update_frobenius_norm), energy)
    if rank is not None:
        return float(rank), False
    return (at_90 if energy < 0.9 else float(row.r)), True


def _side_sum(shape: str) -> int:
    out, inp = shape.split("x")
    return int(out) + int(inp)


def print_lora(modules: pd.DataFrame, title: str, energy: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    at = f"{100 * energy:g} %"
    other = not math.isclose(energy, 0.9)  # a second threshold: its own column
    longest = max((len(name) for name in modules["module"]), default=6)
    table.add_column("module", min_width=longest, no_wrap=True)  # the name PEFT matches: whole
    table.add_column("roles")
    for column in ("shape", "r", "ΔW rank 90 %", *((f"ΔW rank {at}",) if other else ()),
                   "suggested r", "saved"):  # fmt: skip
        table.add_column(column, justify="right")
    for m in modules.itertuples(index=False):
        needed = ("≤" if m.bound else "") + _int(m.energy_rank)
        table.add_row(m.module, m.roles, m.shape, str(m.r), _int(m.energy_rank_90),
                      *((needed,) if other else ()), str(m.suggested_r),
                      f"{m.params_saved:,}")  # fmt: skip
    console = Console()
    if not console.is_terminal:  # a pipe or a file: wide enough for whole module names
        console.width = max(console.width, longest + 80)
    console.print(table)


def _int(value: float) -> str:
    return "-" if value != value else str(int(value))
