"""Compile Triton kernels for an H100 (sm_90) without a GPU: a script run in a subprocess without
TRITON_INTERPRET (the interpreter accepts code the compiler rejects, and never compiles device helpers)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_compile_script(script: str, timeout: int) -> str:
    """The script's stdout; skips when triton's ptxas is missing, fails with its stderr on any other error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("triton's ptxas is not available on this machine")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
