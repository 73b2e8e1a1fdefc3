"""The CUDA verify kernel's headers (csrc/include/lantern/cuda/verify.cuh, target.cuh, block.cuh, radix.h) run
on the host under a SIMT emulator (csrc/tests/cuda_emulation/include/simt_emu.h: a block's CUDA threads as
fibers in one OS thread, barriers for __syncthreads and the warp shuffles, a deadlock aborts the run) and
compared with the CPU kernel they port, row by row (csrc/tests/verify_cuda_emulated.cpp). This checks the
kernel's control flow, indexing and arithmetic without a GPU, once plainly and once under AddressSanitizer +
UndefinedBehaviorSanitizer (no out-of-bounds access on valid or invalid rows); it cannot check the GPU memory
model or CUDA's own exp / log1pf (see tests/ops/test_verify.py for the GPU tests). Needs g++ with C++20
(skipped, with the reason, without)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "csrc", "tests", "verify_cuda_emulated.cpp")
INCLUDES = ["-I", os.path.join(ROOT, "csrc", "tests", "cuda_emulation", "include"),
            "-I", os.path.join(ROOT, "csrc", "include")]
VARIANTS = {  # flags, (walk cases, target cases)
    "plain": (["-O1"], ("24", "60")),
    "asan+ubsan": (["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"], ("8", "16")),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cuda_verify_kernel_matches_the_cpu_kernel_under_emulation(tmp_path, variant):
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx!r} not found)")
    flags, counts = VARIANTS[variant]
    binary = str(tmp_path / "verify_cuda_emulated")
    build = subprocess.run([cxx, "-std=c++20", "-pthread", "-ffp-contract=off", *flags, *INCLUDES, SOURCE,
                            "-o", binary], capture_output=True, text=True, timeout=900)
    if build.returncode != 0 and "c++20" in build.stderr:
        pytest.skip(f"{cxx} lacks C++20: {build.stderr[-500:]}")
    if build.returncode != 0 and "sanitize" in build.stderr and "unrecognized" in build.stderr:
        pytest.skip(f"{cxx} does not support the sanitizers: {build.stderr[-500:]}")
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([binary, *counts], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, ASAN_OPTIONS="detect_leaks=1", UBSAN_OPTIONS="print_stacktrace=1"))
    print(run.stdout[-3000:])
    assert run.returncode == 0 and "verify_cuda_emulated: OK" in run.stdout, (run.stdout[-3000:], run.stderr[-4000:])
