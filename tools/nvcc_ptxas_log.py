"""nvcc, keeping ptxas's resource report of each compiled .cu in build/ptxas/<stem>.log.

setup.py points torch's ninja build at this script (PYTORCH_NVCC) when it builds the CUDA kernels, so the
report of exactly the code in lantern._C exists without compiling anything twice; tests/ops/test_cuda_build.py
reads it (no register spills) next to cuobjdump's view of the built extension. It runs the real nvcc
(LANTERN_REAL_NVCC, else $CUDA_HOME/bin/nvcc) with ``-Xptxas -v`` added, writes the report next to the names
of the source and object, passes nvcc's other output through and exits with nvcc's status. A failed compile
leaves no report (and removes an old one)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ptxas -v lines (kept in the log, not repeated in the build's output); warnings and errors pass through
_REPORT_LINE = re.compile(r"^(ptxas info\s*:|\s+\d+ bytes stack frame)")


def real_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.environ.get("LANTERN_REAL_NVCC") or os.path.join(cuda_home, "bin", "nvcc")


def log_dir() -> str:
    return os.environ.get("LANTERN_PTXAS_LOG_DIR") or os.path.join(ROOT, "build", "ptxas")


def _value_after(args: List[str], flag: str) -> Optional[str]:
    return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None


def main(args: List[str]) -> int:
    sources = [a for a in args if a.endswith(".cu")]  # torch's command has "-c -c <file>.cu"
    if "-c" not in args or len(sources) != 1:  # not a compile of one .cu: plain nvcc
        return subprocess.call([real_nvcc(), *args])
    source, obj = sources[0], _value_after(args, "-o")
    log = os.path.join(log_dir(), os.path.splitext(os.path.basename(source))[0] + ".log")
    if os.path.exists(log):
        os.remove(log)
    run = subprocess.run([real_nvcc(), *args, "-Xptxas", "-v"], stderr=subprocess.PIPE, text=True)
    passed = run.stderr if run.returncode else "".join(
        line for line in run.stderr.splitlines(keepends=True) if not _REPORT_LINE.match(line))
    sys.stderr.write(passed)
    if run.returncode == 0:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        tmp = f"{log}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"# source: {os.path.abspath(source)}\n# object: {os.path.abspath(obj or '')}\n{run.stderr}")
        os.replace(tmp, log)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
