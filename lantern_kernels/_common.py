"""Helpers shared by the Triton kernels of this package (host side only)."""
from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True under Triton's interpreter (TRITON_INTERPRET=1): kernels run on CPU tensors, one program at a
    time in Python, so the autotuners get a single cheap configuration and tiles are chosen for few steps."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(gpu_configs, interpreter_config):
    """The autotune list: every configuration on a GPU, one under the interpreter (nothing to tune there)."""
    return [interpreter_config] if interpreting() else list(gpu_configs)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
