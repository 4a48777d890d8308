"""Run a function on N local processes joined by a gloo process group, with a hard time limit.

``run_session(command, timeout)`` runs a launcher (Lightning re-running a script per rank,
``torchrun``) in a session of its own, so a timeout kills every rank it started.

``run_ranks(function, world_size, tmp_path, *args)`` spawns ``world_size`` processes (fresh
interpreters, ``spawn``), joins them with ``init_process_group("gloo")`` over a file store
(``backend="nccl"``: rank r's GPU r made current first), calls
``function(rank, world_size, *args)`` in each and returns every rank's return value (which must be
picklable by ``torch.save``). A rank that raises fails the test with its traceback; ranks that are
not done after ``timeout`` seconds are killed and the test fails: a test never hangs.
``function`` must live in an importable module (spawn imports it by name).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

TIMEOUT_SECONDS = 180.0


def backend_params(gloo: tuple[int, ...], nccl: tuple[int, ...] = (2, 4)) -> list[Any]:
    """``pytest.param((backend, world_size))`` for each process count: gloo ones run here, NCCL
    ones are ``gpu``-marked and skipped where fewer GPUs than ranks are present."""
    gloo_params = [pytest.param(("gloo", n), id=f"gloo-{n}") for n in gloo]
    nccl_params = [
        pytest.param(
            ("nccl", n),
            id=f"nccl-{n}",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs"),
            ],
        )
        for n in nccl
    ]
    return gloo_params + nccl_params


def _leaves(value: Any) -> Iterator[Any]:
    """The non-container values inside nested tuples, lists and dicts (a torch function's args)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


class LargestTensor(torch.overrides.TorchFunctionMode):
    """Records the largest tensor any torch function creates while active (this thread only).

    Views of an argument (``to_local()``, ``t()``, slices) allocate nothing and are not counted.
    ``numel`` is the largest element count; ``matrix_numel`` the largest ``rows x columns`` of one
    matrix of any tensor (its last two dimensions), which is what "never a full matrix" is about.
    """

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0
        self.matrix_numel = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(value) for value in _leaves((args, kwargs))}
        for value in out if isinstance(out, tuple) else (out,):
            if not isinstance(value, torch.Tensor) or _storage(value) in inputs:
                continue
            if isinstance(value, DTensor):  # its shape is global; only the local block exists
                value = value.to_local()
            self.numel = max(self.numel, value.numel())
            matrix = value.shape[-2] * value.shape[-1] if value.ndim >= 2 else value.numel()
            self.matrix_numel = max(self.matrix_numel, matrix)
        return out


def _storage(value: Any) -> int | None:
    if isinstance(value, DTensor):
        value = value.to_local()
    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        return None
    return value.untyped_storage().data_ptr()


def _entry(
    rank: int,
    world_size: int,
    store: str,
    outdir: str,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str,
) -> None:
    torch.set_num_threads(1)  # the ranks share a small machine
    path = Path(outdir) / f"rank{rank}.pt"
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        try:
            result = function(rank, world_size, *args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        torch.save({"result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        torch.save({"error": traceback.format_exc()}, path)
    # Skip interpreter teardown: a daemon worker thread blocked in gloo must not delay the exit.
    os._exit(0)


def run_ranks(
    function: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = TIMEOUT_SECONDS,
    allow_errors: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Every rank's return value (or, with ``allow_errors``, its traceback string)."""
    outdir = tmp_path / f"ranks-{time.monotonic_ns()}"
    outdir.mkdir()
    store = outdir / "store"
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_entry,
            args=(rank, world_size, str(store), str(outdir), function, args, backend),
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    if hung:
        pytest.fail(f"ranks {hung} of {function.__name__} did not finish within {timeout} s")
    results = []
    for rank in range(world_size):
        path = outdir / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} of {function.__name__} died without a result")
        saved = torch.load(path, weights_only=False)
        if "error" in saved and not allow_errors:
            pytest.fail(f"rank {rank} of {function.__name__} raised:\n{saved['error']}")
        results.append(saved.get("result", saved.get("error")))
    return results


def run_session(
    command: list[str], timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` in its own session (stdout and stderr together); on timeout kill the whole
    process group (every rank it launched) and fail the test."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command[:4])} hung for {timeout} s:\n{output[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # ranks left after rank 0 returned
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)
