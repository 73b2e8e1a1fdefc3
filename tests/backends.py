"""The backends every op test runs on, whether each is usable here, and the device its tensors live on.

- reference, cpu: CPU tensors;
- cuda: "cuda" tensors (marked gpu; skipped, with the reason, without a device or without CUDA kernels in
  lantern._C);
- triton: "cuda" tensors when a GPU exists, else CPU tensors under Triton's interpreter (tests/conftest.py
  sets TRITON_INTERPRET=1). The interpreter runs each program in Python, so tests give an interpreted
  backend smaller cases (``interpreted``).
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import pytest
import torch

NAMES = ("reference", "cpu", "cuda", "triton")
FUSED = ("cpu", "cuda", "triton")


def kernel(backend: str, op: str):
    """The function with ``op``'s public signature that runs ``backend``'s kernel directly (no checks, no
    dispatch): ``lantern.ops.library.OPS[op].caller(backend)``."""
    from lantern.ops.library import OPS

    return OPS[op].caller(backend)


def why_unavailable(name: str) -> Optional[str]:
    """None when ``lantern.fused(name)`` can run here, else the backend's own reason."""
    import lantern

    lantern._backend._load_backends()
    return lantern._backend._why_unavailable(name)


def cuda_kernel_marks(op: str) -> list:
    """pytestmark for a file of CUDA-kernel tests of ``lantern::<op>``: gpu, and a skip with the reason
    when there is no device or lantern._C has no CUDA kernel for the op."""
    why = why_unavailable("cuda")
    if why is None and not torch._C._dispatch_has_kernel_for_dispatch_key(f"lantern::{op}", "CUDA"):
        why = f"lantern._C was built without the CUDA {op} kernel"
    return [pytest.mark.gpu, pytest.mark.skipif(why is not None, reason=str(why))]


def on_gpu(name: str) -> bool:
    """Whether the backend's tensors live on a CUDA device."""
    return name == "cuda" or (name == "triton" and torch.cuda.is_available())


def interpreted(name: str) -> bool:
    """Whether the backend runs under Triton's interpreter (slow: small cases only)."""
    return name == "triton" and not torch.cuda.is_available()


def device_for(name: str) -> torch.device:
    return torch.device("cuda" if on_gpu(name) else "cpu")


def marks(name: str) -> list:
    """gpu when the backend runs on a CUDA device; a skip with the reason when it cannot run here."""
    found = [pytest.mark.gpu] if name == "cuda" or on_gpu(name) else []
    why = why_unavailable(name)
    if why is not None:
        found.append(pytest.mark.skipif(True, reason=f"backend {name!r} is unavailable: {why}"))
    return found


def params(names: Iterable[str] = NAMES) -> list:
    """pytest params for a ``backend`` argument (the fixture in tests/ops/conftest.py, or indirect=True)."""
    return [pytest.param(name, marks=marks(name), id=name) for name in names]


def case_params(names: Sequence[str], cases: Sequence, small_cases: Optional[Sequence] = None, ids=None,
                small_ids=None) -> list:
    """pytest params (backend, case) for ``parametrize("backend,case", ..., indirect=["backend"])``: each
    backend in ``names`` with ``cases``, an interpreted backend with ``small_cases`` instead (when given).
    ``ids``: one string per case."""
    ids = ids or [str(i) for i in range(len(cases))]
    out = []
    for name in names:
        chosen, chosen_ids = (small_cases, small_ids or [f"small{i}" for i in range(len(small_cases))]) \
            if small_cases is not None and interpreted(name) else (cases, ids)
        out += [pytest.param(name, case, marks=marks(name), id=f"{name}-{case_id}")
                for case, case_id in zip(chosen, chosen_ids)]
    return out


def compiled(names: Iterable[str] = FUSED) -> list:
    """The backends among ``names`` that do not run under the interpreter (for cases too large for it)."""
    return [name for name in names if not interpreted(name)]


def usable(names: Iterable[str] = NAMES) -> list:
    """The backends among ``names`` that can run here (for tests that loop over backends themselves)."""
    return [name for name in names if why_unavailable(name) is None]
