"""Median time of the cpu tree_attention kernel at LlamaGen-XL's verification shape (B = 1, H = Hkv = 20,
T = 59 in a chain, Dh = 64, prefix L = 256 and 1024), one thread, for comparing two builds of lantern._C
(which cannot load into one process): run it alternately with each checkout first on PYTHONPATH, e.g.

    for i in 1 2 3 4; do
      PYTHONPATH=/path/to/old/python python tools/time_tree_attention_cpu.py old
      PYTHONPATH=/path/to/new/python python tools/time_tree_attention_cpu.py new
    done

and compare the fastest median of each (the machine's load moves single runs by up to 2x)."""
from __future__ import annotations

import statistics
import sys
import time

import torch


def main(label: str) -> None:
    import lantern
    from lantern.ops import tree_attention_op

    cpu_kernel = tree_attention_op.OP.caller("cpu")

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    B, H, T, Dh = 1, 20, 59, 64
    medians = {}
    for L in (256, 1024):
        q = torch.randn(B, H, T, Dh, generator=g)
        k, v = torch.randn(B, H, L + T, Dh, generator=g), torch.randn(B, H, L + T, Dh, generator=g)
        cache_len, parents = torch.tensor([L]), torch.tensor([[-1] + list(range(T - 1))])
        mask = lantern.ops.ancestor_mask(parents)
        for _ in range(3):
            cpu_kernel(q, k, v, cache_len, mask)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            cpu_kernel(q, k, v, cache_len, mask)
            times.append(time.perf_counter() - start)
        medians[L] = statistics.median(times) * 1e3
    print(label, " ".join(f"L={L}: {t:.3f} ms" for L, t in medians.items()), f"({lantern.__file__})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
