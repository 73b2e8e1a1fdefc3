"""Peak memory of one call, measured in a fresh subprocess: the process's peak resident set during the call
minus its resident set before it. On Linux the peak (VmHWM) is reset just before the call through
/proc/self/clear_refs; elsewhere the growth of resource.getrusage's ru_maxrss is used (which misses a peak
lower than an earlier one). tracemalloc cannot see torch's allocations; this sees everything the call
touches, its output included. Run as ``python -m bench.peak_memory <name> <V> <d> <K>``; it prints JSON with
peak_growth_bytes (everything, the output included), output_bytes (the returned tensor) and
working_bytes (peak growth minus the output: the memory the method needs beyond what it must return)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def _neighbour_impls():
    import torch

    import lantern
    from lantern import ops

    from .bench_neighbours import cdist_topk

    def fused(codebook, K):
        with lantern.fused("cpu"):
            return ops.latent_neighbours(codebook, K, normalize=False)

    def reference(codebook, K):
        with lantern.fused("reference"):
            return ops.latent_neighbours(codebook, K, normalize=False)

    return torch, {"cdist+topk": cdist_topk, "cpu": fused, "reference": reference}


def measure_in_subprocess(name: str, V: int, d: int, K: int) -> int:
    """Bytes by which the peak RSS grows during one call of ``name`` (see module docstring)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "bench.peak_memory", name, str(V), str(d), str(K)], cwd=root,
                         capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_bytes"])


def main() -> None:
    name, V, d, K = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch, impls = _neighbour_impls()
    codebook = torch.nn.functional.normalize(torch.randn(V, d, generator=torch.Generator().manual_seed(0)), dim=-1)
    impls[name](torch.randn(64, d), 8)  # load kernels and libraries on a tiny case first
    if _reset_peak():
        before = _status_kib("VmRSS")
        out = impls[name](codebook, K)
        growth = _status_kib("VmHWM") - before
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = impls[name](codebook, K)
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    output_bytes = out.numel() * out.element_size()
    print(json.dumps({"peak_growth_bytes": growth * 1024, "output_bytes": output_bytes,
                      "working_bytes": growth * 1024 - output_bytes}))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return _status_kib("VmHWM") >= 0
    except OSError:
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


if __name__ == "__main__":
    main()
