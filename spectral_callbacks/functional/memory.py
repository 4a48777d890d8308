"""How many bytes ``randomized_svd`` and the metrics allocate on a batch: an upper bound from shapes.

The snapshot budget (``monitor/engines/budget.py``) is kept from this count, never by asking the device or
the allocator, so it must bound what every path of ``randomized_svd`` can allocate at once, the
rare ones included. Per matrix of the batch, with ``s = min(m, n)``, ``L = max(m, n)``, ``e`` the
bytes of the compute dtype (4, or 8 for float64 input), ``w = k + n_oversamples`` (capped at ``s``)
and ``D`` the deepest Krylov depth (the cold depth plus the stopping rule's extra blocks)::

    randomized    e·3L·w·(D + 2)     the basis, its images and the left images, every block kept
                  + 2·m·n            W rounded to bfloat16 (a cold start on a CPU with AMX tiles)
                  + e·s²             the explicit Gram matrix, where it is cheaper than products
                  + 8·m·n            on CUDA (float32): W's TF32 head and tail during a product
    exact Gram    e·5·s²             G, eigh's copy of it, its workspace (2 s²) and the vectors
                                     (float32 for float32 input; float64 otherwise, formed by
                                     chunks so W is never converted whole)
    svdvals       2·e·m·n + e·s²     the finite-masked copy, LAPACK's own copy, its workspace
    ‖W‖_F²        8·m·n, or up to    one matrix in float64 (an adapted layer's base row norms),
                  32 MiB for a batch  or a dense batch's float64 slices of rows
    ESD (when on) 8·m·n + 8·4·s²     W in float64, its Gram matrix, the masked copy, eigvalsh;
                  + 96 MiB once      and the KS-distance tables, three chunks of 2^22 float64

Every path the method choice can take for the batch counts (``auto``: the cold and the warm
choice, and on the CPU both candidates its calibration times), all matrices of the batch at once. Beyond them, the float64 redo of a matrix float32
could not read (``_exact_where_float32_falls_short``) runs one matrix at a time after the batch's
temporaries are freed: ``8·5·s² + 8·GRAM_CHUNK_ROWS·L`` once, not per matrix.

Example::

    >>> import torch
    >>> svd_working_bytes(5632, 2048, 1, torch.float32) / 2**20  # the float64 redo bounds one matrix
    171.0
    >>> svd_working_bytes(5632, 2048, 4, torch.float32) / 2**20  # four: their exact Gram paths
    320.0
"""

from __future__ import annotations

import torch

from spectral_callbacks.functional.exact import GRAM_CHUNK_ROWS
from spectral_callbacks.functional.method_choice import choose_method
from spectral_callbacks.functional.metrics import _FLOAT64_CHUNK_ELEMENTS as FLOAT64_CHUNK_ELEMENTS
from spectral_callbacks.functional.svd import (
    _EXPECTED_WARM_DEPTH,
    _EXTRA_DEPTH,
    DEFAULT_K,
    DEFAULT_N_OVERSAMPLES,
    _first_test,
    default_n_iter,
)


def svd_working_bytes(
    m: int,
    n: int,
    batch: int,
    dtype: torch.dtype,
    *,
    k: int = DEFAULT_K,
    n_oversamples: int = DEFAULT_N_OVERSAMPLES,
    n_iter: int | None = None,
    method: str = "auto",
    device_type: str = "cpu",
    esd: bool = False,
) -> int:
    """Upper bound of the bytes ``randomized_svd`` plus the metrics allocate on a ``(batch, m, n)``
    input of ``dtype`` (already float32 or float64: the conversion is the caller's).

    Args:
        m, n: the matrices' shape.
        batch: matrices decomposed together.
        dtype: the input's dtype (float64 computes in float64, anything else in float32).
        k, n_oversamples, n_iter, method: as passed to ``randomized_svd``.
        device_type: ``"cpu"`` or an accelerator's type (the method choice and ‖W‖_F differ).
        esd: the ESD family is computed too (``esd_metrics``: every eigenvalue, in float64).
    """
    e = 8 if dtype == torch.float64 else 4
    compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s, large = min(m, n), max(m, n)
    width = min(k + n_oversamples, s)
    cold = default_n_iter(m, n) if n_iter is None else n_iter
    depth = cold + _EXTRA_DEPTH
    if method == "auto":
        methods = {
            choose_method(
                m,
                n,
                width,
                cold,
                compute_dtype,
                device_type,
                True,
                batch,
                _first_test(n_iter, False),
            ),
            choose_method(
                m, n, width, _EXPECTED_WARM_DEPTH, compute_dtype, device_type, False, batch
            ),
        }
        if device_type == "cpu":  # the first call of a kind times both (MethodCalibration)
            methods |= {"randomized", "gram"}
    else:
        methods = {method}
    # On CUDA, float32 products with W under TF32 (precision.matmul) hold W's TF32 head and tail,
    # two float32 copies, while they run; counted whether or not TF32 is on now (the user may
    # turn it on later).
    split = 8 * m * n if device_type == "cuda" and e == 4 else 0
    per_matrix = {
        "randomized": e * 3 * large * width * (depth + 2) + 2 * m * n + e * s * s + split,
        "gram": e * 5 * s * s,
        "svdvals": 2 * e * m * n + e * s * s,
    }
    per_matrix["subspace"] = per_matrix["randomized"]
    paths = max(per_matrix[name] for name in methods)
    # ‖W‖_F² runs (and frees its temporaries) before the SVD; counted everywhere, since on the CPU
    # it is the rare overflow's float64 pass.
    frobenius = max(8 * m * n, min(8 * batch * m * n, 8 * FLOAT64_CHUNK_ELEMENTS))
    redo = 8 * 5 * s * s + 8 * GRAM_CHUNK_ROWS * large  # one matrix at a time, afterwards
    steps = max(batch * paths, frobenius, redo)
    if esd:  # after the SVD's temporaries are freed
        steps = max(steps, batch * (8 * m * n + 8 * 4 * s * s) + 3 * 8 * FLOAT64_CHUNK_ELEMENTS)
    return steps


def subspace_bytes(m: int, n: int, batch: int, dtype: torch.dtype, *, width: int) -> int:
    """Bytes of the right subspaces a warm start keeps between snapshots: ``(batch, n, width)``."""
    e = 8 if dtype == torch.float64 else 4
    return e * batch * n * min(width, m, n)
