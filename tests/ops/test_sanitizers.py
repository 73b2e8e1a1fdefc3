"""Compile csrc/tests/sanitize_main.cpp (the torch-free CPU kernels on adversarial inputs) with
AddressSanitizer + UndefinedBehaviorSanitizer and run it: any out-of-bounds access, undefined behaviour or
out-of-range output fails the test. Needs g++ (skipped, with the reason, when it is missing)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "csrc", "tests", "sanitize_main.cpp")
COMMON = ["-std=c++17", "-g", "-fno-omit-frame-pointer", "-ffp-contract=off", "-fno-sanitize-recover=all"]
FLAGS = {
    # ASan turns the AVX-512 / AVX2 clones off (csrc/include/lantern/cpu/clones.h): baseline code paths
    "asan+ubsan": ["-O1", "-fsanitize=address,undefined,float-cast-overflow"],
    # UBSan alone keeps the clones, so the vector code paths this machine picks are checked too
    "ubsan-clones": ["-O2", "-fsanitize=undefined,float-cast-overflow"],
}


@pytest.mark.parametrize("variant", sorted(FLAGS))
def test_kernels_under_sanitizers(tmp_path, variant):
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx!r} not found): cannot build the sanitizer test")
    binary = str(tmp_path / "sanitize_main")
    build = subprocess.run([cxx, *COMMON, *FLAGS[variant], "-I", os.path.join(ROOT, "csrc", "include"), SOURCE,
                            "-o", binary], capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "sanitize" in build.stderr and "unrecognized" in build.stderr:
        pytest.skip(f"{cxx} does not support the sanitizers: {build.stderr[-500:]}")
    assert build.returncode == 0, build.stderr[-4000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([binary], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and "sanitize_main: OK" in run.stdout, (run.stdout[-2000:], run.stderr[-4000:])
