"""What each rank runs for tests/functional/test_sharded_svd.py (spawned processes import this by name).

Every rank builds the same full test matrix from a seed (the test, not the code under test, may
hold it), keeps only its own block, and calls ``sharded_randomized_svd`` on that block alone under
:class:`LargestTensor`, so the test sees the largest tensor the call itself created.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist
from spawn_ranks import LargestTensor

from spectral_callbacks.functional.sharded_svd import ShardedTopSVD, sharded_randomized_svd

K = 16


def power_law(m: int, n: int, a: float, seed: int) -> torch.Tensor:
    """U diag(i^-a) V^T with random orthonormal U, V: singular values known exactly."""
    generator = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(m, r, dtype=torch.float64, generator=generator)).Q
    V = torch.linalg.qr(torch.randn(n, r, dtype=torch.float64, generator=generator)).Q
    S = torch.arange(1, r + 1, dtype=torch.float64) ** -a
    return ((U * S) @ V.T).float()


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5


# name -> (full matrix, split, where rank 0's block ends along the split dim; rank 1 has the rest)
def cases() -> dict[str, tuple[torch.Tensor, str, int]]:
    return {
        "gaussian_rows_uneven": (gaussian(400, 160, seed=1), "rows", 290),
        "gaussian_rows_rank1_empty": (gaussian(300, 128, seed=2), "rows", 300),
        "gaussian_rows_rank0_empty": (gaussian(300, 128, seed=3), "rows", 0),
        "gaussian_columns_uneven": (gaussian(160, 400, seed=4), "columns", 150),
        "wide_rows": (gaussian(200, 480, seed=5), "rows", 70),
        "power_0.5_rows": (power_law(384, 192, 0.5, seed=6), "rows", 100),
        "power_1.0_columns": (power_law(192, 384, 1.0, seed=7), "columns", 250),
        "power_0.2_rows": (power_law(256, 256, 0.2, seed=8), "rows", 128),
        "small_gram": (gaussian(50, 20, seed=9), "rows", 31),
        # A long unsplit side (FSDP2's MLP_down): Rayleigh-Ritz over the whole Krylov basis.
        "long_rows": (gaussian(256, 1536, seed=10), "rows", 100),
        "power_1.0_long_rows": (power_law(256, 1536, 1.0, seed=11), "rows", 160),
        # Rank 40 of 160 (dead input units): the Krylov space runs out inside the basis.
        "dead_inputs_rows": (dead_inputs(gaussian(400, 160, seed=12), 40), "rows", 290),
    }


def dead_inputs(W: torch.Tensor, alive: int) -> torch.Tensor:
    W[:, alive:] = 0
    return W


def block(full: torch.Tensor, split: str, cut: int, rank: int) -> torch.Tensor:
    along = full if split == "rows" else full.T
    part = along[:cut] if rank == 0 else along[cut:]
    return (part if split == "rows" else part.T).contiguous()


def outcome(top: ShardedTopSVD, **extra: Any) -> dict[str, Any]:
    """What a test reads of one call, plus ``extra``."""
    return {"S": top.S, "frobenius_sq": top.frobenius_sq, "sent_bytes": top.sent_bytes, **extra}


def svd_cases(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    for name, (full, split, cut) in cases().items():
        local = block(full, split, cut, rank)
        generator = torch.Generator().manual_seed(1234)
        with LargestTensor() as largest:
            top = sharded_randomized_svd(local, K, group=group, split=split, generator=generator)
        results[name] = outcome(top, V=top.V, largest=largest.numel, local=local.numel())
    # The Krylov blocks in bfloat16 (the engine's default), a flat and a power-law spectrum.
    for name in ("gaussian_rows_uneven", "power_1.0_columns"):
        full, split, cut = cases()[name]
        top = sharded_randomized_svd(
            block(full, split, cut, rank), K, group=group, split=split, comm_dtype=torch.bfloat16
        )
        results[f"{name}_bf16"] = outcome(top)
    # A batch of three matrices, each split unevenly, plus a warm start on a perturbed copy.
    fulls = torch.stack([gaussian(200, 96, seed=20 + i) for i in range(3)])
    local = fulls[:, :130] if rank == 0 else fulls[:, 130:]
    first = sharded_randomized_svd(
        local, K, group=group, generator=torch.Generator().manual_seed(5)
    )
    moved = local + 0.01 * gaussian(*local.shape, seed=99 + rank)
    warm = sharded_randomized_svd(moved, K, group=group, init=first.V)
    results["batch"] = outcome(first, moved=moved)
    results["warm"] = outcome(warm)
    # A warm start that no longer fits (the matrices were replaced): the stopping rule must go on.
    others = torch.stack([gaussian(200, 96, seed=40 + i) for i in range(3)])
    other = others[:, :130] if rank == 0 else others[:, 130:]
    stale = sharded_randomized_svd(other, K, group=group, init=first.V)
    results["stale"] = outcome(stale, full=others)
    # A NaN on rank 1 only: both ranks must report NaN for that matrix and only that one.
    nan = local.clone()
    if rank == 1:
        nan[1, 3, 5] = float("nan")
    poisoned = sharded_randomized_svd(nan, K, group=group)
    results["nan"] = outcome(poisoned)
    return results


def missing_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 never calls: rank 0's call must fail once the group's timeout passes, not hang."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        time.sleep(8)
        return {}
    start = time.monotonic()
    try:
        sharded_randomized_svd(gaussian(64, 32, seed=0), 4, group=group)
    except Exception as error:  # noqa: BLE001 - the test checks what came out
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}
